"""The namespace against the fake store: listings, name rules, targeted lookups, TTL."""

import pytest
import trio

from fusecore.metrics import MountMetrics
from fusecore.read.namespace import LIST_AFTER_LOOKUPS, ROOT_INODE, Namespace, valid_name
from fusecore.store.errors import NotFound
from tests.support.fakestore import FakeStore


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


async def _direct(fn, *args):
    return fn(*args)


def ns_for(store, prefix="", ttl=60.0, clock=None):
    return Namespace(store, prefix, ttl, MountMetrics(), run_sync=_direct, clock=clock or Clock())


def test_listing_gives_sizes_and_etags_without_any_head():
    store = FakeStore(page_size=7)
    for i in range(50):
        store.put(f"data/train/{i:03d}.jpg", b"x" * i)
    store.put("data/train/sub/a", b"a")
    ns = ns_for(store, prefix="data/")

    async def go():
        await ns.readdir(ROOT_INODE)  # like `ls -l` from the mount root down
        train = await ns.lookup(ROOT_INODE, "train")
        return [(name, ns.node(inode)) for name, inode in await ns.readdir(train.inode)]

    entries = trio.run(go)
    names = [name for name, _ in entries]
    assert names == sorted([f"{i:03d}.jpg" for i in range(50)] + ["sub"])
    sizes = {name: node.info.size for name, node in entries if not node.is_dir}
    assert sizes["007.jpg"] == 7
    assert store.calls["head"] == 0
    assert store.calls["list_dir"] == 2  # root once, train once (paginated inside)


def test_invalid_names_are_skipped_and_a_prefix_wins_over_an_object():
    store = FakeStore()
    for key in ["ok", "a//b", "./x", "../y", "dup", "dup/child", "long" + "n" * 300, "dir/", "dir/inside"]:
        store.put(key, b"1")
    ns = ns_for(store)

    async def go():
        return {name: ns.node(inode) for name, inode in await ns.readdir(ROOT_INODE)}

    entries = trio.run(go)
    assert set(entries) == {"ok", "a", "dup", "dir"}
    assert entries["dup"].is_dir
    assert ns.skipped_names >= 3


@pytest.mark.parametrize("name,ok", [("a", True), ("", False), (".", False), ("..", False), ("a\0b", False),
                                     ("x" * 255, True), ("x" * 256, False), ("é" * 128, False)])
def test_valid_name(name, ok):
    assert valid_name(name) is ok


def test_first_lookup_in_a_directory_of_one_page_lists_it_with_that_one_request():
    store = FakeStore()
    for i in range(30):
        store.put(f"imgs/{i}.jpg", b"x")
    ns = ns_for(store)

    async def go():
        imgs = await ns.lookup(ROOT_INODE, "imgs")
        node = await ns.lookup(imgs.inode, "3.jpg")
        assert node.info.key == "imgs/3.jpg" and node.info.size == 1
        for i in range(30):
            await ns.lookup(imgs.inode, f"{i}.jpg")
        with pytest.raises(NotFound):
            await ns.lookup(imgs.inode, "missing.jpg")

    trio.run(go)
    assert store.calls["probe"] == 2  # the root's first page, then imgs/'s: both whole
    assert store.calls["list_dir"] == store.calls["head"] == store.calls["has_prefix"] == 0


def test_lookup_in_a_large_unlisted_directory_lists_the_name_then_the_whole_directory():
    store = FakeStore(page_size=10)
    for i in range(30):
        store.put(f"imgs/{i}.jpg", b"x")
    ns = ns_for(store)

    async def go():
        imgs = await ns.lookup(ROOT_INODE, "imgs")
        probes = store.calls["probe"]
        node = await ns.lookup(imgs.inode, "3.jpg")
        assert node.info.size == 1 and node.info.key == "imgs/3.jpg"
        assert store.calls["probe"] == probes + 2, "the directory's first page (not all of it), then the name"
        assert store.calls["head"] == store.calls["has_prefix"] == store.calls["list_dir"] == 0
        for i in range(LIST_AFTER_LOOKUPS + 2):
            await ns.lookup(imgs.inode, f"{i}.jpg")
        with pytest.raises(NotFound):
            await ns.lookup(imgs.inode, "missing.jpg")
        return store.calls["list_dir"]

    assert trio.run(go) == 1, "after a targeted lookup the directory is listed once"


def test_a_name_inside_a_large_directorys_first_page_is_answered_by_that_page():
    store = FakeStore(page_size=10)
    for i in range(30):
        store.put(f"imgs/{i}.jpg", b"x" * i)
    store.put("imgs/12.jpg/inner", b"a prefix too")  # '12.jpg/' sorts inside the first page
    ns = ns_for(store)

    async def go():
        imgs = await ns.lookup(ROOT_INODE, "imgs")
        probes = store.calls["probe"]
        node = await ns.lookup(imgs.inode, "11.jpg")  # first page: 0, 1, 10, 11, 12, 12.jpg/, 13, ...
        assert node.info.key == "imgs/11.jpg" and node.info.size == 11
        assert store.calls["probe"] == probes + 1, "the first page answered: no LIST of the name"
        return probes

    probes = trio.run(go)
    ns2 = ns_for(store)

    async def go_dir():
        imgs = await ns2.lookup(ROOT_INODE, "imgs")
        assert (await ns2.lookup(imgs.inode, "12.jpg")).is_dir  # object and prefix: the directory wins

    trio.run(go_dir)
    # each namespace: the root's page, then imgs/'s first page, which answered both names
    assert store.calls["probe"] == 2 * (probes + 1) and store.calls["has_prefix"] == store.calls["list_dir"] == 0


@pytest.mark.parametrize("names,wanted,is_dir", [
    (["a", "a/b"], "a", True),  # an object that is also a prefix shows as the directory
    (["a.txt", "a-1", "a/x"], "a", True),  # siblings that sort before 'a/' share the page
    (["ab", "a"], "a", False),
    (["ab"], "a", None),  # only a longer name: nothing called 'a'
    ([f"a-{i:04d}" for i in range(12)] + ["a/deep"], "a", True),  # 'a/' is beyond the first page
    ([f"a-{i:04d}" for i in range(12)] + ["a"], "a", False),
])
def test_a_name_resolves_from_one_page_of_the_names_that_start_with_it(names, wanted, is_dir):
    store = FakeStore(page_size=5)
    for name in names:
        store.put(name, b"xyz")
    ns = ns_for(store)

    async def go():
        try:
            node = await ns._resolve(ns.node(ROOT_INODE), wanted)
        except NotFound:
            return None
        return node.is_dir

    assert trio.run(go) is is_dir
    beyond = len([n for n in names if n.startswith(wanted) and n < wanted + "/"]) >= 5  # the page size
    assert store.calls["has_prefix"] == (1 if beyond else 0), "a second LIST only when the page ended before 'a/'"


def test_changes_are_picked_up_after_the_ttl_only():
    store = FakeStore()
    store.put("f", b"old")
    clock = Clock()
    ns = ns_for(store, ttl=10, clock=clock)

    async def go():
        first = await ns.lookup(ROOT_INODE, "f")
        ns.remember(first)  # the kernel holds it
        store.put("f", b"newer")
        clock.now += 5
        assert (await ns.lookup(ROOT_INODE, "f")).info.size == 3
        clock.now += 6
        second = await ns.lookup(ROOT_INODE, "f")
        assert second.inode == first.inode, "inode numbers are stable while the kernel holds them"
        assert second.info.size == 5

    trio.run(go)


def test_readdir_pages_of_a_huge_directory_cost_their_own_entries_only():
    """The sorted entries are built once per listing and shared by every readdir page (no re-sort per
    page: paging through 100,000 entries used to be quadratic); a change to the directory rebuilds them."""
    store = FakeStore(page_size=1000)
    for i in range(20_000):
        store.put(f"big/{i:06d}", b"")
    ns = ns_for(store)

    async def go():
        big = await ns.lookup(ROOT_INODE, "big")
        first = await ns.readdir(big.inode)
        again = await ns.readdir(big.inode)
        return big, first, again

    big, first, again = trio.run(go)
    assert first is again and len(first) == 20_000 and first[0][0] == "000000"
    big.set_child("zz-new", 999_999)
    assert big.sorted_children() is not first and big.sorted_children()[-1] == ("zz-new", 999_999)


def test_entries_the_kernel_forgot_are_dropped_once_their_listing_expires():
    """Memory stays bounded: an unreferenced entry goes when its directory listing is older than the TTL
    (or no longer holds it); a referenced one never goes; a directory goes after its children."""
    store = FakeStore(page_size=1)  # the root is more than a page: 'd' is resolved alone, the root stays unlisted
    for i in range(100):
        store.put(f"d/{i:03d}", b"x" * i)
    store.put("keep/a", b"a")
    clock = Clock()
    ns = ns_for(store, ttl=10.0, clock=clock)

    async def listed(path_inode):
        return await ns.readdir(path_inode)

    d = trio.run(ns.lookup, ROOT_INODE, "d")
    ns.remember(d)
    entries = trio.run(listed, d.inode)
    for _, inode in entries:
        ns.remember(ns.node(inode))  # as readdirplus does
    held = ns.node(entries[5][1])
    ns.remember(held)  # a second reference: an open file, say
    assert ns.entries == 1 + 1 + 100  # root, d (resolved alone: the root was not listed), the files
    for _, inode in entries:
        ns.forget(inode, 1)
    assert ns.sweep(force=True) == []  # a fresh listing keeps what it lists
    clock.now += 11  # the listing expired
    ns.forget(ROOT_INODE, 1)  # the root itself is never forgotten
    dropped = ns.sweep()
    assert len(dropped) == 99 and held.inode not in dropped
    assert ns.node(held.inode) is held and ns.entries == 1 + 1 + 1
    with pytest.raises(NotFound):
        ns.node(entries[0][1])
    # the directory still has a referenced child; once that goes, the directory follows (after its own forget)
    ns.forget(held.inode, 1)
    assert ns.sweep(force=True) == [held.inode]
    ns.forget(d.inode, 1)
    assert ns.sweep(force=True) == [d.inode] and ns.entries == 1  # the root only
    # looked up again: listed afresh, same bytes, new inode numbers
    again = trio.run(ns.lookup, ROOT_INODE, "d")
    assert again.inode != d.inode
    assert [n for n, _ in trio.run(listed, again.inode)] == [n for n, _ in entries]
    assert ns.node(dict(trio.run(listed, again.inode))["007"]).info.size == 7


def test_an_entry_gone_from_a_new_listing_is_dropped_when_unreferenced():
    store = FakeStore()
    store.put("a", b"1")
    store.put("b", b"2")
    clock = Clock()
    ns = ns_for(store, ttl=10.0, clock=clock)
    first = dict(trio.run(ns.readdir, ROOT_INODE))
    for inode in first.values():
        ns.remember(ns.node(inode))
    del store.objects["b"]
    clock.now += 11
    second = dict(trio.run(ns.readdir, ROOT_INODE))
    assert second == {"a": first["a"]}  # still held by the kernel: the same inode
    assert ns.sweep(force=True) == []  # "b" is gone from the listing but the kernel still holds it
    ns.forget(first["b"], 1)
    assert ns.sweep(force=True) == [first["b"]]  # the listing is fresh, but no longer holds it
    assert ns.node(first["a"]).path == "a"


def test_a_worker_learns_what_the_hub_wrote_and_a_file_being_written_outlives_its_listing():
    """A writable mount with several workers (fuse/relay.py): the hub's news of a path is the worker's view at once,
    with the directories on its way; a file being written is never swept, though no kernel reference is counted."""
    from fusecore.messages import PathNews

    store = FakeStore()
    store.put("data/old.bin", b"old")
    clock = Clock()
    hub, worker = ns_for(store, prefix="data/", clock=clock), ns_for(store, prefix="data/", clock=clock)

    async def go():
        await worker.readdir(ROOT_INODE)
        worker.learn(PathNews("run/step-1/model.pt", "file", "data/run/step-1/model.pt", 0, "", 1.0, True))
        run = await worker.lookup(ROOT_INODE, "run")
        step = await worker.lookup(run.inode, "step-1")
        model = await worker.lookup(step.inode, "model.pt")
        assert model.writing and run.is_dir and step.is_dir
        clock.now += 3600  # every listing expired: a sweep keeps the file being written, and the way to it
        worker.sweep(force=True)
        await worker.readdir(ROOT_INODE)
        run = await worker.lookup(ROOT_INODE, "run")
        assert (await worker.lookup((await worker.lookup(run.inode, "step-1")).inode, "model.pt")).writing
        worker.learn(PathNews("run/step-1/model.pt", "file", "data/run/step-1/model.pt", 9, '"v2"', 2.0, False))
        assert (model.writing, model.info.size, model.info.etag) == (False, 9, '"v2"')
        assert hub.news_of("nothing/here").kind == "gone"
        old = hub.node(dict(await hub.readdir(ROOT_INODE))["old.bin"])
        assert hub.news_of("old.bin") == PathNews("old.bin", "file", "data/old.bin", 3, old.info.etag,
                                                  old.info.mtime, False)
        del store.objects["data/old.bin"]  # (as the hub's unlink did)
        worker.learn(PathNews("old.bin", "gone"))
        assert "old.bin" not in dict(await worker.readdir(ROOT_INODE))

    trio.run(go)


def test_a_directory_made_here_is_told_of_until_the_bucket_lists_it():
    """mkdir makes a directory that lasts until a file is written in it; the hub of several workers sends it in its
    whole view every 2 s. Once a listing shows the bucket has it, it is a directory like any other: no longer kept
    past its listing, nor sent for the rest of the mount's life."""
    store = FakeStore()
    clock = Clock()
    ns = ns_for(store, prefix="data/", clock=clock)

    async def go():
        await ns.readdir(ROOT_INODE)
        made = ns.add_dir(ns.node(ROOT_INODE), "run")
        ns.remember(made)  # (the kernel's reference: its mkdir's entry)
        assert [n.path for n in ns.written_here()] == ["run"]
        clock.now += 3600
        await ns.readdir(ROOT_INODE)  # listed again: the bucket has no "run/" yet, and it is kept
        assert "run" in dict(await ns.readdir(ROOT_INODE)) and [n.path for n in ns.written_here()] == ["run"]
        store.put("data/run/model.pt", b"weights")  # (a file written in it)
        clock.now += 3600
        await ns.readdir(ROOT_INODE)
        assert "run" in dict(await ns.readdir(ROOT_INODE)) and ns.written_here() == []
        assert not made.made

    trio.run(go)
