"""Scratch directories named for the process that made them, so a killed process's are found.

    with scratch_dir("ckpt") as tmp: ...        # $TMPDIR/ratchet-ckpt-<pid>-xxxx, removed on exit
    remove_stale_scratch()                      # at a run's start: those of processes that are gone

A SIGKILLed process cannot remove its temporary directories (a checkpoint being written can
hold a model's weights); the next run's start does.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path


def alive(pid: int) -> bool:
    """Whether a process with this pid exists here (of any user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def scratch_dir(kind: str) -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix=f"ratchet-{kind}-{os.getpid()}-")


def remove_stale_scratch(root: str | Path | None = None) -> list[str]:
    """Remove the scratch directories whose process is gone; returns their paths."""
    return remove_gone(root or tempfile.gettempdir(), r"ratchet-[^-]*-(\d+)-")


def remove_gone(root: str | Path, name: str, files: bool = False) -> list[str]:
    """Remove the directories (and with `files`, the files) in `root` whose name starts as the regex `name`
    says, its first group the pid of a process of this host that made it, where that process is gone;
    returns their paths. Files only on request: other files in $TMPDIR carry a pid too (an engine
    server's log, kept to be read after a crash)."""
    removed = []
    for path in Path(root).iterdir():
        made_by = re.match(name, path.name)
        if made_by and (files or path.is_dir()) and not alive(int(made_by.group(1))):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(str(path))
    return removed
