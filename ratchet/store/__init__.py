"""The artifact store: what every stage reads from and writes to (DESIGN.md, "Contracts").

    from ratchet.store import open_store, store_for, Ref
    store = open_store(cfg.store.uri)          # a path / file:// URI, or s3://bucket/prefix
    ref = store.write_table("runs/r1/waves/0/trajectories.parquet", frame)
    frame = store_for(ref).read_table(ref)     # in another task, maybe on another machine

Backends: `LocalStore` (local directory, the default) and `S3Store` (MinIO / any S3, on the
`minio` client). Both keep a sha256 with every object and verify it on the way back.
`RunLease` (lease.py) keeps one writer per run id on either backend.
"""

from __future__ import annotations

import threading

from ratchet.store.base import MANIFEST, ArtifactStore, IntegrityError, Ref, _known_root, validate_key
from ratchet.store.lease import LeaseHeld, LeaseLost, RunLease
from ratchet.store.local import LocalStore
from ratchet.store.s3 import S3Store

__all__ = [
    "ArtifactStore", "IntegrityError", "LeaseHeld", "LeaseLost", "LocalStore", "MANIFEST", "Ref", "RunLease",
    "S3Store",
    "open_store", "store_for", "validate_key",
]

_STORES: dict[str, ArtifactStore] = {}
"""Stores opened in this process, by root URI (store_for reuses them)."""
_LOCK = threading.Lock()


def open_store(uri: str) -> ArtifactStore:
    """Open (creating if missing) the store at `uri`: a path or file:// URI -> LocalStore;
    s3://bucket/prefix -> S3Store, connection from RATCHET_S3_ENDPOINT / AWS_* variables."""
    uri = str(uri)
    if uri.startswith("s3://"):
        store: ArtifactStore = S3Store(uri)
    elif uri.startswith("file://"):
        store = LocalStore(uri[len("file://"):])
    elif "://" in uri:
        raise ValueError(f"unsupported store URI {uri!r}: use a path, file:///path or s3://bucket/prefix")
    else:
        store = LocalStore(uri)
    with _LOCK:
        _STORES[store.root_uri] = store
    return store


def store_for(ref: Ref) -> ArtifactStore:
    """The store `ref` lives in (one cached instance per root)."""
    root = ref.root if ref.root is not None else _known_root(ref.uri)
    with _LOCK:
        store = _STORES.get(root)
    return store if store is not None else open_store(root)

