"""The PyTorch DataLoader cell: which systems run it, s3torchconnector's refusal where it is missing, and (where
PyTorch is installed: it is no dependency of Stoker or its tests) one epoch through a real Stoker mount, every sample
checked."""

import sys

import pytest

from stoker_bench.runner import _runs, run_all
from stoker_bench.systems import Boto3Baseline, S3TorchConnector, Stoker, Unavailable
from tests.conftest import requires_fuse


def test_each_system_runs_the_cells_it_can():
    assert _runs(Stoker, "dataloader") and _runs(Stoker, "small")
    assert _runs(S3TorchConnector, "dataloader") and not _runs(S3TorchConnector, "small")
    assert not _runs(Boto3Baseline, "dataloader") and _runs(Boto3Baseline, "small")


def test_s3torchconnector_where_it_is_missing_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "s3torchconnector", None)  # an import of it fails, as where it is not installed
    with pytest.raises(Unavailable, match="pip install torch s3torchconnector"):
        S3TorchConnector("http://127.0.0.1:1", "bench", str(tmp_path), 0).start()


@pytest.mark.integration
@requires_fuse
def test_a_dataloader_epoch_through_a_mount_reads_every_sample_exactly(tmp_path):
    pytest.importorskip("torch")
    cells, _ = run_all(scale=0.02, systems=["stoker"], workloads=["dataloader"], workdir=str(tmp_path),
                       latency=0.002, bandwidth=0, cache_bytes=256 * 2**20, log=lambda line: None)
    assert [(c.run, c.unit, c.wrong) for c in cells] == [("cold", "samples/s", 0), ("warm", "samples/s", 0)], cells
    assert all(c.value and c.requests is not None for c in cells)
    assert cells[0].requests > 0  # the cold epoch reached the store
