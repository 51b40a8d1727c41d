"""deploy/ (kustomize base, examples, dashboard) and the CRD: rendered, validated, and in sync with
their one source of truth."""

from __future__ import annotations

import copy
import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess

import jsonschema
import kubernetes_validate
import pytest
import yaml

from stoker_operator import crd

from .test_chart import KUBE_VERSION, ROOT

EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "deploy", "examples", "*.yaml")))
DATASETCACHE_SCHEMA = crd.definition()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def load_generator():
    spec = importlib.util.spec_from_file_location("deploy_generate", os.path.join(ROOT, "deploy", "generate.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def validate(doc: dict) -> None:
    if doc["kind"] == "DatasetCache":
        jsonschema.validate(doc, DATASETCACHE_SCHEMA)
    else:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def test_crd_copies_match_the_definition_in_code():
    for copy_path in crd.COPIES:
        with open(os.path.join(ROOT, copy_path)) as f:
            assert f.read() == crd.render(), f"{copy_path} is stale: run python deploy/generate.py"
    kubernetes_validate.validate(crd.definition(), KUBE_VERSION, strict=True)


def test_plain_manifests_match_the_chart():
    with open(os.path.join(ROOT, "deploy", "base", "stoker.yaml")) as f:
        assert f.read() == load_generator().render_base(), "deploy/base is stale: run python deploy/generate.py"


def test_kustomize_base_renders_valid_objects():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is required to render deploy/base (kubectl kustomize); install it (see .ci/run)")
    out = subprocess.run([kubectl, "kustomize", os.path.join(ROOT, "deploy", "base")], capture_output=True,
                         text=True, check=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    kinds = {d["kind"] for d in docs}
    assert {"Namespace", "CustomResourceDefinition", "CSIDriver", "DaemonSet", "Deployment"} <= kinds
    for doc in docs:
        validate(doc)


@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_examples_are_valid(path):
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    assert docs
    for doc in docs:
        validate(doc)


VALID = {"apiVersion": "stoker.dev/v1alpha1", "kind": "DatasetCache", "metadata": {"name": "x"},
         "spec": {"source": {"pvc": "data"}}}


@pytest.mark.parametrize("change", [
    lambda d: d.pop("spec"),
    lambda d: d["spec"].pop("source"),
    lambda d: d["spec"]["source"].update(s3={"bucket": "both-given"}),
    lambda d: d["spec"].update(source={"s3": {"prefix": "no-bucket"}}),
    lambda d: d["spec"].update(cacheSize="lots"),
    lambda d: d["spec"].update(cacheSize="-5Gi"),
    lambda d: d["spec"].update(policy="Sometimes"),
    lambda d: d["spec"].update(maxNodeMemoryFraction=1.5),
    lambda d: d["spec"].update(headroomPercent=-1),
    lambda d: d["spec"].update(nodeSelector={"pool": 3}),
    lambda d: d["spec"].update(source={"s3": {"bucket": "b", "endpointUrl": "ftp://x"}}),
])
def test_the_crd_schema_rejects_invalid_datasetcaches(change):
    jsonschema.validate(VALID, DATASETCACHE_SCHEMA)
    doc = copy.deepcopy(VALID)
    change(doc)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, DATASETCACHE_SCHEMA)


def test_grafana_dashboard_uses_metrics_the_node_plugin_exports():
    with open(os.path.join(ROOT, "deploy", "examples", "grafana-dashboard.json")) as f:
        dashboard = json.load(f)
    with open(os.path.join(ROOT, "csi", "metrics.py")) as f:
        source = f.read()
    exported = set(re.findall(r'"(stoker_volume_[a-z_]+)"', source))
    used = {m for p in dashboard["panels"] for t in p["targets"] for m in re.findall(r"stoker_volume_[a-z_]+", t["expr"])}
    assert used and {m.removesuffix("_total") for m in used} <= exported


def test_configuration_reference_names_every_value_and_attribute():
    from csi.attributes import AUTH_ATTRIBUTES, KNOBS, STORE_ATTRIBUTES

    with open(os.path.join(ROOT, "docs", "configuration.md")) as f:
        doc = f.read()
    with open(os.path.join(ROOT, "charts", "stoker", "values.yaml")) as f:
        values = yaml.safe_load(f)

    def leaves(tree, prefix=""):
        for key, value in tree.items():
            if isinstance(value, dict) and value and key not in ("resources", "requests", "limits", "labels"):
                yield from leaves(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}"

    missing = [v for v in leaves(values) if f"`{v}`" not in doc and not any(
        f"`{v}".startswith(f"`{p}") for p in ("node.resources", "node.mounterResources", "operator.resources",
                                               "controller.resources"))]
    assert not missing, f"docs/configuration.md lacks {missing}"
    attributes = [*STORE_ATTRIBUTES, *AUTH_ATTRIBUTES, *KNOBS, *crd.SPEC_SCHEMA["properties"]]
    assert not [a for a in attributes if f"`{a}" not in doc]
