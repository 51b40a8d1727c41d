"""The checkpoint cell (`ckpt`, issue 46): `torch.save` of a state dict of ~`Dataset.write_size` bytes, timed to the end
of its close, every byte checked by the store.

A mount gets `torch.save(state, path)` into the mountpoint, as a training script writes a checkpoint; s3torchconnector
gets what its users write, `torch.save` into `S3Checkpoint.writer(uri)` (a multipart upload on the CRT). The same
state dict serialises to different bytes through a path (the archive is named after the file) and through a write-only
stream, so the bytes each system should have sent are serialised the same way locally first, and the store's digest
of what it received (objectstore.py: a written object that is not generated content keeps its SHA-256) must match.

Needs PyTorch (and s3torchconnector for its cell), as the DataLoader cell does; without them the cell says so.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from typing import Any, cast

from .dataloader import NEEDS_TORCH, missing
from .systems import Unavailable
from .workloads import Dataset, Outcome

TENSORS = 32  # a state dict of this many equal float32 tensors (a model's layers)
_states: dict[int, object] = {}


def _state(size: int):
    """A state dict of about `size` bytes, random values (made once per size: a second run saves the same one)."""
    if size not in _states:
        try:
            import torch
        except ImportError:
            raise Unavailable(NEEDS_TORCH) from None
        g = torch.Generator().manual_seed(46)
        _states.clear()
        _states[size] = {f"layers.{i}.weight": torch.randn(max(1, size // 4 // TENSORS), generator=g)
                         for i in range(TENSORS)}
    return _states[size]


class _Digest:
    """A write-only stream that keeps the SHA-256 of what is written (what an S3 writer sends)."""

    def __init__(self):
        self.sha, self.size = hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += len(data)
        return len(data)

    def flush(self) -> None:
        return None


def _expected_through_path(state, name: str) -> tuple[str, int]:
    """What `torch.save(state, .../name)` writes (saved to a local folder under the same name)."""
    import torch

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, name)
        torch.save(state, path)
        sha = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(8 << 20):
                sha.update(chunk)
        return sha.hexdigest(), os.path.getsize(path)


def _expected_through_stream(state) -> tuple[str, int]:
    import torch

    sink = _Digest()
    torch.save(state, cast(Any, sink))  # (torch.save takes any object with write)
    return sink.sha.hexdigest(), sink.size


def checkpoint(system, d: Dataset, run: int) -> Outcome:
    """One `torch.save` of a state dict of ~d.write_size bytes, to the end of its close (MB/s)."""
    why = missing()
    if why:
        raise Unavailable(why)
    import torch

    key = f"out/{system.name}/run{run}/checkpoint.pt"
    aside = time.process_time()  # (this process's CPU outside the save: not the system's, for a client in it)
    state = _state(d.write_size)
    if system.is_mount:
        digest, size = _expected_through_path(state, os.path.basename(key))
        path = os.path.join(system.mountpoint, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        aside = time.process_time() - aside
        started = time.monotonic()
        torch.save(state, path)
    else:
        digest, size = _expected_through_stream(state)
        aside = time.process_time() - aside
        started = time.monotonic()
        system.save_checkpoint(key, state)
    seconds = time.monotonic() - started
    got = system.store_written().get(f"bench/{key}")
    right = got is not None and got.get("size") == size and got.get("sha256") == digest
    return Outcome(bytes=size, files=1, seconds=seconds, wrong=0 if right else 1,
                   extra={"cpu_outside_s": 0.0 if system.is_mount else round(aside, 3)})
