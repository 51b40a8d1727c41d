"""Which mode each open of an inode is answered in (fuse/passthrough.py): the kernel's rule, with a fake
connection that records backing files as the kernel would (fs/fuse/iomode.c: one backing per inode while
passthrough opens live; no passthrough open beside a cached one)."""

from __future__ import annotations

import dataclasses
import errno
import os

import pytest

from fusecore.fuse.passthrough import BACKED, Passthrough, SharedModes, shared_memory_backs
from fusecore.fuse.session import FuseError
from fusecore.store.objects import ObjectInfo


class KernelRules:
    """Backing ids as the kernel hands them out, and the io mode of each inode as the kernel keeps it."""

    def __init__(self, refuse: int = 0):
        self.refuse = refuse
        self.next_id = 1
        self.open: set[int] = set()
        self.closed: list[int] = []

    def open_backing(self, fd: int) -> int:
        os.fstat(fd)  # a live descriptor
        if self.refuse:
            raise OSError(self.refuse, os.strerror(self.refuse))
        backing, self.next_id = self.next_id, self.next_id + 1
        self.open.add(backing)
        return backing

    def close_backing(self, backing: int) -> None:
        self.open.remove(backing)
        self.closed.append(backing)


def _info(etag: str = "e1") -> ObjectInfo:
    return ObjectInfo("k", 10, etag, 0.0)


@pytest.fixture
def held(tmp_path):
    path = tmp_path / "held"
    path.write_bytes(b"0123456789")
    holds = {"on": True}

    def held_file(info: ObjectInfo, memory: bool) -> int | None:
        return os.open(path, os.O_RDONLY) if holds["on"] else None

    return holds, held_file


def test_a_held_file_opens_in_passthrough_and_shares_its_backing(held):
    holds, held_file = held
    kernel = KernelRules()
    pt = Passthrough(kernel, held_file)
    first = pt.open(1, 5, _info())
    second = pt.open(2, 5, _info())
    assert first and first == second and kernel.open == {first}
    pt.release(1 | BACKED, 5)
    assert kernel.open == {first}  # one handle still reads it
    pt.release(2 | BACKED, 5)
    assert kernel.open == set() and kernel.closed == [first]


def test_no_passthrough_beside_a_cached_open(held):
    holds, held_file = held
    pt = Passthrough(KernelRules(), held_file)
    holds["on"] = False
    assert pt.open(1, 5, _info()) == 0  # not held yet: the page-cache mode
    holds["on"] = True
    assert pt.open(2, 5, _info()) == 0  # held now, but the kernel has the inode in the cached mode
    pt.release(1, 5)
    pt.release(2, 5)
    assert pt.open(3, 5, _info()) > 0  # every cached open closed: passthrough


def test_an_object_changed_under_a_passthrough_open_is_refused_until_it_closes(held):
    holds, held_file = held
    kernel = KernelRules()
    pt = Passthrough(kernel, held_file)
    assert pt.open(1, 5, _info("old"))
    with pytest.raises(FuseError) as refused:
        pt.open(2, 5, _info("new"))
    assert refused.value.errno == errno.EBUSY and pt.refused == 1
    pt.release(1 | BACKED, 5)
    assert pt.open(3, 5, _info("new")) and pt.live == 1


def test_a_kernel_that_refuses_backing_files_turns_passthrough_off(held):
    holds, held_file = held
    kernel = KernelRules(refuse=errno.EPERM)
    pt = Passthrough(kernel, held_file)
    assert pt.open(1, 5, _info()) == 0
    assert not pt.enabled
    kernel.refuse = 0
    assert pt.open(2, 6, _info()) == 0  # off for the life of the mount


def test_release_of_unknown_handle_is_harmless(held):
    _, held_file = held
    pt = Passthrough(KernelRules(), held_file)
    pt.release(99, 7)
    pt.release(98 | BACKED, 7)
    assert pt.live == 0


def test_workers_share_each_inodes_mode_and_backing(held, tmp_path):
    """Two workers of one mount (one shared folder): the kernel may hand an inode's opens and releases to either, and
    its rule is per inode, whoever answered: one backing while passthrough opens live, none beside a cached open."""
    holds, held_file = held
    SharedModes.prepare(str(tmp_path))
    kernel = KernelRules()  # backing ids are the connection's: one table for both
    one = Passthrough(kernel, held_file, SharedModes(str(tmp_path)))
    two = Passthrough(kernel, held_file, SharedModes(str(tmp_path)))
    first = one.open(1, 5, _info())
    assert first and two.open(2, 5, _info()) == first  # the same backing, registered once
    with pytest.raises(FuseError) as refused:
        two.open(3, 5, _info("new"))  # changed while the old version is open in passthrough, in either worker
    assert refused.value.errno == errno.EBUSY
    two.release(1 | BACKED, 5)  # released by the worker that did not open it
    assert kernel.open == {first}
    one.release(2 | BACKED, 5)
    assert kernel.open == set() and kernel.closed == [first]
    assert one.live + two.live == 0
    holds["on"] = False
    assert one.open(4, 6, _info()) == 0  # not held: cached
    holds["on"] = True
    assert two.open(5, 6, _info()) == 0  # held now, but another worker's cached open is live
    two.release(4, 6)
    one.release(5, 6)
    assert two.open(6, 6, _info()) > 0
    modes = SharedModes(str(tmp_path))
    assert not modes.idle(6) and modes.idle(5), "a record per inode open now, no more"


def test_an_inode_whose_window_is_full_is_refused_not_left_uncounted(held, tmp_path, monkeypatch):
    """Every open must be counted where every worker sees it (an uncounted cached open could meet a passthrough
    open of the same inode in another worker: EIO for the user). Where the records near its home slot are all taken,
    the open is refused (EBUSY) and no backing it prepared stays registered."""
    import fusecore.fuse.passthrough as pt

    _, held_file = held
    SharedModes.prepare(str(tmp_path))
    monkeypatch.setattr(pt.SharedModes, "_home", staticmethod(lambda inode: 7))  # every inode at one home
    kernel = KernelRules()
    one = Passthrough(kernel, held_file, SharedModes(str(tmp_path)))
    for inode in range(1, pt.WINDOW + 1):
        assert one.open(inode, inode, _info()) > 0
    with pytest.raises(FuseError) as refused:
        one.open(99, pt.WINDOW + 1, _info())
    assert refused.value.errno == errno.EBUSY
    assert len(kernel.open) == pt.WINDOW, "the refused open's backing was let go"
    one.release(1 | BACKED, 1)
    assert one.open(100, pt.WINDOW + 1, _info()) > 0  # a slot freed: counted


@pytest.mark.parametrize("workers, kernel_cache, writable, asked", [
    (1, False, False, False),  # one process, no disk tier: nothing could back an open
    (2, False, False, True),  # the blocks the workers share in memory
    (2, True, False, False),  # the page cache serves a file's later opens instead
    (2, False, True, False),  # a writable mount's opens for writing are the hub's, counted in no worker's modes
])
def test_passthrough_is_asked_at_init_only_where_shared_blocks_may_back_opens(workers, kernel_cache, writable, asked):
    from fusecore.config import MountConfig, StoreConfig
    from fusecore.fuse.protocol import Init
    from fusecore.process.daemon import _wants

    cfg = MountConfig(store=StoreConfig(bucket="b"), mountpoint="/mnt", workers=workers, kernel_cache=kernel_cache,
                      writable=writable)
    assert bool(_wants(cfg, None) & Init.PASSTHROUGH) == (asked and os.geteuid() == 0)
    # (the rule each worker's opens follow too, where a disk tier made INIT ask for passthrough anyway: StokerFS.open)
    assert shared_memory_backs(kernel_cache, writable) == (asked or workers == 1 and not kernel_cache and not writable)
    assert not _wants(dataclasses.replace(cfg, passthrough=False), None) & Init.PASSTHROUGH
