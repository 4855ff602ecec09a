"""arithmetic: expression and word problems with one exact integer answer.

    Compute (7 + 5) * 3 - 4. Answer with the integer only.          -> 32
    Ana has 12 boxes of 6 pens and gives away 9 pens. How many pens does she have left?  -> 63

Difficulty 1..5 = number of operations (1..5) and the operand range; difficulty >= 3 mixes
in word problems, >= 4 parentheses. The answer must be the bare integer (format-checked):
the completion is written to answer.txt, never executed, and a fixed checker (solution.py,
part of the task) reads it back and returns it normalised, or None when it is not a bare
integer. Tasks whose answer is a trivial guess (0, 1, -1, the first operand) are redrawn.
"""

from __future__ import annotations

import hashlib
import json
import random
import re

from pydantic import BaseModel, ConfigDict, Field

from envs.registry import register_family
from envs.spec import COMPLETION, CallTest, CheckCalls, OverwriteFile, TaskSpec

CHECKER = '''import re

def answer():
    with open("answer.txt") as f:
        text = f.read().strip()
    return str(int(text)) if re.fullmatch(r"[+-]?\\d+", text) else None
'''

_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Farah", "Goran", "Hana")
_THINGS = ("pens", "apples", "coins", "stamps", "marbles", "cards")
_BOXES = ("boxes", "bags", "jars", "crates")


class Config(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    base_range: int = Field(9, ge=2, le=10**6, description="Operands at difficulty 1 are 1..base_range; x2 per level.")
    word_from: int = Field(3, ge=1, le=6, description="Lowest difficulty that mixes in word problems (6: never).")
    heldout_fraction: float = Field(0.15, gt=0, lt=1, description="Share of questions reserved for held-out.")


def _reserved(question: str, fraction: float) -> bool:
    """Seed-independent: a question is held-out or training forever, across versions."""
    h = int.from_bytes(hashlib.sha256(f"arithmetic/heldout/{question}".encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def _expression(rng: random.Random, n_ops: int, hi: int, parens: bool) -> tuple[str, int, str, int]:
    """(text, value, operator sequence, first operand)."""
    first = rng.randint(1, hi)
    text, value, ops = str(first), first, ""
    for _ in range(n_ops):
        op = rng.choice("+-*")
        b = rng.randint(1, hi if op != "*" else max(2, hi // 3))
        if parens and op == "*" and rng.random() < 0.5 and any(c in text for c in "+-"):
            text = f"({text})"
        elif op == "*" and any(c in text for c in "+-"):   # keep left-to-right meaning explicit
            text = f"({text})"
        text, value, ops = f"{text} {op} {b}", eval(f"{value} {op} {b}"), ops + op  # noqa: S307 (our own ints)
    return text, value, ops, first


def _word(rng: random.Random, hi: int) -> tuple[str, int, str, int]:
    name, thing, box = rng.choice(_NAMES), rng.choice(_THINGS), rng.choice(_BOXES)
    a, b, c = rng.randint(2, hi), rng.randint(2, 12), rng.randint(1, hi)
    text = (f"{name} has {a} {box} of {b} {thing} each and gives away {c} {thing}. "
            f"How many {thing} does {name} have left?")
    return text, a * b - c, "w*-", a


def generate(cfg: Config, seed: int, index: int, difficulty: int, split: str) -> TaskSpec:
    rng = random.Random(f"arithmetic:{seed}:{split}:{difficulty}:{index}")
    hi = cfg.base_range * 2 ** (difficulty - 1)
    while True:
        if difficulty >= cfg.word_from and rng.random() < 0.4:
            text, value, ops, first = _word(rng, hi)
            question = text
        else:
            text, value, ops, first = _expression(rng, difficulty, hi, parens=difficulty >= 4)
            question = f"Compute {text}."
        if value not in (0, 1, -1, first) and _reserved(question, cfg.heldout_fraction) == (split == "heldout"):
            break
    prompt = f"{question} Answer with the integer only.\n"
    digest = hashlib.sha256(f"{question}|{seed}|{index}".encode()).hexdigest()[:12]
    return TaskSpec(
        task_id=f"ar-{split}-{difficulty}-{digest}", family="arithmetic", difficulty=difficulty, split=split,
        prompt=prompt,
        execution_steps=(OverwriteFile(path="/app/answer.txt", content=COMPLETION),
                         OverwriteFile(path="/app/solution.py", content=CHECKER),
                         CheckCalls(entry_point="answer")),
        tests=(CallTest(args="[]", expected=json.dumps(str(value))),),
        reference_solution=str(value),
        metadata={"ops": ops, "first_operand": first},
    )


def trivial_answers(spec: TaskSpec) -> list[str]:
    numbers = re.findall(r"\d+", spec.prompt)
    return ["", "0", "1", "-1", numbers[0] if numbers else "2", spec.prompt.strip()]


def curriculum(step: int, total: int, max_difficulty: int) -> list[float]:
    """A window moving from easy to hard: weight peaks at the difficulty matching progress."""
    t = step / max(total - 1, 1)
    centre = 1 + t * (max_difficulty - 1)
    return [1.0 / (1.0 + abs(d - centre)) for d in range(1, max_difficulty + 1)]


def observe(spec: TaskSpec, feedback: dict | None, metrics: dict | None) -> str:
    """Wrong, or not a bare integer; never the expected value (the one test's expected value is the answer)."""
    if feedback is None:
        return "Empty answer."
    details = [t.get("detail") or "" for t in feedback.get("failed_tests") or []]
    if not details:
        return "Timed out." if feedback.get("timed_out") else "Failed."
    got = re.search(r", got (.*)$", details[0], re.S)
    if got is None or got.group(1).startswith(("null", "no result")):
        return "Not a bare integer."
    shown = got.group(1)
    return f"Wrong: {json.loads(shown) if shown.startswith(chr(34)) else shown} is not the answer."


def reprompt(spec: TaskSpec) -> str:
    return "Answer with the integer only.\n"


register_family("arithmetic", config=Config, generate=generate, trivial_answers=trivial_answers, curriculum=curriculum,
                observe=observe, reprompt=reprompt)
