"""The CSI controller's writes to a bucket (it provisions volumes as prefixes); the mount never writes.

It uses a read client (S3Store: the same session, credentials, retries and error table) and adds the
few writes itself, on that client's botocore client: the read client has no write method."""

from __future__ import annotations

from fusecore.config import StoreConfig
from fusecore.store.client import S3Store
from fusecore.store.errors import NotFound, answer_error, translate


class S3Admin:
    """The few writes the CSI controller makes when it provisions a volume as a prefix."""

    def __init__(self, cfg: StoreConfig):
        self.reader = S3Store(cfg)
        self.bucket = cfg.bucket
        self._client = self.reader.client

    def get_small(self, key: str) -> bytes | None:
        """Body of a small object, or None if there is no such object."""
        try:
            return self._client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except Exception as exc:  # noqa: BLE001 - translated below
            err = translate(exc, f"get {key!r}")
            if isinstance(err, NotFound):
                return None
            raise err from exc

    def put_small(self, key: str, body: bytes) -> None:
        try:
            self._client.put_object(Bucket=self.bucket, Key=key, Body=body)
        except Exception as exc:  # noqa: BLE001 - translated below
            raise translate(exc, f"put {key!r}") from exc

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object whose key starts with `prefix` (which must end in '/'); returns the count."""
        if not prefix.endswith("/"):
            raise ValueError("delete_prefix needs a prefix that ends in '/'")
        deleted, batch = 0, []
        for info in self.reader.list_all(prefix):
            batch.append(info.key)
            if len(batch) == 1000:
                deleted += self.delete_keys(batch)
                batch = []
        return deleted + (self.delete_keys(batch) if batch else 0)

    def delete_keys(self, keys: list[str]) -> int:
        """Delete up to 1000 objects in one request; returns the count."""
        try:
            answer = self._client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True})
        except Exception as exc:  # noqa: BLE001 - translated below
            raise translate(exc, f"delete {len(keys)} objects") from exc
        if answer.get("Errors"):
            first = answer["Errors"][0]
            raise answer_error(None, first.get("Code", ""), f"delete {first.get('Key')!r}", retried=True)
        return len(keys)
