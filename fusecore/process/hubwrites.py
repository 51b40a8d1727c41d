"""A writable mount served by several workers: its writes, answered in the hub (fuse/relay.py says why and how).

The hub keeps a data path of its own that writes (one Writer: one part budget for the mount, one journal of open
uploads, swept at start as a single process's is) and answers each relayed request with the FUSE adapter, as a mount
served by one process would. Before the answer goes back, every worker hears what the request changed
(messages.PathNews), so that a file written through one worker is listed and read through any other at once. A worker
that dies fails every file then being written (EIO at its close, its upload aborted): a WRITE the kernel failed with
that worker never reached the hub, and a file must never become an object without it.
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
from ..messages import PathNews
from ..read.datapath import DataPath
from ..read.namespace import valid_name
from ..store.errors import StoreError

log = logging.getLogger(__name__)

TOLD_KEPT = 4096  # paths whose last news is remembered (news that changes nothing is not sent again)
_NAMED: dict[int, int] = {p.Op.CREATE: p.CREATE_IN.size, p.Op.MKDIR: p.MKDIR_IN.size, p.Op.UNLINK: 0, p.Op.RMDIR: 0}


class HubWrites:
    def __init__(self, datapath: DataPath, fs: StokerFS, listener: socket.socket,
                 tell: Callable[[dict], Awaitable[list[dict]]]):
        assert datapath.writes is not None
        self.datapath = datapath
        self.fs = fs
        self._listener = listener  # (relay.listen: listening before the workers start)
        self._tell = tell  # a message to every worker's control socket (Hub._each)
        self._told: dict[str, PathNews] = {}

    async def serve(self, conn: Connection, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        writes = self.datapath.writes
        assert writes is not None
        async with trio.open_nursery() as nursery:
            self.datapath.start(nursery)
            writes.on_gone = lambda parent, name: nursery.start_soon(
                trio.to_thread.run_sync, conn.forget_entry, parent, os.fsencode(name))
            await nursery.start(relay.serve, self._listener, self.answer)
            task_status.started()

    async def answer(self, request: p.Request) -> Sequence[Buffer]:
        """A relayed request, answered by the adapter; the workers hear what it changed first."""
        paths = await self._paths_of(request)
        try:
            return await self.fs(request)
        finally:
            if paths:
                await self._news(paths)

    async def _paths_of(self, request: p.Request) -> list[str]:
        """The path a request may change (none for a WRITE: a file's growing size is asked of the hub)."""
        if request.opcode in (p.Op.WRITE, p.Op.GETATTR):
            return []
        try:
            node = await self.datapath.namespace.resolve(request.nodeid)
        except StoreError:
            return []  # (the adapter answers it)
        if request.opcode not in _NAMED:
            return [node.path]
        name = os.fsdecode(p.name_of(request.arg[_NAMED[request.opcode]:]))
        return [f"{node.path}/{name}" if node.path else name] if valid_name(name) else []

    async def _news(self, paths: list[str]) -> None:
        news = [n for n in map(self.datapath.namespace.news_of, paths) if self._told.get(n.path) != n]
        if not news:
            return
        if len(self._told) > TOLD_KEPT:
            self._told.clear()
        self._told.update((n.path, n) for n in news)
        await self._tell({"op": "news", "news": [n.to_wire() for n in news]})

    def worker_died(self, index: int) -> None:
        writes = self.datapath.writes
        assert writes is not None
        failed = writes.fail_all(f"worker {index} serving the mount died while the file was written (a write it "
                                 "held may be lost)")
        if failed:
            log.warning("worker %d died: %d file(s) being written failed (no object is left)", index, failed)

    def stats(self) -> dict[str, Any]:
        return self.datapath.write_stats() or {}

    def close(self) -> None:
        self._listener.close()
        self.datapath.close()

