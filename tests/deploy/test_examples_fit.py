"""Examples and docs fit the defaults they ship with: every documented install's node budget holds
every example's cache, and the mounter's memory is that budget plus its overhead."""

from __future__ import annotations

import os
import re

import pytest
import yaml
from kubernetes.utils.quantity import parse_quantity

from fusecore.config import parse_size

from .test_chart import ROOT, by_kind, render
from .test_manifests import EXAMPLES

DOCS = [os.path.join(ROOT, "docs", "install.md"), os.path.join(ROOT, "README.md")]


def documented_installs() -> list[dict]:
    """The values of every `helm install` command in the docs, from its --set flags."""
    installs = []
    for path in DOCS:
        text = open(path).read().replace("\\\n", " ")
        for command in re.findall(r"^helm install [^\n]*", text, flags=re.M):
            values: dict = {}
            for key, value in re.findall(r"--set ([\w.]+)=(\S+)", command):
                *parents, leaf = key.split(".")
                node = values
                for part in parents:
                    node = node.setdefault(part, {})
                node[leaf] = value
            installs.append(values)
    return installs


def example_caches() -> list[tuple[str, int]]:
    """(where, bytes) of every cache size an example asks for (PV attributes, StorageClass parameters,
    inline volumes, DatasetCaches with an explicit size), parsed as the driver parses them."""
    found = []
    for path in EXAMPLES:
        for doc in yaml.safe_load_all(open(path)):
            for where, size in _cache_sizes(doc or {}):
                found.append((f"{os.path.basename(path)}: {where}", parse_size(size)))
    return found


def _cache_sizes(node, where: str = ""):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "cacheSize" and isinstance(value, str) and value != "auto":
                yield where or key, value
            else:
                yield from _cache_sizes(value, f"{where}.{key}" if where else key)
    elif isinstance(node, list):
        for item in node:
            yield from _cache_sizes(item, where)


def cache_memory(values: dict) -> tuple[int, int]:
    """(node.cacheMemory, node.memoryOverhead) in bytes: the values given, else the chart's defaults."""
    defaults = yaml.safe_load(open(os.path.join(ROOT, "charts", "stoker", "values.yaml")))["node"]
    node = {**defaults, **values.get("node", {})}
    return int(parse_quantity(str(node["cacheMemory"]))), int(parse_quantity(str(node["memoryOverhead"])))


def test_the_docs_document_a_default_install():
    assert {} in documented_installs()


@pytest.mark.parametrize("values", documented_installs(), ids=str)
def test_every_example_cache_fits_every_documented_install(values):
    budget, overhead = cache_memory(values)
    docs = render(values)
    mounter = next(d for d in by_kind(docs, "DaemonSet") if d["metadata"]["name"] == "stoker-mounter")
    resources = mounter["spec"]["template"]["spec"]["containers"][0]["resources"]
    for kind in ("requests", "limits"):
        assert int(parse_quantity(resources[kind]["memory"])) == budget + overhead  # the scheduler sees the caches
    too_big = [(where, size) for where, size in example_caches() if size > budget]
    assert not too_big, f"examples larger than node.cacheMemory={budget}: {too_big}"


def test_the_first_volume_walkthrough_fits_one_node():
    """docs/install.md's "First volume": the PV and the DatasetCache that warms it share one mount, whose
    budget is the larger of the two; it must fit the default node budget."""
    budget, _ = cache_memory({})
    sizes = dict(example_caches())
    pv = sizes["aws-s3-static.yaml: spec.csi.volumeAttributes"]
    cache = sizes["datasetcache.yaml: spec"]
    assert max(pv, cache) <= budget and len(sizes) >= 5
