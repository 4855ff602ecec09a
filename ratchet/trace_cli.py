"""`ratchet trace`: read a wave's trajectories, and replay them through the sandbox.

    ratchet trace show RUN --step N [--task ID]          prompt, completion, reward, metrics, feedback, advantage
    ratchet trace replay RUN --step N --task ID [--json] does the stored reward reproduce?

`show` reads the wave's most complete table (trained, else scored, else the raw trajectories);
`replay` verifies the stored completions of one task again with the wave's own spec and
settings (ratchet/trace.py) and exits 1 when a sample's reward does not reproduce (a flaky task
or a drifted environment). An unknown run, wave or task, a bad run id or store is one `error:`
line, exit 2, and the store is not written. No Prefect is imported here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ratchet.cli_errors import CHECK_FAILED, fail
from ratchet.config import StoreConfig, describe

app = typer.Typer(help="Traces: show a wave's trajectories, replay them through the sandbox.", no_args_is_help=True)


@app.callback()
def _trace() -> None:
    """Traces: show a wave's trajectories, replay them through the sandbox."""


def _open(store: str, run_id: str):
    """The store (never created here) after checking the run id and the store's settings."""
    from ratchet.preflight import check_run_id, check_store
    from ratchet.store import open_store

    for problem in check_run_id(run_id):
        fail(problem, "RUN")
    for problem in check_store(store):
        fail(problem, "--store")
    if not store.startswith("s3://"):
        path = Path(store.removeprefix("file://")).expanduser()
        if not path.is_dir():
            fail("no store here (no such directory)", f"--store {store}")
    return open_store(store)


@app.command()
def show(
    run_id: str = typer.Argument(..., metavar="RUN", help="Run id."),
    step: int = typer.Option(..., "--step", min=0, help="Wave (step) index."),
    task: Optional[str] = typer.Option(None, "--task", help="Only this task's samples."),
    store: str = typer.Option(StoreConfig().uri, help=describe(StoreConfig, "uri")),
) -> None:
    """Print a wave's samples: prompt, completion, reward, metrics, the sandbox's feedback, advantage."""
    from ratchet.trace import TraceError, load_wave, render

    st = _open(store, run_id)
    try:
        typer.echo(render(load_wave(st, run_id, step, task)))
    except TraceError as e:
        fail(str(e), st.root_uri)


@app.command()
def replay(
    run_id: str = typer.Argument(..., metavar="RUN", help="Run id."),
    step: int = typer.Option(..., "--step", min=0, help="Wave (step) index."),
    task: str = typer.Option(..., "--task", help="Task whose samples are replayed."),
    store: str = typer.Option(StoreConfig().uri, help=describe(StoreConfig, "uri")),
    tolerance: float = typer.Option(1e-9, min=0, help="Largest difference of rewards that still reproduces."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON object."),
) -> None:
    """Verify a task's stored completions again; exit 1 if a stored reward does not reproduce."""
    from ratchet.trace import TraceError, render_replay, replay as replay_task, replay_json

    st = _open(store, run_id)
    try:
        report = replay_task(st, run_id, step, task, tolerance=tolerance)
    except TraceError as e:
        fail(str(e), st.root_uri)
    typer.echo(replay_json(report) if as_json else render_replay(report))
    if not report.reproduced:
        raise typer.Exit(CHECK_FAILED)


if __name__ == "__main__":
    app()
