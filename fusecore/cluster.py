"""A distributed cache's view from one node: who owns a block, asking its owner, serving what this node holds.

Each block has owners among the members (ownership.py); a node warms and keeps the blocks it owns, and
reads a block it does not own from an owner first (peers.py), then from the object store on a miss, a
timeout or any error. Knows nothing of FUSE or Kubernetes: the members come from the mount's
configuration (`--peers`; the operator will write them from the DatasetCacheNodes).
"""

from __future__ import annotations

from .blocks import BlockKey
from .cache import BlockCache, Buffer
from .config import ConfigError, MountConfig
from .ownership import Owners, block_id
from .peers import PeerClient, PeerServer, PeerTimeouts


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
    def __init__(self, cfg: MountConfig, key: bytes):
        self.me = cfg.peer_listen
        self.key = key
        self.owners = Owners(cfg.peer_members, cfg.peer_replicas)
        t = cfg.peer_timeout
        self.client = PeerClient(key, PeerTimeouts(connect=t, first_byte=t, body=t + 2.0))
        self.server: PeerServer | None = None
        self.bytes_from_peers = 0
        self.peer_misses = 0

    def owns(self, key: str, etag: str, index: int) -> bool:
        return self.owners.owns(self.me, block_id(key, etag, index))

    def owner_to_ask(self, key: str, etag: str, index: int) -> str | None:
        """An owner of the block other than this node that is not being avoided; None if this node owns it."""
        owners = self.owners.of(block_id(key, etag, index))
        if self.me in owners:
            return None
        return next((o for o in owners if not self.client.avoided(o)), None)

    def fetch(self, peer: str, key: str, etag: str, index: int, size: int) -> bytearray | None:
        """From a worker thread: the block from `peer`, or None (then the store)."""
        data = self.client.fetch(peer, key, etag, index, size)
        if data is None:
            self.peer_misses += 1
        else:
            self.bytes_from_peers += len(data)
        return data

    def serve(self, held) -> None:
        """Serve what this node holds (`held(key, etag, index)`, thread-safe) on its --peer-listen address."""
        host, _, port = self.me.rpartition(":")
        self.server = PeerServer((host, int(port)), self.key, held).start()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    def stats(self) -> dict:
        server = self.server
        return {"members": len(self.owners.members), "replicas": self.owners.replicas, "me": self.me,
                "share": round(self.owners.share(self.me), 4), "bytes_from_peers": self.bytes_from_peers,
                "peer_misses": self.peer_misses, "peer_failures": dict(self.client.failures),
                "served_to_peers": server.served if server else 0, "refused": server.refused if server else 0,
                "missed_for_peers": server.missed if server else 0}


def held_block(cache: BlockCache, key: str, etag: str, index: int) -> Buffer | None:
    """A whole block this node holds (pages of random readers are never served to peers)."""
    return cache.get(BlockKey(key, etag, index), visit="peer")
