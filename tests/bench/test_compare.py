"""`stoker bench --compare REF`: the A/B of the working tree against a commit, alternating rounds, one table."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from stoker_bench.compare import Side, table
from tests.conftest import requires_fuse

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(seq1: float, cpu: float, rss: float, ceiling: float = 400.0) -> dict:
    cell = {"workload": "seq1", "system": "stoker", "run": "cold", "value": seq1, "unit": "MB/s", "cpu_s_per_gib": cpu,
            "peak_rss_mib": rss, "read_amplification": 1.0, "wrong": 0}
    return {"info": {"python_client_ceiling_MBps": ceiling}, "cells": [cell]}


def test_the_table_puts_both_sides_figures_and_spread_in_one_row_each():
    base = Side("base", "/b", "abc", [_run(300, 2.0, 300), _run(320, 2.2, 310)])
    change = Side("change", "/c", "working tree", [_run(280, 1.5, 300), _run(260, 1.7, 300)])
    text = table(base, change)
    rows = {line.split("|")[4].strip(): line for line in text.splitlines() if line.startswith("| seq1")}
    assert "310 [300-320]" in rows["MB/s"] and "270 [260-280]" in rows["MB/s"] and "worse" in rows["MB/s"]
    assert "better" in rows["CPU-s/GiB"], "a CPU win and a speed loss show side by side"
    assert "75" in text and "67.5" in text  # seq1 as a share of each run's bare-client ceiling


@pytest.mark.integration
@requires_fuse
def test_an_ab_against_head_runs_both_sides_alternating(tmp_path):
    out = tmp_path / "ab"
    relative = os.path.relpath(out, ROOT)  # as a user gives it (the default is ./bench-results)
    result = subprocess.run([sys.executable, "-m", "stoker", "bench", "--compare", "HEAD", "--scale", "0.02",
                             "--workloads", "seq1,partial", "--rounds", "2", "--out", relative, "--keep-page-reporting"],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    sides = {s["side"]: s for s in json.loads((out / "compare.json").read_text())}
    assert len(sides["base"]["runs"]) == len(sides["change"]["runs"]) == 2
    order = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("--- ")]
    assert order == ["base", "change", "change", "base"], order
    text = (out / "compare.md").read_text()
    for figure in ("MB/s", "CPU-s/GiB", "peak RSS MiB", "store bytes / bytes read"):
        assert f"| seq1 | stoker | cold | {figure} |" in text, text
    assert "| partial | stoker | cold |" in text
    assert not any(c["wrong"] for s in sides.values() for r in s["runs"] for c in r["cells"])


def test_an_ab_refuses_one_round_and_an_unknown_ref(tmp_path):
    for args, expected in ((["--compare", "HEAD", "--rounds", "1"], "--rounds"),
                           (["--compare", "no-such-ref-zz"], "not a commit")):
        result = subprocess.run([sys.executable, "-m", "stoker", "bench", *args, "--out", str(tmp_path), "--keep-page-reporting"], cwd=ROOT,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and expected in result.stderr, result.stderr
