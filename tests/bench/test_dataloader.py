"""The PyTorch DataLoader cell: which systems run it, s3torchconnector's refusal where it is missing, the cell's note
without PyTorch, the simulated GPU of --gpu-rate on a fake clock, and (where PyTorch is installed: it is no dependency
of Stoker or its tests) one epoch through a real Stoker mount, every sample checked."""

import os
import sys

import pytest

from stoker_bench.dataloader import SimulatedGpu, busy_fraction, read_epoch
from stoker_bench.objectstore import expected_bytes
from stoker_bench.runner import _run_workload, _runs, run_all
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


class FakeClock:
    """Time that moves only when the loop waits for a batch (`loader`) or the simulated GPU sleeps."""

    def __init__(self, early: float = 0.0):
        self.now, self.early, self.sleeps = 0.0, early, 0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now += seconds * (1 - self.early) if seconds > 1e-3 else seconds  # wakes early, then on time

    def loader(self, batches, waits):
        for batch, wait in zip(batches, waits):
            self.now += wait
            yield batch


def samples(n: int, start: int = 0) -> list[tuple[str, bytes]]:
    keys = [f"loader/train/{i % 100:03d}/img-{i:06d}.jpg" for i in range(start, start + n)]
    return [(key, expected_bytes(key, 0, 100 + i)) for i, key in enumerate(keys)]


def test_the_simulated_gpu_is_busy_for_its_held_time_over_the_epoch_s_wall_time():
    """100 samples/s, batches of 10, 10, 5: held 0.1, 0.1, 0.05 s. The loader's first batch comes after 0.3 s (its
    workers start), the others 0.05 s after the loop asks: the epoch takes 0.3 + 0.1 + 0.05 + 0.1 + 0.05 + 0.05."""
    batches = [samples(10), samples(10, 10), samples(5, 20)]
    sizes = {key: len(data) for batch in batches for key, data in batch}
    clock = FakeClock(early=0.5)  # a sleep that wakes early is slept again: a hold is never short
    gpu = SimulatedGpu(100, clock=clock, sleep=clock.sleep)
    outcome = read_epoch(clock.loader(batches, [0.3, 0.05, 0.05]), sizes, gpu=gpu, batch_size=10, clock=clock)
    assert (outcome.files, outcome.wrong, outcome.seconds) == (25, 0, pytest.approx(0.65))
    assert outcome.extra["simulated_gpu"] == {"rate_samples_per_s": 100, "batch": 10, "batches": 3, "busy_s": 0.25,
                                              "wall_s": 0.65, "busy_fraction": round(0.25 / 0.65, 4)}
    assert clock.sleeps > 3
    assert busy_fraction(0.25, 0.65) == pytest.approx(0.3846, abs=1e-4) and busy_fraction(1.0, 0.0) == 0.0


def test_a_loader_faster_than_the_gpu_keeps_it_busy_and_wrong_bytes_are_counted():
    batches = [samples(4), samples(4, 4)]
    sizes = {key: len(data) for batch in batches for key, data in batch}
    batches[1][0] = (batches[1][0][0], b"x" * len(batches[1][0][1]))
    clock = FakeClock()
    outcome = read_epoch(clock.loader(batches, [0.0, 0.0]), sizes, gpu=SimulatedGpu(8, clock=clock, sleep=clock.sleep),
                         batch_size=4, clock=clock)
    assert outcome.extra["simulated_gpu"]["busy_fraction"] == 1.0 and outcome.wrong == 1
    assert "simulated_gpu" not in read_epoch(batches, sizes).extra  # without --gpu-rate, no GPU and no figure


def test_the_simulated_gpu_holds_on_the_real_clock():
    batches = [samples(5), samples(5, 5), samples(2, 10)]
    outcome = read_epoch(batches, {k: len(v) for b in batches for k, v in b}, gpu=SimulatedGpu(2000), batch_size=5)
    sim = outcome.extra["simulated_gpu"]
    assert sim["busy_s"] == 0.006 and sim["batches"] == 3 and outcome.seconds >= 0.006
    assert 0 < sim["busy_fraction"] <= 1


def test_without_pytorch_the_cell_is_a_note_and_starts_no_system(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch", None)  # as where PyTorch is not installed
    cells, lines = [], []
    _run_workload(None, "dataloader", ["stoker", "boto3", "s3torch"], None, str(tmp_path), 0, cells, lines.append,
                  kernel_cache=True)
    assert [(c.system, c.run, c.value, c.note) for c in cells] == [
        (s, r, None, "cannot run: needs PyTorch (pip install torch; a CPU build is enough)")
        for s in ("stoker", "s3torch") for r in ("cold", "warm")]
    assert len(lines) == 2 and not os.listdir(tmp_path)  # one line per system; no mount was made


@pytest.mark.integration
@requires_fuse
def test_a_dataloader_epoch_with_a_simulated_gpu(tmp_path):
    pytest.importorskip("torch")
    cells, info = run_all(scale=0.02, systems=["stoker"], workloads=["dataloader"], workdir=str(tmp_path),
                          latency=0.002, bandwidth=0, cache_bytes=256 * 2**20, log=lambda line: None,
                          gpu_rate=20000, gpu_batch=16)
    assert info["simulated_gpu"] == {"rate_samples_per_s": 20000, "batch": 16}
    assert all(c.wrong == 0 and 0 < c.extra["simulated_gpu"]["busy_fraction"] <= 1 for c in cells), cells
    assert cells[0].extra["simulated_gpu"]["busy_s"] == round(200 / 20000, 3)
