"""Every deployment in deploy/prefect.yaml imports and its parameters validate against the flow."""

from pathlib import Path

import pytest
import yaml
from prefect.flows import load_flow_from_entrypoint

ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENTS = yaml.safe_load((ROOT / "deploy" / "prefect.yaml").read_text())["deployments"]


@pytest.mark.parametrize("deployment", DEPLOYMENTS, ids=[d["name"] for d in DEPLOYMENTS])
def test_deployment_imports_and_validates(deployment, monkeypatch):
    monkeypatch.chdir(ROOT)
    flow = load_flow_from_entrypoint(deployment["entrypoint"])
    params = flow.validate_parameters(deployment.get("parameters") or {})
    assert set(params) <= set(flow.parameters.properties)
    for schedule in deployment.get("schedules", []):
        assert len(schedule["cron"].split()) == 5


def test_bad_parameters_are_rejected(monkeypatch):
    monkeypatch.chdir(ROOT)
    flow = load_flow_from_entrypoint("flows/nightly.py:nightly")
    with pytest.raises(Exception, match="steps"):
        flow.validate_parameters({"cfg": {"steps": -1}})
    with pytest.raises(Exception, match="no_such_field"):
        flow.validate_parameters({"cfg": {"no_such_field": 1}})


def test_nightly_form_has_descriptions(monkeypatch):
    """The Prefect UI renders the run form from this schema: every field carries a description."""
    monkeypatch.chdir(ROOT)
    flow = load_flow_from_entrypoint("flows/nightly.py:nightly")
    schema = flow.parameters.model_dump()
    definitions = schema.get("definitions") or schema.get("$defs") or {}
    missing = [f"{name}.{field}" for name, d in definitions.items()
               for field, prop in d.get("properties", {}).items() if "description" not in prop]
    assert definitions and missing == []


SPEC = yaml.safe_load((ROOT / "deploy" / "prefect.yaml").read_text())
FLOWS = sorted({d["entrypoint"] for d in DEPLOYMENTS})


def _descriptions(node, path=""):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "description" and isinstance(value, str):
                yield path, value
            else:
                yield from _descriptions(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _descriptions(value, f"{path}[{i}]")


@pytest.mark.parametrize("entrypoint", FLOWS)
def test_form_descriptions_render_as_written(entrypoint, monkeypatch):
    """The UI renders descriptions as HTML: `envs/<family>/<version>/` showed as `envs///`."""
    monkeypatch.chdir(ROOT)
    schema = load_flow_from_entrypoint(entrypoint).parameters.model_dump()
    found = list(_descriptions(schema))
    assert len(found) > 5
    assert [f"{path}: {text}" for path, text in found if "<" in text or ">" in text] == []


def _deployment(name: str) -> dict:
    [d] = [d for d in DEPLOYMENTS if d["name"] == name]
    return d


def test_the_scheduled_audit_reports_on_what_the_scheduled_nightly_trains_on():
    """audit-envs and produce-envs use the nightly's own store, envs, audit and verify sections
    (validated, so a spelled-out default equals an omitted one), so the 00:00 audit produces and
    audits the snapshots the nightly trains on (which the nightly audits again itself), and it
    runs first."""
    from ratchet.config import NightlyConfig

    nightly = NightlyConfig.model_validate(_deployment("nightly")["parameters"]["cfg"])
    for name, sections in (("audit-envs", ("store", "envs", "audit", "verify")), ("produce-envs", ("store", "envs"))):
        params = _deployment(name)["parameters"]
        for section in sections:
            value = getattr(nightly, section)
            assert type(value).model_validate(params.get(section, {})) == value, f"{name}: {section}"
    assert nightly.store.uri.startswith("s3://")

    def hour(name):
        [schedule] = _deployment(name)["schedules"]
        minute, h, *rest = schedule["cron"].split()
        assert rest == ["*", "*", "*"] and schedule["timezone"] == "UTC"
        return int(h) * 60 + int(minute)
    assert hour("audit-envs") < hour("nightly")


def test_one_nightly_at_a_time():
    """A second nightly (a UI Custom run during the 02:00 run) waits for the first: the nightly
    deployment has a concurrency limit of 1 that enqueues, in the shape `prefect deploy` reads
    (Prefect's own schema). The trainer workers' `--limit 1` is test_manifests'."""
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy

    limit = ConcurrencyLimitConfig.model_validate(_deployment("nightly")["concurrency_limit"])
    assert limit.limit == 1 and limit.collision_strategy == ConcurrencyLimitStrategy.ENQUEUE
