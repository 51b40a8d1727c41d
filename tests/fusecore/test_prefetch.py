from hypothesis import given, strategies as st

from fusecore.read.prefetch import AHEAD_SHARE, LONG_RUN_BLOCKS, ReadAhead

MiB = 1024 * 1024


def sequential(ra: ReadAhead, chunk: int, total: int) -> list[range]:
    return [ra.on_read(off, chunk) for off in range(0, total, chunk)]


def test_window_doubles_on_each_new_block_and_stops_at_the_cap():
    ra = ReadAhead(file_size=1024 * MiB, block_size=MiB, max_window_blocks=16)
    windows = []
    for off in range(0, 40 * MiB, MiB):
        ra.on_read(off, MiB)
        windows.append(ra.window)
    assert windows[:6] == [1, 2, 4, 8, 16, 16]
    assert max(windows) == 16


def test_sequential_reader_gets_every_following_block_exactly_once():
    ra = ReadAhead(file_size=64 * MiB + 5, block_size=MiB, max_window_blocks=8)
    issued = [i for r in sequential(ra, 128 * 1024, 64 * MiB + 5) for i in r]
    assert sorted(issued) == list(range(1, 65)), "blocks 1..64 (the short last one too), none twice"


def test_random_reads_prefetch_nothing():
    ra = ReadAhead(file_size=1024 * MiB, block_size=MiB, max_window_blocks=64)
    for off in (500 * MiB, 3 * MiB, 900 * MiB, 100 * MiB, 42 * MiB):
        assert list(ra.on_read(off, 256 * 1024)) == []


def test_seek_resets_the_window():
    ra = ReadAhead(file_size=1024 * MiB, block_size=MiB, max_window_blocks=64)
    sequential(ra, MiB, 10 * MiB)
    assert ra.window > 1
    assert list(ra.on_read(700 * MiB, MiB)) == []
    assert ra.window == 0
    assert list(ra.on_read(701 * MiB, MiB)) == []  # sequential again, but a run past 0 must first be long
    assert ra.window == 1 and not ra.random


def test_slightly_reordered_kernel_reads_still_count_as_sequential():
    ra = ReadAhead(file_size=1024 * MiB, block_size=MiB, max_window_blocks=64)
    for off in (0, MiB, 3 * MiB, 2 * MiB, 4 * MiB):
        ra.on_read(off, MiB)
    assert ra.window >= 8


@given(reads=st.lists(st.tuples(st.integers(0, 200), st.integers(1, 3 * 4096)), max_size=60),
       file_blocks=st.integers(1, 50), window=st.integers(0, 16))
def test_never_prefetches_past_the_end_or_what_is_being_read(reads, file_blocks, window):
    block = 4096
    file_size = file_blocks * block - 7
    ra = ReadAhead(file_size, block, window)
    last = (file_size - 1) // block
    for start_block, size in reads:
        offset = start_block * block // 4
        ahead = ra.on_read(offset, size)
        for index in ahead:
            assert 0 <= index <= last
            assert index > (min(offset + size, file_size) - 1) // block
        assert len(ahead) <= max(window, 0)


def test_every_break_in_the_sequence_counts_as_a_seek():
    ra = ReadAhead(file_size=1024 * MiB, block_size=MiB, max_window_blocks=64)
    sequential(ra, MiB, 8 * MiB)
    assert ra.seeks == 0
    ra.on_read(500 * MiB, MiB)
    ra.on_read(100 * MiB, MiB)
    assert ra.seeks == 2
    ra.on_read(101 * MiB, MiB)  # an exact continuation starts a new sequential run
    assert ra.seeks == 2 and not ra.random


def test_the_window_grows_on_continuing_reads_inside_the_first_block():
    """A cold reader reaches full parallelism after a few small reads, not after many blocks."""
    ra = ReadAhead(file_size=1024 * MiB, block_size=4 * MiB, max_window_blocks=64)
    for off in range(0, 2 * MiB, 256 * 1024):  # 8 reads, all inside block 0
        ra.on_read(off, 256 * 1024)
    assert ra.window >= 64


def test_a_file_read_from_its_start_begins_with_the_initial_window():
    ra = ReadAhead(file_size=64 * MiB, block_size=4 * MiB, max_window_blocks=64, initial_window=4)
    assert list(ra.on_read(0, 128 * 1024)) == [1, 2, 3, 4], "the first GETs go out with the first read"
    assert not ra.paged(0)


def test_a_file_smaller_than_the_initial_window_starts_with_one_block():
    ra = ReadAhead(file_size=12 * MiB, block_size=4 * MiB, max_window_blocks=64, initial_window=4)
    assert list(ra.on_read(0, 128 * 1024)) == [1]


def test_a_first_read_past_the_start_gets_no_initial_window():
    ra = ReadAhead(file_size=64 * MiB, block_size=4 * MiB, max_window_blocks=64, initial_window=4)
    assert list(ra.on_read(8 * MiB, MiB)) == []
    assert ra.paged(2)


def test_a_read_at_the_start_handled_after_a_later_one_still_begins_a_run_from_the_start():
    """The kernel's first readahead requests may be handled out of order: the file is still read from its start."""
    ra = ReadAhead(file_size=64 * MiB, block_size=4 * MiB, max_window_blocks=64, initial_window=4)
    assert list(ra.on_read(128 * 1024, 128 * 1024)) == [] and ra.paged(0), "alone, it looks like a split's reader"
    assert list(ra.on_read(0, 128 * 1024)) == [1, 2, 3, 4]
    assert not ra.paged(0) and not ra.paged(1)
    assert list(ra.on_read(256 * 1024, 128 * 1024)) == [] and not ra.paged(0), "and it goes on from there"


def test_a_reader_of_a_split_is_paged_and_read_ahead_by_a_share_of_what_it_read():
    """A run that began past offset 0 may stop soon: pages for its first blocks, then at most a quarter ahead."""
    block = 4 * MiB
    ra = ReadAhead(file_size=1024 * MiB, block_size=block, max_window_blocks=64, initial_window=4)
    start = 100 * MiB
    issued: list[int] = []
    for off in range(start, start + LONG_RUN_BLOCKS * block - MiB, MiB):
        issued += ra.on_read(off, MiB)
        assert ra.paged(off // block), "inside the run's first blocks: pages only"
    assert issued == [], "nothing read ahead before the run is long"
    for off in range(start + LONG_RUN_BLOCKS * block - MiB, start + 64 * block, MiB):
        issued += ra.on_read(off, MiB)
        run = off + MiB - start
        assert max(issued) * block - (off + MiB) <= run // AHEAD_SHARE + block
    assert not ra.paged((start + 64 * block) // block)
    assert sorted(issued) == sorted(set(issued)), "each block once"


@given(parts=st.lists(st.tuples(st.integers(1, 200), st.integers(1, 40)), min_size=1, max_size=20))
def test_what_a_reader_past_the_start_gets_read_ahead_is_bounded_by_what_it_read(parts):
    """Whatever split a reader reads (offset, length in MiB), the blocks handed out ahead of where it stopped
    stay within a quarter of what it read (plus the block it stopped in)."""
    block = 4 * MiB
    for start_mib, length_mib in parts:
        ra = ReadAhead(file_size=1024 * MiB, block_size=block, max_window_blocks=64, initial_window=4)
        start = start_mib * MiB
        issued: list[int] = []
        for off in range(start, start + length_mib * MiB, MiB):
            issued += ra.on_read(off, MiB)
        end = start + length_mib * MiB
        beyond = sum(block for i in issued if i * block >= end)
        assert beyond <= length_mib * MiB // AHEAD_SHARE + block
