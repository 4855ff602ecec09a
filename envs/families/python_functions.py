"""python_functions: "write this Python function" from a one-line spec.

    # add 3, then take mod 6, then negate it
    def f(x):
        x = x + 3
        x = x % 6
        x = -x
        return x

A task chains 1..3 operations (difficulty = chain length) from 9 integer and 8 string
operations, one statement each. Hidden tests call `f` on `n_tests` inputs (10 by default); the expected outputs
come from applying the operations here, never from running model code.

Held-out split: a fixed, seed-independent 15% of (operation, constant) pairs and of
consecutive operation pairs are reserved. Training tasks never use a reserved pair;
held-out tasks use at least one. Every token still appears in training (the constant 7
of a reserved "add 7" appears in "multiply by 7"), so the split tests composition, not
vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field

from envs.registry import register_family
from envs.spec import COMPLETION, CallTest, CheckCalls, OverwriteFile, TaskSpec


@dataclass(frozen=True)
class Op:
    name: str
    kind: str                     # "int" | "str"
    consts: tuple                 # () for constant-free operations
    describe: Callable[[object], str]
    code: Callable[[object], str]  # the statement, variable x (int) or s (str)
    apply: Callable[[object, object], object]


_WORDS = ("a", "b", "ab", "xy", "z")
OPS: tuple[Op, ...] = (
    Op("add", "int", tuple(range(1, 10)), lambda c: f"add {c}", lambda c: f"x = x + {c}", lambda x, c: x + c),
    Op("sub", "int", tuple(range(1, 10)), lambda c: f"subtract {c}", lambda c: f"x = x - {c}", lambda x, c: x - c),
    Op("mul", "int", tuple(range(2, 10)), lambda c: f"multiply by {c}", lambda c: f"x = x * {c}", lambda x, c: x * c),
    Op("div", "int", tuple(range(2, 10)), lambda c: f"divide by {c} rounding down", lambda c: f"x = x // {c}", lambda x, c: x // c),
    Op("mod", "int", tuple(range(2, 10)), lambda c: f"take mod {c}", lambda c: f"x = x % {c}", lambda x, c: x % c),
    Op("max", "int", tuple(range(0, 10)), lambda c: f"take the max with {c}", lambda c: f"x = max(x, {c})", lambda x, c: max(x, c)),
    Op("neg", "int", (), lambda c: "negate it", lambda c: "x = -x", lambda x, c: -x),
    Op("abs", "int", (), lambda c: "take the absolute value", lambda c: "x = abs(x)", lambda x, c: abs(x)),
    Op("sq", "int", (), lambda c: "square it", lambda c: "x = x * x", lambda x, c: x * x),
    Op("rev", "str", (), lambda c: "reverse it", lambda c: "s = s[::-1]", lambda s, c: s[::-1]),
    Op("upper", "str", (), lambda c: "make it uppercase", lambda c: "s = s.upper()", lambda s, c: s.upper()),
    Op("lower", "str", (), lambda c: "make it lowercase", lambda c: "s = s.lower()", lambda s, c: s.lower()),
    Op("append", "str", _WORDS, lambda c: f"append '{c}'", lambda c: f"s = s + '{c}'", lambda s, c: s + c),
    Op("prepend", "str", _WORDS, lambda c: f"prepend '{c}'", lambda c: f"s = '{c}' + s", lambda s, c: c + s),
    Op("drop", "str", tuple(range(1, 4)), lambda c: f"drop the first {c} characters", lambda c: f"s = s[{c}:]", lambda s, c: s[c:]),
    Op("keep", "str", tuple(range(1, 6)), lambda c: f"keep the first {c} characters", lambda c: f"s = s[:{c}]", lambda s, c: s[:c]),
    Op("repeat", "str", (2, 3), lambda c: f"repeat it {c} times", lambda c: f"s = s * {c}", lambda s, c: s * c),
)
_BY_KIND = {k: [op for op in OPS if op.kind == k] for k in ("int", "str")}


def _reserved(item: str, fraction: float = 0.15) -> bool:
    """Seed-independent membership in the held-out reservation (stable across versions)."""
    h = int.from_bytes(hashlib.sha256(f"python_functions/heldout/{item}".encode()).digest()[:8], "big")
    return h / 2**64 < fraction


class Config(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    n_tests: int = Field(10, ge=1, le=64, description="Hidden tests per task.")
    int_range: int = Field(40, ge=1, le=10**6, description="Integer inputs are drawn from [-int_range, int_range].")
    max_str_len: int = Field(8, ge=1, le=64, description="String inputs have 1..max_str_len letters.")
    heldout_fraction: float = Field(0.15, gt=0, lt=1, description="Share of reserved operation pairs.")


_SELF_UNDOING = {"neg", "abs", "sq", "rev", "upper", "lower"}
"""Constant-free operations that, repeated back to back, are redundant (abs, upper, lower)
or undo themselves (neg, rev): such chains say less than their length."""


def _chain(rng: random.Random, kind: str, length: int) -> list[tuple[Op, object]]:
    ops = _BY_KIND[kind]
    chain: list[tuple[Op, object]] = []
    while len(chain) < length:
        op = rng.choice(ops)
        if chain and op.name == chain[-1][0].name and op.name in _SELF_UNDOING - {"sq"}:
            continue
        chain.append((op, rng.choice(op.consts) if op.consts else None))
    return chain


def _apply(chain: list[tuple[Op, object]], value):
    for op, c in chain:
        value = op.apply(value, c)
    return value


def _variants(chain: list[tuple[Op, object]]):
    """Programs a mutant-testing audit would try: one operation dropped, one constant +-1."""
    for i, (op, c) in enumerate(chain):
        yield chain[:i] + chain[i + 1:]
        if isinstance(c, int) and not isinstance(c, bool):
            for d in (-1, 1):
                if op.name not in ("div", "mod", "repeat") or c + d >= 1:
                    yield chain[:i] + [(op, c + d)] + chain[i + 1:]


def _collapses(chain: list[tuple[Op, object]], inputs: list) -> bool:
    """True when the tests could not tell the chain from a simpler or slightly different one:
    it is the identity or a constant on these inputs, or dropping an operation or moving a
    constant by one gives the same outputs (a redundant step, or tests too weak to see it)."""
    outs = [_apply(chain, v) for v in inputs]
    if outs == inputs or len({repr(o) for o in outs}) == 1:
        return True
    return any([_apply(v, x) for x in inputs] == outs for v in _variants(chain))


def _is_heldout(chain: list[tuple[Op, object]], fraction: float) -> bool:
    pairs = [f"{op.name}:{c}" for op, c in chain if op.consts]
    bigrams = [f"{a.name}>{b.name}" for (a, _), (b, _) in zip(chain, chain[1:])]
    return any(_reserved(p, fraction) for p in pairs + bigrams)


def _render(chain: list[tuple[Op, object]]) -> tuple[str, str]:
    var = "x" if chain[0][0].kind == "int" else "s"
    spec = ", then ".join(op.describe(c) for op, c in chain)
    prompt = f"# {spec}\ndef f({var}):\n"
    body = "".join(f"    {op.code(c)}\n" for op, c in chain) + f"    return {var}\n"
    return prompt, body


def _inputs(rng: random.Random, kind: str, cfg: Config) -> list:
    if kind == "int":
        return [rng.randint(-cfg.int_range, cfg.int_range) for _ in range(cfg.n_tests)]
    letters = "abcdefghijABCDEFGHIJ"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(1, cfg.max_str_len))) for _ in range(cfg.n_tests)]


def generate(cfg: Config, seed: int, index: int, difficulty: int, split: str) -> TaskSpec:
    """Task `index` of `split` at `difficulty` (chain length), deterministic in its arguments."""
    rng = random.Random(f"python_functions:{seed}:{split}:{difficulty}:{index}")
    while True:  # rejection-sample a chain on the right side of the held-out reservation
        kind = "int" if rng.random() < 9 / 16 else "str"
        chain = _chain(rng, kind, difficulty)
        inputs = _inputs(rng, kind, cfg)
        if _is_heldout(chain, cfg.heldout_fraction) == (split == "heldout") and not _collapses(chain, inputs):
            break
    prompt, body = _render(chain)
    tests = [CallTest(args=json.dumps([v]), expected=json.dumps(_apply(chain, v))) for v in inputs]
    key = "|".join(f"{op.name}:{c}" for op, c in chain)
    return TaskSpec(
        task_id=f"pf-{split}-{difficulty}-{hashlib.sha256(f'{key}|{seed}|{index}'.encode()).hexdigest()[:12]}",
        family="python_functions",
        difficulty=difficulty,
        split=split,
        prompt=prompt,
        execution_steps=(
            OverwriteFile(path="/app/solution.py", content=prompt + COMPLETION),
            CheckCalls(entry_point="f"),
        ),
        tests=tuple(tests),
        reference_solution=body,
        metadata={"ops": key, "kind": kind},
    )


def trivial_answers(spec: TaskSpec) -> list[str]:
    var = "x" if spec.metadata.get("kind") == "int" else "s"
    return ["", "    pass\n", f"    return {var}\n", "    return 0\n", "    return ''\n", "    raise ValueError\n"]


def curriculum(step: int, total: int, max_difficulty: int) -> list[float]:
    """Weights per difficulty 1..max: start on short chains, shift to long ones."""
    t = step / max(total - 1, 1)
    return [1.0 + t * (d - 1) for d in range(1, max_difficulty + 1)]


register_family("python_functions", config=Config, generate=generate,
                trivial_answers=trivial_answers, curriculum=curriculum)
