"""One config tree holds every knob, and every knob is read: a field that nothing reads is a
setting whose description lies."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from ratchet.config import EnvsConfig, ModelConfig, NightlyConfig

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("ratchet", "envs", "tasks", "flows") for p in (ROOT / d).rglob("*.py")]
# ratchet/config.py counts too: its fields are declarations (not attribute reads), its methods
# (e.g. EnvsConfig.generator_config) are readers like any other.


def _tree(model: type[BaseModel], path: str = "") -> list[tuple[str, type[BaseModel], str]]:
    """(dotted path, the section class that declares it, field name) of every leaf field."""
    out = []
    for name, field in model.model_fields.items():
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            out += _tree(sub, f"{path}{name}.")
        else:
            out.append((f"{path}{name}", model, name))
    return out


def _reads() -> tuple[set[tuple[str, str]], dict[str, set[str]]]:
    """Attribute reads `<...>.<section>.<field>` anywhere, and per module the attributes read in it
    and the config class names it mentions."""
    chains, by_module = set(), {}
    for path in SOURCES:
        tree = ast.parse(path.read_text(), filename=str(path))
        attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
            a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        by_module[str(path)] = attrs | {f"class:{n}" for n in names}
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute):
                chains.add((n.value.attr, n.attr))
            elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name):
                chains.add((n.value.id, n.attr))
    return chains, by_module


FIELDS = _tree(NightlyConfig)
CHAINS, MODULES = _reads()


@pytest.mark.parametrize("path, section, name", FIELDS, ids=[f[0] for f in FIELDS])
def test_every_field_of_the_tree_is_read(path, section, name):
    """Read as `<x>.<section>.<field>` (e.g. `cfg.rl.is_cap`, `rl.is_cap`), or as `.<field>` in a
    module that names the field's config class (e.g. `self.cfg.lr` in a module importing TrainConfig)."""
    parent = path.rsplit(".", 1)[0] if "." in path else None
    by_chain = parent is not None and (parent.rsplit(".", 1)[-1], name) in CHAINS
    by_module = any(name in reads and f"class:{section.__name__}" in reads for reads in MODULES.values())
    by_root = parent is None and (("cfg", name) in CHAINS)
    assert by_chain or by_module or by_root, f"{path} ({section.__name__}.{name}) is read nowhere"


def test_the_tree_reaches_every_section():
    """Audit, cleaning and per-family generator settings are part of the nightly's one tree."""
    paths = {p for p, _, _ in FIELDS}
    assert {"audit.mutation_threshold", "envs.clean.ngram", "envs.family_config", "verify.timeout_s"} <= paths
    assert "reward.max_env_error_rate" not in paths and "gate.max_env_error_rate" in paths


def test_family_settings_are_validated_against_the_family():
    cfg = EnvsConfig(family_config={"python_functions": {"n_tests": 12}})
    assert cfg.generator_config("python_functions").n_tests == 12
    assert EnvsConfig().generator_config("python_functions").n_tests == 10
    with pytest.raises(ValueError, match="n_tests"):
        EnvsConfig(family_config={"python_functions": {"n_tests": 0}})
    with pytest.raises(ValueError, match="no_such_family"):
        EnvsConfig(family_config={"no_such_family": {}})
    with pytest.raises(ValidationError) as e:      # the family's name locates a typo'd setting
        EnvsConfig(family_config={"python_functions": {"n_tests": 12, "n_testz": 3}})
    assert [(err["loc"], err["type"]) for err in e.value.errors()] == [
        (("family_config", "python_functions", "n_testz"), "extra_forbidden")]


def test_a_model_path_under_home_is_expanded_for_every_reader(tmp_path, monkeypatch):
    """Preflight expanded '~' itself while load_policy and prompt_room handed it to transformers,
    which took it for a Hub repo id: a run that passed preflight failed loading its model."""
    from ratchet.model import load_policy, prompt_room
    from ratchet.preflight import check
    from tests.model.tiny import tiny_llama

    monkeypatch.setenv("HOME", str(tmp_path))
    tiny_llama(tmp_path / "models" / "m")
    cfg = NightlyConfig.model_validate({"model": {"path": "~/models/m", "device": "cpu"},
                                        "store": {"uri": str(tmp_path / "store")}})
    assert cfg.model.path == str(tmp_path / "models" / "m")
    assert cfg.model_validate(cfg.model_dump()) == cfg and ModelConfig(path=None).path is None
    assert check(cfg) == []
    load_policy(cfg.model.path, cfg.model)
    assert prompt_room(cfg.model, 32)(["def f(x):\n"]) == [None]


def test_one_limits_mapping():
    from ratchet.config import VerifyConfig

    limits = VerifyConfig(timeout_s=3.0, memory_mb=256).sandbox_limits()
    assert (limits.wall_s, limits.cpu_s, limits.memory_mb) == (3.0, 3.0, 256)


def test_kl_k1_is_refused_in_the_loss_only():
    """k1's gradient is zero in expectation (tests/rl/test_losses.py): in the loss it would be a KL that controls
    nothing; in the reward it is an unbiased value."""
    from ratchet.config import RLConfig

    with pytest.raises(ValueError, match="'k1' in the loss has zero expected gradient"):
        RLConfig(kl_coef=0.1, kl_estimator="k1")
    assert RLConfig(kl_coef=0.1, kl_estimator="k1", kl_in_reward=True).kl_estimator == "k1"
    assert RLConfig(kl_estimator="k1").kl_coef == 0.0  # no KL term at all: nothing to refuse
    assert RLConfig().kl == "k2" and RLConfig(kl_in_reward=True).kl == "k3"   # unset: the loss's and the reward's
    assert RLConfig(kl_estimator="k3").kl == "k3"


def test_an_overlong_buffer_past_the_length_cap_is_refused():
    with pytest.raises(ValidationError, match="reward.overlong_buffer 64 is longer than an answer can be "
                                              r"\(rollout.max_new_tokens 48\)"):
        NightlyConfig(reward={"overlong_buffer": 64})
    assert NightlyConfig(reward={"overlong_buffer": 48}).reward.overlong_buffer == 48


def test_own_mistake_demos_need_the_revision_demo_tasks():
    with pytest.raises(ValidationError, match="agent.own_revision_steps 100: the own-mistake demos are sampled on the "
                                              "tasks that get a revision demo; set agent.revision_demos above 0"):
        NightlyConfig(agent={"own_revision_steps": 100})
    assert NightlyConfig(agent={"own_revision_steps": 100, "revision_demos": 0.5}).agent.own_revision_steps == 100
