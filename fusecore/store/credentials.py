"""What a store client signs with, replaceable while the mount runs (credential rotation).

A mount given explicit credentials never consults the default chain (environment, files, instance
role): the client's botocore session resolves credentials through one provider, ours, whose object
delegates to the current identity. Static keys sign as they are; a web identity is exchanged for
temporary keys by botocore's own AssumeRoleWithWebIdentity fetcher, refreshed before they expire
with whatever token was handed over last (kubelet sends a fresh one with every republish).
"""

from __future__ import annotations

import threading

import botocore.config
import botocore.credentials
import botocore.session

from ..config import Credentials, Identity, WebIdentity

SESSION_SECONDS = 3600  # lifetime asked of STS; botocore refreshes 15 minutes before the end


class _Current:
    """A credential attribute read from the current identity (botocore's setters are ignored)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        return self if obj is None else getattr(obj.get_frozen_credentials(), self.name)

    def __set__(self, obj, value) -> None:
        pass


class RotatingCredentials(botocore.credentials.Credentials):
    """A botocore credentials object whose identity `replace` swaps (thread-safe)."""

    def __init__(self, identity: Identity):
        self._lock = threading.Lock()
        self._identity = identity
        self._inner, self._token = _botocore_credentials(identity)
        self.method = "stoker"

    def replace(self, identity: Identity) -> None:
        """Sign with `identity` from now on. A new token for the same role only replaces the token:
        the temporary keys already fetched stay in use until botocore refreshes them."""
        with self._lock:
            current = self._identity
            if (isinstance(identity, WebIdentity) and isinstance(current, WebIdentity) and self._token is not None
                    and _same_role(identity, current)):
                self._token.token = identity.token
                self._identity = identity
                return
        inner, token = _botocore_credentials(identity)
        with self._lock:
            self._identity, self._inner, self._token = identity, inner, token

    def get_frozen_credentials(self) -> botocore.credentials.ReadOnlyCredentials:
        with self._lock:
            inner = self._inner
        return inner.get_frozen_credentials()

    # botocore reads these directly in a few places; they always reflect the current identity
    access_key = _Current()
    secret_key = _Current()
    token = _Current()


class _TokenHolder:
    def __init__(self, token: str):
        self.token = token

    def __call__(self) -> str:
        return self.token


def _same_role(a: WebIdentity, b: WebIdentity) -> bool:
    return (a.role_arn, a.session_name, a.sts_endpoint_url, a.sts_region) == \
        (b.role_arn, b.session_name, b.sts_endpoint_url, b.sts_region)


def _botocore_credentials(identity: Identity) -> tuple:
    """(botocore credentials, the token holder of a web identity or None)."""
    if isinstance(identity, Credentials):
        return botocore.credentials.Credentials(identity.access_key_id, identity.secret_access_key,
                                                identity.session_token, method="stoker-keys"), None
    token = _TokenHolder(identity.token)
    return _web_identity_credentials(identity, token), token


def _web_identity_credentials(identity: WebIdentity, token: "_TokenHolder"):
    plain = botocore.session.Session()

    def sts_client(service: str, config: botocore.config.Config | None = None):
        return plain.create_client(service, endpoint_url=identity.sts_endpoint_url,
                                   region_name=identity.sts_region or "us-east-1", config=config)

    fetcher = botocore.credentials.AssumeRoleWithWebIdentityCredentialFetcher(
        client_creator=sts_client, web_identity_token_loader=token,
        role_arn=identity.role_arn,
        extra_args={"RoleSessionName": identity.session_name, "DurationSeconds": SESSION_SECONDS})
    return botocore.credentials.DeferredRefreshableCredentials(
        refresh_using=fetcher.fetch_credentials, method="assume-role-with-web-identity")


class _Provider(botocore.credentials.CredentialProvider):
    METHOD = "stoker"
    CANONICAL_NAME = "custom-stoker"

    def __init__(self, credentials: RotatingCredentials):
        super().__init__()
        self._credentials = credentials

    def load(self) -> RotatingCredentials:
        return self._credentials


def use_only(core: botocore.session.Session, credentials: RotatingCredentials) -> None:
    """Make a botocore session sign with `credentials` only (no default chain behind them)."""
    core.register_component("credential_provider", botocore.credentials.CredentialResolver([_Provider(credentials)]))
