"""Where kubelet puts this driver's volumes on a node (its rules, see tests/support/kubelet.py)."""

from __future__ import annotations

import hashlib
import os
import re

DRIVER_NAME = "csi.stoker.dev"
DEFAULT_KUBELET_DIR = "/var/lib/kubelet"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9._~-]+$")


def driver_staging_dir(kubelet_dir: str) -> str:
    """The directory under which kubelet stages every volume of this driver."""
    return os.path.join(kubelet_dir, "plugins", "kubernetes.io", "csi", DRIVER_NAME)


def kubelet_staging_path(kubelet_dir: str, volume_id: str) -> str:
    """Where kubelet (1.25 and later) stages a persistent volume of this driver."""
    digest = hashlib.sha256(volume_id.encode()).hexdigest()
    return os.path.join(driver_staging_dir(kubelet_dir), digest, "globalmount")


def is_staging_path(kubelet_dir: str, path: str) -> bool:
    """`<kubelet>/plugins/kubernetes.io/csi/csi.stoker.dev/<sha256>/globalmount`, and nothing else."""
    rest = _below(driver_staging_dir(kubelet_dir), path)
    return rest is not None and len(rest) == 2 and bool(_HEX64.match(rest[0])) and rest[1] == "globalmount"


def is_pod_target(kubelet_dir: str, path: str) -> bool:
    """`<kubelet>/pods/<uid>/volumes/kubernetes.io~csi/<volume>/mount`: a CSI volume's target in a pod."""
    rest = _below(os.path.join(kubelet_dir, "pods"), path)
    return (rest is not None and len(rest) == 5 and rest[1] == "volumes" and rest[2] == "kubernetes.io~csi"
            and rest[4] == "mount" and all(_SAFE_NAME.match(part) for part in (rest[0], rest[3])))


def under_mount_root(roots: tuple[str, ...], path: str) -> bool:
    """A path an orchestrator other than kubelet gave (`--mount-root`): anywhere below one of `roots`,
    normalized, with no symbolic link in its parent."""
    return any(_below(root, path) for root in roots)


def allowed_mount_point(kubelet_dir: str, roots: tuple[str, ...], path: str) -> bool:
    """Kubelet's staging and pod volume paths of this driver, or a path below a --mount-root."""
    return is_staging_path(kubelet_dir, path) or is_pod_target(kubelet_dir, path) or under_mount_root(roots, path)


def mount_point_rule(kubelet_dir: str, roots: tuple[str, ...]) -> str:
    """The rule `allowed_mount_point` applies, in words, for a refusal."""
    kubelet = (f"kubelet's staging paths ({driver_staging_dir(kubelet_dir)}/<sha256>/globalmount) and pod volume "
               f"paths ({kubelet_dir}/pods/<uid>/volumes/kubernetes.io~csi/<name>/mount)")
    if roots:
        return f"{kubelet}, or normalized paths below --mount-root {', '.join(roots)}"
    return f"{kubelet}; another orchestrator's directory needs --mount-root DIR on stoker csi and stoker csi-mounter"


def check_mount_root(root: str) -> str:
    """A --mount-root as given: an absolute, normalized directory path other than /, without symbolic links."""
    if not root.startswith("/") or os.path.normpath(root) != root or root == "/":
        raise ValueError(f"--mount-root {root!r}: must be an absolute, normalized directory other than /")
    if os.path.exists(root) and os.path.realpath(root) != root:
        raise ValueError(f"--mount-root {root!r}: must not involve a symbolic link")
    return root


def _below(root: str, path: str) -> list[str] | None:
    """The components of `path` under `root`, if `path` is a normalized absolute path below it
    whose parent directory involves no symbolic link."""
    if not path.startswith("/") or os.path.normpath(path) != path:
        return None
    root = os.path.normpath(root)
    if not path.startswith(root + "/"):
        return None
    parent = os.path.dirname(path)
    if os.path.exists(parent) and os.path.realpath(parent) != parent:
        return None
    return path[len(root) + 1:].split("/")
