"""Presigned GET URLs of one bucket's objects, signed without botocore's per-call pipeline.

botocore's `generate_presigned_url` resolves the endpoint rules, validates and serialises the parameters and
emits its events on every call: 0.4-0.5 ms of CPU, paid once per object, so once per file of a small-file
dataset (the largest Python cost of a cold small file, profiled in the data-path issue). Two objects' URLs
differ only by the quoted key and the time, so `ObjectUrls` learns the URL's form once, from one full presign
of a reference key, and then signs each object's URL itself by the query-string signing AWS documents (SigV2
or SigV4, whichever botocore chose there): ~15 us per URL, against ~55 us (SigV2) and ~135 us (SigV4, which
botocore signs through awscrt) with botocore's auth classes. Credentials stay botocore's: its signer hands
them out (refreshed and rotated as botocore does), at most a second old.

The form is used only where signing the reference key reproduces the full pipeline's URL exactly, signature
and parameter order included; anything else botocore may do (SigV4a, S3 Express sessions, a future auth)
keeps every URL on the full pipeline. A URL the store refuses is signed again on the full pipeline
(`url(fresh=True)`).
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import hashlib
import hmac
import time
import urllib.parse
from dataclasses import dataclass
from typing import Callable, NamedTuple

import botocore.utils

REFERENCE_KEY = "stoker/reference key+~é.bin"  # a key whose quoting shows where the key sits in a URL


@dataclass(frozen=True)
class UrlForm:
    """Where a key goes in this bucket's GET URLs (or a prefix in its probe listings' URLs), and how botocore
    signed them."""

    prefix: str  # the URL up to the quoted key (a listing's: up to its query)
    version: str  # botocore's auth type: "s3-query" (SigV2) or "s3v4-query"
    region: str | None
    service: str
    auth_prefix: str | None = None  # SigV2 signs the path-style resource (/bucket/key) of a virtual-hosted URL
    order: tuple[str, ...] = ()  # the query's parameter names, in the order botocore writes them (the signature's
    # last, not among them)
    operation: tuple[tuple[str, str | None], ...] = ()  # a listing's own parameters, before those of its
    # signature, in botocore's order and encoding; None where the listed prefix goes

    @functools.cached_property
    def path_prefix(self) -> str:
        return urllib.parse.urlsplit(self.prefix).path

    @functools.cached_property
    def host(self) -> str:
        """The signed host header: the endpoint's host, with its port unless it is the scheme's default."""
        parts = urllib.parse.urlsplit(self.prefix)
        default = {"http": 80, "https": 443}.get(parts.scheme)
        host = f"[{parts.hostname}]" if parts.hostname and ":" in parts.hostname else parts.hostname or ""
        return host if parts.port in (None, default) else f"{host}:{parts.port}"


class _Keys(NamedTuple):
    """The credentials a URL is signed with (botocore's frozen credentials, taken at most a second ago)."""

    second: int
    access_key: str
    secret_key: str
    token: str | None

    def __repr__(self) -> str:
        return f"_Keys(access_key={self.access_key!r}, ...)"  # never the secret or the token, in any log


class _V4Second(NamedTuple):
    """What SigV4 URLs signed in one second with one set of keys share."""

    params: dict[str, str]  # the signature's own query parameters, encoded
    query: str  # those, in canonical order
    stamp: str
    scope: str
    key: bytes  # the day's signing key

    def __repr__(self) -> str:
        return f"_V4Second(stamp={self.stamp!r}, scope={self.scope!r}, ...)"  # never the signing key, in any log


def _quote(value: str) -> str:
    """A query value as botocore encodes it (percent_encode_sequence)."""
    return urllib.parse.quote(value, safe="-_.~")


def quote_key(key: str) -> str:
    """An object key as botocore puts it in a URL's path."""
    return botocore.utils.percent_encode(key, safe="/~")


def learn_form(url: str, bucket: str, key: str = REFERENCE_KEY) -> UrlForm | None:
    """The form of a URL botocore presigned for `bucket`'s `key`; None for a form this module does not reproduce."""
    base, _, query = url.partition("?")
    quoted = quote_key(key)
    if not base.endswith(quoted):
        return None
    prefix = base[:-len(quoted)]
    return _auth_form(prefix, urllib.parse.parse_qsl(query, keep_blank_values=True), bucket,
                      urllib.parse.urlsplit(prefix).path.startswith(f"/{bucket}/"))


def learn_listing_form(url: str, bucket: str, prefix: str = REFERENCE_KEY) -> UrlForm | None:
    """The form of a probe listing's URL (ListObjectsV2 of `prefix`, delimiter "/", keys URL-encoded) botocore
    presigned; None for a form this module does not reproduce."""
    base, _, query = url.partition("?")
    raw = [pair.partition("=")[::2] for pair in query.split("&")]
    first_auth = next((i for i, (name, _) in enumerate(raw) if name in ("AWSAccessKeyId", "X-Amz-Algorithm")), None)
    if first_auth is None or [value for name, value in raw[:first_auth] if name == "prefix"] != [_quote(prefix)]:
        return None
    operation = tuple((name, None if name == "prefix" else value) for name, value in raw[:first_auth])
    # SigV2 signs a bucket's resource as /bucket/, whatever the addressing
    form = _auth_form(base, urllib.parse.parse_qsl(query, keep_blank_values=True)[first_auth:], bucket, False)
    return None if form is None else dataclasses.replace(form, operation=operation)


def _auth_form(prefix: str, pairs: list[tuple[str, str]], bucket: str, path_style: bool) -> UrlForm | None:
    """The form of the signature parameters `pairs` (decoded, in their order) of a URL that begins with `prefix`."""
    params = dict(pairs)
    order = tuple(name for name, _ in pairs if name != "X-Amz-Signature")  # (SigV4 appends its signature)
    if params.get("X-Amz-Algorithm") == "AWS4-HMAC-SHA256":
        scope = params.get("X-Amz-Credential", "").split("/")  # key id / date / region / service / aws4_request
        if len(scope) != 5 or scope[4] != "aws4_request":
            return None
        return UrlForm(prefix, "s3v4-query", scope[2], scope[3], None, order)
    if {"AWSAccessKeyId", "Signature", "Expires"} <= params.keys():
        return UrlForm(prefix, "s3-query", None, "s3", None if path_style else f"/{bucket}/", order)
    return None


def _stamp(url: str) -> str | None:
    """The time a presigned URL was signed at (SigV4) or expires at (SigV2)."""
    params = dict(urllib.parse.parse_qsl(url.partition("?")[2], keep_blank_values=True))
    return params.get("X-Amz-Date") or params.get("Expires")


@dataclass
class _Learnt:
    """A URL form learnt at its first use, and again after `learned` is cleared."""

    learn: Callable[[], UrlForm | None]
    learned: bool = False
    _form: UrlForm | None = None

    def form(self) -> UrlForm | None:
        if not self.learned:
            self._form = self.learn()
            self.learned = True
        return self._form


class ObjectUrls:
    """GET URLs of `bucket`'s objects, presigned for `lifetime` seconds by `client` (a botocore S3 client)."""

    def __init__(self, client, bucket: str, lifetime: int, clock: Callable[[], float] | None = None):
        self._client = client
        self._bucket = bucket
        self._lifetime = lifetime
        self._clock = clock or time.time  # (looked up here: a test's frozen clock is botocore's too)
        self._objects = _Learnt(self._learn)
        self._listings = _Learnt(self._learn_listing)
        self._keys: _Keys | None = None
        self._signing_key: tuple[tuple[str, str, str, str], bytes] | None = None
        self._v4_cache: tuple[tuple, _V4Second] | None = None

    @property
    def form(self) -> UrlForm | None:
        """The form signed directly (None: every URL goes through botocore's whole pipeline)."""
        return self._objects.form()

    def url(self, key: str, *, fresh: bool = False) -> str:
        """The presigned GET URL of `key`; `fresh`: through botocore's whole pipeline (a refused URL's retry)."""
        form = None if fresh else self.form
        url = self._sign(form, key) if form is not None else None
        return url if url is not None else self._full(key)

    @property
    def listing_form(self) -> UrlForm | None:
        """The form of probe listings signed directly (None: each goes through botocore's whole pipeline)."""
        return self._listings.form()

    def listing(self, prefix: str, *, fresh: bool = False) -> str:
        """The presigned URL of a probe listing: the first page of ListObjectsV2 of the names that start with
        `prefix`, delimited by "/", keys URL-encoded (one per directory looked up: signed here like an object's)."""
        form = None if fresh else self.listing_form
        url = self._sign_listing(form, prefix) if form is not None else None
        return url if url is not None else self._full_listing(prefix)

    def forget(self) -> None:
        """Learn the forms again at the next URL (the credentials changed)."""
        self._objects.learned = self._listings.learned = False
        self._keys = None

    def _full_listing(self, prefix: str) -> str:
        params = {"Bucket": self._bucket, "EncodingType": "url", "Prefix": prefix, "Delimiter": "/"}
        return self._client.generate_presigned_url("list_objects_v2", Params=params, ExpiresIn=self._lifetime)

    def _full(self, key: str) -> str:
        return self._client.generate_presigned_url("get_object", Params={"Bucket": self._bucket, "Key": key},
                                                   ExpiresIn=self._lifetime)

    def _sign(self, form: UrlForm, key: str) -> str | None:
        """An object's URL signed here; None where its parameters are not the form's (the credentials gained or
        lost a session token since it was learnt)."""
        return self._signed(form, quote_key(key), ())

    def _sign_listing(self, form: UrlForm, prefix: str) -> str | None:
        """A probe listing's URL signed here (None as for `_sign`)."""
        value = _quote(prefix)
        return self._signed(form, "", tuple((name, value if fixed is None else fixed) for name, fixed in form.operation))

    def _signed(self, form: UrlForm, tail: str, operation: tuple[tuple[str, str], ...]) -> str | None:
        """The URL `form.prefix + tail` with the request's own query parameters `operation` (encoded), signed."""
        now = int(self._clock())
        keys = self._credentials(form, now)
        if form.version == "s3-query":
            resource = (form.auth_prefix if form.auth_prefix is not None else form.path_prefix) + tail
            params, signature = self._v2(resource, now, keys)
        else:
            params, signature = self._v4(form, form.path_prefix + tail, operation, now, keys)
        if set(params) != set(form.order):
            return None
        query = "&".join([f"{name}={value}" for name, value in operation] + [f"{name}={params[name]}" for name in form.order])
        url = f"{form.prefix}{tail}?{query}"
        return url if signature is None else f"{url}&X-Amz-Signature={signature}"

    def _v2(self, resource: str, now: int, keys: _Keys) -> tuple[dict[str, str], None]:
        """Query-string authentication of signature version 2 (the signature is one of the parameters; a listing's
        own parameters are no sub-resource, so they are not signed)."""
        expires = str(now + self._lifetime)
        amz = f"x-amz-security-token:{keys.token}\n" if keys.token else ""
        digest = hmac.new(keys.secret_key.encode(), f"GET\n\n\n{expires}\n{amz}{resource}".encode(), hashlib.sha1)
        params = {"AWSAccessKeyId": _quote(keys.access_key),
                  "Signature": _quote(base64.b64encode(digest.digest()).decode()), "Expires": expires}
        if keys.token:
            params["x-amz-security-token"] = _quote(keys.token)
        return params, None

    def _v4(self, form: UrlForm, path: str, operation: tuple[tuple[str, str], ...], now: int,
            keys: _Keys) -> tuple[dict[str, str], str]:
        """Query-string authentication of signature version 4, its payload unsigned (as S3 defines presigned
        URLs), the host its one signed header."""
        second = self._v4_second(form, now, keys)
        query = second.query
        if operation:  # (sorted by name, then value: botocore's canonical order)
            query = "&".join(f"{name}={value}" for name, value in sorted([*operation, *second.params.items()]))
        canonical = f"GET\n{path}\n{query}\nhost:{form.host}\n\nhost\nUNSIGNED-PAYLOAD"
        to_sign = f"AWS4-HMAC-SHA256\n{second.stamp}\n{second.scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
        return second.params, hmac.new(second.key, to_sign.encode(), hashlib.sha256).hexdigest()

    def _v4_second(self, form: UrlForm, now: int, keys: _Keys) -> "_V4Second":
        """What every URL signed in this second with these keys shares."""
        cached = self._v4_cache  # (read once: a worker thread's listing may sign beside the event loop's GETs)
        if cached is not None and cached[0] == (now, keys, form.region, form.service):
            return cached[1]
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
        scope = f"{stamp[:8]}/{form.region}/{form.service}/aws4_request"
        params = {"X-Amz-Algorithm": "AWS4-HMAC-SHA256", "X-Amz-Credential": _quote(f"{keys.access_key}/{scope}"),
                  "X-Amz-Date": stamp, "X-Amz-Expires": str(self._lifetime), "X-Amz-SignedHeaders": "host"}
        if keys.token:
            params["X-Amz-Security-Token"] = _quote(keys.token)
        query = "&".join(f"{name}={value}" for name, value in sorted(params.items()))
        shared = _V4Second(params, query, stamp, scope, self._v4_key(keys.secret_key, stamp[:8], form))
        self._v4_cache = ((now, keys, form.region, form.service), shared)
        return shared

    def _v4_key(self, secret: str, date: str, form: UrlForm) -> bytes:
        """The day's signing key (four HMACs, derived once a day per secret)."""
        scope = (secret, date, form.region or "", form.service)
        cached = self._signing_key
        if cached is None or cached[0] != scope:
            key = f"AWS4{secret}".encode()
            for part in (date, form.region or "", form.service, "aws4_request"):
                key = hmac.new(key, part.encode(), hashlib.sha256).digest()
            cached = self._signing_key = (scope, key)
        return cached[1]

    def _credentials(self, form: UrlForm, now: int) -> _Keys:
        """botocore's credentials, asked for again each second (the client's signer: refreshed as botocore does)."""
        keys = self._keys
        if keys is None or keys.second != now:
            signer = self._client._request_signer
            credentials = signer.get_auth_instance(form.service, form.region, form.version,
                                                   expires=self._lifetime).credentials
            keys = self._keys = _Keys(now, credentials.access_key, credentials.secret_key, credentials.token)
        return keys

    def _learn(self) -> UrlForm | None:
        return self._learnt(lambda: self._full(REFERENCE_KEY), learn_form, self._sign)

    def _learn_listing(self) -> UrlForm | None:
        return self._learnt(lambda: self._full_listing(REFERENCE_KEY), learn_listing_form, self._sign_listing)

    def _learnt(self, reference_url: Callable[[], str], learn: Callable[[str, str], UrlForm | None],
                sign: Callable[[UrlForm, str], str | None]) -> UrlForm | None:
        """The form, if signing the reference key with it gives exactly the pipeline's URL (signed in the same
        second: a clock that ticked in between is tried again)."""
        for _ in range(3):
            reference = reference_url()
            form = learn(reference, self._bucket)
            if form is None:
                return None
            try:
                self._keys = None
                mine = sign(form, REFERENCE_KEY)
            except Exception:  # noqa: BLE001 - any failure here only means: stay on the full pipeline
                return None
            if mine is None:
                return None
            if _stamp(mine) == _stamp(reference):
                return form if mine == reference else None
        return None
