"""Object URLs signed without botocore's per-call pipeline are the URLs botocore's pipeline makes."""

import datetime
import hashlib
import hmac
import urllib.parse

import botocore.auth
import botocore.crt.auth
import botocore.config
import botocore.session
import pytest

from fusecore.store.signing import REFERENCE_KEY, ObjectUrls, learn_form

KEYS = ["small/train/007/img-000123.jpg", "a b/c+d=e&f?g#h", "ünï/cødé~x.bin", "100%/x;y,z:@!$'()*", "k/"]
T = 1_796_400_000.0
NOW = datetime.datetime.fromtimestamp(T, datetime.timezone.utc)
ACCESS, SECRET = "AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"


def sigv4_query(host: str, path: str, *, access: str, secret: str, amz_date: str, region: str, expires: int,
                token: str | None = None) -> dict[str, str]:
    """The query of a presigned S3 GET by AWS's documented query-string SigV4 ("Authenticating Requests: Using
    Query Parameters"), written here with hashlib and hmac alone: an expectation that owes nothing to botocore
    or to fusecore.store.signing (test_the_reference_signer_gives_the_aws_documented_signature checks it)."""
    date = amz_date[:8]
    scope = f"{date}/{region}/s3/aws4_request"
    params = {"X-Amz-Algorithm": "AWS4-HMAC-SHA256", "X-Amz-Credential": f"{access}/{scope}", "X-Amz-Date": amz_date,
              "X-Amz-Expires": str(expires), "X-Amz-SignedHeaders": "host"}
    if token is not None:
        params["X-Amz-Security-Token"] = token

    def quote(text: str) -> str:
        return urllib.parse.quote(text, safe="-_.~")

    query = "&".join(f"{quote(k)}={quote(v)}" for k, v in sorted(params.items()))
    request = "\n".join(["GET", path, query, f"host:{host}", "", "host", "UNSIGNED-PAYLOAD"])
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(request.encode()).hexdigest()])
    key = ("AWS4" + secret).encode()
    for part in (date, region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return dict(params, **{"X-Amz-Signature": hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()})


def expected_get(bucket: str, key: str, token: str | None = None) -> tuple[str, dict[str, str]]:
    """(URL without its query, query parameters) of the path-style GET of `key` that `client("s3v4")` must
    presign at the frozen instant (T: 2026-12-04 16:00:00 UTC), by sigv4_query. `key`: one needing no quoting."""
    query = sigv4_query("127.0.0.1:9000", f"/{bucket}/{key}", access=ACCESS, secret=SECRET,
                        amz_date="20261204T160000Z", region="us-east-1", expires=3600, token=token)
    return f"http://127.0.0.1:9000/{bucket}/{key}", query


def parsed(url: str) -> tuple[str, dict[str, str]]:
    """(URL without its query, its parameters): parameter order is no part of what a URL asks for."""
    base, _, query = url.partition("?")
    pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=True)
    assert len(pairs) == len(dict(pairs)), url
    return base, dict(pairs)


def client(signature_version=None, endpoint="http://127.0.0.1:9000", region="us-east-1", token=None,
           addressing="path"):
    session = botocore.session.Session()
    return session.create_client(
        "s3", endpoint_url=endpoint, region_name=region, aws_access_key_id=ACCESS,
        aws_secret_access_key=SECRET, aws_session_token=token,
        config=botocore.config.Config(signature_version=signature_version, s3={"addressing_style": addressing}))


@pytest.fixture
def frozen(monkeypatch):
    """Every way of signing reads one instant (botocore's SigV2 reads time.time, its SigV4 its current datetime,
    ObjectUrls time.time)."""
    def now(remove_tzinfo=True):
        return NOW.replace(tzinfo=None) if remove_tzinfo else NOW

    monkeypatch.setattr(botocore.auth, "get_current_datetime", now)
    if botocore.auth.HAS_CRT:  # where awscrt is installed (it is a dependency), botocore signs SigV4 through it
        monkeypatch.setattr(botocore.crt.auth, "get_current_datetime", now)
    monkeypatch.setattr(botocore.auth.time, "time", lambda: T)


@pytest.mark.parametrize("make", [
    lambda: client(),  # a custom endpoint, botocore's default (SigV2 query auth there)
    lambda: client("s3v4"),
    lambda: client("s3v4", token="FwoGZXIvYXdzE//session+token="),  # temporary credentials carry their token
    lambda: client(token="FwoGZXIvYXdzE//session+token="),
    lambda: client(endpoint=None, region="eu-west-1", addressing="auto"),  # AWS itself, virtual-hosted
    lambda: client("s3v4", endpoint=None, region="us-west-2", addressing="path"),
], ids=["v2-endpoint", "v4-endpoint", "v4-token", "v2-token", "aws-virtual", "aws-path-v4"])
def test_direct_urls_are_the_pipelines_urls(make, frozen):
    c = make()
    urls = ObjectUrls(c, "my-bucket", 3600)
    assert urls.form is not None, "the form of these URLs is reproduced"
    for key in KEYS:
        assert urls.url(key) == c.generate_presigned_url(
            "get_object", Params={"Bucket": "my-bucket", "Key": key}, ExpiresIn=3600), key
    assert urls.listing_form is not None, "the form of probe listings is reproduced"
    for prefix in [*KEYS, ""]:
        assert urls.listing(prefix) == c.generate_presigned_url("list_objects_v2", Params={
            "Bucket": "my-bucket", "EncodingType": "url", "Prefix": prefix, "Delimiter": "/"}, ExpiresIn=3600), prefix


def test_a_fresh_url_goes_through_the_whole_pipeline(frozen, monkeypatch):
    c = client("s3v4")
    urls = ObjectUrls(c, "b", 3600)
    assert urls.form is not None
    calls = []
    original = c.generate_presigned_url
    monkeypatch.setattr(c, "generate_presigned_url", lambda *a, **k: calls.append(a) or original(*a, **k))
    urls.url("x")
    assert calls == []
    assert parsed(urls.url("x", fresh=True)) == expected_get("b", "x")
    assert len(calls) == 1


@pytest.mark.parametrize("url", [
    "https://b.s3.amazonaws.com/other-key?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=a%2F20261204%2Fus-east-1%2Fs3%2Faws4_request",
    "https://b.s3.amazonaws.com/stoker/reference%20key%2B~%C3%A9.bin?X-Amz-Algorithm=AWS4-ECDSA-P256-SHA256&X-Amz-Credential=a",
    "https://b.s3.amazonaws.com/stoker/reference%20key%2B~%C3%A9.bin?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=broken",
    "https://b.s3.amazonaws.com/stoker/reference%20key%2B~%C3%A9.bin?x-s3session=1",
], ids=["key-elsewhere", "sigv4a", "bad-scope", "unknown-auth"])
def test_a_form_not_reproduced_stays_on_the_pipeline(url):
    assert learn_form(url, "b") is None


def test_the_reference_signer_gives_the_aws_documented_signature():
    """sigv4_query against the worked example of AWS's query-string SigV4 documentation (GET test.txt of
    examplebucket, 24 May 2013, one day): a known answer from outside this project and botocore."""
    query = sigv4_query("examplebucket.s3.amazonaws.com", "/test.txt", access="AKIAIOSFODNN7EXAMPLE",
                        secret="wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", amz_date="20130524T000000Z",
                        region="us-east-1", expires=86400)
    assert query["X-Amz-Signature"] == "aeeed9bbccd4d02ee5c0109b86d86835f995330da4c265957d157751f604d404"
    assert query["X-Amz-Credential"] == "AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request"


@pytest.mark.parametrize("token", [None, "FwoGZXIvYXdzE//session+token="])
def test_an_unknown_form_signs_every_url_through_the_pipeline(frozen, monkeypatch, token):
    c = client("s3v4", token=token)
    calls = []
    original = c.generate_presigned_url
    monkeypatch.setattr(c, "generate_presigned_url", lambda *a, **k: calls.append(a) or original(*a, **k))
    monkeypatch.setattr("fusecore.store.signing.learn_form", lambda url, bucket, key=REFERENCE_KEY: None)
    urls = ObjectUrls(c, "b", 3600)
    assert urls.form is None
    learnt = len(calls)
    for key in ("k", "x"):
        assert parsed(urls.url(key)) == expected_get("b", key, token)
    assert len(calls) == learnt + 2, "each URL through the pipeline"


def test_a_signer_that_differs_from_the_pipeline_is_not_used(frozen, monkeypatch):
    """Checked at run time, signature and all: a form that signs differently keeps the pipeline."""
    c = client("s3v4")
    monkeypatch.setattr(ObjectUrls, "_sign", lambda self, form, key: self._full(key).replace("X-Amz-Signature=", "X-Amz-Signature=0"))
    assert ObjectUrls(c, "b", 3600).form is None


def test_signed_urls_are_what_the_real_pipeline_makes_unfrozen():
    """Without a frozen clock: the run-time check itself accepts botocore's forms here."""
    for make in (client, lambda: client("s3v4")):
        urls = ObjectUrls(make(), "b", 3600)
        assert urls.form is not None and urls.listing_form is not None


def test_credentials_that_gained_a_token_since_the_form_was_learnt_sign_through_the_pipeline(frozen, monkeypatch):
    """The form's parameters are the learnt credentials' (a token adds one): other credentials, until the form is
    learnt again, sign on the pipeline rather than drop or invent a parameter."""
    from fusecore.store.signing import _Keys
    c = client("s3v4")
    urls = ObjectUrls(c, "b", 3600)
    assert urls.form is not None
    monkeypatch.setattr(ObjectUrls, "_credentials", lambda self, form, now: _Keys(now, "AKIDEXAMPLE", "s", "tok"))
    calls = []
    original = c.generate_presigned_url
    monkeypatch.setattr(c, "generate_presigned_url", lambda *a, **k: calls.append(a) or original(*a, **k))
    assert parsed(urls.url("x")) == expected_get("b", "x")  # the client's own keys, no token
    assert len(calls) == 1


@pytest.mark.parametrize("url", [
    "http://h/b?list-type=2&prefix=other&delimiter=%2F&X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=a%2F20261204%2Fus-east-1%2Fs3%2Faws4_request",
    "http://h/b?list-type=2&delimiter=%2F&X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=a%2F20261204%2Fus-east-1%2Fs3%2Faws4_request",
    "http://h/b?list-type=2&prefix=stoker%2Freference%20key%2B~%C3%A9.bin&x-s3session=1",
], ids=["prefix-elsewhere", "no-prefix", "unknown-auth"])
def test_a_listing_form_not_reproduced_stays_on_the_pipeline(url):
    from fusecore.store.signing import learn_listing_form
    assert learn_listing_form(url, "b") is None


def test_a_listing_signer_that_differs_from_the_pipeline_is_not_used(frozen, monkeypatch):
    c = client("s3v4")
    monkeypatch.setattr(ObjectUrls, "_sign_listing",
                        lambda self, form, prefix: self._full_listing(prefix).replace("X-Amz-Signature=", "X-Amz-Signature=0"))
    urls = ObjectUrls(c, "b", 3600)
    assert urls.listing_form is None and urls.form is not None
    assert "X-Amz-Signature=0" not in urls.listing("p/")
