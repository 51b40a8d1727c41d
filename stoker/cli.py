"""`stoker` console entry point: dispatches to the commands each component contributes."""

from __future__ import annotations

import argparse
import sys

from csi import server as csi_server
from fusecore import __version__
from fusecore import cli as fusecore_cli
from stoker_bench import cli as bench_cli
from stoker_operator import agent as warm_agent
from stoker_operator import cli as operator_cli

from . import demo


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stoker", description="Keep GPUs fed from S3-compatible object storage.")
    parser.add_argument("--version", action="version", version=f"stoker {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    fusecore_cli.add_commands(sub)
    demo.add_command(sub)
    csi_server.add_commands(sub, extensions=[warm_agent.WarmAgentExtension()])
    operator_cli.add_command(sub)
    bench_cli.add_command(sub)  # matplotlib (the bench extra) is imported only to draw the chart
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
