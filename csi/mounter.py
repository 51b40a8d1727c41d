"""Who starts mount processes: this process, or a separate long-lived mounter reached over a socket.

Mount processes must outlive the CSI server. On a plain host they are detached (own session), so a
restarted or killed `stoker csi` leaves them serving. In Kubernetes a container restart kills every
process of the container, so the DaemonSet runs a second, rarely-changing container,
`stoker csi-mounter`, that owns the mount processes; the node plugin asks it over a unix socket.

The mounter runs mounts and nothing else. A request is one typed document: the mount's
configuration (validated by fusecore.config, unknown settings refused), its credentials (as
credentials, never as environment), and its log file. The mount point must be one of kubelet's
paths for this driver, the control socket and log file must lie in the state directory, and the
caller must be root or the mounter's own user (SO_PEERCRED). Anything else is answered with an error
and runs nothing.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import socketserver
import struct
from dataclasses import dataclass
from typing import Any, Protocol

from fusecore.process import control
from fusecore.config import ConfigError, MountConfig, config_from_document, identity_document, identity_from_document, \
    mount_document
from fusecore.process.launch import LaunchFailed, NotReady, launch
from fusecore.process.mounts import detach_top, mount_fuse_fd, top_mount
from fusecore.store.errors import StoreError, error_of_kind

from .failures import DriverError
from .layout import allowed_mount_point, mount_point_rule

log = logging.getLogger(__name__)

# Variables through which a process would find credentials of its own; a mount given credentials
# starts without them (and without the instance metadata service).
_AMBIENT_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE",
                 "AWS_DEFAULT_PROFILE", "AWS_ROLE_ARN", "AWS_ROLE_SESSION_NAME", "AWS_WEB_IDENTITY_TOKEN_FILE",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                 "AWS_CONTAINER_AUTHORIZATION_TOKEN", "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
                 "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE")
_REQUEST_KEYS = {"op", "config", "credentials", "log_file", "timeout"}
MAX_REQUEST = 1024 * 1024


class MountFailed(DriverError, RuntimeError):
    """The mount did not start; the message says why (never a credential)."""


class MountNotReady(MountFailed):
    """The mount did not become ready in time (and nothing is left mounted)."""


class MountRefused(MountFailed):
    """The request is not one the mounter runs (bad document, path outside its directories, caller)."""


@dataclass(frozen=True)
class MountRequest:
    """One mount to start: configuration with credentials (None: the node's own), and its log file."""

    config: MountConfig
    log_file: str

    def message(self, timeout: float) -> dict:
        return {"op": "mount", "config": mount_document(self.config),
                "credentials": identity_document(self.config.store.credentials), "log_file": self.log_file,
                "timeout": timeout}

    @classmethod
    def from_message(cls, message: Any) -> tuple["MountRequest", float]:
        if not isinstance(message, dict) or set(message) - _REQUEST_KEYS:
            extra = sorted(set(message) - _REQUEST_KEYS) if isinstance(message, dict) else []
            raise MountRefused(f"the mounter takes a mount document only (unexpected: {', '.join(extra) or 'type'})")
        try:
            config = config_from_document(message.get("config"), identity_from_document(message.get("credentials")))
        except ConfigError as exc:
            raise MountRefused(f"bad mount document: {exc}") from None
        log_file, timeout = message.get("log_file"), message.get("timeout", 60)
        if not isinstance(log_file, str) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 600:
            raise MountRefused("bad mount document: log_file must be a path and timeout 0-600 seconds")
        return cls(config, log_file), float(timeout)


@dataclass(frozen=True)
class MountRules:
    """Where mounts may go: kubelet's paths for this driver, sockets and logs in the state directory."""

    kubelet_dir: str
    state_dir: str
    allow_node_credentials: bool = False
    mount_roots: tuple[str, ...] = ()  # other orchestrators' directories (--mount-root)
    disk_cache_root: str = ""  # where volumes' disk tiers lie, each in a folder of its own (--disk-cache-root)

    def check(self, request: MountRequest) -> None:
        cfg = request.config
        if not allowed_mount_point(self.kubelet_dir, self.mount_roots, cfg.mountpoint):
            raise MountRefused(f"mount point {cfg.mountpoint} is outside this driver's paths: it mounts only at "
                               f"{mount_point_rule(self.kubelet_dir, self.mount_roots)}")
        if not _inside(os.path.join(self.state_dir, "run"), cfg.control_socket or "", ".sock"):
            raise MountRefused("the control socket must lie in the state directory's run/")
        if not _inside(os.path.join(self.state_dir, "logs"), request.log_file, ".log"):
            raise MountRefused("the log file must lie in the state directory's logs/")
        if cfg.metrics_port is not None:
            raise MountRefused("mounts started by the mounter serve no metrics port (the node plugin exports them)")
        if cfg.store.profile is not None:
            raise MountRefused("mounts started by the mounter use no AWS profile")
        if cfg.store.credentials is None and not self.allow_node_credentials:
            raise MountRefused("mounts with the node's own credentials are disabled (--allow-node-credentials)")
        if cfg.disk_cache and not (self.disk_cache_root and _inside(self.disk_cache_root, cfg.disk_cache, "")):
            raise MountRefused(f"a disk cache must be a folder directly under --disk-cache-root "
                               f"({self.disk_cache_root or 'none on this node'})")


def _inside(folder: str, path: str, suffix: str) -> bool:
    folder = os.path.normpath(os.path.abspath(folder))
    return (path.startswith("/") and os.path.normpath(path) == path and os.path.dirname(path) == folder
            and path.endswith(suffix) and "/" not in os.path.basename(path))


class Mounter(Protocol):
    def start(self, request: MountRequest, timeout: float) -> None: ...
    def healthy(self) -> str | None: ...


class ProcessMounter:
    """Mounts /dev/fuse at the volume's path itself, then starts the detached serving process on it.

    Mounting here, with mount(2), lets a new mount go on top of a dead one (libfuse's own mount
    stat()s the mount point first, which fails with ENOTCONN there): that is how a repaired mount
    reaches every bind of the old one and every container's view of them (see csi/volumes.py).
    """

    def __init__(self, rules: MountRules):
        self.rules = rules

    def start(self, request: MountRequest, timeout: float) -> None:
        self.rules.check(request)
        cfg = request.config
        try:
            fd = mount_fuse_fd(cfg.mountpoint, f"stoker:{cfg.store.bucket}", allow_other=cfg.allow_other,
                               uid=os.getuid(), gid=os.getgid(), read_only=not cfg.writable)
        except OSError as exc:
            raise MountFailed(f"cannot mount at {cfg.mountpoint}: {exc.strerror}") from None
        mounted = top_mount(cfg.mountpoint)
        try:
            launch(dataclasses.replace(cfg, fuse_fd=fd), log_file=request.log_file, ready_timeout=timeout,
                   env=_child_env(cfg))
        except LaunchFailed as exc:
            if mounted is not None:  # never leave the mount of a process that did not start
                detach_top(cfg.mountpoint, mounted.device)
            raise _typed(exc) from None
        finally:
            os.close(fd)  # the serving process holds it now: its death aborts the connection

    def healthy(self) -> str | None:
        return None


def _typed(exc: LaunchFailed) -> Exception:
    """The mount process's failure as the error it was: a StoreError (no bucket, denied, ...) keeps its
    kind across the processes, so the CSI answer is NOT_FOUND or PERMISSION_DENIED, not INTERNAL."""
    if isinstance(exc, NotReady):
        return MountNotReady(str(exc))
    return error_of_kind(exc.kind, str(exc)) or MountFailed(str(exc))


def _child_env(cfg: MountConfig) -> dict[str, str]:
    env = dict(os.environ)
    if cfg.store.credentials is not None:
        for var in _AMBIENT_VARS:
            env.pop(var, None)
        env["AWS_EC2_METADATA_DISABLED"] = "true"
    return env


class RemoteMounter:
    """Client of `stoker csi-mounter` (one JSON document per connection over a unix socket)."""

    def __init__(self, path: str):
        self.path = path

    def _call(self, message: dict, timeout: float) -> dict:
        replies = control.exchange(self.path, message, timeout)
        try:
            reply = next(replies, None)
        except control.NobodyAnswers as exc:
            raise MountFailed(f"the mounter at {self.path} did not answer ({exc.why})") from None
        except OSError as exc:
            raise MountFailed(f"the mounter at {self.path} did not answer ({exc.strerror or exc})") from None
        finally:
            replies.close()
        if reply is None:
            raise MountFailed(f"the mounter at {self.path} closed the connection")
        return reply

    def start(self, request: MountRequest, timeout: float) -> None:
        reply = self._call(request.message(timeout), timeout + 60)
        if reply.get("error"):
            store_error = error_of_kind(reply.get("store") or "", reply["error"])
            if store_error is not None:
                raise store_error
            kind = {"not_ready": MountNotReady, "refused": MountRefused}.get(str(reply.get("kind")), MountFailed)
            raise kind(reply["error"])

    def healthy(self) -> str | None:
        try:
            self._call({"op": "ping"}, 5)
        except MountFailed as exc:
            return str(exc)
        return None


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a unix socket (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


class _Handler(socketserver.StreamRequestHandler):
    server: "_Server"

    def handle(self) -> None:
        uid = peer_uid(self.connection)
        if uid not in (0, os.getuid()):
            log.warning("refused a request from uid %d", uid)
            reply: dict = {"error": f"uid {uid} may not use the mounter", "kind": "refused"}
        else:
            reply = self._answer(self.rfile.readline(MAX_REQUEST))
        self.wfile.write(json.dumps(reply).encode() + b"\n")

    def _answer(self, line: bytes) -> dict:
        try:
            request = json.loads(line)
        except ValueError:
            return {"error": "malformed request", "kind": "refused"}
        op = request.get("op") if isinstance(request, dict) else None
        if op == "ping":
            return {"ok": True}
        if op != "mount":
            return {"error": f"unknown op {op!r}", "kind": "refused"}
        try:
            mount, timeout = MountRequest.from_message(request)
            self.server.mounter.start(mount, timeout)
        except MountRefused as exc:
            log.warning("refused a mount request: %s", exc)
            return {"error": str(exc), "kind": "refused"}
        except MountNotReady as exc:
            return {"error": str(exc), "kind": "not_ready"}
        except MountFailed as exc:
            return {"error": str(exc)}
        except StoreError as exc:  # the store refused the mount: its kind travels (errors of the CSI answer)
            return {"error": str(exc), "kind": "store", "store": exc.kind}
        cfg = mount.config
        log.info("mounted s3://%s/%s at %s", cfg.store.bucket, cfg.store.prefix, cfg.mountpoint)
        return {"ok": True}


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    mounter: ProcessMounter


def serve_mounter(path: str, rules: MountRules) -> None:
    """Serve mount requests on `path` (mode 0600, root or our own user only) until killed."""
    os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
    if os.path.exists(path):
        os.unlink(path)
    old_mask = os.umask(0o177)  # the socket exists with mode 0600 from the start
    try:
        server = _Server(path, _Handler)
    finally:
        os.umask(old_mask)
    with server:
        server.mounter = ProcessMounter(rules)
        os.chmod(path, 0o600)
        log.info("mounter listening on %s", path)
        server.serve_forever()
