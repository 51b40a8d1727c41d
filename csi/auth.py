"""Who a volume's mount authenticates as: a Secret's keys, the pod's service account, or (only where
the cluster admin allowed it) the node's own identity. Pure decisions over CSI request data.

- `secret` (the default when the volume has a secret): keys from nodeStageSecretRef /
  nodePublishSecretRef.
- `pod`: the pod's service-account token, which kubelet hands to NodePublishVolume when the CSIDriver
  asks for it (tokenRequests), exchanged with STS AssumeRoleWithWebIdentity for the role in the
  `roleArn` attribute or the service account's `eks.amazonaws.com/role-arn` annotation.
- `node`: whatever the node's mounter has (instance role, its IRSA): refused unless the plugin runs
  with --allow-node-credentials and the volume asks for it by name.
A volume that names none of these and has no secret is refused: no mount ever falls back to the node.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Callable

from fusecore.config import Credentials, Identity, WebIdentity

from .attributes import TOKENS_KEY, AttributeProblem, VolumeSpec, parse_secrets

POD_NAMESPACE_KEY = "csi.storage.k8s.io/pod.namespace"
SERVICE_ACCOUNT_KEY = "csi.storage.k8s.io/serviceAccount.name"
ROLE_ANNOTATION = "eks.amazonaws.com/role-arn"
DEFAULT_AUDIENCE = "sts.amazonaws.com"


class MissingCredentials(AttributeProblem):
    """The volume has no usable credentials (the message names what is missing)."""


RoleLookup = Callable[[str, str], "str | None"]  # (namespace, service account) -> role ARN from its annotation


@dataclass(frozen=True)
class AuthPolicy:
    """What the cluster admin allowed this node plugin (its flags)."""

    allow_node_credentials: bool = False
    audience: str = DEFAULT_AUDIENCE
    role_lookup: RoleLookup | None = None


@dataclass(frozen=True)
class Resolved:
    """A volume's identity for one call: `identity` None means the node's own (only for `node`);
    `who` names it without secrets, to compare mounts and callers; `pending`: a pod-identity volume
    staged before any pod brought its token."""

    source: str
    identity: Identity | None
    who: str
    pending: bool = False


def source_of(spec: VolumeSpec, secrets: dict[str, str]) -> str:
    if spec.auth:
        return spec.auth
    if secrets:
        return "secret"
    raise MissingCredentials(
        "the volume has no credentials: give it a secret (nodeStageSecretRef or nodePublishSecretRef with "
        "accessKeyId and secretAccessKey), or set the volume attribute authenticationSource to 'pod' (the pod's "
        "service account and an IAM role) or, where the cluster admin allowed it, 'node'")


def resolve(spec: VolumeSpec, context: dict[str, str], secrets: dict[str, str], policy: AuthPolicy) -> Resolved:
    """The identity this call brings for the volume; raises MissingCredentials naming what is missing."""
    source = source_of(spec, secrets)
    if source == "secret":
        creds = parse_secrets(_without_tokens(secrets))
        if creds is None:
            raise MissingCredentials("authenticationSource is 'secret' but the volume has no secret "
                                     "(nodeStageSecretRef or nodePublishSecretRef)")
        return Resolved("secret", creds, fingerprint(creds))
    if source == "node":
        if not policy.allow_node_credentials:
            raise MissingCredentials("authenticationSource 'node' is disabled on this cluster: the node's own "
                                     "credentials serve no volume unless the admin sets node.allowNodeCredentials")
        return Resolved("node", None, "node")
    return _pod_identity(spec, context, secrets, policy)


def _pod_identity(spec: VolumeSpec, context: dict[str, str], secrets: dict[str, str], policy: AuthPolicy) -> Resolved:
    namespace, account = context.get(POD_NAMESPACE_KEY, ""), context.get(SERVICE_ACCOUNT_KEY, "")
    raw = context.get(TOKENS_KEY) or secrets.get(TOKENS_KEY)
    if not raw:
        return Resolved("pod", None, "", pending=True)  # NodeStageVolume: tokens come with NodePublishVolume
    if not namespace or not account:
        raise MissingCredentials("authenticationSource 'pod' needs the pod's namespace and service account "
                                 "(the CSIDriver's podInfoOnMount)")
    token = _token_for(raw, policy.audience)
    role = spec.role_arn or (policy.role_lookup(namespace, account) if policy.role_lookup else None)
    if not role:
        raise MissingCredentials(f"authenticationSource 'pod': no IAM role for service account {namespace}/{account}: "
                                 f"set the volume attribute roleArn or annotate the service account with {ROLE_ANNOTATION}")
    session = f"stoker-{namespace}-{account}"[:64]
    identity = WebIdentity(role, token, session_name=session, sts_endpoint_url=spec.sts_endpoint_url,
                           sts_region=spec.region)
    return Resolved("pod", identity, f"pod:{namespace}/{account}:{role}")


def _token_for(raw: str, audience: str) -> str:
    try:
        tokens = json.loads(raw)
        token = tokens[audience]["token"]
    except (ValueError, KeyError, TypeError):
        raise MissingCredentials(f"authenticationSource 'pod': kubelet sent no service-account token for the "
                                 f"audience {audience!r} (the CSIDriver's tokenRequests)") from None
    if not isinstance(token, str) or not token:
        raise MissingCredentials(f"authenticationSource 'pod': the token for {audience!r} is empty")
    return token


def _without_tokens(secrets: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in secrets.items() if k != TOKENS_KEY}


def fingerprint(creds: Credentials) -> str:
    """Names a key pair without revealing it (to tell whether a caller brings other credentials)."""
    digest = hashlib.sha256(f"{creds.access_key_id}\0{creds.secret_access_key}\0{creds.session_token or ''}".encode())
    return f"secret:{digest.hexdigest()[:16]}"


def same_principal(a: str, b: str) -> bool:
    """Two `who`s that may share one mount: equal, or both keys of a secret (a rotation)."""
    return a == b or (a.startswith("secret:") and b.startswith("secret:"))
