"""`ratchet run` stopped by SIGTERM mid-run: it ends within seconds with one line saying how to
resume, the attempt is recorded as interrupted, no process of it is left, and the resumed run
completes with every wave in its summary once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ratchet.store import open_store
from tests.waiting import until

ROOT = Path(__file__).resolve().parents[2]
TINY = {
    "steps": 6, "checkpoint_every": 2,
    "envs": {"n_train": 60, "n_heldout": 12},
    "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "vocab_size": 200, "sft_steps": 20, "sft_batch": 16},
    "rollout": {"prompts_per_wave": 4, "group_size": 4, "max_new_tokens": 16},
    "train": {"minibatch_prompts": 2},
    "gate": {"max_zero_variance_frac": 1.0},
    "monitor": {"max_zero_variance_frac": None},   # the tiny model's groups are all-equal
    "eval": {"n_tasks": 12},
}


def _ratchet_run(tmp_path: Path, store: str, name: str, steps: int = TINY["steps"]) -> subprocess.Popen:
    """`ratchet run` in a subprocess; its output goes to files (a full pipe would block it)."""
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({**TINY, "steps": steps}))
    # INFO, as a user's: the tests read the run's log lines (an earlier test may have quietened this process)
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_LOGGING_LEVEL": "INFO"}
    env.pop("PREFECT_API_URL", None)   # its own ephemeral server, as a user's `ratchet run`
    return subprocess.Popen([sys.executable, "-m", "ratchet.cli", "run", "--config", str(config), "--run-id", "sig",
                             "--store", store], cwd=ROOT, env=env, stdout=open(tmp_path / f"{name}.out", "w"),
                            stderr=open(tmp_path / f"{name}.err", "w"), start_new_session=True)


def _output(tmp_path: Path, name: str) -> tuple[str, str]:
    return (tmp_path / f"{name}.out").read_text(), (tmp_path / f"{name}.err").read_text()


def _run_until(tmp_path: Path, store_uri: str, name: str, step: int, steps: int = TINY["steps"]) -> subprocess.Popen:
    """`ratchet run` in a subprocess, returned once wave `step` is recorded."""
    proc = _ratchet_run(tmp_path, store_uri, name, steps)
    store = open_store(store_uri)

    def wave_done() -> bool:
        assert proc.poll() is None, _output(tmp_path, name)[1][-3000:]
        return store.exists(f"runs/sig/waves/{step:06d}/stats.json")

    until(wave_done, timeout=300, every=0.2, what=f"the run to finish wave {step}")
    return proc


def _children_of(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out.append(int(d.name))
    return out


@pytest.mark.slow
def test_sigterm_mid_run_stops_cleanly_and_the_run_resumes(tmp_path):
    store_uri = str(tmp_path / "store")
    proc = _run_until(tmp_path, store_uri, "first", step=2)
    store = open_store(store_uri)
    children = _children_of(proc.pid)
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)     # to the whole group, as Ctrl-C, `timeout` and systemd deliver it
    proc.wait(timeout=60)
    took = time.monotonic() - t0
    out, err = _output(tmp_path, "first")
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert took < 20, f"SIGTERM took {took:.1f} s"
    assert err.strip().splitlines()[-1] == "ratchet run: run sig interrupted by SIGTERM; resume with: ratchet run --run-id sig"
    assert "Traceback" not in err.strip().splitlines()[-1]
    time.sleep(1.0)
    left = [(p, _cmdline(p)) for p in children if Path(f"/proc/{p}").exists() and "zombie" not in _state(p)]
    assert left == [], "a child process outlived the run"
    assert store.get_json("runs/sig/attempts.json")[-1]["outcome"] == "interrupted: SIGTERM"

    proc = _ratchet_run(tmp_path, store_uri, "resumed")
    proc.wait(timeout=600)
    out, err = _output(tmp_path, "resumed")
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    full = store.get_json("runs/sig/summary.json")
    assert summary["run_id"] == "sig" and [h["step"] for h in full["history"]] == [0, 1, 2, 3, 4, 5]
    assert [a["outcome"] for a in full["attempts"]] == ["interrupted: SIGTERM", "completed"]


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = _children_of(todo.pop())
        out += kids
        todo += kids
    return out


@pytest.mark.slow
def test_sigkill_leaves_no_process_behind_and_the_next_attempt_says_so(tmp_path):
    """The ephemeral Prefect API and the sandbox workers die with a SIGKILLed run."""
    store_uri = str(tmp_path / "store")
    proc = _run_until(tmp_path, store_uri, "killed", step=0)
    store = open_store(store_uri)
    family = _descendants(proc.pid)
    assert family, "the run has child processes (the API server, sandbox workers)"
    proc.kill()
    proc.wait(timeout=10)
    def living() -> list[int]:
        return [p for p in family if Path(f"/proc/{p}").exists() and "zombie" not in _state(p)]

    until(lambda: not living(), timeout=10, every=0.2,
          what=lambda: f"the SIGKILLed run's processes to die; outlived it: {[(p, _cmdline(p)) for p in living()]}")

    proc = _ratchet_run(tmp_path, store_uri, "after-kill")
    proc.wait(timeout=600)
    assert proc.returncode == 0, _output(tmp_path, "after-kill")[1][-3000:]
    attempts = store.get_json("runs/sig/attempts.json")
    assert attempts[0]["outcome"].startswith("interrupted: the process ended") and attempts[1]["outcome"] == "completed"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].splitlines()[0]
    except (OSError, IndexError):
        return "zombie"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return ""


@pytest.mark.slow
def test_a_dead_prefect_api_is_restarted_and_the_run_completes(tmp_path):
    """The ephemeral API server killed mid-run: the run goes on (a watchdog starts the API again
    on its port) and prints its result line."""
    store_uri = str(tmp_path / "store")
    # 20 waves of about a second: the kill lands mid-run even when this process is slow to see wave 0
    proc = _run_until(tmp_path, store_uri, "api-killed", step=0, steps=20)
    servers = [p for p in _descendants(proc.pid) if "uvicorn" in _cmdline(p)]
    assert len(servers) == 1, [(p, _cmdline(p)) for p in _descendants(proc.pid)]
    os.kill(servers[0], signal.SIGKILL)
    proc.wait(timeout=300)
    out, err = _output(tmp_path, "api-killed")
    assert proc.returncode == 0, err[-3000:]
    assert "ephemeral Prefect API on port" in err and "died" in err
    assert err.index("died") < err.index("wave 20/20"), "the API was killed after the last wave: not mid-run"
    # the restarted API outlives the flow (it was started by the watchdog thread, and PDEATHSIG follows
    # the forking thread): the events queued at exit are delivered, not retried against a dead port
    after_flow = err.rsplit("Finished in state Completed()", 1)[-1]   # the flow run's, the last to finish
    assert "Unable to connect" not in after_flow, after_flow[:2000]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["run_id"] == "sig" and summary["steps"] == 20


class _Server:
    """What the watchdog reads of Prefect's SubprocessASGIServer, over a real process and a real port."""

    def __init__(self, proc: subprocess.Popen, port: int):
        self._proc, self.port, self.running, self.starts, self.looks = proc, port, True, 0, 0

    @property
    def server_process(self) -> subprocess.Popen:
        self.looks += 1               # once per round of the watchdog
        return self._proc

    @server_process.setter
    def server_process(self, proc: subprocess.Popen | None) -> None:
        self._proc = proc

    def start(self):
        self.starts += 1
        self.server_process, self.running = _sleeper(), True


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def test_the_api_watchdog_restarts_only_a_server_that_served_and_whose_port_went_quiet(monkeypatch, caplog):
    """Three `ratchet run`s migrating one fresh Prefect database at once (2026-12-07): one API died
    while starting, Prefect started another on a new port, and the watchdog, seeing the dead one,
    started a third onto that port every ~20 s for the whole run (each failed to bind; the port
    answered all the same). A server is restarted once it has served and nobody serves its port."""
    import socket

    from prefect.server.api.server import SubprocessASGIServer

    from ratchet.cli import _restart_ephemeral_api_if_it_dies
    from ratchet.net import free_port

    def listener(port: int) -> socket.socket:
        s = socket.socket()
        s.bind(("127.0.0.1", port))
        s.listen()
        return s

    # served, then died, its port quiet: restarted, once
    served = _Server(_sleeper(), free_port())
    port_of_served = listener(served.port)
    # died while starting (never listened): Prefect's start-up retries it, not the watchdog
    never_served = _Server(subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"]), free_port())
    # served, then died while its port still answers (another server took it): nothing to restart
    replaced = _Server(_sleeper(), free_port())
    port_of_replaced = listener(replaced.port)
    monkeypatch.setattr(SubprocessASGIServer, "_instances", {1: served, 2: never_served, 3: replaced})
    caplog.set_level("WARNING", logger="ratchet.cli")
    stop = _restart_ephemeral_api_if_it_dies(every_s=0.05)
    first = []
    try:
        until(lambda: min(served.looks, replaced.looks) >= 3, timeout=10, what="the watchdog to see both serving")
        first = [served._proc, replaced._proc]
        for proc in first:
            proc.kill()
            proc.wait()
        port_of_served.close()
        until(lambda: served.starts == 1, timeout=10, what="the served server's restart")
        looks = never_served.looks
        until(lambda: never_served.looks >= looks + 10, timeout=10, what="ten more rounds")   # in which nothing more happens
    finally:
        stop.set()
        port_of_replaced.close()
        for proc in [*first, served._proc, replaced._proc]:
            proc.kill()
    assert (served.starts, never_served.starts, replaced.starts) == (1, 0, 0)
    assert [r.getMessage() for r in caplog.records] == [
        f"the ephemeral Prefect API on port {served.port} died (exit -9); starting it again"]


def _waiting_for_flock(path: Path) -> set[int]:
    """The pids blocked in flock() on `path` (the kernel's /proc/locks lists a waiter as "-> FLOCK")."""
    inode = f":{os.stat(path).st_ino} "
    return {int(line.split()[5]) for line in Path("/proc/locks").read_text().splitlines()
            if " -> FLOCK " in line and inode in line}


def test_runs_started_together_migrate_one_fresh_prefect_database_in_turn(tmp_path):
    """Three `ratchet run`s on one fresh PREFECT_HOME (2026-12-07): their ephemeral APIs migrated the
    one database at once, and one died (sqlite3.OperationalError: no such table; two of three
    releases of three bare migrations failed so). Here the test holds the migration lock while three
    processes start: all three wait for it, before any touches the database; released, they bring
    it to head one after another."""
    import fcntl
    import sqlite3

    import prefect.server.database._migrations as migrations
    from alembic.script import ScriptDirectory
    from prefect.server.database.orm_models import AioSqliteORMConfiguration

    from ratchet.cli import MIGRATE_LOCK

    home = tmp_path / "prefect"
    home.mkdir()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PYTHONPATH": str(ROOT)}
    env.pop("PREFECT_API_URL", None)
    lock_path = home / MIGRATE_LOCK
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        procs = [subprocess.Popen([sys.executable, "-c", "from ratchet.cli import _migrate_ephemeral_db as m; m()"],
                                  cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(3)]
        pids = {p.pid for p in procs}

        def all_waiting() -> bool:
            assert all(p.poll() is None for p in procs), "a process ended while the test held the lock"
            return _waiting_for_flock(lock_path) == pids

        until(all_waiting, timeout=120, what=lambda: f"all three to wait: {_waiting_for_flock(lock_path)} of {pids}")
        assert not (home / "prefect.db").exists()
    errs = [p.communicate(timeout=300)[1] for p in procs]   # read as they run: a full pipe would block one
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(err[-2000:] for err in errs)
    head = ScriptDirectory(list(migrations.__path__)[0],
                           version_locations=[str(AioSqliteORMConfiguration().versions_dir)]).get_current_head()
    with sqlite3.connect(home / "prefect.db") as db:
        assert db.execute("select version_num from alembic_version").fetchall() == [(head,)]


def test_a_stop_signal_that_a_library_converts_still_ends_the_attempt_interrupted(monkeypatch):
    """A signal's Interrupted raised inside polars came out as a TypeError (CI, 2026-12-04): the attempt
    is still "interrupted", and `ratchet run` exits as interrupted (the test above)."""
    from ratchet import run

    monkeypatch.setattr(run, "_stop_signals", [])
    assert run.outcome(TypeError("boom")) == "failed: TypeError: boom"
    with pytest.raises(run.Interrupted):
        run.request_stop(signal.SIGTERM)
    assert run.outcome(TypeError("'<unprintable str object>' is not a Polars data type")) == "interrupted: SIGTERM"


def test_a_stop_signal_that_another_handler_took_and_a_library_converted_still_counts(monkeypatch):
    """While a flow runs, Prefect's SIGTERM handler is installed, not ours: the TerminationSignal it
    raised inside polars came out as a SchemaError ("only fails together with the others"; CI,
    2026-12-06), and `ratchet run` exited 1 as failed. The wakeup pipe notes the signal whatever ran."""
    from ratchet import run

    class Termination(BaseException):   # Prefect's TerminationSignal, as its handler raises it
        pass

    def prefect_like(signum, frame):
        raise Termination(signum)

    monkeypatch.setattr(run, "_stop_signals", [])
    monkeypatch.setattr(run, "_wakeup", None)
    before = signal.signal(signal.SIGTERM, prefect_like)
    try:
        run.note_stop_signals()
        assert run.stop_signal() is None
        try:
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1)                         # the handler runs at the next bytecode
            except Termination:
                raise TypeError("not a Polars data type") from None      # a library's conversion
        except TypeError as converted:
            assert run.outcome(converted) == "interrupted: SIGTERM" and run.stop_signal() == signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, before)
        os.close(signal.set_wakeup_fd(-1))
        os.close(run._wakeup)


CONVERTED_TO_A_PANIC = """
import os, signal, sys, time
import flows.nightly
from polars.exceptions import PanicException
from ratchet.cli import app

def nightly(cfg):   # the signal lands inside polars' Rust code, which turns the raised exception into a panic
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    except BaseException:
        raise PanicException("called `Result::unwrap()` on an `Err` value") from None

flows.nightly.nightly = nightly
app(["run", "--run-id", "panic", "--store", sys.argv[1]])
"""


def test_a_stop_signal_that_polars_turned_into_a_panic_still_exits_as_interrupted(tmp_path):
    """CI, 2026-12-07: SIGTERM mid-run, and Prefect's TerminationSignal, raised in a Python callback of
    polars' Rust side, came out as pyo3's PanicException, a BaseException that `ratchet run` let
    through: exit 1 and a panic's traceback, not 143 and the line saying how to resume."""
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    proc = subprocess.run([sys.executable, "-c", CONVERTED_TO_A_PANIC, str(tmp_path / "store")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == ("ratchet run: run panic interrupted by SIGTERM; "
                                                    "resume with: ratchet run --run-id panic")
