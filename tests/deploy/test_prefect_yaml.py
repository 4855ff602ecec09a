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
