"""The benchmark's emulated object store serves correct bytes, ranges and listings (via boto3)."""

import time

import boto3
import botocore.config
import pytest

from stoker_bench.fixture import StoreProcess
from stoker_bench.objectstore import PATTERN_SIZE, expected_bytes

pytestmark = pytest.mark.integration

OBJECTS = {"bench": {**{f"dir/f{i:04d}": 1000 + i for i in range(2500)},
                     "dir/sub/a": 10, "dir/sub/b": 20, "big": 3 * PATTERN_SIZE + 17, "empty": 0}}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with StoreProcess(OBJECTS, latency=0.0, bandwidth=0, workdir=str(tmp_path_factory.mktemp("store"))) as s:
        yield s


@pytest.fixture(scope="module")
def client(store):
    return boto3.client("s3", endpoint_url=store.endpoint, aws_access_key_id="x", aws_secret_access_key="y",
                        region_name="us-east-1", config=botocore.config.Config(s3={"addressing_style": "path"}))


def test_ranges_are_the_generated_bytes(client):
    size = OBJECTS["bench"]["big"]
    head = client.head_object(Bucket="bench", Key="big")
    assert head["ContentLength"] == size
    for start, end in [(0, 100), (PATTERN_SIZE - 5, PATTERN_SIZE + 5), (size - 10, size), (12345, 2 * PATTERN_SIZE)]:
        body = client.get_object(Bucket="bench", Key="big", Range=f"bytes={start}-{end - 1}")["Body"].read()
        assert body == expected_bytes("big", start, end)
    whole = client.get_object(Bucket="bench", Key="big")["Body"].read()
    assert whole == expected_bytes("big", 0, size)
    assert expected_bytes("big", 0, 100) != expected_bytes("dir/f0000", 0, 100), "objects differ"


def test_listing_v2_and_v1_paginate_with_prefix_and_delimiter(client):
    pages = list(client.get_paginator("list_objects_v2").paginate(Bucket="bench", Prefix="dir/", Delimiter="/"))
    keys = [c["Key"] for p in pages for c in p.get("Contents", [])]
    prefixes = [c["Prefix"] for p in pages for c in p.get("CommonPrefixes", [])]
    assert len(pages) == 3 and len(keys) == 2500 and prefixes == ["dir/sub/"]
    assert keys == sorted(keys)
    v1 = list(client.get_paginator("list_objects").paginate(Bucket="bench", Prefix="dir/sub/"))
    assert [c["Key"] for p in v1 for c in p["Contents"]] == ["dir/sub/a", "dir/sub/b"]


def test_missing_things_and_if_match(client):
    with pytest.raises(client.exceptions.NoSuchKey):
        client.get_object(Bucket="bench", Key="nope")
    with pytest.raises(client.exceptions.NoSuchBucket):
        client.list_objects_v2(Bucket="nobucket")
    etag = client.head_object(Bucket="bench", Key="big")["ETag"]
    assert client.get_object(Bucket="bench", Key="big", Range="bytes=0-3", IfMatch=etag)["Body"].read()
    with pytest.raises(Exception) as err:
        client.get_object(Bucket="bench", Key="big", Range="bytes=0-3", IfMatch='"other"')
    assert "PreconditionFailed" in str(err.value)


def test_latency_and_bandwidth_cap_are_applied(tmp_path):
    objects = {"bench": {"obj": 2_000_000}}
    with StoreProcess(objects, latency=0.05, bandwidth=4e6, workdir=str(tmp_path)) as s:
        c = boto3.client("s3", endpoint_url=s.endpoint, aws_access_key_id="x", aws_secret_access_key="y",
                         region_name="us-east-1", config=botocore.config.Config(s3={"addressing_style": "path"}))
        started = time.monotonic()
        data = c.get_object(Bucket="bench", Key="obj")["Body"].read()
        elapsed = time.monotonic() - started
        assert data == expected_bytes("obj", 0, 2_000_000)
        assert elapsed >= 0.05 + 2_000_000 / 4e6 * 0.8  # latency plus ~0.5 s at 4 MB/s
        assert s.stats()["gets"] == 1 and s.stats()["bytes_sent"] >= 2_000_000


def test_uploads_are_taken_checked_and_then_served(client, store):
    from stoker_bench.objectstore import expected_bytes

    key = "out/model.pt"
    size = 11 * 1024 * 1024 + 5
    body = expected_bytes(key, 0, size)
    upload = client.create_multipart_upload(Bucket="bench", Key=key)["UploadId"]
    parts = []
    for n, start in enumerate(range(0, size, 5 * 1024 * 1024), 1):  # (botocore asks 100-continue for each)
        etag = client.upload_part(Bucket="bench", Key=key, UploadId=upload, PartNumber=n,
                                  Body=body[start:start + 5 * 1024 * 1024])["ETag"]
        parts.append({"PartNumber": n, "ETag": etag})
    client.complete_multipart_upload(Bucket="bench", Key=key, UploadId=upload, MultipartUpload={"Parts": parts})
    client.put_object(Bucket="bench", Key="out/small", Body=expected_bytes("out/small", 0, 1000))
    client.put_object(Bucket="bench", Key="out/wrong", Body=b"not the expected bytes")
    written = store.written()
    assert written["bench/out/model.pt"] == {"size": size, "right": True}
    assert written["bench/out/small"] == {"size": 1000, "right": True}
    assert written["bench/out/wrong"]["right"] is False
    assert client.head_object(Bucket="bench", Key=key)["ContentLength"] == size  # listed and served from now on
    assert client.get_object(Bucket="bench", Key=key, Range="bytes=0-99")["Body"].read() == body[:100]
    aborted = client.create_multipart_upload(Bucket="bench", Key="out/gone")["UploadId"]
    client.abort_multipart_upload(Bucket="bench", Key="out/gone", UploadId=aborted)
    assert "bench/out/gone" not in store.written()
    client.delete_object(Bucket="bench", Key="out/small")
    with pytest.raises(client.exceptions.ClientError):
        client.head_object(Bucket="bench", Key="out/small")


def test_other_content_is_kept_as_its_digest_in_part_order(client, store):
    """A checkpoint is not generated content: the store keeps the SHA-256 of the parts in their numbers' order (the
    checkpoint cell compares it with what torch.save should have sent), whatever order the parts came in."""
    import hashlib

    key = "out/ckpt.pt"
    first, second = b"a" * (5 * 1024 * 1024), b"checkpoint tail"
    upload = client.create_multipart_upload(Bucket="bench", Key=key)["UploadId"]
    tail = client.upload_part(Bucket="bench", Key=key, UploadId=upload, PartNumber=2, Body=second)["ETag"]
    head = client.upload_part(Bucket="bench", Key=key, UploadId=upload, PartNumber=1, Body=first)["ETag"]
    client.complete_multipart_upload(Bucket="bench", Key=key, UploadId=upload, MultipartUpload={"Parts": [
        {"PartNumber": 1, "ETag": head}, {"PartNumber": 2, "ETag": tail}]})
    client.put_object(Bucket="bench", Key="out/small.pt", Body=b"one put")
    written = store.written()
    assert written[f"bench/{key}"] == {"size": len(first) + len(second), "right": False,
                                       "sha256": hashlib.sha256(first + second).hexdigest()}
    assert written["bench/out/small.pt"]["sha256"] == hashlib.sha256(b"one put").hexdigest()
