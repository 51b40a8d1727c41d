"""Volume attributes and secrets → a validated mount specification (pure; parsed once, at the edge).

Static PVs carry attributes in `volumeAttributes`, dynamic ones get them from StorageClass
parameters through CreateVolume's volume_context; both land here. Every problem raises
AttributeProblem naming the attribute (never a secret's value).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable

from fusecore.config import (ConfigError, Credentials, Identity, MountConfig, StoreConfig, parse_size, parse_ttl,
                             parse_workers)

from .failures import DriverError

log = logging.getLogger(__name__)

EPHEMERAL_KEY = "csi.storage.k8s.io/ephemeral"
TOKENS_KEY = "csi.storage.k8s.io/serviceAccount.tokens"  # the pod's service-account tokens (bearer secrets)
_KUBERNETES_PREFIXES = ("csi.storage.k8s.io/", "storage.kubernetes.io/")


class AttributeProblem(DriverError, ValueError):
    """A volume attribute, parameter or secret key is missing, unknown or malformed."""


def _boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in ("true", "yes", "1"):
        return True
    if value in ("false", "no", "0"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("must not be negative")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError("must be > 0 seconds")
    return value


@dataclass(frozen=True)
class Knob:
    """One tunable volume attribute and the MountConfig setting it becomes."""

    setting: str  # a MountConfig field, or "store.<StoreConfig field>"
    parse: Callable[[str], object]
    config_name: str  # the name ConfigError uses for it


KNOBS: dict[str, Knob] = {
    "cacheSize": Knob("cache_size", lambda v: parse_size(v, name="cacheSize"), "cache-size"),
    # the volume's disk tier on this node (a folder of the node's --disk-cache-root: never a path from here)
    "diskCacheSize": Knob("disk_cache_size", lambda v: parse_size(v, name="diskCacheSize"), "disk-cache-size"),
    "blockSize": Knob("block_size", lambda v: parse_size(v, name="blockSize"), "block-size"),
    "maxPrefetch": Knob("max_prefetch", lambda v: parse_size(v, name="maxPrefetch"), "max-prefetch"),
    "initialPrefetch": Knob("initial_prefetch", lambda v: parse_size(v, name="initialPrefetch"), "initial-prefetch"),
    "maxConcurrency": Knob("store.max_concurrency", _positive_int, "max-concurrency"),
    "metadataTTL": Knob("metadata_ttl", lambda v: parse_ttl(v, name="metadataTTL"), "metadata-ttl"),
    "requestTimeout": Knob("store.request_timeout", _seconds, "request-timeout"),
    "connectTimeout": Knob("store.connect_timeout", _seconds, "connect-timeout"),
    "maxAttempts": Knob("store.max_attempts", _positive_int, "max-attempts"),
    "readDeadline": Knob("read_deadline", _seconds, "read-deadline"),
    "readAheadKb": Knob("read_ahead_kb", _positive_int, "read-ahead-kb"),
    "kernelCache": Knob("kernel_cache", _boolean, "kernel-cache"),
    "uid": Knob("uid", _positive_int, "uid"),
    "gid": Knob("gid", _positive_int, "gid"),
    # Writes (fusecore/read/writes.py): an administrator's choice, in a PV or StorageClass, never a pod's (an inline
    # volume's attributes are the pod's: refused there)
    "writable": Knob("writable", _boolean, "writable"),
    "allowOverwrite": Knob("allow_overwrite", _boolean, "allow-overwrite"),
    "allowDelete": Knob("allow_delete", _boolean, "allow-delete"),
    # Processes serving the volume's mount on a node (fusecore/process/workers.py): the node's cores and memory, an
    # administrator's choice too
    "workers": Knob("workers", lambda v: parse_workers(v, name="workers"), "workers"),
}
# a PV's or a StorageClass's only (an inline volume's attributes are the pod's)
ADMIN_KNOBS = ("writable", "allowOverwrite", "allowDelete", "workers")
STORE_ATTRIBUTES = ("bucket", "prefix", "endpointUrl", "region")
AUTH_SOURCES = ("secret", "pod", "node")  # csi/auth.py
AUTH_ATTRIBUTES = ("authenticationSource", "roleArn", "stsEndpointUrl")
# Each credential under the spellings Secrets shared with other tools use; any other key is ignored.
SECRET_SPELLINGS = {
    "accessKeyId": ("accessKeyId", "accessKeyID", "AWS_ACCESS_KEY_ID"),
    "secretAccessKey": ("secretAccessKey", "AWS_SECRET_ACCESS_KEY"),
    "sessionToken": ("sessionToken", "AWS_SESSION_TOKEN"),
}
SECRET_KEYS = {spelling for spellings in SECRET_SPELLINGS.values() for spelling in spellings}
_CREDENTIAL_LOOKALIKES = {"accesskeyid", "secretaccesskey", "sessiontoken", "aws_access_key_id",
                          "aws_secret_access_key", "aws_session_token", "password", "secret", "token"}


def looks_like_credential(key: str) -> bool:
    """An attribute name under which someone probably put a secret by mistake (or kubelet put the pod's tokens)."""
    return key.lower() in _CREDENTIAL_LOOKALIKES or key == TOKENS_KEY


@dataclass(frozen=True)
class VolumeSpec:
    """What one volume mounts: the store location and the tuning knobs, all validated."""

    bucket: str
    prefix: str = ""
    endpoint_url: str | None = None
    region: str | None = None
    knobs: tuple[tuple[str, object], ...] = ()  # (attribute, parsed value), sorted
    ephemeral: bool = False
    auth: str | None = None  # authenticationSource; None: 'secret' when the volume has one (csi/auth.py)
    role_arn: str | None = None
    sts_endpoint_url: str | None = None

    @property
    def source(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def mount_config(self, mountpoint: str, control_socket: str, *, credentials: Identity | None = None,
                     cache_size: int | None = None, disk_cache: str = "") -> MountConfig:
        """The mount's configuration; `cache_size` overrides the volume's own cacheSize (a DatasetCache's plan);
        `disk_cache` is the folder the node gives the volume's disk tier (diskCacheSize asks for one)."""
        knobs = dict(self.knobs)
        if cache_size is not None:
            knobs["cacheSize"] = cache_size
        if not disk_cache:
            knobs.pop("diskCacheSize", None)
        settings: dict[str, Any] = {}  # values of the knobs' own types (checked by their parsers)
        store: dict[str, Any] = {}
        for name, value in knobs.items():
            setting = KNOBS[name].setting
            if setting.startswith("store."):
                store[setting[len("store."):]] = value
            else:
                settings[setting] = value
        return MountConfig(store=StoreConfig(bucket=self.bucket, prefix=self.prefix, endpoint_url=self.endpoint_url,
                                             region=self.region, credentials=credentials, **store),
                           mountpoint=mountpoint, control_socket=control_socket, allow_other=True,
                           disk_cache=disk_cache, **settings)

    @property
    def writable(self) -> bool:
        """May this volume be written (a PV's or StorageClass's `writable: "true"`)? Each pod's publish still says
        whether its target is read-only."""
        return bool(dict(self.knobs).get("writable", False))

    @property
    def disk_cache_size(self) -> int:
        """What the volume asks of the node's disk (diskCacheSize; 0: no disk tier)."""
        return int(dict(self.knobs).get("diskCacheSize", 0))  # type: ignore[call-overload]

    def store_config(self, credentials: Identity | None = None, **overrides) -> StoreConfig:
        """Where this volume's objects live, for a store client (checks, listing) outside the mount: the
        mount's own store settings (one set of defaults, StoreConfig's), with `overrides`."""
        return dataclasses.replace(self.mount_config("/", "/", credentials=credentials).store, **overrides)

    def location(self) -> tuple:
        """What makes two specs the same data (tuning knobs aside)."""
        return self.bucket, self.prefix, self.endpoint_url, self.region



def parse_volume_context(context: dict[str, str]) -> VolumeSpec:
    """Validate a volume's attributes; raises AttributeProblem naming the first bad one."""
    values: dict[str, object] = {}
    ephemeral = False
    for key, raw in sorted(context.items()):
        if key == EPHEMERAL_KEY:
            ephemeral = _parse(key, raw, _boolean)
        elif key.startswith(_KUBERNETES_PREFIXES):
            continue  # pod info and provisioner bookkeeping added by Kubernetes
        elif looks_like_credential(key):
            raise AttributeProblem(f"volume attribute {key!r}: credentials are read only from the secret "
                                   "(nodeStageSecretRef / nodePublishSecretRef), never from attributes")
        elif key in STORE_ATTRIBUTES or key in AUTH_ATTRIBUTES:
            values[key] = raw.strip()
        elif key in KNOBS:
            values[key] = _parse(key, raw, KNOBS[key].parse)
        else:
            known = ", ".join([*STORE_ATTRIBUTES, *AUTH_ATTRIBUTES, *KNOBS])
            raise AttributeProblem(f"unknown volume attribute {key!r} (known: {known})")
    bucket = str(values.pop("bucket", "") or "")
    if not bucket:
        raise AttributeProblem("volume attribute 'bucket' is required")
    prefix = str(values.pop("prefix", "") or "").strip("/")
    auth = str(values.pop("authenticationSource", "")) or None
    if auth is not None and auth not in AUTH_SOURCES:
        raise AttributeProblem(f"volume attribute 'authenticationSource': expected one of {', '.join(AUTH_SOURCES)}, "
                               f"got {auth!r}")
    role_arn = str(values.pop("roleArn", "")) or None
    if role_arn is not None and not role_arn.startswith("arn:"):
        raise AttributeProblem(f"volume attribute 'roleArn': expected an IAM role ARN (arn:...), got {role_arn!r}")
    sts_endpoint = str(values.pop("stsEndpointUrl", "")) or None
    asked = [k for k in ADMIN_KNOBS if values.get(k)]
    if ephemeral and asked:
        raise AttributeProblem(f"volume attribute {asked[0]!r}: an inline volume's attributes are the pod's own, and a "
                               "pod never makes a volume writable or chooses its node's processes (a PV or a "
                               "StorageClass may)")
    spec = VolumeSpec(
        bucket=bucket,
        prefix=f"{prefix}/" if prefix else "",
        endpoint_url=str(values.pop("endpointUrl", "")) or None,
        region=str(values.pop("region", "")) or None,
        knobs=tuple(sorted(values.items())),
        ephemeral=ephemeral,
        auth=auth,
        role_arn=role_arn,
        sts_endpoint_url=sts_endpoint,
    )
    check_ranges(spec)
    return spec


def check_ranges(spec: VolumeSpec) -> MountConfig:
    """Build the MountConfig the mount will get, so that range errors surface here, named (a volume that asks for
    a disk tier is checked with one: the node gives its folder at stage)."""
    try:
        return spec.mount_config("/", "/", disk_cache="/" if "diskCacheSize" in dict(spec.knobs) else "")
    except ConfigError as exc:
        name = next((name for name, knob in KNOBS.items() if knob.config_name == exc.setting), exc.setting)
        raise AttributeProblem(f"volume attribute {name}: {exc.problem}") from None


def parse_secrets(secrets: dict[str, str]) -> Credentials | None:
    """Credentials from a CSI secrets map; None when there is no secret. Keys that are no credential
    are ignored (their names logged, never their values); a secret without credentials, or with two
    spellings of one key that disagree, is refused."""
    ignored = sorted(set(secrets) - SECRET_KEYS)
    if ignored:
        log.info("secret keys ignored (not credentials): %s", ", ".join(ignored))
    found: dict[str, str] = {}
    for name, spellings in SECRET_SPELLINGS.items():
        values = {secrets[k] for k in spellings if secrets.get(k)}
        if len(values) > 1:
            raise AttributeProblem(f"secret has contradictory values for {name!r} under "
                                   f"{', '.join(k for k in spellings if secrets.get(k))}")
        if values:
            found[name] = values.pop()
    key_id, secret = found.get("accessKeyId", ""), found.get("secretAccessKey", "")
    if not key_id and not secret:
        if secrets:  # a secret was given: it was meant to hold credentials
            raise AttributeProblem("the secret holds no credentials: it needs accessKeyId and secretAccessKey "
                                   f"(or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY); its keys: {', '.join(sorted(secrets))}")
        return None
    if not key_id or not secret:
        raise AttributeProblem("secret needs both 'accessKeyId' and 'secretAccessKey' "
                               "(or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)")
    return Credentials(key_id, secret, found.get("sessionToken") or None)


def _parse(key: str, raw: str, parse: Callable[[str], object]):
    try:
        return parse(raw)
    except ConfigError as exc:
        raise AttributeProblem(f"volume attribute {exc}") from None
    except (TypeError, ValueError) as exc:
        raise AttributeProblem(f"volume attribute {key!r}: cannot use {raw!r} ({exc})") from None

