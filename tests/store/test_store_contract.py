"""The artifact-store contract, run against both backends: local directory and S3 (moto on loopback).

    .venv/bin/pytest -q tests/store
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import polars as pl
import pytest

from ratchet.store import MANIFEST, IntegrityError, LocalStore, Ref, S3Store, open_store, store_for


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return open_store(str(tmp_path / "store"))
    return open_store(request.getfixturevalue("s3_store_uri"))


def tamper(store, key: str, data: bytes, keep_metadata: bool = True) -> None:
    """Overwrite the stored bytes behind the store's back (bit rot, a stray writer)."""
    if isinstance(store, LocalStore):
        (store.root / key).write_bytes(data)
        if not keep_metadata:
            store._meta_path(key).unlink()
    else:
        meta = None
        if keep_metadata:
            stat = store.client.stat_object(store.bucket, store._name(key))
            meta = {"sha256": stat.metadata["x-amz-meta-sha256"], "size": str(stat.size)}
        store.client.put_object(store.bucket, store._name(key), io.BytesIO(data), len(data), metadata=meta)


# --- round trips ----------------------------------------------------------------------

def test_bytes_roundtrip_and_ref(store):
    ref = store.put_bytes("runs/r1/summary.bin", b"\x00hello\xff")
    assert ref.uri == f"{store.root_uri}/runs/r1/summary.bin"
    assert ref.key == "runs/r1/summary.bin"
    assert ref.size == 7 and ref.rows is None
    assert ref.sha256 == hashlib.sha256(b"\x00hello\xff").hexdigest()
    assert store.get_bytes(ref) == b"\x00hello\xff"
    assert store.get_bytes("runs/r1/summary.bin") == b"\x00hello\xff"
    assert store.ref("runs/r1/summary.bin") == ref
    assert store.exists("runs/r1/summary.bin") and not store.exists("runs/r1/other")


def test_ref_serialises_and_finds_its_store(store):
    ref = store.put_json("runs/r1/summary.json", {"pass_rate": 0.5, "steps": [1, 2]})
    back = Ref.model_validate(json.loads(ref.model_dump_json()))
    assert back == ref
    assert store_for(back).get_json(back) == {"pass_rate": 0.5, "steps": [1, 2]}
    assert back.sibling("eval/3.parquet") == "runs/r1/eval/3.parquet"


def test_overwrite_replaces(store):
    store.put_bytes("k", b"one")
    ref = store.put_bytes("k", b"two")
    assert store.get_bytes("k") == b"two" and store.ref("k") == ref


def test_file_roundtrip_large(store, tmp_path):
    src = tmp_path / "weights.bin"
    src.write_bytes(os.urandom(6 * 1024 * 1024 + 3))  # above the 5 MiB multipart threshold on S3
    ref = store.put_file("runs/r1/checkpoints/1/model.safetensors", src)
    assert ref.size == src.stat().st_size
    assert store.ref(ref.key).sha256 == ref.sha256  # metadata survives multipart upload
    out = store.get_file(ref, tmp_path / "dl" / "model.safetensors")
    assert out.read_bytes() == src.read_bytes()


def test_missing_key(store, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope/x"):
        store.get_bytes("nope/x")
    with pytest.raises(FileNotFoundError, match="nope/x"):
        store.ref("nope/x")
    store.delete("nope/x")  # deleting what is not there is fine


def test_delete(store):
    store.put_bytes("a/b", b"1")
    store.delete("a/b")
    assert not store.exists("a/b") and store.list("a/") == []


def test_table_keeps_types(store):
    df = pl.DataFrame(
        {
            "i32": pl.Series([1, None, 3], dtype=pl.Int32),
            "f32": pl.Series([0.5, 1.5, None], dtype=pl.Float32),
            "s": ["a", "", None],
            "b": [True, False, None],
            "ids": pl.Series([[1, 2], [], None], dtype=pl.List(pl.Int64)),
            "turns": [[{"role": "user", "content": "x"}], [], [{"role": "assistant", "content": "y"}]],
        }
    )
    ref = store.write_table("runs/r1/waves/0/trajectories.parquet", df)
    assert ref.rows == 3 and store.ref(ref.key).rows == 3
    back = store.read_table(ref)
    assert back.schema == df.schema
    assert back.equals(df)


def test_write_table_argument_order_is_checked(store):
    with pytest.raises(TypeError, match=r"write_table\(key, df\)"):
        store.write_table(pl.DataFrame({"x": [1]}), "t.parquet")


# --- integrity ------------------------------------------------------------------------

@pytest.mark.parametrize("keep_metadata", [True, False])
def test_corruption_detected_with_ref(store, keep_metadata):
    ref = store.put_bytes("runs/r1/waves/0/trajectories.parquet", b"good bytes")
    tamper(store, ref.key, b"evil bytes", keep_metadata=keep_metadata)
    with pytest.raises(IntegrityError) as e:
        store.get_bytes(ref)
    msg = str(e.value)
    assert ref.key in msg and ref.sha256 in msg and e.value.actual in msg
    assert e.value.actual == hashlib.sha256(b"evil bytes").hexdigest()
    assert store.get_bytes(ref, verify=False) == b"evil bytes"


def test_corruption_detected_by_key_against_stored_hash(store):
    store.put_bytes("x/y", b"good bytes")
    tamper(store, "x/y", b"evil bytes", keep_metadata=True)
    with pytest.raises(IntegrityError, match="x/y"):
        store.get_bytes("x/y")


def test_corrupt_table_and_file_not_delivered(store, tmp_path):
    ref = store.write_table("t.parquet", pl.DataFrame({"x": [1, 2, 3]}))
    raw = bytearray(store.get_bytes(ref))
    raw[len(raw) // 2] ^= 0xFF
    tamper(store, ref.key, bytes(raw))
    with pytest.raises(IntegrityError):
        store.read_table(ref)
    dest = tmp_path / "dl" / "out.parquet"
    with pytest.raises(IntegrityError):
        store.get_file(ref, dest)
    assert list(dest.parent.iterdir()) == []  # neither the file nor a partial download


def test_ref_from_another_store_is_refused(store, tmp_path):
    other = open_store(str(tmp_path / "other"))
    ref = other.put_bytes("k", b"1")
    with pytest.raises(ValueError, match="store_for"):
        store.get_bytes(ref)


# --- directories and pointers ---------------------------------------------------------

def _make_dir(root: Path) -> dict[str, bytes]:
    files = {"config.json": b'{"a": 1}', "model.safetensors": os.urandom(2048), "tok/vocab.txt": b"a\nb\n"}
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def test_put_dir_get_dir_with_manifest_written_last(store, tmp_path, monkeypatch):
    files = _make_dir(tmp_path / "ckpt")
    written: list[str] = []
    real = store._write
    monkeypatch.setattr(store, "_write", lambda key, *a: (written.append(key), real(key, *a))[1])

    mref = store.put_dir("runs/r1/checkpoints/10", tmp_path / "ckpt")
    assert mref.key == f"runs/r1/checkpoints/10/{MANIFEST}"
    assert written[-1] == mref.key and len(written) == len(files) + 1
    manifest = store.get_json(mref)
    assert set(manifest["files"]) == set(files)
    assert manifest["files"]["tok/vocab.txt"]["size"] == 4

    out = store.get_dir(mref, tmp_path / "restored")
    for rel, data in files.items():
        assert (out / rel).read_bytes() == data
    assert not (out / MANIFEST).exists()
    # by key or by directory prefix too
    assert (store.get_dir("runs/r1/checkpoints/10", tmp_path / "r2") / "config.json").exists()


def test_get_dir_detects_a_corrupt_file(store, tmp_path):
    _make_dir(tmp_path / "ckpt")
    mref = store.put_dir("m", tmp_path / "ckpt")
    tamper(store, "m/tok/vocab.txt", b"x\ny\n")
    with pytest.raises(IntegrityError, match="m/tok/vocab.txt"):
        store.get_dir(mref, tmp_path / "restored")


def test_pointer_after_target(store, tmp_path, monkeypatch):
    assert store.get_pointer("runs/r1/checkpoints/LATEST") is None
    _make_dir(tmp_path / "ckpt")
    target = store.put_dir("runs/r1/checkpoints/10", tmp_path / "ckpt")
    pref = store.set_pointer("runs/r1/checkpoints/LATEST", target)
    assert pref.key == "runs/r1/checkpoints/LATEST"
    assert store.get_pointer("runs/r1/checkpoints/LATEST") == target
    # a pointer to something not (yet) written is refused: the target comes first
    ghost = target.model_copy(update={"uri": f"{store.root_uri}/runs/r1/checkpoints/11/{MANIFEST}"})
    with pytest.raises(FileNotFoundError, match="write it first"):
        store.set_pointer("runs/r1/checkpoints/LATEST", ghost)
    assert store.get_pointer("runs/r1/checkpoints/LATEST") == target


# --- listing and keys -----------------------------------------------------------------

def test_list_by_prefix(store):
    for key in ["runs/r1/a", "runs/r1/waves/0/t.parquet", "runs/r10/a", "envs/f/v1/tasks.parquet", "z"]:
        store.put_bytes(key, b"x")
    assert store.list("runs/r1/") == ["runs/r1/a", "runs/r1/waves/0/t.parquet"]
    assert store.list("runs/r1") == ["runs/r1/a", "runs/r1/waves/0/t.parquet", "runs/r10/a"]
    assert store.list("runs/r1/waves/0/t") == ["runs/r1/waves/0/t.parquet"]
    assert store.list() == sorted(["runs/r1/a", "runs/r1/waves/0/t.parquet", "runs/r10/a", "envs/f/v1/tasks.parquet", "z"])
    assert store.list("nothing/") == []


BAD_KEYS = ["", "/abs", "a/../b", "..", "a//b", "a/", "./a", "a\\b", ".ratchet/tmp/x"]


@pytest.mark.parametrize("key", BAD_KEYS)
def test_bad_keys_rejected(store, key):
    with pytest.raises(ValueError, match="invalid store key"):
        store.put_bytes(key, b"x")
    with pytest.raises(ValueError, match="invalid store key"):
        store.get_bytes(key)


def test_same_keys_on_both_backends(tmp_path, s3_store_uri):
    local, s3 = open_store(str(tmp_path / "store")), open_store(s3_store_uri)
    assert isinstance(local, LocalStore) and isinstance(s3, S3Store)
    _make_dir(tmp_path / "ckpt")
    refs = {}
    for st in (local, s3):
        refs[st] = [
            st.write_table("envs/f/v1/tasks.parquet", pl.DataFrame({"id": ["a", "b"]})),
            st.put_json("runs/r/summary.json", {"x": 1}),
            st.put_dir("runs/r/checkpoints/1", tmp_path / "ckpt"),
        ]
        st.set_pointer("runs/r/checkpoints/LATEST", refs[st][-1])
    assert local.list() == s3.list()
    assert [r.key for r in refs[local]] == [r.key for r in refs[s3]]
    assert [(r.sha256, r.size, r.rows) for r in refs[local]] == [(r.sha256, r.size, r.rows) for r in refs[s3]]
    assert [local.ref(k).sha256 for k in local.list()] == [s3.ref(k).sha256 for k in s3.list()]


def test_open_store_uris(tmp_path):
    a = open_store(str(tmp_path / "s"))
    b = open_store(f"file://{tmp_path / 's'}")
    assert isinstance(a, LocalStore) and a.root_uri == b.root_uri == f"file://{tmp_path / 's'}"
    with pytest.raises(ValueError, match="unsupported store URI"):
        open_store("gs://bucket/x")


def test_s3_needs_an_endpoint(monkeypatch):
    monkeypatch.delenv("RATCHET_S3_ENDPOINT", raising=False)
    with pytest.raises(RuntimeError, match="RATCHET_S3_ENDPOINT"):
        open_store("s3://bucket/prefix")


def test_s3_bucket_created_and_prefix_isolated(s3_env):
    a, b = open_store("s3://fresh-bucket/one"), open_store("s3://fresh-bucket/two")
    a.put_bytes("k", b"1")
    assert b.list() == [] and a.list() == ["k"]
    assert open_store("s3://fresh-bucket").list() == ["one/k"]


def test_unusual_but_valid_keys(store):
    key = "runs/r 1/é+ü/a=b,c@d.txt"
    ref = store.put_bytes(key, b"x")
    assert store.list("runs/r 1/") == [key] and store.get_bytes(ref) == b"x" and ref.key == key


def test_bookkeeping_is_invisible(store):
    store.put_bytes("a", b"1")
    assert store.list() == ["a"] and store.list(".ratchet") == []


def test_concurrent_writers_of_one_key(store):
    """Bytes and their stored hash always belong together, whoever wins."""
    from concurrent.futures import ThreadPoolExecutor

    payloads = [bytes([i]) * (1000 + i) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        for _ in range(40 if isinstance(store, LocalStore) else 3):  # without the lock ~1 in 3 rounds broke
            list(pool.map(lambda p: store.put_bytes("hot/key", p), payloads))
            assert store.get_bytes("hot/key") in payloads  # verified against the stored hash
            assert store.ref("hot/key").size == len(store.get_bytes("hot/key"))


def test_stale_ref_after_overwrite_says_so(store):
    old = store.put_bytes("k", b"v1")
    store.put_bytes("k", b"v2")
    with pytest.raises(IntegrityError, match="overwritten after this Ref was made"):
        store.get_bytes(old)


def test_ref_without_root_resolves_against_open_stores(store):
    ref = store.put_bytes("runs/r1/waves/0/t.parquet", b"x")
    bare = Ref(uri=ref.uri, sha256=ref.sha256, size=ref.size)  # e.g. built by hand from a URI
    assert bare.key == "runs/r1/waves/0/t.parquet"
    assert store_for(bare).get_bytes(bare) == b"x"
    with pytest.raises(ValueError, match="no open store contains it"):
        Ref(uri="file:///nowhere/at/all/x", sha256="0", size=0).key


def test_s3_store_fixture(s3_store):
    assert isinstance(s3_store, S3Store) and s3_store.list() == []


# --- local store: a writer killed mid-write ------------------------------------------------

def test_temp_files_of_a_writer_killed_mid_write_are_removed_at_the_next_open(tmp_path):
    """Found by review: a local store write SIGKILLed with its temp files written (a checkpoint's
    weights) left `.ratchet/tmp/<uuid>` for ever; nothing removed them. A live writer's stay."""
    import socket
    import subprocess
    import sys

    root = tmp_path / "store"
    writer = ("import sys; from ratchet.store import LocalStore\n"
              "LocalStore(sys.argv[1]).put_bytes('runs/r/checkpoints/000004/model.safetensors', b'w' * 4096)")
    killed = subprocess.Popen([sys.executable, "-c", writer, str(root)], cwd=Path(__file__).resolve().parents[2],
                              env={**os.environ, "RATCHET_FAULT": "store.write:1"})   # killed, temp files written
    assert killed.wait(timeout=120) == -9
    tmp = root / ".ratchet" / "tmp"
    left = sorted(tmp.iterdir())
    assert left and all(f.name.startswith(f"{socket.gethostname()}-{killed.pid}-") for f in left)
    store = LocalStore(root)
    live = store._tmpfile()
    live.write_bytes(b"a write in progress")
    assert list(tmp.iterdir()) == [live]                 # the killed writer's went when the store was opened
    LocalStore(root)
    assert list(tmp.iterdir()) == [live]                 # a live process's stays
    assert not store.exists("runs/r/checkpoints/000004/model.safetensors")
