"""`stoker mount|unmount|stats|warm|drop`: parse once at the edge into MountConfig, then act."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import stat
import sys

from . import control
from .. import logs
from ..config import (HUGE_PAGES, ConfigError, MountConfig, StoreConfig, config_from_document, format_size, parse_workers, identity_from_document,
                      parse_s3_url, parse_size, parse_ttl)
from .launch import MAX_DOCUMENT, LaunchFailed, NotReady, launch, ready_line
from .mounts import NOT_READY_STATUS, is_mounted, unmount

DEFAULT_READY_TIMEOUT = 120.0


def _default(name: str):
    """A setting's default, from MountConfig or StoreConfig (the one place defaults are written)."""
    for cls in (MountConfig, StoreConfig):
        field = cls.__dataclass_fields__.get(name)
        if field is not None:
            return field.default
    raise KeyError(name)


def _size_default(name: str) -> str:
    return format_size(_default(name)).replace(".0 ", "").replace(" ", "")


def add_commands(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("mount", help="mount s3://BUCKET[/PREFIX] read-only at MOUNTPOINT")
    m.add_argument("source", help="s3://BUCKET[/PREFIX]")
    m.add_argument("mountpoint")
    m.add_argument("--endpoint-url", help="S3-compatible endpoint (MinIO, Ceph RGW, IBM COS, ...)")
    m.add_argument("--region")
    m.add_argument("--profile", help="profile from the shared AWS config/credentials files")
    m.add_argument("--cache-size", default=_size_default("cache_size"),
                   help=f"memory budget of the block cache (default {_size_default('cache_size')}), or 'auto': "
                        "sized at start from a listing of the dataset to hold it (with --peers, this node's share) "
                        "with 10%% headroom, at most half the machine's memory")
    m.add_argument("--disk-cache", default="", metavar="DIR",
                   help="a directory on local disk holding blocks under the memory cache (read before peers and "
                        "the store; kept across restarts; one mount per directory); needs --disk-cache-size")
    m.add_argument("--disk-cache-size", default="", metavar="SIZE",
                   help="bytes the blocks under --disk-cache may take (e.g. 200GiB)")
    m.add_argument("--block-size", default=_size_default("block_size"),
                   help=f"unit of fetch and cache (default {_size_default('block_size')})")
    m.add_argument("--max-concurrency", type=int, default=_default("max_concurrency"),
                   help=f"concurrent GETs (default {_default('max_concurrency')})")
    m.add_argument("--max-prefetch", default=_size_default("max_prefetch"),
                   help=f"read-ahead per sequential reader (default {_size_default('max_prefetch')})")
    m.add_argument("--initial-prefetch", default=_size_default("initial_prefetch"),
                   help="first read-ahead of a file read from its start, when it holds that much "
                        f"(default {_size_default('initial_prefetch')}; 0: one block)")
    m.add_argument("--metadata-ttl", default=str(_default("metadata_ttl")),
                   help=f"seconds to trust listings, or 'forever' (default {_default('metadata_ttl'):g})")
    m.add_argument("--request-timeout", type=float, default=_default("request_timeout"),
                   help=f"seconds per socket read (default {_default('request_timeout'):g})")
    m.add_argument("--connect-timeout", type=float, default=_default("connect_timeout"),
                   help=f"seconds to connect (default {_default('connect_timeout'):g})")
    m.add_argument("--max-attempts", type=int, default=_default("max_attempts"),
                   help=f"attempts per metadata request, botocore retries (default {_default('max_attempts')})")
    m.add_argument("--read-deadline", type=float, default=_default("read_deadline"),
                   help=f"a read waiting longer than this fails with EIO (default {_default('read_deadline'):g})")
    m.add_argument("--no-kernel-cache", action="store_true", help="do not keep the kernel page cache across opens")
    m.add_argument("--no-passthrough", action="store_true",
                   help="answer every read of a file held on the disk tier here, instead of letting the kernel read "
                        "the held file itself (FUSE passthrough: root and Linux 6.9+)")
    m.add_argument("--huge-pages", default=_default("huge_pages"),
                   help=f"block buffers on 2 MiB pages: {', '.join(HUGE_PAGES)} (default auto: where the kernel "
                        "offers them and the machine does not report free memory to a VM host)")
    m.add_argument("--read-ahead-kb", type=int, default=_default("read_ahead_kb"),
                   help="kernel readahead of the mount (root only)")
    m.add_argument("--peers", default="", help="a distributed cache: every member's HOST:PORT, comma-separated "
                                               "(this node's --peer-listen among them); each block is held by its "
                                               "owners and read from them before the store")
    m.add_argument("--peer-listen", default="", help="HOST:PORT this node serves its blocks to the members on")
    m.add_argument("--peer-key-file", default="", help="file holding the cache's shared key (16+ bytes): peer "
                                                       "requests are signed with it, unsigned ones refused")
    m.add_argument("--peer-replicas", type=int, default=_default("peer_replicas"),
                   help="members holding each block (default 1)")
    m.add_argument("--peer-timeout", type=float, default=_default("peer_timeout"),
                   help=f"seconds to connect to a peer and for its first byte, then the store is read "
                        f"(default {_default('peer_timeout'):g})")
    m.add_argument("--workers", default=str(_default("workers")),
                   help="processes serving the mount, each on its own clone of the FUSE connection, sharing one "
                        "cache (default 1), or 'auto': half the cores the mount may use (its CPU affinity and "
                        "cgroup quota), at most 8")
    m.add_argument("--writable", action="store_true",
                   help="let new files be written (in order, from their start): each streams into a multipart "
                        "upload and exists in the bucket once closed")
    m.add_argument("--allow-overwrite", action="store_true", help="--writable: let an existing object be replaced")
    m.add_argument("--allow-delete", action="store_true", help="--writable: let objects be deleted")
    m.add_argument("--part-size", default=_size_default("part_size"),
                   help=f"--writable: size of each uploaded part (default {_size_default('part_size')}; an object "
                        "has at most 10,000)")
    m.add_argument("--upload-concurrency", type=int, default=_default("upload_concurrency"),
                   help=f"--writable: parts of one file sent at once (default {_default('upload_concurrency')})")
    m.add_argument("--part-budget", default=_size_default("part_budget"),
                   help=f"--writable: memory for parts of all files being written (default "
                        f"{_size_default('part_budget')}); a writer that outruns the store waits")
    m.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    m.add_argument("--metrics-addr", default="127.0.0.1", help="address for --metrics-port (default 127.0.0.1)")
    m.add_argument("--control-socket", help="unix socket of the control API (default: derived from MOUNTPOINT)")
    m.add_argument("--allow-other", action="store_true", help="let other users read the mount")
    m.add_argument("--uid", type=int, help="owner shown for files (default: the mounting user)")
    m.add_argument("--gid", type=int, help="group shown for files (default: the mounting user's group)")
    m.add_argument("--foreground", action="store_true", help="stay attached; unmount on SIGINT/SIGTERM")
    m.add_argument("--log-file", help="log file of a background mount")
    m.add_argument("--log-level", default="INFO")
    m.add_argument("--ready-timeout", type=float, default=DEFAULT_READY_TIMEOUT, help=argparse.SUPPRESS)
    m.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    m.add_argument("--fuse-fd", type=int, help=argparse.SUPPRESS)  # a /dev/fuse the caller mounted already
    m.set_defaults(func=cmd_mount)

    # The serving process a mount starts (fusecore.process.launch): its configuration arrives on stdin.
    _serve_arguments(sub.add_parser("serve-mount"))

    u = sub.add_parser("unmount", help="unmount a Stoker mount")
    u.add_argument("mountpoint")
    u.set_defaults(func=cmd_unmount)

    s = sub.add_parser("stats", help="cache and request statistics of a mount")
    s.add_argument("mountpoint")
    s.add_argument("--json", action="store_true")
    s.add_argument("--control-socket")
    s.set_defaults(func=cmd_stats)

    w = sub.add_parser("warm", help="load files or directories of a mount into its cache")
    w.add_argument("mountpoint")
    w.add_argument("paths", nargs="*", help="paths inside the mount (default: everything)")
    w.add_argument("--control-socket")
    w.add_argument("--quiet", action="store_true")
    w.set_defaults(func=cmd_warm)

    pe = sub.add_parser("peers", help="replace the members of a mount's distributed cache (a node joined or left)")
    pe.add_argument("mountpoint")
    pe.add_argument("members", help="every member's HOST:PORT, comma-separated (this node's among them)")
    pe.add_argument("--replicas", type=int, default=None, help="copies of each block (default: unchanged)")
    pe.add_argument("--no-warm", action="store_true", help="do not warm what this node now owns")
    pe.add_argument("--control-socket")
    pe.set_defaults(func=cmd_peers)

    d = sub.add_parser("drop", help="empty the cache of a mount")
    d.add_argument("mountpoint")
    d.add_argument("--control-socket")
    d.set_defaults(func=cmd_drop)


def config_from_args(args: argparse.Namespace) -> MountConfig:
    bucket, prefix = parse_s3_url(args.source)
    store = StoreConfig(
        bucket=bucket, prefix=prefix, endpoint_url=args.endpoint_url, region=args.region, profile=args.profile,
        max_concurrency=args.max_concurrency, connect_timeout=args.connect_timeout,
        request_timeout=args.request_timeout, max_attempts=args.max_attempts,
    )
    return MountConfig(
        store=store,
        mountpoint=os.path.abspath(args.mountpoint),
        cache_size=_default("cache_size") if args.cache_size == "auto" else parse_size(args.cache_size, name="cache-size"),
        cache_size_auto=args.cache_size == "auto",
        block_size=parse_size(args.block_size, name="block-size"),
        disk_cache=os.path.abspath(args.disk_cache) if args.disk_cache else "",
        disk_cache_size=parse_size(args.disk_cache_size, name="disk-cache-size") if args.disk_cache_size else 0,
        max_prefetch=parse_size(args.max_prefetch, name="max-prefetch"),
        initial_prefetch=parse_size(args.initial_prefetch, name="initial-prefetch"),
        peers=args.peers, peer_listen=args.peer_listen, peer_replicas=args.peer_replicas, peer_timeout=args.peer_timeout,
        peer_key_file=os.path.abspath(args.peer_key_file) if args.peer_key_file else "",
        metadata_ttl=parse_ttl(args.metadata_ttl),
        kernel_cache=not args.no_kernel_cache,
        passthrough=not args.no_passthrough,
        huge_pages=args.huge_pages,
        read_ahead_kb=args.read_ahead_kb,
        metrics_port=args.metrics_port,
        metrics_addr=args.metrics_addr,
        control_socket=args.control_socket,
        allow_other=args.allow_other,
        read_deadline=args.read_deadline,
        uid=args.uid,
        gid=args.gid,
        fuse_fd=None if args.fuse_fd is None else _fuse_fd(args.fuse_fd),
        workers=parse_workers(args.workers, "workers"),
        writable=args.writable,
        allow_overwrite=args.allow_overwrite,
        allow_delete=args.allow_delete,
        part_size=parse_size(args.part_size, name="part-size"),
        upload_concurrency=args.upload_concurrency,
        part_budget=parse_size(args.part_budget, name="part-budget"),
    )


def _fuse_fd(fd: int) -> int:
    """--fuse-fd must be an open /dev/fuse descriptor (the mounter mounted it already)."""
    try:
        given, fuse = os.fstat(fd), os.stat("/dev/fuse")
        is_fuse = stat.S_ISCHR(given.st_mode) and given.st_rdev == fuse.st_rdev
    except OSError:
        is_fuse = False
    if not is_fuse:
        raise ConfigError("fuse-fd", f"{fd} is not an open /dev/fuse descriptor")
    return fd


def cmd_mount(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except ConfigError as exc:
        print(f"stoker mount: {exc}", file=sys.stderr)
        return 2
    if args.foreground:
        return _mount_here(cfg, args.log_level, args.ready_fd)
    try:
        log_file = args.log_file or control.default_control_socket(cfg.mountpoint)[:-5] + ".log"
    except ConfigError as exc:  # the default folder is not this user's own (control.runtime_dir)
        print(f"stoker mount: {exc}", file=sys.stderr)
        return 2
    try:
        launch(cfg, log_file=log_file, ready_timeout=args.ready_timeout, log_level=args.log_level)
    except LaunchFailed as exc:
        print(f"stoker mount: {exc}", file=sys.stderr)
        return NOT_READY_STATUS if isinstance(exc, NotReady) else 1
    return 0


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ready-fd", type=int)
    parser.add_argument("--fuse-fd", type=int)
    parser.set_defaults(func=cmd_serve_mount)


def serve_main(argv: list[str]) -> int:
    """`python -m fusecore serve-mount ...`: what fusecore.process.launch starts (see fusecore/__main__.py); and
    `serve-worker`, what a mount's hub starts for each worker (process/workers.py)."""
    parser = argparse.ArgumentParser(prog="python -m fusecore")
    commands = parser.add_subparsers(dest="command", required=True)
    _serve_arguments(commands.add_parser("serve-mount"))
    w = commands.add_parser("serve-worker")
    w.add_argument("--ready-fd", type=int, required=True)
    w.add_argument("--fuse-fd", type=int, required=True)
    w.add_argument("--worker", type=int, required=True)
    w.add_argument("--spawn", type=int, required=True)
    w.add_argument("--hub", type=int, required=True)
    w.add_argument("--shared", required=True)
    w.add_argument("--minor", type=int, required=True)
    w.add_argument("--flags", type=int, required=True)
    w.add_argument("--max-write", type=int, required=True)
    w.set_defaults(func=cmd_serve_worker)
    args = parser.parse_args(argv)
    return args.func(args)


def _read_document() -> tuple[MountConfig, str]:
    """The mount's configuration, credentials and log level from stdin (ConfigError or ValueError if malformed)."""
    return parse_document(json.loads(sys.stdin.buffer.read(MAX_DOCUMENT + 1)[:MAX_DOCUMENT] or b"null"))


def parse_document(doc: object) -> tuple[MountConfig, str]:
    """A serve document (launch.serve_document): the configuration with its credentials, and the log level."""
    if not isinstance(doc, dict) or set(doc) - {"config", "credentials", "log_level"}:
        raise ConfigError("document", "expected config, credentials and log_level only")
    cfg = config_from_document(doc.get("config"), identity_from_document(doc.get("credentials")))
    return cfg, str(doc.get("log_level") or "INFO")


def cmd_serve_worker(args: argparse.Namespace) -> int:
    """Serve a clone of a mount's connection as one of its workers (the hub wrote the document on stdin)."""
    from .workers import WorkerRole

    try:
        cfg, level = _read_document()
    except (ConfigError, ValueError) as exc:
        os.write(args.ready_fd, ready_line(exc))
        return 2
    role = WorkerRole(args.worker, args.spawn, args.shared, args.fuse_fd, args.minor, args.flags, args.max_write,
                      args.hub)
    return serve_worker(cfg, level, role, args.ready_fd)


def serve_forked(message: dict, fds: list[int], store=None) -> int:
    """A worker its hub's template forked (process/template.py): the same document as serve-worker's and its role
    (workers.WorkerRole's fields), in the message, and its two descriptors (its clone of the connection, its ready
    pipe); `store`: the S3Store the hub made before it forked the template (run_worker)."""
    from .workers import WorkerRole

    fuse_fd, ready_fd = fds
    try:
        cfg, level = parse_document(message.get("document"))
        role = WorkerRole(**dict(message["role"], fuse_fd=fuse_fd))
    except (ConfigError, ValueError, KeyError, TypeError) as exc:
        os.write(ready_fd, ready_line(exc if isinstance(exc, (ConfigError, ValueError)) else ValueError(exc)))
        return 2
    return serve_worker(cfg, level, role, ready_fd, forked=True, store=store)


def serve_worker(cfg: MountConfig, level: str, role, ready_fd: int, forked: bool = False, store=None) -> int:
    """Serve as worker `role` (a workers.WorkerRole) once its descriptor is checked; `forked`: from the template, whose
    logging is the hub's until configured again here."""
    from .daemon import run_worker

    try:
        _fuse_fd(role.fuse_fd)
    except ConfigError as exc:
        os.write(ready_fd, ready_line(exc))
        return 2
    logs.configure(level, f"worker {role.index}", again=forked)
    ready_at: int | None = ready_fd

    def ready(error: Exception | None) -> None:
        nonlocal ready_at
        if ready_at is not None:
            os.write(ready_at, ready_line(error))
            os.close(ready_at)
            ready_at = None

    return run_worker(cfg, role, ready, store)


def cmd_serve_mount(args: argparse.Namespace) -> int:
    """Serve the mount described by the JSON document on stdin (see fusecore.process.launch)."""
    try:
        cfg, level = _read_document()
        if args.fuse_fd is not None:
            cfg = dataclasses.replace(cfg, fuse_fd=_fuse_fd(args.fuse_fd))
    except (ConfigError, ValueError) as exc:
        message = f"stoker serve-mount: {exc}"
        print(message, file=sys.stderr)
        if args.ready_fd is not None:
            os.write(args.ready_fd, ready_line(exc))
        return 2
    return _mount_here(cfg, level, args.ready_fd)


def _mount_here(cfg: MountConfig, log_level: str, ready_fd: int | None) -> int:
    from .daemon import run_mount  # the FUSE adapter is loaded only by the process that serves

    logs.configure(log_level)

    def ready(error: Exception | None) -> None:
        nonlocal ready_fd
        if error is not None:
            print(f"stoker mount: {error}", file=sys.stderr)
        if ready_fd is not None:
            os.write(ready_fd, ready_line(error))
            os.close(ready_fd)
            ready_fd = None

    return run_mount(cfg, ready, log_level)


def cmd_unmount(args: argparse.Namespace) -> int:
    mp = os.path.abspath(args.mountpoint)
    if not is_mounted(mp):
        print(f"stoker unmount: {mp} is not mounted", file=sys.stderr)
        return 1
    problem = unmount(mp)
    if problem:
        print(f"stoker unmount: {problem}", file=sys.stderr)
        return 1
    return 0


def _socket(args: argparse.Namespace) -> str:
    return args.control_socket or control.default_control_socket(args.mountpoint)


def _ask(args: argparse.Namespace, op: str) -> dict | None:
    """One request to the mount's control API; None (after saying why) if it did not answer."""
    try:
        return control.call(_socket(args), {"op": op})
    except control.ControlError as exc:
        print(f"stoker {op}: {exc}", file=sys.stderr)
        return None


def cmd_stats(args: argparse.Namespace) -> int:
    stats = _ask(args, "stats")
    if stats is None:
        return 1
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    c, r = stats["cache"], stats["requests"]
    print(f"mount        s3://{stats['bucket']}/{stats['prefix']} at {stats['mountpoint']}")
    print(f"cache        {format_size(c['bytes'])} of {format_size(c['budget'])}, {c['entries']} blocks, "
          f"hit ratio {c['hit_ratio']:.1%}, {c['evictions']} evictions, on {c['pages']} pages")
    print(f"fetched      {format_size(stats['bytes_fetched'])} in {r['get']} GETs ({r['get_prefetch']} prefetch), "
          f"{r['list']} LIST, {r['head']} HEAD")
    print(f"served       {format_size(stats['bytes_served']['cache'])} from cache, "
          f"{format_size(stats['bytes_served']['network'])} from the network")
    print(f"in flight    {stats['inflight']['requests']} GETs, {format_size(stats['inflight']['bytes'])}")
    print(f"errors       {json.dumps(stats['errors']) if stats['errors'] else 'none'}")
    workers, shared = stats.get("workers"), stats.get("shared")
    if workers and shared:
        print(f"workers      {workers['count']} (pids {', '.join(map(str, workers['pids']))}), {workers['restarts']} "
              f"restarted; shared blocks {format_size(shared['bytes'])} of {format_size(shared['budget'])}, "
              f"{shared['blocks']} blocks, {shared['evictions']} evictions")
    writes = stats.get("writes")
    if writes:
        print(f"written      {format_size(writes['bytes_written'])}, {writes['uploads_completed']} objects, "
              f"{writes['uploads_aborted']} aborted, {writes.get('requests_retried', 0)} requests retried; "
              f"{writes['files_open']} files and {writes['uploads_open']} uploads open")
    cluster = stats.get("cluster")
    if cluster:
        by = stats["bytes_by_source"]
        print(f"cluster      {cluster['members']} members, {cluster['replicas']} replicas, this node owns "
              f"{cluster['share']:.1%}; served {format_size(cluster['bytes_served_to_peers'])} to peers")
        print(f"received     {format_size(by['local_cache'])} from the local cache, {format_size(by['peers'])} from "
              f"peers, {format_size(by['store'])} from the store")
        for peer, row in sorted(cluster["peers"].items()):
            print(f"  peer {peer}: {row['hit']} hits, {row['miss']} misses, {row['failed']} failed, "
                  f"{format_size(row['bytes'])}, {row['mean_ms']} ms mean")
    return 0


def cmd_warm(args: argparse.Namespace) -> int:
    try:
        final = None
        for progress in control.warm(_socket(args), args.paths):
            final = progress
            if not args.quiet:
                _progress_bar(progress)
    except control.ControlError as exc:
        print(f"\nstoker warm: {exc}", file=sys.stderr)
        return 1
    if not args.quiet:
        print()
    if final is None:
        return 1
    skipped = f", {final.skipped_files} files did not fit the cache" if final.skipped_files else ""
    print(f"warmed {final.files_done} files, {format_size(final.bytes_done)} in {final.seconds}s"
          f"{skipped}{', ' + str(final.errors) + ' errors' if final.errors else ''}")
    return 1 if final.errors else 0


def _progress_bar(p: control.WarmProgress) -> None:
    frac = min(1.0, p.bytes_done / (p.bytes_total or 1))
    bar = "#" * int(frac * 30)
    done, total = format_size(p.bytes_done), format_size(p.bytes_total)
    print(f"\r[{bar:<30}] {frac:6.1%} {done}/{total}", end="", flush=True)


def cmd_peers(args: argparse.Namespace) -> int:
    """New members, then a warm: the blocks this node now owns come from a replica or the store."""
    members = [m for m in args.members.split(",") if m.strip()]
    try:
        result = control.set_peers(_socket(args), members, args.replicas)
    except control.ControlError as exc:
        print(f"stoker peers: {exc}", file=sys.stderr)
        return 1
    print(f"{result['members']} members, {result['replicas']} replicas; this node owns {result['share']:.1%}")
    if args.no_warm:
        return 0
    args.paths, args.quiet = [], True
    return cmd_warm(args)


def cmd_drop(args: argparse.Namespace) -> int:
    result = _ask(args, "drop")
    if result is None:
        return 1
    print(f"dropped {format_size(result['dropped_bytes'])}")
    return 0
