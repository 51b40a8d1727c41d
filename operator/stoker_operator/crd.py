"""Stoker's CustomResourceDefinitions (DatasetCache, DatasetCacheNode): the one source of truth.

The chart (`charts/stoker/crds/`) and the plain manifests (`deploy/base/`) hold copies written by
`python -m stoker_operator.crd --write`; a test fails if a copy differs from these definitions.

A DatasetCache's status holds aggregates only, so it stays small at any cluster size; each target
node's plan and progress live in a DatasetCacheNode of the release namespace (nodes.py).
"""

from __future__ import annotations

import argparse
import os
import sys

import yaml

from . import GROUP, KIND, NODE_KIND, NODE_PLURAL, PLURAL, VERSION

QUANTITY_OR_AUTO = r"^(auto|[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?)$"

_NODE_STATUS = {
    "type": "object",
    "properties": {
        "phase": {"type": "string", "enum": ["Pending", "Warming", "Ready", "Evicted", "Failed"]},
        "warmedBytes": {"type": "integer", "format": "int64", "minimum": 0},
        "cachedBytes": {"type": "integer", "format": "int64", "minimum": 0},
        "filesWarmed": {"type": "integer", "minimum": 0},
        "heldOn": {"type": "string", "enum": ["memory", "disk"],
                   "description": "where the node holds what it warmed: memory, or its disk tier"},
        "message": {"type": "string"},
        "updated": {"type": "string", "format": "date-time"},
        "plan": {"type": "string", "description": "the plan this report is about (spec.plan when it was written)"},
        "peer": {"type": "string", "description": "a distributed cache: HOST:PORT this node serves its blocks on"},
        "shareBytes": {"type": "integer", "format": "int64", "minimum": 0,
                       "description": "a distributed cache: bytes of the dataset this node owns"},
        "share": {"type": "string", "description": "a distributed cache: the part of the dataset this node owns"},
    },
}

_CONDITION = {
    "type": "object",
    "required": ["type", "status"],
    "properties": {
        "type": {"type": "string", "enum": ["Sized", "Warmed", "Ready", "CacheTooSmall"]},
        "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
        "reason": {"type": "string"},
        "message": {"type": "string"},
        "lastTransitionTime": {"type": "string", "format": "date-time"},
    },
}

SPEC_SCHEMA = {
    "type": "object",
    "required": ["source"],
    "properties": {
        "source": {
            "type": "object",
            "description": "The dataset: a PVC bound to a Stoker PV, or a bucket/prefix.",
            "oneOf": [{"required": ["pvc"]}, {"required": ["s3"]}],
            "properties": {
                "pvc": {"type": "string", "minLength": 1, "description": "PVC in this namespace"},
                "s3": {
                    "type": "object",
                    "required": ["bucket"],
                    "properties": {
                        "bucket": {"type": "string", "minLength": 3, "maxLength": 63},
                        "prefix": {"type": "string", "default": ""},
                        "endpointUrl": {"type": "string", "pattern": r"^https?://"},
                        "region": {"type": "string"},
                        "secretRef": {
                            "type": "object",
                            "required": ["name"],
                            "properties": {"name": {"type": "string", "minLength": 1}},
                            "description": "Secret in this namespace with accessKeyId/secretAccessKey",
                        },
                    },
                },
            },
        },
        "paths": {"type": "array", "items": {"type": "string"}, "default": [],
                  "description": "Sub-paths to warm; empty means the whole dataset"},
        "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}, "default": {}},
        "cacheSize": {"type": "string", "pattern": QUANTITY_OR_AUTO, "default": "auto",
                      "description": "Cache memory per node: a quantity, or auto"},
        "diskCacheSize": {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$",
                          "description": "Disk cache per node (the volume's diskCacheSize, within the chart's "
                                         "node.diskCache): what does not fit cacheSize in memory is warmed onto "
                                         "the node's disk and read from there"},
        "headroomPercent": {"type": "integer", "minimum": 0, "maximum": 100, "default": 10},
        "maxNodeMemoryFraction": {"type": "number", "minimum": 0.01, "maximum": 0.9, "default": 0.5},
        "policy": {"type": "string", "enum": ["Once", "KeepWarm", "OnDemand"], "default": "Once",
                   "description": "Once warms and leaves it; KeepWarm re-warms after eviction, restarts and on new "
                                  "nodes; OnDemand warms nothing: Ready once every node serves (a distributed cache: "
                                  "has joined), the cache fills as training reads"},
        "distributed": {
            "type": "object",
            "description": "Hold the dataset once (or R times) across the nodes, served node to node, instead of "
                           "whole on every node: each node warms and keeps the blocks it owns",
            "properties": {"replicas": {"type": "integer", "minimum": 1, "maximum": 3, "default": 1,
                                        "description": "copies of each block among the nodes"}},
        },
    },
}

STATUS_SCHEMA = {
    "type": "object",
    "properties": {
        "phase": {"type": "string", "enum": ["Pending", "Sizing", "Warming", "Ready", "Degraded", "Failed"]},
        "datasetBytes": {"type": "integer", "format": "int64", "minimum": 0},
        "datasetSize": {"type": "string"},
        "objectCount": {"type": "integer", "format": "int64", "minimum": 0},
        "cacheBytesPerNode": {"type": "integer", "format": "int64", "minimum": 0},
        "diskBytesPerNode": {"type": "integer", "format": "int64", "minimum": 0},
        "heldOn": {"type": "string", "enum": ["memory", "disk"],
                   "description": "where each node holds what it warms: memory, or its disk tier (diskCacheSize)"},
        "warmableBytes": {"type": "integer", "format": "int64", "minimum": 0,
                          "description": "Bytes of the dataset that fit the per-node cache (what Ready means)"},
        "nodeSummary": {
            "type": "object",
            "description": "target nodes by the phase of their report about the current plan",
            "properties": {k: {"type": "integer", "minimum": 0}
                           for k in ("targets", "ready", "warming", "failed", "waiting")},
        },
        "notReady": {
            "type": "array", "maxItems": 10,
            "description": "a few target nodes that are not Ready, and why (all of them: the DatasetCacheNodes)",
            "items": {"type": "object", "properties": {
                "node": {"type": "string"}, "phase": {"type": "string"}, "message": {"type": "string"}}},
        },
        "nodeReports": {"type": "string",
                        "description": "the label selector of this cache's DatasetCacheNodes (release namespace)"},
        "volume": {
            "type": "object",
            "properties": {
                "id": {"type": "string"},
                "attributes": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "cachedPercentage": {"type": "number", "minimum": 0, "maximum": 100},
        "cached": {"type": "string"},
        "conditions": {"type": "array", "items": _CONDITION},
        "observedGeneration": {"type": "integer", "format": "int64"},
        "plan": {"type": "string",
                 "description": "identity of the current plan (generation and resolved source); only node reports "
                                "of this plan count towards Ready"},
        "warmedBytes": {"type": "integer", "format": "int64", "minimum": 0,
                        "description": "bytes the target nodes hold of the current plan, summed"},
        "distributed": {"type": "object", "description": "a distributed cache: how the dataset is spread",
                        "properties": {"replicas": {"type": "integer", "minimum": 1},
                                       "nodes": {"type": "integer", "minimum": 0},
                                       "shareBytes": {"type": "integer", "format": "int64", "minimum": 0}}},
        "kopf": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
    },
}


NODE_SPEC_SCHEMA = {
    "type": "object",
    "required": ["cache", "node", "plan", "cacheBytes"],
    "properties": {
        "cache": {"type": "string", "description": "the DatasetCache, namespace/name"},
        "node": {"type": "string", "description": "the node whose agent warms this plan"},
        "plan": {"type": "string", "description": "the DatasetCache's plan (status.plan)"},
        "cacheBytes": {"type": "integer", "format": "int64", "minimum": 0,
                       "description": "the cache budget of the volume's mount on this node"},
        "warmableBytes": {"type": "integer", "format": "int64", "minimum": 0,
                          "description": "what Ready means: bytes of the dataset the budget holds"},
        "paths": {"type": "array", "items": {"type": "string"}},
        "policy": {"type": "string", "enum": ["Once", "KeepWarm", "OnDemand"]},
        "distributed": {"type": "object", "description": "a distributed cache: this node warms the blocks it owns",
                        "properties": {"replicas": {"type": "integer", "minimum": 1, "maximum": 3},
                                       "nodes": {"type": "integer", "minimum": 0,
                                                 "description": "the nodes of the plan: each waits for all to join"}}},
    },
}


def _crd(kind: str, plural: str, short: str, description: str, spec: dict, status: dict, columns: list[dict],
         required: list[str]) -> dict:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "listKind": f"{kind}List",
                      "shortNames": [short], "categories": ["stoker"]},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": description,
                    "required": required,
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": spec,
                        "status": status,
                    },
                }},
                "additionalPrinterColumns": columns,
            }],
        },
    }


def definition() -> dict:
    """The DatasetCache CRD."""
    return _crd(KIND, PLURAL, "dsc", "A dataset to keep warm in the Stoker caches of selected nodes.",
                SPEC_SCHEMA, STATUS_SCHEMA, [
                    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                    {"name": "Size", "type": "string", "jsonPath": ".status.datasetSize"},
                    {"name": "Cached", "type": "string", "jsonPath": ".status.cached"},
                    {"name": "Held", "type": "string", "jsonPath": ".status.heldOn"},
                    {"name": "Nodes", "type": "integer", "jsonPath": ".status.nodeSummary.targets"},
                    {"name": "Ready", "type": "integer", "jsonPath": ".status.nodeSummary.ready"},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                ], ["spec"])


def node_definition() -> dict:
    """The DatasetCacheNode CRD: one object per DatasetCache and target node, written by the operator
    (spec: the plan) and by that node's agent (status: its report)."""
    return _crd(NODE_KIND, NODE_PLURAL, "dcn",
                "One node's part of a DatasetCache: what to warm there (spec), and how far it got (status).",
                NODE_SPEC_SCHEMA, _NODE_STATUS, [
                    {"name": "Cache", "type": "string", "jsonPath": ".spec.cache"},
                    {"name": "Node", "type": "string", "jsonPath": ".spec.node"},
                    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                    {"name": "Cached", "type": "integer", "jsonPath": ".status.cachedBytes"},
                    {"name": "Held", "type": "string", "jsonPath": ".status.heldOn"},
                    {"name": "Share", "type": "string", "jsonPath": ".status.share"},
                    {"name": "Message", "type": "string", "jsonPath": ".status.message", "priority": 1},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                ], ["spec"])


def schema(plural: str) -> dict:
    """The openAPIV3Schema of one of the CRDs, by plural."""
    crd = next(c for c in (definition(), node_definition()) if c["spec"]["names"]["plural"] == plural)
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def render() -> str:
    return "# Generated by `python -m stoker_operator.crd --write`; edit operator/stoker_operator/crd.py.\n" + \
        yaml.safe_dump_all([definition(), node_definition()], sort_keys=False)


COPIES = ("charts/stoker/crds/stoker.dev.yaml", "deploy/base/crds.yaml")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="print or write Stoker's CRDs")
    parser.add_argument("--write", metavar="REPO", nargs="?", const=".", help="write the copies in the repo")
    args = parser.parse_args(argv)
    if args.write is None:
        sys.stdout.write(render())
        return 0
    for copy in COPIES:
        path = os.path.join(args.write, copy)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
