"""`stoker csi` and `stoker csi-mounter`: assemble the gRPC server, the repair loop and the mounter."""

from __future__ import annotations

import argparse
import functools
import http.server
import logging
import os
import signal
import threading
import time
from typing import Protocol, Sequence
from concurrent import futures

import grpc
from google.protobuf import text_format

from fusecore import logs

from . import csi_pb2 as pb
from . import csi_pb2_grpc as rpc
from .attributes import looks_like_credential
from .controller import ControllerService
from .diskcache import DiskCaches
from .metrics import serve_metrics
from .auth import DEFAULT_AUDIENCE, AuthPolicy
from .layout import DEFAULT_KUBELET_DIR, check_mount_root
from .mounter import Mounter, MountRules, ProcessMounter, RemoteMounter, serve_mounter
from .node import IdentityService, NodeService
from .state import SecretStore, StateDir
from .volumes import VolumeManager

DEFAULT_SECRETS_DIR = "/run/stoker-csi"  # tmpfs on systemd hosts

log = logging.getLogger("stoker.csi")

_MAPS = ("volume_context", "parameters", "publish_context")


def redacted(request) -> str:
    """A request as text for the log, without secrets, mount flags (which may hold them), or
    attribute values stored under credential-like names by mistake (refused, but not logged)."""
    copy = type(request)()
    copy.CopyFrom(request)
    fields = copy.DESCRIPTOR.fields_by_name
    if "secrets" in fields:
        copy.ClearField("secrets")
    if "volume_capability" in fields and copy.HasField("volume_capability"):
        copy.volume_capability.mount.ClearField("mount_flags")
    for name in (n for n in _MAPS if n in fields):
        attributes = getattr(copy, name)
        for key in [k for k in attributes if looks_like_credential(k)]:
            attributes[key] = "<redacted>"
    return text_format.MessageToString(copy, as_one_line=True)


class LoggingInterceptor(grpc.ServerInterceptor):
    """One log line per call and per outcome; secrets never reach the log."""

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        method = details.method.rsplit("/", 1)[-1]
        inner = handler.unary_unary

        def logged(request, context):
            started = time.monotonic()
            log.info("%s %s", method, redacted(request))
            try:
                response = inner(request, context)
            except Exception:
                log.info("%s -> %s: %s (%.2fs)", method, context.code(), context.details(),
                         time.monotonic() - started)
                raise
            log.info("%s -> OK (%.2fs)", method, time.monotonic() - started)
            return response

        return grpc.unary_unary_rpc_method_handler(logged, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


def socket_path(endpoint: str) -> str:
    if endpoint.startswith("unix://"):
        return endpoint[len("unix://"):]
    if endpoint.startswith("/"):
        return endpoint
    raise SystemExit(f"stoker csi: --endpoint must be unix:///PATH, got {endpoint!r}")


def build_server(args: argparse.Namespace, mounter: Mounter, volumes: VolumeManager | None) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), interceptors=[LoggingInterceptor()])
    node = args.mode in ("node", "all")
    controller = args.mode in ("controller", "all")
    rpc.add_IdentityServicer_to_server(IdentityService(mounter if node else None, controller), server)
    if node and volumes is not None:
        rpc.add_NodeServicer_to_server(NodeService(volumes, args.node_id), server)
    if controller:
        rpc.add_ControllerServicer_to_server(ControllerService(), server)
    return server


def _watch(volumes: VolumeManager, interval: float, stop: threading.Event) -> None:
    while not stop.wait(interval):
        volumes.check_all()


def probe_over_socket(path: str, timeout: float = 5.0) -> str | None:
    """Call Probe on our own gRPC socket, as kubelet's side would: None when ready, else why not."""
    try:
        with grpc.insecure_channel(f"unix://{path}") as channel:
            reply = rpc.IdentityStub(channel).Probe(pb.ProbeRequest(), timeout=timeout)
    except grpc.RpcError as exc:
        return f"{exc.code().name}: {exc.details()}"
    return None if reply.ready.value else "Probe answered not ready"


def serve_health(socket: str, port: int, addr: str) -> http.server.ThreadingHTTPServer:
    """`GET /healthz` for the liveness probe: 200 while the driver answers Probe on its socket."""

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.split("?")[0] != "/healthz":
                self.send_error(404)
                return
            problem = probe_over_socket(socket)
            body = (problem or "ok").encode() + b"\n"
            self.send_response(503 if problem else 200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer((addr, port), Health)
    threading.Thread(target=server.serve_forever, name="healthz", daemon=True).start()
    return server


class NodeExtension(Protocol):
    """Something that runs beside the node service and shares its volumes (the DatasetCache warm agent),
    composed in by `stoker`'s command line (stoker/cli.py): the driver imports none of it."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def start(self, args: argparse.Namespace, volumes: VolumeManager, stop: threading.Event) -> None: ...


def cmd_csi(args: argparse.Namespace, extensions: Sequence[NodeExtension] = ()) -> int:
    _logging(args.log_level)
    path = socket_path(args.endpoint)
    rules = MountRules(os.path.abspath(args.kubelet_dir), os.path.abspath(args.state_dir), args.allow_node_credentials,
                       tuple(args.mount_root), _disk_root(args))
    mounter: Mounter = RemoteMounter(args.mounter_socket) if args.mounter_socket else ProcessMounter(rules)
    volumes = None
    if args.mode in ("node", "all"):
        if not args.node_id:
            raise SystemExit("stoker csi: --node-id is required for the node service")
        policy = AuthPolicy(allow_node_credentials=args.allow_node_credentials, audience=args.token_audience,
                            role_lookup=_role_lookup(args.service_account_roles))
        volumes = VolumeManager(StateDir(args.state_dir), mounter, secrets=SecretStore(args.secrets_dir),
                                policy=policy, kubelet_dir=args.kubelet_dir, ready_timeout=args.mount_timeout,
                                node_cache_memory=args.node_cache_memory, mount_roots=tuple(args.mount_root),
                                disks=DiskCaches(_disk_root(args), args.node_disk_cache))
        repaired = volumes.check_all(sweep_orphans=True)  # start-up: repair broken volumes, drop stale ones
        log.info("found %d volume(s) in %s; repaired %d", len(volumes.state.records()), args.state_dir, len(repaired))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if os.path.exists(path):
        os.unlink(path)
    server = build_server(args, mounter, volumes)
    old_mask = os.umask(0o177 if volumes is not None else 0o117)  # node: kubelet (root) only
    try:
        server.add_insecure_port(f"unix://{path}")
        server.start()
    finally:
        os.umask(old_mask)
    if volumes is not None:
        log.info("serving CSI %s services on %s (node id %s)", args.mode, path, args.node_id)
    else:
        log.info("serving CSI controller services on %s (controller mode: no node service, no node id)", path)
    if args.health_port:
        serve_health(path, args.health_port, args.health_addr)
    stop = threading.Event()
    if volumes is not None:
        threading.Thread(target=_watch, args=(volumes, args.health_interval, stop), daemon=True,
                         name="repair").start()
        if args.metrics_port:
            serve_metrics(volumes, args.metrics_port, args.metrics_addr)
        for extension in extensions:  # e.g. the DatasetCache warm agent
            extension.start(args, volumes, stop)

    def terminate(signum, frame):
        log.info("signal %d: stopping the gRPC server; mounts keep serving", signum)
        stop.set()

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, terminate)
    stop.wait()
    server.stop(grace=5).wait()
    return 0


def _size(text: str) -> int:
    from fusecore.config import ConfigError, parse_size

    try:
        return parse_size(text, name="size")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


MOUNT_ROOT_HELP = ("also take staging and target paths below DIR as the orchestrator gives them (Nomad, csi-sanity; "
                   "repeatable; the same on stoker csi and stoker csi-mounter). Default: kubelet's paths only")


def _mount_root(text: str) -> str:
    try:
        return check_mount_root(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _role_lookup(enabled: bool):
    """Role ARNs from service-account annotations, read through the API (the node's service account)."""
    if not enabled:
        return None
    from .serviceaccounts import ServiceAccountRoles

    return ServiceAccountRoles()


def cmd_mounter(args: argparse.Namespace) -> int:
    _logging(args.log_level)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    serve_mounter(args.socket, MountRules(os.path.abspath(args.kubelet_dir), os.path.abspath(args.state_dir),
                                          args.allow_node_credentials, tuple(args.mount_root), _disk_root(args)))
    return 0


def _disk_root(args: argparse.Namespace) -> str:
    """--disk-cache-root as the node plugin and the mounter both compare paths with it ("": none)."""
    return os.path.abspath(args.disk_cache_root) if args.disk_cache_root else ""


def _logging(level: str) -> None:
    logs.configure(level)


def add_commands(sub: argparse._SubParsersAction, extensions: Sequence[NodeExtension] = ()) -> None:
    """Add `csi` and `csi-mounter`; `extensions` add their flags to `csi` and start beside its node service."""
    c = sub.add_parser("csi", help="serve the Kubernetes CSI driver csi.stoker.dev on a unix socket")
    c.add_argument("--endpoint", default="unix:///csi/csi.sock", help="unix:///PATH of the gRPC socket")
    c.add_argument("--node-id", default=os.environ.get("NODE_ID", ""), help="this node's name (node mode)")
    c.add_argument("--mode", choices=("node", "controller", "all"), default="node")
    c.add_argument("--state-dir", default="/var/lib/stoker-csi", help="where volume records survive restarts")
    c.add_argument("--kubelet-dir", default=DEFAULT_KUBELET_DIR,
                   help="kubelet's root directory: volumes are mounted at its staging paths")
    c.add_argument("--mount-root", type=_mount_root, action="append", default=[], metavar="DIR",
                   help=MOUNT_ROOT_HELP)
    c.add_argument("--node-cache-memory", type=_size,
                   help="memory for every Stoker cache on this node together (the mounter's limit): a volume "
                        "whose cache does not fit is refused with RESOURCE_EXHAUSTED (default: no limit)")
    c.add_argument("--disk-cache-root", default="", metavar="DIR",
                   help="a directory on the node's local disk for volumes' disk caches (volume attribute "
                        "diskCacheSize), each in a folder of its own removed with the volume (default: none)")
    c.add_argument("--node-disk-cache", type=_size,
                   help="bytes every volume's disk cache on this node may take together: a volume whose "
                        "diskCacheSize does not fit is refused with RESOURCE_EXHAUSTED (default: no limit)")
    c.add_argument("--secrets-dir", default=DEFAULT_SECRETS_DIR,
                   help="where the credentials of running mounts are kept for repairs (put it on tmpfs)")
    c.add_argument("--allow-node-credentials", action="store_true",
                   help="let volumes with authenticationSource: node use the node's own credentials")
    c.add_argument("--token-audience", default=DEFAULT_AUDIENCE,
                   help="audience of the service-account token used for authenticationSource: pod")
    c.add_argument("--service-account-roles", action="store_true",
                   help="read a pod's IAM role from its service account's eks.amazonaws.com/role-arn annotation")
    c.add_argument("--health-port", type=int, help="serve GET /healthz (the driver answers Probe) on this port")
    c.add_argument("--health-addr", default="0.0.0.0")
    c.add_argument("--mounter-socket", help="ask `stoker csi-mounter` on this socket to start mounts "
                                            "(default: start them from this process, detached)")
    c.add_argument("--mount-timeout", type=float, default=60.0, help="seconds for a mount to become ready")
    c.add_argument("--health-interval", type=float, default=2.0, help="seconds between mount health checks")
    c.add_argument("--metrics-port", type=int, help="serve Prometheus metrics of every volume's mount on this port")
    c.add_argument("--metrics-addr", default="0.0.0.0")
    c.add_argument("--log-level", default="INFO")
    for extension in extensions:
        extension.add_arguments(c)
    c.set_defaults(func=functools.partial(cmd_csi, extensions=tuple(extensions)))

    m = sub.add_parser("csi-mounter", help="own the mount processes of the CSI node plugin (own container)")
    m.add_argument("--socket", default="/run/stoker-mounter/mounter.sock")
    m.add_argument("--state-dir", default="/var/lib/stoker-csi",
                   help="the node plugin's state directory: control sockets and logs of mounts lie there")
    m.add_argument("--kubelet-dir", default=DEFAULT_KUBELET_DIR, help="mount only at kubelet's paths under it")
    m.add_argument("--mount-root", type=_mount_root, action="append", default=[], metavar="DIR",
                   help=MOUNT_ROOT_HELP)
    m.add_argument("--allow-node-credentials", action="store_true",
                   help="run mounts that use this container's own credentials")
    m.add_argument("--disk-cache-root", default="", metavar="DIR",
                   help="mounts may keep a disk cache only in a folder directly under DIR (as stoker csi's)")
    m.add_argument("--log-level", default="INFO")
    m.set_defaults(func=cmd_mounter)
