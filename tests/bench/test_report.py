"""`stoker bench` never loses its results (issue 44): the JSON and table are written before the chart; the chart leaves
out cells with no value (a peer that cannot run, a 0 ms time) and names them; a chart that fails all the same is a
message, and a run that stops early writes the cells it measured. No mount, no store: the run itself is faked."""

import argparse
import json
import os

import pytest

from stoker_bench import cli, report
from stoker_bench.report import draw_chart, markdown
from stoker_bench.runner import Cell

INFO = {"latency_s": 0.02, "bandwidth_Bps": 16e6, "scale": 0.05, "cache_bytes": 2**30, "epoch_cache_bytes": 2**29,
        "store_ceiling_MBps": 1000, "python_client_ceiling_MBps": 400.0}
NO_TORCH = "cannot run: needs PyTorch (pip install torch; a CPU build is enough)"


def cells_of_a_run_without_torch() -> list[Cell]:
    """seq1 measured; dataloader without a single value (no PyTorch); ttfb only zeros (a tiny run)."""
    return [Cell("seq1", "stoker", "cold", value=300.0, unit="MB/s"), Cell("seq1", "stoker", "warm", value=2000.0),
            Cell("seq1", "s3fs", "cold", value=100.0, unit="MB/s"), Cell("seq1", "s3fs", "warm", value=0.0),
            Cell("seq1", "boto3", "cold", value=20.0, unit="MB/s"),
            Cell("dataloader", "stoker", "cold", note=NO_TORCH), Cell("dataloader", "stoker", "warm", note=NO_TORCH),
            Cell("dataloader", "s3torch", "cold", note=NO_TORCH), Cell("dataloader", "s3torch", "warm", note=NO_TORCH),
            Cell("ttfb", "stoker", "cold", value=0.0, unit="ms"), Cell("ttfb", "stoker", "warm", value=0.0, unit="ms"),
            Cell("ttfb", "s3fs", "cold", value=0.0, unit="ms"), Cell("ttfb", "s3fs", "warm", value=0.0, unit="ms")]


def test_the_chart_leaves_out_cells_with_no_value_and_names_them(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    labels: list[str] = []
    real = matplotlib.axes.Axes.set_xlabel
    monkeypatch.setattr(matplotlib.axes.Axes, "set_xlabel",
                        lambda ax, text, *a, **kw: (labels.append(text), real(ax, text, *a, **kw))[1])
    path, problem = draw_chart(str(tmp_path), cells_of_a_run_without_torch())
    assert problem == "" and path == str(tmp_path / "results.png")
    assert os.path.getsize(path) > 1000
    assert labels == ["no value (see table): s3fs warm",
                      "no value (see table): stoker cold, stoker warm, s3torch cold, s3torch warm",
                      "no value (see table): stoker cold, stoker warm, s3fs cold, s3fs warm"]


def test_a_missing_optional_peer_is_a_line_in_the_table():
    text = markdown(cells_of_a_run_without_torch(), INFO, [])
    row = next(line for line in text.splitlines() if line.startswith("| PyTorch DataLoader") and "| cold |" in line)
    assert row.count(NO_TORCH) == 2  # stoker and s3torch


def bench_args(tmp_path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_command(parser.add_subparsers())
    return parser.parse_args(["bench", "--out", str(tmp_path / "out"), *extra])


def fake_run_all(cells_to_add: list[Cell], stop: BaseException | None = None):
    def run_all(*, cells, info, **_):
        info.update(INFO)
        cells.extend(cells_to_add)
        if stop is not None:
            raise stop
        return cells, info
    return run_all


def test_a_chart_that_fails_costs_neither_the_table_nor_the_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "run_all", fake_run_all(cells_of_a_run_without_torch()))

    def broken_chart(cells, path):
        open(path, "w").close()  # half-written, as a savefig that fails midway
        raise ValueError("Data cannot be log-scaled because all values are <= 0.")
    monkeypatch.setattr(report, "chart", broken_chart)
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.png").write_bytes(b"an earlier run's chart")

    assert cli.run_cells(bench_args(tmp_path), ["stoker", "s3fs", "boto3", "s3torch"], ["seq1"], "") == 0
    printed = capsys.readouterr()
    assert "stoker bench: the chart was not drawn (ValueError: Data cannot be log-scaled" in printed.err
    assert "PyTorch DataLoader" in printed.out  # the table was printed
    assert json.loads((out / "results.json").read_text())["cells"][5]["note"] == NO_TORCH
    assert NO_TORCH in (out / "results.md").read_text()
    assert not (out / "results.png").exists()  # no chart of another run beside these results


def test_a_run_that_stops_early_writes_the_cells_it_measured(tmp_path, monkeypatch, capsys):
    measured = cells_of_a_run_without_torch()[:3]
    monkeypatch.setattr(cli, "run_all", fake_run_all(measured, stop=KeyboardInterrupt()))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "results.png").write_bytes(b"an earlier run's chart")
    with pytest.raises(KeyboardInterrupt):
        cli.run_cells(bench_args(tmp_path), ["stoker", "s3fs"], ["seq1", "small"], "")
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert len(data["cells"]) == 3 and "stopped early (KeyboardInterrupt" in data["info"]["incomplete"]
    assert "**Incomplete:** the run stopped early" in (tmp_path / "out" / "results.md").read_text()
    assert "the cells measured so far are in" in capsys.readouterr().err
    assert not (tmp_path / "out" / "results.png").exists()


def test_simulated_gpu_is_reported_per_system_and_epoch_and_labelled_so(tmp_path, monkeypatch):
    def sim(busy: float, wall: float) -> dict:
        return {"simulated_gpu": {"rate_samples_per_s": 2500.0, "batch": 32, "batches": 7, "busy_s": busy,
                                  "wall_s": wall, "busy_fraction": round(busy / wall, 4)}}
    cells = [Cell("dataloader", "stoker", "cold", value=180.0, unit="samples/s", extra=sim(0.08, 1.0)),
             Cell("dataloader", "stoker", "warm", value=2000.0, unit="samples/s", extra=sim(0.08, 0.1)),
             Cell("dataloader", "s3torch", "cold", note="cannot run: s3torchconnector is not installed"),
             Cell("dataloader", "s3torch", "warm", note="cannot run: s3torchconnector is not installed")]
    info = {**INFO, "simulated_gpu": {"rate_samples_per_s": 2500.0, "batch": 32}}
    text = markdown(cells, info, [])
    assert "180.0 (simulated GPU busy 8%)" in text and "2,000.0 (simulated GPU busy 80%)" in text
    assert "Simulated GPU (--gpu-rate 2500): the DataLoader loop held each batch of 32 samples for 32/2500 s" in text
    assert "| stoker | 8% (0.08 of 1 s) | 80% (0.08 of 0.1 s) |" in text
    assert "| s3torch | cannot run: s3torchconnector is not installed |" in text

    monkeypatch.setattr(cli, "run_all", fake_run_all(cells))
    assert cli.run_cells(bench_args(tmp_path, "--gpu-rate", "2500"), ["stoker", "s3torch"], ["dataloader"], "") == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["cells"][0]["extra"]["simulated_gpu"]["busy_fraction"] == 0.08


@pytest.mark.parametrize("extra", [["--gpu-rate", "0"], ["--gpu-rate", "2500", "--workloads", "seq1"],
                                   ["--gpu-rate", "2500", "--gpu-batch", "0"],
                                   ["--gpu-rate", "2500", "--compare", "HEAD"]])
def test_gpu_rate_is_refused_where_it_cannot_apply(tmp_path, capsys, extra):
    assert cli._plan(bench_args(tmp_path, *extra)) is None
    assert "--gpu-rate takes samples/s above 0" in capsys.readouterr().err


def test_simulated_gpu_without_an_epoch_is_one_line():
    info = {**INFO, "simulated_gpu": {"rate_samples_per_s": 2500.0, "batch": 32}}
    text = markdown(cells_of_a_run_without_torch(), info, [])
    assert "Simulated GPU (--gpu-rate 2500): no DataLoader epoch ran (the table says why)." in text
    assert "simulated GPU busy |" not in text
