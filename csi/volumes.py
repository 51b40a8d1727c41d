"""Node-side volume lifecycle over fusecore mounts: stage, publish, hold for warming, repair.

Knows nothing of gRPC or Kubernetes objects: the servicer (node.py) and the warm agent map onto
it, and errors.py maps what it raises. Each volume has one Stoker mount on the node, at its own
path in the state directory; kubelet's staging path and every published target are read-only bind
mounts of it. So all pods on the node share one cache, and a DatasetCache can warm a volume before
any pod has staged it (and keep it after the last pod left).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import threading
from dataclasses import dataclass
from typing import Iterator

from fusecore import control
from fusecore.config import Credentials
from fusecore.mounts import fs_type, is_mounted, mount_entries, unmount, wait_unmounted
from fusecore.store import S3Store

from .attributes import VolumeSpec, credentials_env, parse_secrets, parse_volume_context
from .errors import Conflict, NotStaged, StillMounted, UnknownVolume, VolumeBusy
from .mounter import Mounter
from .state import StateDir, VolumeRecord

log = logging.getLogger(__name__)

STOKER_FS_TYPE = "fuse.stoker"
UNMOUNT_TIMEOUT = 10.0


@dataclass
class Health:
    abnormal: bool
    message: str
    cache_bytes: int = 0
    cache_budget: int = 0


class VolumeLocks:
    """One lock per volume id; a second caller gets VolumeBusy (gRPC ABORTED), never waits."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._held: set[str] = set()

    @contextlib.contextmanager
    def hold(self, volume_id: str) -> Iterator[None]:
        with self._guard:
            if volume_id in self._held:
                raise VolumeBusy(f"another operation on volume {volume_id!r} is in progress")
            self._held.add(volume_id)
        try:
            yield
        finally:
            with self._guard:
                self._held.discard(volume_id)


class VolumeManager:
    def __init__(self, state: StateDir, mounter: Mounter, *, ready_timeout: float = 60.0,
                 check_store: bool = True):
        self.state = state
        self.mounter = mounter
        self.ready_timeout = ready_timeout
        self.check_store = check_store
        self.locks = VolumeLocks()
        self._problems: dict[str, str] = {}  # volume id -> why its mount is broken right now

    # ---- stage / unstage

    def stage(self, volume_id: str, staging_path: str, context: dict[str, str], secrets: dict[str, str]) -> None:
        spec = parse_volume_context(context)
        creds = parse_secrets(secrets)
        with self.locks.hold(volume_id):
            record = self.state.load(volume_id)
            if record is None:
                if is_mounted(staging_path):
                    raise Conflict(f"{staging_path} is already a mount point")
                record = VolumeRecord(volume_id, self.state.mount_path(volume_id), dict(context), dict(secrets))
                self._mount(record, spec, creds)
            else:
                self._check_same_volume(record, spec)
                if record.staging_path not in (None, staging_path):
                    raise Conflict(f"volume {volume_id!r} is already staged at {record.staging_path}")
                self._ensure_serving(record)
            if not is_mounted(staging_path):
                self._bind(record, staging_path)
            record.staging_path = staging_path
            self.state.save(record)
            log.info("staged volume %s (%s) at %s", volume_id, spec.source, staging_path)

    def unstage(self, volume_id: str, staging_path: str) -> None:
        with self.locks.hold(volume_id):
            record = self.state.load(volume_id)
            if record is None or record.staging_path != staging_path:
                if fs_type(staging_path) == STOKER_FS_TYPE:
                    self._unmount(staging_path)  # ours, but no record knows it any more
                return
            live = [t for t in record.targets if is_mounted(t)]
            if live:
                raise NotStaged(f"volume {volume_id!r} is still published at {', '.join(live)}; unpublish first")
            if is_mounted(staging_path):
                self._unmount(staging_path)
            record.staging_path = None
            self._retire_or_save(record)
            log.info("unstaged volume %s from %s", volume_id, staging_path)

    # ---- publish / unpublish

    def publish(self, volume_id: str, staging_path: str, target: str, how: str,
                context: dict[str, str], secrets: dict[str, str]) -> None:
        spec = parse_volume_context(context)
        if spec.ephemeral:
            return self._publish_ephemeral(volume_id, target, how, spec, context, secrets)
        with self.locks.hold(volume_id):
            record = self.state.load(volume_id)
            if record is None or record.ephemeral or record.staging_path != staging_path:
                raise NotStaged(f"volume {volume_id!r} is not staged at {staging_path!r}")
            self._publish_target(record, target, how)

    def _publish_ephemeral(self, volume_id: str, target: str, how: str, spec: VolumeSpec,
                           context: dict[str, str], secrets: dict[str, str]) -> None:
        creds = parse_secrets(secrets)
        with self.locks.hold(volume_id):
            record = self.state.load(volume_id)
            if record is None:
                record = VolumeRecord(volume_id, self.state.mount_path(volume_id), dict(context), dict(secrets),
                                      ephemeral=True)
                self._mount(record, spec, creds)
            elif target not in record.targets:
                raise Conflict(f"ephemeral volume {volume_id!r} is already published at {', '.join(record.targets)}")
            self._publish_target(record, target, how)

    def _publish_target(self, record: VolumeRecord, target: str, how: str) -> None:
        if target in record.targets:
            if record.targets[target] != how:
                raise Conflict(f"volume {record.volume_id!r} is already published at {target} with another capability")
        elif is_mounted(target):
            raise Conflict(f"{target} is already a mount point")
        if not is_mounted(target):
            self._bind(record, target)
        record.targets[target] = how
        self.state.save(record)
        log.info("published volume %s at %s", record.volume_id, target)

    def unpublish(self, volume_id: str, target: str) -> None:
        with self.locks.hold(volume_id):
            record = self.state.load(volume_id)
            if is_mounted(target) and (record is not None and target in record.targets
                                       or fs_type(target) == STOKER_FS_TYPE):
                self._unmount(target)
            if record is not None and target in record.targets:
                del record.targets[target]
                self._retire_or_save(record)
            _remove_dir(target)
            log.info("unpublished volume %s from %s", volume_id, target)

    # ---- holding a volume's cache for a DatasetCache

    def hold(self, volume_id: str, context: dict[str, str], secrets: dict[str, str], holder: str,
             cache_size: int) -> str:
        """Keep the volume mounted on this node for `holder` (a DatasetCache) with the largest budget its
        holders planned; returns the mount's control socket, through which it is warmed."""
        spec = parse_volume_context(context)
        with self.locks.hold(volume_id):
            record = self.state.load(volume_id)
            if record is None:
                record = VolumeRecord(volume_id, self.state.mount_path(volume_id), dict(context), dict(secrets),
                                      holders={holder: cache_size})
                self._mount(record, spec, parse_secrets(secrets))
            else:
                self._check_same_volume(record, spec)
                self._ensure_serving(record)
                record.holders[holder] = cache_size
                self._resize(record, record.cache_size)
            self.state.save(record)
            return self.state.control_socket(volume_id)

    def release(self, volume_id: str, holder: str) -> None:
        """`holder` no longer needs the cache: give the memory back, and stop the mount if unused."""
        with self.locks.hold(volume_id):
            record = self.state.load(volume_id)
            if record is None or holder not in record.holders:
                return
            del record.holders[holder]
            if record.in_use() and isinstance(self._mount_stats(record), dict):
                self._resize(record, record.cache_size or own_cache_size(record))
            self._retire_or_save(record)
            log.info("released volume %s for %s", volume_id, holder)

    # ---- health and repair

    def find(self, volume_id: str, path: str) -> VolumeRecord:
        record = self.state.load(volume_id)
        if record is None or path not in (record.mount_path, *record.binds()):
            raise UnknownVolume(f"volume {volume_id!r} is not staged or published at {path!r} on this node")
        return record

    def health(self, record: VolumeRecord) -> Health:
        if not is_mounted(record.mount_path):
            return Health(True, f"the volume's mount at {record.mount_path} is gone")
        stats = self._mount_stats(record)
        if isinstance(stats, str):
            return Health(True, f"the mount process is gone or not answering ({stats})")
        missing = [path for path in record.binds() if not is_mounted(path)]
        if missing:
            return Health(True, f"not mounted at {missing[0]}")
        cache = stats.get("cache", {})
        return Health(False, "mounted and serving", int(cache.get("bytes", 0)), int(cache.get("budget", 0)))

    def condition(self, record: VolumeRecord) -> Health:
        health = self.health(record)
        problem = self._problems.get(record.volume_id)
        if problem and not health.abnormal:
            health.message = f"recovered after: {problem}"
        return health

    def check_all(self, *, sweep_orphans: bool = False) -> list[str]:
        """Find broken mounts and repair them, drop stale ones; returns the ids of volumes repaired.

        `sweep_orphans` (start-up only, before serving) also unmounts mounts in the state directory that
        no record names: while serving, a mount exists briefly before its record is saved.
        """
        repaired = []
        records = self.state.records()
        for record in records:
            try:
                with self.locks.hold(record.volume_id):
                    current = self.state.load(record.volume_id)
                    if current is None or self._forget_if_stale(current):
                        continue
                    health = self.health(current)
                    if not health.abnormal:
                        continue
                    self._problems[current.volume_id] = health.message
                    log.warning("volume %s is broken (%s); repairing", current.volume_id, health.message)
                    self._repair(current)
                    log.warning("volume %s recovered: mounted again and bound again at %d path(s)",
                                current.volume_id, len(current.binds()))
                    repaired.append(current.volume_id)
            except VolumeBusy:
                continue
            except Exception as exc:  # noqa: BLE001 - keep watching the other volumes
                self._problems[record.volume_id] = f"repair failed: {exc}"
                log.error("volume %s: repair failed: %s", record.volume_id, exc)
        if sweep_orphans:
            self._unmount_orphans({r.mount_path for r in self.state.records()})
        return repaired

    def _forget_if_stale(self, record: VolumeRecord) -> bool:
        """Kubelet removed a staging or target directory: that use of the volume is over."""
        changed = False
        if record.staging_path and not os.path.isdir(record.staging_path):
            record.staging_path, changed = None, True
        for target in [t for t in record.targets if not os.path.isdir(t)]:
            del record.targets[target]
            changed = True
        if not changed:
            return False
        for path in record.binds():
            if not os.path.isdir(path) and is_mounted(path):
                unmount(path)
        log.warning("volume %s: dropped paths kubelet removed", record.volume_id)
        return self._retire_or_save(record)

    def _unmount_orphans(self, known: set[str]) -> None:
        folder = os.path.join(self.state.root, "mounts") + os.sep
        for point, kind in mount_entries():
            if point.startswith(folder) and point not in known and kind == STOKER_FS_TYPE:
                log.warning("unmounting %s: no volume record names it", point)
                unmount(point)

    def _repair(self, record: VolumeRecord) -> None:
        """Mount again if the mount is dead, then bind every path that lost its bind (the lock is held)."""
        if not self._ensure_serving(record):
            for path in record.binds():
                if not is_mounted(path):
                    self._bind(record, path)

    def _ensure_serving(self, record: VolumeRecord) -> bool:
        """Mount again at the same path if the mount is dead, and re-bind every bind of the dead one;
        returns whether it had to."""
        if is_mounted(record.mount_path) and isinstance(self._mount_stats(record), dict):
            return False
        if is_mounted(record.mount_path):
            unmount(record.mount_path)  # dead FUSE connection: lazy unmount
        self._mount(record, parse_volume_context(record.context), parse_secrets(record.secrets))
        for path in record.binds():
            if is_mounted(path):
                unmount(path)  # a bind of the dead mount
            self._bind(record, path)
        return True

    def _mount_stats(self, record: VolumeRecord) -> dict | str:
        """The mount process's stats, or why it did not answer."""
        try:
            return control.call(self.state.control_socket(record.volume_id), {"op": "stats"}, timeout=5)
        except (control.ControlError, OSError, ValueError) as exc:
            return str(exc)

    # ---- helpers

    def _check_same_volume(self, record: VolumeRecord, spec: VolumeSpec) -> None:
        if record.ephemeral or parse_volume_context(record.context).location() != spec.location():
            raise Conflict(f"volume {record.volume_id!r} is already mounted on this node for another source")

    def _mount(self, record: VolumeRecord, spec: VolumeSpec, creds: Credentials | None) -> None:
        if self.check_store:  # typed errors (no bucket, denied, unreachable) before a process starts
            S3Store(spec.store_config(creds, max_attempts=2)).check()
        os.makedirs(record.mount_path, exist_ok=True)
        argv = spec.mount_argv(record.mount_path, self.state.control_socket(record.volume_id),
                               self.state.log_file(record.volume_id), cache_size=record.cache_size)
        self.mounter.start(argv, credentials_env(creds), self.ready_timeout)
        if not is_mounted(record.mount_path):
            raise StillMounted(f"the mount process reported ready but {record.mount_path} is not mounted")

    def _bind(self, record: VolumeRecord, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        result = subprocess.run(["mount", "--bind", "-o", "ro", record.mount_path, path],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise StillMounted(f"bind mount at {path} failed: {result.stderr.strip()}")

    def _resize(self, record: VolumeRecord, cache_size: int) -> None:
        control.call(self.state.control_socket(record.volume_id), {"op": "resize", "cache_size": cache_size})

    def _retire_or_save(self, record: VolumeRecord) -> bool:
        """Stop the mount of a volume nothing uses any more (True), else save the record (False)."""
        if record.in_use():
            self.state.save(record)
            return False
        if is_mounted(record.mount_path):
            self._unmount(record.mount_path)
        self.state.delete(record.volume_id)
        self._problems.pop(record.volume_id, None)
        log.info("stopped the mount of volume %s", record.volume_id)
        return True

    def _unmount(self, path: str) -> None:
        problem = unmount(path)
        if problem or not wait_unmounted(path, UNMOUNT_TIMEOUT):
            raise StillMounted(f"could not unmount {path}: {problem or 'still in mountinfo'}")


def own_cache_size(record: VolumeRecord) -> int:
    """The cache budget the volume asks for itself (its cacheSize attribute, or the mount default)."""
    return int(dict(parse_volume_context(record.context).knobs).get("cacheSize", 4 * 1024**3))


def _remove_dir(path: str) -> None:
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove %s: %s", path, exc)
