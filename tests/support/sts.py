"""STS for web identities, by AWS's rules, in front of moto's STS.

AWS STS takes AssumeRoleWithWebIdentity unsigned and checks the token against the identity provider
(signature, audience, expiry); moto's server, with IAM enforcement on, crashes on unsigned requests
and checks no token. So this small server does what AWS does first: it accepts only tokens the test's
"identity provider" (`issue`) handed out and has not revoked, records each exchange, then forwards the
call to moto signed with an administrator's key, and hands back moto's answer (optionally with a
shorter lifetime, to make the client refresh soon).
"""

from __future__ import annotations

import http.client
import re
import threading
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import botocore.auth
import botocore.awsrequest
import botocore.credentials

_INVALID = ('<ErrorResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/"><Error><Type>Sender</Type>'
            "<Code>InvalidIdentityToken</Code><Message>{}</Message></Error><RequestId>x</RequestId></ErrorResponse>")


class WebIdentitySts:
    def __init__(self, moto_endpoint: str, admin_key: str, admin_secret: str, region: str = "us-east-1"):
        self.upstream = urlparse(moto_endpoint)
        self.signer = botocore.auth.SigV4Auth(botocore.credentials.Credentials(admin_key, admin_secret), "sts", region)
        self.valid: set[str] = set()
        self.exchanges: list[tuple[str, str, str]] = []  # (token, role arn, session name)
        self.lifetime: float | None = None  # seconds the handed-out keys live; None: moto's answer
        self._lock = threading.Lock()
        self._counter = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, answer = outer._answer(body)
                self.send_response(status)
                self.send_header("Content-Type", "text/xml")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def issue(self, subject: str) -> str:
        """A new token for `subject` (what the API server's TokenRequest would hand kubelet)."""
        with self._lock:
            self._counter += 1
            token = f"token-{self._counter}-{subject}"
            self.valid.add(token)
            return token

    def revoke(self, token: str) -> None:
        with self._lock:
            self.valid.discard(token)

    def _answer(self, body: bytes) -> tuple[int, bytes]:
        form = {k: v[0] for k, v in parse_qs(body.decode()).items()}
        if form.get("Action") != "AssumeRoleWithWebIdentity":
            return 400, _INVALID.format("only AssumeRoleWithWebIdentity is served here").encode()
        token = form.get("WebIdentityToken", "")
        with self._lock:
            if token not in self.valid:
                return 400, _INVALID.format("the token is expired or was never issued").encode()
            self.exchanges.append((token, form.get("RoleArn", ""), form.get("RoleSessionName", "")))
        request = botocore.awsrequest.AWSRequest(
            method="POST", url=f"{self.upstream.scheme}://{self.upstream.netloc}/", data=body,
            headers={"Content-Type": "application/x-www-form-urlencoded; charset=utf-8"})
        self.signer.add_auth(request)
        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=30)
        conn.request("POST", "/", body=body, headers=dict(request.headers.items()))
        resp = conn.getresponse()
        answer = resp.read()
        conn.close()
        if resp.status == 200 and self.lifetime is not None:
            ends = (datetime.now(timezone.utc) + timedelta(seconds=self.lifetime)).strftime("%Y-%m-%dT%H:%M:%SZ")
            answer = re.sub(rb"<Expiration>[^<]*</Expiration>", f"<Expiration>{ends}</Expiration>".encode(), answer)
        return resp.status, answer

    def __enter__(self) -> "WebIdentitySts":
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
