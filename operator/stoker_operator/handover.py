"""What the operator hands the node agents for one DatasetCache: its volume and credentials, in a Secret
of the release namespace that only the operator writes.

Node agents read Secrets of the release namespace only (never a tenant's), and they take nothing that
matters from a DatasetCache's status, which every node agent may patch: the handover's name is derived
from the DatasetCache's namespace and name, and the Secret says which DatasetCache it belongs to.
The operator deletes it when the DatasetCache is deleted (after the nodes released their caches).
"""

from __future__ import annotations

import json
import secrets as secrets_module
from dataclasses import dataclass

from csi.attributes import SECRET_KEYS, AttributeProblem, parse_secrets

from .failures import OperatorError
from .nodes import cache_id
from .source import VolumeRef

OWNER_ANNOTATION = "stoker.dev/datasetcache"
LABELS = {"app.kubernetes.io/managed-by": "stoker-operator", "stoker.dev/handover": "true"}
VOLUME_KEY = "volume"
PEER_KEY = "peerKey"  # a distributed cache's key: its nodes sign and check their block requests with it


class HandoverProblem(OperatorError, ValueError):
    """The handover Secret is missing, belongs to another DatasetCache, or is malformed."""


def handover_name(namespace: str, name: str) -> str:
    """The Secret of a DatasetCache: the same for the operator and every agent, from the cache's identity."""
    return "stoker-dc-" + cache_id(namespace, name)


def owner(namespace: str, name: str) -> str:
    return f"{namespace}/{name}"


def new_peer_key() -> str:
    """A distributed cache's own key (256 bits): a node of another cache, another tenant's included, cannot
    read its blocks."""
    return secrets_module.token_hex(32)


def secret_data(ref: VolumeRef, secrets: dict[str, str], peer_key: str | None = None) -> dict[str, str]:
    """The handover's content: the volume, the credentials under their canonical keys only, and a
    distributed cache's peer key."""
    data = {VOLUME_KEY: json.dumps({"id": ref.volume_id, "attributes": ref.attributes}, sort_keys=True)}
    if peer_key:
        data[PEER_KEY] = peer_key
    creds = parse_secrets(secrets)
    if creds is not None:
        data["accessKeyId"], data["secretAccessKey"] = creds.access_key_id, creds.secret_access_key
        if creds.session_token:
            data["sessionToken"] = creds.session_token
    return data


@dataclass(frozen=True)
class Handover:
    volume_id: str
    attributes: dict[str, str]
    secrets: dict[str, str]
    peer_key: str | None = None  # a distributed cache's key (never logged)


def read_handover(cache_namespace: str, cache_name: str, data: dict[str, str], annotations: dict[str, str]) -> Handover:
    """Check a handover Secret belongs to this DatasetCache and take the volume and credentials from it."""
    if annotations.get(OWNER_ANNOTATION) != owner(cache_namespace, cache_name):
        raise HandoverProblem(f"the handover Secret is not the one of {owner(cache_namespace, cache_name)}")
    try:
        volume = json.loads(data[VOLUME_KEY])
        volume_id, attributes = str(volume["id"]), {str(k): str(v) for k, v in volume["attributes"].items()}
    except (KeyError, ValueError, TypeError, AttributeError):
        raise HandoverProblem("the handover Secret has no valid volume") from None
    secrets = {k: v for k, v in data.items() if k in SECRET_KEYS}
    try:
        parse_secrets(secrets)
    except AttributeProblem as exc:
        raise HandoverProblem(f"the handover Secret: {exc}") from None
    peer_key = data.get(PEER_KEY) or None
    if peer_key is not None:
        if len(peer_key) < 32:
            raise HandoverProblem("the handover Secret's peer key is too short")
        try:
            bytes.fromhex(peer_key)  # as the agent decodes it
        except ValueError:
            raise HandoverProblem("the handover Secret's peer key is not hexadecimal (the operator writes 64 hex "
                                  "digits)") from None
    return Handover(volume_id, attributes, secrets, peer_key)
