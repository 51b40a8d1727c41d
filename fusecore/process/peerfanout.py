"""A distributed cache's connections, spread over a mount's workers (`--workers N` with `--peers`, or a `join`).

A node is one member of the cache, on one address; its mount's workers each hold a share of what the node serves
(any worker reads any block: the shared blocks and the disk tier are the mount's). The hub takes the connections
other members open, on the member's address (`--peer-listen`, bound by the hub before any worker starts: the port is
the mount's alone) or as the node's peer router hands them over (the join's unix socket, bound by the hub), and hands
each to a worker's own hand-off socket in turn (SCM_RIGHTS, as the router does; cluster/router.py). The worker reads
the request and answers as if it had accepted the connection; no byte of a block goes through the hub. A worker that
does not take it (starting again, its socket full) is passed over; where none does, the asker is told 503 (a miss:
it reads the store).
"""

from __future__ import annotations

import array
import logging
import os
import socket

import trio

from ..cluster.intake import accepted, handed
from ..cluster.router import answer_status

log = logging.getLogger(__name__)


def worker_handoff(shared: str, index: int) -> str:
    """Worker `index`'s hand-off socket (its PeerServer receives there)."""
    return os.path.join(shared, f"w{index}.peer")


class PeerFanout:
    def __init__(self, shared: str, workers: int):
        self._targets = [worker_handoff(shared, i) for i in range(1, workers + 1)]
        self._next = 0
        self._out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        self.handed = self.refused = 0
        self._handoff: str | None = None  # the unix socket the node's peer router hands this cache's connections to
        self._receiving: trio.CancelScope | None = None

    def listen(self, address: str) -> socket.socket:
        """The member's own address (HOST:PORT), bound now (an address in use fails the mount before it starts)."""
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        listener = socket.create_server((host, int(port)), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                        backlog=256)
        listener.setblocking(False)
        return listener

    def receiving(self, path: str) -> bool:
        return path == self._handoff

    def receive(self, path: str) -> socket.socket:
        """The unix socket a node's peer router hands this cache's connections to."""
        if os.path.exists(path):
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(path)
            os.chmod(path, 0o600)
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        self._handoff = path
        return sock

    def stop_receiving(self) -> None:
        """An older join's socket (a new join names another): closed, its receiver ended."""
        if self._receiving is not None:
            self._receiving.cancel()
            self._receiving = None
        self._unlink_handoff()

    async def accept(self, listener: socket.socket) -> None:
        with listener:
            async for conn in accepted(listener, "peers"):
                self.hand(conn)

    async def take_handed(self, sock: socket.socket) -> None:
        with sock, trio.CancelScope() as scope:
            self._receiving = scope
            async for conn in handed(sock):
                self.hand(conn)

    def hand(self, conn: socket.socket) -> None:
        """To the next worker that takes it; 503 if none does. Never blocks."""
        fd = array.array("i", [conn.fileno()])
        for _ in range(len(self._targets)):
            target = self._targets[self._next]
            self._next = (self._next + 1) % len(self._targets)
            try:
                self._out.sendmsg([b"c"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fd)], 0, target)
            except OSError:  # not bound yet (starting again), gone, or its socket full
                continue
            self.handed += 1
            conn.close()  # the worker holds its own copy now
            return
        self.refused += 1
        answer_status(conn, 503)

    def close(self) -> None:
        self._out.close()
        self._unlink_handoff()

    def _unlink_handoff(self) -> None:
        if self._handoff is not None:
            try:
                os.unlink(self._handoff)
            except OSError:
                pass
            self._handoff = None
