"""Volumes' disk tiers on a node: one folder per volume under the node's --disk-cache-root, within the node's
--node-disk-cache, removed with the volume's mount (a DatasetCache's hold keeps the mount, and so the folder).

A folder's name is a digest of the volume id (ids may hold any character); folders are 0700 and root's, their
files 0600 (fusecore/cache/disk.py). No volume attribute, pod or Secret names a path: a volume only asks for a size.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time

from fusecore.config import format_size

from .errors import BadRequest, refuse_past

log = logging.getLogger(__name__)


class DiskCaches:
    def __init__(self, root: str = "", node_size: int | None = None):
        self.root = root  # absolute ("": this node has no disk tier)
        self.node_size = node_size  # every volume's disk tier together stays within it (None: no limit)

    def folder(self, volume_id: str) -> str:
        return os.path.join(self.root, hashlib.sha256(volume_id.encode()).hexdigest()[:32])

    def prepare(self, volume_id: str, size: int, others: dict[str, int]) -> str:
        """The folder of a volume that asks for a disk tier of `size` bytes (`others`: what the node's other
        volumes ask), made if missing; BadRequest where this node has no disk tier, NodeFull where it does not
        fit."""
        if not self.root:
            raise BadRequest(f"volume {volume_id!r} asks for a {format_size(size)} disk cache (diskCacheSize), but "
                             "this node has none (the chart's node.diskCache.path)")
        refuse_past(volume_id, size, others, self.node_size, kind="disk cache", setting="node.diskCache.size",
                    advice="Lower its diskCacheSize")
        path = self.folder(volume_id)
        os.makedirs(path, mode=0o700, exist_ok=True)
        os.chmod(path, 0o700)
        return path

    def remove(self, volume_id: str) -> None:
        """Delete the volume's disk tier (its mount has ended, or is ending: a write may still land)."""
        if self.root:
            _remove_tree(self.folder(volume_id))

    def sweep(self, known: set[str]) -> None:
        """Delete folders no volume of the node owns (left by a crash between an unmount and its removal)."""
        if not self.root or not os.path.isdir(self.root):
            return
        mine = {os.path.basename(self.folder(v)) for v in known}
        for name in os.listdir(self.root):
            if len(name) == 32 and name not in mine:
                log.warning("removing disk cache %s: no volume of this node owns it", name)
                _remove_tree(os.path.join(self.root, name))


def _remove_tree(path: str, attempts: int = 20) -> None:
    for _ in range(attempts):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            return
        time.sleep(0.05)  # the ending mount's writer put one more file there
    log.warning("could not remove the disk cache %s", path)
