"""A run's summary across attempts (ratchet/summary.py): what each attempt that ends leaves in it."""

from __future__ import annotations

from ratchet.store import open_store
from ratchet.summary import begin_attempt, end_attempt, record_wave, write_summary


def test_an_attempt_that_ends_without_a_summary_of_its_own_refreshes_the_earlier_ones(tmp_path):
    """Found by review: a run stopped by a monitor at wave 1, resumed, went on to wave 3 and failed there
    (a gate): its summary.json still listed one attempt, as if nothing had run since. Now every attempt
    that ends brings the attempts up to date, and the fields the earlier attempt wrote (its health stop,
    its history) say whose they are."""
    store = open_store(str(tmp_path))
    first = begin_attempt(store, "r")
    for step in (0, 1):
        record_wave(store, "r", step, {"reward_mean": 0.1})
    write_summary(store, "r", {"steps": 5, "promotion": "not evaluated: the run stopped at wave 1"}, 2)
    end_attempt(store, "r", first, "failed: HealthCheckFailed: entropy collapse at wave 1")
    assert "fields_from_attempt" not in store.get_json("runs/r/summary.json")          # its own summary: as written

    second = begin_attempt(store, "r")
    for step in (2, 3):
        record_wave(store, "r", step, {"reward_mean": 0.2})
    end_attempt(store, "r", second, "failed: GateError: wave 3 failed its gate")
    summary = store.get_json("runs/r/summary.json")
    assert [a["outcome"] for a in summary["attempts"]] == ["failed: HealthCheckFailed: entropy collapse at wave 1",
                                                           "failed: GateError: wave 3 failed its gate"]
    assert [h["step"] for h in summary["history"]] == [0, 1]        # the first attempt's (later waves: stats.json)
    assert summary["fields_from_attempt"] == 0 and summary["promotion"].startswith("not evaluated: the run stopped at wave 1")
    assert summary["wall_s"] == round(sum(a["wall_s"] for a in summary["attempts"]), 1)
