"""S3Store against a real S3 HTTP API (moto server), with faults injected on real sockets."""

import concurrent.futures
import time

import pytest

from fusecore.config import StoreConfig
from fusecore.store.client import S3Store
from fusecore.store.errors import AccessDenied, BucketNotFound, NotFound, PreconditionFailed, TransientError, Unavailable
from stoker.s3server import MotoServer
from tests.support.faultproxy import FaultProxy

pytestmark = pytest.mark.integration


@pytest.fixture(params=["native", "presigned", "botocore"], autouse=True)
def gets_path(request, monkeypatch):
    """Range GETs go through presigned URLs, small ones on awscrt connections ("native") unless turned off
    ("presigned": all on urllib3), or through botocore where a proxy is configured. Listings and HEADs
    take the same path in "native" and "presigned"."""
    if request.param == "botocore":
        monkeypatch.setenv("STOKER_BOTOCORE_GETS", "1")
    if request.param == "presigned":
        monkeypatch.setenv("STOKER_NATIVE_HTTP", "0")
    return request.param


def store_for(endpoint, bucket, **kw):
    return S3Store(StoreConfig(bucket=bucket, endpoint_url=endpoint, region="us-east-1", **kw))


def test_listing_is_paginated_and_split_into_files_and_prefixes(s3, bucket, moto_server):
    for i in range(1005):
        s3.put_object(Bucket=bucket, Key=f"many/{i:05d}", Body=b"x" * (i % 7))
    s3.put_object(Bucket=bucket, Key="many/sub/a", Body=b"a")
    store = store_for(moto_server.endpoint, bucket)
    pages = list(store.list_dir("many/"))
    assert len(pages) >= 2
    files = [f for p in pages for f in p.files]
    dirs = [d for p in pages for d in p.dirs]
    assert len(files) == 1005 and dirs == ["many/sub/"]
    assert files[3].size == 3 and files[3].etag.startswith('"')
    assert len(list(store.list_all("many/"))) == 1006


def test_listings_carry_any_key_and_match_botocores_parse(s3, bucket, moto_server, gets_path, monkeypatch):
    """Keys with spaces, '+', '%', '&', '<', quotes and non-ASCII, over several pages: the fast
    listing (presigned, C XML parser, next page requested while this one is parsed) and botocore's
    give the same entries."""
    if gets_path == "botocore":
        pytest.skip("this test compares the fast listing with botocore's itself")
    names = ["a b.jpg", "a+b", "100%.txt", "ümlaut é.png", "x&y<z>", 'quote"s', "semi;colon=eq?"]
    names += [f"n{i:04d}" for i in range(1100)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda name: s3.put_object(Bucket=bucket, Key=f"odd/{name}", Body=name.encode()), names))
    s3.put_object(Bucket=bucket, Key="odd/dir one/f", Body=b"f")
    store = store_for(moto_server.endpoint, bucket)
    pages = list(store.list_dir("odd/"))
    files = {f.key: f for p in pages for f in p.files}
    assert len(pages) >= 2 and sorted(files) == sorted(f"odd/{n}" for n in names)
    assert [d for p in pages for d in p.dirs] == ["odd/dir one/"]
    assert all(f.size == len(f.key[4:].encode()) and f.etag.startswith('"') and f.mtime > 0 for f in files.values())
    monkeypatch.setenv("STOKER_BOTOCORE_GETS", "1")
    reference = {f.key: f for p in store_for(moto_server.endpoint, bucket).list_dir("odd/") for f in p.files}
    assert reference == files
    assert sorted(i.key for i in store.list_all("odd/")) == sorted([*files, "odd/dir one/f"])


def test_range_get_head_and_missing_objects(s3, bucket, moto_server):
    body = bytes(range(256)) * 100
    s3.put_object(Bucket=bucket, Key="k", Body=body)
    store = store_for(moto_server.endpoint, bucket)
    info = store.head("k")
    assert info.size == len(body)
    assert bytes(store.get_range("k", 100, 5000, info.etag)) == body[100:5000]
    assert store.head("nope") is None
    with pytest.raises(NotFound):
        store.get_range("nope", 0, 10, info.etag)
    assert store.has_prefix("k") and not store.has_prefix("zzz/")


def test_head_and_prefix_checks_agree_with_botocore_for_any_key(s3, bucket, moto_server, gets_path, monkeypatch):
    """The lookups of a name in a directory never listed (HEAD and a one-key LIST, presigned when GETs
    are) see exactly what botocore sees, for keys that need escaping."""
    if gets_path == "botocore":
        pytest.skip("this test compares the presigned lookups with botocore's itself")
    names = ["a b.jpg", "a+b", "100%.txt", "ümlaut é.png", "x&y<z>", 'quote"s', "dir one/f"]
    for name in names:
        s3.put_object(Bucket=bucket, Key=f"odd/{name}", Body=name.encode())
    store = store_for(moto_server.endpoint, bucket)
    found = {name: store.head(f"odd/{name}") for name in names}
    prefixes = [store.has_prefix(p) for p in ("odd/dir one/", "odd/a b.jpg/", "odd/")]
    monkeypatch.setenv("STOKER_BOTOCORE_GETS", "1")
    reference = store_for(moto_server.endpoint, bucket)
    assert found == {name: reference.head(f"odd/{name}") for name in names}
    assert all(info is not None and info.size == len(name.encode()) for name, info in found.items())
    assert prefixes == [reference.has_prefix(p) for p in ("odd/dir one/", "odd/a b.jpg/", "odd/")] == [True, False, True]
    assert store.head("odd/missing") is None and reference.head("odd/missing") is None


def test_probe_finds_the_object_and_the_prefix_of_a_name_in_one_listing(s3, bucket, moto_server, monkeypatch):
    """What a lookup in a directory never listed sends (one LIST of the keys starting with the name), on both
    request paths, for names that need escaping; the same answer either way."""
    names = ["a b.jpg", "a b.jpg.bak", "a b.jpg/inner", "100%.txt", "ümlaut é.png", "x&y<z>"]
    for name in names:
        s3.put_object(Bucket=bucket, Key=f"probe/{name}", Body=name.encode())
    presigned = store_for(moto_server.endpoint, bucket)
    page = presigned.probe("probe/a b.jpg")
    assert [f.key for f in page.files] == ["probe/a b.jpg", "probe/a b.jpg.bak"]
    assert page.dirs == ["probe/a b.jpg/"] and not page.truncated
    assert page.files[0].size == len(b"a b.jpg") and page.files[0].etag == presigned.head("probe/a b.jpg").etag
    assert [f.key for f in presigned.probe("probe/ümlaut é.png").files] == ["probe/ümlaut é.png"]
    empty = presigned.probe("probe/missing")
    assert not empty.files and not empty.dirs
    monkeypatch.setenv("STOKER_BOTOCORE_GETS", "1")
    reference = store_for(moto_server.endpoint, bucket)
    for name in names:
        assert presigned.probe(f"probe/{name}") == reference.probe(f"probe/{name}")


def test_if_match_detects_a_changed_object(s3, bucket, moto_server):
    s3.put_object(Bucket=bucket, Key="k", Body=b"version-1")
    store = store_for(moto_server.endpoint, bucket)
    old = store.head("k")
    s3.put_object(Bucket=bucket, Key="k", Body=b"version-2")
    with pytest.raises(PreconditionFailed):
        store.get_range("k", 0, 9, old.etag)


def test_check_reports_a_missing_bucket(moto_server):
    with pytest.raises(BucketNotFound):
        store_for(moto_server.endpoint, "no-such-bucket-here").check()


def test_check_reports_wrong_credentials():
    with MotoServer(env={"INITIAL_NO_AUTH_ACTION_COUNT": "1"}) as server:
        import boto3
        boto3.client("s3", endpoint_url=server.endpoint).create_bucket(Bucket="guarded")
        with pytest.raises(AccessDenied) as err:
            store_for(server.endpoint, "guarded").check()
        assert "testing-secret" not in str(err.value)


def test_slowdown_503_is_retried(s3, bucket, moto_server, gets_path):
    """botocore retries it itself; the presigned path reports it as transient for the fetcher."""
    s3.put_object(Bucket=bucket, Key="k", Body=b"q" * 1000)
    with FaultProxy(moto_server.endpoint) as proxy:
        store = store_for(proxy.endpoint, bucket, max_attempts=5)
        info = store.head("k")
        proxy.set("slowdown", 2)
        if gets_path != "botocore":
            for _ in range(2):
                with pytest.raises(TransientError, match="SlowDown"):
                    store.get_range("k", 0, 1000, info.etag)
        assert bytes(store.get_range("k", 0, 1000, info.etag)) == b"q" * 1000
        assert proxy.faults_served == 2


def test_listings_and_lookups_ride_out_a_few_503s(s3, bucket, moto_server, gets_path):
    """A directory listing or a lookup's one-key LIST answered 503 SlowDown twice still succeeds (backoff and
    retry within max-attempts, on both paths); a HEAD through the proxy reports the object's real size."""
    s3.put_object(Bucket=bucket, Key="d/k", Body=b"q" * 1234)
    with FaultProxy(moto_server.endpoint) as proxy:
        store = store_for(proxy.endpoint, bucket, max_attempts=5)
        assert store.head("d/k").size == 1234
        proxy.set("slowdown", 2)
        assert [f.key for page in store.list_dir("d/") for f in page.files] == ["d/k"]
        assert proxy.faults_served == 2
        proxy.set("slowdown", 2)
        assert store.has_prefix("d/") and proxy.faults_served == 4
        proxy.set("slowdown", 100)
        with pytest.raises(Unavailable):
            list(store.list_dir("d/"))  # beyond max-attempts: an error, not a hang


def test_slowdown_that_persists_is_an_error(s3, bucket, moto_server):
    s3.put_object(Bucket=bucket, Key="k", Body=b"q" * 1000)
    with FaultProxy(moto_server.endpoint) as proxy:
        store = store_for(proxy.endpoint, bucket, max_attempts=2)
        info = store.head("k")
        proxy.set("slowdown", 100)
        with pytest.raises((Unavailable, TransientError)):
            store.get_range("k", 0, 1000, info.etag)


def test_a_body_cut_short_is_a_transient_error(s3, bucket, moto_server):
    s3.put_object(Bucket=bucket, Key="k", Body=b"r" * 100_000)
    with FaultProxy(moto_server.endpoint) as proxy:
        store = store_for(proxy.endpoint, bucket, max_attempts=1)
        info = store.head("k")
        proxy.set("reset", 1)
        with pytest.raises(Exception) as err:
            store.get_range("k", 0, 100_000, info.etag)
        assert err.value.kind in ("transient", "unavailable")
        assert bytes(store.get_range("k", 0, 100_000, info.etag)) == b"r" * 100_000


def test_a_store_that_stops_answering_fails_in_bounded_time(s3, bucket, moto_server):
    s3.put_object(Bucket=bucket, Key="k", Body=b"r" * 10)
    with FaultProxy(moto_server.endpoint) as proxy:
        store = store_for(proxy.endpoint, bucket, max_attempts=1, request_timeout=1.0)
        info = store.head("k")
        proxy.set("blackhole")
        started = time.monotonic()
        with pytest.raises(Unavailable):
            store.get_range("k", 0, 10, info.etag)
        assert time.monotonic() - started < 10
        proxy.set("pass")


@pytest.mark.parametrize("fault", ["shift-range", "ignore-range"])
def test_a_moved_or_ignored_range_is_refused_then_read_right(s3, bucket, moto_server, fault):
    """A proxy that moves the range one byte on, or drops it (200 with the whole object), never yields wrong
    bytes on any GET path: the answer is refused as transient, and the next GET reads the right bytes."""
    data = bytes(range(256)) * 1000
    s3.put_object(Bucket=bucket, Key="k", Body=data)
    with FaultProxy(moto_server.endpoint) as proxy:
        store = store_for(proxy.endpoint, bucket, max_attempts=1)
        info = store.head("k")
        for start, end in ((10, 1010), (0, 100_000)):
            proxy.set(fault, 1)
            with pytest.raises(TransientError):
                store.get_range("k", start, end, info.etag)
            assert bytes(store.get_range("k", start, end, info.etag)) == data[start:end]


def test_small_ranges_go_on_native_connections_and_large_ones_on_urllib3(s3, bucket, moto_server, gets_path,
                                                                         monkeypatch):
    """The native path takes ranges up to native_http.MAX_BODY (cheaper per request), urllib3 the rest
    (cheaper per byte); STOKER_NATIVE_HTTP=0 keeps all on urllib3."""
    from fusecore.store.native_http import MAX_BODY, NativeHttp

    calls = []
    real = NativeHttp.get_into

    def counted(self, url, headers, into, *args):
        calls.append(len(into))
        return real(self, url, headers, into, *args)

    monkeypatch.setattr(NativeHttp, "get_into", counted)
    data = bytes(range(251)) * 5000  # 1,255,000 bytes
    s3.put_object(Bucket=bucket, Key="k", Body=data)
    store = store_for(moto_server.endpoint, bucket)
    info = store.head("k")
    assert bytes(store.get_range("k", 5, 5 + MAX_BODY, info.etag)) == data[5:5 + MAX_BODY]
    assert bytes(store.get_range("k", 0, len(data), info.etag)) == data
    assert calls == ([MAX_BODY] if gets_path == "native" else [])
