"""`stoker` console entry point: dispatches to the commands each component contributes.

The mount's own commands (mount, unmount, stats, warm, peers, drop) import fusecore alone: the CSI driver,
the operator and the bench load grpc and the kubernetes client (about 0.9 s of imports here), which
`stoker unmount` or `stoker stats` has no use for. Every other command, and `--help`, builds the whole parser.
"""

from __future__ import annotations

import argparse
import sys

from fusecore import __version__
from fusecore.process import cli as fusecore_cli

MOUNT_COMMANDS = frozenset({"mount", "unmount", "stats", "warm", "peers", "drop", "serve-mount"})


def _parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    parser = argparse.ArgumentParser(prog="stoker", description="Keep GPUs fed from S3-compatible object storage.")
    parser.add_argument("--version", action="version", version=f"stoker {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    fusecore_cli.add_commands(sub)
    return parser, sub


def build_parser() -> argparse.ArgumentParser:
    from csi import server as csi_server
    from stoker_bench import cli as bench_cli
    from stoker_operator import agent as warm_agent
    from stoker_operator import cli as operator_cli

    from . import demo

    parser, sub = _parser()
    demo.add_command(sub)
    csi_server.add_commands(sub, extensions=[warm_agent.WarmAgentExtension()])
    operator_cli.add_command(sub)
    bench_cli.add_command(sub)  # matplotlib (the bench extra) is imported only to draw the chart
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()[0] if argv and argv[0] in MOUNT_COMMANDS else build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
