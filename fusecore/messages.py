"""The typed replies of a mount's control socket (control.py): what other processes and packages read.
The wire stays JSON lines; these are built from it in one place, and the server builds it from them."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from .failures import StokerError


class MalformedReply(StokerError, ValueError):
    """A reply that does not have the shape of its message."""


@dataclass(frozen=True)
class CacheStats:
    bytes: int
    budget: int
    entries: int = 0
    hits: int = 0
    misses: int = 0
    hit_ratio: float = 0.0


@dataclass(frozen=True)
class ClusterStats:
    """A distributed cache member's part of `stats`: who it is among how many, and what it owns."""

    me: str
    members: int
    replicas: int
    share: float
    bytes_from_peers: int
    bytes_served_to_peers: int


@dataclass(frozen=True)
class MountStats:
    """The `stats` reply, typed: what the CSI plugin, the warm agent, the demo and the bench read."""

    pid: int
    cache: CacheStats
    get_requests: int
    bytes_fetched: int
    served_from_cache: int
    served_from_network: int
    inflight_bytes: int
    document: dict = field(repr=False, compare=False)  # the whole reply, for `stoker stats`
    cluster: ClusterStats | None = None  # a member of a distributed cache
    disk_bytes: int = 0  # held by the mount's disk tier (every block it keeps; memory holds some of them too)

    @property
    def held_bytes(self) -> int:
        """What the mount holds for its readers: its disk tier holds all it keeps, memory what fits."""
        return max(self.cache.bytes, self.disk_bytes)

    @property
    def held_on(self) -> str:
        """Where most of what it holds is: "memory", or "disk" where its disk tier holds more."""
        return "disk" if self.disk_bytes > self.cache.bytes else "memory"

    @classmethod
    def from_wire(cls, doc: dict) -> "MountStats":
        try:
            c = doc["cache"]
            cache = CacheStats(int(c["bytes"]), int(c["budget"]), int(c.get("entries", 0)), int(c.get("hits", 0)),
                               int(c.get("misses", 0)), float(c.get("hit_ratio", 0.0)))
            k = doc.get("cluster")
            cluster = None if k is None else ClusterStats(
                str(k["me"]), int(k["members"]), int(k["replicas"]), float(k["share"]), int(k["bytes_from_peers"]),
                int(k.get("bytes_served_to_peers", 0)))
            return cls(int(doc["pid"]), cache, int(doc["requests"]["get"]), int(doc["bytes_fetched"]),
                       int(doc["bytes_served"]["cache"]), int(doc["bytes_served"]["network"]),
                       int(doc["inflight"]["bytes"]), doc, cluster, int((doc.get("disk") or {}).get("bytes", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise MalformedReply(f"the mount answered stats the client does not understand ({exc!r})") from None


@dataclass
class WarmProgress:
    """A warm's progress: one JSON line every quarter second, the last one with `done`."""

    files_total: int = 0
    bytes_total: int = 0
    files_done: int = 0
    bytes_done: int = 0
    skipped_files: int = 0
    errors: int = 0
    seconds: float = 0.0
    done: bool = False

    def wire(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, doc: dict) -> "WarmProgress":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in doc.items() if k in known})


@dataclass(frozen=True)
class JoinRequest:
    """The control socket's `join`: make a running mount a member of a distributed cache (what a node agent
    does in Kubernetes), or bring its membership up to date. The key travels here, never in a file or an
    argument; the node's peer router hands this cache's connections to the unix socket `handoff`."""

    name: str  # the cache's id: its requests arrive under /c/<name>
    me: str  # HOST:PORT this node is reached on (the node's peer port)
    members: tuple[str, ...]
    replicas: int
    key: bytes = field(repr=False)
    handoff: str

    def wire(self) -> dict:
        return {"op": "join", "name": self.name, "me": self.me, "members": list(self.members),
                "replicas": self.replicas, "key": self.key.hex(), "handoff": self.handoff}

    @classmethod
    def from_wire(cls, doc: dict) -> "JoinRequest":
        """ValueError (the control socket's bad_request) when a field is missing or malformed."""
        try:
            name, me, handoff = str(doc["name"]), str(doc["me"]), str(doc["handoff"])
            members, replicas, key = doc["members"], int(doc["replicas"]), bytes.fromhex(str(doc["key"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"join: missing or malformed field ({type(exc).__name__})") from None
        if not isinstance(members, list):
            raise ValueError("join: members must be a list of HOST:PORT")
        if not (8 <= len(name) <= 64 and all(c in "0123456789abcdef" for c in name)):
            raise ValueError("join: name must be the cache's id (8-64 lowercase hex digits, as peer paths carry it)")
        if len(key) < 16:
            raise ValueError("join: the key must be at least 16 bytes")
        if not handoff.startswith("/"):
            raise ValueError("join: handoff must be an absolute path")
        return cls(name, me, tuple(str(m) for m in members), replicas, key, handoff)


@dataclass(frozen=True)
class PathNews:
    """What the hub of a writable mount with several workers tells each worker a write-side request changed, before it
    answers the request (fuse/relay.py): the state of one path now, for the worker's namespace."""

    path: str  # relative to the mount's root
    kind: str  # "file" (being written, or written), "dir" (made here, empty), or "gone"
    key: str = ""
    size: int = 0
    etag: str = ""
    mtime: float = 0.0
    writing: bool = False

    KINDS = ("file", "dir", "gone")

    def to_wire(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, wire: object) -> "PathNews":
        """Checked field by field: a control request's sender is the hub, but no message is taken blind."""
        if not isinstance(wire, dict):
            raise MalformedReply("path news must be an object")
        try:
            news = cls(path=str(wire["path"]), kind=str(wire["kind"]), key=str(wire.get("key", "")),
                       size=int(wire.get("size", 0)), etag=str(wire.get("etag", "")),
                       mtime=float(wire.get("mtime", 0.0)), writing=wire.get("writing", False) is True)
        except (KeyError, TypeError, ValueError) as exc:
            raise MalformedReply(f"path news: {exc!r}") from None
        if news.kind not in cls.KINDS or news.size < 0 or not math.isfinite(news.mtime) or "\0" in news.path \
                or news.path.startswith("/") or any(part in ("", ".", "..") for part in news.path.split("/")):
            raise MalformedReply(f"path news of {news.path!r} ({news.kind}) is not news")
        return news
