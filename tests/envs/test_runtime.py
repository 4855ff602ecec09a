"""Runtimes: keyed by the dependency set, unsatisfiable sets are a per-task error, not a crash."""

from __future__ import annotations

import pytest

from envs.runtime import RuntimeUnavailable, env_key, resolve
from envs.spec import EnvironmentConfig

MISSING = "/nonexistent/ratchet-missing-0.0-py3-none-any.whl"   # fails without any network; remembered once failed


def test_key_is_the_dependency_set():
    a = EnvironmentConfig(dependencies=("pytest==9.2.0", "attrs==25.1.0"))
    b = EnvironmentConfig(dependencies=("attrs==25.1.0", "pytest == 9.2.0"))
    assert env_key(a) == env_key(b) != env_key(EnvironmentConfig(dependencies=("pytest==9.1.0",)))
    assert resolve(EnvironmentConfig()) is None       # no dependencies: the sandbox's own interpreter


def test_unsatisfiable_and_unknown_runtimes(tmp_path, monkeypatch):
    monkeypatch.setenv("RATCHET_RUNTIMES", str(tmp_path / "runtimes"))
    with pytest.raises(RuntimeUnavailable, match="python2.7"):
        resolve(EnvironmentConfig(runtime="python2.7", dependencies=("six",)), root=tmp_path)
    with pytest.raises(RuntimeUnavailable, match="cannot build runtime"):
        resolve(EnvironmentConfig(dependencies=(MISSING,)), root=tmp_path)
    with pytest.raises(RuntimeUnavailable, match="under /tmp"):
        monkeypatch.setenv("RATCHET_RUNTIMES", "/tmp/x")
        resolve(EnvironmentConfig(dependencies=("six",)))


def test_unsatisfiable_set_is_an_env_error_per_task(tmp_path):
    from envs.families.python_functions import Config, generate
    from ratchet.verify import verify_many

    good = generate(Config(), 0, 1, 1, "train")
    bad = good.model_copy(update={"task_id": "needs-missing", "environment_config": EnvironmentConfig(dependencies=(MISSING,))})
    rb, rg = verify_many([(bad, bad.reference_solution), (good, good.reference_solution)],
                         runtime_python=lambda env: resolve(env, root=tmp_path if env == bad.environment_config else None))
    assert rb.env_error and "cannot build runtime" in rb.env_error_kind
    assert not rg.env_error and rg.metrics["test_pass_rate"] == 1.0
