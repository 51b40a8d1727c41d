"""The benchmark harness at a tiny scale: a real run through Stoker and boto3 yields a well-formed
table and JSON (no speed is asserted)."""

import importlib.util
import json
import os

import pytest

from stoker_bench.report import draw_chart, markdown, write
from stoker_bench.runner import Cell, run_all
from stoker_bench.targets import evaluate
from stoker_bench.workloads import Dataset, WORKLOADS
from tests.conftest import requires_fuse

pytestmark = pytest.mark.integration


def test_dataset_scales():
    small, big = Dataset.build(0.02), Dataset.build(1.0)
    assert sum(s for _, s in small.seq) < sum(s for _, s in big.seq)
    assert big.seq[0][1] >= 1024**3
    assert abs(sum(s for _, s in big.epoch) / big.epoch_cache - 1.5) < 0.01


def test_report_marks_missing_peers_and_ratios():
    cells = [Cell("seq1", "stoker", "cold", value=300.0, unit="MB/s"),
             Cell("seq1", "s3fs", "cold", value=100.0, unit="MB/s"),
             Cell("seq1", "rclone", "cold", note="cannot run: rclone is not installed")]
    info = {"latency_s": 0.02, "bandwidth_Bps": 16e6, "scale": 1, "cache_bytes": 2**30,
            "epoch_cache_bytes": 2**29, "store_ceiling_MBps": 1000}
    text = markdown(cells, info, evaluate(cells, info))
    assert "3.00×" in text and "cannot run: rclone is not installed" in text


def test_targets_are_the_data_path_issue_s():
    """One reader against the bare client of the same run (not s3fs), shards against s3fs, CPU per GiB
    against s3fs; each said met or MISSED with its figures."""
    def cells(seq: float, seq_cpu: float, shards: float) -> list[Cell]:
        return [Cell("seq1", "stoker", "cold", value=seq, unit="MB/s", cpu_s_per_gib=seq_cpu),
                Cell("seq1", "s3fs", "cold", value=300.0, unit="MB/s", cpu_s_per_gib=1.6),
                Cell("shards", "stoker", "cold", value=shards, unit="MB/s"),
                Cell("shards", "s3fs", "cold", value=140.0, unit="MB/s")]
    info = {"cache_bytes": 2**30, "epoch_cache_bytes": 2**29, "python_client_ceiling_MBps": 470.0}
    met = evaluate(cells(430.0, 1.5, 430.0), info)
    assert "large sequential, 1 reader >= 90% of the bare Python client: met (91% of 470 MB/s)" in met
    assert "large sequential CPU-s per GiB <= s3fs: met (1.50 vs 1.60)" in met
    assert "64 MiB shards, 4 readers >= 3x s3fs: met (3.07x)" in met
    missed = evaluate(cells(400.0, 1.7, 400.0), info)
    assert "large sequential, 1 reader >= 90% of the bare Python client: MISSED (85% of 470 MB/s)" in missed
    assert "large sequential CPU-s per GiB <= s3fs: MISSED (1.70 vs 1.60)" in missed
    assert "64 MiB shards, 4 readers >= 3x s3fs: MISSED (2.86x)" in missed
    assert not any("bare Python client" in t for t in evaluate(cells(430.0, 1.5, 430.0), {**info, "python_client_ceiling_MBps": None}))


def test_zero_measurements_make_no_ratio_not_a_crash():
    """`stoker bench --scale 0.05` measured a time to first byte of 0 ms (and a peer may measure 0)."""
    cells = [Cell("ttfb", "stoker", "cold", value=0.0, unit="ms"), Cell("ttfb", "s3fs", "cold", value=4.0, unit="ms"),
             Cell("seq1", "stoker", "cold", value=300.0, unit="MB/s"),
             Cell("seq1", "s3fs", "cold", value=0.0, unit="MB/s"),
             Cell("small", "stoker", "cold", value=10.0, unit="files/s"),
             Cell("small", "s3fs", "cold", value=0.0, unit="files/s")]
    info = {"latency_s": 0.02, "bandwidth_Bps": 16e6, "scale": 0.05, "cache_bytes": 2**30,
            "epoch_cache_bytes": 2**29, "store_ceiling_MBps": 1000}
    text = markdown(cells, info, evaluate(cells, info))
    assert "no ratio" in text


# The DataLoader and checkpoint cells need PyTorch, which neither Stoker nor its tests depend on
# (tests/bench/test_dataloader.py, test_checkpoint.py)
TESTED = [w for w in WORKLOADS if w not in ("dataloader", "ckpt") or importlib.util.find_spec("torch") is not None]


@requires_fuse
def test_a_tiny_run_produces_table_json_and_chart(tmp_path):
    cells, info = run_all(scale=0.02, systems=["stoker", "boto3"], workloads=TESTED, workdir=str(tmp_path),
                          latency=0.002, bandwidth=0, cache_bytes=256 * 2**20, log=lambda line: None)
    assert {c.workload for c in cells} == set(TESTED)
    assert all(c.wrong == 0 for c in cells), [c for c in cells if c.wrong]
    stoker = [c for c in cells if c.system == "stoker"]
    assert len(stoker) == 2 * len(TESTED) and all(c.value is not None for c in stoker), stoker
    assert all(c.peak_rss_mib and c.idle_rss_mib for c in stoker)
    assert all(c.requests > 0 for c in stoker if c.run == "cold"), "a cold run reaches the store"
    bigdir = next(c for c in stoker if c.workload == "bigdir" and c.run == "cold")
    assert bigdir.unit == "s" and bigdir.extra["list_s"] <= bigdir.value and bigdir.wrong == 0
    paths = write(str(tmp_path / "out"), cells, info, evaluate(cells, info))
    table = open(paths["markdown"]).read()
    assert "Idle RSS before a cold run" in table
    assert table.count("\n| ") >= len(TESTED) * 2
    data = json.load(open(paths["json"]))
    assert len(data["cells"]) == len(cells)
    png, problem = draw_chart(str(tmp_path / "out"), cells)
    if importlib.util.find_spec("matplotlib") is not None:
        assert problem == "" and os.path.getsize(png) > 1000


def test_engine_comparison_fetches_and_checks_the_same_ranges(tmp_path):
    """`stoker bench --engines` at a tiny size: every GET of each shape done, bytes checked, CPU measured."""
    from stoker_bench import engines

    rows = engines.run(str(tmp_path), engines=["stoker"], large_mib=8, small=6, latency=0.001, bandwidth=0,
                       log=lambda line: None)
    assert [(r.shape, r.requests) for r in rows] == [("4 MiB ranges", 2), ("small objects", 6)]
    assert all(not r.note and r.wrong == 0 and r.mb_per_s > 0 and r.cpu_ms_per_get >= 0 for r in rows)
    assert "| small objects | stoker | 8 | 6 |" in engines.table(rows)


def test_the_disk_cell_runs_a_mount_of_workers_without_and_with_its_disk_tier():
    from stoker_bench.systems import disk_variants

    plain, with_disk = disk_variants("stoker-w2")
    assert (plain.name, with_disk.name) == ("stoker-w2", "stoker-w2-disk")
    started: list[tuple[str, ...]] = []
    system = with_disk.__new__(with_disk)
    system.extra_args, system.cache_bytes = (), 64 * 1024 * 1024
    system.cache_folder = lambda: "/tmp/disk"
    import stoker_bench.systems as systems

    original = systems.Stoker.start
    systems.Stoker.start = lambda self: started.append(self.extra_args)
    try:
        system.start()
    finally:
        systems.Stoker.start = original
    (args,) = started
    assert args[args.index("--workers") + 1] == "2" and args[args.index("--disk-cache-size") + 1] == str(1024**3)
