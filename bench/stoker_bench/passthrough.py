"""Prototype, not the product: FUSE passthrough (Linux 6.9+) of files held whole on a local disk, to measure what it
would give a disk tier (issue 35, "worth a look"; docs/operations.md "FUSE passthrough").

With passthrough, the server answers an OPEN with the id of a backing file it registered on the connection
(FUSE_DEV_IOC_BACKING_OPEN, which needs CAP_SYS_ADMIN) and FOPEN_PASSTHROUGH: the kernel then reads (and maps) that
file itself, and no READ of it ever reaches the server. The backing file must hold the object's bytes at the same
offsets, from offset 0, and the kernel reads it as it is: nothing the server does runs per read.

What this measures, over N small files in a local folder (the bench's deterministic content, every byte checked by
the readers): reading the folder directly; a mount of it whose server answers each READ with a pread of the file
(what any FUSE server costs, here in a few lines of standard-library Python); and the same mount with passthrough.
The mount is the fuseloop prototype's wire format and loop (stoker_bench.fuseloop), one process of T threads.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import os
import random
import struct
import subprocess
import sys
import threading
import time

from .fuseloop import (INIT, INIT_OUT, IN_HEADER, MAX_READ, OPEN, OPEN_OUT, OUT_HEADER, READ, READ_IN, Node,
                       Server, _cpu, mount)

INIT_IN_EXT = struct.Struct("<IIIII")  # major minor max_readahead flags flags2
FUSE_ASYNC_READ, FUSE_MAX_PAGES, FUSE_INIT_EXT = 1 << 0, 1 << 22, 1 << 30
FUSE_PASSTHROUGH_FLAGS2 = 1 << (37 - 32)  # FUSE_PASSTHROUGH is bit 37: bit 5 of flags2
FOPEN_PASSTHROUGH = 1 << 7
BACKING_MAP = struct.Struct("<iIQ")  # fd flags padding (struct fuse_backing_map)
FUSE_DEV_IOC_BACKING_OPEN = 0x4010E501  # _IOW(229, 1, struct fuse_backing_map)
OPEN_OUT_BACKING = struct.Struct("<QIi")  # fh open_flags backing_id
_libc = ctypes.CDLL(None, use_errno=True)


def tree_of(folder: str) -> tuple[dict[int, Node], dict[int, str]]:
    """The files under `folder` as fuseloop's inode table, and each file inode's path on the local disk."""
    nodes = {1: Node(1)}
    paths: dict[int, str] = {}
    for top, dirs, files in os.walk(folder):
        dirs.sort()
        rel = os.path.relpath(top, folder)
        parent = nodes[1]
        if rel != ".":
            for name in rel.split(os.sep):
                parent = nodes[parent.children[name]]
        for name in sorted(dirs):
            inode = parent.children[name] = len(nodes) + 1
            nodes[inode] = Node(inode)
        for name in sorted(files):
            path = os.path.join(top, name)
            inode = parent.children[name] = len(nodes) + 1
            nodes[inode] = Node(inode, os.path.relpath(path, folder), os.path.getsize(path))
            paths[inode] = path
    return nodes, paths


class LocalServer(Server):
    """Answers from local files: READ with a pread, or (passthrough) OPEN with the file's backing id."""

    def __init__(self, fd: int, nodes: dict[int, Node], paths: dict[int, str], passthrough: bool):
        super().__init__(fd, nodes, ["http://127.0.0.1:1"], "")
        self.paths, self.passthrough = paths, passthrough
        self.reads = 0  # READ requests answered: none for a passthrough file
        self._backing: dict[int, int] = {}  # inode -> backing id, registered at its first open
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()

    def answer(self, opcode: int, nodeid: int, arg: memoryview) -> bytes:
        if opcode == OPEN and nodeid in self.paths:
            if not self.passthrough:
                return OPEN_OUT.pack(nodeid, 0, 0)
            return OPEN_OUT_BACKING.pack(nodeid, FOPEN_PASSTHROUGH, self.backing(nodeid))
        if opcode == READ:
            fh, offset, size = READ_IN.unpack_from(arg)[:3]
            self.reads += 1
            return os.pread(self.fd_of(fh), size, offset)
        return super().answer(opcode, nodeid, arg)

    def fd_of(self, inode: int) -> int:
        with self._lock:
            fd = self._fds.get(inode)
            if fd is None:
                fd = self._fds[inode] = os.open(self.paths[inode], os.O_RDONLY | os.O_CLOEXEC)
            return fd

    def backing(self, inode: int) -> int:
        """The file's backing id on this connection (the kernel holds the file from then on)."""
        with self._lock:
            backing = self._backing.get(inode)
        if backing is None:
            arg = ctypes.create_string_buffer(BACKING_MAP.pack(self.fd_of(inode), 0, 0), BACKING_MAP.size)
            backing = _libc.ioctl(self.fd, ctypes.c_ulong(FUSE_DEV_IOC_BACKING_OPEN), arg)  # its result is the id
            if backing <= 0:
                raise OSError(ctypes.get_errno() or errno.EIO, "FUSE_DEV_IOC_BACKING_OPEN")
            with self._lock:
                self._backing[inode] = backing
        return backing


def answer_init(fd: int, passthrough: bool) -> None:
    """INIT, asking for passthrough (protocol 7.40, one level of stacking) where wanted and offered."""
    request = os.read(fd, MAX_READ + 4096)
    _, opcode, unique = IN_HEADER.unpack_from(request)[:3]
    if opcode != INIT:
        raise RuntimeError(f"expected INIT, got opcode {opcode}")
    major, minor, max_readahead, flags, flags2 = INIT_IN_EXT.unpack_from(request, IN_HEADER.size)
    if passthrough and not (flags & FUSE_INIT_EXT and flags2 & FUSE_PASSTHROUGH_FLAGS2):
        raise RuntimeError(f"kernel FUSE {major}.{minor} does not offer passthrough (Linux 6.9+)")
    want = flags & (FUSE_ASYNC_READ | FUSE_MAX_PAGES)
    want2 = 0
    if passthrough:
        want |= FUSE_INIT_EXT
        want2 = FUSE_PASSTHROUGH_FLAGS2
    body = INIT_OUT.pack(7, min(minor, 40), max_readahead, want, 64, 48, MAX_READ, 1, MAX_READ // 4096, 0, want2,
                         1 if passthrough else 0)
    os.writev(fd, [OUT_HEADER.pack(OUT_HEADER.size + len(body), 0, unique), body])


def serve(folder: str, mountpoint: str, passthrough: bool, threads: int, ready_file: str) -> None:
    nodes, paths = tree_of(folder)
    fd = mount(mountpoint)
    answer_init(fd, passthrough)
    server = LocalServer(fd, nodes, paths, passthrough)

    def report(*_):
        with open(ready_file + ".reads", "w") as f:
            f.write(str(server.reads))

    import signal
    signal.signal(signal.SIGUSR1, report)
    with open(ready_file, "w") as f:
        f.write(str(os.getpid()))
    server.serve(threads)


def make_files(folder: str, files: int) -> list[tuple[str, int]]:
    """`files` files of 90-130 KB under 100 directories, holding the bench store's deterministic bytes."""
    from .objectstore import expected_bytes

    rng = random.Random(42)
    made = []
    for i in range(files):
        key, size = f"train/{i % 100:03d}/img-{i:06d}.jpg", rng.randint(90_000, 130_000)
        path = os.path.join(folder, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(expected_bytes(key, 0, size))
        made.append((key, size))
    return made


def _read_all(root: str, files: list[tuple[str, int]], readers: int) -> tuple[float, int]:
    """Every file read once by `readers` processes of 4 threads each (bytes checked); seconds and wrong files."""
    from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

    from .fuseloop import _read_files

    order = files[:]
    random.Random(7).shuffle(order)
    chunks = [(root, order[i::readers * 4]) for i in range(readers * 4)]
    started = time.monotonic()
    with ProcessPoolExecutor(readers) as pool:
        with ThreadPoolExecutor(readers * 4) as submit:
            results = list(submit.map(lambda chunk: pool.submit(_read_files, chunk).result(), chunks))
    return time.monotonic() - started, sum(r[1] for r in results)


def measure(files: int, threads: int, readers: int, workdir: str) -> list[str]:
    """files/s of the three ways (see the module docstring), a first pass and a second one (the kernel knows the
    names then); mount CPU per file and the READs the server answered."""
    folder = os.path.join(workdir, "disk")
    made = make_files(folder, files)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    lines = []
    seconds, wrong = _read_all(folder, made, readers)
    lines.append(f"local folder:       {files / seconds:7.0f} files/s, wrong {wrong}")
    print(lines[-1], flush=True)
    for passthrough in (False, True):
        mountpoint = os.path.join(workdir, f"mnt-{int(passthrough)}")
        os.makedirs(mountpoint, exist_ok=True)
        ready = os.path.join(workdir, f"ready-{int(passthrough)}")
        proc = subprocess.Popen([sys.executable, "-m", "stoker_bench.passthrough", "serve", "--folder", folder,
                                 "--mountpoint", mountpoint, "--threads", str(threads), "--ready-file", ready,
                                 *(["--passthrough"] if passthrough else [])], env=env)
        try:
            while not os.path.exists(ready):
                if proc.poll() is not None:
                    raise RuntimeError("the prototype mount failed to start")
                time.sleep(0.05)
            pid = int(open(ready).read())
            before = _cpu(pid)
            seconds, wrong = _read_all(mountpoint, made, readers)
            cpu = _cpu(pid) - before
            again, wrong_again = _read_all(mountpoint, made, readers)  # names known: OPEN, READs, FLUSH, RELEASE
            cpu_again = _cpu(pid) - before - cpu
            wrong += wrong_again
            os.kill(pid, 10)  # SIGUSR1: write how many READs it answered
            while not os.path.exists(ready + ".reads"):
                time.sleep(0.02)
            time.sleep(0.05)
            reads = int(open(ready + ".reads").read() or 0)
            name = "mount, passthrough" if passthrough else "mount, pread/READ"
            lines.append(f"{name + ':':<19} {files / seconds:7.0f} files/s ({files / again:.0f} again), "
                         f"{cpu / files * 1000:.3f} ms mount CPU per file ({cpu_again / files * 1000:.3f} again), "
                         f"{reads} READ requests, wrong {wrong}")
            print(lines[-1], flush=True)
        finally:
            subprocess.run(["umount", mountpoint], check=False)
            proc.wait(timeout=30)
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="mount a local folder and serve it until unmounted")
    s.add_argument("--folder", required=True)
    s.add_argument("--mountpoint", required=True)
    s.add_argument("--passthrough", action="store_true")
    s.add_argument("--threads", type=int, default=8)
    s.add_argument("--ready-file", required=True)
    m = sub.add_parser("measure", help="files/s: the folder, a mount of it, the mount with passthrough (root)")
    m.add_argument("--files", type=int, default=3000)
    m.add_argument("--threads", type=int, default=8)
    m.add_argument("--readers", type=int, default=2, help="reader processes (4 threads each)")
    m.add_argument("--workdir", default=None)
    a = p.parse_args(argv)
    if a.command == "serve":
        serve(a.folder, a.mountpoint, a.passthrough, a.threads, a.ready_file)
        return 0
    import tempfile

    measure(a.files, a.threads, a.readers, a.workdir or tempfile.mkdtemp(prefix="passthrough-"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
