"""The DatasetCache CustomResourceDefinition: the one source of truth.

The chart (`charts/stoker/crds/`) and the plain manifests (`deploy/base/`) hold copies written by
`python -m stoker_operator.crd --write`; a test fails if a copy differs from this definition.
"""

from __future__ import annotations

import argparse
import os
import sys

import yaml

from . import GROUP, KIND, PLURAL, VERSION

QUANTITY_OR_AUTO = r"^(auto|[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?)$"

_NODE_STATUS = {
    "type": "object",
    "properties": {
        "phase": {"type": "string", "enum": ["Pending", "Warming", "Ready", "Evicted", "Failed"]},
        "warmedBytes": {"type": "integer", "format": "int64", "minimum": 0},
        "cachedBytes": {"type": "integer", "format": "int64", "minimum": 0},
        "filesWarmed": {"type": "integer", "minimum": 0},
        "message": {"type": "string"},
        "updated": {"type": "string", "format": "date-time"},
        "plan": {"type": "string", "description": "the plan this report is about (status.plan)"},
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
        "headroomPercent": {"type": "integer", "minimum": 0, "maximum": 100, "default": 10},
        "maxNodeMemoryFraction": {"type": "number", "minimum": 0.01, "maximum": 0.9, "default": 0.5},
        "policy": {"type": "string", "enum": ["Once", "KeepWarm"], "default": "Once"},
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
        "warmableBytes": {"type": "integer", "format": "int64", "minimum": 0,
                          "description": "Bytes of the dataset that fit the per-node cache (what Ready means)"},
        "targetNodes": {"type": "array", "items": {"type": "string"}},
        "volume": {
            "type": "object",
            "properties": {
                "id": {"type": "string"},
                "attributes": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "nodes": {"type": "object", "additionalProperties": _NODE_STATUS},
        "cachedPercentage": {"type": "number", "minimum": 0, "maximum": 100},
        "cached": {"type": "string"},
        "conditions": {"type": "array", "items": _CONDITION},
        "observedGeneration": {"type": "integer", "format": "int64"},
        "plan": {"type": "string",
                 "description": "identity of the current plan (generation and resolved source); only node reports "
                                "of this plan count towards Ready"},
        "kopf": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
    },
}


def definition() -> dict:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "plural": PLURAL, "singular": "datasetcache", "listKind": f"{KIND}List",
                      "shortNames": ["dsc"], "categories": ["stoker"]},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "A dataset to keep warm in the Stoker caches of selected nodes.",
                    "required": ["spec"],
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": SPEC_SCHEMA,
                        "status": STATUS_SCHEMA,
                    },
                }},
                "additionalPrinterColumns": [
                    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                    {"name": "Size", "type": "string", "jsonPath": ".status.datasetSize"},
                    {"name": "Cached", "type": "string", "jsonPath": ".status.cached"},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                ],
            }],
        },
    }


def render() -> str:
    return "# Generated by `python -m stoker_operator.crd --write`; edit operator/stoker_operator/crd.py.\n" + \
        yaml.safe_dump(definition(), sort_keys=False)


COPIES = ("charts/stoker/crds/datasetcaches.stoker.dev.yaml", "deploy/base/crd-datasetcache.yaml")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="print or write the DatasetCache CRD")
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
