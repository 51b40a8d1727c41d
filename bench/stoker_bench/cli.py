"""`stoker bench` (filled in by the benchmark issue)."""

import argparse


def add_command(sub: argparse._SubParsersAction) -> None:
    return None
