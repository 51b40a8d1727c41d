"""A mount served by several processes (`--workers N`, design §8).

The hub (the mount's own process) mounts, answers INIT and keeps the connection; each worker is a process of its
own (`python -m fusecore serve-worker`) that serves a clone of that connection (session.clone) with a whole data
path of its own: its own GETs, namespace and read-ahead, so that every core can answer requests. The kernel hands
each request to whichever worker reads first; what a reply depends on is the same in every worker:

- blocks: files in the mount's shared folder on tmpfs (cache/shared.py), fetched once whichever worker asked, kept or
  evicted here in the hub (SharedPolicy) within the mount's one budget, which the workers' own small caches (bytes
  in flight, blocks being read) are part of (`budgets`);
- inode numbers derived from paths, and an open file's version, in the same folder (read/registry.py).

The hub also supervises: a worker that dies is started again on a new clone (the requests it held fail with
ECONNABORTED, as the kernel ends them; no other read is touched); a worker that ends because the connection ended
(unmounted) ends the mount. The control socket is the hub's: `stats` sums the workers' own, the other requests go to
every worker (`warm` to one: the blocks it fetches are every worker's).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import mmap
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import trio
from prometheus_client import CollectorRegistry, Gauge, generate_latest, start_http_server

from ..cache import shared as blocks
from ..cache.disk import DiskTier
from ..cache.pages import choose as choose_pages
from ..config import ConfigError, Identity, MountConfig, identity_document, mount_document
from ..fuse.passthrough import SharedModes
from ..fuse.protocol import Agreed
from ..messages import JoinRequest
from ..metrics import Summed, disk_gauges, write_gauges
from ..fuse.session import clone
from ..read.reader import MAX_SPAWN
from ..read.registry import Registry
from . import control
from .hubwrites import HubWrites
from .launch import LaunchFailed, _read_ready, ended
from .peerfanout import PeerFanout, worker_handoff
from .template import Forked, Strays, Template, TemplateGone

log = logging.getLogger(__name__)

SHARED_BASE = "/dev/shm"  # tmpfs on every Linux: block files cost memory, not disk
READY_TIMEOUT = 60.0  # seconds a worker may take to start serving
RESCAN_EVERY = 5.0  # seconds between the hub's looks at the shared folder (news a full socket dropped)
ENDED = 0  # a worker's exit status when the connection ended (unmounted): the mount ends
_HEX = frozenset(b"0123456789abcdef")
_MARK = re.compile(rb"[0-9]{1,10}-[0-9]{1,19}")
RESTART_FIRST, RESTART_MAX = 0.5, 30.0  # seconds between tries of a worker that does not start again
PF_EXITING = 0x4  # /proc/<pid>/stat flags: the task is exiting
TELL_TRIES = 3  # a message to a worker (the hub's news) is sent again this often where it could not be delivered
STRAYS_EVERY = 1.0  # seconds between looks for zombies the hub adopted (Strays)
LOCAL_BLOCKS = 8  # a worker's own cache: its bytes in flight and this many blocks being read (at most half the budget)


@dataclass(frozen=True)
class WorkerRole:
    """What the hub tells a worker beside the mount's configuration (command-line flags of serve-worker)."""

    index: int  # from 1
    spawn: int  # this start of it, unique in the mount for ~4 million starts (next_spawn: its file handles are new)
    shared: str  # the shared folder
    fuse_fd: int  # its clone of the connection
    minor: int  # what INIT agreed
    flags: int
    max_write: int
    hub: int  # the hub's pid

    @property
    def control_socket(self) -> str:
        return os.path.join(self.shared, f"w{self.index}.sock")

    def agreed(self) -> Agreed:
        return Agreed(self.minor, self.flags, self.max_write, max(1, self.max_write // 4096))


def budgets(cfg: MountConfig) -> tuple[MountConfig, int]:
    """A worker's configuration (its own cache and bytes in flight: its share; read-ahead sized from the mount's
    budget, as one process's) and the shared blocks' budget: the two together are the mount's one budget."""
    n = cfg.workers
    half = cfg.cache_size // (2 * n)  # (at least two blocks: MountConfig checks)
    inflight = max(cfg.block_size, min(cfg.inflight_limit // n, half // 2))
    local = max(2 * cfg.block_size, min(half, inflight + LOCAL_BLOCKS * cfg.block_size))
    worker = dataclasses.replace(cfg, worker_cache=local, max_inflight_bytes=inflight, cache_size_auto=False,
                                 metrics_port=None, control_socket=None, fuse_fd=None, workers=1)  # (one of them)
    return worker, max(2 * cfg.block_size, cfg.cache_size - n * local)


def open_disk(cfg: MountConfig) -> DiskTier | None:
    """The disk tier of a mount of several workers (--disk-cache), opened by the hub before any worker starts: DIR's
    lock is the hub's, and so are its index, its budget and its writes (the workers read it: cache/diskview.py)."""
    if not cfg.disk_cache:
        return None
    return DiskTier(cfg.disk_cache, cfg.disk_cache_size, bucket=cfg.store.bucket, block_size=cfg.block_size,
                    mountpoint=cfg.mountpoint, huge_pages=choose_pages(cfg.huge_pages, cfg.block_size).huge)


def next_spawn(spawn: int) -> int:
    """The spawn number of the next start of a worker: a new one for ~4 million starts, then from 1 again (the file
    handles of a start that far back are long closed), never past the reader handles' room below a write's."""
    return spawn % MAX_SPAWN + 1


def shared_folder() -> str:
    """A new private folder for one mount's shared blocks, under /dev/shm; folders of hubs that died (kill -9) are
    removed first (their blocks would otherwise hold memory until reboot)."""
    base = SHARED_BASE if os.path.isdir(SHARED_BASE) else "/tmp"
    prefix = f"stoker-{os.geteuid()}-"
    for name in os.listdir(base):
        if name.startswith(prefix) and name[len(prefix):].isdigit() and ended(int(name[len(prefix):])):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
    path = os.path.join(base, f"{prefix}{os.getpid()}")
    shutil.rmtree(path, ignore_errors=True)
    os.mkdir(path, 0o700)
    blocks.prepare(path)
    Registry.prepare(path)
    SharedModes.prepare(path)
    return path


class Worker:
    """One worker process as the hub sees it."""

    def __init__(self, role: WorkerRole, proc: subprocess.Popen | Forked, ready_fd: int):
        self.role, self.proc, self.ready_fd = role, proc, ready_fd
        self.ready = False  # it said it serves (a start that failed served nothing: its end is no death)

    def exiting(self) -> bool:
        """Has it died, or begun to? The kernel marks a task exiting (PF_EXITING) before it closes its descriptors,
        which is when the requests the worker held are failed: checked at /proc, it is known before any writer sees
        such a failure."""
        if self.proc.poll() is not None:
            return True
        try:
            with open(f"/proc/{self.proc.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            return fields[0] in (b"Z", b"X", b"x") or bool(int(fields[6]) & PF_EXITING)
        except (OSError, IndexError, ValueError):
            return True


class Hub:
    """Starts and supervises the workers, keeps the shared blocks within the budget, answers the control socket."""

    def __init__(self, cfg: MountConfig, fd: int, agreed: Agreed, shared: str, log_level: str,
                 template: Template | None = None):
        self.cfg = cfg
        self.template = template  # what workers are forked from (template.py); None: each is a new interpreter
        self.fd = fd
        self.agreed = agreed
        self.shared = shared
        self.log_level = log_level
        self.worker_cfg, budget = budgets(cfg)
        self.policy = blocks.SharedPolicy(budget)
        self._show_ahead = blocks.counter_mirror(shared, blocks.AHEAD)
        self.workers: dict[int, Worker] = {}
        self.restarts = 0
        self.spawns = 0
        self._delay: dict[int, float] = {}  # a worker that does not start again is tried less and less often
        self._next_try: dict[int, float] = {}
        self._mourned: set[int] = set()  # spawns whose end was seen
        self.strays = Strays()  # zombies of processes adopted as a subreaper (template.py)
        self._tells = trio.CapacityLimiter(16)  # threads of news to workers (never behind the uploads' threads)
        self.stopping = False
        self.ended = False  # the connection ended (unmounted)
        self._blocks_dir = os.path.join(shared, blocks.BLOCKS)
        self.writes: HubWrites | None = None  # a writable mount's writes, answered here (hubwrites.py)
        self.disk: DiskTier | None = None  # the mount's disk tier: kept here, read by every worker (diskview.py)
        self.fanout = PeerFanout(shared, cfg.workers)  # a distributed cache's connections, handed to the workers
        self._listener: socket.socket | None = None
        self._joined: JoinRequest | None = None  # the last join (a worker started again is told it)
        self._membership: dict | None = None  # the last change of members (likewise)
        self.nursery: trio.Nursery | None = None  # the hub's (set while it serves)
        self._disk_registry: CollectorRegistry | None = None

    def open_peers(self) -> None:
        """--peers: the member's address, bound here before any worker starts (the workers serve what it accepts)."""
        if not self.cfg.peers:
            return
        try:
            self._listener = self.fanout.listen(self.cfg.peer_listen)
        except OSError as exc:
            raise ConfigError("peer-listen", f"cannot serve peers on {self.cfg.peer_listen}: {exc.strerror}") \
                from None

    def serve_peers(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        if self._listener is not None:
            nursery.start_soon(self.fanout.accept, self._listener)

    def keep_disk(self, disk: DiskTier | None) -> None:
        """The mount's disk tier (open_disk), kept here: its queue shown to the workers, its gauges served here."""
        self.disk = disk
        if disk is not None:
            disk.queue_mirror = blocks.counter_mirror(self.shared, blocks.DISK_QUEUE)
            disk.trust_table = blocks.TrustTable(self.shared)  # (what it writes, its workers hand out unread)
            self._disk_registry = CollectorRegistry()
            disk_gauges(self._disk_registry, disk.stats)

    # ---- workers ---------------------------------------------------------------------------
    def start(self, index: int) -> Worker:
        """Start worker `index` on a new clone of the connection."""
        mine = clone(self.fd)
        self.spawns = next_spawn(self.spawns)
        self._mourned.discard(self.spawns)
        role = WorkerRole(index, self.spawns, self.shared, mine, self.agreed.minor, self.agreed.flags,
                          self.agreed.max_write, os.getpid())
        read_fd, write_fd = os.pipe()
        document = {"config": mount_document(self.worker_cfg),
                    "credentials": identity_document(self.cfg.store.credentials), "log_level": self.log_level}
        try:
            proc = self._fork(role, document, [mine, write_fd]) if self.template is not None else \
                self._spawn(role, document, mine, write_fd)
        finally:
            os.close(mine)
            os.close(write_fd)
        if proc is None:  # the template failed this start: a new one, on a new clone, pipe and spawn number (a
            os.close(read_fd)  # worker it may have forked with these fails at its ready line and ends)
            return self.start(index)
        worker = self.workers[index] = Worker(role, proc, read_fd)
        return worker

    def retire_template(self) -> None:
        """The workers serve: the template ends (see template.py: what it holds is ~11 MiB of pages every other
        process has written since); a worker started again from now on is a new interpreter."""
        if self.template is not None:
            self.template.close()
            self.template = None

    def _fork(self, role: WorkerRole, document: dict, fds: list[int]) -> Forked | None:
        """The worker forked from the template (template.py); None where the template failed (it is not asked
        again: the workers start as new interpreters)."""
        assert self.template is not None
        try:
            return Forked(self.template.start({"document": document, "role": dataclasses.asdict(role)}, fds))
        except TemplateGone as exc:
            log.warning("%s: worker %d, and any started after it, starts as a new interpreter", exc, role.index)
            self.template.close(grace=0)
            self.template = None
            return None

    def _spawn(self, role: WorkerRole, document: dict, mine: int, write_fd: int) -> subprocess.Popen:
        """The worker as a new interpreter (`python -m fusecore serve-worker`), its document on stdin."""
        argv = [sys.executable, "-P", "-m", "fusecore", "serve-worker", "--ready-fd", str(write_fd),
                "--fuse-fd", str(mine), "--worker", str(role.index), "--spawn", str(role.spawn),
                "--shared", self.shared, "--hub", str(role.hub),
                "--minor", str(role.minor), "--flags", str(role.flags), "--max-write", str(role.max_write)]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, pass_fds=[mine, write_fd], close_fds=True)
        try:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(document).encode())
            proc.stdin.close()
        except OSError:
            pass  # it died already: its ready pipe says why
        return proc

    def wait_ready(self, worker: Worker, timeout: float = READY_TIMEOUT) -> None:
        """Block until the worker serves (its ready line), or raise with why it did not."""
        answer = _read_ready(worker.ready_fd, timeout)
        if answer == "OK":
            worker.ready = True
            return
        worker.proc.kill()
        worker.proc.wait()
        if answer and answer.startswith("ERR "):
            kind, _, message = answer[4:].partition(" ")
            raise LaunchFailed(f"worker {worker.role.index}: {message}", kind)
        raise LaunchFailed(f"worker {worker.role.index} did not start (status {worker.proc.returncode})")

    async def supervise(self, done: trio.CancelScope) -> None:
        """Start a worker that died again; end the mount when a worker ends because the connection did."""
        next_reap = trio.current_time()
        while not self.stopping:
            await trio.sleep(0.05)
            if trio.current_time() >= next_reap:
                next_reap = trio.current_time() + STRAYS_EVERY
                self.strays.reap({w.proc.pid for w in self.workers.values()}
                                 | ({self.template.pid} if self.template is not None else set()))
            for index, worker in list(self.workers.items()):
                status = worker.proc.poll()
                if status is None or self.stopping:
                    continue
                if status == ENDED:
                    log.info("worker %d: the connection ended (unmounted)", index)
                    self.ended = True
                    done.cancel()
                    return
                self._mourn(index, worker)
                now = trio.current_time()
                if now < self._next_try.get(index, 0.0):
                    continue
                self._sweep_claims()
                try:
                    replacement = self.start(index)
                    await trio.to_thread.run_sync(self.wait_ready, replacement)
                    self._delay.pop(index, None)
                    await self._tell_cluster(replacement)
                except Exception as exc:  # noqa: BLE001 - tried again later, less and less often
                    delay = self._delay[index] = min(RESTART_MAX, self._delay.get(index, RESTART_FIRST) * 2)
                    self._next_try[index] = trio.current_time() + delay
                    log.error("worker %d did not start again (%s): next try in %gs", index, exc, delay)

    def _sweep_claims(self) -> None:
        """Before a worker that died starts again: its claims (its descriptors are closed, their locks free) go."""
        try:
            swept = blocks.sweep_claims(self.shared)
        except OSError as exc:
            log.warning("the claims of a worker that died were not removed: %s", exc)
            return
        if swept:
            log.info("removed %d claim(s) of blocks a worker that died was fetching", swept)

    async def _tell_cluster(self, worker: Worker) -> None:
        """A worker started again is told the distributed cache it serves as it is now (a join, new members)."""
        messages = []
        if self._joined is not None:
            messages.append(self._joined_by(worker.role.index))
        if self._membership is not None:
            messages.append(self._membership)
        for message in messages:
            try:
                await trio.to_thread.run_sync(control.call, worker.role.control_socket, message, 10.0)
            except (OSError, ValueError, control.ControlError) as exc:
                log.warning("worker %d was not told the distributed cache (%s): it asks the store", worker.role.index,
                            exc)

    def _joined_by(self, index: int) -> dict:
        """The last join as worker `index` serves it: on its own hand-off socket, which the hub hands connections
        to (process/peerfanout.py)."""
        assert self._joined is not None
        return dataclasses.replace(self._joined, handoff=worker_handoff(self.shared, index)).wire()

    def _mourn(self, index: int, worker: Worker) -> None:
        """A worker that served has died (once per start of it): counted, and a writable mount's files then being
        written fail (hubwrites.py)."""
        if worker.role.spawn in self._mourned:
            return
        self._mourned.add(worker.role.spawn)
        if not worker.ready:
            return
        self.restarts += 1
        log.warning("worker %d (pid %d) ended (status %s): starting it again (the requests it held failed)", index,
                    worker.proc.pid, worker.proc.poll())
        if self.writes is not None:
            self.writes.worker_died(index)

    def check_workers(self) -> None:
        """Before a written file is completed: a worker that died or is dying is mourned first (its end may have
        failed a WRITE of that file that never reached the hub)."""
        for index, worker in list(self.workers.items()):
            if worker.ready and worker.role.spawn not in self._mourned and worker.exiting():
                self._mourn(index, worker)

    def stop(self) -> None:
        """Ask every worker to end, then make sure they did."""
        self.stopping = True
        for worker in self.workers.values():
            if worker.proc.poll() is None:
                worker.proc.terminate()
        deadline = time.monotonic() + 10
        for worker in self.workers.values():
            try:
                worker.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.proc.kill()
                worker.proc.wait()

    # ---- the shared blocks -----------------------------------------------------------------
    async def keep_budget(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Take the workers' news (a block published, a block read) and evict past the budget."""
        events = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_DGRAM)
        await events.bind(os.path.join(self.shared, blocks.HUB_SOCKET))
        events.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, 4 * 1024 * 1024)
        task_status.started()
        with events:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._rescan)
                while True:
                    for message in (await events.recv(blocks.NEWS_BATCH + 256)).split(b"\n"):
                        self._news(message)

    def _news(self, message: bytes) -> None:
        """"hit NAME", "add NAME SIZE [KEEP]" (a block published, and the name the disk tier keeps it under), "drop
        NAME" (a block handed over to its new owner on another node: let go), "dhit KEEP" or "ddrop KEEP" (a worker
        used, or removed as damaged, a file of the disk tier); anything else (a block name is 32 hex digits, a disk
        tier's file 64) is ignored."""
        verb, _, rest = message.partition(b" ")
        name, _, rest = rest.partition(b" ")
        if verb == b"mark":
            if _MARK.fullmatch(name):  # (a worker's pid and its count of marks: no path of anyone's choosing)
                with open(os.path.join(self.shared, blocks.MARKS, name.decode()), "wb"):
                    pass
            return
        if verb in (b"dhit", b"ddrop"):
            if self.disk is not None and _named(name, 64):
                (self.disk.touch if verb == b"dhit" else self.disk.forgotten)(name.decode())
            return
        if not _named(name, 32):
            return
        if verb == b"hit":
            self.policy.hit(name.decode())
            self._show_ahead(self.policy.ahead_bytes)
            return
        if verb == b"drop":
            self.policy.forget(name.decode())
            self._evict([name.decode()])
            self._show_ahead(self.policy.ahead_bytes)
            return
        size, _, keep = rest.partition(b" ")
        if verb in (b"add", b"ahead") and size.isdigit():
            if keep and _named(keep, 64):  # (first: the policy may evict this very block at once, a small budget's)
                self._keep(name.decode(), keep.decode())
            self._evict(self.policy.admit(name.decode(), int(size), ahead=verb == b"ahead"))
            self._show_ahead(self.policy.ahead_bytes)

    def _keep(self, name: str, keep: str) -> None:
        """The disk tier writes a published block from its file (mapped: its bytes are already in memory, in the
        shared blocks' budget; one the policy evicts before it is written keeps its pages until then, within the
        disk tier's write queue, 32 MiB); one evicted before this is not written."""
        if self.disk is None or self.disk.still_holds(keep):
            return
        try:
            fd = os.open(os.path.join(self._blocks_dir, name), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            size = os.fstat(fd).st_size
            data = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
        except OSError:
            return
        finally:
            os.close(fd)
        if data is not None:
            self.disk.keep(keep, data)

    def _evict(self, names: list[str]) -> None:
        for name in names:
            try:
                os.unlink(os.path.join(self._blocks_dir, name))
            except FileNotFoundError:
                pass

    async def _rescan(self) -> None:
        while True:
            await trio.sleep(RESCAN_EVERY)
            self.rescan()

    def rescan(self) -> None:
        """The files as they are: one published whose news was dropped is counted; one gone is forgotten."""
        present: dict[str, int] = {}
        with os.scandir(self._blocks_dir) as entries:
            for entry in entries:
                try:
                    present[entry.name] = entry.stat().st_size
                except FileNotFoundError:
                    pass
        for name in [n for n in self.policy.names() if n not in present]:
            self.policy.forget(name)
        self._show_ahead(self.policy.ahead_bytes)
        for name, size in present.items():
            if name not in self.policy and len(name) == 32:  # (not a file the workers would ever write)
                self._evict(self.policy.admit(name, size))

    # ---- the control socket: the hub answers for the mount -----------------------------------
    def _sockets(self) -> list[str]:
        return [w.role.control_socket for w in self.workers.values() if w.proc.poll() is None]

    async def tell(self, message: dict) -> None:
        """A message to every worker serving now, each answered before this returns, sent again where it could not
        be delivered (a writable mount's news: hubwrites.py), on threads of its own (never behind the uploads')."""
        await self._each(message, tries=TELL_TRIES, limiter=self._tells)

    def learn(self, news: list, whole: bool = False) -> None:
        raise ValueError("the hub learns no news: its workers do")

    async def _each(self, message: dict | Callable[[int], dict], *, tries: int = 1,
                    limiter: trio.CapacityLimiter | None = None) -> list[dict]:
        """The answers of every worker serving now to `message` (or to `message(index)`, worker `index`'s own);
        one that does not answer (a worker starting again) is asked `tries` times, then left out."""
        async def one(index: int, path: str, into: list[dict]) -> None:
            sent = message(index) if callable(message) else message
            for attempt in range(tries):
                try:
                    into.append(await trio.to_thread.run_sync(control.call, path, sent, 10.0, limiter=limiter))
                    return
                except (OSError, ValueError, control.ControlError) as exc:
                    if attempt == tries - 1:
                        log.info("worker at %s did not answer %s: %s", path, sent.get("op"), exc)
                    else:
                        await trio.sleep(0.05 * (attempt + 1))

        answers: list[dict] = []
        async with trio.open_nursery() as nursery:
            for w in self.workers.values():
                if w.proc.poll() is None:
                    nursery.start_soon(one, w.role.index, w.role.control_socket, answers)
        return answers

    async def stats(self) -> dict:
        answers = await self._each({"op": "stats"})
        total = _sum(answers) if answers else {}
        local = total.get("cache", {}).get("bytes", 0)
        total["pid"] = os.getpid()
        total.setdefault("cache", {}).update({"bytes": local + self.policy.bytes, "budget": self.cfg.cache_size})
        total["open_files"] = len(os.listdir(os.path.join(self.shared, "fh")))
        total["workers"] = {"count": len(self.workers), "pids": [w.proc.pid for w in self.workers.values()],
                            "restarts": self.restarts, "strays_reaped": self.strays.reaped,
                            "template": self.template.pid if self.template is not None else None}
        if self.writes is not None:
            total["writes"] = self.writes.stats()
        total.setdefault("shared", {}).update({"bytes": self.policy.bytes, "budget": self.policy.budget,
                                               "blocks": len(self.policy), "evictions": self.policy.evictions,
                                               "hits": self.policy.hits})
        if self.disk is not None:
            total["disk"] = self._disk_stats(total.get("disk", {}))
        member = next((a["cluster"] for a in answers if "cluster" in a), None)
        if member is not None:  # one member, whichever worker answered: its membership is each worker's
            total.setdefault("cluster", {}).update({k: v for k, v in member.items() if k in MEMBERSHIP},
                                    connections_handed=self.fanout.handed, connections_refused=self.fanout.refused)
        return total

    def _disk_stats(self, read: dict) -> dict:
        """The disk tier as one: what it holds, its budget and writes (the hub's), and the workers' reads of it."""
        assert self.disk is not None
        kept = dataclasses.asdict(self.disk.stats())
        for name in ("hits", "misses", "bytes_read", "dropped", "errors"):
            kept[name] += read.get(name, 0)
        return kept

    async def drop(self) -> dict:
        before = self.policy.bytes
        self._evict(list(self.policy.names()))
        self.rescan()
        answers = await self._each({"op": "drop"})
        return {"dropped_bytes": before + sum(a.get("dropped_bytes", 0) for a in answers)}

    async def resize(self, cache_size: int) -> dict:
        cfg = dataclasses.replace(self.cfg, cache_size=cache_size)
        worker, budget = budgets(cfg)
        await self._each({"op": "resize", "cache_size": cache_size})  # (each worker takes its share: DataPath)
        self.cfg, self.worker_cfg = cfg, worker
        self._evict(self.policy.resize(budget))
        return {"budget": cache_size, "bytes": self.policy.bytes}

    async def rotate(self, identity: Identity) -> dict:
        self.cfg = dataclasses.replace(self.cfg, store=dataclasses.replace(self.cfg.store, credentials=identity))
        if self.writes is not None:  # (the hub's own uploads sign with them too)
            self.writes.datapath.rotate(identity)
        await self._each({"op": "credentials", "credentials": identity_document(identity)})
        return {"rotated": True}

    def serve_metrics(self, port: int, addr: str) -> None:
        """--metrics-port: the workers' metrics summed (asked of each at scrape time), beside the hub's own gauges
        of the shared blocks."""
        registry = CollectorRegistry()
        registry.register(Summed(self._metrics_texts))
        for name, doc, value in (
                ("stoker_shared_bytes", "Bytes of the blocks the workers share", lambda: self.policy.bytes),
                ("stoker_shared_budget_bytes", "Budget of the shared blocks", lambda: self.policy.budget),
                ("stoker_shared_evictions", "Shared blocks evicted (total)", lambda: self.policy.evictions),
                ("stoker_workers", "Worker processes serving the mount", lambda: len(self._sockets())),
                ("stoker_worker_restarts", "Workers started again after they died (total)", lambda: self.restarts)):
            Gauge(name, doc, registry=registry).set_function(value)
        if self.writes is not None:
            write_gauges(registry, self.writes.stats)
        start_http_server(port, addr=addr, registry=registry)

    def _metrics_texts(self) -> list[str]:
        """The workers' expositions, and the hub's own disk tier's: the workers' gauges of it count their reads of
        it, the hub's what it holds and writes; summed, they are the mount's."""
        texts = [generate_latest(self._disk_registry).decode()] if self._disk_registry is not None else []
        for path in self._sockets():
            try:
                texts.append(str(control.call(path, {"op": "metrics"}, 5.0).get("text", "")))
            except (OSError, control.ControlError) as exc:
                log.info("worker at %s gave no metrics: %s", path, exc)
        return texts

    async def set_peers(self, members: list[str], replicas: int | None = None) -> dict:
        message = {"op": "peers", "members": list(members), "replicas": replicas}
        answers = await self._each(message)
        if not answers:
            raise ValueError("no worker took the new members (see the mount's log)")
        self._membership = message
        return answers[0]

    async def join(self, request: JoinRequest) -> dict:
        """Each worker joins (on its own hand-off socket); then the hub takes the connections the node's peer
        router hands to the join's socket, and hands them to the workers."""
        if not self.fanout.receiving(request.handoff):  # (first: a socket that cannot be bound fails the join)
            assert self.nursery is not None
            self.fanout.stop_receiving()
            sock = self.fanout.receive(request.handoff)
            self.nursery.start_soon(self.fanout.take_handed, sock)
        previous = self._joined, self._membership
        self._joined, self._membership = request, None  # (first: a worker started again meanwhile is told it)
        answers = await self._each(self._joined_by)
        if len(answers) < len(self._sockets()):
            log.warning("%d of %d workers joined distributed cache %s (see the log above): a worker started again "
                        "is told the join", len(answers), len(self._sockets()), request.name)
        if not answers:
            self._joined, self._membership = previous
            raise ValueError("no worker joined the distributed cache (see the mount's log)")
        return answers[0]

    async def warm(self, paths: list[str], report: Callable[[dict], Awaitable[None]]) -> dict:
        """One worker warms: the blocks it fetches are published for all of them."""
        sockets = self._sockets()
        if not sockets:
            raise ValueError("no worker is serving")
        send, receive = trio.open_memory_channel[dict](16)
        token = trio.lowlevel.current_trio_token()

        def relay() -> None:
            try:
                for answer in control.request(sockets[0], {"op": "warm", "paths": paths}, None):
                    trio.from_thread.run(send.send, answer, trio_token=token)
            finally:  # on the loop's thread: closed from this one, a channel's waiting receiver broke trio itself
                trio.from_thread.run_sync(send.close, trio_token=token)

        last: dict = {}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, relay)
            async with receive:
                async for answer in receive:
                    if last:
                        await report(last)
                    last = answer
        return last


MEMBERSHIP = ("members", "replicas", "share", "membership_changes")  # a member's, not summed over its workers


def _named(name: bytes, length: int) -> bool:
    return len(name) == length and _HEX.issuperset(name)


def _sum(answers: list[dict]) -> dict:
    """The workers' stats as one mount's: numbers added, everything else the first worker's."""
    first = answers[0]
    out: dict = {}
    for name, value in first.items():
        values = [a.get(name) for a in answers]
        if isinstance(value, dict):
            out[name] = _sum([v for v in values if isinstance(v, dict)])
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = sum(v for v in values if isinstance(v, (int, float)))
        else:
            out[name] = value
    cache = out.get("cache")
    if isinstance(cache, dict) and cache.get("hits", 0) + cache.get("misses", 0):
        cache["hit_ratio"] = round(cache["hits"] / (cache["hits"] + cache["misses"]), 4)
    return out


def die_with_parent(hub: int) -> None:
    """A worker ends when its hub does (PR_SET_PDEATHSIG): no worker serves a mount nobody supervises; and one whose
    hub died before it asked for that ends at once."""
    import ctypes

    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != hub:
        raise SystemExit(f"the hub (pid {hub}) is gone")
