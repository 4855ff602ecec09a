"""Local-directory backend: the embedded default (`.ratchet/store` under the project).

Object `<key>` is the file `<root>/<key>`. Its metadata (sha256, size, rows) is a JSON
sidecar at `<root>/.ratchet/meta/<key>.json`, so listing the data tree shows only data.
Every write goes to a temp file under `<root>/.ratchet/tmp/` and is moved into place with
`os.replace` (atomic on one filesystem): a reader sees the old object or the new, never half.
A temp file is named `<host>-<pid>-<random>`, so those of a writer killed mid-write are found and
removed when the store is next opened on that host.
The two renames (data, then sidecar) happen under an exclusive `flock`, and a reader opens
the data and reads the sidecar under a shared one, so bytes and hash always belong together,
across threads and processes.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from ratchet import faults
from ratchet.scratch import remove_gone
from ratchet.store.base import RESERVED, ArtifactStore, sha256_file

log = logging.getLogger(__name__)


class LocalStore(ArtifactStore):
    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.root_uri = f"file://{self.root.as_posix()}"
        self._tmp = self.root / RESERVED / "tmp"
        self._metaroot = self.root / RESERVED / "meta"
        self._locks = self.root / RESERVED / "locks"
        self._tmp.mkdir(parents=True, exist_ok=True)
        self._locks.mkdir(parents=True, exist_ok=True)
        self._host = socket.gethostname()   # in temp names: a store on a shared disk has writers elsewhere
        gone = remove_gone(self._tmp, rf"{re.escape(self._host)}-(\d+)-", files=True)
        if gone:
            log.warning("store %s: removed %d temp file(s) of writes by processes that are gone", self.root_uri,
                        len(gone))

    def path(self, key: str) -> Path:
        """The local file behind `key` (for tools that need a path, e.g. from_pretrained)."""
        from ratchet.store.base import validate_key

        return self.root / validate_key(key)

    def _meta_path(self, key: str) -> Path:
        return self._metaroot / f"{key}.json"

    def _tmpfile(self) -> Path:
        return self._tmp / f"{self._host}-{os.getpid()}-{uuid.uuid4().hex}"   # getpid now: a fork writes too

    def _locked(self, key: str, exclusive: bool):
        """A lock striped over 256 files by hash of the key (cheap; unrelated keys rarely wait)."""
        return _flock(self._locks / hashlib.sha1(key.encode()).hexdigest()[:2], exclusive)

    def _exclusive(self, name: str):
        return _flock(self._locks / f"op-{name}", exclusive=True)   # a file of its own: never a key's stripe

    def _write(self, key: str, data: bytes | Path, sha256: str, size: int, rows: int | None) -> None:
        dest, meta = self.root / key, self._meta_path(key)
        tmp_data, tmp_meta = self._tmpfile(), self._tmpfile()
        try:
            if isinstance(data, Path):
                shutil.copyfile(data, tmp_data)
            else:
                tmp_data.write_bytes(data)
            dest.parent.mkdir(parents=True, exist_ok=True)
            meta.parent.mkdir(parents=True, exist_ok=True)
            faults.point("store.write")
            with self._locked(key, exclusive=True):
                # The metadata goes first and vouches for the bytes it replaces too, so a crash
                # between the two renames leaves the old object whole and readable, never "corrupt".
                replaces = sha256_file(dest)[0] if dest.is_file() else None
                tmp_meta.write_text(json.dumps({"sha256": sha256, "size": size, "rows": rows, "replaces": replaces}))
                os.replace(tmp_meta, meta)
                faults.point("store.write.between")
                os.replace(tmp_data, dest)
        finally:
            tmp_data.unlink(missing_ok=True)
            tmp_meta.unlink(missing_ok=True)

    def _open(self, key: str) -> tuple[BinaryIO, dict[str, Any] | None]:
        path = self.root / key
        if not path.is_file():
            raise FileNotFoundError(f"{key!r} is not in store {self.root_uri}")
        with self._locked(key, exclusive=False):
            f = open(path, "rb")  # an open file keeps its bytes even if replaced afterwards
            try:
                meta = json.loads(self._meta_path(key).read_text())
            except FileNotFoundError:
                meta = None
        return f, meta

    def _meta(self, key: str) -> dict[str, Any] | None:
        if not (self.root / key).is_file():
            raise FileNotFoundError(f"{key!r} is not in store {self.root_uri}")
        try:
            return json.loads(self._meta_path(key).read_text())
        except FileNotFoundError:
            return None

    def _list(self, prefix: str) -> Iterator[str]:
        head = prefix.rpartition("/")[0]
        start = self.root / head if head else self.root
        if not start.is_dir():
            return
        for dirpath, dirnames, filenames in os.walk(start):
            rel_dir = Path(dirpath).relative_to(self.root).as_posix()
            if rel_dir == ".":
                dirnames[:] = [d for d in dirnames if d != RESERVED]
                rel_dir = ""
            for name in filenames:
                key = f"{rel_dir}/{name}" if rel_dir else name
                if key.startswith(prefix):
                    yield key

    def _delete(self, key: str) -> None:
        (self.root / key).unlink(missing_ok=True)
        self._meta_path(key).unlink(missing_ok=True)


@contextmanager
def _flock(path: Path, exclusive: bool):
    """An flock on `path` (created if absent), exclusive or shared, held for the `with` block."""
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
