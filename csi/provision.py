"""Dynamic provisioning: a volume is a prefix in a bucket, recorded by a small marker object.

CreateVolume(name) makes `<prefix>/<name>/` in the StorageClass's bucket and writes
`<prefix>/<name>/.stoker-volume.json` (name, capacity, delete policy). The volume id is
`<bucket>/<prefix>/<name>/`. DeleteVolume follows the policy recorded in the marker:
`Retain` (default) removes only the marker and keeps the data; `Delete` removes every object
under the volume's prefix. A prefix without our marker is never touched.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

from fusecore.config import StoreConfig
from fusecore.store import S3Admin

from .attributes import CONTROLLER_SECRET_KEYS, AttributeProblem, parse_secrets, parse_volume_context
from .errors import BadRequest, Conflict

MARKER = ".stoker-volume.json"
POLICIES = ("Retain", "Delete")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
_CONTROLLER_ONLY = ("onDelete",)


@dataclass(frozen=True)
class ProvisionedVolume:
    volume_id: str
    capacity_bytes: int
    context: dict[str, str]


def split_volume_id(volume_id: str) -> tuple[str, str] | None:
    """(bucket, prefix) of a provisioned volume's id, or None if the id is not of that form."""
    bucket, _, prefix = volume_id.partition("/")
    if not bucket or not prefix.endswith("/") or "//" in prefix:
        return None
    return bucket, prefix


def _admin(bucket: str, endpoint: str | None, region: str | None, secrets: dict[str, str]) -> S3Admin:
    creds = parse_secrets({k: v for k, v in secrets.items() if k not in ("endpointUrl", "region")},
                          allowed=CONTROLLER_SECRET_KEYS)
    return S3Admin(StoreConfig(bucket=bucket, endpoint_url=endpoint or secrets.get("endpointUrl") or None,
                               region=region or secrets.get("region") or None, credentials=creds))


def create_volume(name: str, capacity: int, parameters: dict[str, str], secrets: dict[str, str]) -> ProvisionedVolume:
    if not _NAME_RE.match(name):
        raise BadRequest(f"volume name {name!r} is not usable as a prefix (letters, digits, . _ -)")
    unknown_secret = sorted(set(secrets) - CONTROLLER_SECRET_KEYS)
    if unknown_secret:
        raise AttributeProblem(f"unknown secret key {unknown_secret[0]!r}")
    policy = parameters.get("onDelete", "Retain")
    if policy not in POLICIES:
        raise AttributeProblem(f"StorageClass parameter 'onDelete': expected Retain or Delete, got {policy!r}")
    base = parameters.get("prefix", "").strip("/")
    context = {k: v for k, v in parameters.items() if k not in _CONTROLLER_ONLY and not k.startswith("csi.storage.k8s.io/")}
    context["prefix"] = f"{base}/{name}/" if base else f"{name}/"
    spec = parse_volume_context(context)  # validates every attribute the node will use
    volume_id = f"{spec.bucket}/{spec.prefix}"
    admin = _admin(spec.bucket, spec.endpoint_url, spec.region, secrets)
    existing = admin.get_small(spec.prefix + MARKER)
    if existing is not None:
        recorded = json.loads(existing)
        if recorded.get("capacity_bytes") != capacity or recorded.get("on_delete") != policy:
            raise Conflict(f"volume {name!r} exists with capacity {recorded.get('capacity_bytes')} and policy "
                           f"{recorded.get('on_delete')}; asked for {capacity} and {policy}")
    else:
        marker = {"name": name, "capacity_bytes": capacity, "on_delete": policy, "created": time.time()}
        admin.put_small(spec.prefix + MARKER, json.dumps(marker).encode())
    return ProvisionedVolume(volume_id, capacity, context)


def delete_volume(volume_id: str, secrets: dict[str, str]) -> int:
    """Apply the volume's recorded policy; returns how many objects were deleted."""
    parts = split_volume_id(volume_id)
    if parts is None:
        return 0  # not an id this controller made: nothing of ours to delete
    bucket, prefix = parts
    admin = _admin(bucket, None, None, secrets)
    marker = admin.get_small(prefix + MARKER)
    if marker is None:
        return 0  # already deleted (or never ours)
    if json.loads(marker).get("on_delete") == "Delete":
        return admin.delete_prefix(prefix)
    return admin.delete_keys([prefix + MARKER])  # Retain: the data stays, the volume is forgotten
