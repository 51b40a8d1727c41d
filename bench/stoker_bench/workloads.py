"""Workloads: each reads a part of the dataset through one system and checks the bytes.

A mounted system is read through its mountpoint with plain file I/O (threads stand in for data
loader workers); the boto3 baseline reads the same keys with one GET stream per file. Large reads
are verified on every 16th MiB (and the last piece); small files and random reads are verified
whole. Any mismatch marks the cell WRONG rather than failing the run.
"""

from __future__ import annotations

import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .objectstore import expected_bytes

MiB = 1024 * 1024
KiB = 1024


@dataclass
class Outcome:
    bytes: int = 0
    files: int = 0
    ops: int = 0
    seconds: float = 0.0
    wrong: int = 0
    extra: dict = field(default_factory=dict)


@dataclass
class Dataset:
    """Keys per workload, built from the scale."""

    scale: float
    seq: list[tuple[str, int]] = field(default_factory=list)
    shards: list[tuple[str, int]] = field(default_factory=list)
    small: list[tuple[str, int]] = field(default_factory=list)
    loader: list[tuple[str, int]] = field(default_factory=list)  # the DataLoader cell's samples
    meta: list[tuple[str, int]] = field(default_factory=list)
    epoch: list[tuple[str, int]] = field(default_factory=list)
    bigdir: list[tuple[str, int]] = field(default_factory=list)
    parts: list[tuple[str, int]] = field(default_factory=list)
    epoch_cache: int = 0
    disk_small: list[tuple[str, int]] = field(default_factory=list)  # the `disk` workload's small files
    disk_stream: list[tuple[str, int]] = field(default_factory=list)  # what the `disk` workload streams beside them
    disk_cache: int = 0  # the memory cache of the `disk` workload: about a quarter of what it reads
    flat: list[tuple[str, int]] = field(default_factory=list)  # issue 44's cold epoch: ~110 KB files in one folder
    classes: list[tuple[str, int]] = field(default_factory=list)  # the same files in class folders of 30
    write_size: int = 0  # the write cells' large file (eight writers write a quarter of it each)
    bigfile: list[tuple[str, int]] = field(default_factory=list)  # one object of 4 GiB at --scale 1 (bigfile cell)

    @classmethod
    def build(cls, scale: float) -> "Dataset":
        rng = random.Random(42)
        d = cls(scale)
        big = max(16 * MiB, int(1024 * MiB * scale) // MiB * MiB)
        d.write_size = big + 12345  # several hundred MiB at the default scale (not a whole number of parts)
        d.seq = [(f"large/object-{i}.bin", big + i * 4099) for i in range(4)]
        d.bigfile = [("large/one.bin", 4 * big + 8191)]
        d.shards = [(f"shards/shard-{i:04d}.tar", 64 * MiB) for i in range(max(4, int(16 * scale)))]
        d.small = [(f"small/train/{i % 100:03d}/img-{i:06d}.jpg", rng.randint(90_000, 130_000))
                   for i in range(max(200, int(3000 * scale)))]
        # Issue 33's DataLoader epoch at the default scale: 2,000 samples of ~110 KB, 20 to a class directory.
        # (sizes from a generator of its own: the groups after it keep theirs)
        sizes = random.Random(33)
        d.loader = [(f"loader/train/{i % 100:03d}/img-{i:06d}.jpg", sizes.randint(90_000, 130_000))
                    for i in range(max(200, int(8000 * scale)))]
        d.meta = [(f"meta/files/f-{i:06d}.dat", 1000 + i % 97) for i in range(max(500, int(10_000 * min(1, scale))))]
        d.epoch = [(f"epochs/part-{i:04d}.bin", 32 * MiB) for i in range(max(6, int(24 * scale)))]
        d.epoch_cache = int(sum(s for _, s in d.epoch) / 1.5)
        d.bigdir = [(f"bigdir/files/f-{i:06d}.jpg", 2000 + i % 1000)
                    for i in range(max(2000, int(100_000 * min(1, scale))))]
        d.parts = [(f"parts/part-{i:04d}.bin", 16 * MiB) for i in range(max(8, int(32 * scale)))]
        # Issue 35's mix at the default scale (0.25): 1,200 files of ~100 KB beside four 32 MiB shards, 64 MiB of memory.
        d.disk_small = [(f"mixed/train/{i % 100:03d}/img-{i:06d}.jpg", rng.randint(90_000, 110_000))
                        for i in range(max(200, round(4800 * scale)))]
        d.disk_stream = [(f"mixed/shards/shard-{i:03d}.tar", 32 * MiB) for i in range(max(2, round(16 * scale)))]
        d.disk_cache = max(16 * MiB, int(256 * MiB * scale))  # the 64 MiB at 0.25: the mix is 3.8x memory
        # Issue 44's cold epoch at the default scale: 3,000 files of ~110 KB in one flat folder (as COCO's train2017),
        # and the same sizes in 100 class folders of 30 (sizes from a generator of their own: the groups above keep theirs)
        sizes = random.Random(44)
        flat_sizes = [sizes.randint(90_000, 130_000) for _ in range(max(300, int(12000 * scale)))]
        d.flat = [(f"flat/train2017/img-{i:06d}.jpg", size) for i, size in enumerate(flat_sizes)]
        d.classes = [(f"classes/train/{i % 100:03d}/img-{i:06d}.jpg", size) for i, size in enumerate(flat_sizes)]
        return d

    def objects(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for group in (self.seq, self.shards, self.small, self.loader, self.meta, self.epoch, self.bigdir, self.parts,
                      self.disk_small, self.disk_stream, self.flat, self.classes, self.bigfile):
            out.update(group)
        return out


# Cells run only when named (--workloads): a cold pass over 3,000 files takes s3fs over a minute each time.
ON_REQUEST = {"flat", "classes", "bigfile"}


def _verify(key: str, offset: int, data: bytes) -> bool:
    return data == expected_bytes(key, offset, offset + len(data))


def read_stream(system, key: str, size: int, bs: int = MiB, verify_every: int = 16) -> tuple[int, int]:
    """Read a whole object sequentially in `bs` pieces; returns (bytes, wrong pieces)."""
    wrong = 0
    pos = 0
    if system.is_mount:
        f = open(os.path.join(system.mountpoint, key), "rb", buffering=0)
        read = f.read
    else:
        f = system.open_read(key)
        read = f.read
    try:
        while True:
            piece = read(bs)
            if not piece:
                break
            if (pos // bs) % verify_every == 0 or pos + len(piece) >= size:
                wrong += not _verify(key, pos, piece)
            pos += len(piece)
    finally:
        f.close()
    if pos != size:
        wrong += 1
    return pos, wrong


def read_part(system, key: str, offset: int, size: int, bs: int = MiB) -> tuple[int, int]:
    """Read `size` bytes from `offset` in `bs` pieces, then close; returns (bytes, wrong pieces), all verified."""
    if system.is_mount:
        f = open(os.path.join(system.mountpoint, key), "rb", buffering=0)
        f.seek(offset)
        read = f.read
    else:
        f = system.open_read(key, offset, size)
        read = f.read
    done = wrong = 0
    try:
        while done < size:
            piece = read(min(bs, size - done))
            if not piece:
                break
            wrong += not _verify(key, offset + done, piece)
            done += len(piece)
    finally:
        f.close()
    return done, wrong + (done != size)


def read_range(system, key: str, offset: int, size: int) -> bytes:
    if system.is_mount:
        with open(os.path.join(system.mountpoint, key), "rb", buffering=0) as f:
            return os.pread(f.fileno(), size, offset)
    body = system.open_read(key, offset, size)
    try:
        return body.read()
    finally:
        body.close()


def _parallel(readers: int, items, fn) -> list:
    with ThreadPoolExecutor(readers) as pool:
        return list(pool.map(fn, items))


def run_streams(system, keys: list[tuple[str, int]], readers: int) -> Outcome:
    started = time.monotonic()
    results = _parallel(readers, keys, lambda kv: read_stream(system, kv[0], kv[1]))
    return Outcome(bytes=sum(b for b, _ in results), files=len(keys), seconds=time.monotonic() - started,
                   wrong=sum(w for _, w in results))


def seq1(system, d: Dataset, run: int) -> Outcome:
    return run_streams(system, d.seq[:1], 1)


def seq4(system, d: Dataset, run: int) -> Outcome:
    return run_streams(system, d.seq, 4)


def shards(system, d: Dataset, run: int) -> Outcome:
    order = d.shards[:]
    random.Random(run).shuffle(order)
    return run_streams(system, order, 4)


def small_files(system, d: Dataset, run: int) -> Outcome:
    return one_pass(system, d.small, run)


def flat_epoch(system, d: Dataset, run: int) -> Outcome:
    """Every file of one flat folder once, shuffled, 8 readers: a cold epoch no cache holds yet."""
    return one_pass(system, d.flat, run)


def class_epoch(system, d: Dataset, run: int) -> Outcome:
    """The flat cell's files in 100 class folders of 30: the same epoch, in the shape the walk ahead was built on."""
    return one_pass(system, d.classes, run)


def one_pass(system, items: list[tuple[str, int]], run: int) -> Outcome:
    order = items[:]
    random.Random(run).shuffle(order)  # like a DataLoader with shuffle=True and 8 workers
    started = time.monotonic()
    results = _parallel(8, order, lambda kv: read_stream(system, kv[0], kv[1], bs=256 * KiB, verify_every=1))
    return Outcome(bytes=sum(b for b, _ in results), files=len(order), seconds=time.monotonic() - started,
                   wrong=sum(w for _, w in results))


def partial(system, d: Dataset, run: int) -> Outcome:
    """4 readers, each reading a 4 MiB range (a quarter past the first) of a 16 MiB object in 1 MiB reads and
    closing it: a reader of a split of a file, which should cost the store little more than the split (the
    figure to watch is the read amplification). A reader from offset 0 is a sequential reader to Stoker (its
    initial read-ahead is accepted waste for one that stops), so the ranges here begin past it."""
    plan = [(key, ((i + run) % 3 + 1) * (size // 4), size // 4) for i, (key, size) in enumerate(d.parts)]
    started = time.monotonic()
    results = _parallel(4, plan, lambda p: read_part(system, *p))
    return Outcome(bytes=sum(b for b, _ in results), files=len(plan), seconds=time.monotonic() - started,
                   wrong=sum(w for _, w in results))


def random_reads(system, d: Dataset, run: int) -> Outcome:
    rng = random.Random(100 + run)
    plan = []
    for _ in range(max(32, int(200 * d.scale))):
        key, size = rng.choice(d.seq)
        plan.append((key, rng.randrange(0, size - 256 * KiB)))
    started = time.monotonic()
    results = _parallel(8, plan, lambda p: (p, read_range(system, p[0], p[1], 256 * KiB)))
    wrong = sum(1 for (key, off), data in results if not _verify(key, off, data) or len(data) != 256 * KiB)
    return Outcome(bytes=sum(len(r) for _, r in results), ops=len(plan), seconds=time.monotonic() - started,
                   wrong=wrong)


def aligned_random(size: int, count: int):
    """Reads of `size` bytes at random 4 KiB-aligned offsets of the large object by 4 threads, each with the file
    kept open (HDF5, LMDB, zarr, a shard's members read out of order): the figure to watch beside MB/s is the
    read amplification (store bytes per byte read)."""

    def workload(system, d: Dataset, run: int) -> Outcome:
        key, total = d.seq[0]
        rng = random.Random(400 + run + size)
        reads = max(16, int(count * min(1.0, d.scale * 4)))
        plan = [[rng.randrange(0, (total - size) // (4 * KiB)) * 4 * KiB for _ in range(reads // 4)] for _ in range(4)]

        def reader(offsets: list[int]) -> tuple[int, int]:
            done = wrong = 0
            if system.is_mount:
                fd = os.open(os.path.join(system.mountpoint, key), os.O_RDONLY)
                try:
                    for off in offsets:
                        data = os.pread(fd, size, off)
                        wrong += len(data) != size or not _verify(key, off, data)
                        done += len(data)
                finally:
                    os.close(fd)
                return done, wrong
            for off in offsets:
                data = read_range(system, key, off, size)
                wrong += len(data) != size or not _verify(key, off, data)
                done += len(data)
            return done, wrong

        started = time.monotonic()
        results = _parallel(4, plan, reader)
        return Outcome(bytes=sum(b for b, _ in results), ops=reads, seconds=time.monotonic() - started,
                       wrong=sum(w for _, w in results))

    return workload


def ceiling(system, d: Dataset, run: int) -> Outcome:
    """Small files as `small`, through a store with no latency and no bandwidth cap and without the kernel's page
    cache (the runner sets both up): what limits is the mount's own CPU per file (files/s; CPU ms per file and
    cores busy are reported beside)."""
    return one_pass(system, d.small, run)


def bigfile(system, d: Dataset, run: int) -> Outcome:
    """One large object (4 GiB at --scale 1) read by 4 readers at once, a quarter each in 1 MiB reads, every piece
    checked, through a store with no latency and no cap and without the page cache (the runner sets both up): how
    many cores a mount's reading of one file can use (issue 45: 8 workers against 1, on 16 cores)."""
    key, size = d.bigfile[0]
    quarter = size // 4
    plan = [(key, i * quarter, quarter if i < 3 else size - 3 * quarter) for i in range(4)]
    started = time.monotonic()
    results = _parallel(4, plan, lambda p: read_part(system, *p))
    return Outcome(bytes=sum(b for b, _ in results), files=1, seconds=time.monotonic() - started,
                   wrong=sum(w for _, w in results))


def metadata(system, d: Dataset, run: int) -> Outcome:
    started = time.monotonic()
    if system.is_mount:
        total = 0
        wrong = 0
        sizes = dict(d.meta)
        for entry in os.scandir(os.path.join(system.mountpoint, "meta/files")):
            st = entry.stat()
            wrong += st.st_size != sizes.get("meta/files/" + entry.name)
            total += 1
    else:
        total = system.list_stat("meta/files/")
        wrong = 0
    wrong += total != len(d.meta)
    return Outcome(files=total, ops=total, seconds=time.monotonic() - started, wrong=wrong)


def multi_epoch(system, d: Dataset, run: int) -> Outcome:
    """Three epochs, same order, over a dataset 1.5x the cache; hit ratio per epoch from the store."""
    outcome = Outcome()
    ratios = []
    for epoch in range(3):
        before = system.store_stats()
        o = run_streams(system, d.epoch, 2)
        sent = system.store_stats()["bytes_sent"] - before["bytes_sent"]
        ratios.append(max(0.0, 1 - sent / max(o.bytes, 1)))
        outcome.bytes += o.bytes
        outcome.files += o.files
        outcome.seconds += o.seconds
        outcome.wrong += o.wrong
    outcome.extra["hit_ratio_per_epoch"] = [round(r, 3) for r in ratios]
    return outcome


def ttfb(system, d: Dataset, run: int) -> Outcome:
    """Open a large object nobody read yet and time its first 4 KiB."""
    times = []
    wrong = 0
    for key, _ in d.shards[-3:] if run == 0 else d.shards[-3:]:
        started = time.monotonic()
        data = read_range(system, key, 0, 4096)
        times.append(time.monotonic() - started)
        wrong += not _verify(key, 0, data)
    times.sort()
    return Outcome(bytes=4096 * len(times), ops=len(times), seconds=sum(times), wrong=wrong,
                   extra={"ttfb_median_ms": round(times[len(times) // 2] * 1000, 1)})


def huge_directory(system, d: Dataset, run: int) -> Outcome:
    """List a huge flat directory, then read random files of it with 8 threads: a loader's first batches
    over a 100,000-file folder (at scale >= 1). Seconds for both, lower is better."""
    picks = random.Random(200 + run).sample(d.bigdir, max(100, int(1000 * min(1, d.scale))))
    started = time.monotonic()
    if system.is_mount:
        listed = len(os.listdir(os.path.join(system.mountpoint, "bigdir/files")))
    else:
        listed = system.list_stat("bigdir/files/")
    list_seconds = time.monotonic() - started
    results = _parallel(8, picks, lambda kv: read_stream(system, kv[0], kv[1], bs=256 * KiB, verify_every=1))
    seconds = time.monotonic() - started
    return Outcome(bytes=sum(b for b, _ in results), files=len(picks), ops=listed, seconds=seconds,
                   wrong=sum(w for _, w in results) + (listed != len(d.bigdir)),
                   extra={"list_s": round(list_seconds, 2), "read_s": round(seconds - list_seconds, 2)})


def mixed(system, d: Dataset, run: int) -> Outcome:
    """Two large sequential readers and eight small-file readers at once, then (Stoker) `stoker warm` of the
    small files: the mixed load under which a mount's peak memory is judged (MB/s)."""
    order = d.small[:]
    random.Random(300 + run).shuffle(order)
    started = time.monotonic()
    with ThreadPoolExecutor(2) as large_pool:
        large = [large_pool.submit(read_stream, system, key, size) for key, size in d.seq[:2]]
        small = _parallel(8, order, lambda kv: read_stream(system, kv[0], kv[1], bs=256 * KiB, verify_every=1))
        results = small + [f.result() for f in large]
    if system.name == "stoker":
        from fusecore.process import control

        for _ in control.warm(control.default_control_socket(system.mountpoint), ["small"]):
            pass
    return Outcome(bytes=sum(b for b, _ in results), files=len(results), seconds=time.monotonic() - started,
                   wrong=sum(w for _, w in results))


def disk_epochs(system, d: Dataset, run: int) -> Outcome:
    """Every small file once (8 shuffled readers) while one reader streams the shards, over a dataset ~4x the memory
    cache (3.8x: issue 35's mix and memory at the default scale; no page cache): epoch 1 cold, epoch 2 warm. Run by each system with and without its
    disk cache (the runner's DISK_VARIANTS); files/s, and store bytes per epoch beside."""
    order = d.disk_small[:]
    random.Random(500 + run).shuffle(order)
    started = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(lambda: [read_stream(system, key, size) for key, size in d.disk_stream])
        small = _parallel(8, order, lambda kv: read_stream(system, kv[0], kv[1], bs=256 * KiB, verify_every=1))
        results = small + stream.result()
    return Outcome(bytes=sum(b for b, _ in results), files=len(order), seconds=time.monotonic() - started,
                   wrong=sum(w for _, w in results))


def _dataloader(system, d: Dataset, run: int, *, gpu_rate: float | None = None, gpu_batch: int = 32) -> Outcome:
    from .dataloader import dataloader_epoch  # (PyTorch is imported only where this cell runs)

    return dataloader_epoch(system, d, run, gpu_rate=gpu_rate, gpu_batch=gpu_batch)


# ---- writes (issue 46): objects written through each system, timed to the end of the close, bytes checked by the store
WRITE_PART = 8 * MiB  # the part size every system is given (Stoker's default)
WRITE_CONCURRENCY = 32  # parts of one file at once (Stoker's default; boto3's upload_fileobj is given the same)


def _pattern_chunks(key: str, size: int, chunk: int = MiB):
    """The generated content of `key` in `chunk` pieces (views of the pattern: nothing is built)."""
    from .objectstore import _DOUBLE, PATTERN_SIZE, shift_of

    shift = shift_of(key)
    view = memoryview(_DOUBLE)
    for pos in range(0, size, chunk):
        n = min(chunk, size - pos)
        p = (pos + shift) % PATTERN_SIZE
        yield view[p:p + n]


class _PatternReader:
    """A file-like object of a key's generated content (for boto3's upload_fileobj)."""

    def __init__(self, key: str, size: int):
        self._chunks = _pattern_chunks(key, size, 256 * KiB)
        self._left = b""

    def read(self, n: int = -1) -> bytes:
        out = bytearray(self._left)
        while n < 0 or len(out) < n:
            piece = next(self._chunks, None)
            if piece is None:
                break
            out += piece
        if n >= 0:
            self._left = bytes(out[n:])
            del out[n:]
        else:
            self._left = b""
        return bytes(out)


def write_object(system, key: str, size: int) -> None:
    if system.is_mount:
        path = os.path.join(system.mountpoint, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb", buffering=0) as f:
            for piece in _pattern_chunks(key, size):
                f.write(piece)
        return
    system.write_object(key, _PatternReader(key, size), part=WRITE_PART, concurrency=WRITE_CONCURRENCY)


def _writes(system, plan: list[tuple[str, int]], writers: int) -> Outcome:
    started = time.monotonic()
    _parallel(writers, plan, lambda item: write_object(system, *item))
    seconds = time.monotonic() - started
    written = system.store_written()
    wrong = sum(1 for key, size in plan if written.get(f"bench/{key}") != {"size": size, "right": True})
    return Outcome(bytes=sum(size for _, size in plan), files=len(plan), seconds=seconds, wrong=wrong)


def _checkpoint(system, d: Dataset, run: int) -> Outcome:
    from .checkpoint import checkpoint  # (PyTorch is imported only where this cell runs)

    return checkpoint(system, d, run)


def write_one(system, d: Dataset, run: int) -> Outcome:
    """One writer, one large file in 1 MiB writes (a checkpoint), timed to the end of its close."""
    return _writes(system, [(f"out/{system.name}/run{run}/model.pt", d.write_size)], 1)


def write_eight(system, d: Dataset, run: int) -> Outcome:
    """Eight writers at once, one file each (the shards of a distributed checkpoint)."""
    return _writes(system, [(f"out/{system.name}/run{run}/rank{i}.pt", d.write_size // 4) for i in range(8)], 8)


WORKLOADS = {
    "seq1": ("large sequential, 1 reader (MB/s)", seq1),
    "seq4": ("large sequential, 4 readers (MB/s)", seq4),
    "shards": ("64 MiB shards, shuffled, 4 readers (MB/s)", shards),
    "small": ("small files, 8 readers (files/s)", small_files),
    "flat": ("one flat folder of ~110 KB files, once, shuffled, 8 readers (files/s)", flat_epoch),
    "classes": ("the flat cell's files in class folders of 30, once, shuffled, 8 readers (files/s)", class_epoch),
    "partial": ("a quarter of each 16 MiB object, 4 readers (MB/s)", partial),
    "random": ("random 256 KiB reads, 8 threads (MB/s)", random_reads),
    "rand4k": ("random 4 KiB preads, 4 KiB-aligned, 4 threads (MB/s)", aligned_random(4 * KiB, 512)),
    "rand256k": ("random 256 KiB preads, 4 KiB-aligned, 4 threads (MB/s)", aligned_random(256 * KiB, 256)),
    "rand1m": ("random 1 MiB preads, 4 KiB-aligned, 4 threads (MB/s)", aligned_random(MiB, 96)),
    "ceiling": ("small files, no store latency, no page cache: the mount's own ceiling (files/s)", ceiling),
    "bigfile": ("one large object, 4 readers a quarter each, no store latency, no page cache (MB/s)", bigfile),
    "metadata": ("scandir + stat, big directory (entries/s)", metadata),
    "epochs": ("3 epochs, dataset 1.5x cache (MB/s)", multi_epoch),
    "ttfb": ("time to first byte (ms, lower is better)", ttfb),
    "bigdir": ("huge directory: list, then random files, 8 threads (s, lower is better)", huge_directory),
    "mixed": ("2 large + 8 small-file readers, then warm (MB/s)", mixed),
    "disk": ("small files beside a stream, dataset ~4x memory, with and without disk caches (files/s)", disk_epochs),
    "dataloader": ("PyTorch DataLoader, 8 workers, ~110 KB samples (samples/s)", _dataloader),
    "write1": ("one writer, one large file in 1 MiB writes, to the end of its close (MB/s)", write_one),
    "write8": ("eight writers at once, a file each, to the end of their closes (MB/s)", write_eight),
    "ckpt": ("torch.save of a state dict (write1's size), to the end of its close (MB/s)", _checkpoint),
}
WRITE_WORKLOADS = frozenset({"write1", "write8", "ckpt"})
