"""One Markdown table of ratios to s3fs-fuse, a JSON file, and a PNG chart.

The JSON and the table are written first; the chart comes after them and cannot take them down: a cell with no value
(a peer that cannot run, a time of 0 ms) is left out of it and named under its panel, and a chart that fails all the
same is a message, not a lost run (draw_chart)."""

from __future__ import annotations

import json
import os
import textwrap

from .runner import Cell, to_dicts
from .workloads import WORKLOADS

LOWER_IS_BETTER = {"ttfb", "bigdir"}


def _ratio(workload: str, value: float | None, base: float | None) -> str:
    if value is None or not base or (workload in LOWER_IS_BETTER and not value):
        return "-"  # nothing to compare (a tiny run can measure a time of 0 ms)
    r = base / value if workload in LOWER_IS_BETTER else value / base
    return f"{r:.2f}×"


def markdown(cells: list[Cell], info: dict, targets: list[str]) -> str:
    by = {(c.workload, c.system, c.run): c for c in cells}
    systems = list(dict.fromkeys(c.system for c in cells))
    workloads = list(dict.fromkeys(c.workload for c in cells))
    lines = [
        f"Emulated object store: first-byte latency {info['latency_s'] * 1000:.0f} ms, "
        f"{info['bandwidth_Bps'] / 1e6:.0f} MB/s per connection, scale {info['scale']}, "
        f"Stoker cache {info['cache_bytes'] / 2**20:.0f} MiB (epochs: {info['epoch_cache_bytes'] / 2**20:.0f} MiB). "
        f"Fixture ceiling without the cap: {info.get('store_ceiling_MBps', '-')} MB/s. A bare Python client (48 "
        f"threads of urllib3 range GETs into reused buffers, no FUSE) reaches {info.get('python_client_ceiling_MBps', '-')} "
        f"MB/s against the capped store on this machine." + (f" {info['host_memory']}" if info.get("host_memory") else ""),
        "",
        *([f"**Incomplete:** {info['incomplete']}", ""] if info.get("incomplete") else []),
        "| workload | run | " + " | ".join(systems) + " | " + " | ".join(f"{s} vs s3fs" for s in systems if s != "s3fs")
        + " |",
        "|---|---|" + "---|" * (len(systems) * 2 - ("s3fs" in systems)),
    ]
    for w in workloads:
        for run in ("cold", "warm"):
            row = [WORKLOADS[w][0], run]
            base = by.get((w, "s3fs", run))
            for s in systems:
                c = by.get((w, s, run))
                if c is None:
                    row.append("n/a" if s == "boto3" and run == "warm" else "-")
                elif c.value is None:
                    row.append(c.note.replace("|", "/")[:80])
                else:
                    text = f"{c.value:,.1f}"
                    if c.wrong:
                        text += " WRONG BYTES"
                    if c.extra.get("hit_ratio_per_epoch"):
                        text += " (hits " + "/".join(f"{h:.0%}" for h in c.extra["hit_ratio_per_epoch"]) + ")"
                    if gpu := c.extra.get("simulated_gpu"):
                        text += f" (simulated GPU busy {gpu['busy_fraction']:.0%})"
                    row.append(text)
            for s in systems:
                if s == "s3fs":
                    continue
                c = by.get((w, s, run))
                row.append(_ratio(w, c.value if c else None, base.value if base else None))
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Resources per cell (CPU-seconds per GiB delivered / peak RSS MiB / requests / read amplification):", "",
              "| workload | run | " + " | ".join(systems) + " |", "|---|---|" + "---|" * len(systems)]
    for w in workloads:
        for run in ("cold", "warm"):
            row = [w, run]
            for s in systems:
                c = by.get((w, s, run))
                if c is None or c.value is None:
                    row.append("-")
                else:
                    row.append(f"{_fmt(c.cpu_s_per_gib)} / {_fmt(c.peak_rss_mib)} / {c.requests} / "
                               f"{_fmt(c.read_amplification)}")
            lines.append("| " + " | ".join(row) + " |")
    idle = {s: max((c.idle_rss_mib for c in cells if c.system == s and c.run == "cold" and c.idle_rss_mib), default=None)
            for s in systems}
    if any(v is not None for v in idle.values()):
        lines += ["", "Idle RSS before a cold run (MiB, largest over workloads): "
                  + ", ".join(f"{s} {_fmt(v)}" for s, v in idle.items() if v is not None)]
    lines += simulated_gpu(cells, info)
    if targets:
        lines += ["", "Targets:", ""] + [f"- {t}" for t in targets]
    return "\n".join(lines) + "\n"


def simulated_gpu(cells: list[Cell], info: dict) -> list[str]:
    """With --gpu-rate: per system and epoch of the DataLoader cell, the share of the epoch's wall time a GPU that
    consumes that many samples/s would have been busy. Simulated: the loop held each batch; no GPU ran."""
    gpu = info.get("simulated_gpu")
    if not gpu:
        return []
    rate, batch = gpu["rate_samples_per_s"], gpu["batch"]
    if not any(c.extra.get("simulated_gpu") for c in cells):
        return ["", f"Simulated GPU (--gpu-rate {rate:g}): no DataLoader epoch ran (the table says why)."]
    lines = ["", f"Simulated GPU (--gpu-rate {rate:g}): the DataLoader loop held each batch of {batch} samples for "
             f"{batch}/{rate:g} s = {batch / rate * 1000:.1f} ms, as one GPU consuming {rate:g} samples/s would, before "
             "it took the next; busy = held time / the epoch's wall time (epoch 1 = cold, a fresh mount; epoch 2 = "
             "warm). Samples/s above cannot exceed the rate.", "",
             "| system | epoch 1 (cold): simulated GPU busy | epoch 2 (warm): simulated GPU busy |", "|---|---|---|"]
    by = {(c.system, c.run): c for c in cells if c.workload == "dataloader"}
    for system in dict.fromkeys(c.system for c in cells if c.workload == "dataloader"):
        row = [system]
        for run in ("cold", "warm"):
            c = by.get((system, run))
            sim = c.extra.get("simulated_gpu") if c is not None else None
            if sim:
                row.append(f"{sim['busy_fraction']:.0%} ({sim['busy_s']:g} of {sim['wall_s']:g} s)")
            else:
                row.append("-" if c is None else (c.note.replace("|", "/")[:80] or "-"))
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _fmt(v) -> str:
    return "-" if v is None else f"{v:g}"


def write(out_dir: str, cells: list[Cell], info: dict, targets: list[str]) -> dict[str, str]:
    """results.json, then results.md (the chart is draw_chart's, after these; an earlier run's is removed)."""
    os.makedirs(out_dir, exist_ok=True)
    if os.path.exists(stale := os.path.join(out_dir, "results.png")):
        os.remove(stale)
    paths = {"json": os.path.join(out_dir, "results.json"), "markdown": os.path.join(out_dir, "results.md")}
    with open(paths["json"], "w") as f:
        json.dump({"info": info, "cells": to_dicts(cells), "targets": targets}, f, indent=2)
    with open(paths["markdown"], "w") as f:
        f.write(markdown(cells, info, targets))
    return paths


def draw_chart(out_dir: str, cells: list[Cell]) -> tuple[str | None, str]:
    """results.png, or None and why not: matplotlib is missing, or the chart failed (a bug, said, never raised: the
    results are written before it). No stale chart of an earlier run is left beside new results."""
    path = os.path.join(out_dir, "results.png")
    try:
        chart(cells, path)
    except ImportError:
        problem = "no chart: matplotlib is not installed (pip install matplotlib)"
    except Exception as exc:  # noqa: BLE001 - the table and JSON stand without it
        problem = (f"the chart was not drawn ({type(exc).__name__}: {exc}); the results are in "
                   f"{os.path.join(out_dir, 'results.md')} and results.json")
    else:
        return path, ""
    if os.path.exists(path):
        os.remove(path)
    return None, problem


def _bar(cell: Cell | None) -> float | None:
    """A cell's height on the chart's log axis, or None: it did not run, has no value, or measured 0."""
    return cell.value if cell is not None and cell.value is not None and cell.value > 0 else None


def chart(cells: list[Cell], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(dict.fromkeys(c.system for c in cells))
    workloads = list(dict.fromkeys(c.workload for c in cells))
    cols = min(4, len(workloads))
    rows = (len(workloads) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.4 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[len(workloads):]:
        ax.axis("off")
    for ax, w in zip(flat, workloads):
        by = {(c.system, c.run): c for c in cells if c.workload == w}
        shown = [s for s in systems if any(c.system == s for c in by.values())]  # the systems that ran it
        left_out = [f"{s} {run}" for s in shown for run in ("cold", "warm")
                    if (s, run) in by and _bar(by[(s, run)]) is None]
        for i, run in enumerate(("cold", "warm")):
            values = [_bar(by.get((s, run))) for s in shown]
            ax.bar([x + i * 0.4 for x in range(len(shown))], [float("nan") if v is None else v for v in values],
                   width=0.4, label=run, color=f"C{i}")
        ax.set_xlim(-0.4, len(shown) - 0.2)
        ax.set_xticks([x + 0.2 for x in range(len(shown))])
        ax.set_xticklabels(shown, rotation=45, fontsize=8)
        ax.set_title(WORKLOADS[w][0], fontsize=8, wrap=True)
        if any(_bar(c) is not None for c in by.values()):
            ax.set_yscale("log")  # warm runs are orders of magnitude above cold ones
        else:
            ax.set_yticks([])
            notes = list(dict.fromkeys(c.note for c in by.values() if c.note))
            ax.text(0.5, 0.5, "\n".join(["no value to draw"] + [textwrap.fill(n, 40) for n in notes[:2]]),
                    transform=ax.transAxes, ha="center", va="center", fontsize=7)
        if left_out:  # said under the panel, not drawn as a bar of 0
            ax.set_xlabel("no value (see table): " + ", ".join(left_out), fontsize=6, wrap=True)
    flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


OPERATOR_COLUMNS = [  # (field, heading)
    ("nodes", "nodes"), ("plan_seconds", "plan s"), ("ready_seconds", "Ready s after last report"),
    ("release_seconds", "release s"), ("cache_object_bytes", "DatasetCache bytes"),
    ("node_object_bytes", "largest DatasetCacheNode bytes"), ("requests", "API requests"),
    ("requests_per_second", "requests/s"), ("cache_status_writes", "DatasetCache status writes"),
    ("reports", "node reports"), ("events_per_agent_watched", "events per real agent watch"),
    ("events_per_agent_max", "most events any node's selector matched"),
    ("operator_cpu_seconds", "operator CPU s"), ("operator_rss_mib", "operator RSS MiB"),
]


def write_operator(out_dir: str, rows: list[dict]) -> dict[str, str]:
    """`stoker bench --operator`: one row per cluster size."""
    lines = ["# DatasetCache operator at scale (simulated nodes, API faked at its HTTP boundary)", "",
             "| " + " | ".join(h for _, h in OPERATOR_COLUMNS) + " |",
             "|" + "---:|" * len(OPERATOR_COLUMNS)]
    lines += ["| " + " | ".join(_fmt(row[k]) for k, _ in OPERATOR_COLUMNS) + " |" for row in rows]
    return write_table(out_dir, "operator", "\n".join(lines), rows)


def write_table(out_dir: str, name: str, markdown: str, rows: list[dict]) -> dict[str, str]:
    """`name`.md and `name`.json in `out_dir`: a table as text and its rows as data."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"markdown": os.path.join(out_dir, f"{name}.md"), "json": os.path.join(out_dir, f"{name}.json")}
    with open(paths["markdown"], "w") as f:
        f.write(markdown + "\n")
    with open(paths["json"], "w") as f:
        json.dump(rows, f, indent=2)
    return paths
