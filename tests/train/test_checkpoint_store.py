"""Checkpoints in the store: manifest last, LATEST after it, corruption detected and skipped,
garbage LATEST survived, partial folders cleaned, LATEST never moved backwards.

    .venv/bin/pytest -q tests/train/test_checkpoint_store.py
"""

import json
import tempfile
from pathlib import Path

import pytest

from ratchet.store import open_store
from ratchet.train.checkpoint import (
    CheckpointBehindLatest, NoUsableCheckpoint, checkpoint_versions, clean_partial, latest_key, load_latest,
    rewind_latest, save_checkpoint,
)


def _write(text):
    def write(d: Path):
        (d / "weights.bin").write_bytes(text.encode() * 100)
        (d / "ledger.json").write_text('{"version": 0}')
    return write


def test_latest_points_at_the_newest_complete_checkpoint(tmp_path):
    store = open_store(str(tmp_path / "s"))
    save_checkpoint(store, "r", 1, _write("one"))
    ref = save_checkpoint(store, "r", 2, _write("two"))
    assert store.get_pointer(latest_key("r")).key == ref.key
    got, path = load_latest(store, "r", tmp_path / "dl")
    assert got.key == ref.key and (path / "weights.bin").read_bytes().startswith(b"two")


def test_a_checkpoint_without_manifest_does_not_exist(tmp_path):
    store = open_store(str(tmp_path / "s"))
    save_checkpoint(store, "r", 1, _write("one"))
    store.put_bytes("runs/r/checkpoints/000002/weights.bin", b"half-written")   # interrupted before its manifest
    assert checkpoint_versions(store, "r") == [1]


def test_corrupt_latest_falls_back_to_the_previous_good_one(tmp_path, caplog):
    store = open_store(str(tmp_path / "s"))
    save_checkpoint(store, "r", 1, _write("one"))
    save_checkpoint(store, "r", 2, _write("two"))
    store.path("runs/r/checkpoints/000002/weights.bin").write_bytes(b"bit rot")     # corrupt on disk
    got, path = load_latest(store, "r", tmp_path / "dl")
    assert got.key == "runs/r/checkpoints/000001/MANIFEST.json"
    assert (path / "weights.bin").read_bytes().startswith(b"one")
    assert "unusable" in caplog.text and "000002" in caplog.text


def test_a_run_resumed_past_corrupt_checkpoints_sets_them_aside_and_saves_again(tmp_path):
    """Versions 2 and 3 rot; the run resumes from 1 and trains version 2 again. Before rewind_latest,
    LATEST (at 3) refused that save for good, the message blaming another writer. The rotten
    checkpoints are moved, bytes as they were, to checkpoints/rejected/, and LATEST goes back to 1."""
    store = open_store(str(tmp_path / "s"))
    for v, text in enumerate(("zero", "one", "two", "three")):
        save_checkpoint(store, "r", v, _write(text))
    for v in (2, 3):
        store.path(f"runs/r/checkpoints/{v:06d}/weights.bin").write_bytes(b"bit rot")
    resumed, _ = load_latest(store, "r", tmp_path / "dl")
    assert resumed.key == "runs/r/checkpoints/000001/MANIFEST.json"
    with pytest.raises(CheckpointBehindLatest, match="version 2 because LATEST points at .*000003"):
        save_checkpoint(store, "r", 2, _write("two again"))
    assert rewind_latest(store, "r", resumed) == [3, 2]
    assert checkpoint_versions(store, "r") == [1, 0] and store.get_pointer(latest_key("r")).key == resumed.key
    assert store.path("runs/r/checkpoints/rejected/000002-0/weights.bin").read_bytes() == b"bit rot"
    assert sorted(store.list("runs/r/checkpoints/rejected/000003-0/")) == [
        f"runs/r/checkpoints/rejected/000003-0/{name}" for name in ("MANIFEST.json", "ledger.json", "weights.bin")]
    assert rewind_latest(store, "r", resumed) == []                    # LATEST is the one resumed from
    save_checkpoint(store, "r", 2, _write("two again"))
    got, path = load_latest(store, "r", tmp_path / "dl2")
    assert got.key.endswith("000002/MANIFEST.json") and (path / "weights.bin").read_bytes().startswith(b"two again")
    store.path("runs/r/checkpoints/000002/weights.bin").write_bytes(b"rot again")   # a second time: a second folder
    assert rewind_latest(store, "r", load_latest(store, "r", tmp_path / "dl3")[0]) == [2]
    assert store.list("runs/r/checkpoints/rejected/000002-1/")


def test_rewind_leaves_a_run_whose_latest_verified_alone(tmp_path):
    """A crash after version 3's manifest, before LATEST moved: the run resumes from LATEST (2) and
    saves 3 again over it; nothing is set aside."""
    store = open_store(str(tmp_path / "s"))
    for v in (1, 2):
        save_checkpoint(store, "r", v, _write(str(v)))
    store.put_dir("runs/r/checkpoints/000003", _dir_of(tmp_path / "three", _write("3")))
    resumed, _ = load_latest(store, "r", tmp_path / "dl")
    assert resumed.key.endswith("000002/MANIFEST.json")
    assert rewind_latest(store, "r", resumed) == [] and checkpoint_versions(store, "r") == [3, 2, 1]
    save_checkpoint(store, "r", 3, _write("3"))


def _dir_of(path: Path, write) -> Path:
    path.mkdir()
    write(path)
    return path


def test_no_checkpoint_is_none(tmp_path):
    assert load_latest(open_store(str(tmp_path / "s")), "nope", tmp_path / "dl") is None


# --- a run that fails safely ------------------------------------------------------------

def _two_checkpoints(tmp_path):
    store = open_store(str(tmp_path / "s"))
    save_checkpoint(store, "r", 1, _write("one"))
    save_checkpoint(store, "r", 2, _write("two"))
    return store


GARBAGE_LATEST = {
    "not json": (b"{not json", "JSONDecodeError"),
    "wrong shape": (json.dumps(["a", "list"]).encode(), "not a ratchet pointer"),
    "missing field": (json.dumps({"format": "ratchet-pointer/1", "sha256": "0", "size": 1}).encode(), "KeyError"),
    "missing target": (json.dumps({"format": "ratchet-pointer/1", "key": "runs/r/checkpoints/000009/MANIFEST.json",
                                   "sha256": "0" * 64, "size": 1}).encode(), "which is not in the store"),
    "another run": (json.dumps({"format": "ratchet-pointer/1", "key": "runs/other/checkpoints/000002/MANIFEST.json",
                                "sha256": "0" * 64, "size": 1}).encode(), "not a checkpoint manifest of run 'r'"),
}


@pytest.mark.parametrize("case", list(GARBAGE_LATEST))
def test_garbage_latest_falls_back_to_the_newest_good_checkpoint(tmp_path, caplog, case):
    store = _two_checkpoints(tmp_path)
    data, why = GARBAGE_LATEST[case]
    store.put_bytes(latest_key("r"), data)
    got, path = load_latest(store, "r", tmp_path / "dl")
    assert got.key == "runs/r/checkpoints/000002/MANIFEST.json"
    assert (path / "weights.bin").read_bytes().startswith(b"two")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and why in warnings[0] and "LATEST" in warnings[0]


def test_latest_with_rotten_bytes_falls_back(tmp_path, caplog):
    store = _two_checkpoints(tmp_path)
    store.path(latest_key("r")).write_bytes(b"\xff\xfe")   # bytes no longer match the stored sha256
    got, _ = load_latest(store, "r", tmp_path / "dl")
    assert got.key.endswith("000002/MANIFEST.json") and "IntegrityError" in caplog.text


def test_all_corrupt_raises_naming_each_rejection_and_writes_nothing(tmp_path):
    store = _two_checkpoints(tmp_path)
    for v in ("000001", "000002"):
        store.path(f"runs/r/checkpoints/{v}/weights.bin").write_bytes(b"bit rot")
    before = {k: store.ref(k).sha256 for k in store.list()}
    with pytest.raises(NoUsableCheckpoint) as e:
        load_latest(store, "r", tmp_path / "dl")
    msg = str(e.value)
    assert "'r'" in msg and store.root_uri in msg
    assert [what for what, _ in e.value.rejected] == ["000002 (via LATEST)", "000001"]
    assert all("IntegrityError" in why and "weights.bin" in why for _, why in e.value.rejected)
    assert {k: store.ref(k).sha256 for k in store.list()} == before   # the store is untouched
    assert list((tmp_path / "dl").iterdir()) == []                     # no half-verified files either


def test_garbage_latest_and_no_checkpoint_is_not_a_fresh_run(tmp_path):
    store = open_store(str(tmp_path / "s"))
    store.put_bytes(latest_key("r"), b"garbage")
    with pytest.raises(NoUsableCheckpoint, match="LATEST"):
        load_latest(store, "r", tmp_path / "dl")


def test_partial_folders_are_cleaned(tmp_path):
    store = _two_checkpoints(tmp_path)
    store.put_bytes("runs/r/checkpoints/000003/weights.bin", b"half")       # interrupted before its manifest
    store.put_bytes("runs/r/checkpoints/000003/sub/ledger.json", b"{}")
    store.put_bytes("runs/r/checkpoints/000000/weights.bin", b"half")
    store.put_bytes("runs/other/checkpoints/000005/weights.bin", b"another run's")
    assert clean_partial(store, "r") == [
        "runs/r/checkpoints/000000/weights.bin",
        "runs/r/checkpoints/000003/sub/ledger.json",
        "runs/r/checkpoints/000003/weights.bin",
    ]
    assert store.list("runs/r/checkpoints/") == sorted(
        [latest_key("r")] + [f"runs/r/checkpoints/00000{v}/{f}" for v in (1, 2)
                             for f in ("MANIFEST.json", "ledger.json", "weights.bin")])
    assert store.exists("runs/other/checkpoints/000005/weights.bin")
    assert clean_partial(store, "r") == []


def test_latest_never_moves_backwards(tmp_path):
    store = _two_checkpoints(tmp_path)
    behind = r"version 1 because LATEST points at .*000002.*never moves backwards"
    with pytest.raises(CheckpointBehindLatest, match=behind):
        save_checkpoint(store, "r", 1, _write("stale"))
    assert store.get_pointer(latest_key("r")).key.endswith("000002/MANIFEST.json")
    assert store.get_bytes("runs/r/checkpoints/000001/weights.bin").startswith(b"one")   # not overwritten
    ref = save_checkpoint(store, "r", 2, _write("again"))       # the same version again (a retried task)
    assert store.get_pointer(latest_key("r")) == ref
    save_checkpoint(store, "r", 3, _write("three"))
    assert checkpoint_versions(store, "r") == [3, 2, 1]


def test_latest_moved_during_the_upload_is_not_moved_back(tmp_path):
    store = _two_checkpoints(tmp_path)

    def racing_write(d: Path):
        _write("mine")(d)
        save_checkpoint(store, "r", 4, _write("other writer"))   # someone else gets further meanwhile

    with pytest.raises(CheckpointBehindLatest, match="version 3"):
        save_checkpoint(store, "r", 3, racing_write)
    assert store.get_pointer(latest_key("r")).key.endswith("000004/MANIFEST.json")


def test_garbage_latest_guards_with_the_newest_complete_version(tmp_path):
    store = _two_checkpoints(tmp_path)
    store.put_bytes(latest_key("r"), b"garbage")
    with pytest.raises(CheckpointBehindLatest, match="newest complete checkpoint is 000002"):
        save_checkpoint(store, "r", 1, _write("stale"))
    save_checkpoint(store, "r", 3, _write("three"))       # a newer version repairs LATEST
    assert store.get_pointer(latest_key("r")).key.endswith("000003/MANIFEST.json")


@pytest.mark.parametrize("fail_in", ["write_files", "upload"])
def test_save_leaves_no_temp_dir_behind(tmp_path, monkeypatch, fail_in):
    tmproot = tmp_path / "tmp"
    tmproot.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmproot))
    store = open_store(str(tmp_path / "s"))

    def write(d: Path):
        _write("x")(d)
        (d / "sub").mkdir()
        (d / "sub" / "f").write_bytes(b"1")
        (d / "sub").chmod(0o500)          # a read-only folder must not defeat the cleanup
        if fail_in == "write_files":
            raise RuntimeError("disk full")

    if fail_in == "upload":
        monkeypatch.setattr(store, "put_dir", lambda *a: (_ for _ in ()).throw(OSError("connection reset")))
    with pytest.raises((RuntimeError, OSError)):
        save_checkpoint(store, "r", 1, write)
    assert list(tmproot.iterdir()) == []
    assert store.get_pointer(latest_key("r")) is None


def test_a_writer_whose_lease_was_taken_over_does_not_move_latest(tmp_path):
    from ratchet.store.lease import LeaseLost, RunLease

    store = open_store(str(tmp_path / "s"))
    now = [0.0]
    clock, sleep = (lambda: now[0]), (lambda s: None)
    mine = RunLease(store, "r", owner="old", ttl_s=60, clock=clock, sleep=sleep).acquire()
    save_checkpoint(store, "r", 1, _write("one"), lease=mine)

    def slow_write(d: Path):                 # paused past ttl while writing: someone else takes over
        _write("two")(d)
        now[0] += 61
        RunLease(store, "r", owner="new", ttl_s=60, clock=clock, sleep=sleep).acquire()

    with pytest.raises(LeaseLost, match="taken over by owner 'new'"):
        save_checkpoint(store, "r", 2, slow_write, lease=mine)
    assert store.get_pointer(latest_key("r")).key.endswith("000001/MANIFEST.json")


def test_a_task_that_saves_under_the_flows_lease_token_stops_at_a_takeover(tmp_path):
    """Found by review: the flow's checkpoint task never passed the lease, so a writer paused past its
    ttl that woke inside it moved LATEST while another owned the run. A task holds no RunLease, only
    its token: the record must still carry it before the upload and before LATEST moves."""
    from ratchet.store.lease import LeaseLost, RunLease

    store = open_store(str(tmp_path / "s"))
    now = [0.0]
    clock, sleep = (lambda: now[0]), (lambda s: None)
    mine = RunLease(store, "r", owner="old", ttl_s=60, clock=clock, sleep=sleep).acquire()
    save_checkpoint(store, "r", 1, _write("one"), lease=mine.token)

    def slow_write(d: Path):
        _write("two")(d)
        now[0] += 61
        RunLease(store, "r", owner="new", ttl_s=60, clock=clock, sleep=sleep).acquire()

    with pytest.raises(LeaseLost, match="lease this writer works under was taken over by owner 'new'"):
        save_checkpoint(store, "r", 2, slow_write, lease=mine.token)
    assert store.get_pointer(latest_key("r")).key.endswith("000001/MANIFEST.json")
    with pytest.raises(LeaseLost, match="taken over"):
        save_checkpoint(store, "r", 2, _write("two"), lease=mine.token)         # refused before any upload
