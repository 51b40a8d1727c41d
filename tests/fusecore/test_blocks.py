from hypothesis import given, strategies as st

from fusecore.cache.blocks import block_count, block_extent, block_span


@given(offset=st.integers(0, 10_000), size=st.integers(0, 10_000), file_size=st.integers(0, 20_000),
       block_size=st.integers(1, 4096))
def test_span_covers_exactly_the_requested_bytes(offset, size, file_size, block_size):
    """Against a naive reference: the set of byte positions each block covers."""
    wanted = set(range(offset, min(offset + size, file_size)))
    span = block_span(offset, size, file_size, block_size)
    covered = set()
    for index in span:
        start, end = block_extent(index, file_size, block_size)
        assert start < end, "no empty block is planned"
        covered |= set(range(start, end))
    assert wanted <= covered
    naive = {pos // block_size for pos in wanted}
    assert set(span) == naive


@given(file_size=st.integers(0, 100_000), block_size=st.integers(1, 5000))
def test_blocks_tile_the_file(file_size, block_size):
    n = block_count(file_size, block_size)
    extents = [block_extent(i, file_size, block_size) for i in range(n)]
    assert sum(end - start for start, end in extents) == file_size
    for (s1, e1), (s2, _) in zip(extents, extents[1:]):
        assert e1 == s2
