"""One writer per run id: RunLease on both backends (local directory, S3 on loopback).
A fake clock stands in for time: `sleep` advances it, so nothing here waits for real.

    .venv/bin/pytest -q tests/store/test_lease.py
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading

import pytest

from ratchet.store import open_store
from ratchet.store.lease import LeaseHeld, LeaseLost, RunLease, lease_key

T0 = 1_700_000_000.0   # 2023-11-14T22:13:20Z


class FakeClock:
    def __init__(self):
        self.t = T0

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return open_store(str(tmp_path / "store"))
    return open_store(request.getfixturevalue("s3_store_uri"))


@pytest.fixture
def clock():
    return FakeClock()


def lease(store, owner, clock, **kw) -> RunLease:
    """ttl 60 s; acquisition settles for 1 s of fake time."""
    return RunLease(store, "r1", owner=owner, ttl_s=60, settle_s=1.0, clock=clock, sleep=clock.advance, **kw)


def test_second_owner_is_refused_naming_the_first(store, clock):
    a = lease(store, "trainer-A", clock).acquire()       # heartbeat written at T0, held from T0 + 1
    clock.advance(5)
    b = lease(store, "trainer-B", clock)
    with pytest.raises(LeaseHeld) as e:
        b.acquire()
    msg = str(e.value)
    assert "'trainer-A'" in msg and f"host {socket.gethostname()}" in msg and f"pid {os.getpid()}" in msg
    assert "6.0 s ago (2023-11-14T22:13:20Z)" in msg and "stale 54.0 s from now (ttl 60 s)" in msg
    assert e.value.holder["token"] == a.token and not b.held
    assert store.get_json(lease_key("r1"))["owner"] == "trainer-A"     # the refused owner wrote nothing
    a.heartbeat()                                                        # and the holder is undisturbed


def test_stale_lease_is_taken_over_after_ttl_and_the_old_holder_stops(store, clock):
    a = lease(store, "trainer-A", clock).acquire()      # heartbeat at T0; now T0 + 1
    b = lease(store, "trainer-B", clock)
    clock.advance(59)                                    # heartbeat exactly 60 s old: not yet stale
    with pytest.raises(LeaseHeld):
        b.acquire()
    clock.advance(1)                                     # 61 s old: stale
    assert b.acquire().held
    with pytest.raises(LeaseLost, match=r"trainer-A.*taken over by owner 'trainer-B'"):
        a.heartbeat()
    assert not a.held
    a.release()                                          # must not delete the new holder's record
    assert store.get_json(lease_key("r1"))["token"] == b.token
    with pytest.raises(LeaseLost):
        a.heartbeat()


def test_heartbeat_keeps_the_lease_alive(store, clock):
    a = lease(store, "trainer-A", clock).acquire()
    for _ in range(3):
        clock.advance(50)
        a.heartbeat()
    clock.advance(50)                                    # 150 s after acquiring, 50 s after the last beat
    with pytest.raises(LeaseHeld, match="50.0 s ago"):
        lease(store, "trainer-B", clock).acquire()


def test_release_then_reacquire(store, clock):
    a = lease(store, "trainer-A", clock).acquire()
    a.release()
    assert not store.exists(lease_key("r1")) and not a.held
    b = lease(store, "trainer-B", clock).acquire()      # at once, no ttl to wait out
    assert store.get_json(lease_key("r1"))["owner"] == "trainer-B"
    b.release()
    assert a.acquire().held                              # the same object can take it again


def test_context_manager_releases_even_on_error(store, clock):
    with pytest.raises(ZeroDivisionError):
        with lease(store, "trainer-A", clock) as a:
            assert a.held and store.get_json(lease_key("r1"))["owner"] == "trainer-A"
            1 / 0
    assert not store.exists(lease_key("r1"))
    with lease(store, "trainer-B", clock):
        pass


def test_leases_of_different_runs_are_independent(store, clock):
    lease(store, "trainer-A", clock).acquire()
    other = RunLease(store, "r2", owner="trainer-B", clock=clock, sleep=clock.advance)
    assert other.acquire().held


def test_two_contenders_that_both_saw_it_free_the_last_writer_wins(store, clock, monkeypatch):
    """B read the lease free before A wrote, and writes while A settles: A backs off."""
    b = lease(store, "trainer-B", clock)
    stale_views = [None]                                 # B's first read happened before A's write
    real_read = b._read
    monkeypatch.setattr(b, "_read", lambda: stale_views.pop() if stale_views else real_read())

    def settle(s: float) -> None:
        clock.advance(s)
        if not b.held:
            b.acquire()                                  # B writes during A's settle window

    a = RunLease(store, "r1", owner="trainer-A", ttl_s=60, settle_s=1.0, clock=clock, sleep=settle)
    with pytest.raises(LeaseHeld, match="won the race.*'trainer-B'"):
        a.acquire()
    assert b.held and not a.held
    b.heartbeat()
    assert store.get_json(lease_key("r1"))["token"] == b.token


def test_a_contender_whose_write_was_slow_waits_until_a_holder_it_overwrote_stops(store, clock, monkeypatch):
    """Found by review: A read the lease free, its PUT took 1.5 s (retried once), longer than settle_s;
    meanwhile B took the lease. A's late write overwrote B's record and, 1 s later, A read its own back:
    both held the lease until B's next heartbeat, and B's flow went on until its next checkpoint.
    A now waits, before reading back, long enough for B to beat and find A's token."""
    b = lease(store, "trainer-B", clock).acquire()
    next_beat = [clock() + 20]                           # B beats every ttl_s / 3, as start_heartbeat does

    def sleep(s: float) -> None:                         # while A waits, time passes for B too
        end = clock() + s
        while next_beat[0] <= end:
            clock.t = next_beat[0]
            with contextlib.suppress(LeaseLost):
                b.heartbeat()
            next_beat[0] += 20
        clock.t = end

    a = RunLease(store, "r1", owner="trainer-A", ttl_s=60, settle_s=1.0, clock=clock, sleep=sleep)
    views, real_read, real_write = [None], a._read, a._write
    monkeypatch.setattr(a, "_read", lambda: views.pop() if views else real_read())   # read before B wrote
    monkeypatch.setattr(a, "_write", lambda now: (clock.advance(1.5), real_write(now)))   # a slow PUT
    a.acquire()
    assert a.held and not b.held                         # never both: B stopped before A went on
    assert store.get_json(lease_key("r1"))["token"] == a.token


def test_garbage_record_counts_as_free(store, clock, caplog):
    store.put_bytes(lease_key("r1"), b"{not json")
    assert lease(store, "trainer-A", clock).acquire().held
    assert "unreadable" in caplog.text


def test_background_heartbeat_stops_on_takeover(store, clock):
    a = lease(store, "trainer-A", clock).acquire()
    clock.advance(61)
    lease(store, "trainer-B", clock).acquire()           # A went stale and was taken over
    a.start_heartbeat(interval_s=0.001)
    a._thread.join(timeout=30)                           # the thread ends by itself on LeaseLost
    assert not a._thread.is_alive()
    with pytest.raises(LeaseLost, match="trainer-B"):
        a.check()


def test_background_heartbeat_renews_and_stops(store, clock):
    a = lease(store, "trainer-A", clock).acquire()
    clock.advance(30)
    beat, real = threading.Event(), a.heartbeat
    a.heartbeat = lambda: (real(), beat.set())           # the thread calls self.heartbeat()
    a.start_heartbeat(interval_s=0.001)
    assert beat.wait(timeout=30)                         # an event, not a sleep
    a.stop_heartbeat()
    assert a._thread is None
    assert store.get_json(lease_key("r1"))["heartbeat_at"] == T0 + 31
    clock.advance(50)
    with pytest.raises(LeaseHeld, match="50.0 s ago"):   # renewed by the thread, not by the caller
        lease(store, "trainer-B", clock).acquire()
    a.check()
    a.release()
    with pytest.raises(LeaseLost, match="does not hold"):
        a.check()


def test_a_lease_of_a_killed_process_here_is_taken_over_at_once(store, clock):
    """Same kernel boot and pid namespace, holder pid gone: no need to wait out the ttl.
    A holder elsewhere (another proc_ns) is trusted until its heartbeat goes stale."""
    import json
    import subprocess
    import sys

    from ratchet.store.lease import _proc_ns

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    record = {"format": "ratchet-lease/1", "owner": "killed-run", "token": "t0", "host": socket.gethostname(),
              "pid": dead.pid, "proc_ns": _proc_ns(), "acquired_at": T0, "heartbeat_at": T0, "ttl_s": 60.0}
    store.put_bytes(lease_key("r"), json.dumps(record).encode())
    lease = RunLease(store, "r", owner="restart", ttl_s=60, clock=clock, sleep=clock.advance).acquire()
    assert store.get_json(lease_key("r"))["owner"] == "restart"
    lease.release()

    store.put_bytes(lease_key("r"), json.dumps({**record, "proc_ns": "another-machine:1"}).encode())
    with pytest.raises(LeaseHeld, match="killed-run"):
        RunLease(store, "r", owner="restart", ttl_s=60, clock=clock, sleep=clock.advance).acquire()


def test_an_attempt_whose_lease_was_taken_over_leaves_attempts_json_to_the_new_owner(tmp_path, caplog):
    """Found by review: a process whose lease went stale and was taken over still wrote its attempt's
    end into attempts.json when it stopped, over the new owner's (which had marked it interrupted)."""
    from ratchet.run import run_attempt
    from ratchet.summary import begin_attempt

    store = open_store(str(tmp_path / "store"))
    new = RunLease(store, "r1", owner="new", ttl_s=60, settle_s=0)
    with pytest.raises(LeaseLost):
        with run_attempt(store, "r1", owner="old", ttl_s=60) as old:
            old.stop_heartbeat()
            store.put_json(lease_key("r1"), {**store.get_json(lease_key("r1")), "heartbeat_at": 0.0})   # gone stale
            new.acquire()                            # taken over, and held while the old attempt ends
            begin_attempt(store, "r1")               # the new owner's attempt; the old one is marked interrupted
            theirs = store.get_json("runs/r1/attempts.json")
            with pytest.raises(LeaseLost):
                old.heartbeat()
            raise LeaseLost("the old owner stops")
    assert [a["outcome"] for a in theirs] == ["interrupted: the process ended without closing the attempt (killed?)",
                                              "running"]
    assert store.get_json("runs/r1/attempts.json") == theirs
    assert "attempt 0 ended (failed: LeaseLost: the old owner stops) and is not recorded" in caplog.text
    assert "taken over by owner 'new'" in caplog.text and store.get_json(lease_key("r1"))["token"] == new.token
    new.release()
