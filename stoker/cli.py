"""`stoker` console entry point: dispatches to the commands each component contributes."""

from __future__ import annotations

import argparse
import sys

from fusecore import __version__
from fusecore import cli as fusecore_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stoker", description="Keep GPUs fed from S3-compatible object storage.")
    parser.add_argument("--version", action="version", version=f"stoker {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    fusecore_cli.add_commands(sub)
    from . import demo

    demo.add_command(sub)
    try:
        from csi import server as csi_server
    except ImportError:  # grpcio missing in a trimmed install
        csi_server = None
    if csi_server is not None:
        csi_parser = csi_server.add_commands(sub)
        try:
            from stoker_operator import agent as warm_agent, cli as operator_cli
        except ImportError:  # kopf/kubernetes missing in a trimmed install
            warm_agent = operator_cli = None
        if operator_cli is not None:
            warm_agent.extend_csi(csi_parser)
            operator_cli.add_command(sub)
    try:
        from stoker_bench import cli as bench_cli
    except ImportError:  # the benchmark ships in the same package; tolerate trimmed installs
        bench_cli = None
    if bench_cli is not None:
        bench_cli.add_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
