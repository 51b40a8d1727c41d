"""Polling helpers shared by the integration tests."""

from __future__ import annotations

import time

from fusecore.mounts import is_mounted, mount_entries, unmount


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
    """Tear down what a test left mounted below `root`: binds first (deepest paths), then FUSE mounts."""
    points = {point for point, _ in mount_entries() if point.startswith(str(root))}
    for point in sorted(points, key=len, reverse=True):
        if is_mounted(point):
            unmount(point)
