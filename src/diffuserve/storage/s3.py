"""The S3-compatible media store (`--media-store s3://bucket/prefix`): result files as objects.

boto3 reads credentials and region the standard way (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
AWS_SESSION_TOKEN, AWS_REGION or AWS_DEFAULT_REGION, AWS_ENDPOINT_URL, profiles, instance roles);
`--s3-endpoint-url` names a non-AWS server (MinIO, SeaweedFS, Ceph, R2), addressed path-style. An object
is visible only once its upload is complete (S3's own guarantee), so a reader never sees half a file;
the results store uploads before it commits the row and deletes after the row is gone.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit

from diffuserve.errors import ConfigError
from diffuserve.storage.media import StoreUnavailableError, safe_name

FLAG = "--media-store"


def parse_s3_url(url: str) -> tuple[str, str]:
    """`s3://bucket/prefix` -> (bucket, "prefix/") (the prefix may be empty); ConfigError otherwise."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
        raise ConfigError(f"{FLAG}: {url!r} is not an S3 URL; give s3://BUCKET or s3://BUCKET/PREFIX.")
    prefix = parts.path.strip("/")
    return parts.netloc, f"{prefix}/" if prefix else ""


def _without_userinfo(url: str) -> str:
    """scheme://host[:port] of an endpoint URL: whatever else it carries (a user, a key) is never shown."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")


class S3Media:
    """Objects `<prefix><id>/<name>` in one bucket."""

    def __init__(
        self, url: str, *, endpoint_url: str | None = None, create_bucket: bool = False, timeout_s: float = 10.0
    ):
        import boto3
        from botocore.config import Config

        self.bucket, self.prefix = parse_s3_url(url)
        self.name = f"{FLAG} {url}"
        endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        # A non-AWS endpoint (an IP, a cluster Service name) has no bucket sub-domains: address path-style.
        config = Config(
            connect_timeout=timeout_s,
            read_timeout=max(timeout_s, 30.0),
            retries={"max_attempts": 2, "mode": "standard"},
            s3={"addressing_style": "path" if endpoint else "auto"},
        )
        self.client = boto3.session.Session().client("s3", endpoint_url=endpoint_url or None, config=config)
        self.where: dict[str, Any] = {
            "kind": "s3",
            "endpoint": _without_userinfo(endpoint) if endpoint else "AWS (the default endpoint)",
            "bucket": self.bucket,
            "prefix": self.prefix,
        }
        self._check(create_bucket, endpoint)

    def _check(self, create_bucket: bool, endpoint: str | None) -> None:
        """At start-up: the endpoint answers, the credentials are accepted, the bucket exists (or is made)."""
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        where = f" at {endpoint}" if endpoint else ""
        try:
            self.client.head_bucket(Bucket=self.bucket)
            return
        except NoCredentialsError:
            raise ConfigError(
                f"{self.name}: no S3 credentials; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "(or a profile / instance role)."
            ) from None
        except ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status in (401, 403):
                raise ConfigError(
                    f"{self.name}: the S3 server{where} refused the credentials for bucket "
                    f"{self.bucket!r} (HTTP {status}); check AWS_ACCESS_KEY_ID / "
                    "AWS_SECRET_ACCESS_KEY and the bucket's policy."
                ) from None
            if status != 404:
                raise ConfigError(
                    f"{self.name}: the S3 server{where} answered HTTP {status} for bucket {self.bucket!r}: {exc}."
                ) from None
        except BotoCoreError as exc:
            raise ConfigError(
                f"{self.name}: cannot reach the S3 server{where} ({exc}); check --s3-endpoint-url "
                "(or AWS_ENDPOINT_URL) and AWS_REGION."
            ) from None
        if not create_bucket:
            raise ConfigError(
                f"{self.name}: bucket {self.bucket!r} does not exist{where}; create it, or start "
                "with --media-store-create-bucket."
            )
        try:
            self.client.create_bucket(Bucket=self.bucket)
        except (BotoCoreError, ClientError) as exc:
            raise ConfigError(f"{self.name}: cannot create bucket {self.bucket!r}{where} ({exc}).") from None

    def _key(self, rid: str, name: str = "") -> str:
        return f"{self.prefix}{safe_name(rid)}/{safe_name(name) if name else ''}"

    def _call(self, method: str, **kwargs: Any) -> Any:
        """One S3 call; a connection error or a server error is a 503 naming the store."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return getattr(self.client, method)(**kwargs)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                raise
            raise StoreUnavailableError(f"The media store ({self.name}) failed: {exc}.", retry_after_s=2.0) from exc
        except BotoCoreError as exc:
            raise StoreUnavailableError(
                f"The media store ({self.name}) is unavailable: {exc}. Retry once it is back.", retry_after_s=2.0
            ) from exc

    def put(self, rid: str, files: dict[str, bytes]) -> int:
        for name, data in files.items():
            self._call("put_object", Bucket=self.bucket, Key=self._key(rid, name), Body=data)
        return sum(len(data) for data in files.values())

    def get(self, rid: str, name: str) -> bytes | None:
        from botocore.exceptions import ClientError

        try:
            reply = self._call("get_object", Bucket=self.bucket, Key=self._key(rid, name))
        except ClientError:
            return None
        return reply["Body"].read()

    def _objects(self, prefix: str) -> list[dict[str, Any]]:
        objects: list[dict[str, Any]] = []
        token: dict[str, str] = {}
        while True:
            page = self._call("list_objects_v2", Bucket=self.bucket, Prefix=prefix, **token)
            objects.extend(page.get("Contents", []))
            if not page.get("IsTruncated"):
                return objects
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def _delete(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            chunk = [{"Key": key} for key in keys[start : start + 1000]]
            self._call("delete_objects", Bucket=self.bucket, Delete={"Objects": chunk, "Quiet": True})

    def remove(self, rid: str) -> None:
        keys = [obj["Key"] for obj in self._objects(self._key(rid))]
        if keys:
            self._delete(keys)

    def remove_orphans(self, known: set[str], now: float, grace_s: float) -> list[str]:
        by_id: dict[str, list[dict[str, Any]]] = {}
        for obj in self._objects(self.prefix):
            rid, _, _ = obj["Key"][len(self.prefix) :].partition("/")
            by_id.setdefault(rid, []).append(obj)
        removed = []
        for rid, objects in by_id.items():
            newest = max(obj["LastModified"].timestamp() for obj in objects)
            if rid not in known and now - newest > grace_s:
                self._delete([obj["Key"] for obj in objects])
                removed.append(rid)
        return removed

    def presign(self, rid: str, name: str, expires_s: int) -> str | None:
        return self.client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": self._key(rid, name)}, ExpiresIn=expires_s
        )

    def close(self) -> None:
        self.client.close()
