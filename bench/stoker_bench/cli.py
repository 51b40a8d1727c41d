"""`stoker bench`: Stoker side by side with s3fs-fuse, rclone mount and plain boto3, one run."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import traceback

from fusecore.config import parse_size

from . import hostmem
from .fixture import scratch_dir
from .report import draw_chart, write, write_operator, write_table
from .runner import run_all
from .systems import SYSTEMS, kind_of
from .targets import evaluate
from .workloads import ON_REQUEST, WORKLOADS

COMPARE_WORKLOADS = "seq1,shards,small,partial"  # the data path's shapes: one stream, shard readers, small files


def add_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark Stoker against s3fs-fuse, rclone and boto3 on an emulated store")
    p.add_argument("--scale", type=float, default=0.25,
                   help="dataset size factor (default 0.25: 256 MiB large objects; 1: 1 GiB and 10,000 files)")
    p.add_argument("--out", default="./bench-results", help="output folder (default ./bench-results)")
    p.add_argument("--systems", default=None,
                   help=f"comma-separated, of {','.join(SYSTEMS)} (default: all; with --compare: stoker), and "
                        "stoker-wN: Stoker served by N worker processes (--workers N), e.g. stoker-w1,stoker-w8 "
                        "for the scaling side by side")
    p.add_argument("--workloads", default=None,
                   help=f"comma-separated, of {','.join(WORKLOADS)} (default: all but {','.join(sorted(ON_REQUEST))}; with --compare: "
                        f"{COMPARE_WORKLOADS})")
    p.add_argument("--latency-ms", type=float, default=20.0, help="first-byte latency of the store (default 20)")
    p.add_argument("--bandwidth-mbps", type=float, default=16.0, help="MB/s per connection (default 16)")
    p.add_argument("--cache-size", default="2GiB", help="Stoker's cache and rclone's cache limit (default 2GiB)")
    p.add_argument("--compare", metavar="REF", default=None,
                   help="A/B: run the workloads on REF's tree (a commit, branch or tag) and on the working tree, "
                        "alternating, and print both sides' throughput, CPU per GiB and RSS per cell")
    p.add_argument("--rounds", type=int, default=2, help="--compare: rounds of each side (at least 2; default 2)")
    p.add_argument("--gpu-rate", type=float, metavar="N", default=None,
                   help="the DataLoader cell as training on one simulated GPU that consumes N samples/s (e.g. ~2500 "
                        "for ResNet-50 on one A100): each batch is held batch/N s and the table says, per system and "
                        "epoch, the share of wall time that GPU would have been busy")
    p.add_argument("--gpu-batch", type=int, metavar="B", default=32,
                   help="--gpu-rate: samples per batch (default 32)")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder (logs of every system)")
    p.add_argument("--keep-page-reporting", action="store_true",
                   help="leave a VM's free page reporting on (by default a root run pauses it and touches memory "
                        "first: see README.md, 'Fresh memory on a VM')")
    p.add_argument("--operator", action="store_true",
                   help="instead: the DatasetCache operator at cluster scale (simulated nodes, faked API server)")
    p.add_argument("--nodes", default="100,1000,5000", help="--operator: node counts (default 100,1000,5000)")
    p.add_argument("--cluster", type=int, metavar="N", default=None,
                   help="instead: data-parallel training on N nodes (N mounts on loopback addresses), per-node "
                        "caches against one distributed cache (DistributedSampler partitions, --epochs epochs)")
    p.add_argument("--epochs", type=int, default=3, help="--cluster: epochs (default 3)")
    p.add_argument("--shard-quarters", action="store_true",
                   help="--cluster: each node reads a different quarter of every shard each epoch (1 MiB reads from "
                        "the quarter's start) beside its small files, instead of whole shards")
    p.add_argument("--replicas", type=int, default=1, help="--cluster: copies of each block (default 1)")
    p.add_argument("--no-kill", action="store_true",
                   help="--cluster: skip the last epochs, in which one node's mount is killed halfway (warmed) or "
                        "stopped for 8 s (not warmed)")
    p.add_argument("--warm", choices=("both", "yes", "no"), default="both",
                   help="--cluster: warm each node's cache before epoch 1 as a DatasetCache does, not at all (the "
                        "caches fill as training reads), or run both (default)")
    p.add_argument("--peer-timeout", type=float, default=1.0,
                   help="--cluster: the mounts' --peer-timeout (default 1.0: N mounts, the store and the readers "
                        "share this machine's cores)")
    p.add_argument("--engines", action="store_true",
                   help="instead: range-GET engines without FUSE (Stoker's store client; awscrt's S3 client if "
                        "installed), CPU per GiB and per GET")
    p.add_argument("--large-mib", type=int, default=512, help="--engines: size of the large object (default 512)")
    p.add_argument("--small-files", type=int, default=600, help="--engines: number of small objects (default 600)")
    p.set_defaults(func=run)


def run_operator(args: argparse.Namespace) -> int:
    """The operator's figures per cluster size: planning time, object sizes, requests, events per agent."""
    from . import operator_scale

    try:
        counts = [int(n) for n in args.nodes.split(",") if n]
    except ValueError:
        print(f"stoker bench: --nodes: {args.nodes!r} is not a comma-separated list of node counts", file=sys.stderr)
        return 2
    if not counts or min(counts) < 1:
        print("stoker bench: --nodes: give at least one count of 1 or more", file=sys.stderr)
        return 2
    workdir = scratch_dir("stoker-bench-operator-")
    try:
        rows = []
        for n in counts:
            os.makedirs(os.path.join(workdir, str(n)))
            rows.append(operator_scale.run(n, workdir=os.path.join(workdir, str(n)),
                                           log=lambda line: print(line, flush=True)).row())
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    paths = write_operator(args.out, rows)
    with open(paths["markdown"]) as f:
        print(f.read())
    print("written: " + ", ".join(paths.values()))
    return 0


def run_engines(args: argparse.Namespace) -> int:
    """Stoker's range-GET client beside awscrt's S3 client, same store, same ranges (see engines.py)."""
    from . import engines

    if args.large_mib < 4 or args.small_files < 1:
        print("stoker bench: --large-mib must be at least 4 and --small-files at least 1", file=sys.stderr)
        return 2
    workdir = scratch_dir("stoker-bench-engines-")
    try:
        rows = engines.run(workdir, engines=engines.available(), large_mib=args.large_mib, small=args.small_files,
                           latency=args.latency_ms / 1000, bandwidth=args.bandwidth_mbps * 1e6,
                           log=lambda line: print(line, flush=True))
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    paths = write_table(args.out, "engines", engines.table(rows), [dataclasses.asdict(r) for r in rows])
    print(engines.table(rows))
    if "awscrt" not in engines.available():
        print("(awscrt is not installed: pip install awscrt to compare it)")
    print("written: " + ", ".join(paths.values()))
    return 1 if any(r.wrong or r.note for r in rows) else 0


def run_cluster(args: argparse.Namespace) -> int:
    """Per-node caches against one distributed cache, N mounts on one machine (cluster.py)."""
    from . import cluster

    n = args.cluster
    workdir = scratch_dir("stoker-bench-cluster-")
    try:
        result = cluster.run(n=n, replicas=args.replicas, epochs=args.epochs, kill=not args.no_kill,
                             scale=args.scale, workdir=workdir, latency=args.latency_ms / 1000,
                             bandwidth=args.bandwidth_mbps * 1e6, peer_timeout=args.peer_timeout,
                             warm={"both": (True, False), "yes": (True,), "no": (False,)}[args.warm],
                             quarters=args.shard_quarters,
                             log=lambda line: print(line, flush=True))
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    text = cluster.table(result)
    paths = write_table(args.out, f"cluster-{n}", text, [dataclasses.asdict(r) for r in result.rows])
    print()
    print(text)
    print("written: " + ", ".join(paths.values()))
    return 1 if any(r.wrong for r in result.rows) else 0


def run_compare(args: argparse.Namespace, systems: list[str], workloads: list[str], memory_note: str) -> int:
    """Base (REF) and change (the working tree) alternating, `--rounds` each; one table of both."""
    from . import compare

    bench_args = ["--scale", str(args.scale), "--latency-ms", str(args.latency_ms), "--bandwidth-mbps", str(args.bandwidth_mbps),
                  "--cache-size", args.cache_size]
    try:
        base, change = compare.run(ref=args.compare, rounds=args.rounds, systems=systems, workloads=workloads,
                                   bench_args=bench_args, out=args.out,
                                   log=lambda line: print(line, flush=True))
    except compare.CompareError as exc:
        print(f"stoker bench: {exc}", file=sys.stderr)
        return 2
    text = compare.table(base, change) + (f"\n{memory_note}\n" if memory_note else "")
    paths = write_table(args.out, "compare", text, [{"side": s.name, "label": s.label, "runs": s.runs}
                                                    for s in (base, change)])
    print()
    print(text)
    print("written: " + ", ".join(paths.values()))
    return 1 if compare.any_wrong(base, change) else 0


def _no_fuse() -> bool:
    """Can this process not mount (neither root nor fusermount3)? Says so."""
    if os.geteuid() != 0 and not shutil.which("fusermount3"):
        print("stoker bench: FUSE mounts need root or fusermount3", file=sys.stderr)
        return True
    return False


def run(args: argparse.Namespace) -> int:
    if args.operator:
        return run_operator(args)
    # Arguments are refused before memory is primed (that takes ~25 s on a fresh VM).
    plan: tuple[list[str], list[str]] | None = None
    if args.engines:
        pass
    elif args.cluster is not None:
        if _bad_cluster(args) or _no_fuse():
            return 2
    elif (plan := _plan(args)) is None:
        return 2
    with hostmem.reporting_paused(keep=args.keep_page_reporting) as memory:
        if note := memory.describe():
            print(note, flush=True)
        if args.engines:
            return run_engines(args)
        if args.cluster is not None:
            return run_cluster(args)
        assert plan is not None
        if args.compare:
            return run_compare(args, *plan, note)
        return run_cells(args, *plan, note)


def _bad_cluster(args: argparse.Namespace) -> bool:
    """Are the --cluster arguments out of range? Says so."""
    if not 2 <= args.cluster <= 32 or args.epochs < 2 or not 1 <= args.replicas <= args.cluster:
        print("stoker bench: --cluster takes 2-32 nodes, --epochs at least 2, --replicas 1 to the nodes",
              file=sys.stderr)
        return True
    return False


def _plan(args: argparse.Namespace) -> tuple[list[str], list[str]] | None:
    """The systems and workloads asked for, or None after saying why they cannot run."""
    default_systems = "stoker" if args.compare else ",".join(SYSTEMS)
    default_workloads = COMPARE_WORKLOADS if args.compare else ",".join(w for w in WORKLOADS if w not in ON_REQUEST)
    systems = [s for s in (args.systems or default_systems).split(",") if s]
    workloads = [w for w in (args.workloads or default_workloads).split(",") if w]
    unknown = [s for s in systems if kind_of(s) is None] + [w for w in workloads if w not in WORKLOADS]
    if unknown:
        print(f"stoker bench: unknown system or workload: {', '.join(unknown)}", file=sys.stderr)
        return None
    if args.gpu_rate is not None and (args.gpu_rate <= 0 or args.gpu_batch < 1 or "dataloader" not in workloads
                                      or args.compare):
        print("stoker bench: --gpu-rate takes samples/s above 0 and a --gpu-batch of 1 or more, and needs the "
              "dataloader workload in a plain run (not --compare)", file=sys.stderr)
        return None
    if args.compare and args.rounds < 2:
        print("stoker bench: --rounds must be at least 2 (one round cannot tell a change from noise)",
              file=sys.stderr)
        return None
    return None if _no_fuse() else (systems, workloads)


def run_cells(args: argparse.Namespace, systems: list[str], workloads: list[str], memory_note: str) -> int:
    """One run of every workload on every system: its JSON and table, then the chart, which cannot lose them. A run
    that stops early (Ctrl-C, a fault of the harness) still writes the cells it measured."""
    workdir = scratch_dir()
    cells: list = []
    info: dict = {"host_memory": memory_note}
    try:
        run_all(scale=args.scale, systems=systems, workloads=workloads, workdir=workdir,
                latency=args.latency_ms / 1000, bandwidth=args.bandwidth_mbps * 1e6,
                cache_bytes=parse_size(args.cache_size, name="cache-size"), log=lambda line: print(line, flush=True),
                gpu_rate=args.gpu_rate, gpu_batch=args.gpu_batch, cells=cells, info=info)
    except BaseException as exc:
        if cells:
            info["incomplete"] = f"the run stopped early ({type(exc).__name__}: {exc}); these are the cells it measured"
            paths = write(args.out, cells, info, [])
            print(f"stoker bench: stopped early; the cells measured so far are in {', '.join(paths.values())}",
                  file=sys.stderr)
        raise
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    try:
        targets = evaluate(cells, info)
    except Exception as exc:  # noqa: BLE001 - a fault in the targets must not cost the results
        traceback.print_exc()
        targets = [f"not evaluated ({type(exc).__name__}: {exc})"]
    paths = write(args.out, cells, info, targets)
    print()
    with open(paths["markdown"]) as f:
        print(f.read())
    png, problem = draw_chart(args.out, cells)
    if png:
        paths["png"] = png
    print("written: " + ", ".join(paths.values()))
    if problem:
        print(f"stoker bench: {problem}", file=sys.stderr)
    return 1 if any(c.wrong for c in cells) else 0
