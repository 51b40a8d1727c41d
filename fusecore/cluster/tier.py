"""A distributed cache's view from one node: who owns a block, asking its owner, serving what this node holds.

Each block has owners among the members (ownership.py); a node keeps the blocks it owns, and reads a
block it does not own (or a random reader's exact range inside one) from an owner first (peers.py), then
from the object store on a miss, a timeout or any error. An owner asked for bytes of its own block that
it does not hold reads them through: it fetches them from the store (one fetch however many nodes ask, a big
block in parts: Fetcher.forward), keeps them and answers, so the cluster fills as it is read, with or without
a warm. Knows nothing of FUSE or Kubernetes: the members come from the mount's
configuration (`--peers`) and can be replaced while it runs (the control API's `peers`, `stoker peers`):
blocks then change owners, and a read or a warm after the change fetches a block this node now owns from
another owner when R > 1, then from the member that owned it before (from its memory or its disk tier, which it
then lets go of: DataPath._for_peer), and only then from the store.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import trio

from ..cache.blocks import BlockKey, block_extent
from ..cache.memory import BlockCache, Buffer
from ..config import ConfigError, MountConfig, check_member
from ..metrics import MountMetrics
from .ownership import Owners, block_id
from .peers import BlockAsk, Lookup, PeerClient, PeerServer, PeerTimeouts, cache_prefix


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


# Asks in a row of the members that owned blocks before that found none held: those members hold nothing of what
# moved (a cluster that starts cold, or caches that turned over since), so they are asked no more.
MOVED_MISSES = 32


class Plan(NamedTuple):
    """Whom a node asks for a block before the store, in order, and how."""

    peers: list[str]
    through: bool  # they may read it through (asked as the block's owners: this node is not one)
    moved: int = 0  # the last `moved` of them owned the block before the membership changed (asked what they hold)


def _without(me: str, owners: Owners) -> Owners | None:
    """The owners among the other members: as they were before `me` joined them."""
    others = [m for m in owners.members if m != me]
    return Owners(others, owners.replicas) if others else None


class Cluster:
    def __init__(self, me: str, members: list[str], replicas: int, key: bytes, metrics: MountMetrics | None = None,
                 *, timeout: float = 0.3, name: str = ""):
        self.me = me
        self.name = name  # the cache's id when the node's peer router serves it (requests under /c/<name>)
        self.key = key
        self.metrics = metrics or MountMetrics()
        self.owners = Owners(members, replicas)
        self._members = frozenset(self.owners.members)
        # Who owned each block before this node's last membership change (for a node that started among its members,
        # before it joined them): a block this node now owns is asked of them before the store
        self.before = _without(me, self.owners)
        self._moved_misses = 0
        self.changes = 0  # membership changes since the mount started
        self.prefix = cache_prefix(name) if name else ""
        self.client = PeerClient(key, PeerTimeouts(connect=timeout, first_byte=timeout, body=timeout + 2.0),
                                 prefix=self.prefix)  # (a read-through beats within first_byte: see peers.py)
        self.server: PeerServer | None = None
        self.peer_misses = 0
        self.moved_bytes = 0  # bytes of blocks this node took over, received from the members that owned them before
        self.asks_disagreeing = 0  # asks read through for no one: their size or ETag is not what this node lists
        self._show_owners()

    @classmethod
    def from_config(cls, cfg: MountConfig, key: bytes, metrics: MountMetrics | None = None) -> "Cluster":
        """A member configured at start (`--peers`, `--peer-listen`): it listens on its own address."""
        return cls(cfg.peer_listen, cfg.peer_members, cfg.peer_replicas, key, metrics, timeout=cfg.peer_timeout)

    def set_members(self, members: list[str], replicas: int | None = None, *, entering: bool = False) -> dict:
        """Replace the member list (a node joined or left); this node must stay among them (`entering`: it joins
        them now). Building a table takes ~0.15 s: call it from a worker thread."""
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
            self.before = _without(self.me, owners) if entering else self.owners
            self.owners, self._members, self._moved_misses = owners, frozenset(owners.members), 0
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
            self.client.close()  # pooled connections keep the old key's sessions
            if self.server is not None:
                self.server.rekey(key)  # and so do the askers' connections it keeps
        if me != self.me:
            self.me = me
            self._show_owners()

    def _show_owners(self) -> None:
        self.metrics.cluster_members.set(len(self.owners.members))
        self.metrics.cluster_share.set(self.owners.share(self.me))

    def owns(self, key: str, etag: str, index: int) -> bool:
        return self.owners.owns(self.me, block_id(key, etag, index))

    def plan(self, key: str, etag: str, index: int) -> Plan:
        """Whom to ask for a block before the store: its owners other than this node (a replica when this node
        is an owner), primary first, skipping peers being avoided, asked to read it through unless this node is an
        owner (it asks the others only for what they hold). An owner then asks the member that owned the block
        before the membership changed: after a join the newcomer's share, and the few blocks Maglev deals anew
        between members that stay, come from the members that hold them rather than from the store again."""
        block = block_id(key, etag, index)
        owners = self.owners.of(block)
        peers = [o for o in owners if o != self.me and not self.client.avoided(o)]
        if self.me not in owners:
            return Plan(peers, True)
        moved = [o for o in self._moved_from(block, owners) if not self.client.avoided(o)]
        return Plan(peers + moved, False, len(moved))

    def _moved_from(self, block: bytes, owners: tuple[str, ...]) -> list[str]:
        """The members that owned `block` before and do not now (one that left is gone: not asked)."""
        if self.before is None:
            return []
        return [o for o in self.before.of(block) if o not in owners and o in self._members]

    async def fetch(self, plan: Plan, want: BlockAsk) -> bytearray | None:
        """On the event loop: the bytes `want` from the first of `plan`'s peers that answers with them, or None
        (then the store)."""
        m = self.metrics
        for position, peer in enumerate(plan.peers):
            began = time.monotonic()
            outcome, data = await self.client.ask(peer, want)
            if outcome == "avoided":  # failed since `plan` was read: not asked
                continue
            seconds = time.monotonic() - began
            m.peer_requests.labels(peer=peer, outcome=outcome).inc()
            m.peer_seconds.labels(peer=peer).inc(seconds)
            m.peer_latency.observe(seconds)
            former = position >= len(plan.peers) - plan.moved  # (an owner before the change)
            if former:
                self._moved_misses = 0 if data is not None else self._moved_misses + 1
                if self._moved_misses >= MOVED_MISSES:
                    self.before = None  # (and its table's memory with it)
            if data is not None:
                m.peer_bytes.labels(peer=peer).inc(len(data))
                self.moved_bytes += len(data) if former else 0
                return data
        self.peer_misses += 1  # (on the event loop)
        return None

    def serve(self, lookup: Lookup, nursery: trio.Nursery, handoff: str | None = None) -> None:
        """Serve what this node holds or owns (`lookup(ask)`, called on `nursery`'s event loop: see peers.Lookup): on
        its own address, or on the connections the node's peer router hands to the unix socket `handoff`."""
        if handoff is None:
            host, _, port = self.me.rpartition(":")
            self.server = PeerServer((host, int(port)), self.key, lookup, metrics=self.metrics).start(nursery)
        else:
            self.server = PeerServer(None, self.key, lookup, metrics=self.metrics,
                                     prefix=self.prefix).receive(handoff).start(nursery)

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
                    row = out.setdefault(peer, {"hit": 0, "through": 0, "miss": 0, "failed": 0})
                    row[sample.labels["outcome"]] = int(sample.value)
        for peer, row in out.items():
            asked = row["hit"] + row["through"] + row["miss"] + row["failed"]
            row["bytes"] = int(m.value(m.peer_bytes, peer=peer))
            row["mean_ms"] = round(1000 * m.value(m.peer_seconds, peer=peer) / max(1, asked), 2)
        return out

    def stats(self) -> dict:
        server = self.server
        return {"members": len(self.owners.members), "replicas": self.owners.replicas, "me": self.me,
                "name": self.name,
                "share": round(self.owners.share(self.me), 4), "membership_changes": self.changes,
                "bytes_from_peers": self.bytes_from_peers, "peer_misses": self.peer_misses,
                "bytes_from_former_owners": self.moved_bytes,
                "peer_failures": dict(self.client.failures), "peers": self.per_peer(),
                "served_to_peers": server.served if server else 0,
                # of those, read through for a peer (fetched from the store by this owner) rather than held
                "read_through_for_peers": server.through if server else 0,
                "read_through_failed": server.through_failed if server else 0,
                "bytes_served_to_peers": server.served_bytes if server else 0,
                "refused": server.refused if server else 0, "busy": server.busy if server else 0,
                "missed_for_peers": server.missed if server else 0,
                "asks_disagreeing": self.asks_disagreeing,
                "connections_shed": server.shed if server else 0,
                "connections_turned_away": server.turned_away if server else 0,
                "connections_from_peers": server.connections if server else 0}


def held(cache: BlockCache, want: BlockAsk, block_size: int) -> Buffer | None:
    """The bytes `want` if this node holds them: inside a whole block, or inside a held range."""
    start, stop = block_extent(want.index, want.size, block_size)
    key = BlockKey(want.key, want.etag, want.index)
    data = cache.get(key, visit="peer") if key in cache else None
    if data is not None:
        return memoryview(data)[want.start - start:want.stop - start]
    found = cache.cover(want.key, want.etag, want.start, want.stop, visit="peer")
    if found is None:
        return None
    base = found[0].start
    return memoryview(found[1])[want.start - base:want.stop - base]


def check_ask(want: BlockAsk, block_size: int, prefix: str) -> None:
    """ValueError unless `want` lies inside its block (of this node's size) of an object of this node's dataset,
    named plainly: a member asks only for what its own reads need, so anything else is refused, never fetched.
    (What an ask says of the object, its size and ETag, is checked against this node's own listing before
    anything is read through: DataPath._read_through.)"""
    start, stop = block_extent(want.index, want.size, block_size)
    if not start <= want.start < want.stop <= stop:
        raise ValueError(f"bytes {want.start}-{want.stop} are not inside block {want.index} of {block_size} bytes")
    if not want.key.startswith(prefix):
        raise ValueError("an object outside this cache's dataset")
    if any(segment in (".", "..") for segment in want.key.split("/")) or "\0" in want.key:
        # a store or a proxy that normalises paths would serve `d/../x` from outside the prefix
        raise ValueError("a key with a '.' or '..' segment")
