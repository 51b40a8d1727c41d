"""A mount's local control API: JSON lines over a unix socket (stats, warm, drop, resize, credentials, peers, join).

The CLI (`stoker stats|warm|drop`) and the CSI plugin talk to a running mount through it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
from typing import Any, Generator, Iterator

import trio

from .failures import StokerError
from .config import identity_from_document
from .datapath import DataPath
from .store_errors import StoreError
from .messages import JoinRequest, MalformedReply, MountStats, WarmProgress

log = logging.getLogger(__name__)


def runtime_dir() -> str:
    if os.geteuid() == 0:
        return "/run/stoker"
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return os.path.join(base, f"stoker-{os.getuid()}")


def default_control_socket(mountpoint: str) -> str:
    """Where the mount at `mountpoint` listens, derived from its absolute path."""
    digest = hashlib.sha256(os.path.abspath(mountpoint).encode()).hexdigest()[:20]
    return os.path.join(runtime_dir(), f"{digest}.sock")


class ControlError(StokerError, RuntimeError):
    """A control request failed; `kind` says how, as the mount sent it (malformed, unknown_op, bad_request,
    failed, or a StoreError's kind), or "unreachable" when nothing answers."""

    def __init__(self, message: str, kind: str = "failed"):
        super().__init__(message)
        self.kind = kind


def stats(path: str, timeout: float | None = 30.0) -> MountStats:
    """The mount's stats, typed."""
    try:
        return MountStats.from_wire(call(path, {"op": "stats"}, timeout))
    except MalformedReply as exc:
        raise ControlError(str(exc), "malformed") from None


def warm(path: str, paths: list[str]) -> Iterator[WarmProgress]:
    """Warm `paths` of the mount (all of it: []), yielding its progress until done."""
    for reply in request(path, {"op": "warm", "paths": list(paths)}, timeout=None):
        yield WarmProgress.from_wire(reply)


def resize(path: str, cache_size: int, timeout: float | None = 30.0) -> None:
    call(path, {"op": "resize", "cache_size": cache_size}, timeout)


def set_peers(path: str, members: list[str], replicas: int | None = None, timeout: float | None = 30.0) -> dict:
    """Replace a distributed cache's members on a running mount (then warm: it fetches what it now owns)."""
    return call(path, {"op": "peers", "members": list(members), "replicas": replicas}, timeout)


def join(path: str, request: JoinRequest, timeout: float | None = 30.0) -> dict:
    """Make a running mount a member of a distributed cache, or update its membership (then warm)."""
    return call(path, request.wire(), timeout)


def rotate(path: str, credentials: dict[str, Any] | None, timeout: float | None = 10.0) -> None:
    call(path, {"op": "credentials", "credentials": credentials}, timeout)


async def serve(datapath: DataPath, path: str, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    if os.path.exists(path):
        os.unlink(path)
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    await sock.bind(path)
    os.chmod(path, 0o600)
    sock.listen(16)
    listener = trio.SocketListener(sock)
    task_status.started()
    try:
        async def handle(stream: trio.SocketStream) -> None:
            try:
                await _handle(datapath, stream)
            except Exception as exc:  # noqa: BLE001 - one request's end never ends the mount's serving
                if not _client_gone(exc):
                    log.exception("control request failed")

        await trio.serve_listeners(handle, [listener])
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


async def _handle(datapath: DataPath, stream: trio.SocketStream) -> None:
    async with stream:
        buf = b""
        while b"\n" not in buf:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return
            buf += chunk
        try:
            request = json.loads(buf.split(b"\n", 1)[0])
            op = request.get("op")
        except (ValueError, AttributeError):
            await _send(stream, {"error": "malformed request", "kind": "malformed"})
            return
        try:
            if op == "stats":
                await _send(stream, datapath.stats())
            elif op == "drop":
                await _send(stream, datapath.drop())
            elif op == "resize":
                await _send(stream, datapath.resize(int(request["cache_size"])))
            elif op == "peers":
                members = request["members"]
                if not isinstance(members, list):
                    raise TypeError("members must be a list of HOST:PORT")
                replicas = request.get("replicas")
                await _send(stream, await datapath.set_peers([str(m) for m in members],
                                                             None if replicas is None else int(replicas)))
            elif op == "join":
                await _send(stream, await datapath.join(JoinRequest.from_wire(request)))
            elif op == "credentials":
                identity = identity_from_document(request.get("credentials"))
                if identity is None:
                    raise ValueError("credentials: none given")
                await _send(stream, datapath.rotate(identity))
            elif op == "warm":
                paths = [str(p) for p in request.get("paths", [])]
                result = await datapath.warm(paths, lambda progress: _send(stream, progress))
                await _send(stream, result)
            else:
                await _send(stream, {"error": f"unknown op {op!r}", "kind": "unknown_op"})
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        except StoreError as exc:
            await _send(stream, {"error": str(exc), "kind": exc.kind})
        except (ValueError, KeyError, TypeError) as exc:
            await _send(stream, {"error": f"{op}: {exc}", "kind": "bad_request"})
        except Exception as exc:  # noqa: BLE001 - report to the client, keep serving
            if _client_gone(exc):  # e.g. a warm's caller stopped listening (re-planned): the warm just ends
                return
            log.exception("control request %r failed", op)
            await _send(stream, {"error": f"{type(exc).__name__}: {exc}", "kind": "failed"})


_GONE = (trio.BrokenResourceError, trio.ClosedResourceError)


def _client_gone(exc: BaseException) -> bool:
    """The client hung up: the error, or a group of nothing else (a warm's progress reporter raises it
    from a nursery)."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(_GONE)[1] is None
    return isinstance(exc, _GONE)


async def _send(stream: trio.SocketStream, message: dict) -> None:
    await stream.send_all(json.dumps(message).encode() + b"\n")


class NobodyAnswers(ControlError):
    """Nothing listens on the socket (no such file, or refused)."""

    def __init__(self, path: str, why: str):
        super().__init__(f"nothing answers on {path} ({why})", "unreachable")
        self.path, self.why = path, why


def exchange(path: str, message: dict, timeout: float | None) -> Generator[dict, None, None]:
    """One request over a unix socket, JSON lines both ways; yields each reply line as it was sent.

    The one client of Stoker's local sockets (a mount's control socket, the CSI mounter): callers read
    the replies' meaning (errors and their kinds) themselves. NobodyAnswers if nothing listens; OSError on
    a broken or timed-out socket."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        sock.close()
        raise NobodyAnswers(path, exc.strerror or str(exc)) from None
    with sock, sock.makefile("rb") as reader:
        sock.sendall(json.dumps(message).encode() + b"\n")
        for line in reader:
            yield json.loads(line)


def request(path: str, message: dict, timeout: float | None = 30.0) -> Iterator[dict]:
    """Send one request to a mount and yield each JSON line it answers (blocking client)."""
    try:
        replies = exchange(path, message, timeout)
        for reply in replies:
            if "error" in reply:
                raise ControlError(str(reply["error"]), str(reply.get("kind") or "failed"))
            yield reply
    except NobodyAnswers as exc:
        raise ControlError(f"no Stoker mount answers on {path} ({exc.why})", "unreachable") from None


def call(path: str, message: dict, timeout: float | None = 30.0) -> dict:
    replies = list(request(path, message, timeout))
    if not replies:
        raise ControlError("the mount closed the connection without answering")
    return replies[-1]
