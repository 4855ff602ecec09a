"""Fault injection for crash tests: SIGKILL this process at a named point on its Nth visit.

    RATCHET_FAULT=store.write.between:12 ratchet run ...     # killed at the 12th visit of that point

Points sit where a crash does the most damage:

    store.write          a local store write whose temporary files exist, before any rename
    store.write.between  between the rename of an object's bytes and the rename of its metadata
    store.put_dir        between two files of a directory upload (a checkpoint without its manifest)
    checkpoint.latest    a checkpoint complete in the store, LATEST not yet moved to it

Unset (always, outside tests), `point` is one global lookup. tests/flows/test_fault_injection.py
kills small runs at these points and at random moments and checks that the resumed run ends
bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import os
import signal

_FAULT = os.environ.get("RATCHET_FAULT")
_visits: dict[str, int] = {}


def point(name: str) -> None:
    """Die by SIGKILL if RATCHET_FAULT names this point and this is its Nth visit."""
    if _FAULT is None:
        return
    want, _, nth = _FAULT.rpartition(":")
    if name != want:
        return
    _visits[name] = _visits.get(name, 0) + 1
    if _visits[name] == int(nth):
        os.kill(os.getpid(), signal.SIGKILL)
