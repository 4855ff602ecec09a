"""Reward-hacking guards that are decisions on specs and results (the sandbox-side guards live in
`ratchet.verify.verifier`: tests placed read-only after the completion, results compared outside).

    hidden_test_leaks(spec)      # ["hidden test 2 (f(3) -> 5) appears in the prompt", ...]; the audit quarantines such tasks (verdict "leaky_tests")
    special_cased(1.0, 0.2)      # True: flag "special_cased_examples"

Rules, each with a test that runs a real attempt (tests/verify/test_hacking.py):

- hidden tests never appear in the prompt: a hidden call test leaks when the prompt shows the
  call `entry(args)` followed (within 200 characters) by its expected value, in Python or JSON
  spelling; a hidden test file leaks when one of its assertion lines appears in the prompt; a
  hidden test whose args equal a visible example's is no held-out input and counts as leaked.
- special-casing the visible examples: a task may list visible examples in
  `metadata["visible_tests"]` (a list of {"args": JSON, "expected": JSON}, like CallTest). The
  verifier runs them next to the hidden tests; a completion that passes every visible example
  (visible pass rate = 1) but fewer than half the hidden ones (hidden pass rate < 0.5) is
  flagged `special_cased_examples` in `security_flags`. An honest solution that generalises
  passes the hidden tests as well as the visible ones; one that memorised the examples does not.
- an empty completion never scores > 0 (`is_empty`, applied in verify and in score_frame).
"""

from __future__ import annotations

import json
import re

from envs.spec import CallTest, CheckCalls, TaskSpec, for_task, visible_tests_of

SPECIAL_CASED = "special_cased_examples"
SPECIAL_CASED_MAX_HIDDEN = 0.5
_WINDOW = 200


def is_empty(completion: str | None) -> bool:
    """True for a completion with nothing but whitespace."""
    return not (completion or "").strip()


def special_cased(visible_pass_rate: float | None, hidden_pass_rate: float) -> bool:
    """The special-casing rule: visible pass rate == 1 and hidden pass rate < 0.5 (None: no visible examples)."""
    return visible_pass_rate is not None and visible_pass_rate >= 1.0 and hidden_pass_rate < SPECIAL_CASED_MAX_HIDDEN


def visible_tests(spec: TaskSpec) -> tuple[CallTest, ...]:
    """The task's visible examples, `metadata["visible_tests"]`, as CallTests (ValueError names a bad entry)."""
    return for_task(spec.task_id, visible_tests_of, spec.metadata, "metadata.")   # the schema's rule


def _squash(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _spellings(value: object) -> set[str]:
    return {repr(value), json.dumps(value), json.dumps(value, separators=(",", ":"))}


def _call_spellings(entry: str, args_json: str) -> set[str]:
    args = json.loads(args_json)
    args = args if isinstance(args, list) else [args]
    inner = {", ".join(repr(a) for a in args), ", ".join(json.dumps(a) for a in args),
             ",".join(json.dumps(a, separators=(",", ":")) for a in args)}
    return {f"{entry}({i})" for i in inner}


def _call_leaks(prompt: str, entry: str, test: CallTest) -> bool:
    expected = _spellings(json.loads(test.expected))
    for call in _call_spellings(entry, test.args):
        for m in re.finditer(re.escape(call), prompt):
            after = prompt[m.end(): m.end() + _WINDOW]
            if any(e in after for e in expected):
                return True
    return False


def _assert_lines(source: str) -> list[str]:
    return [_squash(ln.strip()) for ln in source.splitlines() if ln.strip().startswith("assert") and len(ln.strip()) >= 12]


def hidden_test_leaks(spec: TaskSpec) -> list[str]:
    """Why the spec's hidden tests are not hidden (empty list: they are); rules in the module docstring."""
    prompt = _squash(spec.prompt)
    entry = next((s.entry_point for s in spec.execution_steps if isinstance(s, CheckCalls)), None)
    visible_args = {json.dumps(json.loads(t.args)) for t in visible_tests(spec)}
    leaks = []
    for i, t in enumerate(spec.tests):
        if entry and _call_leaks(prompt, entry, t):
            leaks.append(f"hidden test {i} ({entry}{t.args} -> {t.expected}) appears in the prompt")
        if json.dumps(json.loads(t.args)) in visible_args:
            leaks.append(f"hidden test {i} repeats a visible example's args {t.args}: not a held-out input")
    for path, source in spec.test_files.items():
        for line in _assert_lines(source):
            if line in prompt:
                leaks.append(f"hidden test file {path}: line {line!r} appears in the prompt")
    return leaks
