"""Polling helpers shared by the integration tests."""

from __future__ import annotations

import time

from fusecore.mounts import mount_entries, unmount_stack


def wait_for(predicate, timeout: float, interval: float = 0.1):
    """Poll `predicate` until it returns something truthy (returned) or `timeout` passes (last value)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def unmount_everything_under(root: str) -> None:
    """Tear down what a test left mounted below `root` (every layer), deepest paths first."""
    points = {point for point, _ in mount_entries() if point.startswith(str(root))}
    for point in sorted(points, key=len, reverse=True):
        unmount_stack(point)
