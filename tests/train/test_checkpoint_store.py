"""Checkpoints in the store: manifest last, LATEST after it, corruption detected and skipped."""

from pathlib import Path

from ratchet.store import open_store
from ratchet.train.checkpoint import checkpoint_versions, latest_key, load_latest, save_checkpoint


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


def test_no_checkpoint_is_none(tmp_path):
    assert load_latest(open_store(str(tmp_path / "s")), "nope", tmp_path / "dl") is None
