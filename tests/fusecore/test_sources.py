"""BySource: connections by source and in all, oldest first (what the peer port and the router shed from)."""

from fusecore.cluster.sources import BySource


def test_items_are_kept_by_source_and_in_all_oldest_first():
    book: BySource[str] = BySource()
    for source, item in (("a", "a1"), ("b", "b1"), ("a", "a2"), ("c", "c1"), ("a", "a3")):
        book.add(source, item)
    assert len(book) == 5 and list(book.all) == ["a1", "b1", "a2", "c1", "a3"]
    assert (book.count("a"), book.count("b"), book.count("z")) == (3, 1, 0)
    assert list(book.of("a")) == ["a1", "a2", "a3"] and list(book.of("z")) == []
    book.discard("a1")
    book.discard("b1")
    book.discard("nothing")  # (already gone: no error)
    assert list(book.of("a")) == ["a2", "a3"] and book.count("b") == 0 and "b1" not in book
    assert list(book.all) == ["a2", "c1", "a3"]
    book.clear()
    assert len(book) == 0 and book.count("a") == 0
