"""Workers forked from a template of the hub, so that a mount's processes share what they all loaded once.

A worker started as a new interpreter (`python -m fusecore serve-worker`) imports the data path, botocore and trio
and parses botocore's S3 model again: ~46 MiB of its own, measured, the same in each worker. So before it makes any
socket or thread the hub forks a template: a process that holds those pages (the imports, and the mount's S3Store,
made and not yet used: its botocore client and the S3 model it parsed) and does nothing but fork a worker when the
hub asks; each worker serves with its copy of that store (daemon.run_worker). A worker forked
from it shares those pages with the hub, the template and every sibling, copy on write: memory summed over a mount's
processes (PSS) counts them once.

The template serves the mount's start only: once every worker serves, the hub ends it (Hub.retire_template). As the
mount serves, every other process writes to most of the pages they shared (a reference count changes the page of
its object), and what a template kept would become its own: 11 MiB of private memory, measured after 50 reads (a
worker's start later, one died, is a new interpreter: ~1 s and ~23 MiB more than a fork, against 11 MiB all along).

The worker is forked twice (the template's child forks it and exits) and the hub is a child subreaper
(PR_SET_CHILD_SUBREAPER): the worker is the hub's own child, which waits for it and reads its exit status as it does
a worker it started itself, and the template's end ends no worker. Where there is no template (the hub had threads
when it would have forked, or the template died), Hub.start starts a new interpreter as before.

The hub sends the worker's document (the mount's configuration and credentials, as serve-worker reads on stdin) and
its role on a socket pair no other process holds, with the worker's two descriptors (its clone of the connection and
its ready pipe); the template answers the worker's pid.
"""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from typing import Callable

from ..failures import StokerError

log = logging.getLogger(__name__)

PR_SET_CHILD_SUBREAPER = 36
MAX_MESSAGE = 1024 * 1024  # bytes of a worker's document at most (as serve-worker's stdin: launch.MAX_DOCUMENT)
ANSWER_TIMEOUT = 5.0  # seconds the hub waits for a worker's pid (a fork takes milliseconds)
REPARENT_TIMEOUT = 5.0  # seconds a forked worker waits to become the hub's child

# What the template runs in a forked worker: the message's document and role, its descriptors -> an exit status
Serve = Callable[[dict, list[int]], int]


class TemplateGone(StokerError, OSError):
    """The template cannot start a worker (it died, or could not fork): the hub starts a new interpreter."""


class Template:
    """The hub's end of its template."""

    def __init__(self, sock: socket.socket, pid: int):
        self.sock, self.pid = sock, pid
        self.sock.settimeout(ANSWER_TIMEOUT)

    @classmethod
    def fork(cls, serve: Serve) -> Template | None:
        """Fork the template from this process (the hub), which then reaps the workers it forks; None where this
        process already has threads (a fork would copy their locks held) or is no subreaper."""
        if threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1 or not _become_subreaper():
            return None  # (the tasks: a library's native thread is no Python thread)
        hub_end, template_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        hub = os.getpid()
        gc.collect()
        gc.freeze()  # the collector never writes to what was loaded before the fork: its pages stay shared
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the template (its workers are tested through real mounts)
            status = 1
            try:
                hub_end.close()
                status = _template(template_end, hub, serve)
            finally:
                os._exit(status)
        template_end.close()  # (the hub's loaded objects stay frozen too: a full collection would copy their pages)
        return cls(hub_end, pid)

    def start(self, message: dict, fds: list[int]) -> int:
        """Have the template fork a worker; its pid (TemplateGone where it cannot: the caller closes the template and
        must not use `fds` for another start, a worker may have been forked with them and not told of)."""
        try:
            socket.send_fds(self.sock, [json.dumps(message).encode()], fds)
            answer = self.sock.recv(64)
        except OSError as exc:  # (gone, or no answer within ANSWER_TIMEOUT)
            raise TemplateGone(f"the workers' template is gone ({exc.strerror or exc})") from None
        if not answer:
            raise TemplateGone("the workers' template ended while it forked a worker")
        if not answer.isdigit():
            raise TemplateGone(f"the workers' template could not fork a worker ({answer.decode(errors='replace')})")
        return int(answer)

    def close(self, grace: float = 2.0) -> None:
        """End the template (it ends on this end's close; killed past `grace` seconds: a stopped or stuck one never
        holds up the hub); reaped."""
        if self.sock.fileno() >= 0:
            self.sock.close()
        deadline = time.monotonic() + grace
        try:
            while os.waitpid(self.pid, os.WNOHANG)[0] == 0:
                if time.monotonic() >= deadline:
                    os.kill(self.pid, signal.SIGKILL)
                    os.waitpid(self.pid, 0)
                    return
                time.sleep(0.01)
        except (ChildProcessError, ProcessLookupError):
            pass


class Forked:
    """A worker the template forked, as the hub handles one it started itself (subprocess.Popen's calls it uses):
    the hub's child, by the subreaper."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self._waiting = threading.Lock()  # (the hub polls from its loop and waits from a thread: one reaps)

    def poll(self) -> int | None:
        with self._waiting:
            if self.returncode is None:
                self._reap(os.WNOHANG)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def _reap(self, flags: int) -> None:
        try:
            pid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:  # (not ours: it never became the hub's child)
            self.returncode = -1
            return
        if pid == self.pid:
            self.returncode = os.waitstatus_to_exitcode(status)


class Strays:
    """Zombies of processes the hub adopted as a child subreaper and waits for nowhere else: the child a worker that
    was killed leaves (a `credential_process` it ran), an intermediate a template that died mid-fork leaves. `reap`
    waits for each one found a zombie at two calls in a row: a child of the hub's own that some library runs and
    waits for (botocore's `credential_process`) is never taken from it, it waits at once."""

    def __init__(self) -> None:
        self._seen: set[int] = set()
        self.reaped = 0

    def reap(self, tracked: set[int]) -> None:
        """Reap the strays (not in `tracked`, the hub's workers and template); `reaped` counts them."""
        zombies = {pid for pid in children() if pid not in tracked and _zombie(pid)}
        for pid in zombies & self._seen:
            try:
                os.waitpid(pid, os.WNOHANG)
                self.reaped += 1
            except ChildProcessError:
                pass
        self._seen = zombies - self._seen


def children(pid: int | str = "self") -> list[int]:
    """The processes whose parent is `pid` (each of its threads' children), as /proc lists them."""
    found: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found.extend(int(child) for child in f.read().split())
    except OSError:
        pass
    return found


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def holds_sockets() -> bool:
    """Has this process a socket open? An object made before the fork that owns one (a credentials provider that
    fetched already: the instance metadata's keeps its connection) must not go to the workers: the template closes
    what it inherited, and two processes would share one connection."""
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                return True
        except OSError:
            pass
    return False


def _become_subreaper() -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _template(sock: socket.socket, hub: int, serve: Serve) -> int:  # pragma: no cover - in the forked template
    """The template's loop: a worker forked for each message, until the hub closes its end (or dies)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a terminal's ^C is the hub's to act on)
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: it ends with the hub
    if os.getppid() != hub:
        return 0
    _close_inherited(keep={0, 1, 2, sock.fileno()})
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 4)
        except OSError:
            return 0
        if not data:
            return 0
        try:
            answer = _fork_worker(sock, hub, serve, data, fds)
        finally:
            for fd in fds:
                os.close(fd)
        sock.send(answer)


def _fork_worker(sock: socket.socket, hub: int, serve: Serve, data: bytes,
                 fds: list[int]) -> bytes:  # pragma: no cover - in the forked template
    """Fork twice: the worker's parent exits at once, which makes the worker the hub's child (the subreaper)."""
    read_fd, write_fd = os.pipe()
    try:
        child = os.fork()
    except OSError as exc:
        os.close(read_fd)
        os.close(write_fd)
        return f"ERR fork: {exc.strerror}".encode()
    if child == 0:
        status = 1
        try:
            os.close(read_fd)
            sock.close()
            worker = os.fork()
            if worker:
                os.write(write_fd, str(worker).encode())
                status = 0
            else:
                os.close(write_fd)
                status = _worker(hub, serve, data, fds)
        finally:
            os._exit(status)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        pid = pipe.read()
    os.waitpid(child, 0)
    return pid or b"ERR fork"


def _worker(hub: int, serve: Serve, data: bytes, fds: list[int]) -> int:  # pragma: no cover - in a forked worker
    """In the worker: once it is the hub's child, what serve-worker would run."""
    deadline = time.monotonic() + REPARENT_TIMEOUT
    while os.getppid() != hub:
        if time.monotonic() > deadline:
            return 1
        time.sleep(0.001)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return serve(json.loads(data), fds)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - what would have been its traceback, logged: then it ends
        log.exception("worker forked from the template failed")
        return 1


def _close_inherited(keep: set[int]) -> None:  # pragma: no cover - in the forked template
    """The template holds no descriptor of the hub's (its connection, the ready pipe to its launcher): closed by
    number (the hub had made no object that owns one before it forked, but for the standard streams)."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass
