"""A writable mount served by several workers: its writes, answered in the hub (fuse/relay.py says why and how).

The hub keeps a data path of its own that writes (one Writer: one part budget for the mount, one journal of open
uploads, swept at start as a single process's is) and answers each relayed request with the FUSE adapter, as a mount
served by one process would. Before the answer goes back, every worker hears what the request changed
(messages.PathNews, sent again where a worker did not take it), so that a file written through one worker is listed
and read through any other at once; every 2 s each worker also gets the whole view (files being written, directories
made), which a worker started again or one that missed news needs. A worker that dies fails every file then being
written (EIO at its close, its upload aborted): a WRITE the kernel failed with that worker may never have reached the
hub, and a file must never become an object without it. So before a FLUSH, FSYNC or RELEASE completes a file the
hub looks at its workers (a dying one is marked exiting by the kernel before it closes its descriptors, which is
when its requests fail).
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any, Awaitable, Callable, Sequence

import trio

from ..fuse import protocol as p
from ..fuse import relay
from ..fuse.adapter import StokerFS
from ..fuse.session import Buffer, Connection
from ..read.datapath import DataPath
from ..read.namespace import valid_name
from ..store.errors import StoreError

log = logging.getLogger(__name__)

RESYNC_EVERY = 2.0  # seconds between the whole views sent to the workers
_COMPLETING = frozenset({p.Op.FLUSH, p.Op.FSYNC, p.Op.RELEASE})  # what may make a file an object
_NAMED: dict[int, int] = {p.Op.CREATE: p.CREATE_IN.size, p.Op.MKDIR: p.MKDIR_IN.size, p.Op.UNLINK: 0, p.Op.RMDIR: 0}


class HubWrites:
    def __init__(self, datapath: DataPath, fs: StokerFS, listener: socket.socket,
                 tell: Callable[[dict], Awaitable[None]], check_workers: Callable[[], None] = lambda: None):
        assert datapath.writes is not None
        self.datapath = datapath
        self.fs = fs
        self._listener = listener  # (relay.listen: listening before the workers start)
        self._tell = tell  # a message to every worker's control socket (Hub.tell)
        self._check_workers = check_workers  # a worker dead or dying is mourned now (Hub.check_workers)
        self._told_whole = False  # the last whole view sent named something (the next one must clear it)
        # News is worked out and delivered under one lock: what a worker takes last is never older than what it took
        # before (a whole view worked out before a CREATE never lands after that CREATE's news)
        self._telling = trio.Lock()

    async def serve(self, conn: Connection, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        writes = self.datapath.writes
        assert writes is not None
        async with trio.open_nursery() as nursery:
            self.datapath.start(nursery)
            writes.on_gone = lambda parent, name: nursery.start_soon(
                trio.to_thread.run_sync, conn.forget_entry, parent, os.fsencode(name))
            await nursery.start(relay.serve, self._listener, self.answer)
            nursery.start_soon(self._resync)
            task_status.started()

    async def answer(self, request: p.Request) -> Sequence[Buffer]:
        """A relayed request, answered by the adapter; what it changed, every worker hears first."""
        if request.opcode in _COMPLETING:
            self._check_workers()  # (a dead worker may have failed a WRITE of this file the hub never saw)
        paths = await self._paths_of(request)
        ns = self.datapath.namespace
        before = [ns.news_of(path) for path in paths]
        try:
            return await self.fs(request)
        finally:
            async with self._telling:
                changed = [now for now, then in zip(map(ns.news_of, paths), before) if now != then]
                if changed:
                    await self._tell({"op": "news", "news": [n.to_wire() for n in changed]})

    async def _paths_of(self, request: p.Request) -> list[str]:
        """The path a request may change (none for a WRITE: a file's growing size is asked of the hub)."""
        if request.opcode in (p.Op.WRITE, p.Op.GETATTR, p.Op.RENAME, p.Op.RENAME2):
            return []
        try:
            node = await self.datapath.namespace.resolve(request.nodeid)
        except StoreError:
            return []  # (the adapter answers it)
        if request.opcode not in _NAMED:
            return [node.path] if node.path else []
        name = os.fsdecode(p.name_of(request.arg[_NAMED[request.opcode]:]))
        return [f"{node.path}/{name}" if node.path else name] if valid_name(name) else []

    async def _resync(self) -> None:
        """Every RESYNC_EVERY seconds, the whole view (files being written, directories made) to every worker: one
        started again learns it, and one that missed news (a worker busy past the retries) is put right."""
        while True:
            await trio.sleep(RESYNC_EVERY)
            async with self._telling:
                news = self.datapath.namespace.written_here()
                if news or self._told_whole:
                    await self._tell({"op": "news", "news": [n.to_wire() for n in news], "whole": True})
                self._told_whole = bool(news)

    def worker_died(self, index: int) -> None:
        writes = self.datapath.writes
        assert writes is not None
        failed = writes.fail_all(f"worker {index} serving the mount died while the file was written (a write it "
                                 "held may be lost)")
        if failed:
            log.warning("worker %d died: %d file(s) being written failed (no object is left)", index, failed)
            self._told_whole = True  # (the next whole view tells the workers)

    def stats(self) -> dict[str, Any]:
        return self.datapath.write_stats() or {}

    def close(self) -> None:
        self._listener.close()
        self.datapath.close()
