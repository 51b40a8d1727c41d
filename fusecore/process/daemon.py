"""Mount lifecycle: validate the store, mount, serve the FUSE connection until unmounted or signalled."""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import functools
import logging
import os
import shutil
import signal
from typing import Callable

import trio

from ..failures import StokerError
from . import control, workers
from ..config import WORKERS_AUTO, ConfigError, MountConfig, auto_cache_size, auto_workers, block_squares
from ..cache.disk import HeldFiles
from ..read.datapath import DataPath
from ..fuse import relay
from ..fuse.adapter import StokerFS
from ..fuse.passthrough import Passthrough, SharedModes, shared_memory_backs
from ..fuse.protocol import Init, ProtocolError
from ..fuse.device import MountFailed, MountOptions, mount, unmount
from ..fuse.session import Connection
from .hubwrites import HubWrites
from .peerfanout import worker_handoff
from .template import Template, holds_sockets
from .mounts import is_mounted
from ..store.client import S3Store
from ..store.errors import StoreError

log = logging.getLogger(__name__)

ReadyCallback = Callable[[Exception | None], None]  # None: mounted and serving; else why it failed (typed)


class MountError(StokerError, RuntimeError):
    kind = "mount"


def tune_malloc() -> None:
    """Keep RSS close to the cache budget: big blocks come from mmap and go back on free."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1024 * 1024)  # M_MMAP_THRESHOLD: fixed, no dynamic growth
        libc.mallopt(-8, 4)  # M_ARENA_MAX: worker threads share a few arenas
    except (OSError, AttributeError):
        pass


def check_mountpoint(path: str) -> None:
    if not os.path.isdir(path):
        raise MountError(f"mountpoint {path} is not an existing directory")
    if is_mounted(path):
        raise MountError(f"{path} is already a mount point")


def usable_cores(cgroup_root: str = "/sys/fs/cgroup", own: str = "/proc/self/cgroup") -> float:
    """Cores this process may use: its CPU affinity, within the CPU quota (cgroup v2 `cpu.max`) of its cgroup and
    every cgroup above it (a container's limit, a pod's)."""
    cores = float(len(os.sched_getaffinity(0)))
    try:
        with open(own) as f:
            path = next((line.split("::", 1)[1].strip() for line in f if line.startswith("0::")), None)
    except OSError:
        path = None
    while path is not None:
        try:
            with open(os.path.join(cgroup_root, path.lstrip("/"), "cpu.max")) as f:
                quota, period = f.read().split()[:2]
            if quota != "max":
                cores = min(cores, int(quota) / int(period))
        except (OSError, ValueError):
            pass
        path = None if path in ("", "/") else os.path.dirname(path)
    return max(1.0, cores)


def machine_memory() -> int:
    """Bytes of memory this process may use: the machine's, or its cgroup's limit where that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def _sized(cfg: MountConfig, store: S3Store) -> MountConfig:
    """`--cache-size auto`: one listing of the dataset (no HEADs) before mounting, then the budget."""
    dataset = squares = 0  # in one pass over the listing, whatever its length
    for info in store.list_all(cfg.store.prefix):
        dataset += info.size
        squares += block_squares((info.size,), cfg.block_size)
    size, why = auto_cache_size(cfg, dataset, machine_memory(), squares)
    log.info("%s", why)
    return dataclasses.replace(cfg, cache_size=size)


def run_mount(cfg: MountConfig, ready: ReadyCallback, log_level: str = "INFO") -> int:
    """Mount and serve in this process (with several workers: this process is their hub); returns the exit
    status."""
    tune_malloc()
    template: Template | None = None
    try:
        if cfg.fuse_fd is None:
            check_mountpoint(cfg.mountpoint)
        if not cfg.control_socket:
            control.runtime_dir()  # the default socket's folder, checked before mounting (a ConfigError)
        if cfg.workers == WORKERS_AUTO:
            workers_now, why = auto_workers(cfg, usable_cores())
            log.info("%s", why)
            cfg = dataclasses.replace(cfg, workers=workers_now)
        store = S3Store(cfg.store)  # (no request yet: no socket, no thread)
        template = _fork_template(cfg, store)  # (before this process has any socket or thread)
        store.check()
        if cfg.cache_size_auto:
            cfg = _sized(cfg, store)
        if cfg.workers > 1:
            return _run_hub(cfg, store, ready, log_level, template)
        journal = _control_socket(cfg) + ".uploads"
        datapath = DataPath(cfg, store, journal=journal if cfg.writable else None)
        if datapath.writer is not None:
            swept = datapath.writer.uploads.sweep()
            if swept:
                log.info("aborted %d upload(s) a crash of this mount left open", swept)
        log.info("block buffers on %s pages: %s", datapath.pages.size, datapath.pages.why)
    except (MountError, StoreError, ConfigError) as exc:
        ready(exc)
        return 1
    finally:
        if template is not None:
            template.close()
    try:
        trio.run(_serve, cfg, datapath, ready)
    except (MountError, ConfigError) as exc:
        ready(exc)
        return 1
    finally:
        datapath.close()
    return 0


# What the mount asks of the kernel at INIT (libfuse's defaults for a read-only filesystem): concurrent reads of
# one file, page-cache invalidation on a changed size or mtime, READDIRPLUS, concurrent lookups in one directory, and
# reads of up to 1 MiB. Passthrough is asked where held files can be backing files (see _wants).
WANT = (Init.ASYNC_READ | Init.AUTO_INVAL_DATA | Init.DO_READDIRPLUS | Init.ASYNC_DIO | Init.PARALLEL_DIROPS
        | Init.MAX_PAGES)
MAX_TASKS = 128  # requests answered at once; past that the kernel queues them


async def _serve(cfg: MountConfig, datapath: DataPath, ready: ReadyCallback) -> None:
    fs = _filesystem(cfg, datapath)
    conn = _connect(cfg, datapath.disk)
    if conn.agreed is not None and conn.agreed.passthrough:
        fs.passthrough = Passthrough(conn, datapath.held_file)
        datapath.passthrough = fs.passthrough
        log.info("FUSE passthrough: files held whole on the disk tier are read by the kernel itself")
    try:
        async with trio.open_nursery() as nursery:
            datapath.start(nursery)
            if datapath.writes is not None:
                datapath.writes.on_gone = lambda parent, name: nursery.start_soon(
                    trio.to_thread.run_sync, conn.forget_entry, parent, os.fsencode(name))
            await nursery.start(control.serve, datapath, _control_socket(cfg))
            if cfg.metrics_port is not None:
                datapath.metrics.serve(cfg.metrics_port, cfg.metrics_addr)
            nursery.start_soon(_terminate_on_signal, nursery.cancel_scope)
            nursery.start_soon(_announce_ready, cfg, ready)
            await conn.serve(fs, fs.forget, waits=fs.waits, max_tasks=MAX_TASKS)
            nursery.cancel_scope.cancel()
    finally:
        if not conn.ended and cfg.fuse_fd is None:
            unmount(cfg.mountpoint)  # stopped by a signal: detach, as libfuse did
        conn.close()


def _fork_template(cfg: MountConfig, store: S3Store) -> Template | None:
    """The template the workers of a mount of several are forked from (process/template.py): each worker serves with
    its copy of `store`, made before the fork and never used in the template (its botocore client, ~8 MiB a process
    where each made its own, measured, is then shared until written)."""
    if cfg.workers == 1:
        return None
    from .cli import serve_forked

    inherited = None if holds_sockets() else store  # (a store that talked already stays the hub's)
    try:
        template = Template.fork(functools.partial(serve_forked, store=inherited))
    except OSError as exc:
        log.warning("no template for the workers (%s): each starts a new interpreter", exc.strerror or exc)
        return None
    if template is None:
        log.warning("no template for the workers (this process has threads, or cannot reap its workers): each "
                    "starts a new interpreter")
    return template


def _run_hub(cfg: MountConfig, store: S3Store, ready: ReadyCallback, log_level: str,
             template: Template | None = None) -> int:
    """Mount, start the workers on clones of the connection, and keep them (process/workers.py); a writable mount's
    writes are answered here (process/hubwrites.py)."""
    try:
        disk = workers.open_disk(cfg)  # (before INIT: whether the kernel may read its files itself)
    except ConfigError as exc:
        ready(exc)
        return 1
    try:
        conn = _connect(cfg, disk)
    except MountError as exc:
        if disk is not None:
            disk.close()
        ready(exc)
        return 1
    assert conn.agreed is not None
    try:
        shared = workers.shared_folder()
    except OSError as exc:
        conn.close()
        if disk is not None:
            disk.close()
        if cfg.fuse_fd is None:
            unmount(cfg.mountpoint)
        ready(MountError(f"cannot make the workers' shared folder: {exc.strerror or exc}"))
        return 1
    hub = workers.Hub(cfg, conn.fd, conn.agreed, shared, log_level, template)
    hub.keep_disk(disk)
    try:
        try:
            hub.open_peers()
            if cfg.writable:
                hub.writes = _hub_writes(cfg, store, hub, conn)
            for worker in [hub.start(i) for i in range(1, cfg.workers + 1)]:
                hub.wait_ready(worker)
            hub.retire_template()
        except Exception as exc:  # noqa: BLE001 - any worker that cannot serve: nothing stays mounted
            hub.stop()
            if cfg.fuse_fd is None:
                unmount(cfg.mountpoint)
            ready(exc)
            return 1
        log.info("%d workers serve the mount (shared blocks in %s)", cfg.workers, shared)
        trio.run(_serve_hub, cfg, hub, conn, ready)
    finally:
        hub.stop()
        if hub.writes is not None:
            hub.writes.close()
        if hub.disk is not None:
            hub.disk.close()
        hub.fanout.close()
        if not hub.ended and cfg.fuse_fd is None:
            unmount(cfg.mountpoint)
        conn.close()
        shutil.rmtree(shared, ignore_errors=True)
    return 0


def _hub_writes(cfg: MountConfig, store: S3Store, hub: workers.Hub, conn: Connection) -> HubWrites:
    """The hub's writes: one data path that writes (its open uploads named beside the control socket, as a single
    process's are, and those a crash left swept now), and the relay socket the workers send write-side requests to,
    listening before they start. Where the kernel reads held files itself, its opens for writing are counted in the
    modes every worker sees (fuse/passthrough.py: a file open in passthrough is not written meanwhile)."""
    writing = dataclasses.replace(hub.worker_cfg, disk_cache="", disk_cache_size=0, peers="", peer_listen="",
                                  peer_key_file="")  # (the tiers and the peers are the workers')
    datapath = DataPath(writing, store, shared=hub.shared, journal=_control_socket(cfg) + ".uploads", writes=True)
    try:
        assert datapath.writer is not None
        swept = datapath.writer.uploads.sweep()
        if swept:
            log.info("aborted %d upload(s) a crash of this mount left open", swept)
        listener = relay.listen(os.path.join(hub.shared, relay.SOCKET))
    except BaseException:
        datapath.close()
        raise
    fs = _filesystem(hub.worker_cfg, datapath)
    if conn.agreed is not None and conn.agreed.passthrough:
        fs.passthrough = Passthrough(conn, lambda info, memory: None, SharedModes(hub.shared))
    return HubWrites(datapath, fs, listener, hub.tell, hub.check_workers)


async def _serve_hub(cfg: MountConfig, hub: workers.Hub, conn: Connection, ready: ReadyCallback) -> None:
    async with trio.open_nursery() as nursery:
        if hub.writes is not None:
            await nursery.start(hub.writes.serve, conn)
        await nursery.start(hub.keep_budget)
        hub.serve_peers(nursery)
        hub.rescan()  # what the workers published before the hub listened
        await nursery.start(control.serve, hub, _control_socket(cfg))  # (the hub answers as a DataPath does)
        if cfg.metrics_port is not None:
            hub.serve_metrics(cfg.metrics_port, cfg.metrics_addr)
        nursery.start_soon(_terminate_on_signal, nursery.cancel_scope)
        nursery.start_soon(hub.supervise, nursery.cancel_scope)
        await _announce_ready(cfg, ready)


def run_worker(cfg: MountConfig, role: workers.WorkerRole, ready: ReadyCallback, store: S3Store | None = None) -> int:
    """Serve one clone of a mount's connection as worker `role.index` (started by its hub); `store`: one made for the
    mount before this process was forked from its hub's template, used where it is the worker's own store."""
    workers.die_with_parent(role.hub)
    tune_malloc()
    try:
        mine = store if store is not None and store.cfg == cfg.store else S3Store(cfg.store)
        datapath = DataPath(cfg, mine, shared=role.shared, worker=role.spawn, writes=False,
                            peer_handoff=worker_handoff(role.shared, role.index))
    except (StoreError, ConfigError) as exc:
        ready(exc)
        return 1
    try:
        ended = trio.run(_serve_worker, cfg, role, datapath, ready)
    finally:
        datapath.close()
    return workers.ENDED if ended else 3


async def _serve_worker(cfg: MountConfig, role: workers.WorkerRole, datapath: DataPath, ready: ReadyCallback) -> bool:
    """True once the connection ended (unmounted); False when stopped by a signal."""
    writes = relay.Relay(os.path.join(role.shared, relay.SOCKET)) if cfg.writable else None
    fs = _filesystem(cfg, datapath, writes)
    conn = Connection(role.fuse_fd, agreed=role.agreed())
    if conn.agreed is not None and conn.agreed.passthrough:  # (held files: the shared blocks, the disk tier's)
        # (the modes of an inode's opens are the mount's, kept where every worker sees them)
        fs.passthrough = Passthrough(conn, datapath.held_file, SharedModes(role.shared))
        datapath.passthrough = fs.passthrough
    try:
        async with trio.open_nursery() as nursery:
            datapath.start(nursery)
            await nursery.start(control.serve, datapath, role.control_socket)
            nursery.start_soon(_terminate_on_signal, nursery.cancel_scope)
            ready(None)
            await conn.serve(fs, fs.forget, waits=fs.waits, max_tasks=MAX_TASKS)
            nursery.cancel_scope.cancel()
    finally:
        conn.close()
        if writes is not None:
            writes.close()
    return conn.ended


def _filesystem(cfg: MountConfig, datapath: DataPath, writes: relay.Relay | None = None) -> StokerFS:
    """The FUSE adapter over a data path (a mount's own process, one worker of several, or their hub's writes);
    `writes`: a worker's relay of write-side requests to its hub."""
    return StokerFS(datapath.namespace, datapath.reader, block_size=cfg.block_size, kernel_cache=cfg.kernel_cache,
                    uid=os.getuid() if cfg.uid is None else cfg.uid, gid=os.getgid() if cfg.gid is None else cfg.gid,
                    on_open=datapath.walk.on_open, writes=datapath.writes, relay=writes)


def _control_socket(cfg: MountConfig) -> str:
    return cfg.control_socket or control.default_control_socket(cfg.mountpoint)


def _connect(cfg: MountConfig, disk: HeldFiles | None) -> Connection:
    """The mount's FUSE connection, INIT answered: mounted here, or the descriptor a caller mounted (CSI)."""
    if cfg.fuse_fd is None:
        options = MountOptions(fsname=f"stoker:{cfg.store.bucket}", subtype="stoker", allow_other=cfg.allow_other,
                               uid=os.getuid(), gid=os.getgid(), read_only=not cfg.writable)
        try:
            fd = mount(cfg.mountpoint, options)
        except MountFailed as exc:
            raise MountError(f"cannot mount at {cfg.mountpoint}: {exc}") from None
        except OSError as exc:
            raise MountError(f"cannot mount at {cfg.mountpoint}: {exc.strerror}") from None
    else:
        fd = cfg.fuse_fd
    conn = Connection(fd)
    try:
        conn.negotiate(want=_wants(cfg, disk), max_background=MAX_BACKGROUND)
    except (ProtocolError, OSError) as exc:
        conn.close()
        if cfg.fuse_fd is None:
            unmount(cfg.mountpoint)
        raise MountError(f"cannot serve the FUSE connection at {cfg.mountpoint}: {exc}") from None
    return conn


def _wants(cfg: MountConfig, disk: HeldFiles | None) -> int:
    """Passthrough needs files that hold objects whole (a disk tier's; the block files several workers share, where
    `shared_memory_backs`) and CAP_SYS_ADMIN to register them (root, the CSI mounter)."""
    shared = cfg.workers > 1 and shared_memory_backs(cfg.kernel_cache, cfg.writable)
    held = cfg.passthrough and ((disk is not None and disk.plain) or shared)
    # a writable mount: an open with O_TRUNC comes as one OPEN (not an OPEN and a SETATTR to size 0), and a write
    # of up to max_write as one WRITE (without BIG_WRITES the kernel sends one per page: 4 KiB)
    return int(WANT | (Init.PASSTHROUGH if held and os.geteuid() == 0 else 0)
               | (Init.ATOMIC_O_TRUNC | Init.BIG_WRITES if cfg.writable else 0))


async def _announce_ready(cfg: MountConfig, ready: ReadyCallback) -> None:
    """Report ready only once the kernel gets answers from this process."""
    st = await trio.to_thread.run_sync(os.stat, cfg.mountpoint)
    _set_read_ahead(st.st_dev, cfg.read_ahead_kb)
    log.info("mounted s3://%s/%s at %s", cfg.store.bucket, cfg.store.prefix, cfg.mountpoint)
    ready(None)


def _set_read_ahead(dev: int, kb: int) -> None:
    """Larger kernel readahead means larger, concurrent FUSE reads for sequential readers."""
    path = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"
    try:
        with open(path, "w") as f:
            f.write(str(kb))
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT):
            log.info("could not set %s: %s", path, exc)


MAX_BACKGROUND = 64  # asked at INIT: the kernel's default of 12 queued readahead requests starves several readers


async def _terminate_on_signal(serving: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("signal %d: unmounting", signum)
            serving.cancel()
            return
