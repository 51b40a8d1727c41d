"""The checkpoint cell (`ckpt`): which systems run it, its note without PyTorch, and (where PyTorch is installed: it is
no dependency of Stoker or its tests) one torch.save through a real writable Stoker mount, its bytes checked by the
store."""

import os
import sys

import pytest

from stoker_bench.runner import _run_workload, _runs, run_all
from stoker_bench.systems import Boto3Baseline, S3TorchConnector, Stoker
from tests.conftest import requires_fuse


def test_a_mount_and_s3torchconnector_save_checkpoints_and_boto3_does_not():
    assert _runs(Stoker, "ckpt") and _runs(S3TorchConnector, "ckpt")
    assert not _runs(Boto3Baseline, "ckpt")


def test_without_pytorch_the_cell_is_a_note_and_starts_no_system(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch", None)  # as where PyTorch is not installed
    cells, lines = [], []
    _run_workload(None, "ckpt", ["stoker", "boto3", "s3torch"], None, str(tmp_path), 0, cells, lines.append,
                  kernel_cache=True)
    assert [(c.system, c.value, c.note) for c in cells] == [
        (s, None, "cannot run: needs PyTorch (pip install torch; a CPU build is enough)")
        for s in ("stoker", "stoker", "s3torch", "s3torch")]
    assert not os.listdir(tmp_path)  # no mount was made


@pytest.mark.integration
@requires_fuse
def test_a_checkpoint_saved_into_a_mount_is_every_byte_torch_wrote(tmp_path):
    pytest.importorskip("torch")
    cells, _ = run_all(scale=0.02, systems=["stoker"], workloads=["ckpt"], workdir=str(tmp_path),
                       latency=0.002, bandwidth=0, cache_bytes=256 * 2**20, log=lambda line: None)
    assert [(c.run, c.unit, c.wrong) for c in cells] == [("cold", "MB/s", 0), ("warm", "MB/s", 0)], cells
    assert all(c.value and c.bytes > 16 * 2**20 for c in cells)
