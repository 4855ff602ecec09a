"""One invocation of a run id: its lease, its leftovers cleaned, its attempt recorded.

    with run_attempt(store, run_id, owner=flow_run_id) as lease:   # LeaseHeld: another process runs it
        ...                                                        # lease.check() before each wave and checkpoint
    # attempts.json says how this attempt ended: completed, failed: <error>, interrupted: <signal>

Used by `flows/nightly.py`; everything here is plain Python over the store.
"""

from __future__ import annotations

import logging
import os
import signal
from contextlib import contextmanager
from typing import Iterator

from ratchet.errors import picklable
from ratchet.scratch import remove_stale_scratch
from ratchet.store import ArtifactStore, RunLease
from ratchet.store.lease import LeaseLost, require_holder
from ratchet.summary import begin_attempt, end_attempt
from ratchet.train.checkpoint import clean_partial

log = logging.getLogger(__name__)


@picklable
class Interrupted(KeyboardInterrupt):
    """SIGTERM (or SIGINT) asked the run to stop; it is resumable from its last checkpoint."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_stop_signals: list[int] = []   # SIGTERM / SIGINT received by this process's run, first first
_wakeup: int | None = None       # read end of the pipe CPython writes every caught signal's number to


def note_stop_signals() -> None:
    """From now on CPython writes the number of every signal this process catches to a pipe
    (`signal.set_wakeup_fd`), whichever Python handler runs: while a flow runs, Prefect swaps in its
    own SIGTERM handler, and when the TerminationSignal it raises lands inside a library that
    converts it (polars, into an error about a column's values) neither it nor `request_stop` is
    seen, and a stopped run read as failed. `stop_signal` reads the pipe. Main thread; once."""
    global _wakeup
    if _wakeup is None:
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        _wakeup = r


def request_stop(signum: int) -> None:
    """A stop signal's handler: note the signal, then raise `Interrupted` wherever the run is. The note
    keeps the attempt "interrupted" when a library converts the exception raised in its code (polars
    turned one into "TypeError: '<unprintable str object>' is not a Polars data type")."""
    _stop_signals.append(signum)
    raise Interrupted(signum)


def stop_signal() -> int | None:
    """The first stop signal this process received, if any (`request_stop`, `note_stop_signals`)."""
    if _wakeup is not None:
        try:
            caught = os.read(_wakeup, 4096)
        except BlockingIOError:
            caught = b""
        _stop_signals.extend(n for n in caught if n in (signal.SIGTERM, signal.SIGINT))
    return _stop_signals[0] if _stop_signals else None


def stopped_by(exc: BaseException) -> int | None:
    """The stop signal that ended a run which raised `exc`, or None: `Interrupted`'s, or the one noted
    (`stop_signal`) when a library converted the exception raised in its code on its way up, into an
    Exception (polars: a TypeError, a SchemaError) or not (polars' Rust side: pyo3's PanicException,
    a BaseException, when the handler raised inside a callback; CI, 2026-12-07)."""
    return exc.signum if isinstance(exc, Interrupted) else stop_signal()


def outcome(exc: BaseException) -> str:
    """One line saying how an attempt ended."""
    if (signum := stopped_by(exc)) is not None:
        return f"interrupted: {signal.Signals(signum).name}"
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted: SIGINT"
    signum = getattr(exc, "signal", None)   # an orchestrator's termination exception (Prefect's TerminationSignal)
    if isinstance(signum, int) and signum in {s.value for s in signal.Signals}:
        return f"interrupted: {signal.Signals(signum).name}"
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"failed: {type(exc).__name__}: {first}"[:500]


@contextmanager
def run_attempt(store: ArtifactStore, run_id: str, owner: str | None = None, ttl_s: float = 60.0) -> Iterator[RunLease]:
    with RunLease(store, run_id, owner=owner, ttl_s=ttl_s) as lease:
        lease.start_heartbeat()
        removed = clean_partial(store, run_id)
        if removed:
            log.warning("run %s: removed %d file(s) of interrupted checkpoint writes", run_id, len(removed))
        for path in remove_stale_scratch():
            log.warning("removed %s, left by a process that is gone", path)
        attempt = begin_attempt(store, run_id)

        def close(how: str) -> None:
            """Record how the attempt ended, unless the run has another owner now: its attempts.json
            (where it marked this attempt interrupted) is not this process's to rewrite."""
            try:
                require_holder(store, run_id, lease.token)
            except LeaseLost as lost:
                log.error("run %s: attempt %d ended (%s) and is not recorded: %s", run_id, attempt, how, lost)
                return
            end_attempt(store, run_id, attempt, how)

        try:
            yield lease
        except BaseException as e:
            close(outcome(e))
            raise
        close("completed")
