"""Files held on the disk tier, read with the page cache dropped (a dataset larger than the node's RAM), against the
same files in a local folder read the same way (issue 45's passthrough target: at least half the folder's speed).

    cd bench && python3 -m stoker_bench.dropped [--files 2000] [--passes 2] [--workers N]   (root: drops the page cache)

Small files (100-120 KB, in folders of 100) are warmed onto a Stoker mount's disk tier (`stoker warm`), its memory
cache is emptied (`stoker drop`), then each pass drops the page cache and reads every file whole once, shuffled, by
8 threads: first the local folder, then the mount, once with FUSE passthrough (the kernel reads held files itself)
and once with `--no-passthrough` (every READ answered by the mount from its disk tier). Every byte is checked.
Printed per pass: files/s of each, the mount's share of the folder's speed, and the mount's CPU per file; with
`--json`, also how many opens each mount answered with a backing file.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from fusecore.process import control

from .fixture import StoreProcess, scratch_dir
from .objectstore import expected_bytes
from .runner import _proc_cpu
from .systems import StokerDisk

READERS = 8
MEMORY = 64 * 1024 * 1024  # the mount's memory cache: far below what the disk tier holds


@dataclass
class Pass:
    files_s: float
    cpu_ms_per_file: float  # the mount's (0 for the folder)
    wrong: int


def drop_page_cache() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def dataset(files: int) -> list[tuple[str, int]]:
    sizes = random.Random(45)
    return [(f"held/{i // 100:03d}/img-{i:05d}.jpg", sizes.randint(100_000, 120_000)) for i in range(files)]


def cpu_seconds(pid: int | None) -> float:
    """The mount's CPU seconds: its process and its workers' (--workers)."""
    return _proc_cpu(pid) if pid is not None else 0.0


def read_pass(root: str, items: list[tuple[str, int]], seed: int, pid: int | None = None) -> Pass:
    """Every file whole once, shuffled, by READERS threads; its bytes checked."""
    order = items[:]
    random.Random(seed).shuffle(order)
    feed = iter(order)
    lock = threading.Lock()
    wrong = [0]

    def reader() -> None:
        while True:
            with lock:
                item = next(feed, None)
            if item is None:
                return
            key, size = item
            with open(os.path.join(root, key), "rb", buffering=0) as f:
                data = f.read()
            if data != expected_bytes(key, 0, size):
                with lock:
                    wrong[0] += 1

    began, cpu = time.monotonic(), cpu_seconds(pid)
    threads = [threading.Thread(target=reader) for _ in range(READERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.monotonic() - began
    return Pass(len(items) / seconds, 1000 * (cpu_seconds(pid) - cpu) / len(items) if pid else 0.0, wrong[0])


def _stoker(*args: str, env: dict) -> None:
    subprocess.run([sys.executable, "-m", "stoker", *args], env=env, check=True, capture_output=True)


def measure(files: int, passes: int, workdir: str, log=print, workers: int = 1) -> dict:
    items = dataset(files)
    folder = os.path.join(workdir, "folder")
    for key, size in items:
        os.makedirs(os.path.dirname(os.path.join(folder, key)), exist_ok=True)
        with open(os.path.join(folder, key), "wb") as f:
            f.write(expected_bytes(key, 0, size))
    results: dict = {"files": files, "passes": []}
    with StoreProcess({"bench": dict(items)}, latency=0, bandwidth=0, workdir=workdir) as store:
        mounts: dict[str, StokerDisk] = {}
        try:
            for label, extra in (("passthrough", ()), ("no-passthrough", ("--no-passthrough",))):
                extra = (*extra, "--workers", str(workers))
                home = os.path.join(workdir, label)  # (a disk tier's folder is its mount's alone)
                os.makedirs(home)
                mounts[label] = system = StokerDisk(store.endpoint, "bench", home, MEMORY, extra_args=extra)
                system.start()
                _stoker("warm", system.mountpoint, "held", env=system.env())
                held = (control.stats(control.default_control_socket(system.mountpoint)).document.get("disk")
                        or {}).get("blocks", 0)
                if held < files:
                    raise RuntimeError(f"{label}: the disk tier holds {held} of {files} files after the warm")
                _stoker("drop", system.mountpoint, env=system.env())
            for n in range(passes):
                row: dict = {}
                drop_page_cache()
                row["folder"] = read_pass(folder, items, 10 + n).__dict__
                for label, system in mounts.items():
                    drop_page_cache()
                    row[label] = read_pass(system.mountpoint, items, 20 + n, system.pid).__dict__
                results["passes"].append(row)
                log(f"pass {n + 1}: folder {row['folder']['files_s']:,.0f} files/s; " + "; ".join(
                    f"{label} {row[label]['files_s']:,.0f} ({row[label]['files_s'] / row['folder']['files_s']:.2f} of "
                    f"the folder), {row[label]['cpu_ms_per_file']:.3f} ms of mount CPU a file"
                    + (f", {row[label]['wrong']} WRONG" if row[label]["wrong"] else "") for label in mounts))
            for label, system in mounts.items():
                document = control.stats(control.default_control_socket(system.mountpoint)).document
                results[f"{label}_opens"] = (document.get("passthrough") or {}).get("opens", 0)
        finally:
            for system in mounts.values():
                system.stop()
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--workers", type=int, default=1, help="processes serving each mount (stoker mount --workers)")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args()
    if os.geteuid() != 0:
        print("dropping the page cache (and passthrough) needs root", file=sys.stderr)
        return 2
    workdir = scratch_dir("stoker-dropped-")
    try:
        results = measure(args.files, args.passes, workdir, workers=args.workers)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    wrong = sum(row[label]["wrong"] for row in results["passes"] for label in row)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
