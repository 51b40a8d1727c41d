"""Prototype, not the product: one FUSE connection served by several processes through cloned `/dev/fuse`
descriptors, to measure how a mount's small-file ceiling scales with processes (the plan of the issue "a mount
past one core", docs/operations.md "One core").

What it is: a read-only mount of one bucket prefix on an S3 endpoint that needs no signature (the bench's emulated
store), written with the standard library only (so it also runs on a machine with nothing installed). The main
process lists the prefix, mounts with mount(2) on a `/dev/fuse` descriptor, answers INIT, then forks N-1 workers;
each worker opens `/dev/fuse` and clones the connection onto it (FUSE_DEV_IOC_CLONE), so the kernel hands each
request to whichever process reads next, and the reply goes back on the descriptor it came from. Every process
runs T threads of `read request -> answer -> write reply`. The namespace is listed once before the fork, so inode
numbers mean the same in every process; a file handle carries everything a READ needs (the inode), so no open-file
state is shared. There is no cache: it measures epoch 1, the mount's CPU per file and how that spreads over cores.

What the product would still need (and this leaves out): a shared block cache, read-ahead state for large files,
re-listing, FORGET bookkeeping, INTERRUPT, credentials and signing, and every error path.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import fcntl
import http.client
import os
import signal
import stat
import struct
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from xml.etree import ElementTree

# ---- the FUSE wire format (include/uapi/linux/fuse.h) -----------------------------------------------------------
IN_HEADER = struct.Struct("<IIQQIIII")  # len, opcode, unique, nodeid, uid, gid, pid, padding
OUT_HEADER = struct.Struct("<IiQ")  # len, error, unique
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # ino size blocks atime mtime ctime *nsec(3) mode nlink uid gid rdev blksize flags
ENTRY_OUT = struct.Struct("<QQQQII")  # nodeid generation entry_valid attr_valid entry_valid_nsec attr_valid_nsec
ATTR_OUT = struct.Struct("<QII")  # attr_valid attr_valid_nsec dummy
OPEN_OUT = struct.Struct("<QII")  # fh open_flags padding
READ_IN = struct.Struct("<QQIIQII")  # fh offset size read_flags lock_owner flags padding
INIT_IN = struct.Struct("<IIII")  # major minor max_readahead flags (flags2 and more follow)
INIT_OUT = struct.Struct("<IIIIHHIIHHII24x")  # 64 bytes
STATFS_OUT = struct.Struct("<QQQQQIIII24x")

LOOKUP, FORGET, GETATTR, OPEN, READ, STATFS, RELEASE, FLUSH, INIT = 1, 2, 3, 14, 15, 17, 18, 25, 26
OPENDIR, RELEASEDIR, ACCESS, INTERRUPT, DESTROY, BATCH_FORGET = 27, 29, 34, 36, 38, 42
NO_REPLY = {FORGET, BATCH_FORGET, INTERRUPT}
FUSE_ASYNC_READ, FUSE_MAX_PAGES = 1 << 0, 1 << 22
FUSE_DEV_IOC_CLONE = 0x8004E500  # _IOR(229, 0, uint32_t)
MAX_READ = 1 << 20
TIMEOUT = 3600


@dataclass
class Node:
    inode: int
    key: str = ""  # objects only
    size: int = 0
    children: dict[str, int] = field(default_factory=dict)  # directories only

    @property
    def is_dir(self) -> bool:
        return not self.key


def list_tree(endpoint: str, bucket: str, prefix: str) -> dict[int, Node]:
    """Every object under `prefix` (ListObjectsV2 pages), as a tree with inode numbers in listing order."""
    parts = urllib.parse.urlsplit(endpoint)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port)
    nodes = {1: Node(1)}
    token = ""
    while True:
        query = {"list-type": "2", "prefix": prefix, **({"continuation-token": token} if token else {})}
        conn.request("GET", f"/{bucket}?{urllib.parse.urlencode(query)}")
        root = ElementTree.fromstring(conn.getresponse().read())
        ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
        for item in root.iterfind(f"{ns}Contents"):
            key = item.findtext(f"{ns}Key") or ""
            parent = nodes[1]
            names = key[len(prefix):].split("/")
            for name in names[:-1]:
                child = parent.children.get(name)
                if child is None:
                    child = parent.children[name] = len(nodes) + 1
                    nodes[child] = Node(child)
                parent = nodes[child]
            inode = parent.children[names[-1]] = len(nodes) + 1
            nodes[inode] = Node(inode, key, int(item.findtext(f"{ns}Size") or 0))
        token = root.findtext(f"{ns}NextContinuationToken") or ""
        if (root.findtext(f"{ns}IsTruncated") or "").strip() != "true":
            return nodes


class Server:
    """One process's share of the connection: T threads reading requests from `fd`."""

    def __init__(self, fd: int, nodes: dict[int, Node], endpoints: list[str], bucket: str):
        self.fd, self.nodes, self.bucket = fd, nodes, bucket
        self.stores = [urllib.parse.urlsplit(e) for e in endpoints]  # each thread GETs from one of them
        self.local = threading.local()
        self.threads = 0
        self.uid, self.gid, self.now = os.getuid(), os.getgid(), int(time.time())

    def serve(self, threads: int) -> None:
        workers = [threading.Thread(target=self.loop, daemon=True) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    def loop(self) -> None:
        while True:
            try:
                request = os.read(self.fd, MAX_READ + 4096)
            except OSError as exc:
                if exc.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):  # ENOENT: an interrupted request
                    continue
                return  # ENODEV: unmounted
            length, opcode, unique, nodeid = IN_HEADER.unpack_from(request)[:4]
            if opcode in NO_REPLY:
                continue
            try:
                body = self.answer(opcode, nodeid, memoryview(request)[IN_HEADER.size:length])
                error = 0
            except OSError as exc:
                body, error = b"", -(exc.errno or errno.EIO)
            try:
                os.writev(self.fd, [OUT_HEADER.pack(OUT_HEADER.size + len(body), error, unique), body])
            except OSError:
                pass  # the request was interrupted meanwhile: the kernel no longer waits for it

    def answer(self, opcode: int, nodeid: int, arg: memoryview) -> bytes:
        if opcode == LOOKUP:
            name = bytes(arg).split(b"\0", 1)[0].decode()
            child = self.nodes[nodeid].children.get(name)
            if child is None:
                raise OSError(errno.ENOENT, name)
            return ENTRY_OUT.pack(child, 0, TIMEOUT, TIMEOUT, 0, 0) + self.attr(self.nodes[child])
        if opcode == GETATTR:
            return ATTR_OUT.pack(TIMEOUT, 0, 0) + self.attr(self.nodes[nodeid])
        if opcode in (OPEN, OPENDIR):
            return OPEN_OUT.pack(nodeid, 0, 0)  # the handle is the inode: no open-file state to share
        if opcode == READ:
            fh, offset, size = READ_IN.unpack_from(arg)[:3]
            node = self.nodes[fh]
            end = min(offset + size, node.size)
            return self.get(node.key, offset, end) if end > offset else b""
        if opcode in (RELEASE, RELEASEDIR):
            return b""
        if opcode == STATFS:
            return STATFS_OUT.pack(0, 0, 0, 0, 0, 4096, 255, 4096, 0)
        if opcode == ACCESS:
            return b""
        raise OSError(errno.ENOSYS, "not implemented")

    def attr(self, node: Node) -> bytes:
        mode = (stat.S_IFDIR | 0o555) if node.is_dir else (stat.S_IFREG | 0o444)
        return ATTR.pack(node.inode, node.size, (node.size + 511) // 512, self.now, self.now, self.now, 0, 0, 0,
                         mode, 2 if node.is_dir else 1, self.uid, self.gid, 0, 4096, 0)

    def get(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of `key` in one range GET on this thread's kept-alive connection."""
        for attempt in range(2):
            conn = getattr(self.local, "conn", None)
            if conn is None:
                self.threads += 1
                store = self.stores[(os.getpid() + self.threads) % len(self.stores)]
                conn = self.local.conn = http.client.HTTPConnection(store.hostname or "127.0.0.1", store.port, timeout=30)
            try:
                conn.request("GET", f"/{self.bucket}/{urllib.parse.quote(key)}",
                             headers={"Range": f"bytes={start}-{end - 1}"})
                response = conn.getresponse()
                body = response.read()
                if response.status in (200, 206) and len(body) == end - start:
                    return body
                raise OSError(errno.EIO, f"status {response.status}")
            except (OSError, http.client.HTTPException):
                conn.close()
                self.local.conn = None
                if attempt:
                    raise OSError(errno.EIO, "get failed") from None
        raise AssertionError("unreachable")


def mount(mountpoint: str) -> int:
    """mount(2) of a new FUSE connection at `mountpoint`; the connection's first descriptor."""
    fd = os.open("/dev/fuse", os.O_RDWR)
    libc = ctypes.CDLL(None, use_errno=True)
    options = f"fd={fd},rootmode=40000,user_id={os.getuid()},group_id={os.getgid()},allow_other".encode()
    if libc.mount(b"stoker-proto", mountpoint.encode(), b"fuse.stoker-proto", 1 | 2 | 4, options) != 0:  # RDONLY NOSUID NODEV
        raise OSError(ctypes.get_errno(), f"mount {mountpoint}")
    return fd


def answer_init(fd: int) -> None:
    """The kernel's first request on a new connection: agree on the protocol and the read size."""
    request = os.read(fd, MAX_READ + 4096)
    _, opcode, unique = IN_HEADER.unpack_from(request)[:3]
    if opcode != INIT:
        raise RuntimeError(f"expected INIT, got opcode {opcode}")
    major, minor, max_readahead, flags = INIT_IN.unpack_from(request, IN_HEADER.size)
    if major != 7 or minor < 31:
        raise RuntimeError(f"kernel FUSE protocol {major}.{minor}: 7.31 or later needed")
    want = flags & (FUSE_ASYNC_READ | FUSE_MAX_PAGES)
    body = INIT_OUT.pack(7, 31, max_readahead, want, 64, 48, MAX_READ, 1, MAX_READ // 4096, 0, 0, 0)
    os.writev(fd, [OUT_HEADER.pack(OUT_HEADER.size + len(body), 0, unique), body])


def clone(fd: int) -> int:
    """A new descriptor of the same connection: the kernel gives each request to whichever descriptor reads it."""
    mine = os.open("/dev/fuse", os.O_RDWR)
    fcntl.ioctl(mine, FUSE_DEV_IOC_CLONE, struct.pack("I", fd))
    return mine


def run(endpoints: list[str], bucket: str, prefix: str, mountpoint: str, processes: int, threads: int,
        ready_file: str | None) -> None:
    nodes = list_tree(endpoints[0], bucket, prefix)
    fd = mount(mountpoint)
    answer_init(fd)
    children = []
    for _ in range(processes - 1):
        pid = os.fork()
        if pid == 0:
            try:
                Server(clone(fd), nodes, endpoints, bucket).serve(threads)
            finally:
                os._exit(0)
        children.append(pid)
    if ready_file:
        with open(ready_file, "w") as f:
            f.write(" ".join(str(p) for p in [os.getpid(), *children]))
    signal.signal(signal.SIGTERM, lambda *_: os.system(f"umount -l {mountpoint}"))
    Server(fd, nodes, endpoints, bucket).serve(threads)
    for pid in children:
        os.waitpid(pid, 0)


def _read_files(args: tuple[str, list[tuple[str, int]]]) -> tuple[int, int]:
    """In a reader process: read files whole in 256 KiB reads, check every byte; (files, wrong)."""
    from .objectstore import expected_bytes

    mountpoint, files = args
    wrong = 0
    for key, size in files:
        with open(os.path.join(mountpoint, key), "rb", buffering=0) as f:
            data = b"".join(iter(lambda: f.read(256 * 1024), b""))
        wrong += data != expected_bytes(key, 0, size)
    return len(files), wrong


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(files: int, processes: list[int], threads: int, readers: int, stores: int, workdir: str) -> list[str]:
    """The small-file ceiling of this prototype at each process count: the emulated store (`stores` processes of it,
    one alone is a Python process that tops out near 6,000 files/s) with no latency and no cap, `files` files of
    90-130 KB under 100 directories, read once each, shuffled, by `readers` processes of 4 threads; files/s, mount
    CPU per file, cores busy (all mount processes together)."""
    import json
    import random
    import subprocess
    from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

    rng = random.Random(42)
    dataset = {f"train/{i % 100:03d}/img-{i:06d}.jpg": rng.randint(90_000, 130_000) for i in range(files)}
    with open(os.path.join(workdir, "dataset.json"), "w") as f:
        json.dump({"bench": dataset}, f)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    servers, endpoints = [], []
    lines = []
    try:
        for i in range(stores):
            port_file = os.path.join(workdir, f"store-{i}.port")
            servers.append(subprocess.Popen([sys.executable, "-m", "stoker_bench.objectstore", "--dataset",
                                             os.path.join(workdir, "dataset.json"), "--latency", "0", "--bandwidth",
                                             "0", "--port-file", port_file], env=env, stdout=subprocess.DEVNULL))
            while not os.path.exists(port_file):
                time.sleep(0.05)
            time.sleep(0.1)
            endpoints.append(f"http://127.0.0.1:{int(open(port_file).read())}")
        for count in processes:
            mountpoint = os.path.join(workdir, f"mnt-{count}")
            os.makedirs(mountpoint, exist_ok=True)
            ready = os.path.join(workdir, f"ready-{count}")
            mount_proc = subprocess.Popen([sys.executable, "-m", "stoker_bench.fuseloop", "serve",
                                           "--endpoint", ",".join(endpoints),
                                           "--bucket", "bench", "--mountpoint", mountpoint, "--processes", str(count),
                                           "--threads", str(threads), "--ready-file", ready], env=env)
            while not os.path.exists(ready):
                if mount_proc.poll() is not None:
                    raise RuntimeError("the prototype mount failed to start")
                time.sleep(0.05)
            pids = [int(x) for x in open(ready).read().split()]
            order = list(dataset.items())
            random.Random(count).shuffle(order)
            chunks = [(mountpoint, order[i::readers * 4]) for i in range(readers * 4)]
            before = sum(_cpu(p) for p in pids)
            started = time.monotonic()
            with ProcessPoolExecutor(readers) as pool:
                with ThreadPoolExecutor(readers * 4) as submit:
                    results = list(submit.map(lambda chunk: pool.submit(_read_files, chunk).result(), chunks))
            seconds = time.monotonic() - started
            cpu = sum(_cpu(p) for p in pids) - before
            done, wrong = sum(r[0] for r in results), sum(r[1] for r in results)
            lines.append(f"processes {count:>2} x {threads} threads: {done / seconds:7.0f} files/s, "
                         f"{cpu / done * 1000:.2f} ms CPU per file, {cpu / seconds:5.2f} cores busy, wrong {wrong}")
            print(lines[-1], flush=True)
            subprocess.run(["umount", mountpoint], check=False)
            mount_proc.wait(timeout=30)
    finally:
        for server in servers:
            server.terminate()
            server.wait(timeout=10)
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="mount and serve until unmounted")
    serve.add_argument("--endpoint", required=True, help="the store's URL (several, comma-separated: spread over threads)")
    serve.add_argument("--bucket", required=True)
    serve.add_argument("--prefix", default="")
    serve.add_argument("--mountpoint", required=True)
    serve.add_argument("--processes", type=int, default=1)
    serve.add_argument("--threads", type=int, default=8)
    serve.add_argument("--ready-file")
    bench = sub.add_parser("measure", help="the small-file ceiling at several process counts (root, /dev/fuse)")
    bench.add_argument("--files", type=int, default=3000)
    bench.add_argument("--processes", default="1,2,4")
    bench.add_argument("--threads", type=int, default=8)
    bench.add_argument("--readers", type=int, default=4, help="reader processes (4 threads each)")
    bench.add_argument("--stores", type=int, default=1, help="emulated store processes (one tops out near 6,000 files/s)")
    bench.add_argument("--workdir", default=None)
    a = p.parse_args(argv)
    if a.command == "serve":
        run(a.endpoint.split(","), a.bucket, a.prefix, a.mountpoint, a.processes, a.threads, a.ready_file)
        return 0
    import tempfile

    measure(a.files, [int(x) for x in a.processes.split(",")], a.threads, a.readers, a.stores,
            a.workdir or tempfile.mkdtemp(prefix="fuseloop-"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
