"""Watching a run: TensorBoard event files read back by TensorBoard itself, the curves PNG, the
table, the artifacts on a flow run's page, the speed figures of a wave, and the progress callbacks."""

from __future__ import annotations

import base64
import io
import re

import polars as pl
import pytest

from envs.families.python_functions import Config as PyConfig, generate
from ratchet import stages
from ratchet.audit import audit
from ratchet.config import AuditConfig, NightlyConfig, StoreConfig, WatchConfig
from ratchet.data.schemas import trajectories_frame
from ratchet.store import open_store
from ratchet.verify import verify_many
from ratchet.watch import (curves_png, group_of, progress_bar, render, report_markdown, scalars, scalars_table,
                           tensorboard_key, write_tensorboard)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def waves(n: int = 4) -> list[dict]:
    """Stats dicts as record_wave stores them, with a sparse held-out figure and non-numeric values."""
    out = []
    for step in range(n):
        stats = {"step": step, "reward_mean": 0.1 * step - 0.05, "reward_std": 0.5 / (step + 1), "pass_rate": step / 8,
                 "kl": 0.001 * step, "grad_norm": 2.0 - 0.25 * step, "rollout_tokens_per_s": 4000.0 + 17 * step,
                 "sandbox_p50_ms": 3.5, "sandbox_p95_ms": 9.25 + step, "env_error_rate": 0.0, "staleness": 0,
                 "train_samples": 96 - step, "note": "not a number", "promoted": True, "per_family": {"pf": 0.25 * step}}
        if step % 2 == 1:
            stats["heldout_pass_rate"] = 0.125 * step
        out.append(stats)
    return out


def test_scalars_are_the_numeric_values_and_each_has_a_group():
    v = scalars(waves()[1])
    assert "step" not in v and "note" not in v and "promoted" not in v        # the index, text and booleans
    assert v["per_family.pf"] == 0.25 and v["staleness"] == 0.0 and v["heldout_pass_rate"] == 0.125
    expected = {"reward_mean": "outcome", "pass_rate": "outcome", "heldout_pass_rate": "outcome", "kl": "policy",
                "entropy": "policy", "clip_frac": "policy", "grad_norm": "policy", "is_weight_mean": "policy",
                "rollout_tokens_per_s": "speed", "sandbox_p95_ms": "speed", "env_error_rate": "data",
                "staleness": "data", "train_samples": "data", "per_family.pf": "other"}
    assert {n: group_of(n) for n in expected} == expected


def _read_tensorboard(logdir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_reads_every_wave_back(tmp_path):
    store = open_store(tmp_path / "store")
    history = waves()
    for stats in history:
        write_tensorboard(store, "r1", stats["step"], stats)
    write_tensorboard(store, "r1", 2, history[2])          # a wave redone after a resume rewrites its file
    assert store.list("runs/r1/tensorboard/") == [tensorboard_key("r1", s) for s in range(4)]

    found = _read_tensorboard(tmp_path / "store" / "runs" / "r1" / "tensorboard")
    expected = {}
    for stats in history:
        for name, value in scalars(stats).items():
            expected.setdefault(f"{group_of(name)}/{name}", []).append((stats["step"], value))
    assert set(found) == set(expected) and "outcome/heldout_pass_rate" in found
    for tag, points in expected.items():     # TensorBoard keeps float32
        assert [s for s, _ in found[tag]] == [s for s, _ in points], tag
        assert [v for _, v in found[tag]] == pytest.approx([v for _, v in points], rel=1e-6), tag
    assert found["outcome/heldout_pass_rate"] == [(1, 0.125), (3, 0.375)]


def test_tensorboard_files_on_s3_read_back_the_same(s3_store, tmp_path):
    history = waves(2)
    for stats in history:
        write_tensorboard(s3_store, "r1", stats["step"], stats)
    for key in s3_store.list("runs/r1/tensorboard/"):
        s3_store.get_file(key, tmp_path / "tb" / key.rsplit("/", 1)[1])
    found = _read_tensorboard(tmp_path / "tb")
    assert found["speed/sandbox_p95_ms"] == [(0, 9.25), (1, 10.25)]


def test_table_is_one_row_per_wave_and_one_column_per_signal():
    table = scalars_table(waves(2)).splitlines()
    assert table[0] == ("| wave | reward_mean | reward_std | pass_rate | heldout_pass_rate | kl | grad_norm | "
                        "rollout_tokens_per_s | sandbox_p50_ms | sandbox_p95_ms | env_error_rate | staleness | "
                        "train_samples | per_family.pf |")
    assert table[2] == "| 0 | -0.05 | 0.5 | 0 |  | 0 | 2 | 4000 | 3.5 | 9.25 | 0 | 0 | 96 | 0 |"
    assert table[3] == "| 1 | 0.05 | 0.25 | 0.125 | 0.125 | 0.001 | 1.75 | 4017 | 3.5 | 10.25 | 0 | 0 | 95 | 0.25 |"


def test_curves_are_a_png_in_the_store_and_inline_in_the_report(tmp_path):
    from PIL import Image

    store = open_store(tmp_path / "store")
    view = render(store, "r1", waves(), plots=True)
    png = store.get_bytes("runs/r1/plots/curves.png")
    assert png == view.png and png.startswith(PNG_MAGIC)
    image = Image.open(io.BytesIO(png))
    image.verify()
    assert image.size[0] > 600 and image.size[1] > 400
    assert store.get_bytes("runs/r1/plots/scalars.md").decode() == view.table
    md = report_markdown("r1", view)
    inline = re.search(r"!\[[^\]]*\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", md)
    assert inline and base64.b64decode(inline.group(1)) == png
    assert view.table in md

    no_plot = render(store, "r2", waves(), plots=False)
    assert no_plot.png is None and not store.exists("runs/r2/plots/curves.png")
    assert "data:image" not in report_markdown("r2", no_plot)
    with pytest.raises(ValueError, match="no numeric signal"):
        curves_png([{"step": 0, "note": "x"}])


def test_wave_speed_figures():
    def row(i, ms, completion, env_error=False, tokens=10, version=4):
        return {"run_id": "r", "step": 0, "policy_version": version, "task_id": f"t{i % 3}", "family": "f",
                "difficulty": 1, "group_id": "0:0", "sample_idx": i, "prompt": "p", "completion": completion,
                "prompt_tokens": 3, "completion_tokens": tokens, "completion_ids": [1] * tokens,
                "behavior_logprobs": [0.0] * tokens, "env_error": env_error,
                "metrics": None if env_error else {"execution_time_ms": ms, "test_pass_rate": 1.0 if ms > 5 else 0.0,
                                                   "timed_out": False}}
    rows = [row(0, 2.0, "a"), row(1, 4.0, "b"), row(2, 6.0, "c"), row(3, 8.0, "d"), row(4, 10.0, "e"),
            row(3, 8.0, "d"),                          # the same (task, completion) again: counted once
            row(6, 0.0, ""),                           # an empty completion: not run
            row(7, None, "x", env_error=True, version=3)]
    frame = trajectories_frame(rows)
    stats = stages.sandbox_stats(frame)
    assert stats == {"sandbox_p50_ms": 6.0, "sandbox_p95_ms": pytest.approx(9.6)}     # of 2, 4, 6, 8, 10
    assert stages.rollout_stats(frame, 2.0) == {"rollout_tokens_per_s": 40.0, "rollout_s": 2.0, "sampled_tokens": 80}
    assert stages.staleness(frame, 4) == 1 and stages.staleness(frame.filter(pl.col("policy_version") == 4), 4) == 0


def _specs(n: int):
    return [generate(PyConfig(), 0, i, 1, "train") for i in range(n)]


def test_verify_many_reports_every_item(monkeypatch):
    import ratchet.verify.verifier as verifier

    monkeypatch.setattr(verifier, "PROGRESS_CHUNK", 1)     # 2 runs between reports: several reports
    specs = _specs(3)
    items = [(s, s.reference_solution) for s in specs] + [(specs[0], specs[0].reference_solution), (specs[1], "")]
    items += [(s, "    return None\n") for s in specs]
    calls = []
    with_progress = verify_many(items, progress=lambda done, total: calls.append((done, total)))
    assert calls[0] == (1, 8) and calls[-1] == (8, 8)          # the empty completion is known before any run
    assert [d for d, _ in calls] == sorted(d for d, _ in calls) and len(calls) == 1 + 3   # 6 distinct runs, 2 a chunk
    assert [v.metrics["tests_passed"] for v in with_progress] == [v.metrics["tests_passed"] for v in verify_many(items)]


def test_the_audit_reports_every_candidate_run():
    calls = []
    cfg = AuditConfig(max_mutants=2, max_reference_ms=60_000)
    verdicts = audit(_specs(2), cfg, progress=lambda done, total: calls.append((done, total)))
    assert len(verdicts) == 2
    total = calls[-1][1]
    assert calls[-1] == (total, total) and total >= 2 * cfg.reference_runs
    assert [d for d, _ in calls] == sorted(d for d, _ in calls) and {t for _, t in calls} == {total}


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_on_a_terminal():
    with progress_bar("verify", io.StringIO()) as progress:
        assert progress is None                                     # a pipe, a log file, a test: no bar
    term = _Terminal()
    with progress_bar("verify", term) as progress:
        progress(3, 4)
        progress(4, 4)
    assert "verify" in term.getvalue()
