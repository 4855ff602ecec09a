"""A deployment run's settings, checked before any work, and the pull step that finds the code.

    cfg, = deployment_settings(cfg=cfg)     # at the top of a flow
    require_store(cfg.store)

Prefect lays a run's parameters over its deployment's one level deep:
`prefect deployment run nightly/nightly -p cfg='{"steps": 10}'` replaces the deployment's
whole `cfg`, and its store and min_gain would be dropped without a word. `deployment_settings`
gives each parameter back the deployment's value deep-merged under the run's own
(`ratchet.config.deep_merge`), then validated; a key the run does not give keeps the
deployment's value. The flows leave validation to it (`validate_parameters=False`): Prefect
would check the run's partial value alone, against the defaults, and refuse one that is valid
only over the deployment's (`reward.overlong_buffer` 128 over a deployment's
`rollout.max_new_tokens` 512). Outside a deployment run (Python, `ratchet run`) it validates
what it was given (a dict, as Prefect passes JSON, or the settings object itself).

`enter_ratchet_home` is the pull step of deploy/prefect.yaml: a worker without RATCHET_HOME
(or with one that is no ratchet checkout) fails there with one error naming the variable,
not with a FileNotFoundError under a temporary directory.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, NoReturn, get_type_hints

from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext
from pydantic import TypeAdapter

from ratchet.config import StoreConfig, deep_merge
from ratchet.preflight import SettingsError, check_store


def deployment_settings(**given: Any) -> tuple[Any, ...]:
    """The flow's parameters `given` (in their order) as this run should see them, validated as the
    flow declares them (a settings class, `str | None`): in a run of a deployment, each settings dict
    the deployment's value deep-merged under what the run was given."""
    ctx = FlowRunContext.get()
    run = ctx.flow_run if ctx else None
    declared = get_type_hints(ctx.flow.fn) if ctx else {}
    defaults, raw = {}, {}
    if run is not None and run.deployment_id is not None:
        with get_client(sync_client=True) as client:
            defaults = client.read_deployment(run.deployment_id).parameters or {}
        raw = run.parameters or {}   # as stored: the run's own values (Prefect put the deployment's under them, one level deep)
    merged = []
    for name, value in given.items():
        if isinstance(defaults.get(name), dict) and isinstance(raw.get(name), dict):
            value = deep_merge(defaults[name], raw[name])
        merged.append(TypeAdapter(declared[name]).validate_python(value) if name in declared else value)
    return tuple(merged)


def require_store(store: StoreConfig) -> None:
    """Fail at once, with one message per problem, when this worker cannot use the store: an s3://
    store without RATCHET_S3_ENDPOINT or AWS credentials, an endpoint that does not answer, a local
    directory that cannot be written (`ratchet.preflight.check_store`)."""
    problems = check_store(store.uri)
    if problems:
        raise SettingsError(problems)


def enter_ratchet_home() -> dict[str, str]:
    """Pull step (deploy/prefect.yaml): run flows from the ratchet checkout named by RATCHET_HOME."""
    home = os.environ.get("RATCHET_HOME", "").strip()
    if not home:
        _pull_failed("RATCHET_HOME is not set on this worker: set it to the ratchet checkout the worker "
                     "runs flows from (e.g. RATCHET_HOME=/opt/ratchet; deploy/README.md, 'What runs where')")
    path = Path(home).expanduser()
    if not (path / "flows" / "nightly.py").is_file():
        _pull_failed(f"RATCHET_HOME={home!r} is not a ratchet checkout (no flows/nightly.py there): "
                     "set it to the directory the worker runs flows from")
    os.chdir(path)
    return {"directory": str(path.resolve())}


def _pull_failed(problem: str) -> NoReturn:
    """A pull step's exception reaches only the worker's own output; the run's page in the UI
    would say no more than "Process exited with status code: 1". Log it to the run too."""
    if run_id := os.environ.get("PREFECT__FLOW_RUN_ID"):   # set by the worker for the flow-run process
        logging.getLogger("prefect.flow_runs").error(problem, extra={"flow_run_id": run_id})
    raise SettingsError([problem])
