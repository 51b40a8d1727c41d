"""Kubernetes RBAC authorization over a set of rendered objects, by the API server's own rules
(k8s.io/kubernetes pkg/apis/rbac/v1 evaluation helpers and pkg/registry/rbac/validation):

- A ClusterRoleBinding grants its ClusterRole's rules everywhere: cluster-scoped requests and every
  namespace. A RoleBinding grants its Role's (or a ClusterRole's) rules in its own namespace only,
  and never for cluster-scoped requests.
- A subject matches a service account by kind ServiceAccount + name + namespace, or through the
  groups every service account has: system:serviceaccounts, system:serviceaccounts:<ns>,
  system:authenticated.
- A rule matches when its verbs hold the verb or "*", its apiGroups the group or "*", its resources
  "*", the resource (with "/subresource" if one is asked for), or "*/subresource"; and its
  resourceNames are empty or hold the name (a list or a create carries no name).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    verb: str
    group: str
    resource: str
    namespace: str | None = None  # None: a cluster-scoped object (or a list across all namespaces)
    name: str = ""
    subresource: str = ""


def _groups(namespace: str) -> set[str]:
    return {"system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"}


def _subject_matches(subject: dict, account: str, namespace: str) -> bool:
    kind = subject.get("kind")
    if kind == "ServiceAccount":
        return subject.get("name") == account and subject.get("namespace") == namespace
    if kind == "Group":
        return subject.get("name") in _groups(namespace)
    if kind == "User":
        return subject.get("name") == f"system:serviceaccount:{namespace}:{account}"
    return False


def _rule_matches(rule: dict, request: Request) -> bool:
    verbs, groups = rule.get("verbs") or [], rule.get("apiGroups") or []
    if "*" not in verbs and request.verb not in verbs:
        return False
    if "*" not in groups and request.group not in groups:
        return False
    combined = request.resource + (f"/{request.subresource}" if request.subresource else "")
    resource_ok = False
    for allowed in rule.get("resources") or []:
        if allowed in ("*", combined):
            resource_ok = True
        elif request.subresource and allowed == f"*/{request.subresource}":
            resource_ok = True
    if not resource_ok:
        return False
    names = rule.get("resourceNames") or []
    return not names or request.name in names


class Authorizer:
    def __init__(self, objects: list[dict]):
        self.objects = objects
        self.cluster_roles = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ClusterRole"}
        self.roles = {(o["metadata"]["namespace"], o["metadata"]["name"]): o for o in objects if o["kind"] == "Role"}

    def _role_rules(self, ref: dict, namespace: str | None) -> list[dict]:
        if ref.get("kind") == "ClusterRole":
            role = self.cluster_roles.get(ref["name"])
        else:
            role = self.roles.get((namespace, ref["name"]))
        return list((role or {}).get("rules") or [])

    def rules_for(self, account: str, namespace: str, request_namespace: str | None) -> list[dict]:
        """Every rule that applies to the account for a request in `request_namespace` (None: cluster-wide)."""
        rules = []
        for binding in self.objects:
            subjects = binding.get("subjects") or []
            if not any(_subject_matches(s, account, namespace) for s in subjects):
                continue
            if binding["kind"] == "ClusterRoleBinding":
                rules += self._role_rules(binding["roleRef"], None)
            elif binding["kind"] == "RoleBinding":
                where = binding["metadata"]["namespace"]
                if request_namespace == where:
                    rules += self._role_rules(binding["roleRef"], where)
        return rules

    def allowed(self, account: str, namespace: str, request: Request) -> bool:
        """May the service account `namespace/account` make this request?"""
        return any(_rule_matches(rule, request) for rule in self.rules_for(account, namespace, request.namespace))
