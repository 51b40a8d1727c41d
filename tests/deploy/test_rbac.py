"""What each of the chart's service accounts may do, evaluated from the rendered RBAC objects by the API
server's matching rules (tests/support/rbac.py), for the default values and a namespaced operator."""

from __future__ import annotations

import pytest

from tests.support.rbac import Authorizer, Request

from .test_chart import render

RELEASE_NS = "stoker-system"
NODE, MOUNTER, OPERATOR, CONTROLLER = "stoker-node", "stoker-mounter", "stoker-operator", "stoker-controller"


def authorizer(values: dict) -> Authorizer:
    return Authorizer(render(values))


@pytest.fixture(scope="module")
def defaults() -> Authorizer:
    return authorizer({})


@pytest.fixture(scope="module")
def namespaced() -> Authorizer:
    return authorizer({"operator": {"replicas": 2, "namespaces": ["ml", "research"]}})


def may(auth: Authorizer, account: str, verb: str, resource: str, namespace: str | None, *, group: str = "",
        subresource: str = "", name: str = "") -> bool:
    return auth.allowed(account, RELEASE_NS, Request(verb, group, resource, namespace, name, subresource))


def test_the_evaluator_follows_the_api_servers_rules():
    """A ClusterRole bound by a RoleBinding applies in that namespace only; */status matches any status."""
    role = {"kind": "ClusterRole", "metadata": {"name": "r"},
            "rules": [{"apiGroups": [""], "resources": ["*/status", "pods"], "verbs": ["get"],
                       "resourceNames": ["only-this"]}]}
    binding = {"kind": "RoleBinding", "metadata": {"name": "b", "namespace": "a"},
               "roleRef": {"kind": "ClusterRole", "name": "r"},
               "subjects": [{"kind": "Group", "name": "system:serviceaccounts:x"}]}
    auth = Authorizer([role, binding])
    assert auth.allowed("sa", "x", Request("get", "", "pods", "a", "only-this"))
    assert auth.allowed("sa", "x", Request("get", "", "nodes", "a", "only-this", "status"))
    assert not auth.allowed("sa", "x", Request("get", "", "pods", "a", "other"))
    assert not auth.allowed("sa", "x", Request("get", "", "pods", "b", "only-this"))
    assert not auth.allowed("sa", "x", Request("get", "", "pods", None, "only-this"))
    assert not auth.allowed("sa", "y", Request("get", "", "pods", "a", "only-this"))
    assert not auth.allowed("sa", "x", Request("list", "", "pods", "a"))


def test_node_plugin_reads_no_tenant_secret(defaults):
    for namespace in ("ml", "kube-system", "default", None):
        for verb in ("get", "list", "watch"):
            assert not may(defaults, NODE, verb, "secrets", namespace), (verb, namespace)
    assert may(defaults, NODE, "get", "secrets", RELEASE_NS)  # the operator's handovers
    assert not may(defaults, NODE, "list", "secrets", RELEASE_NS)
    assert not may(defaults, NODE, "create", "secrets", RELEASE_NS)


def test_node_plugin_works_on_its_plans_in_the_release_namespace_only(defaults):
    """The warm agent follows and reports on DatasetCacheNodes of the release namespace; it reads no
    tenant's DatasetCache and can neither create nor delete a plan."""
    assert may(defaults, NODE, "watch", "datasetcachenodes", RELEASE_NS, group="stoker.dev")
    assert may(defaults, NODE, "patch", "datasetcachenodes", RELEASE_NS, group="stoker.dev", subresource="status")
    assert may(defaults, NODE, "patch", "datasetcachenodes", RELEASE_NS, group="stoker.dev")  # its finalizer
    for verb in ("create", "delete", "update"):
        assert not may(defaults, NODE, verb, "datasetcachenodes", RELEASE_NS, group="stoker.dev"), verb
    for namespace in ("ml", None):
        for verb in ("get", "list", "watch", "patch"):
            assert not may(defaults, NODE, verb, "datasetcachenodes", namespace, group="stoker.dev"), (verb, namespace)
            assert not may(defaults, NODE, verb, "datasetcaches", namespace, group="stoker.dev"), (verb, namespace)
        assert not may(defaults, NODE, "patch", "datasetcaches", namespace, group="stoker.dev", subresource="status")
    assert may(defaults, NODE, "get", "serviceaccounts", "ml")  # the role annotation of a pod's account
    assert not may(defaults, NODE, "create", "serviceaccounts", "ml", subresource="token")
    assert not may(defaults, NODE, "list", "pods", None)


def test_node_plugin_without_service_account_roles_reads_no_service_account():
    auth = authorizer({"node": {"serviceAccountRoles": False}})
    assert not may(auth, NODE, "get", "serviceaccounts", "ml")


def test_mounter_may_do_nothing(defaults):
    for namespace in ("ml", RELEASE_NS, None):
        assert defaults.rules_for(MOUNTER, RELEASE_NS, namespace) == []


def test_cluster_wide_operator(defaults):
    assert may(defaults, OPERATOR, "get", "secrets", "ml")  # a DatasetCache's source secret
    assert not may(defaults, OPERATOR, "list", "secrets", "ml")
    assert not may(defaults, OPERATOR, "create", "secrets", "ml")
    assert may(defaults, OPERATOR, "create", "secrets", RELEASE_NS)  # handovers
    assert may(defaults, OPERATOR, "delete", "secrets", RELEASE_NS)
    assert may(defaults, OPERATOR, "create", "datasetcachenodes", RELEASE_NS, group="stoker.dev")  # plans per node
    assert may(defaults, OPERATOR, "watch", "datasetcachenodes", None, group="stoker.dev")  # kopf's index
    assert not may(defaults, OPERATOR, "create", "datasetcachenodes", "ml", group="stoker.dev")
    assert not may(defaults, OPERATOR, "patch", "datasetcachenodes", RELEASE_NS, group="stoker.dev",
                   subresource="status")  # reports are the nodes' own
    assert not may(defaults, OPERATOR, "delete", "secrets", "ml")
    assert may(defaults, OPERATOR, "list", "pods", None)
    assert may(defaults, OPERATOR, "list", "nodes", None)
    assert not may(defaults, OPERATOR, "patch", "nodes", None)
    assert not may(defaults, OPERATOR, "delete", "pods", "ml")


def test_namespaced_operator_reaches_its_namespaces_only(namespaced):
    for namespace in ("ml", "research"):
        assert may(namespaced, OPERATOR, "get", "secrets", namespace)
        assert may(namespaced, OPERATOR, "patch", "pods", namespace)
        assert may(namespaced, OPERATOR, "watch", "datasetcaches", namespace, group="stoker.dev")
        assert may(namespaced, OPERATOR, "patch", "kopfpeerings", namespace, group="kopf.dev")
    for namespace in ("finance", "kube-system", None):
        assert not may(namespaced, OPERATOR, "get", "secrets", namespace), namespace
        assert not may(namespaced, OPERATOR, "list", "pods", namespace), namespace
        assert not may(namespaced, OPERATOR, "patch", "datasetcaches", namespace, group="stoker.dev"), namespace
        assert not may(namespaced, OPERATOR, "get", "persistentvolumeclaims", namespace), namespace
    assert not may(namespaced, OPERATOR, "patch", "clusterkopfpeerings", None, group="kopf.dev")
    assert may(namespaced, OPERATOR, "create", "secrets", RELEASE_NS)  # handovers
    assert may(namespaced, OPERATOR, "create", "datasetcachenodes", RELEASE_NS, group="stoker.dev")
    assert may(namespaced, OPERATOR, "watch", "datasetcachenodes", RELEASE_NS, group="stoker.dev")
    assert may(namespaced, OPERATOR, "watch", "datasetcaches", RELEASE_NS, group="stoker.dev")
    assert not may(namespaced, OPERATOR, "watch", "datasetcachenodes", None, group="stoker.dev")
    assert may(namespaced, OPERATOR, "list", "nodes", None) and may(namespaced, OPERATOR, "get", "persistentvolumes", None)


@pytest.mark.parametrize("values", [{}, {"operator": {"replicas": 2, "namespaces": ["ml"]}},
                                    {"controller": {"enabled": True}}])
def test_no_rule_is_a_wildcard_or_an_escalation(values):
    for obj in render(values):
        for rule in obj.get("rules") or [] if obj["kind"] in ("Role", "ClusterRole") else []:
            for key in ("verbs", "resources", "apiGroups"):
                assert "*" not in (rule.get(key) or []), (obj["metadata"]["name"], rule)
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"]), rule
            assert not {"roles", "clusterroles", "rolebindings", "clusterrolebindings"} & set(rule["resources"]), rule


def test_controller_is_absent_unless_enabled(defaults):
    assert not may(defaults, CONTROLLER, "create", "persistentvolumes", None)
    auth = authorizer({"controller": {"enabled": True}})
    assert may(auth, CONTROLLER, "create", "persistentvolumes", None)
