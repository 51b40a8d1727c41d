"""One typed configuration object for a mount, parsed once at the edge (CLI, CSI attributes)."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

from .failures import StokerError

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

FOREVER = math.inf
WARM_FRACTION = 0.9  # `warm` fills at most this share of a cache budget (the rest serves reads meanwhile)
INFLIGHT_DIVISOR = 8  # in-flight GET bytes take at most budget / this
WINDOW_FRACTION = 0.1  # of a cache budget: new blocks, and blocks kept for their readers only (cache/memory.py)
STAGED_FRACTION = 0.125  # of a cache budget: prefetched blocks not read yet (cache/memory.py)
HUGE_PAGES = ("auto", "on", "off")  # block buffers on 2 MiB pages: where cheap, always, never (pages.py)


def kept_fraction() -> float:
    """The share of a cache budget that blocks survive in while readers fill the rest at their most:
    the window, staged prefetches and GETs in flight are transient (cache/memory.py). A distributed cache is
    sized on it, because an owner that evicts a block it owns sends every other node to the store."""
    return 1 - WINDOW_FRACTION - STAGED_FRACTION - 1 / INFLIGHT_DIVISOR


SPREAD_SIGMAS = 3  # a member's bytes pass its share's average by this many standard deviations at most (1 in ~740)
MAX_WORKERS = 64
WORKERS_AUTO = 0  # --workers auto
AUTO_WORKERS_MAX = 8  # what auto chooses at most (the prototype's measured scaling: 1 to 8 processes on 16 cores)
DEFAULT_BLOCK_SIZE = 4 * 1024**2  # MountConfig.block_size's default (also what the CSI driver mounts with)


def block_squares(sizes: Iterable[int], block_size: int) -> int:
    """The sum of the squares of the blocks' lengths of objects of `sizes`: what a member's share varies by."""
    total = 0
    for size in sizes:
        full, rest = divmod(size, block_size)
        total += full * block_size * block_size + rest * rest
    return total


def estimated_block_squares(dataset_bytes: int, objects: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """block_squares from the dataset's size and object count alone (exact where the objects are alike)."""
    return min(block_size, dataset_bytes // max(1, objects)) * dataset_bytes


def distributed_cache_size(dataset_bytes: int, members: int, replicas: int = 1, headroom: float = 0.1,
                           squares: int = 0) -> int:
    """The cache budget of one member of a distributed cache: its share of the dataset (R/N; Maglev keeps
    the table's shares within a few percent of it), `headroom` over it, plus SPREAD_SIGMAS standard
    deviations of what it owns (blocks land on owners by hash, so few blocks split unevenly: two members
    and 32 blocks of 4 MiB vary by +-11 MiB; `squares` is block_squares of the dataset), all kept through
    transient use (kept_fraction): an owner that cannot keep its share sends every other member to the store."""
    p = min(replicas, members) / max(1, members)
    spread = SPREAD_SIGMAS * math.sqrt(squares * p * (1 - p))
    return int(math.ceil((dataset_bytes * p * (1 + headroom) + spread) / kept_fraction()))


AUTO_MEMORY_FRACTION = 0.5  # `--cache-size auto` takes at most this share of the machine's memory


def auto_cache_size(cfg: "MountConfig", dataset_bytes: int, memory_bytes: int, squares: int = 0) -> tuple[int, str]:
    """`--cache-size auto`: the budget that holds this mount's part of the dataset (all of it, or in a
    distributed cache its share, R/N) with headroom, as the operator sizes a DatasetCache; at least two
    blocks, at most AUTO_MEMORY_FRACTION of the machine's memory. `squares`: block_squares of the listed objects (a
    distributed member's spread). Returns it and a line that says why."""
    members = len(cfg.peer_members) if cfg.peers else 1
    replicas = cfg.peer_replicas if cfg.peers else 1
    wanted = max(2 * cfg.block_size, distributed_cache_size(dataset_bytes, members, replicas,
                                                            squares=squares if members > 1 else 0))
    cap = int(memory_bytes * AUTO_MEMORY_FRACTION)
    part = f"a {replicas}/{members} share of " if cfg.peers else ""
    why = f"cache size auto: {wanted} bytes for {part}a dataset of {dataset_bytes} bytes"
    if wanted > cap >= 2 * cfg.block_size:
        return cap, f"{why}, capped at {AUTO_MEMORY_FRACTION:.0%} of this machine's memory ({cap} bytes)"
    return wanted, why


class ConfigError(StokerError, ValueError):
    """A configuration value is malformed: `setting` names it (as its flag), `problem` says what is wrong."""

    def __init__(self, setting: str, problem: str):
        super().__init__(f"{setting}: {problem}")
        self.setting, self.problem = setting, problem


def parse_size(text: str | int, *, name: str = "size") -> int:
    """Parse '4GiB', '512MiB', '64M', '1000' into bytes."""
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE_RE.match(str(text))
        unit = match.group(2).lower() if match else None
        if not match or unit not in _SIZE_UNITS:
            raise ConfigError(name, f"cannot parse {text!r} as a size (examples: 4GiB, 512MiB, 1048576)")
        value = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if value < 0:
        raise ConfigError(name, "must not be negative")
    return value


def format_size(n: float) -> str:
    """Bytes for people: '512 B', '3.5 GiB' (the inverse direction of parse_size)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def parse_ttl(text: str | float, *, name: str = "metadata-ttl") -> float:
    """Parse a TTL in seconds, or 'forever'."""
    if isinstance(text, str) and text.strip().lower() in ("forever", "inf", "infinite"):
        return FOREVER
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ConfigError(name, f"expected seconds or 'forever', got {text!r}") from None
    if value < 0 or math.isnan(value):
        raise ConfigError(name, "must be >= 0 seconds")
    return value


def parse_s3_url(url: str) -> tuple[str, str]:
    """Split 's3://bucket/some/prefix' into ('bucket', 'some/prefix/')."""
    if not url.startswith("s3://"):
        raise ConfigError("source", f"expected s3://BUCKET[/PREFIX], got {url!r}")
    rest = url[len("s3://"):]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ConfigError("source", f"no bucket in {url!r}")
    prefix = prefix.strip("/")
    return bucket, (prefix + "/") if prefix else ""


@dataclass(frozen=True)
class Credentials:
    """Static S3 keys handed over by a caller (the CSI plugin's secrets); never printed."""

    access_key_id: str
    secret_access_key: str = field(repr=False)
    session_token: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class WebIdentity:
    """A pod's service-account token, exchanged for temporary keys with STS AssumeRoleWithWebIdentity
    (refreshed before they expire, with the newest token handed over); the token is never printed."""

    role_arn: str
    token: str = field(repr=False)
    session_name: str = "stoker"
    sts_endpoint_url: str | None = None
    sts_region: str | None = None


Identity = Credentials | WebIdentity  # what a mount signs with; None where used means the default chain


@dataclass(frozen=True)
class StoreConfig:
    """Where the objects live and how to talk to the store."""

    bucket: str
    prefix: str = ""
    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    max_concurrency: int = 64
    connect_timeout: float = 5.0
    request_timeout: float = 10.0  # per socket read; bounds a silent store
    max_attempts: int = 5  # botocore 'standard' retry mode (503 SlowDown, resets, ...)
    credentials: Identity | None = None  # None: boto3's default chain (environment, files, roles)


def check_member(member: str) -> None:
    """A distributed cache's member is HOST:PORT (how the others reach it); ValueError if not."""
    host, _, port = member.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{member!r} is not HOST:PORT")


def _within(name: str, value: float, low: float, high: float, text: str | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ConfigError(name, f"{text or f'must be between {low:g} and {high:g}'} (got {value!r})")


@dataclass(frozen=True)
class MountConfig:
    """Everything a mount needs; built once by the CLI (or the CSI plugin) and passed down."""

    store: StoreConfig
    mountpoint: str = ""
    cache_size: int = 4 * 1024**3
    # `--cache-size auto`: sized at start from the dataset's listing (auto_cache_size); cache_size until then
    cache_size_auto: bool = False
    block_size: int = DEFAULT_BLOCK_SIZE
    max_prefetch: int = 256 * 1024**2  # bytes ahead of one sequential reader
    initial_prefetch: int = 16 * 1024**2  # first read-ahead of a file read from offset 0 (0: one block)
    max_inflight_bytes: int = 256 * 1024**2  # all GETs of the mount together
    metadata_ttl: float = 60.0
    kernel_cache: bool = True  # keep_cache while the ETag is unchanged
    passthrough: bool = True  # files held whole on the disk tier are read by the kernel (root, Linux 6.9+)
    huge_pages: str = "auto"  # one of HUGE_PAGES
    read_ahead_kb: int = 1024  # kernel readahead for the mount's bdi (one FUSE read: see README "Reads")
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    control_socket: str | None = None
    allow_other: bool = False
    read_deadline: float = 60.0  # a read waiting longer than this for the store fails with EIO
    uid: int | None = None
    gid: int | None = None
    fuse_fd: int | None = None  # an open /dev/fuse already mounted at `mountpoint` by the caller
    # A distributed cache (fusecore/cluster/tier.py): every member's HOST:PORT, comma-separated; where this node
    # serves its blocks (one of them); the file holding the cache's shared key; copies of each block.
    peers: str = ""
    peer_listen: str = ""
    peer_key_file: str = ""
    peer_replicas: int = 1
    peer_timeout: float = 0.3  # seconds to connect to a peer and for its first byte (the block body: 2 s more)
    # A node-local disk tier under the memory cache (fusecore/cache/disk.py): its directory (absolute) and budget
    disk_cache: str = ""
    disk_cache_size: int = 0
    # Processes serving the mount (fusecore/process/workers.py): 1 serves it in this process, as before; WORKERS_AUTO
    # (`--workers auto`): chosen at start from the cores the mount may use (auto_workers)
    workers: int = 1
    # A worker's own cache (its bytes in flight and the blocks it reads), within cache_size, which stays the mount's
    # (read-ahead and in-flight bytes are sized from it); 0: not a worker, the cache is cache_size
    worker_cache: int = 0
    # Writes (fusecore/read/writer.py): new files written in order, streamed into multipart uploads of part_size,
    # upload_concurrency parts of a file in flight (32: measured against 16, one writer +12% at +10% CPU per GiB),
    # part_budget bytes of parts in memory for the whole mount;
    # overwriting an existing object and deleting one each need their own flag
    writable: bool = False
    allow_overwrite: bool = False
    allow_delete: bool = False
    part_size: int = 8 * 1024**2
    upload_concurrency: int = 32
    part_budget: int = 256 * 1024**2

    def __post_init__(self) -> None:
        """Every setting in its range, named as its flag: no value may yield a mount that cannot serve."""
        store = self.store
        _within("block-size", self.block_size, 64 * 1024, 64 * 1024**2, "must be between 64KiB and 64MiB")
        if self.cache_size < 2 * self.block_size:
            raise ConfigError("cache-size", "must hold at least two blocks")
        _within("max-concurrency", store.max_concurrency, 1, 1024)
        _within("max-attempts", store.max_attempts, 1, 20)
        _within("request-timeout", store.request_timeout, 0.1, 3600, "must be between 0.1 and 3600 seconds")
        _within("connect-timeout", store.connect_timeout, 0.1, 3600, "must be between 0.1 and 3600 seconds")
        _within("read-deadline", self.read_deadline, 1, 86400, "must be between 1 and 86400 seconds")
        _within("max-prefetch", self.max_prefetch, 0, 1 << 50, "must not be negative")
        _within("initial-prefetch", self.initial_prefetch, 0, 1 << 50, "must not be negative")
        _within("max-inflight-bytes", self.max_inflight_bytes, self.block_size, 1 << 50,
                "must hold at least one block")
        if not self.metadata_ttl >= 0:
            raise ConfigError("metadata-ttl", "must be >= 0 seconds")
        if self.huge_pages not in HUGE_PAGES:
            raise ConfigError("huge-pages", f"must be one of {', '.join(HUGE_PAGES)} (got {self.huge_pages!r})")
        _within("read-ahead-kb", self.read_ahead_kb, 0, 1024 * 1024, "must be between 0 and 1048576")
        if self.metrics_port is not None:
            _within("metrics-port", self.metrics_port, 1, 65535)
        _within("peer-timeout", self.peer_timeout, 0.01, 60, "must be between 0.01 and 60 seconds")
        if self.peers or self.peer_listen or self.peer_key_file:
            self._check_peers()
        for name, value in (("uid", self.uid), ("gid", self.gid)):
            if value is not None:
                _within(name, value, 0, 2**32 - 2)
        if self.disk_cache or self.disk_cache_size:
            self._check_disk()
        _within("workers", self.workers, WORKERS_AUTO, MAX_WORKERS, f"must be auto or between 1 and {MAX_WORKERS}")
        if self.worker_cache and not 2 * self.block_size <= self.worker_cache <= self.cache_size:
            raise ConfigError("worker-cache", "must hold two blocks and fit the cache size")
        self._check_writes()
        if self.workers > 1 and self.cache_size // (2 * self.workers) < 2 * self.block_size:
            raise ConfigError("workers", f"{self.workers} workers need a --cache-size of at least "
                                         f"{4 * self.workers} blocks (each keeps two of its own)")

    def _check_writes(self) -> None:
        if (self.allow_overwrite or self.allow_delete) and not self.writable:
            raise ConfigError("allow-overwrite" if self.allow_overwrite else "allow-delete", "needs --writable")
        # S3's bounds: parts of 5 MiB to 5 GiB (the last may be smaller), at most 10,000 of them per object
        _within("part-size", self.part_size, 5 * 1024**2, 5 * 1024**3, "must be between 5MiB and 5GiB")
        _within("upload-concurrency", self.upload_concurrency, 1, 64)
        _within("part-budget", self.part_budget, self.part_size, 1 << 40, "must hold at least one part")

    def _check_disk(self) -> None:
        """What can be said without looking at the disk (fusecore/cache/disk.py checks the directory itself)."""
        if not self.disk_cache:
            raise ConfigError("disk-cache", "--disk-cache-size needs --disk-cache DIR")
        if not self.disk_cache.startswith("/"):
            raise ConfigError("disk-cache", f"must be an absolute path (got {self.disk_cache!r})")
        if self.disk_cache_size < 2 * self.block_size:
            raise ConfigError("disk-cache-size", "--disk-cache needs a size that holds at least two blocks "
                                                 f"(got {self.disk_cache_size})")

    def _check_peers(self) -> None:
        if not (self.peers and self.peer_listen and self.peer_key_file):
            raise ConfigError("peers", "a distributed cache needs --peers, --peer-listen and --peer-key-file together")
        for member in [*self.peer_members, self.peer_listen]:
            try:
                check_member(member)
            except ValueError as exc:
                raise ConfigError("peers", str(exc)) from None
        if self.peer_listen not in self.peer_members:
            raise ConfigError("peer-listen", f"{self.peer_listen} must be one of --peers (how the others reach it)")
        _within("peer-replicas", self.peer_replicas, 1, len(self.peer_members), "must be between 1 and the members")

    @property
    def peer_members(self) -> list[str]:
        return [m.strip() for m in self.peers.split(",") if m.strip()]

    @property
    def inflight_limit(self) -> int:
        """In-flight GET bytes count against the cache budget: at most an eighth of it, so that
        reading ahead never pushes out the blocks a multi-epoch job keeps hitting."""
        return max(self.block_size, min(self.max_inflight_bytes, self.cache_size // INFLIGHT_DIVISOR))

    @property
    def prefetch_limit(self) -> int:
        """Read-ahead of one sequential reader; also bounded by an eighth of the budget."""
        return max(self.block_size, min(self.max_prefetch, self.cache_size // 8))


# ---- the mount's configuration as one JSON document (between processes: CSI plugin -> mounter -> mount)

_PROCESS_LOCAL = {"fuse_fd", "credentials"}  # never travel in a document


def _check_type(name: str, value: Any, kind: Any) -> Any:
    """Accept `value` for a field annotated `kind` (as text: annotations are strings here)."""
    allowed = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,)}
    options = [part.strip() for part in str(kind).split("|")]
    if value is None and "None" in options:
        return None
    for option in options:
        types = allowed.get(option)
        if types and isinstance(value, types) and not (option in ("int", "float") and isinstance(value, bool)):
            return float(value) if option == "float" else value  # type: ignore[arg-type]  # narrowed by isinstance above
    raise ConfigError(name, f"expected {kind}, got {type(value).__name__}")


def _document_of(obj: Any) -> dict:
    out = {}
    for f in dataclasses.fields(obj):
        if f.name in _PROCESS_LOCAL:
            continue
        value = getattr(obj, f.name)
        out[f.name] = _document_of(value) if dataclasses.is_dataclass(value) else value
    return out


def _from_document(cls: type, doc: Any, where: str) -> Any:
    if not isinstance(doc, dict):
        raise ConfigError(where, "expected an object")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in _PROCESS_LOCAL}
    unknown = sorted(set(doc) - set(fields))
    if unknown:
        raise ConfigError(where, f"unknown setting(s) {', '.join(unknown)}")
    values = {}
    for name, value in doc.items():
        if name == "store":
            values[name] = _from_document(StoreConfig, value, "store")
        else:
            values[name] = _check_type(f"{where}.{name}" if where != "config" else name, value, fields[name].type)
    try:
        return cls(**values)
    except TypeError as exc:
        raise ConfigError(where, str(exc)) from None


def mount_document(cfg: MountConfig) -> dict:
    """The configuration as plain JSON data, without credentials or process-local settings."""
    return _document_of(cfg)


def config_from_document(doc: Any, credentials: Identity | None = None) -> MountConfig:
    """Parse and validate a mount document (unknown or mistyped settings raise ConfigError)."""
    cfg = _from_document(MountConfig, doc, "config")
    if not isinstance(doc.get("store"), dict):
        raise ConfigError("config", "store is required")
    if not cfg.mountpoint.startswith("/"):
        raise ConfigError("mountpoint", "must be an absolute path")
    return dataclasses.replace(cfg, store=dataclasses.replace(cfg.store, credentials=credentials))


def identity_document(identity: Identity | None) -> dict | None:
    """Credentials as JSON data (for a 0600 socket or a pipe only: it holds secrets)."""
    if identity is None:
        return None
    kind = "keys" if isinstance(identity, Credentials) else "webIdentity"
    return {"kind": kind, **dataclasses.asdict(identity)}


def identity_from_document(doc: Any) -> Identity | None:
    if doc is None:
        return None
    if not isinstance(doc, dict) or doc.get("kind") not in ("keys", "webIdentity"):
        raise ConfigError("credentials", "expected an object with kind 'keys' or 'webIdentity'")
    cls = Credentials if doc["kind"] == "keys" else WebIdentity
    fields = {f.name: f for f in dataclasses.fields(cls)}
    body = {k: v for k, v in doc.items() if k != "kind"}
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise ConfigError("credentials", f"unknown field(s) {', '.join(unknown)}")
    values = {k: _check_type(f"credentials.{k}", v, fields[k].type) for k, v in body.items()}
    try:
        identity = cls(**values)
    except TypeError as exc:
        raise ConfigError("credentials", str(exc)) from None
    first = identity.access_key_id if isinstance(identity, Credentials) else identity.role_arn
    second = identity.secret_access_key if isinstance(identity, Credentials) else identity.token
    if not first or not second:
        raise ConfigError("credentials", "empty key or token")
    return identity


def parse_workers(text: str | int, name: str = "workers") -> int:
    """`auto` (WORKERS_AUTO) or a number of processes."""
    if isinstance(text, int):
        return text
    if text.strip().lower() == "auto":
        return WORKERS_AUTO
    try:
        return int(text)
    except ValueError:
        raise ConfigError(name, f"must be auto or a number (got {text!r})") from None


def auto_workers(cfg: MountConfig, cores: float) -> tuple[int, str]:
    """--workers auto: half the cores the mount may use (the readers feeding the GPUs need the rest), at least one,
    at most AUTO_WORKERS_MAX, and no more than the cache holds (four blocks a worker); and why, for the log."""
    by_cache = cfg.cache_size // (4 * cfg.block_size)
    n = max(1, min(AUTO_WORKERS_MAX, int(cores) // 2, by_cache))
    return n, f"--workers auto: {n} (of {cores:g} usable cores: half, at most {AUTO_WORKERS_MAX}; the cache holds {by_cache})"
