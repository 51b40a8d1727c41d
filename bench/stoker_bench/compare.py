"""`stoker bench --compare REF`: an A/B of the working tree against REF, in one run, alternating.

The base is REF's tree exported beside the working tree (`git archive`, cached by commit under the
output folder), the change a fresh copy of the working tree (edits included); each side runs `stoker bench` as its own process with its own tree first on the
import path, and the sides alternate round by round (base first in odd rounds, change first in even
ones) so that a drift of the machine's speed lands on both. Every cell then shows throughput, CPU
per GiB, peak RSS and read amplification of both sides, each as the median of the rounds with its
spread, so a CPU win that costs speed (or the reverse) shows in one table.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field

from .report import LOWER_IS_BETTER

# Figures compared per cell: (Cell field, heading, True where higher is better).
FIGURES = [("value", "throughput", True), ("cpu_s_per_gib", "CPU-s/GiB", False),
           ("peak_rss_mib", "peak RSS MiB", False), ("read_amplification", "store bytes / bytes read", False)]


class CompareError(RuntimeError):
    """The A/B cannot run (unknown ref, not a git checkout); the message says why."""


@dataclass
class Side:
    name: str  # base | change
    tree: str
    label: str  # the ref and commit, or "working tree"
    runs: list[dict] = field(default_factory=list)  # each round's results.json


def repo_root(start: str) -> str:
    """The git checkout holding `start` (the change side is its working tree, uncommitted edits included)."""
    try:
        out = subprocess.run(["git", "-C", start, "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                             check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise CompareError(f"--compare needs a git checkout of Stoker ({start} is not one)") from exc
    return out.stdout.strip()


def export_ref(repo: str, ref: str, dest: str) -> tuple[str, str]:
    """REF's tree in `dest`/base-<commit> (kept for the next A/B against it); returns (tree, commit)."""
    try:
        commit = subprocess.run(["git", "-C", repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
                                capture_output=True, text=True, check=True).stdout.strip()
    except subprocess.CalledProcessError as exc:
        raise CompareError(f"--compare: {ref!r} is not a commit of {repo}") from exc
    tree = os.path.join(dest, f"base-{commit[:12]}")
    if os.path.isfile(os.path.join(tree, ".exported")):
        return tree, commit
    shutil.rmtree(tree, ignore_errors=True)
    os.makedirs(tree)
    with tempfile.TemporaryFile() as archive:
        subprocess.run(["git", "-C", repo, "archive", "--format=tar", commit], stdout=archive, check=True)
        archive.seek(0)
        with tarfile.open(fileobj=archive) as tar:
            tar.extractall(tree, filter="data")
    open(os.path.join(tree, ".exported"), "w").close()
    return tree, commit


def export_working_tree(repo: str, dest: str) -> str:
    """The working tree as it is (tracked and untracked files git does not ignore, edits included) in
    `dest`/change, so that both sides run from a fresh copy laid out alike (no side keeps compiled
    caches or stray files the other lacks)."""
    tree = os.path.join(dest, "change")
    shutil.rmtree(tree, ignore_errors=True)
    os.makedirs(tree)
    listed = subprocess.run(["git", "-C", repo, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout.split(b"\0")
    for name in (n.decode() for n in listed if n):
        source = os.path.join(repo, name)
        if not os.path.isfile(source):
            continue  # deleted in the working tree
        target = os.path.join(tree, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(source, target)
    return tree


def side_env(tree: str) -> dict[str, str]:
    """Imports come from `tree` alone: its packages first on the path, ahead of the installed project."""
    paths = [tree, os.path.join(tree, "bench"), os.path.join(tree, "operator")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths), PYTHONDONTWRITEBYTECODE="1")


def run_side(side: Side, bench_args: list[str], out: str, log=print) -> dict:
    """One `stoker bench` of one side; its results.json."""
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, "-m", "stoker", "bench", *bench_args, "--out", out]
    log(f"--- {side.name} ({side.label}): {' '.join(cmd[1:])}")
    result = subprocess.run(cmd, cwd=side.tree, env=side_env(side.tree))
    path = os.path.join(out, "results.json")
    if not os.path.exists(path):
        raise CompareError(f"the {side.name} side's bench wrote no results (exit {result.returncode})")
    with open(path) as f:
        return json.load(f)


def known_workloads(tree: str) -> set[str]:
    """The workloads the bench of `tree` knows (an older base may lack newer ones)."""
    code = "from stoker_bench.workloads import WORKLOADS; print(','.join(WORKLOADS))"
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env=side_env(tree), capture_output=True, text=True)
    if out.returncode != 0:
        raise CompareError(f"cannot load the bench of {tree}: {out.stderr.strip().splitlines()[-1:]}")
    return set(out.stdout.strip().split(","))


def run(*, ref: str, rounds: int, systems: list[str], workloads: list[str], bench_args: list[str], out: str,
        log=print) -> tuple[Side, Side]:
    repo = repo_root(os.getcwd())
    out = os.path.abspath(out)  # each side's bench runs in its own tree: a relative --out would land there
    trees = os.path.join(out, "trees")
    base_tree, commit = export_ref(repo, ref, trees)
    base = Side("base", base_tree, f"{ref} = {commit[:12]}")
    change = Side("change", export_working_tree(repo, trees), f"working tree of {repo}")
    common = [w for w in workloads if w in known_workloads(base.tree)]
    if dropped := [w for w in workloads if w not in common]:
        log(f"the base's bench has no {', '.join(dropped)}: compared without")
    if not common:
        raise CompareError("none of the workloads exists in the base's bench")
    bench_args = [*bench_args, "--systems", ",".join(systems), "--workloads", ",".join(common)]
    for r in range(rounds):
        order = (base, change) if r % 2 == 0 else (change, base)
        for side in order:
            side.runs.append(run_side(side, bench_args, os.path.join(out, f"round{r + 1}-{side.name}"), log=log))
    return base, change


def _cells(side: Side) -> dict[tuple[str, str, str], list[dict]]:
    by: dict[tuple[str, str, str], list[dict]] = {}
    for result in side.runs:
        for cell in result["cells"]:
            by.setdefault((cell["workload"], cell["system"], cell["run"]), []).append(cell)
    return by


def _spread(values: list[float]) -> str:
    """median [min-max] of the rounds."""
    if not values:
        return "-"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.4g}"
    return f"{med:.4g} [{min(values):.4g}-{max(values):.4g}]"


def _change(base: list[float], change: list[float], higher_better: bool) -> str:
    """The change's median against the base's, as a signed percentage of the base (better or worse)."""
    if not base or not change:
        return "-"
    b, c = statistics.median(base), statistics.median(change)
    if not b:
        return "-"
    pct = (c - b) / b * 100
    better = pct >= 0 if higher_better else pct <= 0
    return f"{pct:+.1f}%" + ("" if abs(pct) < 0.05 else (" better" if better else " worse"))


def _ceilings(side: Side) -> list[float]:
    return [r["info"].get("python_client_ceiling_MBps") for r in side.runs
            if r["info"].get("python_client_ceiling_MBps")]


def table(base: Side, change: Side) -> str:
    """One row per cell and figure: base and change (median [min-max] over rounds) and the change."""
    rounds = min(len(base.runs), len(change.runs))
    lines = [f"# A/B: base {base.label} vs change ({change.label}), {rounds} round(s), alternating", "",
             "Each figure is the median over rounds with [min-max]; the last column is the change's median "
             "against the base's.", "",
             "| workload | system | run | figure | base | change | change vs base |",
             "|---|---|---|---|---:|---:|---|"]
    b_cells, c_cells = _cells(base), _cells(change)
    for key in list(dict.fromkeys([*b_cells, *c_cells])):
        workload, system, run = key
        for name, heading, higher in FIGURES:
            b = [c[name] for c in b_cells.get(key, []) if c.get(name) is not None]
            c = [c[name] for c in c_cells.get(key, []) if c.get(name) is not None]
            if not b and not c:
                continue
            if name == "value":
                unit = next((x["unit"] for x in b_cells.get(key, []) + c_cells.get(key, []) if x.get("unit")), "")
                heading = unit or heading
                higher = workload not in LOWER_IS_BETTER
            lines.append(f"| {workload} | {system} | {run} | {heading} | {_spread(b)} | {_spread(c)} | "
                         f"{_change(b, c, higher)} |")
        wrong = sum(x.get("wrong", 0) for x in b_cells.get(key, []) + c_cells.get(key, []))
        if wrong:
            lines.append(f"| {workload} | {system} | {run} | WRONG BYTES | | | {wrong} pieces |")
    bare_b, bare_c = _ceilings(base), _ceilings(change)
    lines += ["", f"Bare Python client ceiling (MB/s, same store, measured in each run): base {_spread(bare_b)}, "
                  f"change {_spread(bare_c)}"]
    for side in (base, change):
        fractions = []
        for result in side.runs:
            ceiling = result["info"].get("python_client_ceiling_MBps")
            seq = next((c["value"] for c in result["cells"] if (c["workload"], c["system"], c["run"])
                        == ("seq1", "stoker", "cold") and c.get("value")), None)
            if ceiling and seq:
                fractions.append(seq / ceiling * 100)
        if fractions:
            lines.append(f"Stoker seq1 cold as % of that run's bare client, {side.name}: {_spread(fractions)}")
    return "\n".join(lines) + "\n"


def any_wrong(*sides: Side) -> bool:
    return any(c.get("wrong") for side in sides for r in side.runs for c in r["cells"])
