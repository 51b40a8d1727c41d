"""Resolve a DatasetCache's source to a Stoker volume, and list the dataset to learn its size."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from csi.attributes import AttributeProblem, parse_secrets, parse_volume_context
from fusecore.store.client import S3Store
from fusecore.store.errors import StoreError, TransientError, Unavailable

from .kube import Kube, NotFoundInCluster
from .plan import SpecProblem

DRIVER = "csi.stoker.dev"
StoreBusy = (Unavailable, TransientError)  # worth retrying later, unlike a missing bucket or bad keys


@dataclass(frozen=True)
class VolumeRef:
    """What a node needs to mount the dataset: the CSI volume id, attributes and secret reference."""

    volume_id: str
    attributes: dict[str, str]
    secret_namespace: str | None = None
    secret_name: str | None = None

    def as_status(self) -> dict:
        """For people reading the status; no component acts on it (node agents read the handover)."""
        return {"id": self.volume_id, "attributes": self.attributes}


def resolve(spec: dict, namespace: str, kube: Kube) -> VolumeRef:
    """The volume the nodes mount; spec.diskCacheSize, if any, becomes its diskCacheSize (a disk tier per node)."""
    ref = _source(spec, namespace, kube)
    if spec.get("diskCacheSize"):
        attributes = dict(ref.attributes, diskCacheSize=str(spec["diskCacheSize"]))
        try:
            parse_volume_context(attributes)
        except AttributeProblem as exc:
            raise SpecProblem(f"diskCacheSize: {exc}") from None
        ref = dataclasses.replace(ref, attributes=attributes)
    return ref


def _source(spec: dict, namespace: str, kube: Kube) -> VolumeRef:
    source = spec.get("source") or {}
    try:
        if source.get("pvc"):
            return _from_pvc(source["pvc"], namespace, kube)
        s3 = source.get("s3") or {}
        attributes = {k: str(s3[k]) for k in ("bucket", "prefix", "endpointUrl", "region") if s3.get(k)}
        parse_volume_context(attributes)
        secret = (s3.get("secretRef") or {}).get("name")
        prefix = (s3.get("prefix") or "").strip("/")
        return VolumeRef(f"s3://{s3.get('bucket')}/{prefix + '/' if prefix else ''}", attributes,
                         namespace if secret else None, secret)
    except NotFoundInCluster as exc:
        raise SpecProblem(str(exc)) from None
    except AttributeProblem as exc:
        raise SpecProblem(f"source: {exc}") from None


def _from_pvc(name: str, namespace: str, kube: Kube) -> VolumeRef:
    pvc = kube.pvc(namespace, name)
    pv_name = pvc.spec.volume_name
    if not pv_name or (pvc.status and pvc.status.phase not in (None, "Bound")):
        raise SpecProblem(f"PVC {namespace}/{name} is not bound to a volume yet")
    pv = kube.pv(pv_name)
    csi = pv.spec.csi
    if csi is None or csi.driver != DRIVER:
        driver = csi.driver if csi else "no CSI driver"
        raise SpecProblem(f"PVC {namespace}/{name} is bound to PV {pv_name} of {driver}, not {DRIVER}")
    attributes = dict(csi.volume_attributes or {})
    parse_volume_context(attributes)
    ref = csi.node_stage_secret_ref or csi.node_publish_secret_ref
    return VolumeRef(csi.volume_handle, attributes, ref.namespace if ref else None, ref.name if ref else None)


def read_secrets(ref: VolumeRef, kube: Kube) -> dict[str, str]:
    """The credentials of the source; a source without any is refused (nothing falls back to the
    operator's or a node's own identity)."""
    if not ref.secret_name or not ref.secret_namespace:
        raise SpecProblem("the source has no credentials: give source.s3 a secretRef, or use a PVC whose volume "
                          "has a node-stage (or node-publish) secret")
    try:
        data = kube.secret_data(ref.secret_namespace, ref.secret_name)
    except NotFoundInCluster as exc:
        raise SpecProblem(f"credentials: {exc}") from None
    try:
        parse_secrets(data)
    except AttributeProblem as exc:
        raise SpecProblem(f"Secret {ref.secret_namespace}/{ref.secret_name}: {exc}") from None
    return data


def measure(ref: VolumeRef, secrets: dict[str, str], paths: list[str]) -> tuple[int, int]:
    """(bytes, objects) of the dataset (under `paths`, or all of it), by listing it."""
    spec = parse_volume_context(ref.attributes)
    store = S3Store(spec.store_config(parse_secrets(secrets), max_attempts=3))
    total = count = 0
    try:
        for path in paths or [""]:
            base = spec.prefix + path.strip("/")
            for info in store.list_all(base):
                inside = not path.strip("/") or info.key == base or info.key.startswith(base + "/")
                if inside and not info.key.endswith("/"):
                    total += info.size
                    count += 1
    except StoreBusy:
        raise
    except StoreError as exc:
        raise SpecProblem(f"listing the dataset: {exc}") from None
    return total, count
