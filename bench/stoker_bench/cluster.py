"""`stoker bench --cluster N`: data-parallel training on N "nodes" (N mounts on one machine, each its own
process and loopback address), per-node caches as today against one distributed cache, same store.

Each epoch every node reads its DistributedSampler partition (the dataset's items reshuffled with the
epoch as seed, node k taking every N-th from k) with 8 reader threads: ~2,000 small files read whole
and a few shards read sequentially. Before epoch 1 each node warms what its cache is meant to hold, as
a DatasetCache does (the distributed cache: the blocks it owns; a per-node cache: what fits, in listing
order). Both modes get the same cache memory per node: the distributed cache's budget
(fusecore.config.distributed_cache_size: the share dataset x R / N, 10% headroom, room for reads). The kernel page cache is off (`--no-kernel-cache`) so the budget is the memory measured.

Reported per mode and epoch: store GETs and bytes (x the dataset), bytes from peers, files/s per node,
peak RSS and cache bytes per node; every byte read is checked. With --kill, a last epoch kills one
node's mount with SIGKILL halfway: the other nodes must see no failed read and no wrong byte.
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

from fusecore import control
from fusecore.config import distributed_cache_size
from stoker.s3server import free_port

from .fixture import StoreProcess
from .runner import RssSampler, _proc_cpu
from .systems import Stoker
from .workloads import KiB, MiB, _parallel, read_stream

READERS = 8  # per node: a DataLoader's workers


@dataclass
class ClusterDataset:
    items: list[tuple[str, int]]

    @classmethod
    def build(cls, scale: float) -> "ClusterDataset":
        rng = random.Random(7)
        small = [(f"train/{i % 50:02d}/img-{i:05d}.jpg", rng.randint(90_000, 130_000))
                 for i in range(max(200, int(8000 * scale)))]
        shards = [(f"shards/shard-{i:02d}.tar", 16 * MiB) for i in range(max(2, int(16 * scale)))]
        return cls(small + shards)

    @property
    def bytes(self) -> int:
        return sum(size for _, size in self.items)

    def partition(self, epoch: int, nodes: int, rank: int) -> list[tuple[str, int]]:
        """DistributedSampler(shuffle=True) after set_epoch(epoch): a reshuffled 1/N for each rank."""
        order = list(range(len(self.items)))
        random.Random(epoch).shuffle(order)
        return [self.items[i] for i in order[rank::nodes]]


@dataclass
class EpochRow:
    mode: str
    epoch: str  # "warm", "1", "2", ..., "kill"
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


def cache_per_node(dataset_bytes: int, nodes: int, replicas: int) -> int:
    """The distributed cache's budget per node, as the operator sizes it (whole MiB)."""
    return int(math.ceil(distributed_cache_size(dataset_bytes, nodes, replicas) / MiB)) * MiB


class Node:
    def __init__(self, rank: int, mount: Stoker):
        self.rank, self.mount = rank, mount
        self.killed = False
        self.files = self.bytes = self.failed = self.wrong = 0

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

    def read(self, items: list[tuple[str, int]]) -> None:
        self.files = self.bytes = self.failed = self.wrong = 0
        lock = threading.Lock()

        def one(item: tuple[str, int]) -> None:
            key, size = item
            small = size <= MiB  # small files are checked whole, shards every 16 MiB and at the end
            try:
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


def _totals(nodes: list[Node], skip: int | None = None) -> tuple[int, int, int, int]:
    """(bytes received from peers, cache bytes, blocks peers did not hold, failed peer requests) summed over
    the live nodes (but `skip`)."""
    peers = cached = missed = failed = 0
    for node in nodes:
        if node.killed or node.rank == skip:
            continue
        s = node.stats()
        peers += s.get("bytes_by_source", {}).get("peers", 0)
        cached += s["cache"]["bytes"]
        for row in s.get("cluster", {}).get("peers", {}).values():
            missed += row["miss"]
            failed += row["failed"]
    return peers, cached, missed, failed


def _phase(mode: str, label: str, nodes: list[Node], store: StoreProcess, dataset: ClusterDataset,
           work, kill_rank: int | None = None) -> EpochRow:
    """Run `work(node)` on every node at once; measure the store, the peers and the mounts around it."""
    row = EpochRow(mode, label)
    before_store = store.stats()
    before_peers, _, before_missed, before_failed = _totals(nodes, skip=kill_rank)
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
        victim = nodes[kill_rank]
        os.kill(victim.pid, signal.SIGKILL)
        victim.killed = True
        row.note = f"node {kill_rank}'s mount killed (SIGKILL) 0.5 s in; its own reads are not counted"
    for t in threads:
        t.join()
    row.seconds = round(time.monotonic() - started, 2)
    cpu_after = _cpu(nodes, store, skip=kill_rank)
    row.cpu_mounts, row.cpu_store, row.cpu_readers = (round(a - b, 1) for a, b in zip(cpu_after, cpu_before))
    row.cpu_busy = round(sum(row.cpu_mounts_store_readers()) / (row.seconds * (os.cpu_count() or 1)), 2)
    after_store = store.stats()
    after_peers, cached, missed, failed = _totals(nodes)
    row.peer_missed, row.peer_failed = missed - before_missed, failed - before_failed
    live = [node for node in nodes if not node.killed]
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
    return row


def run_mode(mode: str, *, n: int, replicas: int, epochs: int, kill: bool, dataset: ClusterDataset,
             store: StoreProcess, workdir: str, cache_bytes: int, peer_timeout: float, log=print) -> list[EpochRow]:
    nodes = _start_nodes(mode, n, replicas, store, workdir, cache_bytes, peer_timeout)
    rows = []
    try:
        def warm(node: Node) -> None:
            for _ in control.warm(node.sock, []):
                pass

        rows.append(_phase(mode, "warm", nodes, store, dataset, warm))
        log(_line(rows[-1]))
        for epoch in range(1, epochs + 1):
            rows.append(_phase(mode, str(epoch), nodes, store, dataset,
                               lambda node, e=epoch: node.read(dataset.partition(e, n, node.rank))))
            log(_line(rows[-1]))
        if kill:
            e = epochs + 1
            rows.append(_phase(mode, "kill", nodes, store, dataset,
                               lambda node: node.read(dataset.partition(e, n, node.rank)), kill_rank=n - 1))
            log(_line(rows[-1]))
    finally:
        for node in nodes:
            node.mount.stop()
    return rows


def _line(row: EpochRow) -> str:
    return (f"{row.mode:>12} epoch {row.epoch:>4}: {row.seconds:6.1f} s, store {row.store_x_dataset}x dataset "
            f"({row.store_gets} GETs), peers {row.peer_x_dataset}x, {row.files_per_s_per_node} files/s per node, "
            f"rss {row.peak_rss_mib} MiB, cache {row.cache_mib_per_node} MiB/node, peer misses {row.peer_missed} "
            f"failures {row.peer_failed}"
            + (f", {row.failed_reads} FAILED" if row.failed_reads else "") + (f", {row.wrong} WRONG" if row.wrong else ""))


def run(*, n: int, replicas: int, epochs: int, kill: bool, scale: float, workdir: str, latency: float,
        bandwidth: float, peer_timeout: float, log=print) -> ClusterResult:
    dataset = ClusterDataset.build(scale)
    cache_bytes = cache_per_node(dataset.bytes, n, replicas)
    result = ClusterResult(n, replicas, dataset.bytes, len(dataset.items), cache_bytes)
    with StoreProcess({"bench": dict(dataset.items)}, latency=latency, bandwidth=bandwidth, workdir=workdir) as store:
        log(f"{n} nodes, dataset {len(dataset.items)} items, {dataset.bytes / MiB:.0f} MiB; cache "
            f"{cache_bytes / MiB:.0f} MiB per node in both modes")
        for mode in ("per-node", "distributed"):
            result.rows += run_mode(mode, n=n, replicas=replicas, epochs=epochs, kill=kill and mode == "distributed",
                                    dataset=dataset, store=store, workdir=workdir, cache_bytes=cache_bytes,
                                    peer_timeout=peer_timeout, log=log)
    return result


COLUMNS = [("mode", "mode"), ("epoch", "epoch"), ("seconds", "s"), ("store_gets", "store GETs"),
           ("store_x_dataset", "store bytes ÷ dataset"), ("peer_x_dataset", "peer bytes ÷ dataset"),
           ("files_per_s_per_node", "files/s per node"), ("peak_rss_mib", "peak RSS MiB (largest mount)"),
           ("cache_mib_per_node", "cache MiB per node"), ("peer_missed", "peer misses"),
           ("peer_failed", "peer failures"), ("cpu_mounts", "CPU s mounts"),
           ("cpu_store", "CPU s store"), ("cpu_readers", "CPU s readers"), ("cpu_busy", "cores busy"), ("failed_reads", "failed reads"), ("wrong", "wrong")]


def targets(result: ClusterResult) -> list[str]:
    """The cluster-cache issue's targets, each with its figure (met or missed)."""
    by = {(r.mode, r.epoch): r for r in result.rows}
    epochs = [r for r in result.rows if r.mode == "distributed" and r.epoch not in ("kill",)]
    total = sum(r.store_bytes for r in epochs) / result.dataset_bytes
    later = [r for r in epochs if r.epoch not in ("warm", "1")]
    later_gets = sum(r.store_gets for r in later)
    out = [f"{'met' if total <= 1.05 else 'MISSED'}: the store sent the dataset {total:.3f}x over the warm and all "
           f"epochs (target ≤ 1.05x; per-node caches: "
           f"{sum(r.store_bytes for r in result.rows if r.mode == 'per-node') / result.dataset_bytes:.3f}x)",
           f"{'met' if later and later_gets == 0 else 'MISSED'}: epochs after the first sent {later_gets} GETs "
           f"({sum(r.store_bytes for r in later)} bytes) to the store (target 0)"]
    d2, p2 = by.get(("distributed", "2")), by.get(("per-node", "2"))
    if d2 and p2 and p2.files_per_s_per_node:
        ratio = d2.files_per_s_per_node / p2.files_per_s_per_node
        out.append(f"{'met' if ratio >= 2 else 'MISSED'}: epoch 2 {d2.files_per_s_per_node} files/s per node against "
                   f"{p2.files_per_s_per_node} with per-node caches, {ratio:.2f}x (target ≥ 2x)")
    k = by.get(("distributed", "kill"))
    if k:
        out.append(f"{'met' if k.failed_reads == 0 and k.wrong == 0 else 'MISSED'}: a mount killed mid-epoch: "
                   f"{k.failed_reads} failed and {k.wrong} wrong reads on the other nodes (target 0)")
    wrong = sum(r.wrong for r in result.rows)
    if wrong:
        out.append(f"WRONG BYTES: {wrong} reads")
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
