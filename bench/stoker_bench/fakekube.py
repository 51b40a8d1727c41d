"""A small in-memory Kubernetes API server over real HTTP, for operator and agent tests and for the
operator's scale benchmark (`stoker bench --operator`).

Serves discovery, get/list/watch/create/patch (merge and JSON patch)/delete for the resources the
operator touches, with resourceVersions, label selectors, the status subresource, finalizers and
deletionTimestamp. Clients (kopf's aiohttp client, the kubernetes package) reach it through a
kubeconfig written by `kubeconfig()`. Not a conformance server: just the boundary, faithfully.
"""

from __future__ import annotations

import bisect
import typing
import copy
import json
import threading
import time
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import yaml

from .fixture import wait_for


CORE = [  # (plural, kind, namespaced, has_status)
    ("pods", "Pod", True, True),
    ("nodes", "Node", False, True),
    ("persistentvolumeclaims", "PersistentVolumeClaim", True, True),
    ("persistentvolumes", "PersistentVolume", False, True),
    ("secrets", "Secret", True, False),
    ("serviceaccounts", "ServiceAccount", True, False),
    ("events", "Event", True, False),
    ("namespaces", "Namespace", False, True),
]
GROUPS = {  # group -> version -> [(plural, kind, namespaced, has_status)]
    "stoker.dev": {"v1alpha1": [("datasetcaches", "DatasetCache", True, True),
                                ("datasetcachenodes", "DatasetCacheNode", True, True)]},
    "events.k8s.io": {"v1": [("events", "Event", True, False)]},
}


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_patch(target, patch):
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


class PatchTestFailed(Exception):
    pass


def json_patch(doc, ops):
    """RFC 6902 (add, remove, replace, test)."""
    doc = copy.deepcopy(doc)
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent = doc
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent.setdefault(part, {})
        last = parts[-1] if parts else None
        kind = op["op"]
        if kind == "test":
            current = parent[int(last)] if isinstance(parent, list) else parent.get(last)
            if current != op.get("value"):
                raise PatchTestFailed(op["path"])
        elif kind in ("add", "replace"):
            if isinstance(parent, list):
                if last == "-":
                    parent.append(op["value"])
                elif kind == "add":
                    parent.insert(int(last), op["value"])
                else:
                    parent[int(last)] = op["value"]
            else:
                parent[last] = op["value"]
        elif kind == "remove":
            if isinstance(parent, list):
                parent.pop(int(last))
            else:
                parent.pop(last, None)
    return doc


def prune(value, schema: dict, path: str, pruned: list[str]):
    """The API server's pruning of custom resources (structural schemas): fields the schema does not
    declare are dropped, unless x-kubernetes-preserve-unknown-fields; `pruned` collects their paths."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return value
    if isinstance(value, dict):
        properties, extra = schema.get("properties"), schema.get("additionalProperties")
        out = {}
        for key, item in value.items():
            if properties is not None and key in properties:
                out[key] = prune(item, properties[key], f"{path}.{key}", pruned)
            elif isinstance(extra, dict):
                out[key] = prune(item, extra, f"{path}.{key}", pruned)
            elif properties is None and extra is None and schema.get("type") != "object":
                out[key] = item
            else:
                pruned.append(f"{path}.{key}")
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [prune(item, schema["items"], f"{path}[]", pruned) for item in value]
    return value


def _selector_matches(selector: str, labels: dict) -> bool:
    for clause in filter(None, (selector or "").split(",")):
        if "!=" in clause:
            k, v = clause.split("!=", 1)
            if labels.get(k) == v:
                return False
        elif "=" in clause:
            k, v = clause.split("=", 1)
            if labels.get(k.rstrip("=")) != v.lstrip("="):
                return False
        elif labels.get(clause) is None:
            return False
    return True


class FakeKube:
    def __init__(self):
        self._lock = threading.Condition()
        self._objects: dict[tuple, dict] = {}  # (prefix, plural, namespace, name) -> object
        self._events: dict[tuple, list[tuple[int, tuple, str, dict]]] = {}  # (prefix, plural) -> events
        self._kinds: dict[tuple, dict[tuple, dict]] = {}  # (prefix, plural) -> {key: object}
        self.watches: list[dict] = []  # per watch request: path, labelSelector, events and bytes delivered
        self._rv = 100
        self.requests: list[tuple[str, str]] = []
        self.pruned: list[str] = []  # fields the API server would have dropped (see prune)
        self.schemas: dict[str, dict] = {}  # plural -> openAPIV3Schema of a custom resource
        # Namespaces that do not exist: creating an object in one is refused as the NamespaceLifecycle
        # admission plugin refuses it (404, details.kind "namespaces"); every other namespace exists.
        self.missing_namespaces: set[str] = set()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._closed = False

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._server.shutdown()
        self._server.server_close()

    def kubeconfig(self, path: str) -> str:
        config = {"apiVersion": "v1", "kind": "Config", "current-context": "fake",
                  "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                  "users": [{"name": "fake", "user": {"token": "fake-token"}}],
                  "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}]}
        with open(path, "w") as f:
            yaml.safe_dump(config, f)
        return path

    # ---- direct access for tests

    @staticmethod
    def _prefix(api_version: str) -> str:
        return "/api/v1" if api_version == "v1" else f"/apis/{api_version}"

    def create(self, obj: dict) -> dict:
        plural = self._plural(obj["apiVersion"], obj["kind"])
        key = (self._prefix(obj["apiVersion"]), plural, obj["metadata"].get("namespace"), obj["metadata"]["name"])
        with self._lock:
            return copy.deepcopy(self._store(key, obj, "ADDED"))

    def get(self, api_version: str, plural: str, name: str, namespace: str | None = None) -> dict | None:
        with self._lock:
            obj = self._objects.get((self._prefix(api_version), plural, namespace, name))
            return copy.deepcopy(obj)

    def list(self, api_version: str, plural: str, namespace: str | None = None) -> list[dict]:
        prefix = self._prefix(api_version)
        with self._lock:
            return [copy.deepcopy(o) for (p, pl, ns, _), o in self._objects.items()
                    if p == prefix and pl == plural and (namespace is None or ns == namespace)]

    def patch(self, api_version: str, plural: str, name: str, namespace: str, body: dict, subresource: str = "") -> None:
        """A merge patch over HTTP, as another client (a user, a node agent) would send it."""
        import urllib.request

        path = f"{self._prefix(api_version)}/namespaces/{namespace}/{plural}/{name}" + (f"/{subresource}" if subresource else "")
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="PATCH",
                                         headers={"Content-Type": "application/merge-patch+json"})
        urllib.request.urlopen(request, timeout=10).close()

    def history(self, api_version: str, plural: str, name: str, namespace: str | None = None) -> "typing.List[dict]":
        """Every version of one object, oldest first (what a watch from the beginning delivered)."""
        key = (self._prefix(api_version), plural, namespace, name)
        with self._lock:
            return [copy.deepcopy(o) for _, k, _, o in self._events.get(key[:2], []) if k == key]

    def delete(self, api_version: str, plural: str, name: str, namespace: str | None = None) -> None:
        with self._lock:
            self._delete((self._prefix(api_version), plural, namespace, name))

    wait_for = staticmethod(wait_for)

    # ---- the object store

    @staticmethod
    def _plural(api_version: str, kind: str) -> str:
        table = CORE if api_version == "v1" else GROUPS[api_version.split("/")[0]][api_version.split("/")[1]]
        return next(p for p, k, _, _ in table if k == kind)

    def _store(self, key, obj, event_type) -> dict:
        schema = self.schemas.get(key[1])
        if schema is not None:
            kept = {k: obj[k] for k in ("apiVersion", "kind", "metadata") if k in obj}
            body = prune({k: v for k, v in obj.items() if k not in kept}, schema, key[1], self.pruned)
            obj = {**body, **kept}
        self._rv += 1
        meta = obj.setdefault("metadata", {})
        meta["resourceVersion"] = str(self._rv)
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", _now())
        meta.setdefault("generation", 1)
        if key[2] is not None:
            meta["namespace"] = key[2]
        self._objects[key] = obj
        self._kinds.setdefault(key[:2], {})[key] = obj
        self._events.setdefault(key[:2], []).append((self._rv, key, event_type, copy.deepcopy(obj)))
        self._lock.notify_all()
        return obj

    def _delete(self, key) -> dict | None:
        obj = self._objects.get(key)
        if obj is None:
            return None
        if obj["metadata"].get("finalizers"):
            if not obj["metadata"].get("deletionTimestamp"):
                obj = copy.deepcopy(obj)
                obj["metadata"]["deletionTimestamp"] = _now()
                self._store(key, obj, "MODIFIED")
            return obj
        del self._objects[key]
        del self._kinds[key[:2]][key]
        self._rv += 1
        gone = copy.deepcopy(obj)
        gone["metadata"]["resourceVersion"] = str(self._rv)
        self._events.setdefault(key[:2], []).append((self._rv, key, "DELETED", gone))
        self._lock.notify_all()
        return gone

    # ---- HTTP

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _status(self, code: int, reason: str, message: str, details: dict | None = None) -> None:
                self._send(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason,
                                  "message": message, "code": code, **({"details": details} if details else {})})

            def _body(self):
                length = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(length) or b"null")

            def do_GET(self):
                fake._serve(self, "GET")

            def do_POST(self):
                fake._serve(self, "POST")

            def do_PATCH(self):
                fake._serve(self, "PATCH")

            def do_PUT(self):
                fake._serve(self, "PUT")

            def do_DELETE(self):
                fake._serve(self, "DELETE")

        return Handler

    def _discovery(self, path: str):
        if path == "/api":
            return {"kind": "APIVersions", "versions": ["v1"]}
        if path == "/apis":
            return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
                {"name": g, "versions": [{"groupVersion": f"{g}/{v}", "version": v} for v in vs],
                 "preferredVersion": {"groupVersion": f"{g}/{next(iter(vs))}", "version": next(iter(vs))}}
                for g, vs in GROUPS.items()]}
        table, group_version = None, None
        if path == "/api/v1":
            table, group_version = CORE, "v1"
        else:
            parts = path.strip("/").split("/")
            if len(parts) == 3 and parts[0] == "apis" and parts[2] in GROUPS.get(parts[1], {}):
                table, group_version = GROUPS[parts[1]][parts[2]], f"{parts[1]}/{parts[2]}"
            elif len(parts) == 2 and parts[0] == "apis" and parts[1] in GROUPS:
                g = parts[1]
                v = next(iter(GROUPS[g]))
                return {"kind": "APIGroup", "name": g, "versions": [{"groupVersion": f"{g}/{v}", "version": v}],
                        "preferredVersion": {"groupVersion": f"{g}/{v}", "version": v}}
        if table is None:
            return None
        resources = []
        for plural, kind, namespaced, has_status in table:
            verbs = ["create", "delete", "get", "list", "patch", "update", "watch"]
            resources.append({"name": plural, "singularName": kind.lower(), "namespaced": namespaced,
                              "kind": kind, "verbs": verbs})
            if has_status:
                resources.append({"name": f"{plural}/status", "singularName": "", "namespaced": namespaced,
                                  "kind": kind, "verbs": ["get", "patch", "update"]})
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version,
                "resources": resources}

    def _route(self, path: str):
        """(prefix, plural, namespace, name, subresource) of a resource path, or None."""
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "v1"]:
            prefix, rest = "/api/v1", parts[2:]
        elif parts[0] == "apis" and len(parts) >= 3:
            prefix, rest = f"/apis/{parts[1]}/{parts[2]}", parts[3:]
        else:
            return None
        namespace = None
        if len(rest) >= 3 and rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
        if not rest:
            return None
        plural = rest[0]
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        return prefix, plural, namespace, name, sub

    def _serve(self, h, method: str) -> None:
        url = urlparse(h.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        self.requests.append((method, h.path))
        if method == "GET":
            found = self._discovery(url.path)
            if found is not None:
                return h._send(200, found)
        route = self._route(url.path)
        if route is None:
            return h._status(404, "NotFound", f"no route {url.path}")
        prefix, plural, namespace, name, sub = route
        key = (prefix, plural, namespace, name)
        if method == "GET" and name is None:
            if query.get("watch") in ("1", "t", "T", "TRUE", "true", "True"):  # Go strconv.ParseBool
                return self._watch(h, prefix, plural, namespace, query)
            return self._list(h, prefix, plural, namespace, query)
        with self._lock:
            if method == "GET":
                obj = self._objects.get(key)
                return h._send(200, obj) if obj else h._status(404, "NotFound", f"{plural} {name!r} not found")
            if method == "POST":
                body = h._body()
                body.setdefault("metadata", {})
                if not body["metadata"].get("name") and body["metadata"].get("generateName"):
                    body["metadata"]["name"] = body["metadata"]["generateName"] + uuid.uuid4().hex[:5]
                key = (prefix, plural, namespace, body["metadata"]["name"])
                if namespace in self.missing_namespaces:
                    return h._status(404, "NotFound", f'namespaces "{namespace}" not found',
                                     {"name": namespace, "kind": "namespaces"})
                if key in self._objects:
                    return h._status(409, "AlreadyExists", f"{plural} {key[3]!r} already exists")
                if query.get("dryRun") == "All":  # admitted and validated, never stored
                    return h._send(201, dict(body, metadata=dict(body["metadata"], namespace=namespace)))
                return h._send(201, self._store(key, body, "ADDED"))
            if method == "DELETE":
                gone = self._delete(key)
                return h._send(200, gone) if gone else h._status(404, "NotFound", f"{plural} {name!r} not found")
            obj = self._objects.get(key)
            if obj is None:
                return h._status(404, "NotFound", f"{plural} {name!r} not found")
            body = h._body()
            if method == "PUT":
                new = body
            elif "json-patch" in (h.headers.get("Content-Type") or ""):
                try:
                    new = json_patch(obj, body)
                except PatchTestFailed as exc:
                    return h._status(422, "Invalid", f"test failed at {exc}")
            else:
                new = merge_patch(obj, body)
            has_status = any(t[0] == plural and t[3] for t in self._table(prefix))
            if sub == "status":  # only status changes through /status ...
                new = dict(obj, status=new["status"]) if new.get("status") is not None else \
                    {k: v for k, v in obj.items() if k != "status"}
            elif sub is None and has_status:  # ... and never through the main resource
                new = {k: v for k, v in new.items() if k != "status"}
                if "status" in obj:
                    new["status"] = obj["status"]
                if new.get("spec") != obj.get("spec"):
                    new.setdefault("metadata", {})["generation"] = obj["metadata"].get("generation", 1) + 1
            if new == obj:
                return h._send(200, obj)
            new["metadata"]["resourceVersion"] = obj["metadata"]["resourceVersion"]
            if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
                self._objects[key] = new
                return h._send(200, self._delete(key))
            return h._send(200, self._store(key, new, "MODIFIED"))

    def _table(self, prefix: str):
        if prefix == "/api/v1":
            return CORE
        _, _, group, version = prefix.split("/")
        return GROUPS[group][version]

    def _matches(self, key, prefix, plural, namespace, query) -> bool:
        obj_prefix, obj_plural, obj_ns, _ = key
        return obj_prefix == prefix and obj_plural == plural and (namespace is None or obj_ns == namespace)

    def _list(self, h, prefix, plural, namespace, query) -> None:
        selector = query.get("labelSelector", "")
        with self._lock:
            items = [o for k, o in self._kinds.get((prefix, plural), {}).items()
                     if self._matches(k, prefix, plural, namespace, query)
                     and _selector_matches(selector, o["metadata"].get("labels") or {})]
            rv = str(self._rv)
        h._send(200, {"kind": "List", "apiVersion": "v1", "metadata": {"resourceVersion": rv}, "items": items})

    def _watch(self, h, prefix, plural, namespace, query) -> None:
        since = int(query.get("resourceVersion") or 0)
        deadline = time.monotonic() + min(float(query.get("timeoutSeconds") or 30), 30)
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        selector = query.get("labelSelector", "")
        stats = {"path": urlparse(h.path).path, "labelSelector": selector, "events": 0, "bytes": 0}
        with self._lock:
            self.watches.append(stats)
        events = self._events.setdefault((prefix, plural), [])
        try:
            while True:
                with self._lock:
                    start = bisect.bisect_right(events, since, key=lambda e: e[0])
                    batch = [(rv, t, o) for rv, k, t, o in events[start:]
                             if self._matches(k, prefix, plural, namespace, query)
                             and _selector_matches(selector, o["metadata"].get("labels") or {})]
                    if not batch:
                        since = events[-1][0] if events else since
                        remaining = deadline - time.monotonic()
                        if remaining <= 0 or self._closed:
                            break
                        self._lock.wait(min(remaining, 0.5))
                        continue
                for rv, event_type, obj in batch:
                    since = rv
                    line = json.dumps({"type": event_type, "object": obj}).encode() + b"\n"
                    h.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                    stats["events"] += 1
                    stats["bytes"] += len(line)
                h.wfile.flush()
            h.wfile.write(b"0\r\n\r\n")
            h.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass
