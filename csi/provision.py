"""Dynamic provisioning: a volume is a prefix in a bucket, recorded by a small marker object.

CreateVolume(name) makes `<prefix>/<name>/` in the StorageClass's bucket and writes
`<prefix>/<name>/.stoker-volume.json` (name, capacity, delete policy). The volume id carries the
whole store location (`stoker1:` and a query string of bucket, prefix, endpoint and region), because
DeleteVolume gets nothing but the id and the provisioner secret, and that secret holds credentials
only (the same Secret can serve node staging). Ids of the older form `<bucket>/<prefix>/` still
delete, with `endpointUrl`/`region` from the secret. DeleteVolume follows the policy recorded in the marker:
`Retain` (default) removes only the marker and keeps the data; `Delete` removes every object
under the volume's prefix. A prefix without our marker is never touched.
"""

from __future__ import annotations

import json
import re
import time
import urllib.parse
from dataclasses import dataclass

from fusecore.config import StoreConfig
from csi.admin import S3Admin

from .attributes import AttributeProblem, VolumeSpec, parse_secrets, parse_volume_context
from .errors import BadRequest, Conflict

MARKER = ".stoker-volume.json"
ID_SCHEME = "stoker1:"
POLICIES = ("Retain", "Delete")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
_CONTROLLER_ONLY = ("onDelete",)


@dataclass(frozen=True)
class ProvisionedVolume:
    volume_id: str
    capacity_bytes: int
    context: dict[str, str]


@dataclass(frozen=True)
class Location:
    """Where a provisioned volume lives (what DeleteVolume needs)."""

    bucket: str
    prefix: str
    endpoint_url: str | None = None
    region: str | None = None


def volume_id_for(spec: VolumeSpec) -> str:
    fields = {"b": spec.bucket, "p": spec.prefix, "e": spec.endpoint_url or "", "r": spec.region or ""}
    return ID_SCHEME + urllib.parse.urlencode({k: v for k, v in fields.items() if v})


def split_volume_id(volume_id: str) -> Location | None:
    """The location in a provisioned volume's id, or None if the id is not one this controller made."""
    if volume_id.startswith(ID_SCHEME):
        fields = dict(urllib.parse.parse_qsl(volume_id[len(ID_SCHEME):]))
        bucket, prefix = fields.get("b", ""), fields.get("p", "")
        if not bucket or not prefix.endswith("/") or "//" in prefix:
            return None
        return Location(bucket, prefix, fields.get("e") or None, fields.get("r") or None)
    bucket, _, prefix = volume_id.partition("/")  # the older form
    if not bucket or not prefix.endswith("/") or "//" in prefix:
        return None
    return Location(bucket, prefix)


def _admin(location: Location, secrets: dict[str, str]) -> S3Admin:
    creds = parse_secrets(secrets)
    return S3Admin(StoreConfig(bucket=location.bucket, endpoint_url=location.endpoint_url or
                               secrets.get("endpointUrl") or None,
                               region=location.region or secrets.get("region") or None, credentials=creds))


def create_volume(name: str, capacity: int, parameters: dict[str, str], secrets: dict[str, str]) -> ProvisionedVolume:
    if not _NAME_RE.match(name):
        raise BadRequest(f"volume name {name!r} is not usable as a prefix (letters, digits, . _ -)")
    policy = parameters.get("onDelete", "Retain")
    if policy not in POLICIES:
        raise AttributeProblem(f"StorageClass parameter 'onDelete': expected Retain or Delete, got {policy!r}")
    base = parameters.get("prefix", "").strip("/")
    context = {k: v for k, v in parameters.items() if k not in _CONTROLLER_ONLY and not k.startswith("csi.storage.k8s.io/")}
    context["prefix"] = f"{base}/{name}/" if base else f"{name}/"
    spec = parse_volume_context(context)  # validates every attribute the node will use
    volume_id = volume_id_for(spec)
    admin = _admin(Location(spec.bucket, spec.prefix, spec.endpoint_url, spec.region), secrets)
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
    location = split_volume_id(volume_id)
    if location is None:
        return 0  # not an id this controller made: nothing of ours to delete
    prefix = location.prefix
    admin = _admin(location, secrets)
    marker = admin.get_small(prefix + MARKER)
    if marker is None:
        return 0  # already deleted (or never ours)
    if json.loads(marker).get("on_delete") == "Delete":
        return admin.delete_prefix(prefix)
    return admin.delete_keys([prefix + MARKER])  # Retain: the data stays, the volume is forgotten
