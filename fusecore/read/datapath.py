"""Assembles one mount's data path (store, cache, fetcher, namespace, reader) and its stats.

Knows nothing of FUSE: the filesystem adapter and the control API both sit on top of it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from concurrent.futures import Future
from typing import Awaitable, Callable, Protocol, cast

import trio

from ..cache.blocks import BlockKey, block_count, block_extent
from ..cache.memory import BlockCache, Buffer
from ..cluster.tier import Cluster, check_ask, held, read_key
from ..config import WARM_FRACTION, ConfigError, Identity, MountConfig
from ..cache.disk import DiskTier, HeldFiles
from ..cache.diskview import DiskView
from .fetcher import CAUSES, Fetcher
from ..messages import JoinRequest, PathNews, WarmProgress
from ..metrics import MountMetrics
from .namespace import Namespace
from .reader import Reader
from .registry import Registry
from .writer import Writer
from .writes import Writes
from ..store.uploads import Uploads, WithClient
from ..cache.shared import FLUSH_EVERY, SharedBlocks
from ..store.objects import ObjectInfo, ObjectStore
from ..cluster.peers import BlockAsk, HandOver
from ..cache.pages import choose as choose_pages
from ..store.errors import StoreError
from .walk import DirectoryPrefetcher


log = logging.getLogger(__name__)

WORKER_STAGED = 0.75  # of a worker's own cache: bytes in flight and read ahead (the rest: blocks being read)
DISK_SETTLE = 10.0  # seconds a warm waits at its end for the disk tier to write what it fetched


class KernelReads(Protocol):
    """FUSE passthrough as the data path sees it (fuse/passthrough.py): whether the kernel takes backing files now."""

    enabled: bool

    def stats(self) -> dict: ...


class DataPath:
    def __init__(self, cfg: MountConfig, store: ObjectStore, metrics: MountMetrics | None = None, *,
                 shared: str | None = None, worker: int = 0, journal: str | None = None, writes: bool | None = None,
                 peer_handoff: str | None = None):
        """`shared`: this data path is a worker of a mount served by several processes, which share blocks, inode
        numbers and open files through that folder (cache/shared.py, registry.py); `worker`: its number, unique in
        the mount for as long as it runs (no worker started again reuses it for ~4 million starts: it is in its file
        handles, workers.next_spawn); `writes`: this data path writes (by default where the mount is writable; a
        worker of several relays its writes to the hub instead: fuse/relay.py); `peer_handoff`: a worker serves the
        distributed cache's connections its hub hands to this unix socket (process/peerfanout.py), not an address."""
        self.cfg = cfg
        self.store = store
        self.rotations = 0  # credentials replaced while mounted
        self.peer_handoff = peer_handoff
        self.passthrough: KernelReads | None = None  # set by the FUSE adapter's process where the kernel offers it
        self.metrics = metrics or MountMetrics()
        # A worker's own cache holds mostly bytes in flight and blocks until they are published (shared.py): its
        # staging room is most of it (at the usual eighth, a worker's read-ahead would not start)
        self.cache = BlockCache(cfg.worker_cache, staged_fraction=WORKER_STAGED, spares_counted=True) if cfg.worker_cache \
            else BlockCache(cfg.cache_size)
        self.metrics.bind_cache(self.cache.stats)
        self.cluster = Cluster.from_config(cfg, read_key(cfg.peer_key_file), self.metrics) if cfg.peers else None
        self.cache.lends = self.cluster is None
        self.pages = choose_pages(cfg.huge_pages, cfg.block_size)
        self.shared = SharedBlocks(shared) if shared is not None else None
        self.disk = self._disk_tier(cfg, self.shared) if cfg.disk_cache else None
        if self.disk is not None:
            self.metrics.bind_disk(self.disk.stats)
        self.fetcher = Fetcher(store, self.cache, self.metrics, block_size=cfg.block_size,
                               max_concurrency=cfg.store.max_concurrency, inflight_limit=cfg.inflight_limit,
                               read_deadline=cfg.read_deadline, cluster=self.cluster, huge_pages=self.pages.huge,
                               disk=self.disk)
        self.fetcher.shared = self.shared
        registry = Registry(shared) if shared is not None else None
        self.namespace = Namespace(store, cfg.store.prefix, cfg.metadata_ttl, self.metrics, registry=registry)
        self.reader = Reader(self.fetcher, self.metrics, block_size=cfg.block_size,
                             prefetch_limit=cfg.prefetch_limit, initial_prefetch=cfg.initial_prefetch,
                             registry=registry, worker=worker)
        self.walk = DirectoryPrefetcher(self.namespace, self.fetcher, self.cache, small_file_max=cfg.block_size,
                                        budget=cfg.prefetch_limit, read_by_kernel=self.read_by_kernel,
                                        ahead_elsewhere=self.shared.ahead_bytes if self.shared is not None else
                                        (lambda: 0))
        # A writable mount (`journal`: where its open uploads are named, for the next start to abort: uploads.py)
        self.writer: Writer | None = None
        self.writes: Writes | None = None
        if cfg.writable if writes is None else writes:
            uploads = Uploads(cast(WithClient, store), journal)  # (an S3Store: its botocore client writes)
            self.writer = Writer(uploads, part_size=cfg.part_size, concurrency=cfg.upload_concurrency,
                                 budget=cfg.part_budget, deadline=cfg.read_deadline, huge_pages=self.pages.huge)
            self.metrics.bind_writes(self.write_stats)
            self.writes = Writes(self.namespace, self.writer, allow_overwrite=cfg.allow_overwrite,
                                 allow_delete=cfg.allow_delete, forget_blocks=self.cache.invalidate)

    def _disk_tier(self, cfg: MountConfig, shared: SharedBlocks | None) -> HeldFiles:
        """The disk tier itself, or a worker's view of its hub's (cache/diskview.py)."""
        if shared is not None:
            return DiskView(cfg.disk_cache, cfg.disk_cache_size, bucket=cfg.store.bucket, block_size=cfg.block_size,
                            shared=shared, huge_pages=self.pages.huge)
        return DiskTier(cfg.disk_cache, cfg.disk_cache_size, bucket=cfg.store.bucket, block_size=cfg.block_size,
                        mountpoint=cfg.mountpoint, huge_pages=self.pages.huge)

    def start(self, nursery: trio.Nursery) -> None:
        if self.writer is not None:
            self.writer.start(nursery)
        self.fetcher.start(nursery)
        self.walk.start(nursery)
        if self.shared is not None:
            nursery.start_soon(self._tell_hub, self.shared)
        self._nursery = nursery
        if self.cluster is not None:
            try:
                self.cluster.serve(self._for_peer, nursery, handoff=self.peer_handoff)
            except OSError as exc:
                raise ConfigError("peer-listen", f"cannot serve peers on {self.cfg.peer_listen}: {exc.strerror}") \
                    from None

    @staticmethod
    async def _tell_hub(shared: SharedBlocks) -> None:
        """News of the blocks this worker published and read reach the hub at least every FLUSH_EVERY seconds."""
        while True:
            await trio.sleep(FLUSH_EVERY)
            shared.flush()

    def _for_peer(self, want: BlockAsk) -> "Buffer | Future | None":
        """On the event loop (the peer server runs on it): the bytes this node holds, a Future of the bytes it reads
        through (its own block), or None; ValueError for an ask outside this node's dataset or blocks."""
        check_ask(want, self.cfg.block_size, self.cfg.store.prefix)
        found = held(self.cache, want, self.cfg.block_size)
        block = BlockKey(want.key, want.etag, want.index)
        lo, hi = block_extent(want.index, want.size, self.cfg.block_size)
        if found is None and self.shared is not None:  # (a worker: the blocks any worker of the mount published)
            found = self.shared.read(block, hi - lo, want.start - lo, want.stop - lo, asked=True)
        cluster = self.cluster
        owned = cluster is not None and cluster.owns(want.key, want.etag, want.index)
        # An owner's ask of a whole block (a range asked stays where it is: the asker keeps only the range); of one
        # this node does not own, it owned it before the members changed and it is now the asker's
        owners_ask = not want.through and cluster is not None and (want.start, want.stop) == (lo, hi)
        if found is not None and owners_ask and not owned:
            self._let_go(block)
        if found is None and owners_ask and self.disk is not None and self.disk.where(block) is not None:
            handing: Future = HandOver()
            self._nursery.start_soon(self._from_disk_for_peer, want, block, handing)
            return handing
        if found is not None or not want.through or not owned:
            return found  # another owner asks only for what is held (peers.py: no owner waits on another)
        pending: Future = Future()
        self._nursery.start_soon(self._read_through, want, pending)
        return pending

    def _let_go(self, block: BlockKey) -> None:
        """A block handed over leaves this node's memory (the answer keeps its bytes), so that serving it never keeps
        it over the share this node owns now."""
        self.cache.discard(block)
        if self.shared is not None:  # (and the workers' shared memory: its hub evicts it)
            self.shared.let_go(block)

    async def _from_disk_for_peer(self, want: BlockAsk, block: BlockKey, handing: Future) -> None:
        """A block an owner asked for, from this node's disk tier (read and checked there), for an ask of the object
        as this node lists it (one of another size would have the disk drop a good block as damaged). One this node
        does not own (it owned it before the members changed, now the asker's) is then let go from the disk too; one
        it owns (a replica's ask, or an asker that heard of a change before this node did) stays."""
        try:
            info = await self.namespace.object_at(want.key)
            if self._disagrees(want, info, "not handed over"):
                handing.set_result(None)
                return
            data = await self.fetcher.from_disk(block, want.length)
            handing.set_result(data)
        except Exception as exc:  # noqa: BLE001 - whatever failed, the asker is answered MISS at once
            handing.set_exception(exc)
            return
        cluster, disk = self.cluster, self.disk
        if data is not None and cluster is not None and disk is not None \
                and not cluster.owns(want.key, want.etag, want.index):
            await trio.to_thread.run_sync(disk.let_go, block, limiter=self.fetcher.disk_readers)

    def _disagrees(self, want: BlockAsk, info: ObjectInfo | None, what: str) -> bool:
        """Does an ask say other than this node's listing of its object (an asker that is stale, or lies)? Counted,
        and logged at the 1st, 2nd, 4th, 8th... (no flood of lines)."""
        if info is not None and (info.size, info.etag) == (want.size, want.etag):
            return False
        assert self.cluster is not None
        self.cluster.asks_disagreeing += 1
        seen = self.cluster.asks_disagreeing
        say = log.info if seen & (seen - 1) == 0 else log.debug
        say("a peer asked %s (%s, %d bytes), which this node lists %s: %s", want.key, want.etag, want.size,
            "as no object" if info is None else f"as ({info.etag}, {info.size} bytes)", what)
        return True

    async def _read_through(self, want: BlockAsk, pending: Future) -> None:
        """Fetch bytes of a block this node owns for a peer (joining any GET of it already running here) and keep
        them: whole blocks as blocks, a random reader's range as that range (its low amplification stays). Only for
        the object as this node lists it: an ask whose size or ETag differs (an asker that is stale, or lies) is
        answered FAILED and changes nothing here, so no ask can make this node keep bytes of another length or
        drop what it holds (the asker reads the store)."""
        try:
            info = await self.namespace.object_at(want.key)
        except Exception as exc:  # noqa: BLE001 - a listing that failed: the asker reads the store
            pending.set_exception(exc)
            return
        if self._disagrees(want, info, "not read through"):
            pending.set_exception(ValueError("the ask disagrees with this node's listing"))
            return
        assert info is not None  # (one this node lists, as asked)
        try:
            if (want.start, want.stop) == block_extent(want.index, want.size, self.cfg.block_size):
                pending.set_result(memoryview(await self.fetcher.forward(info, want.index)))
            else:
                data, _, base = await self.fetcher.range(info, want.start, want.stop, visit="peer")
                pending.set_result(memoryview(data)[want.start - base:want.stop - base])
        except Exception as exc:  # noqa: BLE001 - whatever failed, the asker is answered FAILED at once
            pending.set_exception(exc)

    def held_file(self, info: ObjectInfo, memory: bool = True) -> int | None:
        """An open descriptor of a file holding exactly `info`'s bytes, for the kernel to read itself (FUSE
        passthrough), counted as served from the cache: an object of one block that the workers' shared memory holds
        (a file on tmpfs, where `memory`), else the disk tier's, checked. None where this process's memory holds the
        block: the read order is memory first (and a cold epoch's files, fetched ahead into memory and written behind
        to disk, were 9% slower read back through passthrough than from memory), and where neither holds it."""
        if not 0 < info.size <= self.cfg.block_size:
            return None
        key = BlockKey(info.key, info.etag, 0)
        if key in self.cache:
            return None
        fd = None
        if self.shared is not None:
            if memory:
                fd = self.shared.open_whole(key, info.size)
            elif self.shared.holds(key):
                return None  # (memory first: the workers read it from the shared blocks)
        if fd is None and self.disk is not None:
            fd = self.disk.open_whole(key, info.size)
        if fd is not None:
            self.metrics.bytes_served.labels(source="cache").inc(info.size)
        return fd

    def read_by_kernel(self, info: ObjectInfo) -> bool:
        """Will an open of this file be answered with its disk tier file (FUSE passthrough, `held_file`)? Then nothing
        fetches it into memory ahead of its reader: memory comes first at open, so a copy there would turn the
        kernel's own read of the file into READs this process answers."""
        return (self.disk is not None and 0 < info.size <= self.cfg.block_size and self.passthrough is not None
                and self.passthrough.enabled and self.disk.where(BlockKey(info.key, info.etag, 0)) is not None)

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.close()
        if self.disk is not None:
            self.disk.close()
        if self.shared is not None:
            self.shared.close()

    def stats(self) -> dict:
        c = self.cache.stats()
        disk = self.disk.stats() if self.disk is not None else None
        m = self.metrics
        errors = {}
        for metric in m.errors.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    errors[sample.labels["kind"]] = int(sample.value)
        gets = sum(m.value(m.get_requests, kind=k) for k in ("demand", "prefetch"))
        return {
            "pid": os.getpid(),
            "mountpoint": self.cfg.mountpoint,
            "bucket": self.cfg.store.bucket,
            "prefix": self.cfg.store.prefix,
            "cache": {
                "bytes": c.bytes, "budget": c.budget, "entries": c.entries, "staged_bytes": c.staged, "lent_bytes": c.lent,
                "hits": c.hits, "misses": c.misses, "hit_ratio": round(c.hit_ratio, 4),
                "evictions": c.evictions, "prefetch_dropped": c.prefetch_dropped,
                "recycled_buffers": self.cache.recycled,
                "pages": self.pages.size, "pages_why": self.pages.why,
            },
            "requests": {
                "get": int(gets),
                "get_prefetch": int(m.value(m.get_requests, kind="prefetch")),
                "list": int(m.value(m.list_requests)),
                "head": int(m.value(m.head_requests)),
                "body_retries": int(m.value(m.retries)),
                "throttled": int(m.value(m.throttled)),
            },
            "bytes_fetched": int(m.value(m.get_bytes)),
            # why they were fetched (fetcher.CAUSES): where a distributed cache's store bytes go past the dataset
            "store_bytes_by_cause": {cause: int(m.value(m.store_bytes, cause=cause)) for cause in CAUSES},
            "bytes_served": {
                "cache": int(m.value(m.bytes_served, source="cache")),
                "network": int(m.value(m.bytes_served, source="network")),
            },
            # where the bytes this node received came from: its cache (served to readers), peers, the store
            "bytes_by_source": {
                "local_cache": int(m.value(m.bytes_served, source="cache")),
                "disk": disk.bytes_read if disk is not None else 0,
                "peers": self.cluster.bytes_from_peers if self.cluster is not None else 0,
                "store": int(m.value(m.get_bytes)),
            },
            "inflight": {"requests": self.fetcher.inflight, "bytes": int(m.value(m.inflight_bytes))},
            "open_files": self.reader.open_files,
            "walk_prefetches": self.walk.issued,
            "walk_dirs_ahead": self.walk.dirs_ahead,
            "walk_dirs_whole": self.walk.whole_dirs,
            "fuse_reads": {"count": self.reader.read_calls, "bytes_requested": self.reader.read_bytes},
            # opens the kernel reads itself (FUSE passthrough of files held on the disk tier), when the adapter has it
            **({"passthrough": self.passthrough.stats()} if self.passthrough is not None else {}),
            "errors": errors,
            "skipped_names": self.namespace.skipped_names,
            "namespace_entries": self.namespace.entries,
            "credential_rotations": self.rotations,
            **({"cluster": self.cluster.stats()} if self.cluster is not None else {}),
            **({"disk": dataclasses.asdict(disk)} if disk is not None else {}),
            **({"shared": dataclasses.asdict(self.shared.stats)} if self.shared is not None else {}),
            **({"writes": self.write_stats()} if self.writer is not None else {}),
        }

    def write_stats(self) -> dict | None:
        """A writable mount's `writes` (None where this data path does not write)."""
        if self.writer is None:
            return None
        return {**dataclasses.asdict(self.writer.stats), "files_open": self.writer.in_flight,
                "uploads_open": self.writer.uploads.open_uploads, "requests_retried": self.writer.uploads.retried}

    def learn(self, news: list[PathNews], whole: bool = False) -> None:
        """A worker of a writable mount: what the hub wrote (fuse/relay.py), or its whole view (`whole`). Refused
        elsewhere: a mount that writes itself, or reads only, takes no one's news."""
        if not (self.cfg.writable and self.writes is None and self.shared is not None):
            raise ValueError("news: only a worker of a writable mount takes the hub's news")
        if whole:
            self.namespace.learn_whole(news)
            return
        for one in news:
            self.namespace.learn(one)

    def resize(self, cache_size: int) -> dict:
        """New cache budget (the operator sizes node caches); in-flight GET bytes follow it as at start."""
        if cache_size < 2 * self.cfg.block_size:
            raise ValueError(f"cache size must hold at least two blocks ({2 * self.cfg.block_size} bytes)")
        old = self.cfg
        local = max(2 * old.block_size, old.worker_cache * cache_size // old.cache_size) if old.worker_cache else 0
        self.cfg = dataclasses.replace(old, cache_size=cache_size, worker_cache=min(local, cache_size))
        self.fetcher.set_inflight_limit(self.cfg.inflight_limit)
        self.cache.resize(self.cfg.worker_cache or cache_size)  # (a worker: its share of the mount's new budget)
        return {"budget": self.cache.budget, "bytes": self.cache.stats().bytes}

    async def set_peers(self, members: list[str], replicas: int | None = None) -> dict:
        """New members of the distributed cache (a node joined or left); warm again to fetch what this node
        now owns."""
        if self.cluster is None:
            raise ValueError("this mount is not part of a distributed cache (--peers)")
        return await trio.to_thread.run_sync(self.cluster.set_members, members, replicas)

    async def join(self, request: JoinRequest) -> dict:
        """Become a member of a distributed cache, or update the membership of the one this mount is in
        (members, replicas, this node's address, the key). A mount serves one distributed cache at most."""
        cluster = self.cluster
        if cluster is not None and cluster.name != request.name:
            raise ValueError(f"this mount already serves distributed cache {cluster.name or '(--peers)'!r}")
        if cluster is None:
            cluster = Cluster(request.me, [request.me], 1, request.key, self.metrics, timeout=self.cfg.peer_timeout,
                              name=request.name)
            answer = await trio.to_thread.run_sync(
                lambda: cluster.set_members(list(request.members), request.replicas, entering=True))
            cluster.changes = 0
            cluster.serve(self._for_peer, self._nursery, handoff=request.handoff)
            self.cluster = self.fetcher.cluster = cluster
            self.cache.lends = False
            return answer
        cluster.rekey(request.me, request.key)
        return await trio.to_thread.run_sync(cluster.set_members, list(request.members), request.replicas)

    def rotate(self, identity: Identity) -> dict:
        """Sign with new credentials from now on (kubelet's republish or restage brought them)."""
        self.store.rotate(identity)
        self.rotations += 1
        return {"rotated": True}

    def drop(self) -> dict:
        before = self.cache.stats().bytes
        self.cache.clear()
        return {"dropped_bytes": before}

    def _warmed_blocks(self, info) -> list[int]:
        """The blocks of a file this node warms: all, or in a distributed cache the ones it owns."""
        blocks = range(block_count(info.size, self.cfg.block_size))
        if self.cluster is None:
            return list(blocks)
        return [i for i in blocks if self.cluster.owns(info.key, info.etag, i)]

    async def warm(self, paths: list[str], report: Callable[[dict], Awaitable[None]]) -> dict:
        """Load files into the cache (up to 90% of the budget: the disk tier's where it is larger than memory),
        reporting progress as it goes."""
        files = []
        for path in paths or [""]:
            files.extend(await self.namespace.walk_files(path))
        disk = self.disk
        held = self.cfg.cache_size if self.shared is not None else self.cache.budget  # (a worker warms the shared)
        budget = int(max(held, disk.budget if disk is not None else 0) * WARM_FRACTION)
        block_size = self.cfg.block_size
        planned, total, skipped = [], 0, 0
        for info in files:
            mine = self._warmed_blocks(info)
            size = sum(min(block_size, info.size - i * block_size) for i in mine)
            if mine and total + size <= budget:
                planned.append((info, mine))
                total += size
            elif mine or self.cluster is None:  # another node's file is not skipped: it is not this node's to warm
                skipped += 1
        progress = WarmProgress(files_total=len(planned), bytes_total=total, skipped_files=skipped)
        slots = trio.CapacityLimiter(self.cfg.store.max_concurrency)

        fetching = 0  # bytes of blocks being warmed, while a disk tier writes them behind

        async def warm_block(info, index: int) -> None:
            nonlocal fetching
            nbytes = min(block_size, info.size - index * block_size)
            async with slots:
                # The disk's writer takes blocks from a bounded queue and skips what does not fit (readers never
                # wait for it): a warm, which nobody waits for, fetches no faster than the disk writes.
                while disk is not None and (fetching or disk.queued_bytes) \
                        and disk.queued_bytes + fetching + nbytes > disk.queue_limit:
                    await trio.sleep(0.005)
                fetching += nbytes
                try:
                    if self.shared is None or not self.shared.touch(BlockKey(info.key, info.etag, index), nbytes):
                        # (a worker: a block the workers' shared memory holds is warm, and its hub's policy told so;
                        # loading it would copy it into this worker's own memory too)
                        await self.fetcher.block(info, index, visit="warm")
                except StoreError:
                    progress.errors += 1
                    return
                finally:
                    fetching -= nbytes
            progress.bytes_done += nbytes

        async def reporter() -> None:
            while True:
                await trio.sleep(0.25)
                await report(progress.wire())

        started = time.monotonic()
        async with trio.open_nursery() as outer:
            outer.start_soon(reporter)
            async with trio.open_nursery() as nursery:
                for info, mine in planned:
                    for index in mine:
                        async with slots:  # keep at most max_concurrency tasks queued
                            pass
                        nursery.start_soon(warm_block, info, index)
                    progress.files_done += 1
            # Done means held where the mount says it holds them: the disk's writer takes the last blocks first
            # (its queue is bounded, so this is short; a stalled disk is waited for no longer than DISK_SETTLE).
            settle = trio.current_time() + DISK_SETTLE

            async def settled(done: Callable[[], bool]) -> None:
                while not done() and trio.current_time() < settle:
                    await trio.sleep(0.005)

            if disk is not None:
                # (a worker's: its last blocks go to the hub behind the warm's tasks, and the hub's queue counts them
                # once it took their news, which its answer to a mark sent after them says)
                await settled(lambda: not self.fetcher.publishing)
                mark = self.shared.mark() if self.shared is not None else None
                if mark is not None:
                    await settled(lambda: SharedBlocks.marked(mark))
                await settled(lambda: not disk.queued_bytes)
            outer.cancel_scope.cancel()
        progress.seconds = round(time.monotonic() - started, 3)
        progress.done = True
        return progress.wire()
