"""A run's summary across every attempt: what each wave did, once, and how each attempt ended.

    attempt = begin_attempt(store, run_id)             # marks a previous attempt left "running" as interrupted
    record_wave(store, run_id, step, {"reward_mean": ...})
    end_attempt(store, run_id, attempt, "completed")   # or "failed: GateError: ...", "interrupted: SIGTERM"
    summary = write_summary(store, run_id, {"final_pass_rate": ...})

Keys: `runs/<run_id>/waves/<step>/stats.json` (one per wave, rewritten when a resumed run redoes
the wave), `runs/<run_id>/attempts.json` (every invocation of the run id), and
`runs/<run_id>/summary.json`, whose `history` lists every wave once in step order and whose
`wall_s` is the total over attempts (`attempts[i].wall_s` each). Resuming, or rerunning a
finished run, appends an attempt; it never loses the history of the earlier ones.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone

from ratchet.store import ArtifactStore, Ref


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _attempts(store: ArtifactStore, run_id: str) -> list[dict]:
    key = f"runs/{run_id}/attempts.json"
    return store.get_json(key) if store.exists(key) else []


def begin_attempt(store: ArtifactStore, run_id: str) -> int:
    """Append a running attempt; one still marked running (a process that was killed) is interrupted."""
    attempts = _attempts(store, run_id)
    for a in attempts:
        if a["outcome"] == "running":
            a["outcome"] = "interrupted: the process ended without closing the attempt (killed?)"
    attempts.append({"attempt": len(attempts), "started_at": _now(), "ended_at": None, "wall_s": None,
                     "outcome": "running", "_t0": time.time()})
    store.put_json(f"runs/{run_id}/attempts.json", attempts)
    return len(attempts) - 1


def end_attempt(store: ArtifactStore, run_id: str, attempt: int, outcome: str) -> dict:
    """Close an attempt with its outcome (one line) and wall time."""
    attempts = _attempts(store, run_id)
    a = attempts[attempt]
    a.update(ended_at=_now(), wall_s=round(time.time() - a["_t0"], 1), outcome=outcome.splitlines()[0][:500])
    store.put_json(f"runs/{run_id}/attempts.json", attempts)
    key = f"runs/{run_id}/summary.json"
    summary = store.get_json(key) if store.exists(key) else None
    if summary:   # every attempt as it ended (the one that wrote it: a health stop, the last write, included)
        fresh = {**summary, **_attempt_fields(attempts)}
        if not any(s["attempt"] == attempt for s in summary["attempts"]):
            # written by an earlier attempt (its health stop, its promotion; its history): this one ended
            # without a summary of its own, and its waves are in their stats.json, not in the summary
            fresh["fields_from_attempt"] = summary.get("fields_from_attempt", max(s["attempt"] for s in summary["attempts"]))
        store.put_json(key, fresh)
    return a


def record_wave(store: ArtifactStore, run_id: str, step: int, stats: dict) -> Ref:
    return store.put_json(f"runs/{run_id}/waves/{step:06d}/stats.json", {"step": step, **stats})


def history(store: ArtifactStore, run_id: str, steps: int) -> list[dict]:
    """Every recorded wave of the run below `steps`, once, in step order."""
    return [store.get_json(k) for k in sorted(store.list(f"runs/{run_id}/waves/"))
            if k.endswith("/stats.json") and int(k.split("/")[3]) < steps]


def write_summary(store: ArtifactStore, run_id: str, fields: dict, steps: int) -> tuple[Ref, dict]:
    """summary.json: `fields` + the whole history + every attempt + total wall time."""
    summary = {**fields, "history": history(store, run_id, steps), **_attempt_fields(_attempts(store, run_id))}
    return store.put_json(f"runs/{run_id}/summary.json", summary), summary


def _attempt_fields(attempts: list[dict]) -> dict:
    """summary.json's `attempts` (without private keys) and their total `wall_s`."""
    public = [{k: v for k, v in a.items() if not k.startswith("_")} for a in attempts]
    return {"attempts": public, "wall_s": round(sum(a["wall_s"] or 0.0 for a in public), 1)}
