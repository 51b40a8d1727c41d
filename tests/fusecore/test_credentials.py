"""Credentials a mount signs with, against a store that checks them (moto with IAM enforced) and STS for
web identities: explicit credentials never fall back to the environment, rotate in place, and a web
identity refreshes its keys with the newest token it was handed."""

from __future__ import annotations

import time

import pytest

from fusecore.config import Credentials, StoreConfig, WebIdentity
from fusecore.store.credentials import RotatingCredentials
from fusecore.store.client import S3Store
from fusecore.store.errors import AccessDenied

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def botocore_requests(monkeypatch):
    """moto's IAM enforcement cannot check presigned URLs: every request goes through botocore here."""
    monkeypatch.setenv("STOKER_BOTOCORE_GETS", "1")


def keys(secret: dict[str, str]) -> Credentials:
    return Credentials(secret["accessKeyId"], secret["secretAccessKey"])


def store_with(guarded, identity) -> S3Store:
    return S3Store(StoreConfig(bucket=guarded.bucket, endpoint_url=guarded.endpoint, region="us-east-1",
                               credentials=identity, max_attempts=1))


def test_explicit_keys_are_used_and_never_the_environment(guarded, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", guarded.admin["aws_access_key_id"])  # would be allowed
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", guarded.admin["aws_secret_access_key"])
    with pytest.raises(AccessDenied):
        store_with(guarded, keys(guarded.stranger)).check()
    store_with(guarded, keys(guarded.reader)).check()


def test_rotated_keys_reach_a_running_store(guarded):
    store = store_with(guarded, keys(guarded.stranger))
    with pytest.raises(AccessDenied):
        store.check()
    store.rotate(keys(guarded.reader))  # the same client, new keys
    store.check()
    assert sum(1 for _ in store.list_all("train/")) == len(guarded.dataset)


def test_a_web_identity_reads_with_the_roles_keys(guarded):
    token = guarded.sts.issue("ml/trainer")
    identity = WebIdentity(guarded.role_arn, token, "stoker-ml-trainer", guarded.sts.endpoint, "us-east-1")
    store = store_with(guarded, identity)
    store.check()
    assert (token, guarded.role_arn, "stoker-ml-trainer") in guarded.sts.exchanges
    with pytest.raises(AccessDenied):  # a token the identity provider never issued
        store_with(guarded, WebIdentity(guarded.role_arn, "forged-token", "x1", guarded.sts.endpoint)).check()


def test_expiring_keys_are_refreshed_with_the_newest_token(guarded):
    guarded.sts.lifetime = 2  # the keys STS hands out expire almost at once: every use refreshes them
    try:
        first = guarded.sts.issue("ml/trainer")
        creds = RotatingCredentials(WebIdentity(guarded.role_arn, first, "s-refresh", guarded.sts.endpoint))
        before = creds.get_frozen_credentials().access_key
        second = guarded.sts.issue("ml/trainer")
        creds.replace(WebIdentity(guarded.role_arn, second, "s-refresh", guarded.sts.endpoint))  # a republish
        guarded.sts.revoke(first)  # the old token expired
        time.sleep(2.5)
        after = creds.get_frozen_credentials().access_key
        assert after != before
        tokens = [t for t, _, session in guarded.sts.exchanges if session == "s-refresh"]
        assert tokens[0] == first and tokens[-1] == second
    finally:
        guarded.sts.lifetime = None
