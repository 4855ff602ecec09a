"""Every sandbox run is leased, and a reaper ends whatever outlives its lease.

    lease = take(pid, limits)        # a backend, as soon as the run's process exists
    ...; lease.release()             # once the backend has reaped the run itself
    reap()                           # any process on the host: end runs past their lease or orphaned
    counts()                         # {"launched", "reaped", "orphaned"} of this process, cumulative

A lease is a small JSON file in the host's lease directory (`$RATCHET_SANDBOX_LEASES`, default
`/tmp/ratchet-sandbox-leases`; one per machine, shared by every worker on it): the run's process
(pid and its start time in /proc, so a reused pid is never killed), its owner (the worker process,
pid and start time), a deadline (the run's wall limit + GRACE_S) and the slot's uid.

`reap()` claims each lease it acts on by renaming the file (so two reapers never both count or
kill one run) and then:
- owner dead: the run is **orphaned** (counted); if its process is still alive it is killed
  (process group, the process, and, as root, everything its slot uid runs) and **reaped** (counted);
- owner alive, deadline passed, run alive: the owner failed to end it: killed and **reaped**;
- otherwise the lease is left alone (the owner releases it).

Who reaps: every open `Sandbox` runs `reap()` on a daemon thread every REAP_EVERY_S and before
each wave; `ratchet sandbox reap` does it once (a cron job or a sidecar on a worker host).

Defence in depth, before any reaper: the run's process is in its own session and process group;
the subprocess and bwrap backends' child has PR_SET_PDEATHSIG=SIGKILL (set after the uid drop,
which would clear it), bwrap adds --die-with-parent; a zygote ends its runs when its worker's
socket closes. The reaper is what is left when those fail: a zygote killed with its worker, a
worker frozen past the deadline.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

GRACE_S = 10.0
"""A run's lease lasts its wall limit plus this (the owner's own timer kills at the wall limit)."""
REAP_EVERY_S = 2.0
"""How often an open Sandbox's reaper thread scans the lease directory."""
_counts = {"launched": 0, "reaped": 0, "orphaned": 0}
_lock = threading.Lock()


_made: set[str] = set()
_HOST = socket.gethostname()


def lease_dir() -> str:
    """The host's lease directory (created 0700 on first use)."""
    d = os.environ.get("RATCHET_SANDBOX_LEASES") or "/tmp/ratchet-sandbox-leases"
    if d not in _made or not os.path.isdir(d):
        os.makedirs(d, mode=0o700, exist_ok=True)
        _made.add(d)
    return d


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, /proc/<pid>/stat field 22); None if it
    is gone or a zombie (a zombie has ended: nothing left to kill)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()   # after "pid (comm) ": state is field 3
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def alive(pid: int, start: int | None) -> bool:
    """Is `pid` still the process that started at `start`? (start None: whatever runs as `pid`.)"""
    now = start_time(pid)
    return now is not None and (start is None or now == start)


_self: tuple[int, int | None] | None = None


def _owner() -> tuple[int, int | None]:
    global _self
    if _self is None or _self[0] != os.getpid():      # (re)computed after a fork
        _self = (os.getpid(), start_time(os.getpid()))
    return _self


class Lease:
    def __init__(self, path: str | None):
        self.path = path

    def release(self) -> None:
        if self.path is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass   # a reaper claimed it (the run was past its lease)


def take(pid: int, wall_s: float, uid: int | None = None) -> Lease:
    """Lease the run whose process is `pid` (its own process group) for wall_s + GRACE_S seconds."""
    start = start_time(pid)
    with _lock:
        _counts["launched"] += 1
    if start is None:           # it has already ended (a zombie until its owner waits): nothing to lease
        return Lease(None)
    owner, owner_start = _owner()
    record = {"pid": pid, "start": start, "owner": owner, "owner_start": owner_start,
              "deadline": time.time() + wall_s + GRACE_S, "uid": uid, "host": _HOST}
    path = os.path.join(lease_dir(), f"{pid}-{start}.json")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, json.dumps(record).encode())
    finally:
        os.close(fd)
    return Lease(path)


def _kill(rec: dict, owner_dead: bool) -> None:
    pid = rec["pid"]
    for send in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            send()
        except OSError:
            pass
    # What left the process group, by the slot's uid (host.UID_BASE and up): only for a dead owner,
    # whose slot no later run can be using (a live owner's slot may already serve its next run).
    if owner_dead and rec.get("uid") and os.geteuid() == 0 and rec["uid"] >= 1_000_000:
        from .host import sweep_uid
        sweep_uid(rec["uid"])


def reap(directory: str | None = None, now: float | None = None) -> dict[str, int]:
    """One pass over the lease directory (default: `lease_dir()`); returns what this pass counted
    (also added to counts())."""
    now = time.time() if now is None else now
    found = {"reaped": 0, "orphaned": 0}
    d = directory or lease_dir()
    try:
        names = [n for n in os.listdir(d) if n.endswith(".json")]
    except OSError:
        return found
    me = os.getpid()
    for name in names:
        path = os.path.join(d, name)
        try:
            with open(path) as f:
                rec = json.load(f)
        except (OSError, ValueError):
            continue   # released meanwhile, or half-written (its owner is writing it now)
        run_alive = rec.get("start") is not None and alive(rec["pid"], rec["start"])   # never a pid we cannot identify
        owner_dead = not alive(rec["owner"], rec["owner_start"])
        if not owner_dead and not (run_alive and now > rec["deadline"]):
            continue
        claimed = f"{path}.reaping-{me}"
        try:
            os.rename(path, claimed)          # one reaper acts on a lease, once
        except OSError:
            continue
        if owner_dead:
            found["orphaned"] += 1
        if run_alive:
            _kill(rec, owner_dead)
            found["reaped"] += 1
        try:
            os.unlink(claimed)
        except OSError:
            pass
    if found["reaped"] or found["orphaned"]:
        with _lock:
            for k, v in found.items():
                _counts[k] += v
    return found


def counts() -> dict[str, int]:
    """This process's cumulative launched / reaped / orphaned counts (subtract two to get a wave's)."""
    with _lock:
        return dict(_counts)


def diff(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


_reaper: threading.Thread | None = None


def start_reaper() -> None:
    """A daemon thread in this process running reap() every REAP_EVERY_S (idempotent)."""
    global _reaper
    with _lock:
        if _reaper is not None and _reaper.is_alive():
            return
        _reaper = threading.Thread(target=_loop, name="sandbox-reaper", daemon=True)
        _reaper.start()


def _loop() -> None:
    while True:
        time.sleep(REAP_EVERY_S)
        try:
            reap()
        except Exception:   # a reaper must never take its worker down
            pass
