"""Environment families register themselves here; nothing else names them.

A family is one file in `envs/families/` that ends with a `register_family(...)` line. The
registry imports `envs.families.<name>` on first use, so adding a family is adding a file.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Callable, Literal

from pydantic import BaseModel

from envs.spec import TaskSpec

Split = Literal["train", "heldout"]


@dataclass(frozen=True)
class Family:
    name: str
    config: type[BaseModel]
    """Generator config (difficulty knobs); `config()` must be valid with defaults."""
    generate: Callable[[BaseModel, int, int, int, Split], TaskSpec]
    """generate(cfg, seed, index, difficulty, split) -> TaskSpec, deterministic in its arguments."""
    trivial_answers: Callable[[TaskSpec], list[str]] = field(default=lambda spec: ["", "pass"])
    """Completions that must fail every task of the family (audit)."""
    curriculum: Callable[[int, int, int], list[float]] | None = None
    """curriculum(step, total_steps, max_difficulty) -> sampling weight per difficulty 1..max."""
    observe: Callable[[TaskSpec, dict | None, dict | None], str] | None = None
    """observe(spec, feedback, metrics) -> the feedback part of an episode's observation (what the
    sandbox said about an answer); None: `envs.episode.feedback_text`. The re-prompt is appended after it."""
    reprompt: Callable[[TaskSpec], str] | None = None
    """reprompt(spec) -> the text that ends an observation, so that the next answer has the shape of the
    first; None: `envs.episode.default_reprompt`."""


FAMILIES: dict[str, Family] = {}


def register_family(name: str, **kw) -> Family:
    family = Family(name=name, **kw)
    FAMILIES[name] = family
    return family


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        try:
            importlib.import_module(f"envs.families.{name}")
        except ModuleNotFoundError as e:
            known = ", ".join(all_family_names()) or "none"
            raise KeyError(f"unknown environment family {name!r} (known: {known})") from e
    return FAMILIES[name]


def all_family_names() -> list[str]:
    import envs.families as pkg

    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_"))
