"""Traces you can replay: a wave's rows read back, and re-verified to see whether the reward reproduces.

    wave = load_wave(store, "r1", step=3, task_id="python_functions/12")   # scored (or trained) rows
    print(render(wave))                       # prompt, completion, reward, metrics, feedback, advantage
    report = replay(store, "r1", step=3, task_id="python_functions/12")
    print(render_replay(report)); report.reproduced

From the shell: `ratchet trace show RUN --step N [--task ID]`, `ratchet trace replay RUN --step N
--task ID` (ratchet/trace_cli.py).

A replay runs the stored completions again through `ratchet.verify.verify_many` against the
same task spec, with the VerifyConfig and RewardConfig the wave was scored with, and scores
them with `ratchet.reward.frame.row_reward` and `final_reward`, as the score_wave task did (a
multi-turn episode: its final answer, then the agent's shaping over its stored turns; then the
overlong penalty of the stored answer's length, when the reward config has one). Where the stored
reward and the replayed one differ (beyond `tolerance`), or one of them is an env_error and
the other not, the sample is "not reproduced": a flaky task, or the environment drifted (a
runtime, the sandbox, the spec). What the wave was scored with is recorded next to it when it
is scored (`scoring_record`, written by tasks/score.py):

    runs/<run_id>/waves/<step>/scoring.json   {"train": [Ref of each task snapshot], "verify": {...}, "reward": {...},
                                               "agent": {...}, "max_new_tokens": 48}

A snapshot that no longer matches its recorded sha256 is still read (the replay then says so
in its notes: the spec itself drifted). A wave scored before this record existed can be
shown but not replayed. Pure: no Prefect; every failure a person can act on is a TraceError
of one line.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

import polars as pl

from envs.spec import TaskSpec
from ratchet.config import AgentConfig, NightlyConfig, RewardConfig, VerifyConfig
from ratchet.store import ArtifactStore, IntegrityError, Ref, store_for

TABLES = ("trained.parquet", "scored.parquet", "trajectories.parquet")
"""A wave's tables, the most complete first: the one found first is read."""
SCORING = "scoring.json"


def write_wave_table(store: ArtifactStore, key: str, frame: pl.DataFrame) -> Ref:
    """Write the wave table at `key` (one of TABLES), first deleting the tables an earlier attempt
    made from it (a wave redone after a resume or a retry), so that `load_wave` never reads the old
    attempt's rows beside the new one's (a redo that stopped at the gate showed the old, clean
    trained rows)."""
    prefix, _, name = key.rpartition("/")
    for later in TABLES[:TABLES.index(name)]:
        store.delete(f"{prefix}/{later}")
    return store.write_table(key, frame)


class TraceError(ValueError):
    """A run, wave, task or record that is not there; the message names it and where."""


def wave_prefix(run_id: str, step: int) -> str:
    return f"runs/{run_id}/waves/{step:06d}"


def scoring_record(train: list[Ref], cfg: NightlyConfig) -> dict:
    """What a wave is scored with, for a later replay: the task snapshots, the configs and the length
    cap its answers were sampled under."""
    return {"train": [r.model_dump(mode="json") for r in train],
            "verify": cfg.verify.model_dump(mode="json"), "reward": cfg.reward.model_dump(mode="json"),
            "agent": cfg.agent.model_dump(mode="json"), "max_new_tokens": cfg.rollout.max_new_tokens}


# --- load -----------------------------------------------------------------------------------

@dataclass
class Wave:
    run_id: str
    step: int
    table: str                     # which of TABLES the rows come from
    rows: pl.DataFrame             # in stored order; one task's rows when a task was asked for
    task_id: str | None = None


def steps(store: ArtifactStore, run_id: str) -> list[int]:
    """The waves of a run that have a table in the store, in order."""
    found = set()
    for key in store.list(f"runs/{run_id}/waves/"):
        parts = key.split("/")
        if len(parts) == 5 and parts[4] in TABLES and parts[3].isdigit():
            found.add(int(parts[3]))
    return sorted(found)


def _ranges(xs: list[int]) -> str:
    out, start = [], None
    for i, x in enumerate(xs):
        start = x if start is None else start
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)


def load_wave(store: ArtifactStore, run_id: str, step: int, task_id: str | None = None) -> Wave:
    """The rows of wave `step` of `run_id` (of one task if `task_id`), from its most complete table."""
    if not store.list(f"runs/{run_id}/"):
        raise TraceError(f"no run {run_id!r} in the store")
    prefix = wave_prefix(run_id, step)
    table = next((t for t in TABLES if store.exists(f"{prefix}/{t}")), None)
    if table is None:
        have = steps(store, run_id)
        raise TraceError(f"run {run_id!r} has no wave {step}; "
                         + (f"its waves: {_ranges(have)}" if have else "it has no wave yet"))
    rows = store.read_table(f"{prefix}/{table}")
    if task_id is not None:
        picked = rows.filter(pl.col("task_id") == task_id)
        if picked.height == 0:
            known = rows["task_id"].unique(maintain_order=True).to_list()
            more = f" (+{len(known) - 8} more)" if len(known) > 8 else ""
            raise TraceError(f"task {task_id!r} is not in wave {step} of run {run_id!r}; "
                             f"its tasks: {', '.join(known[:8])}{more}")
        rows = picked
    return Wave(run_id, step, table, rows, task_id)


# --- render ---------------------------------------------------------------------------------

def _indent(text: str | None, pad: str = "  ") -> str:
    if text is None or text == "":
        return f"{pad}(empty)"
    return "\n".join(pad + line for line in text.rstrip("\n").split("\n"))


def _num(x: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def _metrics_line(m: dict | None) -> str:
    if not m:
        return "metrics: none (not verified)"
    flags = ", ".join(m.get("security_flags") or []) or "-"
    return (f"metrics: tests {m['tests_passed']}/{m['tests_total']} (pass rate {m['test_pass_rate']:.2f}), "
            f"{m['execution_time_ms']:.1f} ms, {m['peak_memory_mb']:.1f} MB, "
            f"syntax {'ok' if m['syntax_ok'] else 'bad'}, format {'ok' if m['format_ok'] else 'bad'}, "
            f"timed out {'yes' if m['timed_out'] else 'no'}, flags {flags}")


def _feedback_lines(fb: dict | None, recorded: bool = True) -> list[str]:
    if not recorded:
        return ["feedback: not recorded (the wave was scored before feedback was kept)"]
    if fb is None:
        return ["feedback: none (not run: an empty completion, a task error, or not verified yet)"]
    how = f"exit {fb['exit_code']}" if fb["exit_code"] is not None else "no exit code"
    if fb["killed_by"]:
        how += f", killed by the {fb['killed_by']} limit"
    if fb["timed_out"]:
        how += ", timed out"
    lines = [f"feedback: {how}"]
    failed = fb.get("failed_tests") or []
    lines.append(f"failed tests ({len(failed)}):" if failed else "failed tests: none")
    lines += [f"  {t['name']}: {t['detail']}" for t in failed]
    for name in ("stdout", "stderr"):
        text = fb.get(f"{name}_tail")
        lines += [f"{name} (tail):", _indent(text)] if text else [f"{name}: (empty)"]
    return lines


def render_row(row: dict, with_prompt: bool = True, trained: bool = False) -> str:
    """One trajectory row, readably (`trained`: the row comes from trained.parquet)."""
    head = (f"--- task {row['task_id']} | group {row['group_id']} | sample {row['sample_idx']} "
            f"| policy v{row['policy_version']} ---")
    verdict = f"reward {_num(row.get('reward'))}"
    if row.get("advantage") is not None:
        verdict += f" | advantage {row['advantage']:+.3f}"
    elif row.get("token_advantages") is not None:
        verdict += f" | token advantages mean {sum(row['token_advantages']) / max(len(row['token_advantages']), 1):+.3f}"
    elif trained:
        verdict += " | not trained on (its group was excluded or had equal rewards)"
    if row.get("env_error"):
        verdict += f" | env_error: {row.get('env_error_kind')} (excluded, never scored)"
    lines = [head, verdict, _metrics_line(row.get("metrics"))]
    if with_prompt:
        lines += ["prompt:", _indent(row["prompt"])]
    turns = row.get("turns") or []
    if len(turns) > 1:   # a multi-turn episode: every answer, its verdict and the observation it got
        for t in turns:
            verdict = "env_error" if t.get("env_error") else "passed" if t.get("passed") else "failed"
            lines += [f"turn {t['turn'] + 1} ({verdict}, reward {_num(t.get('reward'))}):", _indent(t["action"])]
            if t.get("observation") is not None:
                lines += ["observation:", _indent(t["observation"])]
    else:
        lines += ["completion:", _indent(row["completion"])]
    lines += _feedback_lines(row.get("feedback"), recorded="feedback" in row)
    return "\n".join(lines)


def render(wave: Wave) -> str:
    """A wave (or one task of it), readably: per task its prompt once, then every sample."""
    rows = wave.rows.to_dicts()
    what = f"task {wave.task_id}" if wave.task_id else f"{wave.rows['task_id'].n_unique()} tasks"
    out = [f"run {wave.run_id}, wave {wave.step} ({wave.table}): {what}, {len(rows)} samples"]
    if wave.table == "trajectories.parquet":
        out.append("(not scored yet: no metrics, reward or feedback)")
    seen: set[str] = set()
    for row in rows:
        first = row["task_id"] not in seen
        seen.add(row["task_id"])
        out += ["", render_row(row, with_prompt=first, trained=wave.table == "trained.parquet")]
    return "\n".join(out)


# --- replay ---------------------------------------------------------------------------------

@dataclass
class Sample:
    """One sample's stored outcome against its replay."""

    group_id: str
    sample_idx: int
    stored_reward: float | None
    replayed_reward: float | None
    stored_env_error: str | None          # the env_error kind, None when it was verified
    replayed_env_error: str | None
    stored_pass_rate: float | None
    replayed_pass_rate: float | None
    reproduced: bool
    feedback: dict | None = None          # the replay's


@dataclass
class Replay:
    run_id: str
    step: int
    task_id: str
    samples: list[Sample]
    notes: list[str] = field(default_factory=list)   # what changed since the wave was scored

    @property
    def reproduced(self) -> bool:
        return all(s.reproduced for s in self.samples)

    def to_dict(self) -> dict:
        return {"run_id": self.run_id, "step": self.step, "task_id": self.task_id, "reproduced": self.reproduced,
                "notes": self.notes, "samples": [asdict(s) for s in self.samples]}


def load_scoring(store: ArtifactStore, run_id: str, step: int) -> tuple[list[Ref], VerifyConfig, RewardConfig,
                                                                       AgentConfig, int | None]:
    """The task snapshots, configs and length cap wave `step` was scored with (its scoring.json; a
    record written before the agent's shaping was kept gets AgentConfig's defaults: no shaping; one
    written before the cap was kept, None: its reward config has no overlong penalty)."""
    key = f"{wave_prefix(run_id, step)}/{SCORING}"
    if not store.exists(key):
        raise TraceError(f"wave {step} of run {run_id!r} has no scoring record ({key}): it was scored before "
                         "replays were recorded, or not scored yet; it can be shown, not replayed")
    record = store.get_json(key)
    try:
        refs = [Ref.model_validate(r) for r in record["train"]]
        verify, reward = VerifyConfig.model_validate(record["verify"]), RewardConfig.model_validate(record["reward"])
        agent = AgentConfig.model_validate(record.get("agent", {}))
    except (KeyError, TypeError, ValueError) as e:
        raise TraceError(f"unreadable scoring record {key}: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    cap = record.get("max_new_tokens")
    if reward.overlong_buffer and cap is None:
        raise TraceError(f"unreadable scoring record {key}: reward.overlong_buffer {reward.overlong_buffer} "
                         "without the max_new_tokens its penalty is measured against")
    return refs, verify, reward, agent, cap


def find_spec(refs: list[Ref], task_id: str) -> tuple[TaskSpec, list[str]]:
    """The spec of `task_id` in the recorded snapshots, and notes on any snapshot that changed since."""
    notes = []
    for ref in refs:
        st = store_for(ref)
        try:
            table = st.read_table(ref)
        except IntegrityError as e:
            notes.append(f"the task snapshot changed since the wave was scored: {e}")
            table = st.read_table(ref.key, verify=False)
        except FileNotFoundError:
            notes.append(f"the task snapshot {ref.uri} is gone")
            continue
        hit = table.filter(pl.col("task_id") == task_id)
        if hit.height:
            return TaskSpec.model_validate_json(hit["spec_json"][0]), notes
    raise TraceError(f"task {task_id!r} is in none of the wave's task snapshots "
                     f"({', '.join(r.uri for r in refs)})" + (f"; {'; '.join(notes)}" if notes else ""))


def _same(a: float | None, b: float | None, tolerance: float) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return math.isclose(a, b, rel_tol=0.0, abs_tol=tolerance)


def replay(store: ArtifactStore, run_id: str, step: int, task_id: str, spec: TaskSpec | None = None,
           tolerance: float = 1e-9) -> Replay:
    """Verify and score again every stored sample of `task_id` in wave `step`, with the wave's own
    spec (or `spec`, to try a changed one), VerifyConfig and RewardConfig; compare with what is stored."""
    from ratchet.reward.frame import final_reward, row_reward   # late: the judge and its sandbox load only to replay
    from ratchet.verify import verify_many

    wave = load_wave(store, run_id, step, task_id)
    if wave.table == "trajectories.parquet":
        raise TraceError(f"wave {step} of run {run_id!r} is not scored yet: nothing to reproduce")
    refs, verify, reward, agent, cap = load_scoring(store, run_id, step)
    notes: list[str] = []
    if spec is None:
        spec, notes = find_spec(refs, task_id)
    else:
        notes.append("replayed against a spec given by the caller, not the recorded snapshot")
    rows = wave.rows.to_dicts()
    results = verify_many([(spec, r["completion"]) for r in rows], verify.sandbox_limits(), verify.concurrency,
                          verify.env_error_retries, feedback_bytes=verify.feedback_bytes)
    samples = []
    for row, res in zip(rows, results):
        again = row_reward({"completion": row["completion"], "metrics": res.metrics or None,
                            "env_error": res.env_error}, spec.reward_logic, reward)
        # a multi-turn episode: its final answer replayed, the shaping on its stored turns; the stored length
        again = final_reward(again, row, cap, reward, agent.turn_penalty, agent.repeat_reward)
        stored_err = row["env_error_kind"] or ("env_error" if row["env_error"] else None)
        replayed_err = (res.env_error_kind or "env_error") if res.env_error else None
        samples.append(Sample(
            row["group_id"], row["sample_idx"], row["reward"], again, stored_err, replayed_err,
            (row["metrics"] or {}).get("test_pass_rate"), (res.metrics or {}).get("test_pass_rate"),
            reproduced=(stored_err is None) == (replayed_err is None) and _same(row["reward"], again, tolerance),
            feedback=res.feedback))
    return Replay(run_id, step, task_id, samples, notes)


def render_replay(report: Replay) -> str:
    """Stored against replayed, one line per sample, then the verdict."""
    out = [f"replay of run {report.run_id}, wave {report.step}, task {report.task_id}: {len(report.samples)} samples"]
    out += [f"note: {n}" for n in report.notes]
    for s in report.samples:
        stored = f"env_error ({s.stored_env_error})" if s.stored_env_error else f"reward {_num(s.stored_reward)}"
        again = f"env_error ({s.replayed_env_error})" if s.replayed_env_error else f"reward {_num(s.replayed_reward)}"
        rates = f"pass rate {_num(s.stored_pass_rate, '{:.2f}')} -> {_num(s.replayed_pass_rate, '{:.2f}')}"
        out.append(f"sample {s.sample_idx} (group {s.group_id}): stored {stored}, replayed {again}, {rates}: "
                   + ("reproduced" if s.reproduced else "NOT reproduced"))
        if not s.reproduced:
            out += ["  " + line for line in _feedback_lines(s.feedback)]
    n = sum(s.reproduced for s in report.samples)
    out.append(f"{'reproduced' if report.reproduced else 'not reproduced'}: {n}/{len(report.samples)} samples "
               "give the stored reward")
    return "\n".join(out)


def replay_json(report: Replay) -> str:
    return json.dumps(report.to_dict())
