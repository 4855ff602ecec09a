"""Watching a run: each wave's scalars as TensorBoard event files, the curves as a PNG, a table.

    write_tensorboard(store, run_id, step, stats)   # runs/<run_id>/tensorboard/events.out.tfevents.<step>.ratchet
    view = render(store, run_id, history)           # runs/<run_id>/plots/curves.png and scalars.md
    report_markdown(run_id, view)                   # the table with the plot inlined, for a Prefect artifact
    tensorboard --logdir .ratchet/store/runs/<run_id>/tensorboard

Every numeric value of a wave's stats dict (`runs/<run_id>/waves/<step>/stats.json`) is a
signal: a new figure added to the stats shows up here with no change. Each signal belongs to a
group (`group_of`: outcome, policy, speed, data, other), which is its TensorBoard section
(tag `<group>/<name>`) and its row of panels in the plot.

One event file per wave, written locally and uploaded whole: it works the same on a local
directory and on S3 (no appends), a wave redone after a resume rewrites its own file, and
TensorBoard reads a directory's files in name order, which is step order here.

`progress_bar` is the command line's progress bar (on stderr, only when it is a terminal).
"""

from __future__ import annotations

import base64
import io
import math
import re
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from ratchet.scratch import scratch_dir

if TYPE_CHECKING:   # the command line's progress bar should not import the store clients
    from ratchet.store import ArtifactStore, Ref

Progress = Callable[[int, int], None]
"""progress(done, total): `done` of `total` items finished so far (called as they finish, last with done == total)."""

GROUPS: tuple[tuple[str, str], ...] = (
    ("outcome", r"reward|pass_rate|pass_at"),
    ("policy", r"kl|entropy|clip|grad_norm|loss|ratio|^is_|^lr$"),
    ("speed", r"per_s|_ms$|_s$|wall"),
    ("data", r"env_error|stale|group|sample|steps|skipped|len|tokens"),
)
"""(group, pattern on the signal's name), first match wins; anything else is "other"."""


def group_of(name: str) -> str:
    return next((g for g, pattern in GROUPS if re.search(pattern, name)), "other")


def scalars(stats: dict, prefix: str = "") -> dict[str, float]:
    """The numeric values of a stats dict (nested dicts flattened as `a.b`), without `step` and booleans."""
    out: dict[str, float] = {}
    for key, value in stats.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, f"{name}."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and name != "step":
            out[name] = float(value)
    return out


def signals(history: list[dict]) -> list[str]:
    """Every signal of a run's history, by group (in GROUPS order) then by first appearance."""
    seen: dict[str, None] = {}
    for wave in history:
        seen.update(dict.fromkeys(scalars(wave)))
    order = [g for g, _ in GROUPS] + ["other"]
    return sorted(seen, key=lambda name: order.index(group_of(name)))


# --- TensorBoard ---------------------------------------------------------------------------------

def tensorboard_key(run_id: str, step: int) -> str:
    return f"runs/{run_id}/tensorboard/events.out.tfevents.{step:06d}.ratchet"


def write_tensorboard(store: ArtifactStore, run_id: str, step: int, stats: dict,
                      walltime: float | None = None) -> Ref | None:
    """Wave `step`'s scalars as one TensorBoard event file in the store (None: no numeric value)."""
    values = scalars(stats)
    if not values:
        return None
    from torch.utils.tensorboard import SummaryWriter   # needs the tensorboard package

    walltime = time.time() if walltime is None else walltime
    with scratch_dir("tensorboard") as tmp:
        writer = SummaryWriter(log_dir=tmp)
        for name, value in values.items():
            writer.add_scalar(f"{group_of(name)}/{name}", value, global_step=step, walltime=walltime)
        writer.close()
        (path,) = Path(tmp).glob("events.out.tfevents.*")
        return store.put_file(tensorboard_key(run_id, step), path)


# --- the curves and the table ----------------------------------------------------------------------

def curves_png(history: list[dict], title: str = "", columns: int = 4, dpi: int = 80) -> bytes:
    """One figure, a row of panels per signal group (wrapping after `columns`), a panel per signal
    (its own y scale: rewards, norms, milliseconds and rates do not share an axis). PNG bytes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    names = signals(history)
    if not names:
        raise ValueError("curves_png: the history has no numeric signal to plot")
    rows: list[list[str]] = []
    for group in dict.fromkeys(group_of(n) for n in names):
        members = [n for n in names if group_of(n) == group]
        rows += [members[i:i + columns] for i in range(0, len(members), columns)]
    fig = Figure(figsize=(3.4 * columns, 2.3 * len(rows) + 0.8), dpi=dpi)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(rows), columns, squeeze=False)
    points = [(wave["step"], scalars(wave)) for wave in history]
    colour = {g: f"C{i}" for i, (g, _) in enumerate((*GROUPS, ("other", "")))}
    span = (min(s for s, _ in points) - 0.5, max(s for s, _ in points) + 0.5)   # every panel on the same waves
    for r, row in enumerate(rows):
        for c in range(columns):
            ax = axes[r][c]
            if c >= len(row):
                ax.set_axis_off()
                continue
            name = row[c]
            xs, ys = zip(*[(step, v[name]) for step, v in points if name in v])
            ax.plot(xs, ys, marker="o" if len(xs) < 12 else None, markersize=3, linewidth=1.2,
                    color=colour[group_of(name)])
            ax.set_xlim(*span)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_title(name, fontsize=9)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
            if c == 0:
                ax.set_ylabel(group_of(name), fontsize=9, fontweight="bold")
            if r == len(rows) - 1 or c >= len(rows[r + 1]):
                ax.set_xlabel("wave", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    height = 2.3 * len(rows) + 0.8   # fixed margins in inches: a constrained layout costs seconds of CPU
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.45 / height, top=1 - 0.75 / height, wspace=0.3, hspace=0.5)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _cell(value: float | None) -> str:
    if value is None:
        return ""
    if math.isfinite(value) and value == int(value) and abs(value) < 1e9:
        return str(int(value))
    return f"{value:.4g}"


def scalars_table(history: list[dict]) -> str:
    """A markdown table: one row per wave, one column per signal (grouped as in the plot)."""
    names = signals(history)
    lines = ["| wave | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    for wave in history:
        v = scalars(wave)
        lines.append(f"| {wave['step']} | " + " | ".join(_cell(v.get(n)) for n in names) + " |")
    return "\n".join(lines)


@dataclass(frozen=True)
class View:
    """What `render` drew for a run: the table, the PNG (None: plots off) and where they are stored."""

    waves: int
    table: str
    png: bytes | None
    refs: dict[str, Ref]


def render(store: ArtifactStore, run_id: str, history: list[dict], plots: bool = True) -> View:
    """runs/<run_id>/plots/scalars.md (the table) and, with `plots`, runs/<run_id>/plots/curves.png."""
    table = scalars_table(history)
    refs = {"table": store.put_bytes(f"runs/{run_id}/plots/scalars.md", table.encode())}
    png = None
    if plots and signals(history):
        png = curves_png(history, f"run {run_id}: {len(history)} waves")
        refs["curves"] = store.put_bytes(f"runs/{run_id}/plots/curves.png", png)
    return View(len(history), table, png, refs)


def report_markdown(run_id: str, view: View) -> str:
    """The view as one markdown document: heading, the PNG inlined as a data: URI, the table.
    (Prefect's UI renders a markdown image with any src, data: URIs included; a local store's
    files are not reachable from a browser, and S3's presigned URLs expire.)"""
    parts = [f"# Run {run_id}: {view.waves} wave(s)", ""]
    if view.png is not None:
        parts += [f"![curves of run {run_id}](data:image/png;base64,{base64.b64encode(view.png).decode()})", ""]
    parts += [f"Stored: {', '.join(r.uri for r in view.refs.values())}", "", view.table]
    return "\n".join(parts)


# --- the command line's progress bar ----------------------------------------------------------------

@contextmanager
def progress_bar(label: str, stream=None) -> Iterator[Progress | None]:
    """A `Progress` callback drawing a bar on `stream` (stderr), or None when it is not a terminal
    (so logs, pipes and tests get no bar)."""
    stream = sys.stderr if stream is None else stream
    if not (hasattr(stream, "isatty") and stream.isatty()):
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn

    with Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
             console=Console(file=stream), transient=True) as bar:
        task = bar.add_task(label, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)
