"""S3 / MinIO backend on the `minio` client: production storage, same keys as local.

Object `<key>` is `s3://<bucket>/<prefix>/<key>`; its sha256 (and size, rows) ride along as
object metadata (`x-amz-meta-sha256`, ...), so `ref(key)` is one HEAD request. A single PUT
is atomic in S3, so no temp objects are needed; pointers rely on write-then-pointer ordering
(the minio client cannot send conditional-write headers).

Connection from the environment:
    RATCHET_S3_ENDPOINT      host:port (an http:// or https:// prefix is also accepted)
    AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY
    RATCHET_S3_SECURE        1 (default, https) or 0 (plain http)
    AWS_DEFAULT_REGION       default us-east-1
"""

from __future__ import annotations

import io
import logging
import os
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, TypeVar

from ratchet.errors import StoreUnavailable, is_transient
from ratchet.store.base import ArtifactStore

log = logging.getLogger(__name__)
T = TypeVar("T")

_MISSING = {"NoSuchKey", "NoSuchObject", "ResourceNotFound", "NotFound"}


class _Body:
    """A minio response as a closable binary stream that returns its connection to the pool."""

    def __init__(self, resp):
        self._resp = resp

    def read(self, n: int = -1) -> bytes:
        return self._resp.read() if n is None or n < 0 else self._resp.read(n)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._resp.close()
        self._resp.release_conn()


def _parse_meta(headers, size: int) -> dict[str, Any] | None:
    """Our metadata from an object's headers (HEAD or GET: the same object version)."""
    sha = headers.get("x-amz-meta-sha256")
    if not sha:
        return None
    rows = headers.get("x-amz-meta-rows")
    return {"sha256": sha, "size": size, "rows": int(rows) if rows is not None else None}


def client_from_env(retry_budget_s: float = 120.0):
    """A minio client configured from RATCHET_S3_* / AWS_* environment variables, whose requests give
    up within the store's retry budget (`_http`)."""
    from minio import Minio

    endpoint = os.environ.get("RATCHET_S3_ENDPOINT")
    if not endpoint:
        raise RuntimeError("an s3:// store needs RATCHET_S3_ENDPOINT=host:port (and AWS_ACCESS_KEY_ID, "
                           "AWS_SECRET_ACCESS_KEY; RATCHET_S3_SECURE=0 for plain http)")
    secure = os.environ.get("RATCHET_S3_SECURE", "1").strip().lower() not in ("0", "false", "no")
    for scheme, is_secure in (("https://", True), ("http://", False)):
        if endpoint.startswith(scheme):
            endpoint, secure = endpoint[len(scheme):], is_secure
    return Minio(
        endpoint.rstrip("/"),
        access_key=os.environ.get("AWS_ACCESS_KEY_ID"),
        secret_key=os.environ.get("AWS_SECRET_ACCESS_KEY"),
        session_token=os.environ.get("AWS_SESSION_TOKEN"),
        secure=secure,
        region=os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION") or "us-east-1",
        http_client=_http(retry_budget_s),
    )


def _http(retry_budget_s: float):
    """The connection pool of a store's client. minio's own waits 300 s per connect or read and retries
    5 times: a server that accepts and never answers held one call for half an hour, and `_retrying`,
    which checks the budget between calls, with it (the lease heartbeat too). Here a request gives up
    after `timeout` of silence and urllib3 retries nothing but redirects: `_retrying` decides, within
    the budget. The timeouts apply to each socket operation, not to a whole request: a large upload
    that keeps moving is never cut; urllib3 sends a body under the connect timeout, so that one is
    not just a few seconds either."""
    import certifi
    import urllib3

    timeout = min(30.0, max(5.0, retry_budget_s))
    return urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=min(10.0, timeout), read=timeout),
        maxsize=10,                                                        # as minio's
        ca_certs=os.environ.get("SSL_CERT_FILE") or certifi.where(),      # as minio's
        retries=urllib3.Retry(total=None, connect=0, read=0, status=0, other=0, redirect=5),
    )


class S3Store(ArtifactStore):
    """`retry_budget_s`: how long one operation keeps retrying transient failures (connection
    refused, timeouts, 5xx) with backoff before it fails with StoreUnavailable, one line naming
    the store and the operation. The default outlasts a 60 s outage."""

    def __init__(self, uri: str, client=None, retry_budget_s: float = 120.0):
        if not uri.startswith("s3://"):
            raise ValueError(f"not an s3:// URI: {uri!r}")
        bucket, _, prefix = uri[len("s3://"):].partition("/")
        if not bucket:
            raise ValueError(f"s3 URI without a bucket: {uri!r}")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.root_uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.client = client or client_from_env(retry_budget_s)
        self.retry_budget_s = retry_budget_s
        self._retrying("create bucket", "", self._ensure_bucket)

    def _retrying(self, op: str, key: str, fn: Callable[[], T]) -> T:
        """fn(), retried with backoff (0.5 s doubling to 8 s) while it fails transiently, for at
        most retry_budget_s; then StoreUnavailable. Deterministic failures are raised at once."""
        start, delay = time.monotonic(), 0.5
        while True:
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - classified by is_transient
                waited = time.monotonic() - start
                if not is_transient(e):
                    raise
                if waited + delay > self.retry_budget_s:
                    cause = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
                    raise StoreUnavailable(f"store {self.root_uri} unreachable for {waited:.0f} s "
                                           f"(retry budget {self.retry_budget_s:.0f} s) during {op} "
                                           f"{key!r}: {type(e).__name__}: {cause}") from None
                log.warning("store %s: %s %r failed (%s); retrying in %.1f s", self.root_uri, op, key,
                            type(e).__name__, delay)
                time.sleep(delay)
                delay = min(delay * 2, 8.0)

    def _ensure_bucket(self) -> None:
        from minio.error import S3Error

        if self.client.bucket_exists(self.bucket):
            return
        try:
            self.client.make_bucket(self.bucket)
        except S3Error as e:  # created meanwhile by another worker
            if e.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise

    def _name(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _not_found(self, key: str) -> FileNotFoundError:
        return FileNotFoundError(f"{key!r} is not in store {self.root_uri}")

    def _write(self, key: str, data: bytes | Path, sha256: str, size: int, rows: int | None) -> None:
        meta = {"sha256": sha256, "size": str(size)}
        if rows is not None:
            meta["rows"] = str(rows)
        if isinstance(data, Path):
            self._retrying("put", key, lambda: self.client.fput_object(self.bucket, self._name(key), str(data),
                                                                       metadata=meta))
        else:
            self._retrying("put", key, lambda: self.client.put_object(self.bucket, self._name(key), io.BytesIO(data),
                                                                      len(data), metadata=meta))

    def _open(self, key: str) -> tuple[BinaryIO, dict[str, Any] | None]:
        resp = self._found("get", key, lambda: self.client.get_object(self.bucket, self._name(key)))
        size = int(resp.headers.get("content-length", 0))
        return _Body(resp), _parse_meta(resp.headers, size)

    def _meta(self, key: str) -> dict[str, Any] | None:
        st = self._found("stat", key, lambda: self.client.stat_object(self.bucket, self._name(key)))
        return _parse_meta(st.metadata or {}, st.size)

    def _found(self, op: str, key: str, fn: Callable[[], T]) -> T:
        """fn() with retries; an object that is not there is FileNotFoundError (not retried)."""
        from minio.error import S3Error

        def attempt() -> T:
            try:
                return fn()
            except S3Error as e:
                if e.code in _MISSING:
                    raise self._not_found(key) from None
                raise

        return self._retrying(op, key, attempt)

    def _list(self, prefix: str) -> Iterator[str]:
        full = self._name(prefix) if prefix else (f"{self.prefix}/" if self.prefix else "")
        skip = len(self.prefix) + 1 if self.prefix else 0
        names = self._retrying("list", prefix, lambda: [o.object_name for o in self.client.list_objects(
            self.bucket, prefix=full, recursive=True) if not o.is_dir])
        for name in names:
            yield name[skip:]

    def _delete(self, key: str) -> None:
        self._retrying("delete", key, lambda: self.client.remove_object(self.bucket, self._name(key)))
