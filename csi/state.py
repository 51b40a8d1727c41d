"""The node plugin's memory across restarts: one JSON record per volume in the state directory,
and the credentials of each mount apart from it, in a directory on tmpfs.

A record holds what is needed to mount the volume again without kubelet's help (the volume
context, who its mount authenticates as) and where it is published; it holds no secret. The
credentials a repair needs live in the secrets directory (default /run/stoker-csi, tmpfs on
every systemd host, like kubelet's own pod secrets): 0600 files in a 0700 directory, gone with a
reboot, when the mounts are gone too. Nothing here is ever logged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, field

from fusecore.config import ConfigError, Identity, identity_document, identity_from_document

log = logging.getLogger(__name__)
TMPFS_MAGIC = 0x01021994


@dataclass
class VolumeRecord:
    """One volume on this node: its FUSE mount lives at `mount_path` (kubelet's staging path of the
    volume, or the target of an inline volume); every published target is a read-only bind of it
    that follows it (see csi/volumes.py)."""

    volume_id: str
    mount_path: str
    context: dict[str, str]  # without the service-account tokens kubelet puts there
    who: str = ""  # whom the mount authenticates as (csi/auth.py), never a secret; "" not mounted yet
    ephemeral: bool = False
    staging_path: str | None = None
    targets: dict[str, str] = field(default_factory=dict)  # target -> how it was published
    holders: dict[str, int] = field(default_factory=dict)  # DatasetCache -> the cache budget it planned

    @property
    def cache_size(self) -> int | None:
        """The largest budget a holding DatasetCache planned; None: the volume's own cacheSize."""
        return max(self.holders.values()) if self.holders else None

    def binds(self) -> list[str]:
        """The targets that are binds of the mount (an inline volume's target is the mount itself)."""
        return [t for t in self.targets if t != self.mount_path]

    def paths(self) -> list[str]:
        """Every path at which kubelet or a pod sees this volume."""
        return [self.mount_path, *([self.staging_path] if self.staging_path else []), *self.binds()]

    def in_use(self) -> bool:
        return bool(self.staging_path or self.targets or self.holders)

    @property
    def key(self) -> str:
        return volume_key(self.volume_id)


def volume_key(volume_id: str) -> str:
    """Short, file-name-safe key of a volume (volume ids may hold any character)."""
    return hashlib.sha256(volume_id.encode()).hexdigest()[:16]


class StateDir:
    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        for sub in ("volumes", "run", "logs"):
            os.makedirs(os.path.join(self.root, sub), mode=0o700, exist_ok=True)
        os.chmod(self.root, 0o700)

    def _path(self, volume_id: str) -> str:
        return os.path.join(self.root, "volumes", volume_key(volume_id) + ".json")

    def control_socket(self, volume_id: str) -> str:
        return os.path.join(self.root, "run", volume_key(volume_id) + ".sock")

    def peer_socket(self, volume_id: str) -> str:
        return os.path.join(self.root, "run", volume_key(volume_id) + ".peer")

    def log_file(self, volume_id: str) -> str:
        return os.path.join(self.root, "logs", volume_key(volume_id) + ".log")

    def load(self, volume_id: str) -> VolumeRecord | None:
        try:
            with open(self._path(volume_id)) as f:
                return _record(json.load(f))
        except FileNotFoundError:
            return None

    def save(self, record: VolumeRecord) -> None:
        path = self._path(record.volume_id)
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(record), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def delete(self, volume_id: str) -> None:
        try:
            os.unlink(self._path(volume_id))
        except FileNotFoundError:
            pass

    def records(self) -> list[VolumeRecord]:
        out = []
        folder = os.path.join(self.root, "volumes")
        for name in sorted(os.listdir(folder)):
            if name.endswith(".json"):
                try:
                    with open(os.path.join(folder, name)) as f:
                        out.append(_record(json.load(f)))
                except (OSError, ValueError, TypeError):
                    continue  # a torn or foreign file: not ours to act on
        return out


def _record(data: dict) -> VolumeRecord:
    data.pop("secrets", None)  # a record written before credentials moved to the secrets directory
    return VolumeRecord(**data)


class SecretStore:
    """The credentials of each mount, for repairs: one 0600 file per volume in a 0700 directory."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        os.chmod(self.root, 0o700)
        if not on_tmpfs(self.root):
            log.warning("secrets directory %s is not on tmpfs: credentials reach persistent disk", self.root)

    def _path(self, volume_id: str) -> str:
        return os.path.join(self.root, volume_key(volume_id) + ".json")

    def save(self, volume_id: str, identity: Identity | None) -> None:
        path = self._path(volume_id)
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(identity_document(identity), f)
        os.replace(tmp, path)

    def load(self, volume_id: str) -> Identity | None:
        """The saved credentials; None if none are saved (or the node's own were used)."""
        try:
            with open(self._path(volume_id)) as f:
                return identity_from_document(json.load(f))
        except (FileNotFoundError, ValueError, ConfigError):
            return None

    def has(self, volume_id: str) -> bool:
        return os.path.exists(self._path(volume_id))

    def delete(self, volume_id: str) -> None:
        try:
            os.unlink(self._path(volume_id))
        except FileNotFoundError:
            pass


def on_tmpfs(path: str) -> bool:
    """Whether `path` lies on a memory filesystem (statfs f_type)."""
    import ctypes

    buf = ctypes.create_string_buffer(128)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.statfs(path.encode(), buf) != 0:
        return False
    return int.from_bytes(buf.raw[:8], "little") == TMPFS_MAGIC
