"""The artifact store contract: `Ref`, `ArtifactStore`, key rules, integrity errors.

Stages hand each other `Ref`s (URI + sha256 + size [+ rows]), never big objects. Every
backend (local directory, S3/MinIO) implements the same handful of byte-level primitives;
everything else (JSON, Parquet tables, directories with a manifest, pointers) is built here
on top of them, once, so both backends behave identically and use the same keys.

    store = open_store(".ratchet/store")
    ref = store.write_table("runs/r1/waves/0/trajectories.parquet", df)
    df2 = store_for(ref).read_table(ref)          # sha256 checked on the way back
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import posixpath
import uuid
from abc import ABC, abstractmethod
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from pydantic import BaseModel, ConfigDict, Field

from ratchet import faults
from ratchet.errors import picklable

MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = "ratchet-manifest/1"
POINTER_FORMAT = "ratchet-pointer/1"
RESERVED = ".ratchet"
"""First key component reserved for the store's own bookkeeping (local temp files, sidecars)."""
CHUNK = 1 << 20


@picklable
class IntegrityError(Exception):
    """Stored bytes do not match the sha256 they were written (or referenced) with."""

    def __init__(self, key: str, expected: str, actual: str, where: str = "", hint: str = ""):
        self.key, self.expected, self.actual = key, expected, actual
        at = f" in {where}" if where else ""
        super().__init__(f"sha256 mismatch for {key!r}{at}: expected {expected}, got {actual}" + (f" ({hint})" if hint else ""))


class Ref(BaseModel):
    """A reference to one stored object: what tasks hand each other (JSON-serialisable)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    uri: str = Field(description="Full URI: file:///abs/root/<key> or s3://bucket/prefix/<key>.")
    sha256: str = Field(description="Hex sha256 of the object's bytes.")
    size: int = Field(ge=0, description="Size in bytes.")
    rows: int | None = Field(None, ge=0, description="Row count, for tables.")
    root: str | None = Field(None, description="Root URI of the store the object lives in.")

    @property
    def key(self) -> str:
        """The key relative to the store root."""
        root = self.root if self.root is not None else _known_root(self.uri)
        if not self.uri.startswith(root.rstrip("/") + "/"):
            raise ValueError(f"Ref uri {self.uri!r} is not under its root {root!r}")
        return self.uri[len(root.rstrip("/")) + 1:]

    def sibling(self, name: str) -> str:
        """Key of a file next to this one: Ref(.../waves/3/trajectories.parquet).sibling("scored.parquet")."""
        return validate_key(posixpath.join(posixpath.dirname(self.key), name))


def _known_root(uri: str) -> str:
    """Root of a Ref made without one: the longest root of a store opened in this process."""
    from ratchet.store import _STORES  # late: the cache lives with open_store

    roots = [r for r in _STORES if uri.startswith(r.rstrip("/") + "/")]
    if not roots:
        raise ValueError(f"Ref {uri!r} carries no root and no open store contains it; open the store first")
    return max(roots, key=len)


def validate_key(key: str) -> str:
    """Return `key` if it is a valid store key, else raise a ValueError naming it."""
    def bad(why: str) -> ValueError:
        return ValueError(f"invalid store key {key!r}: {why}")

    if not isinstance(key, str) or not key:
        raise bad("a key is a non-empty string")
    if key.startswith("/"):
        raise bad("keys are relative to the store root (no leading '/')")
    if "\\" in key or "\x00" in key:
        raise bad("no backslashes or NUL bytes")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise bad("no empty, '.' or '..' path components (nor a trailing '/')")
    if RESERVED in parts:
        raise bad(f"{RESERVED!r} is reserved for the store's own bookkeeping")
    return key


def sha256_file(path: str | Path) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


class ArtifactStore(ABC):
    """Keys -> bytes with a sha256 on every write. Backends implement the `_`-primitives."""

    root_uri: str

    # --- backend primitives -------------------------------------------------------------
    @abstractmethod
    def _write(self, key: str, data: bytes | Path, sha256: str, size: int, rows: int | None) -> None:
        """Store `data` (bytes, or a local file to upload) atomically, with its metadata."""

    @abstractmethod
    def _open(self, key: str) -> tuple[BinaryIO, dict[str, Any] | None]:
        """A readable stream of the object and the metadata stored with those very bytes
        (as `_meta`); FileNotFoundError naming the key if absent."""

    @abstractmethod
    def _meta(self, key: str) -> dict[str, Any] | None:
        """Stored metadata {sha256, size, rows}; None if the object exists without it.
        FileNotFoundError if the object does not exist."""

    @abstractmethod
    def _list(self, prefix: str) -> Iterator[str]:
        """Keys starting with `prefix` (any order)."""

    @abstractmethod
    def _delete(self, key: str) -> None:
        """Remove the object; no error if absent."""

    # --- refs and keys ------------------------------------------------------------------
    def uri(self, key: str) -> str:
        return f"{self.root_uri}/{validate_key(key)}"

    def _make_ref(self, key: str, sha256: str, size: int, rows: int | None = None) -> Ref:
        return Ref(uri=self.uri(key), sha256=sha256, size=size, rows=rows, root=self.root_uri)

    def _key(self, key_or_ref: str | Ref) -> tuple[str, str | None]:
        """(key, expected sha256 or None)."""
        if isinstance(key_or_ref, Ref):
            root = key_or_ref.root
            if (root is not None and root != self.root_uri) or not key_or_ref.uri.startswith(self.root_uri + "/"):
                raise ValueError(
                    f"{key_or_ref.uri!r} lives in store {root or '?'}, not {self.root_uri}; use store_for(ref)"
                )
            return validate_key(key_or_ref.uri[len(self.root_uri) + 1:]), key_or_ref.sha256
        return validate_key(key_or_ref), None

    def exists(self, key: str) -> bool:
        try:
            self._meta(validate_key(key))
            return True
        except FileNotFoundError:
            return False

    def list(self, prefix: str = "") -> list[str]:
        """Keys that start with `prefix` (a plain string prefix, as S3 lists), sorted."""
        if prefix.startswith("/") or ".." in prefix.split("/"):
            raise ValueError(f"invalid store prefix {prefix!r}")
        return sorted(k for k in self._list(prefix) if RESERVED not in k.split("/"))   # nor a nested store's

    def delete(self, key: str) -> None:
        self._delete(validate_key(key))

    @contextmanager
    def _exclusive(self, name: str) -> Iterator[None]:
        """Serialize a read-then-write named `name` across the processes that open this store, where the
        backend can: a local store takes an flock; S3 has no lock to take, and this yields at once."""
        yield

    def move_aside(self, key: str, dest: str) -> None:
        """Move an object to `dest` as it is stored, its bytes and the metadata that vouches for them,
        unverified: what is set aside is often what failed verification, and reads there fail as they
        did here. FileNotFoundError if `key` is absent."""
        key, dest = validate_key(key), validate_key(dest)
        stream, meta = self._open(key)
        with stream:
            data = stream.read()
        meta = meta or {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
        self._write(dest, data, meta["sha256"], meta.get("size", len(data)), meta.get("rows"))
        self._delete(key)

    def ref(self, key: str) -> Ref:
        """Stat an existing object (FileNotFoundError if absent)."""
        key = validate_key(key)
        meta = self._meta(key)
        if meta is None or meta.get("replaces"):  # not written by ratchet, or an overwrite: hash what is there
            h, size = self._hash_stream(key)
            if meta is None or h != meta["sha256"]:
                return self._make_ref(key, h, size)
        return self._make_ref(key, meta["sha256"], int(meta["size"]), meta.get("rows"))

    def _hash_stream(self, key: str) -> tuple[str, int]:
        h, size = hashlib.sha256(), 0
        f, _ = self._open(key)
        with f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
                size += len(chunk)
        return h.hexdigest(), size

    def _verify(self, key: str, from_ref: str | None, meta: dict[str, Any] | None, actual: str) -> None:
        """Raise IntegrityError unless `actual` is the Ref's sha256 (if given), else one the stored
        metadata vouches for: the object's, or the one it `replaces` (a local overwrite interrupted
        between its two renames leaves the previous bytes under the new metadata: still whole)."""
        if from_ref is not None:
            accepted: tuple[str, ...] = (from_ref,)
        elif meta:
            accepted = tuple(s for s in (meta["sha256"], meta.get("replaces")) if s)
        else:
            return
        if actual not in accepted:
            raise self._mismatch(key, accepted[0], actual, meta)

    def _mismatch(self, key: str, expected: str, actual: str, meta: dict[str, Any] | None) -> IntegrityError:
        hint = ("the object was overwritten after this Ref was made"
                if meta and meta["sha256"] == actual else "the stored bytes are corrupt")
        return IntegrityError(key, expected, actual, self.root_uri, hint)

    # --- bytes and files ----------------------------------------------------------------
    def put_bytes(self, key: str, data: bytes, rows: int | None = None) -> Ref:
        key = validate_key(key)
        data = bytes(data)
        digest = hashlib.sha256(data).hexdigest()
        self._write(key, data, digest, len(data), rows)
        return self._make_ref(key, digest, len(data), rows)

    def get_bytes(self, key_or_ref: str | Ref, verify: bool = True) -> bytes:
        """The object's bytes. verify: check the sha256 (the Ref's, else the stored one)."""
        key, expected = self._key(key_or_ref)
        f, meta = self._open(key)
        with f:
            data = f.read()
        if verify:
            self._verify(key, expected, meta, hashlib.sha256(data).hexdigest())
        return data

    def put_file(self, key: str, path: str | Path) -> Ref:
        key, path = validate_key(key), Path(path)
        digest, size = sha256_file(path)
        self._write(key, path, digest, size, None)
        return self._make_ref(key, digest, size)

    def get_file(self, key_or_ref: str | Ref, dest_path: str | Path, verify: bool = True) -> Path:
        """Download to `dest_path` (atomically: a temp file next to it, then os.replace)."""
        key, expected = self._key(key_or_ref)
        dest = Path(dest_path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:12]}.part")
        h = hashlib.sha256()
        try:
            src, meta = self._open(key)
            with src, open(tmp, "wb") as out:
                while chunk := src.read(CHUNK):
                    h.update(chunk)
                    out.write(chunk)
            if verify:
                self._verify(key, expected, meta, h.hexdigest())
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        return dest

    # --- JSON and tables ----------------------------------------------------------------
    def put_json(self, key: str, obj: Any) -> Ref:
        """JSON-encode `obj` (pydantic models are dumped in JSON mode)."""
        if isinstance(obj, BaseModel):
            obj = obj.model_dump(mode="json")
        return self.put_bytes(key, json.dumps(obj, indent=2, ensure_ascii=False).encode())

    def get_json(self, key_or_ref: str | Ref, verify: bool = True) -> Any:
        return json.loads(self.get_bytes(key_or_ref, verify=verify))

    def write_table(self, key: str, df) -> Ref:
        """Write a polars DataFrame as Parquet; the Ref carries its row count."""
        import polars as pl

        if not isinstance(key, str) or not isinstance(df, pl.DataFrame):
            raise TypeError(f"write_table(key, df) takes a str key and a polars DataFrame, got "
                            f"({type(key).__name__}, {type(df).__name__})")
        buf = io.BytesIO()
        df.write_parquet(buf)
        return self.put_bytes(key, buf.getvalue(), rows=df.height)

    def read_table(self, key_or_ref: str | Ref, verify: bool = True):
        import polars as pl

        return pl.read_parquet(io.BytesIO(self.get_bytes(key_or_ref, verify=verify)))

    # --- directories --------------------------------------------------------------------
    def put_dir(self, prefix: str, local_dir: str | Path) -> Ref:
        """Upload every file under `local_dir` to `<prefix>/<relative path>`, then write
        `<prefix>/MANIFEST.json` (relative path -> sha256, size) LAST; return its Ref.
        A reader that finds the manifest finds every file it lists."""
        prefix = validate_key(prefix.rstrip("/"))
        root = Path(local_dir)
        if not root.is_dir():
            raise NotADirectoryError(f"put_dir: {root} is not a directory")
        files: dict[str, dict[str, Any]] = {}
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            rel = path.relative_to(root).as_posix()
            if rel == MANIFEST:
                raise ValueError(f"put_dir: {path} would clash with the manifest written at {prefix}/{MANIFEST}")
            if files:
                faults.point("store.put_dir")
            ref = self.put_file(f"{prefix}/{rel}", path)
            files[rel] = {"sha256": ref.sha256, "size": ref.size}
        return self.put_json(f"{prefix}/{MANIFEST}", {"format": MANIFEST_FORMAT, "files": files})

    def get_dir(self, manifest_ref_or_key: str | Ref, local_dir: str | Path, verify: bool = True) -> Path:
        """Download every file the manifest lists into `local_dir`, each checked against it.
        Accepts the manifest's Ref, its key, or the directory prefix."""
        if isinstance(manifest_ref_or_key, str) and posixpath.basename(manifest_ref_or_key) != MANIFEST:
            manifest_ref_or_key = f"{manifest_ref_or_key.rstrip('/')}/{MANIFEST}"
        mkey, _ = self._key(manifest_ref_or_key)
        manifest = self.get_json(manifest_ref_or_key, verify=verify)
        if manifest.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"{mkey} is not a ratchet manifest (format {manifest.get('format')!r})")
        prefix, dest = posixpath.dirname(mkey), Path(local_dir)
        dest.mkdir(parents=True, exist_ok=True)
        for rel, entry in manifest["files"].items():
            key = validate_key(f"{prefix}/{rel}")
            ref = self._make_ref(key, entry["sha256"], entry["size"])
            self.get_file(ref, dest / rel, verify=verify)
        return dest

    # --- pointers -----------------------------------------------------------------------
    def set_pointer(self, key: str, target: Ref) -> Ref:
        """Write a small JSON pointer to `target` (e.g. runs/<id>/checkpoints/LATEST).
        The target must already be stored: write-then-pointer ordering is the atomic handoff.
        The pointer names the target by key, so a store copied elsewhere keeps its pointers."""
        tkey, _ = self._key(target)
        if not self.exists(tkey):
            raise FileNotFoundError(f"set_pointer({key!r}): target {target.uri} is not in the store; write it first")
        doc = {"format": POINTER_FORMAT, "key": tkey, "sha256": target.sha256, "size": target.size, "rows": target.rows}
        return self.put_json(key, doc)

    def get_pointer(self, key: str) -> Ref | None:
        """The Ref a pointer names, or None if the pointer does not exist."""
        if not self.exists(key):
            return None
        doc = self.get_json(key)
        if not isinstance(doc, dict) or doc.get("format") != POINTER_FORMAT:
            raise ValueError(f"{key!r} in {self.root_uri} is not a ratchet pointer")
        return self._make_ref(validate_key(doc["key"]), doc["sha256"], doc["size"], doc.get("rows"))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.root_uri!r})"
