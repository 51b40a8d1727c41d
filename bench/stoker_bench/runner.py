"""Runs every workload through every system, cold then warm, and measures each cell."""

from __future__ import annotations

import os
import resource
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field

from fusecore.process.template import children
from fusecore.store.bodies import socket_readinto

from .fixture import StoreProcess
from .systems import Unavailable, disk_variants, kind_of
from .workloads import WORKLOADS, WRITE_WORKLOADS, Dataset, Outcome

CLK_TCK = os.sysconf("SC_CLK_TCK")
GiB = 1024**3


@dataclass
class Cell:
    workload: str
    system: str
    run: str  # cold | warm
    value: float | None = None  # the workload's headline figure
    unit: str = ""
    seconds: float = 0.0
    bytes: int = 0
    cpu_seconds: float | None = None
    cpu_s_per_gib: float | None = None
    peak_rss_mib: float | None = None
    idle_rss_mib: float | None = None  # the serving process before the workload ran
    requests: int = 0
    store_bytes: int = 0
    read_amplification: float | None = None
    wrong: int = 0
    note: str = ""
    extra: dict = field(default_factory=dict)


def _proc_cpu(pid: int) -> float:
    """CPU seconds of a process, with its children's (a mount's worker processes: the live ones, and those that
    ended and were waited for)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    own = sum(int(v) for v in fields[11:15]) / CLK_TCK
    return own + sum(_proc_cpu(child) for child in children(pid))


def _tree_memory_kib(pid: int) -> int:
    """Memory of a mount: its RSS; for one served by several processes, the PSS of each (pages shared between them
    count once) and the block files they share on tmpfs (workers.shared_folder)."""
    workers = children(pid)
    if not workers:
        return _proc_rss_kib(pid)
    total = sum(_pss_kib(p) for p in (pid, *workers))
    folder = f"/dev/shm/stoker-{os.geteuid()}-{pid}/blocks"
    try:
        total += sum(e.stat().st_size for e in os.scandir(folder)) // 1024
    except OSError:
        pass
    return total


def _pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _cpu_seconds(system) -> float:
    """CPU time of the process doing the reads: the FUSE daemon, or this process for boto3."""
    if system.is_mount:
        return _proc_cpu(system.pid)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _proc_rss_kib(pid: int, field_name: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    return 0


class RssSampler(threading.Thread):
    """Peak RSS of a process over a window (VmHWM would also count earlier runs)."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self._done = pid, 0, threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            try:
                self.peak = max(self.peak, _tree_memory_kib(self.pid))
            except OSError:
                return
            self._done.wait(0.05)

    def finish(self) -> float:
        self._done.set()
        self.join()
        return self.peak / 1024


UNTHROTTLED = {"ceiling", "bigfile"}  # workloads run against a store of their own, with no latency and no cap


def headline(workload: str, o: Outcome) -> tuple[float, str]:
    if workload in ("small", "ceiling", "disk", "flat", "classes"):
        return o.files / o.seconds, "files/s"
    if workload == "dataloader":
        return o.files / o.seconds, "samples/s"
    if workload == "metadata":
        return o.files / o.seconds, "entries/s"
    if workload == "ttfb":
        return o.extra["ttfb_median_ms"], "ms"
    if workload == "bigdir":
        return o.seconds, "s"
    return o.bytes / o.seconds / 1e6, "MB/s"


def measure(system, store: StoreProcess, workload: str, d: Dataset, run_index: int,
            options: dict | None = None) -> Cell:
    """One run of a workload on a started system; `options` go to the workload (the DataLoader cell's gpu_rate and
    gpu_batch)."""
    fn = WORKLOADS[workload][1]
    cell = Cell(workload, system.name, "cold" if run_index == 0 else "warm")
    own = not system.is_mount
    before_cpu = _cpu_seconds(system)
    sampler = None if own else RssSampler(system.pid)
    if sampler:
        cell.idle_rss_mib = round(_tree_memory_kib(system.pid) / 1024, 1)
        sampler.start()
    before = store.stats()
    outcome = fn(system, d, run_index, **(options or {}))
    after = store.stats()
    after_cpu = _cpu_seconds(system)
    cell.value, cell.unit = headline(workload, outcome)
    cell.seconds, cell.bytes, cell.wrong, cell.extra = outcome.seconds, outcome.bytes, outcome.wrong, outcome.extra
    cell.cpu_seconds = round(after_cpu - before_cpu - outcome.extra.pop("cpu_outside_s", 0.0), 3)
    if outcome.bytes:
        cell.cpu_s_per_gib = round(cell.cpu_seconds / (outcome.bytes / GiB), 3)
    if sampler:
        cell.peak_rss_mib = round(sampler.finish(), 1)
    cell.requests = after["requests"] - before["requests"]
    cell.store_bytes = after["bytes_sent"] - before["bytes_sent"]
    if outcome.bytes:
        cell.read_amplification = round(cell.store_bytes / outcome.bytes, 3)
    if workload in ("small", "ceiling") and outcome.files and outcome.seconds:
        cell.extra["cpu_ms_per_file"] = round(cell.cpu_seconds / outcome.files * 1000, 3)
        cell.extra["cores_busy"] = round(cell.cpu_seconds / outcome.seconds, 2)
    return cell


def run_all(*, scale: float, systems: list[str], workloads: list[str], workdir: str, latency: float,
            bandwidth: float, cache_bytes: int, log=print, gpu_rate: float | None = None, gpu_batch: int = 32,
            cells: list[Cell] | None = None, info: dict | None = None) -> tuple[list[Cell], dict]:
    """Every workload on every system. `cells` and `info`, where given, are filled as the run goes, so that a caller
    still has the cells measured so far if the run stops early. `gpu_rate` (samples/s) runs the DataLoader cell with a
    simulated GPU that holds each batch of `gpu_batch` samples (dataloader.py)."""
    d = Dataset.build(scale)
    cells = [] if cells is None else cells
    info = {} if info is None else info
    options = {"dataloader": {"gpu_rate": gpu_rate, "gpu_batch": gpu_batch}} if gpu_rate is not None else {}
    with StoreProcess({"bench": d.objects()}, latency=latency, bandwidth=bandwidth, workdir=workdir) as store:
        info.update({"scale": scale, "latency_s": latency, "bandwidth_Bps": bandwidth, "cache_bytes": cache_bytes,
                     "epoch_cache_bytes": d.epoch_cache, "disk_cache_bytes": d.disk_cache,
                     "objects": len(d.objects())})
        if gpu_rate is not None:
            info["simulated_gpu"] = {"rate_samples_per_s": gpu_rate, "batch": gpu_batch}
        info["store_ceiling_MBps"] = store_ceiling(d, workdir, latency)
        info["python_client_ceiling_MBps"] = python_client_ceiling(store, d)
        if WRITE_WORKLOADS & set(workloads):
            info["store_write_ceiling_MBps"] = store_write_ceiling(store)
            log(f"the store takes {info['store_write_ceiling_MBps']} MB/s of parallel PUTs (48 connections)")
        log(f"emulated store at {store.endpoint}: {info['objects']} objects, latency {latency * 1000:.0f} ms, "
            f"{bandwidth / 1e6:.0f} MB/s per connection; unthrottled ceiling {info['store_ceiling_MBps']} MB/s; "
            f"a bare Python client with 48 connections reaches {info['python_client_ceiling_MBps']} MB/s")
        for workload in workloads:
            if workload in UNTHROTTLED:
                fast_dir = os.path.join(workdir, f"unthrottled-{workload}")
                os.makedirs(fast_dir, exist_ok=True)
                served = d.bigfile if workload == "bigfile" else d.small
                with StoreProcess({"bench": dict(served)}, latency=0, bandwidth=0, workdir=fast_dir) as fast:
                    _run_workload(fast, workload, systems, d, workdir, cache_bytes, cells, log, kernel_cache=False)
                continue
            _run_workload(store, workload, systems, d, workdir, cache_bytes, cells, log,
                          kernel_cache=workload not in ("epochs", "disk"), options=options.get(workload))
    return cells, info


def _runs(kind, workload: str) -> bool:
    """Does this system run this cell? s3torchconnector runs only the dataset and checkpoint cells (it reads datasets
    and writes checkpoints, not files), a DataLoader needs a mount or a dataset of the system's own (boto3 has none),
    and a checkpoint a mount or a checkpoint writer of the system's own."""
    if workload == "dataloader" and not kind.is_mount and not hasattr(kind, "dataset"):
        return False
    if workload == "ckpt" and not kind.is_mount and not hasattr(kind, "save_checkpoint"):
        return False
    return workload in getattr(kind, "workloads", (workload,))


def _missing(workload: str) -> str | None:
    """Why a workload cannot run on this machine at all (an optional package is not installed), or None."""
    if workload in ("dataloader", "ckpt"):
        from .dataloader import missing

        return missing()
    return None


def _run_workload(store: StoreProcess, workload: str, systems: list[str], d: Dataset, workdir: str, cache_bytes: int,
                  cells: list[Cell], log, *, kernel_cache: bool, options: dict | None = None) -> None:
    """One workload through every system, cold then warm (boto3 once). A workload that cannot run here is one note
    per cell, and no system is started for it."""
    kinds: list = [kind for name in systems for kind in disk_variants(name)] if workload == "disk" \
        else [kind_of(name) for name in systems]
    missing = _missing(workload)
    for kind in kinds:
        name = kind.name
        if not _runs(kind, workload):
            continue
        runs = 1 if name == "boto3" else 2
        if missing:
            cells.extend(Cell(workload, name, ("cold", "warm")[r], note=f"cannot run: {missing}") for r in range(runs))
            log(f"{workload:>8} {name:>7}: cannot run: {missing}")
            continue
        cache = {"epochs": d.epoch_cache, "disk": d.disk_cache}.get(workload, cache_bytes)
        # The multi-epoch cells measure the budgeted cache itself: with the kernel page cache
        # on, this 24 GiB machine would serve every epoch from memory whatever the budget.
        system = kind(store.endpoint, "bench", workdir, cache, kernel_cache=kernel_cache)
        system.store_stats = store.stats
        system.store_written = store.written
        system.writable = workload in WRITE_WORKLOADS
        try:
            system.start()
        except Unavailable as exc:
            for r in range(runs):
                cells.append(Cell(workload, name, ("cold", "warm")[r], note=f"cannot run: {exc}"))
            log(f"{workload:>8} {name:>7}: cannot run: {exc}")
            continue
        try:
            for r in range(runs):
                try:
                    cell = measure(system, store, workload, d, r, options)
                except Unavailable as exc:  # an optional package the cell needs
                    cell = Cell(workload, name, ("cold", "warm")[r], note=f"cannot run: {exc}")
                except Exception as exc:  # noqa: BLE001 - a failing peer becomes a note
                    cell = Cell(workload, name, ("cold", "warm")[r], note=f"failed: {type(exc).__name__}: {exc}")
                    traceback.print_exc()
                cells.append(cell)
                log(f"{workload:>8} {name:>7} {cell.run}: "
                    + (f"{cell.value:.1f} {cell.unit}" if cell.value is not None else cell.note)
                    + (f", rss {cell.idle_rss_mib} idle / {cell.peak_rss_mib} peak MiB" if cell.peak_rss_mib else "")
                    + (f", {cell.requests} req, amp {cell.read_amplification}" if cell.value is not None else "")
                    + (f" WRONG BYTES x{cell.wrong}" if cell.wrong else "")
                    + (f" {cell.extra}" if cell.extra else ""))
        finally:
            system.stop()


def store_ceiling(d: Dataset, workdir: str, latency: float) -> float:
    """How fast the fixture itself serves on this machine with the per-connection cap lifted."""
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    key, size = d.seq[0]
    n = min(size, 128 * 1024 * 1024)
    ceiling_dir = os.path.join(workdir, "ceiling")
    os.makedirs(ceiling_dir, exist_ok=True)
    with StoreProcess({"bench": dict(d.seq)}, latency=latency, bandwidth=0, workdir=ceiling_dir) as fast:
        def fetch(i: int) -> int:
            req = urllib.request.Request(f"{fast.endpoint}/bench/{key}", headers={"Range": f"bytes=0-{n - 1}"})
            total = 0
            with urllib.request.urlopen(req, timeout=120) as r:
                while chunk := r.read(4 << 20):
                    total += len(chunk)
            return total

        started = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            total = sum(pool.map(fetch, range(8)))
        return round(total / (time.monotonic() - started) / 1e6, 1)


def store_write_ceiling(store: StoreProcess, connections: int = 48, part: int = 8 * 1024 * 1024) -> float:
    """What the store takes of uploads at most: `connections` threads each PUTting parts of 8 MiB (MB/s)."""
    import urllib3
    from concurrent.futures import ThreadPoolExecutor

    from .objectstore import expected_bytes

    pool = urllib3.PoolManager(maxsize=connections)
    count = connections * 2

    def put(i: int) -> int:
        key = f"ceiling/put-{i}"
        resp = pool.request("PUT", f"{store.endpoint}/bench/{key}", body=expected_bytes(key, 0, part))
        resp.release_conn()
        return part

    started = time.monotonic()
    with ThreadPoolExecutor(connections) as executor:
        done = sum(executor.map(put, range(count)))
    return round(done / (time.monotonic() - started) / 1e6, 1)


def python_client_ceiling(store: StoreProcess, d: Dataset, connections: int = 48) -> float:
    """The best a Python process does here against the capped store: `connections` threads of
    bare urllib3 range GETs into reused buffers, no FUSE, no cache. Stoker's cold sequential
    throughput is bounded by this (and by the CPU the kernel's FUSE copies take besides)."""
    import urllib3
    from concurrent.futures import ThreadPoolExecutor

    key, size = d.seq[0]
    block = 4 * 1024 * 1024
    count = min(size // block, 64)
    pool = urllib3.PoolManager(maxsize=connections)
    buffers = [bytearray(block) for _ in range(connections)]
    url = f"{store.endpoint}/bench/{key}"

    def fetch(i: int) -> int:
        resp = pool.request("GET", url, headers={"Range": f"bytes={i * block}-{(i + 1) * block - 1}"},
                            preload_content=False)
        view, pos = memoryview(buffers[i % connections]), 0
        readinto = socket_readinto(resp) or resp.readinto
        while pos < block and (n := readinto(view[pos:pos + 262144])):
            pos += n
        resp.release_conn()
        return pos

    started = time.monotonic()
    with ThreadPoolExecutor(connections) as executor:
        total = sum(executor.map(fetch, range(count)))
    elapsed = time.monotonic() - started
    pool.clear()  # its connections would stay open against the store through every later cell
    buffers.clear()
    return round(total / elapsed / 1e6, 1)


def to_dicts(cells: list[Cell]) -> list[dict]:
    return [asdict(c) for c in cells]
