"""The product targets, checked against one run's cells and printed with the table."""

from __future__ import annotations

from .runner import Cell


def _value(cells: list[Cell], workload: str, system: str, run: str, figure: str = "value") -> float | None:
    """A figure of one cell (its headline by default), or None if it did not run."""
    return next((getattr(c, figure) for c in cells if (c.workload, c.system, c.run) == (workload, system, run)
                 and getattr(c, figure) is not None), None)


def _against(cells: list[Cell], check, label: str, workload: str, peer: str, factor: float, *,
             system: str = "stoker", run: str = "cold") -> None:
    """`system`'s headline figure at least `factor` times `peer`'s in one workload (checked where both ran)."""
    st, other = _value(cells, workload, system, run), _value(cells, workload, peer, run)
    if st is not None and other is not None:
        check(label, st >= factor * other, _times(st, other))


def evaluate(cells: list[Cell], info: dict) -> list[str]:
    out = []

    def check(label: str, ok: bool | None, detail: str) -> None:
        mark = "n/a" if ok is None else ("met" if ok else "MISSED")
        out.append(f"{label}: {mark} ({detail})")

    st = _value(cells, "seq1", "stoker", "cold")
    bare = info.get("python_client_ceiling_MBps")
    if st is not None and bare:  # the bare client's figure, not s3fs's: that one depends on its parallel_count
        check("large sequential, 1 reader >= 90% of the bare Python client", st >= 0.9 * bare,
              f"{st / bare:.0%} of {bare:.0f} MB/s")
    _against(cells, check, "large sequential, 1 reader >= 20x boto3 single stream", "seq1", "boto3", 20)
    st_cpu, s3_cpu = (_value(cells, "seq1", s, "cold", "cpu_s_per_gib") for s in ("stoker", "s3fs"))
    if st_cpu is not None and s3_cpu is not None:
        check("large sequential CPU-s per GiB <= s3fs", st_cpu <= s3_cpu, f"{st_cpu:.2f} vs {s3_cpu:.2f}")
    _against(cells, check, "64 MiB shards, 4 readers >= 3x s3fs", "shards", "s3fs", 3)
    _against(cells, check, "small files cold >= 10x s3fs", "small", "s3fs", 10)
    _against(cells, check, "PyTorch DataLoader epoch 1 >= 3x s3torchconnector", "dataloader", "s3torch", 3)
    _random_targets(cells, check)
    _disk_targets(cells, check)
    _write_targets(cells, info, check)
    st, s3 = _value(cells, "ceiling", "stoker", "cold"), _value(cells, "ceiling", "s3fs", "cold")
    if st is not None and s3 is not None:
        busy = _extra(cells, "ceiling", "stoker", "cores_busy")
        check("small-file ceiling (no latency, no page cache) >= s3fs", st >= s3,
              f"{_times(st, s3)}, {busy} cores busy")
    st_ms, s3_ms = (_extra(cells, w, s, "cpu_ms_per_file") for w, s in (("ceiling", "stoker"), ("ceiling", "s3fs")))
    if st_ms is not None and s3_ms is not None:
        check("mount CPU per small file <= s3fs", st_ms <= s3_ms, f"{st_ms:.2f} vs {s3_ms:.2f} ms")
    _against(cells, check, "small files warm >= rclone full cache", "small", "rclone", 1, run="warm")
    st = _value(cells, "seq1", "stoker", "warm")
    if st is not None:
        check("warm large sequential >= 1.5 GB/s", st >= 1500, f"{st:.0f} MB/s")
    epochs = next((c for c in cells if (c.workload, c.system, c.run) == ("epochs", "stoker", "cold")
                   and c.extra.get("hit_ratio_per_epoch")), None)
    if epochs is not None:
        ratio = 1 / 1.5
        later = epochs.extra["hit_ratio_per_epoch"][1:]
        check("epochs 2-3 hit ratio >= 50% of cache/dataset", min(later) >= 0.5 * ratio,
              f"{later} vs {0.5 * ratio:.2f}")
    peaks = [(c.peak_rss_mib - _budget(c, info) / 2**20, c) for c in cells
             if c.system in ("stoker", "stoker-disk") and c.peak_rss_mib is not None]
    if peaks:
        over, worst = max(peaks, key=lambda p: p[0])
        check("Stoker peak RSS <= cache budget + 100 MiB (with the disk tier too)", over <= 100,
              f"worst {worst.workload}/{worst.run}: {over + _budget(worst, info) / 2**20:.0f} MiB, "
              f"{over:+.0f} MiB vs budget")
    idle = [c.idle_rss_mib for c in cells if c.system == "stoker" and c.idle_rss_mib is not None
            and c.run == "cold"]  # a fresh mount
    if idle:
        check("Stoker idle RSS <= 60 MiB", max(idle) <= 60, f"largest fresh mount: {max(idle):.0f} MiB")
    return out


def _write_targets(cells: list[Cell], info: dict, check) -> None:
    """Issue 46: one writer at the store's pace and above a bare client and s3fs, at no more CPU than s3fs; eight
    writers 2x s3fs; torch.save into the mount 0.9x s3torchconnector's S3Checkpoint."""
    st = _value(cells, "write1", "stoker", "cold")
    ceiling = info.get("store_write_ceiling_MBps")
    if st is not None and ceiling:
        check("one writer >= 80% of the store's ceiling of parallel PUTs", st >= 0.8 * ceiling,
              f"{st / ceiling:.0%} of {ceiling:.0f} MB/s")
    _against(cells, check, "one writer >= a bare multipart client (boto3 upload_fileobj)", "write1", "boto3", 1)
    _against(cells, check, "one writer >= 1.25x s3fs", "write1", "s3fs", 1.25)
    st_cpu, s3_cpu = (_value(cells, "write1", s, "cold", "cpu_s_per_gib") for s in ("stoker", "s3fs"))
    if st_cpu is not None and s3_cpu is not None:
        check("one writer's CPU-s per GiB written <= s3fs", st_cpu <= s3_cpu, f"{st_cpu:.2f} vs {s3_cpu:.2f}")
    _against(cells, check, "eight writers >= 2x s3fs", "write8", "s3fs", 2)
    _against(cells, check, "torch.save into the mount >= 0.9x S3Checkpoint", "ckpt", "s3torch", 0.9)


def _random_targets(cells: list[Cell], check) -> None:
    """Random reads at 4 KiB-aligned offsets cost the store at most 1.1x what they read; 256 KiB ones >= 3x s3fs."""
    for workload in ("rand4k", "rand256k", "rand1m"):
        amp = _value(cells, workload, "stoker", "cold", "read_amplification")
        if amp is not None:
            check(f"{workload} store bytes per byte read <= 1.1", amp <= 1.1, f"{amp:.3f}")
    _against(cells, check, "random 256 KiB reads >= 3x s3fs", "rand256k", "s3fs", 3)


def _disk_targets(cells: list[Cell], check) -> None:
    """A dataset 4x the memory cache: the disk tier keeps epoch 2 off the store and fast; filling it costs epoch 1
    little; memory alone keeps some of the small files while a stream passes."""
    def store_share(system: str, run: str) -> float | None:
        cell = next((c for c in cells if (c.workload, c.system, c.run) == ("disk", system, run) and c.bytes), None)
        return None if cell is None else cell.store_bytes / cell.bytes

    share = store_share("stoker-disk", "warm")
    if share is not None:
        check("disk tier: epoch 2 takes <= 1% of the dataset from the store", share <= 0.01, f"{share:.3f}x")
    for system, factor, label in (("stoker", 2, "2x memory only"), ("s3fs-disk", 1, "s3fs with use_cache")):
        _against(cells, check, f"disk tier: epoch 2 >= {label}", "disk", system, factor, system="stoker-disk",
                 run="warm")
    _against(cells, check, "disk tier: epoch 1 >= 0.9x memory only", "disk", "stoker", 0.9, system="stoker-disk")
    share = store_share("stoker", "warm")
    if share is not None:
        check("memory only, small files beside a stream: epoch 2 <= 0.8x the dataset from the store", share <= 0.8,
              f"{share:.3f}x")


def _extra(cells: list[Cell], workload: str, system: str, name: str, run: str = "cold") -> float | None:
    return next((c.extra[name] for c in cells if (c.workload, c.system, c.run) == (workload, system, run)
                 and name in c.extra), None)


def _times(value: float, base: float) -> str:
    """value / base as a ratio; a zero base (a tiny run measured nothing) is no ratio, not a crash."""
    return f"{value / base:.2f}x" if base else "no ratio (peer measured 0)"


def _budget(cell: Cell, info: dict) -> int:
    return {"epochs": info["epoch_cache_bytes"], "disk": info.get("disk_cache_bytes", 0)}.get(cell.workload,
                                                                                          info["cache_bytes"])
