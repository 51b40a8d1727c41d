"""A distributed cache's view from one node: who owns a block, asking its owner, serving what this node holds.

Each block has owners among the members (ownership.py); a node warms and keeps the blocks it owns, and
reads a block it does not own from an owner first (peers.py), then from the object store on a miss, a
timeout or any error. Knows nothing of FUSE or Kubernetes: the members come from the mount's
configuration (`--peers`) and can be replaced while it runs (the control API's `peers`, `stoker peers`):
blocks then change owners, and a warm after the change fetches what this node now owns (from another
owner when R > 1, else from the store).
"""

from __future__ import annotations

import threading
import time

from .blocks import BlockKey
from .cache import BlockCache, Buffer
from .config import ConfigError, MountConfig, check_member
from .metrics import MountMetrics
from .ownership import Owners, block_id
from .peers import PeerClient, PeerServer, PeerTimeouts, cache_prefix


def read_key(path: str) -> bytes:
    """The cache's shared key, from a file (never an argument or the mount document)."""
    try:
        with open(path, "rb") as f:
            key = f.read().strip()
    except OSError as exc:
        raise ConfigError("peer-key-file", f"cannot read {path}: {exc.strerror}") from None
    if len(key) < 16:
        raise ConfigError("peer-key-file", f"{path} must hold a key of at least 16 bytes")
    return key


class Cluster:
    def __init__(self, me: str, members: list[str], replicas: int, key: bytes, metrics: MountMetrics | None = None,
                 *, timeout: float = 0.3, name: str = ""):
        self.me = me
        self.name = name  # the cache's id when the node's peer router serves it (requests under /c/<name>)
        self.key = key
        self.metrics = metrics or MountMetrics()
        self.owners = Owners(members, replicas)
        self.changes = 0  # membership changes since the mount started
        self.prefix = cache_prefix(name) if name else ""
        self.client = PeerClient(key, PeerTimeouts(connect=timeout, first_byte=timeout, body=timeout + 2.0),
                                 prefix=self.prefix)
        self.server: PeerServer | None = None
        self._lock = threading.Lock()  # worker threads count blocks no peer answered
        self.peer_misses = 0
        self._show_owners()

    @classmethod
    def from_config(cls, cfg: MountConfig, key: bytes, metrics: MountMetrics | None = None) -> "Cluster":
        """A member configured at start (`--peers`, `--peer-listen`): it listens on its own address."""
        return cls(cfg.peer_listen, cfg.peer_members, cfg.peer_replicas, key, metrics, timeout=cfg.peer_timeout)

    def set_members(self, members: list[str], replicas: int | None = None) -> dict:
        """Replace the member list (a node joined or left); this node must stay among them. Building the
        table takes ~0.15 s: call it from a worker thread."""
        members = sorted({m.strip() for m in members if m.strip()})
        for member in members:
            check_member(member)
        if self.me not in members:
            raise ValueError(f"this node ({self.me}) must be one of the members")
        replicas = self.owners.replicas if replicas is None else replicas
        if not 1 <= replicas <= len(members):
            raise ValueError(f"replicas must be between 1 and the members ({len(members)})")
        owners = Owners(members, replicas)
        if (owners.members, owners.replicas) != (self.owners.members, self.owners.replicas):
            self.owners = owners
            self.changes += 1
            self.client.close()  # idle connections to members that left
            self._show_owners()
        return {"members": len(owners.members), "replicas": owners.replicas, "share": round(owners.share(self.me), 4)}

    def rekey(self, me: str, key: bytes) -> None:
        """A new address for this node (its peer port moved) or a new key (the cache's handover was made
        again); the members that follow are checked by set_members."""
        check_member(me)
        if key != self.key:
            self.key = self.client.key = key
            if self.server is not None:
                self.server.key = key
        if me != self.me:
            self.me = me
            self._show_owners()

    def _show_owners(self) -> None:
        self.metrics.cluster_members.set(len(self.owners.members))
        self.metrics.cluster_share.set(self.owners.share(self.me))

    def owns(self, key: str, etag: str, index: int) -> bool:
        return self.owners.owns(self.me, block_id(key, etag, index))

    def sources(self, key: str, etag: str, index: int) -> list[str]:
        """Whom to ask for a block before the store: its owners other than this node (a replica when this
        node is an owner), primary first, skipping peers being avoided."""
        return [o for o in self.owners.of(block_id(key, etag, index)) if o != self.me and not self.client.avoided(o)]

    def fetch(self, peers: list[str], key: str, etag: str, index: int, size: int) -> bytearray | None:
        """From a worker thread: the block from the first of `peers` (its `sources`) that answers with it, or
        None (then the store)."""
        m = self.metrics
        for peer in peers:
            began = time.monotonic()
            outcome, data = self.client.ask(peer, key, etag, index, size)
            if outcome == "avoided":  # failed since `sources` was read: not asked
                continue
            seconds = time.monotonic() - began
            m.peer_requests.labels(peer=peer, outcome=outcome).inc()
            m.peer_seconds.labels(peer=peer).inc(seconds)
            m.peer_latency.observe(seconds)
            if data is not None:
                m.peer_bytes.labels(peer=peer).inc(len(data))
                return data
        with self._lock:
            self.peer_misses += 1
        return None

    def serve(self, held, handoff: str | None = None) -> None:
        """Serve what this node holds (`held(key, etag, index)`, thread-safe): on its own address, or on the
        connections the node's peer router hands to the unix socket `handoff`."""
        if handoff is None:
            host, _, port = self.me.rpartition(":")
            self.server = PeerServer((host, int(port)), self.key, held, metrics=self.metrics).start()
        else:
            self.server = PeerServer(None, self.key, held, metrics=self.metrics, prefix=self.prefix).receive(handoff)

    def close(self) -> None:
        self.client.close()
        if self.server is not None:
            self.server.close()

    @property
    def bytes_from_peers(self) -> int:
        """Bytes received from peers (the sum of stoker_peer_bytes_total)."""
        return sum(int(sample.value) for metric in self.metrics.peer_bytes.collect() for sample in metric.samples
                   if sample.name.endswith("_total"))

    def per_peer(self) -> dict[str, dict]:
        """Requests by outcome, bytes and mean latency of each peer this node asked."""
        out: dict[str, dict] = {}
        m = self.metrics
        for metric in m.peer_requests.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    peer = sample.labels["peer"]
                    out.setdefault(peer, {"hit": 0, "miss": 0, "failed": 0})[sample.labels["outcome"]] = int(sample.value)
        for peer, row in out.items():
            asked = row["hit"] + row["miss"] + row["failed"]
            row["bytes"] = int(m.value(m.peer_bytes, peer=peer))
            row["mean_ms"] = round(1000 * m.value(m.peer_seconds, peer=peer) / max(1, asked), 2)
        return out

    def stats(self) -> dict:
        server = self.server
        return {"members": len(self.owners.members), "replicas": self.owners.replicas, "me": self.me,
                "name": self.name,
                "share": round(self.owners.share(self.me), 4), "membership_changes": self.changes,
                "bytes_from_peers": self.bytes_from_peers, "peer_misses": self.peer_misses,
                "peer_failures": dict(self.client.failures), "peers": self.per_peer(),
                "served_to_peers": server.served if server else 0,
                "bytes_served_to_peers": server.served_bytes if server else 0,
                "refused": server.refused if server else 0, "busy": server.busy if server else 0,
                "missed_for_peers": server.missed if server else 0}


def held_block(cache: BlockCache, key: str, etag: str, index: int) -> Buffer | None:
    """A whole block this node holds (pages of random readers are never served to peers)."""
    return cache.get(BlockKey(key, etag, index), visit="peer")
