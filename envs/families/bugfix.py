"""bugfix: a small multi-file Python project whose pytest suite fails; fix the broken file.

The project is 1..3 modules of small documented functions. One module carries 1..3 injected
bugs (mutants of the correct code: a swapped operator, an off-by-one constant, a dropped
statement). The model sees every file and replies with the full corrected content of the
broken one; `overwrite_file` writes it, with a dispatcher after it (`call(name, *args)`), and
`check_calls` calls each of its functions on the hidden cases: the results are serialised inside
the sandbox and compared with the expected values outside it, so the reward is the share of
cases that come out right. (Until 2026-12-07 a hidden pytest file held the expected values and
ran in the answer's own process: an answer that read that file, or returned an object equal to
everything, passed every test without fixing anything.)

Difficulty: 1 -> one module, one bug; 2 -> two modules, one bug; 3 -> two modules, two bugs;
4 -> three modules, two bugs; 5 -> three modules, three bugs. Every injected bug is checked
here, on the hidden tests' own cases, to make at least one of them fail (no equivalent bugs),
and the hidden cases are amplified until they kill every one-edit mutant of the correct file
that some input can tell apart (what the audit's mutation testing then measures).
"""

from __future__ import annotations

import hashlib
import json
import random
import re

from pydantic import BaseModel, ConfigDict, Field

from envs.episode import call_describer, feedback_text
from envs.mutation import python_mutants
from envs.registry import register_family
from envs.spec import COMPLETION, CallTest, CheckCalls, OverwriteFile, TaskSpec

_L = lambda r, lo=0, hi=6: [r.randint(-9, 9) for _ in range(r.randint(lo, hi))]  # noqa: E731
# name -> (source, input generator); every function is loop-bounded and pure
FUNCS = {
    "clamp": ('def clamp(x, lo, hi):\n    """x limited to the range [lo, hi]."""\n    if x < lo:\n        return lo\n'
              '    if x > hi:\n        return hi\n    return x\n', lambda r: (r.randint(-12, 12), r.randint(-6, 0), r.randint(1, 6))),
    "total": ('def total(xs):\n    """Sum of the numbers in xs."""\n    s = 0\n    for x in xs:\n        s = s + x\n    return s\n',
              lambda r: (_L(r),)),
    "count_above": ('def count_above(xs, t):\n    """How many items of xs are strictly greater than t."""\n    n = 0\n'
                    '    for x in xs:\n        if x > t:\n            n = n + 1\n    return n\n', lambda r: (_L(r), r.randint(-3, 3))),
    "maximum": ('def maximum(xs):\n    """The largest item of a non-empty list."""\n    best = xs[0]\n    for x in xs[1:]:\n'
                '        if x > best:\n            best = x\n    return best\n', lambda r: (_L(r, 1),)),
    "is_sorted": ('def is_sorted(xs):\n    """True if xs is in non-decreasing order."""\n    for i in range(1, len(xs)):\n'
                  '        if xs[i - 1] > xs[i]:\n            return False\n    return True\n',
                  lambda r: (sorted(_L(r)) if r.random() < 0.5 else _L(r),)),
    "window_sums": ('def window_sums(xs, k):\n    """Sums of every k consecutive items, left to right."""\n'
                    '    return [sum(xs[i:i + k]) for i in range(len(xs) - k + 1)]\n', lambda r: (_L(r, 2, 7), r.randint(1, 3))),
    "dedupe": ('def dedupe(xs):\n    """xs without repeats, first occurrences kept, in order."""\n    seen = []\n    for x in xs:\n'
               '        if x not in seen:\n            seen.append(x)\n    return seen\n', lambda r: ([r.randint(0, 4) for _ in range(r.randint(0, 8))],)),
    "fizz": ('def fizz(n):\n    """FizzBuzz word for n."""\n    if n % 15 == 0:\n        return "FizzBuzz"\n    if n % 3 == 0:\n'
             '        return "Fizz"\n    if n % 5 == 0:\n        return "Buzz"\n    return str(n)\n', lambda r: (r.choice([3, 5, 15, 30, 9, 10]) if r.random() < 0.6 else r.randint(1, 40),)),
    "scale": ('def scale(xs, f):\n    """Every item of xs multiplied by f."""\n    return [x * f for x in xs]\n', lambda r: (_L(r, 1), r.randint(2, 5))),
    "middle": ('def middle(xs):\n    """The middle item of a non-empty list (the left one of two)."""\n    return xs[(len(xs) - 1) // 2]\n',
               lambda r: (_L(r, 1, 7),)),
}
_MODULES = ("core_ops", "list_ops", "misc_ops")   # no stdlib names (numbers!)
_LEVELS = {1: (1, 1), 2: (2, 1), 3: (2, 2), 4: (3, 2), 5: (3, 3)}   # difficulty -> (modules, bugs)
# after the answer in its file: the one entry point check_calls calls, each hidden case as
# call("clamp", 3, -2, 4); defined last, so an answer's own `call` does not replace it
DISPATCH = "\n\n\ndef call(name, *args):\n    return globals()[name](*args)\n"


class Config(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    funcs_per_module: int = Field(2, ge=1, le=4, description="Functions in each module.")
    cases_per_func: int = Field(4, ge=1, le=20, description="Random hidden test cases per function.")
    amplify_tries: int = Field(40, ge=0, le=1000, description="Random inputs tried per surviving mutant to add a case that kills it.")
    heldout_fraction: float = Field(0.15, gt=0, lt=1, description="Share of function sets reserved for held-out.")


def _run(source: str, name: str, args: tuple):
    ns: dict = {}
    exec(compile(source, "<bugfix>", "exec"), ns)  # noqa: S102 (our own generated code)
    return ns[name](*[list(a) if isinstance(a, list) else a for a in args])


def _bugs(rng: random.Random, module: str, names: list[str], cases: dict, n: int) -> str | None:
    """`module` with n bugs that each fail at least one hidden case; None if none found."""
    src = module
    for _ in range(n):
        options = python_mutants(src) or []
        rng.shuffle(options)
        for cand in options:
            try:
                if any(_safe(cand, f, a) != e for f in names for a, e in cases[f]):
                    src = cand
                    break
            except Exception:
                src = cand
                break
        else:
            return None
    return src


def _amplify(rng: random.Random, module: str, names: list[str], cases: dict, tries: int) -> None:
    """Add a hidden case for each one-edit mutant of `module` the cases miss, when random inputs
    find one that tells it apart (mutants no input separates are equivalent: nothing to add)."""
    for mutant in python_mutants(module) or []:
        if any(_safe(mutant, f, a) != e for f in names for a, e in cases[f]):
            continue
        for _ in range(tries):
            f = rng.choice(names)
            args = FUNCS[f][1](rng)
            want = _run(FUNCS[f][0], f, args)
            if _safe(mutant, f, args) != want:
                cases[f].append((args, want))
                break


def _safe(source: str, name: str, args: tuple):
    try:
        return _run(source, name, args)
    except Exception as e:   # a bug that raises is a caught bug
        return f"!{type(e).__name__}"


def _reserved(key: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(f"bugfix/heldout/{key}".encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def generate(cfg: Config, seed: int, index: int, difficulty: int, split: str) -> TaskSpec:
    rng = random.Random(f"bugfix:{seed}:{split}:{difficulty}:{index}")
    n_mod, n_bugs = _LEVELS[difficulty]
    while True:
        chosen = rng.sample(sorted(FUNCS), n_mod * cfg.funcs_per_module)
        groups = [chosen[i * cfg.funcs_per_module:(i + 1) * cfg.funcs_per_module] for i in range(n_mod)]
        if _reserved("|".join(sorted(groups[0])), cfg.heldout_fraction) != (split == "heldout"):
            continue
        modules = {f"{_MODULES[i]}.py": "\n\n".join(FUNCS[f][0] for f in g) for i, g in enumerate(groups)}
        cases = {f: [] for f in groups[0]}     # the broken module's functions: the others are not the answer's
        for f in groups[0]:
            for _ in range(cfg.cases_per_func):
                args = FUNCS[f][1](rng)
                cases[f].append((args, _run(FUNCS[f][0], f, args)))
        target = f"{_MODULES[0]}.py"
        _amplify(rng, modules[target], groups[0], cases, cfg.amplify_tries)
        buggy = _bugs(rng, modules[target], groups[0], cases, n_bugs)
        if buggy is not None:
            break
    files = {**modules, target: buggy}
    tests = tuple(CallTest(args=json.dumps([f, *a]), expected=json.dumps(e)) for f in groups[0] for a, e in cases[f])
    shown = "".join(f"--- {p} ---\n{files[p]}\n" for p in sorted(files))
    prompt = (f"The hidden tests of this project fail because of bugs in {target}. "
              f"Reply with the full corrected content of {target} (code only).\n\n{shown}")
    digest = hashlib.sha256(f"{prompt}|{seed}|{index}".encode()).hexdigest()[:12]
    return TaskSpec(
        task_id=f"bf-{split}-{difficulty}-{digest}", family="bugfix", difficulty=difficulty, split=split,
        prompt=prompt,
        execution_steps=(OverwriteFile(path=f"/app/{target}", content=COMPLETION + DISPATCH),
                         CheckCalls(entry_point="call")),
        files=files, tests=tests,
        reference_solution=modules[target],
        metadata={"target": target, "buggy": buggy, "functions": chosen, "tested": groups[0], "bugs": n_bugs},
    )


def trivial_answers(spec: TaskSpec) -> list[str]:
    return ["", "pass\n", spec.metadata["buggy"], "raise NotImplementedError\n",
            "".join(f"def {f}(*a):\n    return 0\n\n" for f in spec.metadata["functions"])]


def curriculum(step: int, total: int, max_difficulty: int) -> list[float]:
    """Linear ramp from single-bug single-module projects to the hardest level allowed."""
    t = step / max(total - 1, 1)
    return [max(0.05, 1.0 - abs((d - 1) / max(max_difficulty - 1, 1) - t)) for d in range(1, max_difficulty + 1)]


def observe(spec: TaskSpec, feedback: dict | None, metrics: dict | None) -> str:
    """The default feedback, each failed case shown as the call of the function it tests:
    `- clamp(3, -2, 4): expected 3, got 4` (the dispatcher's `call("clamp", 3, -2, 4)` unwrapped)."""
    default = call_describer(spec)
    return feedback_text(spec, feedback, metrics, lambda t: re.sub(r'^call\("(\w+)",? ?', r"\1(", default(t)))


def reprompt(spec: TaskSpec) -> str:
    return f"Reply with the full corrected content of {spec.metadata['target']} (code only).\n"


register_family("bugfix", config=Config, generate=generate, trivial_answers=trivial_answers, curriculum=curriculum,
                observe=observe, reprompt=reprompt)
