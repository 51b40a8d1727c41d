"""Start a detached mount process from a typed configuration and wait until it serves.

The serving process (`stoker serve-mount`) reads one JSON document on stdin: the mount's
configuration (fusecore.config's document), its credentials and its log level. Nothing else
crosses: no argv to interpret, and credentials never sit in an argv or a file.
"""

from __future__ import annotations

import errno
import json
import os
import select
import subprocess
import sys
import time

from ..failures import StokerError
from ..config import MountConfig, identity_document, mount_document
from .mounts import is_mounted, unmount

MAX_DOCUMENT = 1024 * 1024  # bytes a serve-mount reads from stdin at most


class LaunchFailed(StokerError, RuntimeError):
    """The mount did not start; the message says why (never a credential), `kind` what kind of failure
    (a StoreError's kind such as access_denied or no_bucket, or config, mount, failed)."""

    def __init__(self, message: str, kind: str = "failed"):
        super().__init__(message)
        self.kind = kind


def ready_line(error: Exception | None) -> bytes:
    """What the serving process writes on its ready pipe: OK, or ERR with the error's kind and message."""
    if error is None:
        return b"OK\n"
    kind = getattr(error, "kind", "config" if isinstance(error, ValueError) else "failed")
    return f"ERR {kind} {error}".replace("\n", " ").encode() + b"\n"


class NotReady(LaunchFailed):
    """The mount did not become ready in time; nothing is left mounted by it."""


def serve_document(cfg: MountConfig, log_level: str = "INFO") -> bytes:
    return json.dumps({"config": mount_document(cfg), "credentials": identity_document(cfg.store.credentials),
                       "log_level": log_level}).encode()


def launch(cfg: MountConfig, *, log_file: str, ready_timeout: float, log_level: str = "INFO",
           env: dict[str, str] | None = None) -> None:
    """Start the serving process (`python -m fusecore serve-mount`, the data path alone) in its own session
    for `cfg` and return once it mounted."""
    os.makedirs(os.path.dirname(log_file) or ".", mode=0o700, exist_ok=True)
    log_fd = open_log(log_file)
    read_fd, write_fd = os.pipe()
    # -P: `-m` would put the caller's working directory first on sys.path, and a folder named fusecore
    # there (an older checkout, a user's own) would be served instead of the installed data path.
    argv = [sys.executable, "-P", "-m", "fusecore", "serve-mount", "--ready-fd", str(write_fd)]
    inherited = [write_fd]
    if cfg.fuse_fd is not None:
        argv += ["--fuse-fd", str(cfg.fuse_fd)]
        inherited.append(cfg.fuse_fd)
    try:
        child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=log_fd, stderr=log_fd, pass_fds=inherited,
                                 start_new_session=True, close_fds=True, env=env)
    finally:
        os.close(log_fd)
        os.close(write_fd)
    try:
        assert child.stdin is not None  # stdin=PIPE
        child.stdin.write(serve_document(cfg, log_level))
        child.stdin.close()
    except OSError:
        pass  # it died already: the ready pipe says why
    answer = _read_ready(read_fd, ready_timeout)
    if answer == "OK":
        return
    if answer is None:
        child.kill()
    status = child.wait()
    if answer in (None, "") and cfg.fuse_fd is None and is_mounted(cfg.mountpoint):
        unmount(cfg.mountpoint)  # the child got as far as mounting: never leave its dead mount behind
    if answer is None:
        raise NotReady(f"the mount did not become ready within {ready_timeout:g}s")
    if answer.startswith("ERR "):
        kind, _, message = answer[4:].partition(" ")
        raise LaunchFailed(message, kind)
    raise LaunchFailed(f"the mount process exited (status {status}); see {log_file}")


def open_log(log_file: str) -> int:
    """The mount's log, to append to: created 0600 where missing, never opened through a symbolic link
    (one planted where the log goes is refused, not followed); close-on-exec, so that only the mount
    process gets it (as its stdout and stderr)."""
    try:
        return os.open(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise LaunchFailed(f"the log file {log_file} is a symbolic link: refused (remove it, or choose "
                               f"another --log-file)", "config") from None
        raise LaunchFailed(f"cannot open the log file {log_file} ({exc.strerror or exc})", "config") from None


def _read_ready(fd: int, timeout: float) -> str | None:
    """The child's one-line answer on the ready pipe; '' if it closed it without one, None on timeout."""
    deadline = time.monotonic() + timeout
    data = b""
    with os.fdopen(fd, "rb", buffering=0) as pipe:
        while b"\n" not in data:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            readable, _, _ = select.select([pipe], [], [], remaining)
            if readable:
                chunk = pipe.read(4096)
                if not chunk:
                    return data.decode().strip()
                data += chunk
    return data.decode().strip()


def stop_process(proc: subprocess.Popen | None, grace: float = 10.0) -> None:
    """SIGTERM, wait up to `grace` seconds, then SIGKILL; reaped either way (nothing if it already ended)."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def ended(pid: int) -> bool:
    """Has process `pid` ended? A zombie has: it only waits to be reaped by its parent, or by init when a
    mount's launcher exited first (which here, in a container whose init reaps every second or two, is
    long after the mount ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True
