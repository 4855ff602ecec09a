"""The promote task through `.fn()`: the incumbent pointer moves only for a winner beyond noise."""

from __future__ import annotations

from prefect.logging import disable_run_logger

from ratchet.config import EvalConfig, NightlyConfig, StoreConfig
from ratchet.store import open_store
from ratchet.train.session import PolicyRef
from tasks.evaluate import INCUMBENT, promote


def _results(solved: int, n: int = 300) -> dict:
    return {"results": {f"t{i}": i < solved for i in range(n)}}


def test_promote_moves_the_incumbent_only_for_a_winner_beyond_noise(tmp_path):
    cfg = NightlyConfig(store=StoreConfig(uri=str(tmp_path)), eval=EvalConfig(min_gain=0.0))
    store = open_store(cfg.store)
    ckpt = store.put_json("runs/r/checkpoints/000003/MANIFEST.json", {"files": {}})
    policy = PolicyRef(run_id="r", version=3, checkpoint=ckpt, checkpoint_version=3)
    with disable_run_logger():
        tie = promote.fn(policy, _results(61), _results(60), cfg)      # one task more out of 300: noise
        assert tie["promoted"] is False and tie["checkpoint"] is None and tie["ci"][0] <= 0
        assert store.get_pointer(INCUMBENT) is None
        won = promote.fn(policy, _results(120), _results(60), cfg)     # +20 points, the 60 a subset
    assert won["promoted"] and won["checkpoint"] == ckpt.uri and won["ci"][0] > 0.1 and won["p_value"] < 1e-10
    assert store.get_pointer(INCUMBENT).uri == ckpt.uri


def test_promote_does_not_overwrite_an_incumbent_it_was_not_judged_against(tmp_path):
    """Two runs judged against the same incumbent: the first promotes; the second, better than the
    old incumbent but never compared with the new one, leaves the pointer where it is."""
    cfg = NightlyConfig(store=StoreConfig(uri=str(tmp_path)), eval=EvalConfig(min_gain=0.0))
    store = open_store(cfg.store)
    old, a, b = (store.put_json(f"runs/{r}/checkpoints/000003/MANIFEST.json", {"files": {}}) for r in ("o", "a", "b"))
    store.set_pointer(INCUMBENT, old)
    judged = {**_results(60), "checkpoint": old.uri}
    with disable_run_logger():
        assert promote.fn(PolicyRef(run_id="a", version=3, checkpoint=a, checkpoint_version=3),
                          _results(180), judged, cfg)["promoted"]
        late = promote.fn(PolicyRef(run_id="b", version=3, checkpoint=b, checkpoint_version=3),
                          _results(120), judged, cfg)
        assert late["promoted"] is False and late["checkpoint"] is None
        assert f"moved to {a.uri} while this run was judged against {old.uri}" in late["reason"]
        again = promote.fn(PolicyRef(run_id="a", version=3, checkpoint=a, checkpoint_version=3),   # a resumed run
                           _results(180), judged, cfg)
    assert again["promoted"] and store.get_pointer(INCUMBENT).uri == a.uri


def test_a_run_resumed_after_it_promoted_is_judged_against_what_it_beat(tmp_path, monkeypatch):
    """promote moves the pointer before the summary is written: an attempt that dies in between is
    resumed with the pointer naming its own checkpoint. The incumbent it was judged against is kept
    for the run, so the resumed attempt does not judge the candidate against itself ("+0.0: keep")."""
    import tasks.evaluate as evaluation
    from ratchet.model import save_policy
    from ratchet.train.checkpoint import save_checkpoint
    from tasks.evaluate import evaluate_incumbent
    from tests.train import tiny

    cfg = NightlyConfig(store=StoreConfig(uri=str(tmp_path)), model=tiny.TINY, eval=EvalConfig(min_gain=0.0))
    store = open_store(cfg.store)
    model, tok = tiny.model(), tiny.tokenizer()
    old, mine = (save_checkpoint(store, r, 3, lambda d: save_policy(model, tok, d)) for r in ("o", "r"))
    store.set_pointer(INCUMBENT, old)
    judged = []

    class _Result:
        def summary(self, confidence):
            return _results(60)

    monkeypatch.setattr(evaluation, "_eval", lambda engine, heldout, cfg: judged.append(1) or _Result())
    policy = PolicyRef(run_id="r", version=3, checkpoint=mine, checkpoint_version=3)
    with disable_run_logger():
        first = evaluate_incumbent.fn(policy, [], cfg)
        assert first["checkpoint"] == old.uri and promote.fn(policy, _results(120), first, cfg)["promoted"]
        resumed = evaluate_incumbent.fn(policy, [], cfg)                   # the pointer now names `mine`
        assert resumed == first and len(judged) == 1
        assert promote.fn(policy, _results(120), resumed, cfg)["promoted"]
        other = PolicyRef(run_id="s", version=3, checkpoint=old, checkpoint_version=3)
        assert evaluate_incumbent.fn(other, [], cfg)["checkpoint"] == mine.uri and len(judged) == 2   # another run


def test_a_run_resumed_under_another_evaluation_protocol_stops_naming_what_changed(tmp_path, monkeypatch):
    """Kept evaluations are reused on resume. One made with eval.samples 1 beside an incumbent
    evaluated now with 4 failed at promotion, after all the training (and a changed temperature or
    turn count compared two protocols silently): the resumed run's base evaluation refuses instead."""
    import pytest

    from tasks.evaluate import evaluate, protocol

    cfg = NightlyConfig(store=StoreConfig(uri=str(tmp_path)))
    store = open_store(cfg.store)
    kept = {"version": 0, "pass_rate": 0.5, "protocol": protocol(cfg)}
    store.put_json("runs/r/eval/000000.json", kept)
    base = PolicyRef(run_id="r", version=0, checkpoint=None, checkpoint_version=0)
    assert evaluate.fn(base, [], cfg) == kept                                   # the same settings: reused
    other = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"samples": 4})})
    with pytest.raises(ValueError, match=r"^run r: policy v0 was evaluated with samples 1, temperature None, seed None; "
                                         r"this attempt has samples 4, temperature 1.0, seed 0: resume with the run's own settings"):
        evaluate.fn(base, [], other)
    longer = cfg.model_copy(update={"verify": cfg.verify.model_copy(update={"timeout_s": 60.0})})   # found by review:
    with pytest.raises(ValueError, match=r"verify_timeout_s 5.0; this attempt has verify_timeout_s 60.0"):  # a "gain"
        evaluate.fn(base, [], longer)
    # found by review: a run resumed on other held-out tasks (a family's code fixed meanwhile: new tasks under the
    # same ids) or another confidence level reused its base record, pairing results on other tasks at promotion
    import tasks.evaluate as evaluation

    class Spec:
        def __init__(self, task_id, text):
            self.task_id, self.text = task_id, text

        def model_dump_json(self):
            return self.text

    was = [Spec("t1", "x + 1"), Spec("t2", "x * 2")]
    store.put_json("runs/r/eval/000000.json", {**kept, "task_digests": evaluation.task_digests(was)})
    for now in ([Spec("t1", "x + 1")], [Spec("t1", "x + 1"), Spec("t2", "x * 2"), Spec("t3", "x")]):  # a verdict flipped
        monkeypatch.setattr(evaluation, "_tasks", lambda heldout, cfg, now=now: now)
        assert evaluate.fn(base, [], cfg)["pass_rate"] == 0.5
    monkeypatch.setattr(evaluation, "_tasks", lambda heldout, cfg: [Spec("t1", "x + 1"), Spec("t2", "x * 3")])
    with pytest.raises(ValueError, match=r"^run r: 1 held-out task\(s\) \(e.g. 't2'\) read differently from when policy v0 "):
        evaluate.fn(base, [], cfg)
    monkeypatch.undo()
    wider = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"confidence": 0.9})})
    with pytest.raises(ValueError, match=r"evaluated with confidence 0.95; this attempt has confidence 0.9"):
        evaluate.fn(base, [], wider)
    older = {**kept, "protocol": {k: v for k, v in kept["protocol"].items()
                                  if not k.startswith(("verify_", "feedback", "confidence"))}}
    store.put_json("runs/r/eval/000000.json", older)      # kept before the protocol named the sandbox's limits
    assert evaluate.fn(base, [], cfg) == older


def test_a_greedy_evaluation_is_reused_under_another_temperature_or_seed_and_a_sampled_one_is_not(tmp_path):
    """eval.samples 1 is greedy: neither eval.temperature nor train.seed changes its figures, so a
    resumed run that changed them reuses its kept record (one kept when the protocol still named
    them included); with samples 4 both change the figures, and the resumed run refuses."""
    import pytest

    from tasks.evaluate import evaluate, protocol

    def cfg_with(samples, temperature, seed):
        return NightlyConfig(store=StoreConfig(uri=str(tmp_path)), eval={"samples": samples, "temperature": temperature},
                             train={"seed": seed})

    store = open_store(StoreConfig(uri=str(tmp_path)))
    base = PolicyRef(run_id="r", version=0, checkpoint=None, checkpoint_version=0)
    before_the_rule = {**protocol(cfg_with(1, 1.0, 0)), "temperature": 1.0, "seed": 0}
    store.put_json("runs/r/eval/000000.json", {"version": 0, "pass_rate": 0.5, "protocol": before_the_rule})
    assert protocol(cfg_with(1, 0.7, 3)) == protocol(cfg_with(1, 1.0, 0))
    assert evaluate.fn(base, [], cfg_with(1, 0.7, 3))["pass_rate"] == 0.5          # reused, not evaluated again
    store.put_json("runs/r/eval/000000.json", {"version": 0, "pass_rate": 0.5, "protocol": protocol(cfg_with(4, 1.0, 0))})
    assert evaluate.fn(base, [], cfg_with(4, 1.0, 0))["pass_rate"] == 0.5
    with pytest.raises(ValueError, match=r"evaluated with temperature 1.0; this attempt has temperature 0.7"):
        evaluate.fn(base, [], cfg_with(4, 0.7, 0))
    with pytest.raises(ValueError, match=r"evaluated with seed 0; this attempt has seed 3"):
        evaluate.fn(base, [], cfg_with(4, 1.0, 3))


def test_a_resumed_run_sets_aside_the_evaluations_of_versions_it_trains_again(tmp_path):
    """Resumed from its checkpoint of v3, a run trains v4.. again (async or GPU: other weights):
    its kept evaluations of v6 move to eval/superseded/ (nothing lost), so `evaluate` runs again;
    v0 and v3, and the incumbent's record, stay."""
    from tasks.evaluate import set_aside_evaluations

    store = open_store(StoreConfig(uri=str(tmp_path)))
    for name in ("000000.json", "000000.parquet", "000003.json", "000006.json", "000006.parquet", "incumbent.json"):
        store.put_json(f"runs/r/eval/{name}", {"name": name})
    moved = set_aside_evaluations(store, "r", 3)
    assert sorted(k.rsplit("/", 1)[-1] for k in moved) == ["000006.json", "000006.parquet"]
    assert sorted(store.list("runs/r/eval/")) == sorted(
        [f"runs/r/eval/{n}" for n in ("000000.json", "000000.parquet", "000003.json", "incumbent.json")]
        + ["runs/r/eval/superseded/000006-0.json", "runs/r/eval/superseded/000006-0.parquet"])
    assert store.get_json("runs/r/eval/superseded/000006-0.json") == {"name": "000006.json"}
    store.put_json("runs/r/eval/000006.json", {"again": True})           # a second crash after v6
    set_aside_evaluations(store, "r", 3)
    assert store.get_json("runs/r/eval/superseded/000006-1.json") == {"again": True}
    assert set_aside_evaluations(store, "r", 6) == []


def test_a_candidate_whose_env_errors_hide_its_losses_is_not_promoted(tmp_path):
    """Found by review: a task with an env_error on either side left the pairing silently; 20 env_errors
    exactly where the incumbent passed, and 20 wins elsewhere, promoted at +100 points over 20 tasks."""
    cfg = NightlyConfig(store=StoreConfig(uri=str(tmp_path)), eval=EvalConfig(min_gain=0.0))
    store = open_store(cfg.store)
    ckpt = store.put_json("runs/r/checkpoints/000003/MANIFEST.json", {"files": {}})
    policy = PolicyRef(run_id="r", version=3, checkpoint=ckpt, checkpoint_version=3)
    incumbent = {"results": {f"t{i}": i < 20 for i in range(40)}}
    candidate = {"results": {f"t{i}": None if i < 20 else True for i in range(40)}}
    with disable_run_logger():
        d = promote.fn(policy, candidate, incumbent, cfg)
    assert d["promoted"] is False and "20 of 40 held-out tasks could not be paired" in d["reason"], d["reason"]
    assert store.get_pointer(INCUMBENT) is None


def test_two_runs_promoting_at_once_check_and_move_the_pointer_one_after_the_other(tmp_path, monkeypatch):
    """Found by review: promote read the pointer, checked it and moved it as separate steps, so two runs
    judged against one incumbent could both pass the check and the last (here the worse) would win.
    Run a holds its move for a while; run b, starting meanwhile, now waits and then sees a's pointer."""
    import logging
    import threading
    import time

    from ratchet.store.local import LocalStore

    cfg = NightlyConfig(store=StoreConfig(uri=str(tmp_path)), eval=EvalConfig(min_gain=0.0))
    store = open_store(cfg.store)
    old, a, b = (store.put_json(f"runs/{r}/checkpoints/000003/MANIFEST.json", {"files": {}}) for r in ("o", "a", "b"))
    store.set_pointer(INCUMBENT, old)
    judged = {**_results(60), "checkpoint": old.uri}
    slow_move = threading.Event()
    set_pointer = LocalStore.set_pointer

    def held(self, key, ref):                       # a's move takes its time: b starts in between
        if ref.uri == a.uri:
            slow_move.set()
            time.sleep(1.5)
        return set_pointer(self, key, ref)

    monkeypatch.setattr(LocalStore, "set_pointer", held)
    monkeypatch.setattr("tasks.evaluate.get_run_logger", lambda: logging.getLogger("promote"))   # two threads, no run
    out = {}

    def run(name, ckpt, solved):
        out[name] = promote.fn(PolicyRef(run_id=name, version=3, checkpoint=ckpt, checkpoint_version=3),
                               _results(solved), judged, cfg)

    first = threading.Thread(target=run, args=("a", a, 180))
    first.start()
    assert slow_move.wait(30)
    second = threading.Thread(target=run, args=("b", b, 120))
    second.start()
    first.join(60), second.join(60)
    assert out["a"]["promoted"] and not out["b"]["promoted"], out
    assert f"moved to {a.uri}" in out["b"]["reason"] and store.get_pointer(INCUMBENT).uri == a.uri
