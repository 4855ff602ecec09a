"""A deployment run's settings: the deep merge of a partial override, the store checked before
any work, and the pull step of deploy/prefect.yaml that names RATCHET_HOME when it is missing.
(The merge inside a real deployment run: tests/deploy/test_server.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from ratchet.config import EnvsConfig, NightlyConfig, StoreConfig, deep_merge
from ratchet.preflight import SettingsError

ROOT = Path(__file__).resolve().parents[2]
PULL = yaml.safe_load((ROOT / "deploy" / "prefect.yaml").read_text())["pull"]


def test_deep_merge_keeps_what_the_override_does_not_name():
    deployment = {"cfg": {"steps": 100, "store": {"uri": "s3://ratchet/prod"}, "eval": {"min_gain": 0.01, "n_tasks": 300}}}
    run = {"cfg": {"steps": 10, "eval": {"n_tasks": 12}}}
    assert deep_merge(deployment, run) == {
        "cfg": {"steps": 10, "store": {"uri": "s3://ratchet/prod"}, "eval": {"min_gain": 0.01, "n_tasks": 12}}}
    assert deployment["cfg"]["steps"] == 100 and deployment["cfg"]["eval"]["n_tasks"] == 300   # not modified
    assert run == {"cfg": {"steps": 10, "eval": {"n_tasks": 12}}}


def test_deep_merge_replaces_lists_scalars_and_none():
    base = {"envs": {"families": ["a", "b"], "family_config": {"a": {"n": 1}}}, "model": {"path": "/m"}, "x": {"y": 1}}
    over = {"envs": {"families": ["c"], "family_config": {"a": {"k": 2}}}, "model": {"path": None}, "x": 5}
    assert deep_merge(base, over) == {
        "envs": {"families": ["c"], "family_config": {"a": {"n": 1, "k": 2}}}, "model": {"path": None}, "x": 5}
    assert deep_merge({"a": 1}, {}) == {"a": 1} and deep_merge({}, {"a": {"b": 1}}) == {"a": {"b": 1}}


def test_a_partial_override_validates_to_the_deployment_settings():
    deployment = yaml.safe_load((ROOT / "deploy" / "prefect.yaml").read_text())
    [nightly] = [d for d in deployment["deployments"] if d["name"] == "nightly"]
    cfg = NightlyConfig.model_validate(deep_merge(nightly["parameters"]["cfg"], {"steps": 10}))
    assert cfg.steps == 10 and cfg.store.uri == "s3://ratchet/prod" and cfg.eval.min_gain == 0.01
    shallow = NightlyConfig.model_validate({"steps": 10})        # what Prefect alone would run
    assert shallow.store.uri != cfg.store.uri and shallow.eval.min_gain != cfg.eval.min_gain


@pytest.fixture
def no_s3(monkeypatch):
    for var in ("RATCHET_S3_ENDPOINT", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var, raising=False)


def test_the_flows_name_a_missing_s3_setting_before_any_work(no_s3, tmp_path, monkeypatch):
    """A worker without the S3 settings: one error naming them, from each flow, nothing written."""
    from flows.audit_envs import audit_envs_flow
    from flows.niah import niah
    from flows.nightly import nightly
    from flows.produce_envs import produce_envs_flow

    monkeypatch.chdir(tmp_path)
    store = StoreConfig(uri="s3://ratchet/prod")
    for run in (lambda: nightly.fn(NightlyConfig(store=store)),
                lambda: audit_envs_flow.fn(store=store),
                lambda: produce_envs_flow.fn(EnvsConfig(), store),
                lambda: niah.fn(None, store=store)):
        with pytest.raises(SettingsError) as e:
            run()
        assert e.value.problems == [
            "store.uri 's3://ratchet/prod': set RATCHET_S3_ENDPOINT=host:port (RATCHET_S3_SECURE=0 for plain http)",
            "store.uri 's3://ratchet/prod': credentials unset: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"]
    assert list(tmp_path.iterdir()) == []


def _pull(monkeypatch, home: str | None):
    """Call deploy/prefect.yaml's pull steps as a worker's flow-run process does (Prefect's
    run_step: import the step by name, call it with its inputs; the templating it does first
    needs an API and has nothing to resolve here)."""
    from prefect.utilities.importtools import import_object

    monkeypatch.chdir("/")
    if home is None:
        monkeypatch.delenv("RATCHET_HOME", raising=False)
    else:
        monkeypatch.setenv("RATCHET_HOME", home)
    out = {}
    for step in PULL:
        [(name, inputs)] = step.items()
        out.update(import_object(name)(**inputs))
    return out


def test_pull_step_without_ratchet_home_names_it(monkeypatch):
    with pytest.raises(SettingsError, match="^RATCHET_HOME is not set on this worker: set it to the ratchet checkout"):
        _pull(monkeypatch, None)
    assert os.getcwd() == "/"


def test_pull_step_with_a_wrong_ratchet_home_names_it(monkeypatch, tmp_path):
    with pytest.raises(SettingsError, match=f"^RATCHET_HOME='{tmp_path}' is not a ratchet checkout"):
        _pull(monkeypatch, str(tmp_path))
    assert os.getcwd() == "/"


def test_pull_step_enters_ratchet_home(monkeypatch):
    out = _pull(monkeypatch, str(ROOT))
    assert out["directory"] == str(ROOT) and Path.cwd() == ROOT


def test_a_partial_override_valid_only_over_the_deployment_reaches_the_merge(monkeypatch):
    """Found by review: Prefect validated a run's partial cfg alone, against the defaults, before the
    flow could merge it, so `reward.overlong_buffer` 128 over a deployment's `rollout.max_new_tokens`
    512 was refused (ParameterTypeError). The flows leave validation to deployment_settings."""
    from types import SimpleNamespace

    import flows.settings as settings
    from flows.audit_envs import audit_envs_flow
    from flows.niah import niah
    from flows.nightly import nightly
    from flows.produce_envs import produce_envs_flow

    assert not any(f.should_validate_parameters for f in (nightly, audit_envs_flow, produce_envs_flow, niah))
    deployment = {"cfg": {"steps": 100, "store": {"uri": "s3://ratchet/prod"}, "rollout": {"max_new_tokens": 512}}}
    run = {"cfg": {"reward": {"overlong_buffer": 128}}}       # as Prefect stores it: the run's own, one level deep
    client = SimpleNamespace(read_deployment=lambda _: SimpleNamespace(parameters=deployment))

    class Client:
        def __enter__(self):
            return client

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(settings, "get_client", lambda sync_client: Client())
    context = SimpleNamespace(flow=nightly, flow_run=SimpleNamespace(deployment_id="d", parameters=run))
    monkeypatch.setattr(settings.FlowRunContext, "get", lambda: context)
    cfg, = settings.deployment_settings(cfg=run["cfg"])
    assert isinstance(cfg, NightlyConfig)
    assert (cfg.reward.overlong_buffer, cfg.rollout.max_new_tokens, cfg.steps, cfg.store.uri) == (128, 512, 100, "s3://ratchet/prod")

    context.flow_run.deployment_id = None                        # not a deployment run: the value alone, validated
    with pytest.raises(ValueError, match=r"reward.overlong_buffer 128 is longer than an answer can be"):
        settings.deployment_settings(cfg=run["cfg"])


def test_a_flow_parameter_prefect_no_longer_checks_is_checked_here(monkeypatch):
    """Found by review: with Prefect's own check off, niah's `model` (str | None) was not validated: a
    number reached the probe. deployment_settings validates every parameter as the flow declares it."""
    from types import SimpleNamespace

    import flows.settings as settings
    from flows.niah import niah

    monkeypatch.setattr(settings.FlowRunContext, "get", lambda: SimpleNamespace(
        flow=niah, flow_run=SimpleNamespace(deployment_id=None, parameters={})))
    with pytest.raises(ValueError, match="Input should be a valid string"):
        settings.deployment_settings(model=5)
    assert settings.deployment_settings(model=None, store={"uri": "/x"}) == (None, StoreConfig(uri="/x"))
