"""`stoker operator`: run the DatasetCache operator (kopf) with kubeconfig or in-cluster credentials."""

from __future__ import annotations

import argparse
import getpass
import os
import socket
import sys


def add_command(sub: argparse._SubParsersAction) -> None:
    o = sub.add_parser("operator", help="run the DatasetCache operator (kopf)")
    scope = o.add_mutually_exclusive_group()
    scope.add_argument("--namespace", action="append", default=[], help="watch only this namespace (repeatable)")
    scope.add_argument("--all-namespaces", action="store_true", help="watch the whole cluster (default)")
    mode = o.add_mutually_exclusive_group()
    mode.add_argument("--standalone", action="store_true",
                      help="no peering, one replica (the default unless --peering is given)")
    mode.add_argument("--peering", help="coordinate several replicas through kopf peering under this name "
                                        "(needs kopf's peering CRDs: the chart installs them when replicas > 1)")
    o.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="liveness endpoint URL ('' to disable)")
    o.add_argument("--handover-namespace", default=os.environ.get("POD_NAMESPACE", "stoker-system"),
                   help="where DatasetCache volumes are handed to the node agents (the release namespace)")
    o.add_argument("--node-cache-memory", help="Stoker cache memory of each node (the chart's node.cacheMemory): "
                                                 "DatasetCaches sharing a node never plan past it")
    o.add_argument("--log-level", default="INFO")
    o.set_defaults(func=cmd_operator)


def ensure_identity() -> None:
    """kopf names this replica from POD_ID, else from the user name, which a container running as a
    uid without a passwd entry (the chart's 65532) does not have: fall back to host name and pid."""
    if os.environ.get("POD_ID"):
        return
    try:
        getpass.getuser()
    except (KeyError, OSError):
        os.environ["POD_ID"] = f"{socket.gethostname()}-{os.getpid()}"


def peering_missing(namespaced: bool) -> str | None:
    """Why kopf could not peer on this cluster (its peering CRD is not served), or None.

    kopf would otherwise pause every watch silently and forever, saying so only at DEBUG."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    from .kube import load_config

    plural = "kopfpeerings" if namespaced else "clusterkopfpeerings"
    load_config()
    try:
        served = [r.name for r in client.CustomObjectsApi().get_api_resources("kopf.dev", "v1").resources]
    except ApiException as exc:
        if exc.status != 404:
            raise
        served = []
    if plural in served:
        return None
    return (f"--peering needs kopf's {plural}.kopf.dev CRD, which this cluster does not serve: install it "
            f"(charts/stoker/templates/peering.yaml) or run one replica without --peering")


def cmd_operator(args: argparse.Namespace) -> int:
    import kopf

    from fusecore import logs

    ensure_identity()
    if args.peering:
        problem = peering_missing(bool(args.namespace))
        if problem:
            print(f"stoker operator: {problem}", file=sys.stderr)
            return 2

    from . import handlers  # registers the handlers
    from .plan import SpecProblem, quantity_bytes

    try:
        memory = quantity_bytes(args.node_cache_memory, what="--node-cache-memory") if args.node_cache_memory else 0
    except SpecProblem as exc:
        print(f"stoker operator: {exc}", file=sys.stderr)
        return 2
    config = handlers.OperatorConfig(handover_namespace=args.handover_namespace, node_cache_memory=memory)

    logs.configure(args.log_level)
    kopf.run(
        standalone=not args.peering,
        peering_name=args.peering,
        # the DatasetCacheNodes live in the handover namespace: a namespaced operator watches it too
        namespaces=list(dict.fromkeys([*args.namespace, args.handover_namespace])) if args.namespace else (),
        clusterwide=not args.namespace,
        liveness_endpoint=args.liveness or None,
        memo=kopf.Memo(config=config),
    )
    return 0
