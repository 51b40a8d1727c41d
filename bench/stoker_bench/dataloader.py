"""The PyTorch DataLoader cell: a map-style dataset of small files (`Dataset.loader`: issue 33's 2,000 samples of ~110 KB
at the default scale, 20 to a class directory) read by a DataLoader with 8 worker processes in shuffled order, one
sample per file (samples/s), every sample checked against the object's bytes. A mount is read
with plain file I/O in each worker; s3torchconnector through its own S3MapDataset, as its users read S3.

Needs PyTorch (and s3torchconnector for its cell): neither is a dependency of Stoker or of the test suite (`pip install
torch s3torchconnector`; a CPU build of torch is enough). Without them the cell says so and the rest of the bench runs.
"""

from __future__ import annotations

import os
import time

from .workloads import Outcome, _verify

WORKERS = 8


def _torch():
    try:
        import torch
        import torch.utils.data
    except ImportError:
        raise RuntimeError("needs PyTorch (pip install torch; a CPU build is enough)") from None
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


def dataloader_epoch(system, d, run: int) -> Outcome:
    """One epoch over the samples (shuffled with the run's seed) through a DataLoader of WORKERS processes."""
    torch = _torch()
    items = d.loader
    dataset = system.dataset(items) if not system.is_mount else MountFiles(system.mountpoint, items)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, shuffle=True, num_workers=WORKERS,
                                         generator=torch.Generator().manual_seed(run))
    sizes = dict(items)
    started = time.monotonic()
    samples = nbytes = wrong = 0
    for key, data in loader:
        samples += 1
        nbytes += len(data)
        wrong += len(data) != sizes.get(key) or not _verify(key, 0, bytes(data))
    return Outcome(bytes=nbytes, files=samples, seconds=time.monotonic() - started,
                   wrong=wrong + (samples != len(items)))
