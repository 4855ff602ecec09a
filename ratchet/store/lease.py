"""One writer per run: a lease record in the store, renewed by heartbeats.

    from ratchet.store.lease import RunLease, LeaseHeld, LeaseLost
    with RunLease(store, run_id, owner=flow_run_id, ttl_s=60) as lease:   # LeaseHeld if taken
        lease.start_heartbeat()          # a daemon thread renews every ttl_s / 3 ...
        ...                              # ... or call lease.heartbeat() between steps yourself
        save_checkpoint(store, run_id, version, write, lease=lease)       # renews; LeaseLost if taken over
        save_checkpoint(store, run_id, version, write, lease=lease.token) # elsewhere (a task): LeaseLost if taken over
        lease.check()                    # LeaseLost if the background beat found a takeover

The record is `runs/<run_id>/LEASE` (JSON: owner, token, host, pid, acquired_at, heartbeat_at,
ttl_s, proc_ns). A lease whose holder process is gone (same kernel boot and pid namespace:
a pid there means what it means here) is taken over at once. A lease whose heartbeat is more
than its ttl_s old is stale: its holder is presumed
dead, and the next `acquire()` takes it over. `heartbeat()` of the old holder then raises
`LeaseLost`, so a paused process that wakes up stops writing instead of racing the new one.

How acquisition is made safe without conditional writes. Neither backend offers an atomic
"create if absent" through this store (the minio client cannot send If-None-Match), only an
atomic whole-object put, so `acquire()` is Fischer's timed mutual exclusion (Lamport, "A fast
mutual exclusion algorithm", ACM TOCS 1987, which credits it to Fischer):

    1. read the record; refuse (LeaseHeld) if another owner's heartbeat is fresh
    2. write our record (a new random token)                   the newest record wins
    3. wait settle_s, then read the record back                 ours: we hold it; else LeaseHeld

Two contenders that both saw the lease free in (1) both write in (2); whichever wrote last
finds its own token in (3), the other finds the winner's and backs off, provided each
contender's step (1) -> (2) takes less than settle_s. A contender that sees, by its own clock,
that its (1) -> (2) took longer (a slow or retried PUT, a pause) may have overwritten a lease won
meanwhile, whose holder cannot know it before its next heartbeat: in (3) it waits 2/3 of ttl_s
instead of settle_s, two intervals of the default heartbeat (ttl_s / 3), before it reads back. A live
holder it overwrote beats in that time, finds the other token and stops (LeaseLost); one whose beat
overwrote the contender's record makes it back off (settle_s 0 turns settling off, this wait too).
What is NOT covered, honestly:
- a write that lands later than its caller saw it complete (a request the client gave up on and
  the server applied afterwards) or a holder that beats less often than every ttl_s / 3 can still
  overwrite a lease already won: both believe they hold it until the loser's next `heartbeat()`,
  which finds the other token and raises LeaseLost. The overlap lasts at most one heartbeat
  interval (and the loser's flow stops at its next wave: it calls `check()` before each);
  `save_checkpoint(..., lease=)` renews (given the RunLease) or checks the record still carries the
  holder's token (given the token: the flow's checkpoint task does) right before moving LATEST.
- a holder whose lease went stale (paused > ttl_s) may renew in the instant after a takeover
  and overwrite the new record; then the new holder's next heartbeat raises LeaseLost. Again
  exactly one survives, after at most one interval.
- staleness compares the holder's clock (heartbeat_at) with the contender's: keep ttl_s far
  above the clock skew between machines (NTP: milliseconds; ttl: a minute).
- `release()` reads then deletes: a takeover in between (only of a stale lease) is deleted.
Stores: S3 (and MinIO) give read-after-write consistency and last-writer-wins puts of one key;
the local store replaces files atomically. Tests inject `clock` and `sleep` instead of waiting.
"""

from __future__ import annotations

import getpass
import logging
import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any, Callable, Iterator

from ratchet.errors import picklable
from ratchet.scratch import alive
from ratchet.store.base import ArtifactStore, IntegrityError

log = logging.getLogger(__name__)

LEASE_FORMAT = "ratchet-lease/1"


def lease_key(run_id: str) -> str:
    return f"runs/{run_id}/LEASE"


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _proc_ns() -> str | None:
    """This kernel boot and pid namespace: where a pid means the same process as here."""
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


def _who(rec: dict[str, Any]) -> str:
    return f"owner {rec.get('owner')!r} (host {rec.get('host')}, pid {rec.get('pid')})"


@picklable
class LeaseHeld(RuntimeError):
    """Another live owner holds the run's lease."""

    def __init__(self, run_id: str, holder: dict[str, Any], now: float, lost_race: bool = False):
        self.run_id, self.holder = run_id, holder
        beat, ttl = float(holder["heartbeat_at"]), float(holder.get("ttl_s", 0))
        how = "another writer won the race for" if lost_race else "another writer holds"
        super().__init__(
            f"run {run_id!r}: {how} its lease: {_who(holder)}, heartbeat last seen {now - beat:.1f} s ago "
            f"({_when(beat)}); it goes stale {max(0.0, beat + ttl - now):.1f} s from now (ttl {ttl:g} s). "
            f"Stop that run, or wait for it to end or go stale."
        )


class LeaseLost(RuntimeError):
    """This owner's lease was taken over (or deleted): stop writing to the run."""


def require_holder(store: ArtifactStore, run_id: str, token: str) -> None:
    """LeaseLost unless the run's lease record still carries `token` (a holder's `RunLease.token`): for a
    writer that is not the lease's holder object (a task, perhaps on another worker), which cannot renew
    it but must not write past a takeover."""
    lost = _lost(RunLease(store, run_id)._read(), token, run_id, "the lease this writer works under")
    if lost:
        raise lost


def _lost(rec: dict[str, Any] | None, token: str, run_id: str, whose: str) -> LeaseLost | None:
    """The LeaseLost naming who took the lease over, unless the record `rec` carries `token`."""
    if rec is not None and rec["token"] == token:
        return None
    whom = "deleted (or made unreadable)" if rec is None else \
        f"taken over by {_who(rec)}, heartbeat at {_when(float(rec['heartbeat_at']))}"
    return LeaseLost(f"run {run_id!r}: {whose} was {whom}; stop writing, another writer owns this run now")


@contextmanager
def one_at_a_time(store: ArtifactStore, name: str, owner: str, wait_s: float = 300.0) -> Iterator[RunLease]:
    """A read-check-write that runs of one store must not interleave (moving the promoted model's
    pointer: two runs judged against one incumbent would both pass the check, and the last one
    would win unjudged): a lease at `locks/<name>/LEASE` under the same protocol as a run's, waited
    for while another live owner holds it (LeaseHeld after `wait_s`)."""
    lease = RunLease(store, name, owner=owner, key=f"locks/{name}/LEASE")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            lease.acquire()
            break
        except LeaseHeld:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
    try:
        yield lease
    finally:
        lease.release()


class RunLease:
    """The lease on `runs/<run_id>/` for one owner. See the module docstring for the protocol."""

    def __init__(self, store: ArtifactStore, run_id: str, owner: str | None = None, ttl_s: float = 60.0,
                 settle_s: float = 1.0, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep, key: str | None = None):
        if ttl_s <= 0 or settle_s < 0:
            raise ValueError(f"RunLease: ttl_s must be > 0 and settle_s >= 0, got {ttl_s}, {settle_s}")
        self.store, self.run_id, self.key = store, run_id, key or lease_key(run_id)   # key: a lock of its own
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.owner = owner or f"{getpass.getuser()}@{self.host}:{self.pid}"
        self.ttl_s, self.settle_s, self._clock, self._sleep = float(ttl_s), float(settle_s), clock, sleep
        self.token = uuid.uuid4().hex
        self.held = False
        self._acquired_at: float | None = None
        self._mutex = threading.Lock()   # the background beat and the caller never interleave
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._error: LeaseLost | None = None

    # --- the record -------------------------------------------------------------------------
    def _read(self) -> dict[str, Any] | None:
        """The current record, or None if there is none (or it is unreadable: then it is stale)."""
        try:
            rec = self.store.get_json(self.key)
        except FileNotFoundError:
            return None
        except (IntegrityError, ValueError) as e:
            log.warning("run %r: lease record %s is unreadable (%s); treating the lease as free", self.run_id,
                        self.key, e)
            return None
        if not (isinstance(rec, dict) and rec.get("format") == LEASE_FORMAT and isinstance(rec.get("token"), str)
                and isinstance(rec.get("heartbeat_at"), (int, float))):
            log.warning("run %r: %s is not a lease record; treating the lease as free", self.run_id, self.key)
            return None
        return rec

    def _write(self, now: float) -> None:
        self.store.put_json(self.key, {
            "format": LEASE_FORMAT, "run_id": self.run_id, "owner": self.owner, "token": self.token,
            "host": self.host, "pid": self.pid, "proc_ns": _proc_ns(), "acquired_at": self._acquired_at,
            "heartbeat_at": now,
            "ttl_s": self.ttl_s,
        })

    def _stale(self, rec: dict[str, Any], now: float) -> bool:
        if now - float(rec["heartbeat_at"]) > float(rec.get("ttl_s", self.ttl_s)):
            return True
        # a holder in this very process namespace (same kernel boot, same pid namespace) whose
        # process is gone was killed: no need to wait out its ttl (a restarted run resumes at once)
        return rec.get("proc_ns") is not None and rec.get("proc_ns") == _proc_ns() and not alive(int(rec["pid"]))

    # --- the protocol -----------------------------------------------------------------------
    def acquire(self) -> RunLease:
        """Take the lease (or take over a stale one); LeaseHeld naming the holder otherwise."""
        with self._mutex:
            started = self._clock()
            rec, now = self._read(), self._clock()
            if rec is not None and rec["token"] != self.token and not self._stale(rec, now):
                raise LeaseHeld(self.run_id, rec, now)
            if rec is not None and rec["token"] != self.token:
                log.warning("run %r: taking over the stale lease of %s, heartbeat last seen %.1f s ago",
                            self.run_id, _who(rec), now - float(rec["heartbeat_at"]))
            self._acquired_at = now
            self._write(now)
            if not self.settle_s or self._clock() - started <= self.settle_s:   # settle_s 0: no settling at all
                self._sleep(self.settle_s)   # let a contender that read "free" too finish its write
            else:   # we may have overwritten a lease won meanwhile: let its holder beat (module docstring)
                log.warning("run %r: writing the lease record took %.1f s, over settle_s %g s; waiting %.0f s for "
                            "a holder it may have overwritten to notice", self.run_id, self._clock() - started,
                            self.settle_s, self.ttl_s * 2 / 3)
                self._sleep(self.ttl_s * 2 / 3)
            back = self._read()
            if back is None or back["token"] != self.token:
                self.held = False
                if back is None:
                    raise LeaseLost(f"run {self.run_id!r}: the lease record vanished while acquiring it")
                raise LeaseHeld(self.run_id, back, self._clock(), lost_race=True)
            self.held, self._error = True, None
        return self

    def heartbeat(self) -> None:
        """Renew the lease; LeaseLost if another owner has taken it over (or it was deleted)."""
        with self._mutex:
            if not self.held:
                raise LeaseLost(f"run {self.run_id!r}: {self.owner!r} does not hold the lease (acquire it first)")
            lost = _lost(self._read(), self.token, self.run_id, f"the lease of {self.owner!r}")
            if lost:
                self.held = False
                raise lost
            self._write(self._clock())

    def release(self) -> None:
        """Stop the heartbeat thread and delete the record if it is still ours."""
        self.stop_heartbeat()
        with self._mutex:
            if self.held:
                rec = self._read()
                if rec is not None and rec["token"] == self.token:
                    self.store.delete(self.key)
            self.held = False

    def check(self) -> None:
        """Raise what the background heartbeat found (LeaseLost), or LeaseLost if not held. No I/O."""
        if self._error is not None:
            raise self._error
        if not self.held:
            raise LeaseLost(f"run {self.run_id!r}: {self.owner!r} does not hold the lease")

    # --- background heartbeat ---------------------------------------------------------------
    def start_heartbeat(self, interval_s: float | None = None) -> None:
        """Renew every interval_s (default ttl_s / 3) on a daemon thread until stop_heartbeat(),
        release(), or a takeover (then check() raises the LeaseLost). Store errors are logged
        and retried: if they last beyond ttl_s the lease goes stale, as it should."""
        if self._thread is not None and self._thread.is_alive():
            return
        interval = self.ttl_s / 3 if interval_s is None else float(interval_s)
        self._stop.clear()

        def beat() -> None:
            while not self._stop.wait(interval):
                try:
                    self.heartbeat()
                except LeaseLost as e:
                    self._error = e
                    log.error("%s", e)
                    return
                except Exception as e:  # noqa: BLE001  a flaky store: try again next interval
                    log.warning("run %r: lease heartbeat failed (%s); retrying in %.1f s", self.run_id, e, interval)

        self._thread = threading.Thread(target=beat, name=f"lease-{self.run_id}", daemon=True)
        self._thread.start()

    def stop_heartbeat(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    def __enter__(self) -> RunLease:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"RunLease({self.run_id!r}, owner={self.owner!r}, held={self.held})"
