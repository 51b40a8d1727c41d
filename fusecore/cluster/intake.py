"""Connections taken in by whoever serves a distributed cache: accepted on a listener, or handed over on a unix socket
(SCM_RIGHTS, by a node's peer router or a mount's hub). Never blocks the event loop; a failure of one connection
costs that connection only."""

from __future__ import annotations

import logging
import os
import socket
from typing import AsyncIterator

import trio

log = logging.getLogger(__name__)

ACCEPT_BACKOFF = 0.1  # seconds without accepting after a failure (out of descriptors, say: the backlog waits)


async def accepted(listener: socket.socket, who: str) -> AsyncIterator[socket.socket]:
    """The connections `listener` (non-blocking) accepts, as they come."""
    while True:
        await trio.lowlevel.wait_readable(listener)
        while True:
            try:
                conn, _ = listener.accept()
            except BlockingIOError:
                break
            except OSError as exc:
                log.warning("%s: cannot accept a connection: %s", who, exc)
                await trio.sleep(ACCEPT_BACKOFF)
                break
            yield conn


async def handed(sock: socket.socket) -> AsyncIterator[socket.socket]:
    """The connections handed over on the unix datagram socket `sock` (non-blocking), until it fails or closes; a
    descriptor that is no connected socket is closed and passed over."""
    while True:
        await trio.lowlevel.wait_readable(sock)
        try:
            _, fds, _, _ = socket.recv_fds(sock, 16, 4)
        except BlockingIOError:
            continue
        except OSError:
            return  # closed
        for fd in fds:
            try:
                conn = socket.socket(fileno=fd)
            except OSError:  # not a socket
                os.close(fd)
                continue
            try:
                conn.getpeername()
            except OSError:  # gone already (the socket owns the descriptor now: closed once, by it)
                conn.close()
                continue
            yield conn
