"""Presigned GET URLs of one bucket's objects, signed by botocore's signer without its per-call pipeline.

botocore's `generate_presigned_url` resolves the endpoint rules, validates and serialises the parameters and
emits its events on every call: 0.4-0.5 ms of CPU, paid once per object, so once per file of a small-file
dataset (the largest Python cost of a cold small file, profiled in the data-path issue). Two objects' URLs
differ only by the quoted key, so `ObjectUrls` learns the URL's form once, from one full presign of a
reference key, and then signs each object's URL with the auth class botocore chose there (SigV2 or SigV4
query auth; the client's own signer hands out the instance, so credentials, their refresh and rotation stay
botocore's): ~0.09 ms (SigV2) and ~0.25 ms (SigV4) per URL.

The form is used only where it reproduces the full pipeline's URL for the reference key exactly, signature
included; anything else botocore may do (SigV4a, S3 Express sessions, a future auth)
keeps every URL on the full pipeline. A URL the store refuses is signed again on the full pipeline
(`url(fresh=True)`).
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
import botocore.awsrequest
import botocore.utils

REFERENCE_KEY = "stoker/reference key+~é.bin"  # a key whose quoting shows where the key sits in a URL


@dataclass(frozen=True)
class UrlForm:
    """Where a key goes in this bucket's GET URLs, and how botocore signed them."""

    prefix: str  # the URL up to the quoted key
    version: str  # botocore's auth type: "s3-query" (SigV2) or "s3v4-query"
    region: str | None
    service: str
    auth_prefix: str | None = None  # SigV2 signs the path-style resource (/bucket/key) of a virtual-hosted URL


def quote_key(key: str) -> str:
    """An object key as botocore puts it in a URL's path."""
    return botocore.utils.percent_encode(key, safe="/~")


def learn_form(url: str, bucket: str, key: str = REFERENCE_KEY) -> UrlForm | None:
    """The form of a URL botocore presigned for `bucket`'s `key`; None for a form this module does not reproduce."""
    base, _, query = url.partition("?")
    quoted = quote_key(key)
    if not base.endswith(quoted):
        return None
    params = dict(urllib.parse.parse_qsl(query, keep_blank_values=True))
    if params.get("X-Amz-Algorithm") == "AWS4-HMAC-SHA256":
        scope = params.get("X-Amz-Credential", "").split("/")  # key id / date / region / service / aws4_request
        if len(scope) != 5 or scope[4] != "aws4_request":
            return None
        return UrlForm(base[:-len(quoted)], "s3v4-query", scope[2], scope[3])
    if {"AWSAccessKeyId", "Signature", "Expires"} <= params.keys():
        prefix = base[:-len(quoted)]
        path_style = urllib.parse.urlsplit(prefix).path.startswith(f"/{bucket}/")
        return UrlForm(prefix, "s3-query", None, "s3", None if path_style else f"/{bucket}/")
    return None


def _stamp(url: str) -> str | None:
    """The time a presigned URL was signed at (SigV4) or expires at (SigV2)."""
    params = dict(urllib.parse.parse_qsl(url.partition("?")[2], keep_blank_values=True))
    return params.get("X-Amz-Date") or params.get("Expires")


class ObjectUrls:
    """GET URLs of `bucket`'s objects, presigned for `lifetime` seconds by `client` (a botocore S3 client)."""

    def __init__(self, client, bucket: str, lifetime: int):
        self._client = client
        self._bucket = bucket
        self._lifetime = lifetime
        self._form: UrlForm | None = None
        self._learned = False

    @property
    def form(self) -> UrlForm | None:
        """The form signed directly (None: every URL goes through botocore's whole pipeline)."""
        if not self._learned:
            self._form = self._learn()
            self._learned = True
        return self._form

    def url(self, key: str, *, fresh: bool = False) -> str:
        """The presigned GET URL of `key`; `fresh`: through botocore's whole pipeline (a refused URL's retry)."""
        form = None if fresh else self.form
        if form is None:
            return self._full(key)
        return self._sign(form, key)

    def forget(self) -> None:
        """Learn the form again at the next URL (the credentials changed)."""
        self._learned = False

    def _full(self, key: str) -> str:
        return self._client.generate_presigned_url("get_object", Params={"Bucket": self._bucket, "Key": key},
                                                   ExpiresIn=self._lifetime)

    def _sign(self, form: UrlForm, key: str) -> str:
        quoted = quote_key(key)
        request = botocore.awsrequest.AWSRequest(method="GET", url=form.prefix + quoted)
        if form.auth_prefix is not None:
            request.auth_path = form.auth_prefix + quoted
        auth = self._auth(form)
        auth.add_auth(request)
        return request.url

    def _auth(self, form: UrlForm):
        signer = self._client._request_signer  # the client's signer: its credentials, refreshed as botocore does
        return signer.get_auth_instance(form.service, form.region, form.version, expires=self._lifetime)

    def _learn(self) -> UrlForm | None:
        """The form, if signing the reference key with it gives exactly the pipeline's URL (signed in the same
        second: a clock that ticked in between is tried again)."""
        for _ in range(3):
            reference = self._full(REFERENCE_KEY)
            form = learn_form(reference, self._bucket)
            if form is None:
                return None
            try:
                mine = self._sign(form, REFERENCE_KEY)
            except Exception:  # noqa: BLE001 - any failure here only means: stay on the full pipeline
                return None
            if _stamp(mine) == _stamp(reference):
                return form if mine == reference else None
        return None

