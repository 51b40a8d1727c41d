"""`stoker bench --cluster N`: data-parallel training on N "nodes" (N mounts on one machine, each its own
process and loopback address), per-node caches as today against one distributed cache, same store.

Each epoch every node reads its DistributedSampler partition (the dataset's items reshuffled with the
epoch as seed, node k taking every N-th from k) with 8 reader threads: ~2,000 small files read whole
and a few shards read sequentially. Before epoch 1 each node warms what its cache is meant to hold, as
a DatasetCache does (the distributed cache: the blocks it owns; a per-node cache: what fits, in listing
order). Both modes get the same cache memory per node: the distributed cache's budget
(fusecore.config.distributed_cache_size: the share dataset x R / N, 10% headroom, three standard deviations of what
a member owns past it, room for reads), as `--cache-size auto` sizes a member. The kernel page cache is off
(`--no-kernel-cache`) so the budget is the memory measured.

Reported per mode and epoch: store GETs and bytes (x the dataset), bytes from peers, files/s per node,
peak RSS and cache bytes per node, the longest single file read; every byte read is checked. With
--kill, a last epoch kills one node's mount with SIGKILL halfway (with the warm), or stops it with
SIGSTOP for STOP_SECONDS and continues it (without): the other nodes must see no failed read and no
wrong byte, and no read of theirs may wait on the stopped node; an epoch after the stop shows whether
the node serves its blocks again.
"""

from __future__ import annotations

import math
import os
import random
import resource
import signal
import threading
import time
from dataclasses import asdict, dataclass, field

from fusecore.process import control
from fusecore.config import block_squares, distributed_cache_size
from fusecore.messages import WarmProgress
from stoker.s3server import free_port

from .fixture import StoreProcess
from .runner import RssSampler, _proc_cpu
from .systems import Stoker
from .workloads import KiB, MiB, _parallel, read_part, read_stream

READERS = 8  # per node: a DataLoader's workers
STOP_SECONDS = 8.0  # how long the stop epoch keeps one node's mount stopped (SIGSTOP)


@dataclass
class ClusterDataset:
    items: list[tuple[str, int]]
    quarters: bool = False  # each node reads a different quarter of every shard each epoch, not whole shards

    @classmethod
    def build(cls, scale: float, quarters: bool = False) -> "ClusterDataset":
        rng = random.Random(7)
        if quarters:  # issue 44's shape: 2,000 files of 103-117 KB and 4 shards of 16 MiB, at the default scale
            small = [(f"train/{i % 50:02d}/img-{i:05d}.jpg", rng.randint(103_000, 117_000))
                     for i in range(max(200, int(8000 * scale)))]
            return cls(small + [(f"shards/shard-{i:02d}.tar", 16 * MiB) for i in range(4)], quarters=True)
        small = [(f"train/{i % 50:02d}/img-{i:05d}.jpg", rng.randint(90_000, 130_000))
                 for i in range(max(200, int(8000 * scale)))]
        shards = [(f"shards/shard-{i:02d}.tar", 16 * MiB) for i in range(max(2, int(16 * scale)))]
        return cls(small + shards)

    @property
    def bytes(self) -> int:
        return sum(size for _, size in self.items)

    def partition(self, epoch: int, nodes: int, rank: int) -> list[tuple[str, int, int, int]]:
        """DistributedSampler(shuffle=True) after set_epoch(epoch): a reshuffled 1/N for each rank, as (key, size,
        offset, length) reads. With `quarters`, the shards are not shuffled out: every node reads quarter
        (rank + epoch) % 4 of every shard, from its start to its end, beside its small files."""
        items = [item for item in self.items if not (self.quarters and item[1] > MiB)]
        order = list(range(len(items)))
        random.Random(epoch).shuffle(order)
        reads = [(*items[i], 0, items[i][1]) for i in order[rank::nodes]]
        if self.quarters:
            q = (rank + epoch) % 4
            reads += [(key, size, q * size // 4, size // 4) for key, size in self.items if size > MiB]
            random.Random(epoch * 100 + rank).shuffle(reads)
        return reads


@dataclass
class EpochRow:
    mode: str  # "per-node" or "distributed", with ", no warm" when the caches were not warmed
    epoch: str  # "warm", "1", "2", ..., "kill", "stop", "after stop"
    seconds: float = 0.0
    store_gets: int = 0
    store_bytes: int = 0
    store_x_dataset: float = 0.0
    peer_bytes: int = 0
    peer_x_dataset: float = 0.0
    files_per_s_per_node: float = 0.0
    peak_rss_mib: float = 0.0  # the largest mount process of the epoch
    cache_mib_per_node: float = 0.0
    peer_missed: int = 0  # blocks asked of a peer that did not hold them
    peer_failed: int = 0  # peer requests that failed (refused, timed out, wrong answer)
    cpu_mounts: float = 0.0  # CPU seconds of every mount process
    cpu_store: float = 0.0  # of the emulated store
    cpu_readers: float = 0.0  # of the reader threads (this process)
    cpu_busy: float = 0.0  # all three over the machine's cores x seconds
    failed_reads: int = 0  # on nodes that were not killed
    wrong: int = 0
    warm_errors: int = 0  # blocks a warm could not fetch (a warm row: what each node's warm reported)
    warm_skipped: int = 0  # files a warm left out (they did not fit the cache)
    longest_read_s: float = 0.0  # the longest single file read on the nodes not killed or stopped
    store_by_cause: dict = field(default_factory=dict)  # the live nodes' store bytes by why they were fetched
    served_by_victim: int = 0  # blocks the killed or stopped node served to the others in this phase
    note: str = ""

    def cpu_mounts_store_readers(self) -> tuple[float, float, float]:
        return self.cpu_mounts, self.cpu_store, self.cpu_readers


def _cpu(nodes: list[Node], store: StoreProcess, skip: int | None = None) -> tuple[float, float, float]:
    """CPU seconds so far of the live mounts (but `skip`), the store and this process."""
    mounts = 0.0
    for node in nodes:
        if node.rank == skip:
            continue
        try:
            mounts += _proc_cpu(node.pid)
        except OSError:  # killed
            pass
    usage = resource.getrusage(resource.RUSAGE_SELF)
    assert store.proc is not None, "the store is started"
    return mounts, _proc_cpu(store.proc.pid), usage.ru_utime + usage.ru_stime


@dataclass
class ClusterResult:
    nodes: int
    replicas: int
    dataset_bytes: int
    items: int
    cache_bytes_per_node: int
    rows: list[EpochRow] = field(default_factory=list)


def cache_per_node(items: list[tuple[str, int]], nodes: int, replicas: int, block_size: int = 4 * MiB) -> int:
    """The distributed cache's budget per node, as a member sizes it (`--cache-size auto`), in whole MiB."""
    sizes = [size for _, size in items]
    need = distributed_cache_size(sum(sizes), nodes, replicas, squares=block_squares(sizes, block_size))
    return int(math.ceil(need / MiB)) * MiB


class Node:
    def __init__(self, rank: int, mount: Stoker):
        self.rank, self.mount = rank, mount
        self.killed = False
        self.warmed: WarmProgress | None = None  # the last progress of its warm
        self.files = self.bytes = self.failed = self.wrong = 0
        self.longest = 0.0

    @property
    def pid(self) -> int:
        """The mount's serving process."""
        assert self.mount.pid is not None, "the mount is started"
        return self.mount.pid

    @property
    def sock(self) -> str:
        return control.default_control_socket(self.mount.mountpoint)

    def stats(self) -> dict:
        return control.call(self.sock, {"op": "stats"})

    def read(self, items: list[tuple[str, int, int, int]]) -> None:
        self.files = self.bytes = self.failed = self.wrong = 0
        self.longest = 0.0
        lock = threading.Lock()

        def one(item: tuple[str, int, int, int]) -> None:
            key, size, offset, length = item
            small = size <= MiB  # small files are checked whole, shards every 16 MiB and at the end
            began = time.monotonic()
            try:
                if length < size:  # a part of a shard, from its offset, in 1 MiB reads (every piece checked)
                    n, wrong = read_part(self.mount, key, offset, length, bs=MiB)
                else:
                    n, wrong = read_stream(self.mount, key, size, bs=256 * KiB if small else MiB,
                                           verify_every=1 if small else 16)
            except OSError:
                with lock:
                    self.failed += 1
                return
            with lock:
                self.files += 1
                self.bytes += n
                self.wrong += wrong > 0
                if small:  # (a shard's read is long by its size)
                    self.longest = max(self.longest, time.monotonic() - began)

        _parallel(READERS, items, one)


def _start_nodes(mode: str, n: int, replicas: int, store: StoreProcess, workdir: str, cache_bytes: int,
                 peer_timeout: float) -> list[Node]:
    port = free_port()
    members = [f"127.0.0.{2 + i}:{port}" for i in range(n)]
    key_file = os.path.join(workdir, "peer.key")
    with open(key_file, "wb") as f:
        f.write(os.urandom(32).hex().encode())
    os.chmod(key_file, 0o600)
    nodes = []
    for rank in range(n):
        extra: tuple[str, ...] = ("--no-kernel-cache",)
        if mode == "distributed":
            extra += ("--peers", ",".join(members), "--peer-listen", members[rank], "--peer-key-file", key_file,
                      "--peer-replicas", str(replicas), "--peer-timeout", str(peer_timeout))
        mount = Stoker(store.endpoint, "bench", workdir, cache_bytes, label=f"{mode}-{rank}", extra_args=extra)
        nodes.append(Node(rank, mount))
    try:
        for node in nodes:
            node.mount.start()
    except Exception:
        for node in nodes:
            node.mount.stop()
        raise
    return nodes


def _totals(nodes: list[Node], skip: int | None = None, causes: dict | None = None) -> tuple[int, int, int, int]:
    """(bytes received from peers, cache bytes, blocks peers did not hold, failed peer requests) summed over
    the live nodes (but `skip`); their store bytes by cause added into `causes`."""
    peers = cached = missed = failed = 0
    for node in nodes:
        if node.killed or node.rank == skip:
            continue
        s = node.stats()
        for cause, nbytes in s.get("store_bytes_by_cause", {}).items():
            if causes is not None:
                causes[cause] = causes.get(cause, 0) + nbytes
        peers += s.get("bytes_by_source", {}).get("peers", 0)
        cached += s["cache"]["bytes"]
        for row in s.get("cluster", {}).get("peers", {}).values():
            missed += row["miss"]
            failed += row["failed"]
    return peers, cached, missed, failed


def _served(node: Node) -> int:
    return node.stats().get("cluster", {}).get("served_to_peers", 0)


def _phase(mode: str, label: str, nodes: list[Node], store: StoreProcess, dataset: ClusterDataset,
           work, kill_rank: int | None = None, stop_rank: int | None = None, victim: int | None = None) -> EpochRow:
    """Run `work(node)` on every node at once; measure the store, the peers and the mounts around it. With
    `kill_rank`, that node's mount is killed 0.5 s in; with `stop_rank`, stopped 0.5 s in for STOP_SECONDS;
    `victim`: the node whose serving is counted (served_by_victim)."""
    row = EpochRow(mode, label)
    victim = kill_rank if kill_rank is not None else stop_rank if stop_rank is not None else victim
    served_before = _served(nodes[victim]) if victim is not None and kill_rank is None else 0
    before_store = store.stats()
    causes_before: dict[str, int] = {}
    before_peers, _, before_missed, before_failed = _totals(nodes, skip=kill_rank, causes=causes_before)
    cpu_before = _cpu(nodes, store, skip=kill_rank)
    samplers = [RssSampler(node.pid) for node in nodes if not node.killed]
    for sampler in samplers:
        sampler.start()
    threads = [threading.Thread(target=work, args=(node,)) for node in nodes if not node.killed]
    started = time.monotonic()
    for t in threads:
        t.start()
    if kill_rank is not None:
        time.sleep(0.5)  # halfway into the epoch's first reads
        killed = nodes[kill_rank]
        os.kill(killed.pid, signal.SIGKILL)
        killed.killed = True
        row.note = f"node {kill_rank}'s mount killed (SIGKILL) 0.5 s in; its own reads are not counted"
    if stop_rank is not None:
        time.sleep(0.5)
        stopped = nodes[stop_rank].pid
        os.kill(stopped, signal.SIGSTOP)
        try:
            time.sleep(STOP_SECONDS)
        finally:
            os.kill(stopped, signal.SIGCONT)
        row.note = (f"node {stop_rank}'s mount stopped (SIGSTOP) 0.5 s in for {STOP_SECONDS:g} s; its own reads "
                    "are not counted")
    for t in threads:
        t.join()
    row.seconds = round(time.monotonic() - started, 2)
    cpu_after = _cpu(nodes, store, skip=kill_rank)
    row.cpu_mounts, row.cpu_store, row.cpu_readers = (round(a - b, 1) for a, b in zip(cpu_after, cpu_before))
    row.cpu_busy = round(sum(row.cpu_mounts_store_readers()) / (row.seconds * (os.cpu_count() or 1)), 2)
    after_store = store.stats()
    causes_after: dict[str, int] = {}
    after_peers, cached, missed, failed = _totals(nodes, skip=kill_rank, causes=causes_after)
    row.store_by_cause = {cause: round((nbytes - causes_before.get(cause, 0)) / dataset.bytes, 4)
                          for cause, nbytes in causes_after.items() if nbytes - causes_before.get(cause, 0)}
    row.peer_missed, row.peer_failed = missed - before_missed, failed - before_failed
    live = [node for node in nodes if not node.killed and node.rank != stop_rank]
    row.store_gets = after_store["gets"] - before_store["gets"]
    row.store_bytes = after_store["get_bytes"] - before_store["get_bytes"]
    row.store_x_dataset = round(row.store_bytes / dataset.bytes, 3)
    row.peer_bytes = after_peers - before_peers
    row.peer_x_dataset = round(row.peer_bytes / dataset.bytes, 3)
    row.files_per_s_per_node = round(sum(node.files for node in live) / len(live) / max(row.seconds, 1e-9), 1)
    row.peak_rss_mib = round(max(s.finish() for s in samplers), 1)
    row.cache_mib_per_node = round(cached / len(live) / MiB, 1)
    row.failed_reads = sum(node.failed for node in live)
    row.wrong = sum(node.wrong for node in live)
    others = [node for node in live if node.rank not in (kill_rank, stop_rank)]
    row.longest_read_s = round(max((node.longest for node in others), default=0.0), 2)
    if victim is not None and kill_rank is None:
        row.served_by_victim = _served(nodes[victim]) - served_before
    return row


def run_mode(mode: str, *, warm: bool, n: int, replicas: int, epochs: int, kill: bool, dataset: ClusterDataset,
             store: StoreProcess, workdir: str, cache_bytes: int, peer_timeout: float, log=print) -> list[EpochRow]:
    label = mode if warm else f"{mode}, no warm"
    nodes = _start_nodes(mode, n, replicas, store, workdir, cache_bytes, peer_timeout)
    rows = []
    try:
        def warm_node(node: Node) -> None:
            for progress in control.warm(node.sock, []):
                node.warmed = progress

        def epoch_of(e: int):
            return lambda node: node.read(dataset.partition(e, n, node.rank))

        if warm:
            rows.append(_phase(label, "warm", nodes, store, dataset, warm_node))
            rows[-1].warm_errors = sum(node.warmed.errors for node in nodes if node.warmed)
            rows[-1].warm_skipped = sum(node.warmed.skipped_files for node in nodes if node.warmed)
            log(_line(rows[-1]))
        for epoch in range(1, epochs + 1):
            rows.append(_phase(label, str(epoch), nodes, store, dataset, epoch_of(epoch)))
            log(_line(rows[-1]))
        if kill and warm:
            rows.append(_phase(label, "kill", nodes, store, dataset, epoch_of(epochs + 1), kill_rank=n - 1))
            log(_line(rows[-1]))
        elif kill:
            rows.append(_phase(label, "stop", nodes, store, dataset, epoch_of(epochs + 1), stop_rank=n - 1))
            log(_line(rows[-1]))
            rows.append(_phase(label, "after stop", nodes, store, dataset, epoch_of(epochs + 2), victim=n - 1))
            log(_line(rows[-1]))
    finally:
        for node in nodes:
            node.mount.stop()
    return rows


def _line(row: EpochRow) -> str:
    return (f"{row.mode:>12} epoch {row.epoch:>4}: {row.seconds:6.1f} s, store {row.store_x_dataset}x dataset "
            f"({row.store_gets} GETs), peers {row.peer_x_dataset}x, {row.files_per_s_per_node} files/s per node, "
            f"rss {row.peak_rss_mib} MiB, cache {row.cache_mib_per_node} MiB/node, peer misses {row.peer_missed} "
            f"failures {row.peer_failed}, longest file read {row.longest_read_s} s"
            + (f", the stopped/killed node served {row.served_by_victim}" if row.served_by_victim else "")
            + (f", store bytes by cause (x dataset) {row.store_by_cause}" if row.store_by_cause else "")
            + (f", {row.failed_reads} FAILED" if row.failed_reads else "") + (f", {row.wrong} WRONG" if row.wrong else ""))


def run(*, n: int, replicas: int, epochs: int, kill: bool, scale: float, workdir: str, latency: float,
        bandwidth: float, peer_timeout: float, warm: tuple[bool, ...] = (True, False), quarters: bool = False,
        log=print) -> ClusterResult:
    dataset = ClusterDataset.build(scale, quarters)
    cache_bytes = cache_per_node(dataset.items, n, replicas)
    result = ClusterResult(n, replicas, dataset.bytes, len(dataset.items), cache_bytes)
    with StoreProcess({"bench": dict(dataset.items)}, latency=latency, bandwidth=bandwidth, workdir=workdir) as store:
        log(f"{n} nodes, dataset {len(dataset.items)} items, {dataset.bytes / MiB:.0f} MiB; cache "
            f"{cache_bytes / MiB:.0f} MiB per node in both modes")
        for warmed in warm:
            for mode in ("per-node", "distributed"):
                result.rows += run_mode(mode, warm=warmed, n=n, replicas=replicas, epochs=epochs,
                                        kill=kill and mode == "distributed", dataset=dataset, store=store,
                                        workdir=workdir, cache_bytes=cache_bytes, peer_timeout=peer_timeout, log=log)
    return result


COLUMNS = [("mode", "mode"), ("epoch", "epoch"), ("seconds", "s"), ("store_gets", "store GETs"),
           ("store_x_dataset", "store bytes ÷ dataset"), ("peer_x_dataset", "peer bytes ÷ dataset"),
           ("files_per_s_per_node", "files/s per node"), ("peak_rss_mib", "peak RSS MiB (largest mount)"),
           ("cache_mib_per_node", "cache MiB per node"), ("peer_missed", "peer misses"),
           ("peer_failed", "peer failures"), ("cpu_mounts", "CPU s mounts"),
           ("cpu_store", "CPU s store"), ("cpu_readers", "CPU s readers"), ("cpu_busy", "cores busy"),
           ("longest_read_s", "longest file read s"), ("served_by_victim", "served by the killed/stopped node"),
           ("failed_reads", "failed reads"), ("wrong", "wrong")]


def targets(result: ClusterResult) -> list[str]:
    """The cluster-cache issues' targets, each with its figure (met or missed), for each warm setting run."""
    out: list[str] = []
    modes = {r.mode for r in result.rows}
    if "distributed" in modes:
        out += _warm_targets(result)
    if "distributed, no warm" in modes:
        out += _cold_targets(result)
    wrong = sum(r.wrong for r in result.rows)
    if wrong:
        out.append(f"WRONG BYTES: {wrong} reads")
    return out


def _store_x(rows: list[EpochRow], dataset_bytes: int) -> float:
    return sum(r.store_bytes for r in rows) / dataset_bytes


def _warm_targets(result: ClusterResult) -> list[str]:
    by = {(r.mode, r.epoch): r for r in result.rows}
    epochs = [r for r in result.rows if r.mode == "distributed" and r.epoch != "kill"]
    total = _store_x(epochs, result.dataset_bytes)
    later = [r for r in epochs if r.epoch not in ("warm", "1")]
    later_gets = sum(r.store_gets for r in later)
    out = [f"{'met' if total <= 1.05 else 'MISSED'}: with the warm, the store sent the dataset {total:.3f}x over the "
           f"warm and all epochs (target ≤ 1.05x; per-node caches: "
           f"{_store_x([r for r in result.rows if r.mode == 'per-node'], result.dataset_bytes):.3f}x)",
           f"{'met' if later and later_gets == 0 else 'MISSED'}: with the warm, epochs after the first sent {later_gets} "
           f"GETs ({sum(r.store_bytes for r in later)} bytes) to the store (target 0)"]
    d2, p2 = by.get(("distributed", "2")), by.get(("per-node", "2"))
    if d2 and p2 and p2.files_per_s_per_node:
        ratio = d2.files_per_s_per_node / p2.files_per_s_per_node
        out.append(f"{'met' if ratio >= 2 else 'MISSED'}: epoch 2 {d2.files_per_s_per_node} files/s per node against "
                   f"{p2.files_per_s_per_node} with per-node caches, {ratio:.2f}x (target ≥ 2x)")
    k = by.get(("distributed", "kill"))
    if k:
        out.append(f"{'met' if k.failed_reads == 0 and k.wrong == 0 else 'MISSED'}: a mount killed mid-epoch: "
                   f"{k.failed_reads} failed and {k.wrong} wrong reads on the other nodes (target 0)")
    return out


def _cold_targets(result: ClusterResult) -> list[str]:
    mode, base = "distributed, no warm", "per-node, no warm"
    by = {(r.mode, r.epoch): r for r in result.rows}
    epochs = [r for r in result.rows if r.mode == mode and r.epoch.isdigit()]
    total = _store_x(epochs, result.dataset_bytes)
    later = [r for r in epochs if r.epoch != "1"]
    later_x = _store_x(later, result.dataset_bytes)
    out = [f"{'met' if total <= 1.05 else 'MISSED'}: without a warm, the store sent the dataset {total:.3f}x over "
           f"epochs 1-{len(epochs)} (target ≤ 1.05x; per-node caches: "
           f"{_store_x([r for r in result.rows if r.mode == base and r.epoch.isdigit()], result.dataset_bytes):.3f}x)",
           f"{'met' if later and later_x <= 0.01 else 'MISSED'}: without a warm, epochs after the first sent "
           f"{sum(r.store_gets for r in later)} GETs, {later_x:.4f}x the dataset (target ≤ 0.01x)"]
    for epoch, floor in (("1", 0.9), ("2", 1.0)):
        d, p = by.get((mode, epoch)), by.get((base, epoch))
        if d and p and p.files_per_s_per_node:
            ratio = d.files_per_s_per_node / p.files_per_s_per_node
            out.append(f"{'met' if ratio >= floor else 'MISSED'}: without a warm, epoch {epoch} "
                       f"{d.files_per_s_per_node} files/s per node against {p.files_per_s_per_node} with per-node "
                       f"caches, {ratio:.2f}x (target ≥ {floor}x)")
    stop, after = by.get((mode, "stop")), by.get((mode, "after stop"))
    if stop:
        ok = stop.failed_reads == 0 and stop.wrong == 0 and stop.longest_read_s <= 2.0
        out.append(f"{'met' if ok else 'MISSED'}: a mount stopped {STOP_SECONDS:g} s mid-epoch: {stop.failed_reads} "
                   f"failed and {stop.wrong} wrong reads on the other nodes, their longest file read "
                   f"{stop.longest_read_s} s (targets 0, 0, ≤ 2 s)")
    if after:
        out.append(f"{'met' if after.served_by_victim > 0 else 'MISSED'}: after it continued, the stopped node served "
                   f"{after.served_by_victim} blocks to the others (target > 0)")
    return out


def table(result: ClusterResult) -> str:
    lines = [f"# Cluster cache: {result.nodes} nodes, R = {result.replicas}, dataset {result.items} items "
             f"({result.dataset_bytes / MiB:.0f} MiB), {result.cache_bytes_per_node / MiB:.0f} MiB cache per node", "",
             "| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---|" * 2 + "---:|" * (len(COLUMNS) - 2)]
    for row in result.rows:
        d = asdict(row)
        lines.append("| " + " | ".join(str(d[k]) for k, _ in COLUMNS) + " |")
    notes = [r.note for r in result.rows if r.note]
    lines += [""] + [f"- {t}" for t in targets(result)] + [f"- {n}" for n in notes]
    return "\n".join(lines)
