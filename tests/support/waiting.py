"""Polling helpers shared by the integration tests."""

from __future__ import annotations

from fusecore.mounts import mount_entries, unmount_stack
from stoker_bench.fixture import wait_for  # noqa: F401 - the tests' polling helper


def unmount_everything_under(root: str) -> None:
    """Tear down what a test left mounted below `root` (every layer), deepest paths first."""
    points = {point for point, _ in mount_entries() if point.startswith(str(root))}
    for point in sorted(points, key=len, reverse=True):
        unmount_stack(point)
