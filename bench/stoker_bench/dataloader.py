"""The PyTorch DataLoader cell: a map-style dataset of small files (`Dataset.loader`: issue 33's 2,000 samples of ~110 KB
at the default scale, 20 to a class directory) read by a DataLoader with 8 worker processes in shuffled order, one
sample per file (samples/s), every sample checked against the object's bytes. A mount is read
with plain file I/O in each worker; s3torchconnector through its own S3MapDataset, as its users read S3.

Needs PyTorch (and s3torchconnector for its cell): neither is a dependency of Stoker or of the test suite (`pip install
torch s3torchconnector`; a CPU build of torch is enough). Without them the cell says so and the rest of the bench runs.

With `--gpu-rate N` the loop that takes the batches stands in for a training loop on one GPU that consumes N samples/s:
it holds each batch of `--gpu-batch` samples for batch / N seconds (a step that syncs, as `loss.item()` does, before it
takes the next batch) and reports the share of the epoch's wall time that GPU would have been busy. The GPU is
simulated (SimulatedGpu: a clock and a sleep); nothing runs on a real one.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable, Iterable

from .systems import Unavailable
from .workloads import Outcome, _verify

WORKERS = 8
NEEDS_TORCH = "needs PyTorch (pip install torch; a CPU build is enough)"


def missing() -> str | None:
    """Why the cell cannot run here (PyTorch is not installed), or None. Asked before any mount starts."""
    return None if importlib.util.find_spec("torch") is not None else NEEDS_TORCH


def _torch():
    try:
        import torch
        import torch.utils.data
    except ImportError:
        raise Unavailable(NEEDS_TORCH) from None
    return torch


class MountFiles:
    """Files under a mount point, by index: (key, bytes) per sample. (A torch Dataset needs no base class.)"""

    def __init__(self, root: str, items: list[tuple[str, int]]):
        self.root, self.items = root, items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[str, bytes]:
        key = self.items[index][0]
        with open(os.path.join(self.root, key), "rb", buffering=0) as f:
            return key, f.read()


def as_list(batch: list) -> list:
    """The DataLoader's collate_fn with --gpu-rate: a batch stays a list of (key, bytes) (module level: workers
    pickle it)."""
    return batch


class SimulatedGpu:
    """One GPU that computes `rate` samples/s: `hold(n)` returns after n / rate seconds and counts them as busy.

    `clock` and `sleep` are time.monotonic and time.sleep unless a test passes a fake pair. A hold never returns
    before its time is up (a sleep that wakes early sleeps again), so busy time never exceeds the wall time that
    contains it."""

    def __init__(self, rate: float, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        if rate <= 0:
            raise ValueError(f"a GPU rate must be positive, not {rate}")
        self.rate, self.clock, self.sleep = rate, clock, sleep
        self.busy = 0.0
        self.batches = 0

    def hold(self, samples: int) -> None:
        seconds = samples / self.rate
        until = self.clock() + seconds
        while (left := until - self.clock()) > 0:
            self.sleep(left)
        self.busy += seconds
        self.batches += 1


def busy_fraction(busy: float, wall: float) -> float:
    """The share of an epoch's wall time the GPU computed: busy / wall (0 for an epoch that took no time)."""
    return min(1.0, busy / wall) if wall > 0 else 0.0


def read_epoch(batches: Iterable[list[tuple[str, bytes]]], sizes: dict[str, int], *, gpu: SimulatedGpu | None = None,
               batch_size: int | None = None, clock: Callable[[], float] = time.monotonic) -> Outcome:
    """The training loop: takes each batch of (key, bytes) samples from `batches` (a DataLoader, or any iterable in a
    test), checks every sample, and hands the batch to `gpu` if there is one. The epoch's wall time starts before the
    first batch is asked for (a DataLoader starts its workers then) and ends after the last batch's hold."""
    started = clock()
    samples = nbytes = wrong = 0
    for batch in batches:
        for key, data in batch:
            samples += 1
            nbytes += len(data)
            wrong += len(data) != sizes.get(key) or not _verify(key, 0, bytes(data))
        if gpu is not None:
            gpu.hold(len(batch))
    seconds = clock() - started
    outcome = Outcome(bytes=nbytes, files=samples, seconds=seconds, wrong=wrong + (samples != len(sizes)))
    if gpu is not None:
        outcome.extra["simulated_gpu"] = {
            "rate_samples_per_s": gpu.rate, "batch": batch_size, "batches": gpu.batches,
            "busy_s": round(gpu.busy, 3), "wall_s": round(seconds, 3),
            "busy_fraction": round(busy_fraction(gpu.busy, seconds), 4)}
    return outcome


def dataloader_epoch(system, d, run: int, *, gpu_rate: float | None = None, gpu_batch: int = 32) -> Outcome:
    """One epoch over the samples (shuffled with the run's seed) through a DataLoader of WORKERS processes: one sample
    at a time, or batches of `gpu_batch` held by a SimulatedGpu of `gpu_rate` samples/s."""
    torch = _torch()
    items = d.loader
    dataset = system.dataset(items) if not system.is_mount else MountFiles(system.mountpoint, items)
    generator = torch.Generator().manual_seed(run)
    if gpu_rate is None:
        loader = torch.utils.data.DataLoader(dataset, batch_size=None, shuffle=True, num_workers=WORKERS,
                                             generator=generator)
        return read_epoch(([sample] for sample in loader), dict(items))
    loader = torch.utils.data.DataLoader(dataset, batch_size=gpu_batch, shuffle=True, num_workers=WORKERS,
                                         generator=generator, collate_fn=as_list)
    return read_epoch(loader, dict(items), gpu=SimulatedGpu(gpu_rate), batch_size=gpu_batch)
