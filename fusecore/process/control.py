"""A mount's local control API: JSON lines over a unix socket (stats, warm, drop, resize, credentials, peers, join).

The CLI (`stoker stats|warm|drop`) and the CSI plugin talk to a running mount through it.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import socket
import stat
from typing import Any, Generator, Iterator

import trio

from ..failures import StokerError
from ..config import ConfigError, identity_from_document
from ..read.datapath import DataPath
from ..store.errors import StoreError
from ..messages import JoinRequest, MalformedReply, MountStats, PathNews, WarmProgress

log = logging.getLogger(__name__)


ROOT_RUNTIME_DIR = "/run/stoker"  # root's; another user's is $XDG_RUNTIME_DIR/stoker-<uid>, or /tmp/stoker-<uid>

# The longest request line a mount reads. The largest legitimate ones: a join or peers with every node of
# the largest Kubernetes cluster (5,000 members: ~96 KB as "10.0.0.1:7000", ~250 KB as bracketed IPv6), and
# a warm's paths, as many as a command line (ARG_MAX, 2 MiB) or a DatasetCache (an etcd request, 1.5 MiB)
# holds. Longer is refused without reading the rest: one connection costs the mount this much at most.
MAX_REQUEST = 4 * 1024 * 1024
# The largest cache budget `resize` takes: 1 PiB, some 30 times the memory of today's largest machines, yet
# far from the integers that overflow a 64-bit counter. A fixed bound, not this machine's memory: the budget
# is the sizer's decision (the operator's, within the pod's limit), and the same request gets the same
# answer on every node.
MAX_CACHE_SIZE = 2**50


class ControlError(StokerError, RuntimeError):
    """A control request failed; `kind` says how, as the mount sent it (malformed, too_large, unknown_op,
    bad_request, failed, or a StoreError's kind), or "unreachable" when nothing answers. The mount's server
    raises it too, for a request it refuses with that kind."""

    def __init__(self, message: str, kind: str = "failed"):
        super().__init__(message)
        self.kind = kind


class UnsafeRuntimeDir(ControlError, ConfigError):
    """The folder of the default control sockets and logs (runtime_dir) is not this user's own. A client
    reads it as a ControlError (kind unsafe_runtime_dir), a mount as a ConfigError (of its control socket):
    either way it is refused, not used."""

    def __init__(self, path: str, problem: str):
        elsewhere = "give --control-socket and --log-file" + ("" if os.geteuid() == 0 else ", or set XDG_RUNTIME_DIR")
        message = f"control-socket: the state folder {path} {problem}: refused (remove it, or {elsewhere})"
        Exception.__init__(self, message)  # the two parents' __init__ take different arguments
        self.kind, self.setting, self.problem, self.path = "unsafe_runtime_dir", "control-socket", problem, path


def runtime_dir() -> str:
    """The folder of this user's mounts' default control sockets and logs: created 0700 where missing, and
    used only if it is a real folder (not a symbolic link) of this user's, that no one else may write to;
    else UnsafeRuntimeDir (another local user could have made /tmp/stoker-<uid> first)."""
    if os.geteuid() == 0:
        path = ROOT_RUNTIME_DIR
    else:
        base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
        path = os.path.join(base, f"stoker-{os.getuid()}")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass  # checked below, like any folder found there
    except OSError as exc:
        raise UnsafeRuntimeDir(path, f"cannot be created ({exc.strerror or exc})") from None
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise UnsafeRuntimeDir(path, f"cannot be checked ({exc.strerror or exc})") from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeRuntimeDir(path, "is a symbolic link")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeRuntimeDir(path, "is not a folder")
    if st.st_uid != os.geteuid():
        raise UnsafeRuntimeDir(path, f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})")
    if st.st_mode & 0o022:
        raise UnsafeRuntimeDir(path, f"may be written by its group or others (mode {stat.S_IMODE(st.st_mode):o})")
    return path


def default_control_socket(mountpoint: str) -> str:
    """Where the mount at `mountpoint` listens, derived from its absolute path (in runtime_dir: checked)."""
    digest = hashlib.sha256(os.path.abspath(mountpoint).encode()).hexdigest()[:20]
    return os.path.join(runtime_dir(), f"{digest}.sock")


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
        op = None
        try:
            line = await _read_line(stream)
            if line is None:
                return  # the client hung up before a whole request
            request = _parse(line)
            op = request.get("op")
            await _answer(datapath, stream, request, op)
        except Exception as exc:  # noqa: BLE001 - report to the client, keep serving
            reply = _error_reply(op, exc)
            if reply is not None:
                await _send(stream, reply)


async def _read_line(stream: trio.SocketStream) -> bytes | None:
    """The request line (without its newline); None if the client hung up first. ControlError too_large
    when it is longer than MAX_REQUEST: the rest is never read."""
    buf = bytearray()
    while True:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return None
        end = chunk.find(b"\n")
        buf += chunk if end < 0 else chunk[:end]
        if len(buf) > MAX_REQUEST:
            raise ControlError(f"request line longer than {MAX_REQUEST} bytes: refused", "too_large")
        if end >= 0:
            return bytes(buf)


def _parse(line: bytes) -> dict:
    try:
        request = json.loads(line)
    except ValueError:
        request = None
    if not isinstance(request, dict):
        raise ControlError("malformed request", "malformed")
    return request


def _integer(request: dict, name: str, low: int, high: int) -> int:
    """The request's `name`: an integer (JSON's, not a bool, a string or a float) from low to high."""
    value = request.get(name)
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{name} must be an integer from {low} to {high} (got {value!r:.40})")
    return value


def _members(request: dict) -> list[str]:
    members = request.get("members")
    if not isinstance(members, list):
        raise TypeError("members must be a list of HOST:PORT")
    return [str(m) for m in members]


async def _answer(datapath: DataPath, stream: trio.SocketStream, request: dict, op: object) -> None:
    if op == "stats":
        await _send(stream, await _result(datapath.stats()))
    elif op == "metrics":  # a worker's, for its hub (workers.Hub.serve_metrics)
        await _send(stream, {"text": datapath.metrics.text()})
    elif op == "drop":
        await _send(stream, await _result(datapath.drop()))
    elif op == "resize":
        await _send(stream, await _result(datapath.resize(_integer(request, "cache_size", 1, MAX_CACHE_SIZE))))
    elif op == "peers":
        members = _members(request)
        replicas = None if request.get("replicas") is None else _integer(request, "replicas", 1, len(members))
        await _send(stream, await datapath.set_peers(members, replicas))
    elif op == "join":
        _integer(request, "replicas", 1, len(_members(request)))
        await _send(stream, await datapath.join(JoinRequest.from_wire(request)))
    elif op == "credentials":
        identity = identity_from_document(request.get("credentials"))
        if identity is None:
            raise ValueError("credentials: none given")
        await _send(stream, await _result(datapath.rotate(identity)))
    elif op == "news":  # a worker's, from the hub of a writable mount (fuse/relay.py): what it wrote
        news = request.get("news")
        if not isinstance(news, list):
            raise TypeError("news must be a list")
        datapath.learn([PathNews.from_wire(n) for n in news], whole=request.get("whole") is True)
        await _send(stream, {"ok": True})
    elif op == "warm":
        paths = request.get("paths", [])
        if not isinstance(paths, list):
            raise TypeError("paths must be a list of paths")
        result = await datapath.warm([str(p) for p in paths], lambda progress: _send(stream, progress))
        await _send(stream, result)
    else:
        raise ControlError(f"unknown op {op!r:.80}", "unknown_op")


async def _result(answer: Any) -> dict:
    """An answer, awaited where it is one (a mount served by several workers asks them: workers.Hub)."""
    return await answer if inspect.isawaitable(answer) else answer


def _error_reply(op: object, exc: Exception) -> dict | None:
    """The one place a request's failure becomes its answer, {"error", "kind"} (the client's ControlError);
    None when the client hung up (nothing to answer)."""
    if _client_gone(exc):  # e.g. a warm's caller stopped listening (re-planned): the warm just ends
        return None
    if isinstance(exc, (ControlError, StoreError)):
        return {"error": str(exc), "kind": exc.kind}
    if isinstance(exc, (ValueError, KeyError, TypeError)):
        return {"error": f"{op}: {exc}", "kind": "bad_request"}
    log.exception("control request %r failed", op, exc_info=exc)
    return {"error": f"{type(exc).__name__}: {exc}", "kind": "failed"}


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
        try:
            sock.sendall(json.dumps(message).encode() + b"\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the mount refused the request before reading all of it (too long): its answer says why
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
