"""Mutants of a reference solution, for the audit's mutation testing.

A task's hidden tests are only as good as the wrong answers they reject. `mutants()` makes
small wrong variants of the reference (operator swaps, off-by-one constants, flipped
comparisons, dropped statements) and the audit counts how many the tests kill.

Mutations are spliced into the *completion text* at the AST node's source position, so a
mutant is itself a completion: it runs through exactly the same execution steps as the
model's answers. The completion may be a fragment (a function body): it is parsed inside the
file it is written into (`prefix` + completion + `suffix`), and only nodes that lie wholly
inside the completion are mutated. A reference that is not Python (a shell script, a number)
gets text mutations: integer literals +-1 and dropped lines.

    mutants("    x = x + 3\\n    return x\\n", prefix="def f(x):\\n")
    # ['    x = (x - 3)\\n    return x\\n', '    x = x + 4\\n    return x\\n', ...]
"""

from __future__ import annotations

import ast
import random
import re

from envs.source import parse_python

_BINOP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult,
          ast.Div: ast.Mult, ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult, ast.BitAnd: ast.BitOr,
          ast.BitOr: ast.BitAnd, ast.LShift: ast.RShift, ast.RShift: ast.LShift}
_CMP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
        ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
_BOOL = {ast.And: ast.Or, ast.Or: ast.And}


def _edits(tree: ast.AST) -> list[tuple[ast.AST, str]]:
    """(node, replacement source) for every mutation point, in `ast.walk`'s breadth-first order: a
    statement's replacement by `pass` comes before the operator and constant edits inside it, so the
    first mutants that fail (what `ratchet.agent.wrong_attempts` takes) are mostly dropped statements."""
    skip: set[int] = set()
    for node in ast.walk(tree):   # f-string internals have unreliable positions: leave them
        if isinstance(node, ast.JoinedStr):
            skip.update(id(n) for n in ast.walk(node))
    out: list[tuple[ast.AST, str]] = []
    for node in ast.walk(tree):
        if id(node) in skip or not hasattr(node, "end_col_offset"):
            continue
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOP:
            new = ast.BinOp(left=node.left, op=_BINOP[type(node.op)](), right=node.right)
            out.append((node, f"({ast.unparse(new)})"))
        elif isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                if type(op) in _CMP:
                    ops = list(node.ops)
                    ops[i] = _CMP[type(op)]()
                    out.append((node, f"({ast.unparse(ast.Compare(node.left, ops, node.comparators))})"))
        elif isinstance(node, ast.BoolOp):
            out.append((node, f"({ast.unparse(ast.BoolOp(_BOOL[type(node.op)](), node.values))})"))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.Not)):
            out.append((node, f"({ast.unparse(node.operand)})"))
        elif isinstance(node, ast.Constant) and type(node.value) is bool:
            out.append((node, repr(not node.value)))
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            out += [(node, f"({node.value + 1})"), (node, f"({node.value - 1})")]
        elif isinstance(node, ast.stmt) and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                   ast.ClassDef, ast.Pass)):
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                continue  # a docstring
            out.append((node, "pass"))
    return out


def _offsets(text: bytes) -> list[int]:
    starts = [0]
    for i, b in enumerate(text):
        if b == 10:
            starts.append(i + 1)
    return starts


def python_mutants(completion: str, prefix: str = "", suffix: str = "") -> list[str] | None:
    """Mutated completions, or None if prefix + completion + suffix is not valid Python."""
    full = (prefix + completion + suffix).encode()
    tree = parse_python(full)
    if tree is None:
        return None
    lines = _offsets(full)
    lo, hi = len(prefix.encode()), len(prefix.encode()) + len(completion.encode())
    comp = completion.encode()
    out: list[str] = []
    for node, new in _edits(tree):
        s = lines[node.lineno - 1] + node.col_offset
        e = lines[node.end_lineno - 1] + node.end_col_offset
        if s < lo or e > hi:
            continue
        mutant = (comp[: s - lo] + new.encode() + comp[e - lo:]).decode(errors="replace")
        out.append(mutant)
    return out


def text_mutants(reference: str) -> list[str]:
    """Mutants of a non-Python reference: each integer literal +-1, each non-blank line dropped."""
    out = []
    for m in re.finditer(r"(?<![\w.-])\d+(?![\w.])", reference):   # not option flags like -1
        v = int(m.group())
        for nv in (v + 1, v - 1):
            out.append(reference[: m.start()] + str(nv) + reference[m.end():])
    lines = reference.splitlines(keepends=True)
    if len(lines) > 1:
        for i, line in enumerate(lines):
            if line.strip() and not line.lstrip().startswith("#"):
                out.append("".join(lines[:i] + lines[i + 1:]))
    return out


def mutants(reference: str, prefix: str = "", suffix: str = "", limit: int | None = 12,
            seed: str = "", python: bool | None = None) -> list[str]:
    """Distinct mutants of `reference` (never equal to it), at most `limit`, sampled
    deterministically from `seed`. python=None: try Python, else text mutations."""
    found = python_mutants(reference, prefix, suffix) if python is not False else None
    if found is None:
        found = text_mutants(reference)
    unique = [m for m in dict.fromkeys(found) if m != reference]
    if limit is not None and len(unique) > limit:
        picked = sorted(random.Random(f"mutants:{seed}").sample(range(len(unique)), limit))
        unique = [unique[i] for i in picked]
    return unique
