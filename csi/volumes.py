"""Node-side volume lifecycle over fusecore mounts: stage, publish, hold for warming, repair.

Knows nothing of gRPC or Kubernetes objects: the servicer (node.py) and the warm agent map onto
it, and errors.py maps what it raises.

Layout (why: kubelet's rules, see docs/operations.md and tests/support/kubelet.py):
- A volume's one FUSE mount per node lives at kubelet's own staging path for it
  (`<kubelet>/plugins/kubernetes.io/csi/csi.stoker.dev/<sha256 of the volume id>/globalmount`), and
  nowhere else. Kubelet refuses to unstage while the same filesystem is mounted outside that path,
  so a private mount elsewhere would keep every volume (and its cache) on the node forever.
- A DatasetCache that holds a volume before any pod staged it mounts it at that same path, so the
  later NodeStageVolume finds it warm; after the last pod, NodeUnstageVolume keeps it while held.
- Each published target is a read-only bind of the staging mount that *follows* it (a slave of it,
  shared with its own copies). A container's view of the target (rslave, HostToContainer) follows it
  too. When a mount process dies, repair mounts a new FUSE filesystem on top of the dead one at the
  staging path; the kernel propagates that mount onto every target and into every running container.
  Unmounting a target (every layer) never travels back to the staging mount or other targets.
- Inline (ephemeral) volumes have no staging path: the FUSE mount lives at the target.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from dataclasses import dataclass
from typing import Iterator

from fusecore.process import control
from fusecore.config import identity_document
from fusecore.process.mounts import MountInfo, top_mount
from fusecore.store.client import S3Store

from .attributes import TOKENS_KEY, VolumeSpec, parse_volume_context
from .auth import AuthPolicy, MissingCredentials, Resolved, resolve, same_principal
from .diskcache import DiskCaches
from .kernel import HostMounts, MountTable
from .errors import (BadRequest, Conflict, NotStaged, PermissionDenied, StillMounted, UnknownVolume, VolumeBusy,
                     refuse_past)
from .layout import (DEFAULT_KUBELET_DIR, DRIVER_NAME, allowed_mount_point, driver_staging_dir,  # noqa: F401
                     kubelet_staging_path, mount_point_rule)
from .mounter import MountFailed, Mounter, MountRequest
from .state import SecretStore, StateDir, VolumeRecord

log = logging.getLogger(__name__)

STOKER_FS_TYPE = "fuse.stoker"
LOCK_WAIT = 5.0  # seconds a call waits for another operation on the same volume before ABORTED


@dataclass
class Health:
    abnormal: bool
    message: str
    cache_bytes: int = 0
    cache_budget: int = 0


class VolumeLocks:
    """One lock per volume id; a second caller waits up to `wait` seconds (a health check or repair
    takes about that long), then gets VolumeBusy (gRPC ABORTED, which kubelet retries)."""

    def __init__(self) -> None:
        self._guard = threading.Condition()
        self._held: set[str] = set()

    @contextlib.contextmanager
    def hold(self, volume_id: str, wait: float = 0.0) -> Iterator[None]:
        with self._guard:
            if not self._guard.wait_for(lambda: volume_id not in self._held, timeout=wait):
                raise VolumeBusy(f"another operation on volume {volume_id!r} is in progress")
            self._held.add(volume_id)
        try:
            yield
        finally:
            with self._guard:
                self._held.discard(volume_id)
                self._guard.notify_all()


class VolumeManager:
    def __init__(self, state: StateDir, mounter: Mounter, *, secrets: SecretStore, policy: AuthPolicy = AuthPolicy(),
                 kubelet_dir: str = DEFAULT_KUBELET_DIR, ready_timeout: float = 60.0, check_store: bool = True,
                 node_cache_memory: int | None = None, mounts: MountTable | None = None,
                 mount_roots: tuple[str, ...] = (), disks: DiskCaches | None = None):
        self.state = state
        self.disks = disks or DiskCaches()  # volumes' disk tiers (diskCacheSize) under --disk-cache-root
        self.mounts = mounts or HostMounts()  # the kernel's mount table (a fake in fast tests)
        self.node_cache_memory = node_cache_memory  # the sum of every mount's cache budget stays below it
        self.mounter = mounter
        self.secrets = secrets
        self.policy = policy
        self.kubelet_dir = os.path.abspath(kubelet_dir)
        self.mount_roots = mount_roots  # other orchestrators' directories where paths are taken as given
        self.ready_timeout = ready_timeout
        self.check_store = check_store
        self.locks = VolumeLocks()
        self.lock_wait = LOCK_WAIT
        self._problems: dict[str, str] = {}  # volume id -> why its mount is broken right now

    # ---- stage / unstage

    def check_path(self, path: str, what: str) -> None:
        """A staging or target path must be one of kubelet's for this driver, or lie below a --mount-root:
        anything else is the caller's mistake (INVALID_ARGUMENT), refused before anything is mounted."""
        if not allowed_mount_point(self.kubelet_dir, self.mount_roots, path):
            raise BadRequest(f"{what} {path} is outside this driver's paths: it mounts only at "
                             f"{mount_point_rule(self.kubelet_dir, self.mount_roots)}")

    def stage(self, volume_id: str, staging_path: str, context: dict[str, str], secrets: dict[str, str]) -> None:
        self.check_path(staging_path, "staging_target_path")
        spec = parse_volume_context(context)
        auth = resolve(spec, context, secrets, self.policy)
        staging_path = os.path.abspath(staging_path)
        with self.locks.hold(volume_id, self.lock_wait):
            record = self.state.load(volume_id)
            if record is None:
                if self._is_mounted(staging_path):
                    raise Conflict(f"{staging_path} is already a mount point")
                record = VolumeRecord(volume_id, staging_path, _stored(context))
                self._check_fits(volume_id, cache_budget(record))
                if not auth.pending:  # a pod-identity volume mounts with the first pod's token (publish)
                    self._mount(record, spec, auth)
            else:
                self._check_same_volume(record, spec)
                if record.mount_path != staging_path:
                    raise Conflict(f"volume {volume_id!r} is mounted at {record.mount_path} on this node, not at "
                                   f"the staging path {staging_path} (is --kubelet-dir kubelet's root directory?)")
                if not auth.pending:
                    self._adopt(record, spec, auth)
                self._repair(record)
            record.staging_path = staging_path
            self.state.save(record)
            log.info("staged volume %s (%s) at %s", volume_id, spec.source, staging_path)

    def unstage(self, volume_id: str, staging_path: str) -> None:
        staging_path = os.path.abspath(staging_path)
        with self.locks.hold(volume_id, self.lock_wait):
            record = self.state.load(volume_id)
            if record is None or record.ephemeral or record.mount_path != staging_path:
                if self._fs_type(staging_path) == STOKER_FS_TYPE:
                    self._unmount(staging_path)  # ours, but no record knows it any more
                return
            live = [t for t in record.binds() if self._is_mounted(t)]
            if live:
                raise NotStaged(f"volume {volume_id!r} is still published at {', '.join(live)}; unpublish first")
            record.staging_path = None
            record.targets.clear()
            if record.holders:
                log.info("unstaged volume %s; its mount stays for %s", volume_id, ", ".join(record.holders))
            self._retire_or_save(record)
            log.info("unstaged volume %s from %s", volume_id, staging_path)

    # ---- publish / unpublish

    def publish(self, volume_id: str, staging_path: str, target: str, how: str,
                context: dict[str, str], secrets: dict[str, str]) -> None:
        """Publish (or republish: kubelet repeats it to hand over fresh tokens) the volume at `target`."""
        self.check_path(target, "target_path")
        spec = parse_volume_context(context)
        target = os.path.abspath(target)
        if spec.ephemeral:
            return self._publish_ephemeral(volume_id, target, how, spec, context, secrets)
        staging_path = os.path.abspath(staging_path)
        auth = self._caller(spec, context, secrets)
        with self.locks.hold(volume_id, self.lock_wait):
            record = self.state.load(volume_id)
            if record is None or record.ephemeral or record.mount_path != staging_path:
                raise NotStaged(f"volume {volume_id!r} is not staged at {staging_path!r}")
            if auth is not None:
                self._adopt(record, spec, auth)
            self._publish_target(record, target, how)

    def _caller(self, spec: VolumeSpec, context: dict[str, str], secrets: dict[str, str]) -> Resolved | None:
        """The identity a publish brings: the pod's token, or a publish secret; None: it brings none."""
        if spec.auth != "pod" and not secrets:
            return None
        auth = resolve(spec, context, secrets, self.policy)
        if auth.pending:
            raise MissingCredentials("authenticationSource 'pod': kubelet sent no service-account token (the "
                                     "CSIDriver csi.stoker.dev needs tokenRequests; is the chart's CSIDriver installed?)")
        return auth

    def _publish_ephemeral(self, volume_id: str, target: str, how: str, spec: VolumeSpec,
                           context: dict[str, str], secrets: dict[str, str]) -> None:
        auth = self._caller(spec, context, secrets) or resolve(spec, context, secrets, self.policy)
        with self.locks.hold(volume_id, self.lock_wait):
            record = self.state.load(volume_id)
            if record is None:
                if self._is_mounted(target):
                    raise Conflict(f"{target} is already a mount point")
                record = VolumeRecord(volume_id, target, _stored(context), ephemeral=True)
                self._check_fits(volume_id, cache_budget(record))
                self._mount(record, spec, auth)
            elif record.mount_path != target:
                raise Conflict(f"ephemeral volume {volume_id!r} is already published at {record.mount_path}")
            elif record.targets.get(target, how) != how:
                raise Conflict(f"volume {volume_id!r} is already published at {target} with another capability")
            else:
                self._adopt(record, spec, auth)
            record.targets[target] = how
            self.state.save(record)
            log.info("published inline volume %s at %s", volume_id, target)

    def _publish_target(self, record: VolumeRecord, target: str, how: str) -> None:
        if target in record.targets:
            if record.targets[target] != how:
                raise Conflict(f"volume {record.volume_id!r} is already published at {target} with another capability")
        elif self._is_mounted(target):
            raise Conflict(f"{target} is already a mount point")
        if self._behind(record, [target]):
            self._bind(record, target, how)
        record.targets[target] = how
        self.state.save(record)
        log.info("published volume %s at %s", record.volume_id, target)

    def unpublish(self, volume_id: str, target: str) -> None:
        target = os.path.abspath(target)
        with self.locks.hold(volume_id, self.lock_wait):
            record = self.state.load(volume_id)
            ours = record if record is not None and target in record.targets else None
            if ours is not None or self._fs_type(target) == STOKER_FS_TYPE:
                self._unmount(target)  # every layer: the bind and what repairs stacked on it
            if ours is not None:
                del ours.targets[target]
                self._retire_or_save(ours)  # an inline volume's mount was at the target: it stops
            _remove_dir(target)
            log.info("unpublished volume %s from %s", volume_id, target)

    # ---- holding a volume's cache for a DatasetCache

    def hold(self, volume_id: str, context: dict[str, str], secrets: dict[str, str], holder: str,
             cache_size: int) -> str:
        """Keep the volume mounted on this node for `holder` (a DatasetCache) with the largest budget its
        holders planned; returns the mount's control socket, through which it is warmed.

        Before any pod staged the volume, it is mounted at the staging path kubelet will use for it."""
        spec = parse_volume_context(context)
        auth = resolve(spec, context, secrets, self.policy)
        if auth.source == "pod":
            raise MissingCredentials("a volume with authenticationSource 'pod' cannot be warmed before its pods run: "
                                     "the warm agent has no pod identity (give the DatasetCache a secret)")
        with self.locks.hold(volume_id, self.lock_wait):
            record = self.state.load(volume_id)
            if record is None:
                path = kubelet_staging_path(self.kubelet_dir, volume_id)
                if self._is_mounted(path):
                    raise Conflict(f"{path} is already a mount point")
                record = VolumeRecord(volume_id, path, _stored(context), holders={holder: cache_size})
                self._check_fits(volume_id, cache_budget(record))
                self._mount(record, spec, auth)
            else:
                self._check_same_volume(record, spec)
                self._check_fits(volume_id, max(cache_budget(record), cache_size))
                self._adopt(record, spec, auth)
                self._repair(record)
                record.holders[holder] = cache_size
                self._resize(record, cache_budget(record))
            self.state.save(record)
            return self.state.control_socket(volume_id)

    def release(self, volume_id: str, holder: str) -> None:
        """`holder` no longer needs the cache: give the memory back, and stop the mount if unused."""
        with self.locks.hold(volume_id, self.lock_wait):
            record = self.state.load(volume_id)
            if record is None or holder not in record.holders:
                return
            del record.holders[holder]
            if record.in_use() and not isinstance(self._mount_stats(record), str):
                self._resize(record, cache_budget(record))
            self._retire_or_save(record)
            log.info("released volume %s for %s", volume_id, holder)

    def peer_socket(self, volume_id: str) -> str:
        """Where a volume's mount receives the peer connections of its distributed cache (fusecore/cluster/router.py)."""
        return self.state.peer_socket(volume_id)

    def holders(self) -> set[str]:
        """Everyone holding a volume on this node (DatasetCaches, by namespace/name)."""
        return {holder for record in self.state.records() for holder in record.holders}

    def release_holder(self, holder: str) -> None:
        """`holder` lets go of every volume it holds on this node."""
        for record in self.state.records():
            if holder in record.holders:
                self.release(record.volume_id, holder)

    # ---- the node's cache memory

    def node_cache_usage(self) -> dict[str, int]:
        """The cache budget each volume's mount may fill on this node."""
        return {r.volume_id: cache_budget(r) for r in self.state.records()}

    def _check_fits(self, volume_id: str, budget: int) -> None:
        """Refuse a cache that would take the node's caches past --node-cache-memory (the mounter
        container's memory limit: past it the kernel kills every mount of the node at once)."""
        others = {v: b for v, b in self.node_cache_usage().items() if v != volume_id}
        refuse_past(volume_id, budget, others, self.node_cache_memory, kind="cache", setting="node.cacheMemory",
                    advice="Lower its cacheSize, or free the node")

    # ---- health and repair

    def find(self, volume_id: str, path: str) -> VolumeRecord:
        record = self.state.load(volume_id)
        if record is None or os.path.abspath(path) not in record.paths():
            raise UnknownVolume(f"volume {volume_id!r} is not staged or published at {path!r} on this node")
        return record

    def health(self, record: VolumeRecord) -> Health:
        if not record.who:
            return Health(False, "staged; mounts with the first pod's service-account token")
        stats = self._serving(record)
        if isinstance(stats, str):
            return Health(True, stats)
        behind = self._behind(record)
        if behind:
            return Health(True, f"{behind[0]} does not show the volume's mount")
        return Health(False, "mounted and serving", stats.cache.bytes, stats.cache.budget)

    def condition(self, record: VolumeRecord) -> Health:
        health = self.health(record)
        problem = self._problems.get(record.volume_id)
        if problem and not health.abnormal:
            health.message = f"recovered after: {problem}"
        return health

    def check_all(self, *, sweep_orphans: bool = False) -> list[str]:
        """Find broken mounts and repair them, drop stale ones; returns the ids of volumes repaired.

        `sweep_orphans` (start-up only, before serving) also unmounts Stoker mounts at this driver's
        staging paths that no record names: while serving, a mount exists briefly before its record.
        """
        repaired = []
        for record in self.state.records():
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
                    log.warning("volume %s recovered: serving again at %s and %d target(s)",
                                current.volume_id, current.mount_path, len(current.binds()))
                    repaired.append(current.volume_id)
            except VolumeBusy:
                continue
            except Exception as exc:  # noqa: BLE001 - keep watching the other volumes
                self._problems[record.volume_id] = f"repair failed: {exc}"
                log.error("volume %s: repair failed: %s", record.volume_id, exc)
        if sweep_orphans:
            self._unmount_orphans({r.mount_path for r in self.state.records()})
            self.disks.sweep({r.volume_id for r in self.state.records()})
        return repaired

    def _forget_if_stale(self, record: VolumeRecord) -> bool:
        """Kubelet removed a staging or target directory: that use of the volume is over.

        A directory is removed only when nothing is mounted there and it does not exist: a dead
        FUSE mount answers ENOTCONN to every look, and that is a mount to repair, not a removal."""
        changed = False
        if record.staging_path and self._removed(record.staging_path):
            record.staging_path, changed = None, True
        for target in [t for t in record.targets if self._removed(t)]:
            del record.targets[target]
            changed = True
        if not changed:
            return False
        log.warning("volume %s: dropped paths kubelet removed", record.volume_id)
        return self._retire_or_save(record)

    def _unmount_orphans(self, known: set[str]) -> None:
        folder = driver_staging_dir(self.kubelet_dir) + os.sep
        for point in sorted({m.point for m in self.mounts.table() if m.fs_type == STOKER_FS_TYPE}):
            if point.startswith(folder) and point not in known:
                log.warning("unmounting %s: no volume record names it", point)
                self.mounts.unmount(point)

    def _repair(self, record: VolumeRecord) -> None:
        """Serve again if the mount is dead, with a new mount on top of the dead one (it propagates to
        every target and container), then bind any target the new mount did not reach (the lock is held)."""
        if not record.who:
            return  # a pod-identity volume no pod published yet: nothing is mounted, nothing is broken
        if isinstance(self._serving(record), str):
            self._mount(record, parse_volume_context(record.context), self._saved(record))
        for path in self._behind(record):
            self._bind(record, path, record.targets.get(path, ""))

    def _serving(self, record: VolumeRecord) -> control.MountStats | str:
        """The stats of the volume's live mount, or why its mount is not serving."""
        top = self._top(record.mount_path)
        if top is None or top.fs_type != STOKER_FS_TYPE:
            return f"the volume's mount at {record.mount_path} is gone"
        stats = self._mount_stats(record)
        return stats if not isinstance(stats, str) else f"the mount process is gone or not answering ({stats})"

    def _behind(self, record: VolumeRecord, paths: list[str] | None = None) -> list[str]:
        """Those of `paths` (default: every bind) where a lookup does not reach the volume's current mount."""
        table = self.mounts.table()
        mine = top_mount(record.mount_path, table)
        tops = {path: top_mount(path, table) for path in (record.binds() if paths is None else paths)}
        return [path for path, top in tops.items() if mine is None or top is None or top.device != mine.device]

    def _mount_stats(self, record: VolumeRecord) -> control.MountStats | str:
        """The mount process's stats, or why it did not answer."""
        try:
            return control.stats(self.state.control_socket(record.volume_id), timeout=5)
        except (control.ControlError, OSError, ValueError) as exc:
            return str(exc)

    # ---- helpers

    def _check_same_volume(self, record: VolumeRecord, spec: VolumeSpec) -> None:
        if record.ephemeral or parse_volume_context(record.context).location() != spec.location():
            raise Conflict(f"volume {record.volume_id!r} is already mounted on this node for another source")

    def _mount(self, record: VolumeRecord, spec: VolumeSpec, auth: Resolved) -> None:
        """Mount the volume; the mount process checks the store first and its typed error (no bucket,
        access denied, unreachable) comes back through the mounter."""
        _make_dir(record.mount_path)
        disk = ""
        if spec.disk_cache_size:
            others = {r.volume_id: own_disk_size(r) for r in self.state.records() if r.volume_id != record.volume_id}
            disk = self.disks.prepare(record.volume_id, spec.disk_cache_size, others)
        cfg = spec.mount_config(record.mount_path, self.state.control_socket(record.volume_id),
                                credentials=auth.identity, cache_size=record.cache_size, disk_cache=disk)
        self.mounter.start(MountRequest(cfg, self.state.log_file(record.volume_id)), self.ready_timeout)
        top = self._top(record.mount_path)
        if top is None or top.fs_type != STOKER_FS_TYPE:
            raise StillMounted(f"the mount process reported ready but {record.mount_path} is not mounted")
        record.who = auth.who
        self.secrets.save(record.volume_id, auth.identity)

    def _adopt(self, record: VolumeRecord, spec: VolumeSpec, auth: Resolved) -> None:
        """A caller brings its identity for the volume's mount (a stage, publish, republish or hold).

        The same principal's newer credentials (a fresh token, rotated keys) reach the running mount
        at once. Other keys are checked against the store before they share the mount, then replace
        the old ones. Another pod identity, or node versus secret, never shares it."""
        if not record.who:
            self._mount(record, spec, auth)
            return
        if not same_principal(auth.who, record.who):
            raise PermissionDenied(f"volume {record.volume_id!r} is mounted on this node as {_describe(record.who)}; "
                                   f"a caller authenticating as {_describe(auth.who)} cannot share that mount")
        if auth.who == record.who and self.secrets.load(record.volume_id) == auth.identity:
            return
        if auth.who != record.who and self.check_store:
            S3Store(spec.store_config(auth.identity, max_attempts=2)).check()  # denied: PERMISSION_DENIED
        self.secrets.save(record.volume_id, auth.identity)
        record.who = auth.who
        self.state.save(record)
        try:
            control.rotate(self.state.control_socket(record.volume_id), identity_document(auth.identity))
        except (control.ControlError, OSError) as exc:
            log.warning("volume %s: new credentials saved; the mount did not take them (%s)", record.volume_id, exc)
            return
        log.info("volume %s: the mount signs with new credentials (%s)", record.volume_id, _describe(auth.who))

    def _saved(self, record: VolumeRecord) -> Resolved:
        """The identity the volume was last mounted with, for a repair."""
        if record.who == "node":
            if not self.policy.allow_node_credentials:
                raise MissingCredentials("node credentials are disabled; the volume cannot be mounted again")
            return Resolved("node", None, "node")
        identity = self.secrets.load(record.volume_id)
        if identity is None:
            raise MountFailed(f"the credentials of volume {record.volume_id!r} are gone from the secrets directory; "
                              "kubelet's next stage or publish brings them again")
        return Resolved(record.who.split(":", 1)[0], identity, record.who)

    def _bind(self, record: VolumeRecord, path: str, how: str) -> None:
        """A target: read-only, unless the volume is writable (its PV or StorageClass says so) and this publish is
        not read-only (capability_key's "...:rw")."""
        _make_dir(path)
        writable = parse_volume_context(record.context).writable and how.endswith(":rw")
        try:
            self.mounts.bind(record.mount_path, path, read_only=not writable)
        except OSError as exc:
            raise StillMounted(f"bind mount at {path} failed: {exc.strerror}") from None

    def _resize(self, record: VolumeRecord, cache_size: int) -> None:
        control.resize(self.state.control_socket(record.volume_id), cache_size)

    def _retire_or_save(self, record: VolumeRecord) -> bool:
        """Stop the mount of a volume nothing uses any more (True), else save the record (False)."""
        if record.in_use():
            self.state.save(record)
            return False
        self._forget(record)
        self.disks.remove(record.volume_id)  # its disk tier goes with it (a hold would have kept the mount)
        if record.mount_path == kubelet_staging_path(self.kubelet_dir, record.volume_id):
            _remove_dir(record.mount_path)  # kubelet removes it after an unstage too; a hold made it
            _remove_dir(os.path.dirname(record.mount_path), quiet=True)
        log.info("stopped the mount of volume %s", record.volume_id)
        return True

    def _forget(self, record: VolumeRecord) -> None:
        """Unmount the volume's mount (its process ends with it) and drop the record."""
        self._unmount(record.mount_path)
        self.state.delete(record.volume_id)
        self.secrets.delete(record.volume_id)
        self._problems.pop(record.volume_id, None)

    def _top(self, path: str) -> MountInfo | None:
        """What a lookup of `path` reaches in the mount table (the last mount stacked there)."""
        return top_mount(path, self.mounts.table())

    def _is_mounted(self, path: str) -> bool:
        return self._top(path) is not None

    def _fs_type(self, path: str) -> str | None:
        top = self._top(path)
        return top.fs_type if top else None

    def _removed(self, path: str) -> bool:
        """Kubelet removed this directory (nothing is mounted there and it does not exist)."""
        if self._is_mounted(path):
            return False
        try:
            os.lstat(path)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return False

    def _unmount(self, path: str) -> None:
        problem = self.mounts.unmount(path)
        if problem:
            raise StillMounted(f"could not unmount {problem}")


def _stored(context: dict[str, str]) -> dict[str, str]:
    """A volume context as the record keeps it: without the pod's service-account tokens."""
    return {k: v for k, v in context.items() if k != TOKENS_KEY}


def _describe(who: str) -> str:
    if who.startswith("pod:"):
        return "service account " + who[len("pod:"):].split(":", 1)[0]
    return {"node": "the node's own credentials"}.get(who, "a secret's keys" if who.startswith("secret:") else who)


def cache_budget(record: VolumeRecord) -> int:
    """What the volume's mount may hold in memory: its holders' largest plan, else its own cacheSize."""
    return record.cache_size or own_cache_size(record)


def own_disk_size(record: VolumeRecord) -> int:
    """What the volume's disk tier may take on this node (its diskCacheSize; 0: none)."""
    return parse_volume_context(record.context).disk_cache_size


def own_cache_size(record: VolumeRecord) -> int:
    """The cache budget the volume asks for itself (its cacheSize attribute, or the mount default)."""
    return parse_volume_context(record.context).mount_config("/", "/").cache_size


def _make_dir(path: str) -> None:
    """Create a mount point; one that exists with a dead mount on it (ENOTCONN) is fine too."""
    try:
        os.makedirs(path, mode=0o750)
    except FileExistsError:
        pass


def _remove_dir(path: str, *, quiet: bool = False) -> None:
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if not quiet and exc.errno != errno.ENOTEMPTY:
            log.warning("could not remove %s: %s", path, exc)
