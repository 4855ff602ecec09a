"""The artifact store: what every stage reads from and writes to (DESIGN.md, "Contracts").

    from ratchet.store import open_store, store_for, Ref
    store = open_store(cfg.store)              # a StoreConfig, or a path / file:// URI / s3://bucket/prefix
    ref = store.write_table("runs/r1/waves/0/trajectories.parquet", frame)
    frame = store_for(ref).read_table(ref)     # in another task, maybe on another machine

Backends: `LocalStore` (local directory, the default) and `S3Store` (MinIO / any S3, on the
`minio` client). Both keep a sha256 with every object and verify it on the way back.
`RunLease` (lease.py) keeps one writer per run id on either backend.
"""

from __future__ import annotations

import hashlib
import json
import threading
import uuid
from datetime import datetime, timezone

from ratchet.config import StoreConfig
from ratchet.store.base import MANIFEST, RESERVED, ArtifactStore, IntegrityError, Ref, _known_root, validate_key
from ratchet.store.lease import LeaseHeld, LeaseLost, RunLease
from ratchet.store.local import LocalStore
from ratchet.store.s3 import S3Store

__all__ = [
    "ArtifactStore", "IntegrityError", "LeaseHeld", "LeaseLost", "LocalStore", "MANIFEST", "Ref", "RunLease",
    "S3Store", "StoreLost",
    "open_store", "store_for", "validate_key",
]

_STORES: dict[str, ArtifactStore] = {}
"""Stores opened in this process, by root URI (store_for reuses them)."""
_IDENTITY: dict[str, str] = {}
"""The id of each store this process has opened (`.ratchet/store.json`), by root URI."""
_LOCK = threading.Lock()
IDENTITY_KEY = f"{RESERVED}/store.json"


class StoreLost(RuntimeError):
    """The store no longer holds what it held earlier in this process (emptied, recreated)."""


def open_store(uri, retry_budget_s: float | None = None) -> ArtifactStore:
    """Open (creating if missing) the store at `uri`: a path or file:// URI -> LocalStore;
    s3://bucket/prefix -> S3Store, connection from RATCHET_S3_ENDPOINT / AWS_* variables.
    `uri` may also be a StoreConfig (its uri and retry budget are used).

    A store is identified by `.ratchet/store.json`, written when it is first created. Opening
    again a store this process has opened before checks that id: a bucket emptied or recreated
    mid-run (a restarted S3 server without its data) is `StoreLost`, never a fresh, empty store."""
    if isinstance(uri, StoreConfig):
        uri, retry_budget_s = uri.uri, uri.retry_budget_s
    uri = str(uri)
    if uri.startswith("s3://"):
        store: ArtifactStore = S3Store(uri) if retry_budget_s is None else S3Store(uri, retry_budget_s=retry_budget_s)
    elif uri.startswith("file://"):
        store = LocalStore(uri[len("file://"):])
    elif "://" in uri:
        raise ValueError(f"unsupported store URI {uri!r}: use a path, file:///path or s3://bucket/prefix")
    else:
        store = LocalStore(uri)
    _check_identity(store)
    with _LOCK:
        _STORES[store.root_uri] = store
    return store


def _check_identity(store: ArtifactStore) -> None:
    # one process at a time (a local store): two that open a fresh store together would each write an
    # id, and the one whose id was overwritten would stop at its next open with a false StoreLost. S3
    # has no lock: two processes creating one fresh bucket prefix in the same moment can still race.
    with store._exclusive("identity"):
        _check_identity_locked(store)


def _check_identity_locked(store: ArtifactStore) -> None:
    try:
        stream, _ = store._open(IDENTITY_KEY)
        with stream:
            found = json.loads(stream.read()).get("store_id")
    except FileNotFoundError:
        found = None
    except ValueError:   # unreadable marker: rewrite it only for a store this process has not seen
        found = None
    with _LOCK:
        seen = _IDENTITY.get(store.root_uri)
    if seen is not None and found != seen:
        what = "its identity marker is gone" if found is None else f"it now has another id ({found})"
        raise StoreLost(f"store {store.root_uri} lost the objects it held earlier in this run: {what} "
                        f"(expected id {seen}); was the bucket emptied or the S3 server restarted without "
                        f"its data? Nothing more is written to it.")
    if found is None:
        found = uuid.uuid4().hex
        data = json.dumps({"store_id": found, "created_at": datetime.now(timezone.utc).isoformat()}).encode()
        store._write(IDENTITY_KEY, data, hashlib.sha256(data).hexdigest(), len(data), None)
    with _LOCK:
        _IDENTITY[store.root_uri] = found


def store_for(ref: Ref) -> ArtifactStore:
    """The store `ref` lives in (one cached instance per root)."""
    root = ref.root if ref.root is not None else _known_root(ref.uri)
    with _LOCK:
        store = _STORES.get(root)
    return store if store is not None else open_store(root)

