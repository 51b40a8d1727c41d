from __future__ import annotations

import pytest

from csi.attributes import AttributeProblem, parse_secrets, parse_volume_context
from fusecore.config import WORKERS_AUTO


def test_parses_store_location_and_knobs():
    spec = parse_volume_context({"bucket": "b", "prefix": "/data/train/", "endpointUrl": "http://s3:9000",
                                 "region": "eu", "cacheSize": "2GiB", "blockSize": "8MiB", "metadataTTL": "forever",
                                 "kernelCache": "false", "maxConcurrency": "32",
                                 "csi.storage.k8s.io/pod.name": "p", "storage.kubernetes.io/csiProvisionerIdentity": "x"})
    assert (spec.bucket, spec.prefix, spec.endpoint_url, spec.region) == ("b", "data/train/", "http://s3:9000", "eu")
    cfg = spec.mount_config("/mnt/x", "/run/x.sock")
    assert (cfg.store.bucket, cfg.store.prefix, cfg.mountpoint, cfg.control_socket) == \
        ("b", "data/train/", "/mnt/x", "/run/x.sock")
    assert not cfg.kernel_cache and cfg.cache_size == 2 * 1024**3 and cfg.block_size == 8 * 1024**2
    assert cfg.metadata_ttl == float("inf") and cfg.store.max_concurrency == 32
    assert cfg.allow_other and not spec.ephemeral and cfg.store.credentials is None
    assert spec.mount_config("/m", "/s", cache_size=64 << 20).cache_size == 64 << 20  # a DatasetCache's plan
    auto = parse_volume_context({"bucket": "b", "workers": "auto"}).mount_config("/m", "/s")
    assert auto.workers == WORKERS_AUTO  # (chosen by the mount process, from its own cores)


@pytest.mark.parametrize("attrs, named", [
    ({}, "bucket"),
    ({"bucket": "b", "cacheSize": "huge"}, "cacheSize"),
    ({"bucket": "b", "blockSize": "1KiB"}, "blockSize"),
    ({"bucket": "b", "initialPrefetch": "lots"}, "initialPrefetch"),
    ({"bucket": "b", "cacheSize": "1MiB"}, "cacheSize"),
    ({"bucket": "b", "diskCacheSize": "1MiB"}, "diskCacheSize: .*at least two blocks"),
    ({"bucket": "b", "diskCacheSize": "many"}, "diskCacheSize"),
    ({"bucket": "b", "maxConcurrency": "many"}, "maxConcurrency"),
    ({"bucket": "b", "maxConcurrency": "5000"}, "maxConcurrency: must be between"),
    ({"bucket": "b", "kernelCache": "perhaps"}, "kernelCache"),
    ({"bucket": "b", "requestTimeout": "0"}, "requestTimeout"),
    ({"bucket": "b", "connectTimeout": "0.01"}, "connectTimeout: must be between"),
    ({"bucket": "b", "maxAttempts": "0"}, "maxAttempts: must be between 1 and 20"),
    ({"bucket": "b", "maxAttempts": "-1"}, "maxAttempts"),
    ({"bucket": "b", "readDeadline": "0"}, "readDeadline"),
    ({"bucket": "b", "readDeadline": "0.2"}, "readDeadline: must be between 1 and"),
    ({"bucket": "b", "readAheadKb": "99999999"}, "readAheadKb: must be between"),
    ({"bucket": "b", "uid": "-5"}, "uid"),
    ({"bucket": "b", "workers": "many"}, "workers: must be auto or a number"),
    ({"bucket": "b", "workers": "65"}, "workers: must be auto or between 1 and 64"),
    ({"bucket": "b", "cachesize": "1GiB"}, "cachesize"),
    ({"bucket": "b", "accessKeyId": "AKIA"}, "accessKeyId"),
    ({"bucket": "b", "csi.storage.k8s.io/ephemeral": "maybe"}, "ephemeral"),
])
def test_bad_attributes_are_named(attrs, named):
    with pytest.raises(AttributeProblem, match=named):
        parse_volume_context(attrs)


def test_secrets():
    assert parse_secrets({}) is None
    creds = parse_secrets({"accessKeyId": "id", "secretAccessKey": "s3cr3t", "sessionToken": "tok"})
    assert "s3cr3t" not in repr(creds) and "tok" not in repr(creds)
    assert (creds.access_key_id, creds.secret_access_key, creds.session_token) == ("id", "s3cr3t", "tok")
    with pytest.raises(AttributeProblem, match="secretAccessKey"):
        parse_secrets({"accessKeyId": "id"})
    with pytest.raises(AttributeProblem, match="no credentials.*endpointUrl, pass") as info:
        parse_secrets({"pass": "hunter2", "endpointUrl": "https://s3.example"})
    assert "hunter2" not in str(info.value)
    shared = parse_secrets({"AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": "s3cr3t", "config": "x"})
    assert (shared.access_key_id, shared.secret_access_key) == ("id", "s3cr3t")
    assert parse_secrets({"accessKeyID": "id", "accessKeyId": "id", "secretAccessKey": "s"}).access_key_id == "id"
    with pytest.raises(AttributeProblem, match="contradictory") as info:
        parse_secrets({"accessKeyId": "id", "AWS_ACCESS_KEY_ID": "other", "secretAccessKey": "hunter2"})
    assert "hunter2" not in str(info.value) and "other" not in str(info.value)
