"""The `ratchet` command line.

    ratchet run [--steps N] [--run-id ID] [--store URI] [--config FILE.json]   the nightly cycle
                [--tasks FILE.jsonl ...]                                          + your own task sets
                [--model DIR]                                                     + your own model
    ratchet sandbox run FILE [--json] | ratchet sandbox doctor                  the sandbox
    ratchet envs import FILE --format taskspec|humaneval                         user task specs
    ratchet verify --tasks T.jsonl --completions C.jsonl                         score any model's outputs
    ratchet gate check FILE.parquet                                               the wave gate
    ratchet trace show RUN --step N [--task ID] | ratchet trace replay RUN --step N --task ID   traces
    ratchet serve --model DIR [--port N] [--host H]                               OpenAI-compatible rollout server
    ratchet eval niah --model DIR [--lengths 120,240] [--depths 0,0.5,1]          long-context recall table

Only `run` reaches Prefect (lazily, inside the command), so the other commands start fast.
`run` checks its settings first (`ratchet.preflight`) and exits 2, one line per problem,
before Prefect is imported or anything starts. Every command fails with one line on stderr,
`error: <what> (<where>)`: exit 2 for bad input or usage, 1 for a check that ran and failed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import typer
from pydantic import ValidationError

from ratchet.cli_errors import OneLineErrors, fail, message, read_text, require_model_dir
from ratchet.config import AgentConfig, ModelConfig, NightlyConfig, StoreConfig, describe
from ratchet.data.cli import app as gate_app
from ratchet.envs_cli import app as envs_app
from ratchet.eval_cli import app as eval_app
from ratchet.sandbox.cli import app as sandbox_app
from ratchet.trace_cli import app as trace_app
from ratchet.verify.cli import verify_command

app = typer.Typer(help="ratchet: an RL post-training pipeline for LLMs, orchestrated with Prefect.",
                  no_args_is_help=True, add_completion=False, cls=OneLineErrors)
app.add_typer(sandbox_app, name="sandbox", help="Run code in the sandbox; inspect its mechanisms.")
app.add_typer(gate_app, name="gate", help="Great Expectations gates on waves and task tables.")
app.add_typer(envs_app, name="envs", help="Import task specs (taskspec, HumanEval) and audit them.")
app.add_typer(trace_app, name="trace", help="Show a wave's trajectories; replay them to see if the rewards reproduce.")
app.add_typer(eval_app, name="eval", help="Probe a checkpoint: needle-in-a-haystack recall by depth and length.")
app.command("verify", help="Score completions against tasks in the sandbox (one JSON line each).")(verify_command)


@app.command()
def serve(
    model: Path = typer.Option(..., exists=True, file_okay=False, help="Checkpoint directory (Hugging Face layout)."),
    port: int = typer.Option(8000, min=1, max=65535, help="TCP port."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0: every interface)."),
    name: Optional[str] = typer.Option(None, help="Model id in the API [default: the directory's name]."),
    batch_size: int = typer.Option(128, min=1, help="Sequences decoded together."),
) -> None:
    """Serve a checkpoint with the torch engine behind an OpenAI-compatible API (/v1/completions,
    /v1/models; /v1/load swaps in another checkpoint). See ratchet/rollout/server.py."""
    require_model_dir(model)
    from ratchet.rollout.server import BadRequest, serve as serve_model

    try:
        serve_model(str(model), host=host, port=port, name=name, batch_size=batch_size)
    except BadRequest as e:
        typer.echo(f"error: ratchet serve: {e.message}", err=True)
        raise typer.Exit(2)


SUMMARY_KEYS = ("run_id", "summary", "base_pass_rate", "final_pass_rate", "promoted", "steps", "wall_s")


@app.command()
def run(
    steps: Optional[int] = typer.Option(None, help=f"{describe(NightlyConfig, 'steps')} [default: {NightlyConfig().steps}]"),
    run_id: Optional[str] = typer.Option(None, help="Run id; an existing one is resumed from its LATEST checkpoint."),
    store: Optional[str] = typer.Option(None, help=f"{describe(StoreConfig, 'uri')} [default: {StoreConfig().uri}]"),
    config: Optional[Path] = typer.Option(None, help="JSON file of NightlyConfig fields (overrides)."),
    tasks: Optional[list[str]] = typer.Option(None, "--tasks", help="A task file to train on beside the families "
                                              "(.jsonl, .jsonl.gz, .parquet; repeatable): adds to envs.sources."),
    model: Optional[str] = typer.Option(None, "--model", metavar="DIR",
                                        help=f"{describe(ModelConfig, 'path')} Sets model.path."),
    turns: Optional[int] = typer.Option(None, "--turns", metavar="K",
                                        help=f"{describe(AgentConfig, 'turns')} Sets agent.turns. [default: 1]"),
) -> None:
    """Run the nightly training cycle now. The last line printed is one JSON object."""
    cfg = _settings(config, steps, run_id, store, model, turns)
    cfg = _with_sources(cfg, tasks or [], config)
    from ratchet.preflight import SettingsError, require

    try:
        require(cfg)               # before Prefect is imported: a bad setting costs a second, not a run
    except SettingsError as e:
        for problem in e.problems:
            typer.echo(message(problem, config or "settings"), err=True)
        raise typer.Exit(2) from None
    if cfg.run_id is None:   # named here, so that every message can say how to resume it
        cfg = cfg.model_copy(update={"run_id": datetime.now(timezone.utc).strftime("nightly-%Y%m%d-%H%M%S")})
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # The ephemeral API migrates a fresh database on first start: allow for a busy machine.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    _ephemeral_api_dies_with_us()
    _migrate_ephemeral_db()
    from flows.nightly import nightly
    from ratchet.run import note_stop_signals, request_stop, stopped_by

    handlers = {sig: signal.signal(sig, lambda signum, _frame: request_stop(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    note_stop_signals()   # a signal Prefect's handler took, and a library then converted, still counts
    watchdog = _restart_ephemeral_api_if_it_dies()
    resume = f"resume with: ratchet run --run-id {cfg.run_id}"

    def interrupted(signum: int) -> None:
        _quiet_prefect_exit()
        typer.echo(f"ratchet run: run {cfg.run_id} interrupted by {signal.Signals(signum).name}; {resume}", err=True)
        _exit_now(128 + signum)

    try:
        summary = nightly(cfg)
    except BaseException as e:   # the flow has logged the traceback; the last line says what ended it
        if (signum := stopped_by(e)) is not None:
            interrupted(signum)
        if not isinstance(e, Exception) or os.environ.get("RATCHET_DEBUG"):
            raise
        _quiet_prefect_exit()
        first = (str(e).strip().splitlines() or [""])[0]
        from ratchet.store.lease import LeaseHeld

        then = "resume it once that run has ended or gone stale" if isinstance(e, LeaseHeld) else resume  # it runs
        typer.echo(f"error: {type(e).__name__}: {first} (run {cfg.run_id}; {then})", err=True)
        raise typer.Exit(1)
    finally:
        watchdog.set()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    _quiet_prefect_exit()
    if summary.get("eval_table"):
        print(f"\n{summary['eval_table']}\n\n{summary['promotion']}\n", flush=True)
    print(json.dumps({k: summary[k] for k in SUMMARY_KEYS}), flush=True)


def _settings(config: Path | None, steps: int | None, run_id: str | None, store: str | None,
              model: str | None = None, turns: int | None = None) -> NightlyConfig:
    """The run's NightlyConfig from --config and the options; fail (exit 2) naming each bad field."""
    fields = {}
    if config is not None:
        text = read_text(config, "config file")
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as e:
            fail(f"malformed JSON: {e.msg}", f"{config}:{e.lineno}:{e.colno}")
        if not isinstance(fields, dict):
            fail(f"the config must be a JSON object of NightlyConfig fields, got a {type(fields).__name__}", config)
    for name, value in (("steps", steps), ("run_id", run_id)):
        if value is not None:
            fields[name] = value
    if store is not None:
        fields["store"] = {"uri": store}
    for section_name, key, value in (("model", "path", model), ("agent", "turns", turns)):
        if value is not None:
            section = fields.get(section_name)
            fields[section_name] = {**(section if isinstance(section, dict) else {}), key: value}
    try:
        return NightlyConfig.model_validate(fields)
    except ValidationError as e:
        for err in e.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(config)"
            got = "" if err["type"] == "missing" else f" (got {json.dumps(err.get('input'), default=str)[:60]})"
            typer.echo(message(f"field {where!r}: {err['msg']}{got}", config or "options"), err=True)
        raise typer.Exit(2)


def _with_sources(cfg: NightlyConfig, tasks: list[str], config: Path | None) -> NightlyConfig:
    """`--tasks` files appended to envs.sources (local paths made absolute: the flow may run elsewhere)."""
    if not tasks:
        return cfg
    added = tuple(t if "://" in t else str(Path(t).expanduser().absolute()) for t in tasks)
    try:
        envs = cfg.envs.model_validate({**cfg.envs.model_dump(), "sources": cfg.envs.sources + added})
    except ValidationError as e:
        for err in e.errors():
            typer.echo(message(f"--tasks: {err['msg'].removeprefix('Value error, ')}", config or "options"), err=True)
        raise typer.Exit(2)
    return cfg.model_copy(update={"envs": envs})


def _ephemeral_api_dies_with_us() -> None:
    """The ephemeral Prefect API is a child process (uvicorn) that outlives a SIGKILLed parent.
    Start it with PR_SET_PDEATHSIG, so the kernel kills it when this process dies, however; and
    in a process group of its own, so that a signal to ours (Ctrl-C in a terminal, `timeout`)
    reaches this process, which closes the run through the API, and not the API first."""
    import ctypes
    import subprocess
    from types import SimpleNamespace

    import prefect.server.api.server as api

    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def die_with_parent() -> None:   # runs in the child, between fork and exec
        os.setpgrp()                           # out of our process group: Ctrl-C / `timeout` signal us, not it
        libc.prctl(1, signal.SIGKILL)          # PR_SET_PDEATHSIG
        if os.getppid() != parent:             # the parent died before the prctl: go now
            os._exit(1)

    def popen(*args, **kw):
        kw.setdefault("preexec_fn", die_with_parent)
        return subprocess.Popen(*args, **kw)

    api.subprocess = SimpleNamespace(**{**vars(subprocess), "Popen": popen})


MIGRATE_LOCK = "ratchet-migrate.lock"   # in PREFECT_HOME: `ratchet run`s migrate its database one at a time


def _migrate_ephemeral_db() -> None:
    """Bring the ephemeral API's database to Prefect's head revision here, one process at a time.

    Every ephemeral API migrates its database as it starts, and `ratchet run`s started together on
    one PREFECT_HOME share that database: their migrations race (one drops a table another has just
    dropped; sqlite3.OperationalError, and that API dies while starting). So the first holder of an
    exclusive lock in PREFECT_HOME migrates it, and the others, in turn, find it at head (a
    no-op); each API's own migration is then a no-op too. With PREFECT_API_URL set there is no
    ephemeral API: its server migrates its own database."""
    import asyncio
    import fcntl

    from prefect.server.database import provide_database_interface
    from prefect.settings import PREFECT_API_DATABASE_MIGRATE_ON_START, PREFECT_API_URL, PREFECT_HOME

    if PREFECT_API_URL.value() or not PREFECT_API_DATABASE_MIGRATE_ON_START.value():
        return
    home = PREFECT_HOME.value()
    home.mkdir(parents=True, exist_ok=True)
    with open(home / MIGRATE_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # released when the file closes, or when this process dies
        asyncio.run(provide_database_interface().create_db())


def _restart_ephemeral_api_if_it_dies(every_s: float = 2.0) -> threading.Event:
    """A watchdog thread: an ephemeral API that dies mid-run is started again on its port (its
    database is a file, so the run's state survives) instead of leaving the run's API calls to
    retry for minutes. Without an ephemeral API (PREFECT_API_URL set) it watches nothing.

    Only a server it has seen serving (alive, its port listening) and whose port nobody serves any
    more: one that fails while starting is Prefect's own start-up to retry (it starts another on a
    new port; seen when three `ratchet run`s migrated one fresh database at once), and a restart
    onto a port that still answers fails to bind and, answered all the same, would be retried for
    ever (the same three runs: a uvicorn started every ~20 s for the whole run)."""
    import logging

    from prefect.server.api.server import SubprocessASGIServer

    log = logging.getLogger("ratchet.cli")

    stopped = threading.Event()

    def watch() -> None:
        served: set[int] = set()      # the pids seen serving
        while not stopped.wait(every_s):
            for server in list(SubprocessASGIServer._instances.values()):
                proc = server.server_process
                if proc is None or server.port is None:
                    continue
                if proc.poll() is None:
                    if proc.pid not in served and _listening(server.port):
                        served.add(proc.pid)
                    continue
                if proc.pid not in served or _listening(server.port):
                    continue
                served.discard(proc.pid)
                log.warning("the ephemeral Prefect API on port %s died (exit %s); starting it again",
                            server.port, proc.returncode)
                server.server_process, server.running = None, False
                try:
                    server.start()
                except Exception as e:  # noqa: BLE001 - the run's own calls will report it
                    log.error("could not restart the ephemeral Prefect API: %s", e)
        # A server started here is this thread's child, and PR_SET_PDEATHSIG (`die_with_parent`) fires
        # when the forking THREAD exits, not the process: returning would kill it while Prefect still
        # has the run's queued events to deliver at exit (7 s each, then a hang). Park until exit.
        threading.Event().wait()

    threading.Thread(target=watch, name="ephemeral-api-watchdog", daemon=True).start()
    return stopped      # set it to stop watching


def _listening(port: int) -> bool:
    """Whether a process listens on loopback `port`: with SO_REUSEADDR a bind fails then, and not for
    the connections a closed server leaves in TIME_WAIT."""
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _exit_now(code: int) -> None:
    """Exit at once, the run already closed (attempt recorded, lease released). Prefect's exit
    handlers wait to deliver their queued events to the API, and after a signal that reached
    the whole process group (Ctrl-C in a terminal, `timeout`, systemd) the ephemeral API is
    gone too: they would wait for ever. The sandbox workers are stopped first (os._exit skips
    the exit handlers that would)."""
    from ratchet.sandbox.pool import close_defaults

    close_defaults()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _quiet_prefect_exit() -> None:
    """Prefect stops its ephemeral API at exit and logs it: keep our line the last one printed."""
    import logging

    sys.stderr.flush()
    logging.getLogger("prefect").setLevel(logging.WARNING)


if __name__ == "__main__":
    app()
