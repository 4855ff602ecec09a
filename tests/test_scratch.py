"""Scratch directories of a killed process are removed at the next run's start; live ones stay."""

from __future__ import annotations

import os
import subprocess
import sys

from ratchet.scratch import remove_stale_scratch, scratch_dir


def test_only_the_scratch_of_processes_that_are_gone_is_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f"ratchet-ckpt-{gone.pid}-abc"
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "model.safetensors").write_bytes(b"x" * 10)
    other = tmp_path / "ratchet-notes-here"            # not ours: no pid in the name
    other.mkdir()
    engine_log = tmp_path / f"ratchet-engine-{gone.pid}-abc.log"   # a file: kept to be read after a crash
    engine_log.write_text("the engine's last words")
    with scratch_dir("ckpt") as live:
        assert os.path.basename(live).startswith(f"ratchet-ckpt-{os.getpid()}-")
        assert remove_stale_scratch() == [str(stale)]
        assert not stale.exists() and os.path.isdir(live) and other.exists() and engine_log.exists()
