"""The product targets, checked against one run's cells and printed with the table."""

from __future__ import annotations

from .runner import Cell


def _get(cells: list[Cell], workload: str, system: str, run: str) -> Cell | None:
    return next((c for c in cells if (c.workload, c.system, c.run) == (workload, system, run)
                 and c.value is not None), None)


def evaluate(cells: list[Cell], info: dict) -> list[str]:
    out = []

    def check(label: str, ok: bool | None, detail: str) -> None:
        mark = "n/a" if ok is None else ("met" if ok else "MISSED")
        out.append(f"{label}: {mark} ({detail})")

    st, s3, bo = (_get(cells, "seq1", s, "cold") for s in ("stoker", "s3fs", "boto3"))
    if st and s3:
        check("large sequential, 1 reader >= 3x s3fs", st.value >= 3 * s3.value, _times(st.value, s3.value))
    if st and bo:
        check("large sequential, 1 reader >= 20x boto3 single stream", st.value >= 20 * bo.value,
              _times(st.value, bo.value))
    st, s3 = _get(cells, "small", "stoker", "cold"), _get(cells, "small", "s3fs", "cold")
    if st and s3:
        check("small files cold >= 5x s3fs", st.value >= 5 * s3.value, _times(st.value, s3.value))
    st, rc = _get(cells, "small", "stoker", "warm"), _get(cells, "small", "rclone", "warm")
    if st and rc:
        check("small files warm >= rclone full cache", st.value >= rc.value, _times(st.value, rc.value))
    st = _get(cells, "seq1", "stoker", "warm")
    if st:
        check("warm large sequential >= 1.5 GB/s", st.value >= 1500, f"{st.value:.0f} MB/s")
    st = _get(cells, "epochs", "stoker", "cold")
    if st and st.extra.get("hit_ratio_per_epoch"):
        ratio = 1 / 1.5
        later = st.extra["hit_ratio_per_epoch"][1:]
        check("epochs 2-3 hit ratio >= 50% of cache/dataset", min(later) >= 0.5 * ratio,
              f"{later} vs {0.5 * ratio:.2f}")
    rss = [c for c in cells if c.system == "stoker" and c.peak_rss_mib is not None]
    if rss:
        worst = max(rss, key=lambda c: c.peak_rss_mib - _budget(c, info) / 2**20)
        over = worst.peak_rss_mib - _budget(worst, info) / 2**20
        check("Stoker peak RSS <= cache budget + 100 MiB", over <= 100,
              f"worst {worst.workload}/{worst.run}: {worst.peak_rss_mib:.0f} MiB, {over:+.0f} MiB vs budget")
    idle = [c.idle_rss_mib for c in rss if c.idle_rss_mib is not None and c.run == "cold"]  # a fresh mount
    if idle:
        check("Stoker idle RSS <= 60 MiB", max(idle) <= 60, f"largest fresh mount: {max(idle):.0f} MiB")
    return out


def _times(value: float, base: float) -> str:
    """value / base as a ratio; a zero base (a tiny run measured nothing) is no ratio, not a crash."""
    return f"{value / base:.2f}x" if base else "no ratio (peer measured 0)"


def _budget(cell: Cell, info: dict) -> int:
    return info["epoch_cache_bytes"] if cell.workload == "epochs" else info["cache_bytes"]
