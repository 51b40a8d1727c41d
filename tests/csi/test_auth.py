"""Whom a volume authenticates as (csi/auth.py): pure decisions over what kubelet sends."""

from __future__ import annotations

import json

import pytest

from csi.attributes import AttributeProblem, parse_volume_context
from csi.auth import AuthPolicy, MissingCredentials, resolve, same_principal
from fusecore.config import Credentials, WebIdentity

KEYS = {"accessKeyId": "AKIA1", "secretAccessKey": "s3cr3t-value"}
POD = {"csi.storage.k8s.io/pod.namespace": "ml", "csi.storage.k8s.io/serviceAccount.name": "trainer"}


def tokens(token: str = "jwt-1", audience: str = "sts.amazonaws.com") -> dict[str, str]:
    return {"csi.storage.k8s.io/serviceAccount.tokens":
            json.dumps({audience: {"token": token, "expirationTimestamp": "2030-01-01T00:00:00Z"}})}


def run(attrs: dict, secrets: dict | None = None, policy: AuthPolicy = AuthPolicy(), extra: dict | None = None):
    context = {"bucket": "b", **attrs, **(extra or {})}
    return resolve(parse_volume_context(context), context, secrets or {}, policy)


def test_a_volume_needs_credentials():
    with pytest.raises(MissingCredentials, match="no credentials.*authenticationSource"):
        run({})
    with pytest.raises(MissingCredentials, match="no secret"):
        run({"authenticationSource": "secret"})
    with pytest.raises(MissingCredentials, match="allowNodeCredentials"):
        run({"authenticationSource": "node"})
    with pytest.raises(AttributeProblem, match="authenticationSource"):
        run({"authenticationSource": "root"})
    with pytest.raises(AttributeProblem, match="roleArn"):
        run({"authenticationSource": "pod", "roleArn": "reader"})


def test_a_secret_and_the_node():
    got = run({}, KEYS)
    assert got.source == "secret" and got.identity == Credentials("AKIA1", "s3cr3t-value")
    assert "s3cr3t" not in got.who and "AKIA1" not in got.who
    assert run({}, dict(KEYS, secretAccessKey="other")).who != got.who
    node = run({"authenticationSource": "node"}, policy=AuthPolicy(allow_node_credentials=True))
    assert (node.identity, node.who) == (None, "node")


def test_the_pods_identity():
    pending = run({"authenticationSource": "pod", "roleArn": "arn:aws:iam::1:role/r"}, extra=POD)
    assert pending.pending and pending.identity is None  # NodeStageVolume: no token yet
    got = run({"authenticationSource": "pod", "roleArn": "arn:aws:iam::1:role/r", "stsEndpointUrl": "http://sts"},
              extra={**POD, **tokens()})
    assert got.identity == WebIdentity("arn:aws:iam::1:role/r", "jwt-1", "stoker-ml-trainer", "http://sts", None)
    assert got.who == "pod:ml/trainer:arn:aws:iam::1:role/r" and "jwt" not in got.who
    with pytest.raises(MissingCredentials, match="audience 'sts.amazonaws.com'"):
        run({"authenticationSource": "pod", "roleArn": "arn:aws:iam::1:role/r"}, extra={**POD, **tokens(audience="x")})
    looked_up = []
    policy = AuthPolicy(role_lookup=lambda ns, sa: looked_up.append((ns, sa)) or "arn:aws:iam::1:role/from-sa")
    got = run({"authenticationSource": "pod"}, policy=policy, extra={**POD, **tokens()})
    assert got.identity.role_arn == "arn:aws:iam::1:role/from-sa" and looked_up == [("ml", "trainer")]
    with pytest.raises(MissingCredentials, match="eks.amazonaws.com/role-arn"):
        run({"authenticationSource": "pod"}, policy=AuthPolicy(role_lookup=lambda ns, sa: None),
            extra={**POD, **tokens()})


def test_who_may_share_a_mount():
    assert same_principal("secret:aa", "secret:bb")  # rotated keys: checked against the store, then shared
    assert same_principal("pod:ml/a:arn", "pod:ml/a:arn")
    assert not same_principal("pod:ml/a:arn", "pod:ml/b:arn")
    assert not same_principal("node", "secret:aa") and not same_principal("pod:ml/a:arn", "secret:aa")


def test_a_bad_node_cache_memory_flag_is_refused_naming_it(capsys):
    from stoker.cli import build_parser

    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["csi", "--node-cache-memory", "lots"])
    assert info.value.code == 2 and "node-cache-memory" in capsys.readouterr().err
