"""Polling helpers shared by the integration tests, and the data-path tests' wait on a trio loop."""

from __future__ import annotations

from typing import Callable, TypeVar

import trio

from fusecore.process.mounts import mount_entries, unmount_stack
from stoker_bench.fixture import wait_for  # noqa: F401 - the tests' polling helper

T = TypeVar("T")
HANG = 30.0  # seconds after which a wait on an event is taken for a hang (never a measure of speed)


async def until(predicate: Callable[[], T], timeout: float = HANG) -> T:
    """On a trio loop: wait until `predicate()` is truthy (its value is returned), looking again each
    millisecond while the other tasks run. It waits on the condition, not on time: a loaded machine only
    waits longer; after `timeout` seconds the wait fails with AssertionError."""
    with trio.move_on_after(timeout):
        while not (value := predicate()):
            await trio.sleep(0.001)
        return value
    raise AssertionError(f"still not true after {timeout:g}s: {predicate.__doc__ or predicate}")


def unmount_everything_under(root: str) -> None:
    """Tear down what a test left mounted below `root` (every layer), deepest paths first."""
    points = {point for point, _ in mount_entries() if point.startswith(str(root))}
    for point in sorted(points, key=len, reverse=True):
        unmount_stack(point)
