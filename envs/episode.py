"""The episode protocol: what the model sees after an answer, so that it can revise it.

An episode is: the task's prompt -> the model answers -> the answer runs in the sandbox
(`ratchet.verify`, exactly as a single-turn answer) -> the verdict comes back as an
*observation* -> the model answers again ... until it passes, a turn limit or the context
limit (`ratchet/agent.py` runs it; `ratchet/rollout/episodes.py` samples it with KV reuse).

    body, again = observation_parts(spec, verification.feedback, verification.metrics)
    text = observation(spec, feedback, metrics)        # body + again

An observation is two parts: the *feedback* (what the sandbox said: tests passed of total,
which tests failed and how, the error tail; most useful first, so that a cut at a token
budget loses the least useful) and the *re-prompt* (what makes the next answer have the same
shape as the first; kept whole when the feedback is cut). Both are rendered from the
verifier's FEEDBACK struct and metrics (`ratchet/data/schemas.py`), never from the answer
itself, so any task is episodic without code of its own: every generated family and every
imported task works with the defaults here. A family may customise either part with the
`observe` and `reprompt` fields of its registration (`envs/registry.py`): bugfix shows the
failing hidden test, arithmetic says only whether its number was wrong. An observation never
shows the expected value of more than the first third of a task's hidden calls (SHOWN_EXPECTED).

Default re-prompt: "Revise your answer." and, when the answer continues a function header
(python_functions writes `prompt + answer`, a body after `def f(x):`; HumanEval likewise),
that header again, so the next answer is a body again.
"""

from __future__ import annotations

import ast
import re
import textwrap
from typing import Callable

from envs.registry import Family, get_family
from envs.source import parse_python
from envs.spec import COMPLETION, NEVER_RAN, CheckCalls, TaskSpec

REVISE = "Revise your answer.\n"
MAX_FAILED_SHOWN = 5      # failed tests listed in an observation (the rest are counted)
ERROR_LINES = 3           # lines of each output tail (stdout, stderr) shown
LINE_CHARS = 160          # one shown line at most


def family_of(spec: TaskSpec) -> Family | None:
    """The spec's registered family; None for imported tasks (or any family without a file)."""
    try:
        return get_family(spec.family)
    except KeyError:
        return None


def observation_parts(spec: TaskSpec, feedback: dict | None, metrics: dict | None) -> tuple[str, str]:
    """(feedback text, re-prompt) of the observation after an answer with this verdict; each
    ends with a newline. The family's `observe` / `reprompt` hooks win over the defaults."""
    family = family_of(spec)
    observe = family.observe if family is not None and family.observe is not None else feedback_text
    again = family.reprompt if family is not None and family.reprompt is not None else default_reprompt
    return _line_end(observe(spec, feedback, metrics)), _line_end(again(spec))


def repeats(action: str | None, before: str | None) -> bool:
    """Whether an answer repeats the answer before it, leading and trailing whitespace aside: on a
    deterministic task it gets the same verdict, so a repeat of a failed answer is a turn spent."""
    return (action or "").strip() == (before or "").strip()


def observation(spec: TaskSpec, feedback: dict | None, metrics: dict | None) -> str:
    """What the model sees after an answer: the sandbox's verdict, then the re-prompt."""
    body, again = observation_parts(spec, feedback, metrics)
    return body + again


def feedback_text(spec: TaskSpec, feedback: dict | None, metrics: dict | None,
                  describe: Callable[[dict], str] | None = None) -> str:
    """The default feedback: a summary line (tests passed of total, timed out / killed), the
    first failed test, the error tail (the output's last lines: pytest's `E` lines, what a
    script printed, stderr's last lines), then the other failed tests (MAX_FAILED_SHOWN at
    most). When the answer never ran (it does not parse, or no call got a result) its failed
    tests say nothing, so the error tail comes first, from its last line up: the exception,
    then the line it points at. `describe(failed_test)` renders one failed test ({"name",
    "detail"}); default `name: detail`, a check_calls call as `f(args): expected ..., got ...`."""
    lines = [_summary(feedback, metrics)]
    if feedback is None:
        return lines[0] + "\n"
    describe = describe or call_describer(spec)
    failed = _unique(list(feedback.get("failed_tests") or []))
    said = _unique([f"- {_cut(describe(t))}" for t in failed])   # two calls of the same args read alike: one line
    shown = said[:MAX_FAILED_SHOWN]
    if len(said) > MAX_FAILED_SHOWN:
        shown.append(f"- ... {len(said) - MAX_FAILED_SHOWN} more failed")
    tail = [_cut(ln) for ln in error_lines(feedback) if not any(ln in s for s in shown)]
    if _never_ran(spec, failed, metrics):
        return "\n".join(lines + tail[::-1] + shown) + "\n"
    return "\n".join(lines + shown[:1] + tail + shown[1:]) + "\n"


def _never_ran(spec: TaskSpec, failed: list[dict], metrics: dict | None) -> bool:
    """A Python answer that does not parse (`syntax_ok`; a shell answer is not parsed), or none of the
    failed calls got a result (the module did not load)."""
    return ((metrics or {}).get("syntax_ok") is False and spec.python_file() is not None) or (
        bool(failed) and all((t.get("detail") or "").endswith(NEVER_RAN) for t in failed))


def default_reprompt(spec: TaskSpec) -> str:
    """"Revise your answer." and, when the answer continues a function header, that header."""
    return REVISE + (continued_header(spec) or "")


def continued_header(spec: TaskSpec) -> str | None:
    """The `def ...:` line(s) the answer continues, when it is written into a .py file right
    after a function's signature (and docstring): the answer is that function's body."""
    step = spec.python_file()
    if step is None:
        return None
    lines = step.content.split(COMPLETION, 1)[0].splitlines(keepends=True)
    starts = [i for i, ln in enumerate(lines) if re.match(r"\s*(async\s+)?def\s", ln)]
    if not starts:
        return None
    i = starts[-1]
    j = next((k for k in range(i, len(lines)) if lines[k].split("#")[0].rstrip().endswith(":")), None)
    if j is None:
        return None
    return "".join(lines[i:j + 1]) if _docstring_only("".join(lines[j + 1:])) else None


def _docstring_only(text: str) -> bool:
    """Nothing but blank lines, comments and one docstring: a function whose body is yet to come."""
    tree = parse_python(textwrap.dedent(text))      # a task file's text (an imported task's: anything)
    if tree is None:
        return False
    body = tree.body
    return not body or (len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                        and isinstance(body[0].value.value, str))


def error_lines(feedback: dict) -> list[str]:
    """The output's most telling last lines: pytest's `E` lines (the assertion, the exception) or
    the last lines a script printed, then stderr's last lines (the exception of a traceback)."""
    stdout = feedback.get("stdout_tail") or ""
    if re.search(r"^={3,} .* ={3,}$", stdout, re.M):           # pytest's report: its `E` lines say why
        said = [ln[1:].strip() for ln in stdout.splitlines() if ln.startswith("E ")]
        out = _unique([ln for ln in said if not ln.startswith("+") and not re.fullmatch(r"[\s^~]*", ln)])[-ERROR_LINES:]
    else:
        out = _last_lines(stdout)
    return _unique(out + _last_lines(feedback.get("stderr_tail") or ""))


def _summary(feedback: dict | None, metrics: dict | None) -> str:
    if feedback is None:
        return "Nothing ran (empty answer)." if metrics is not None else "No result."
    parts = []
    if metrics and metrics.get("tests_total") is not None:
        parts.append(f"Tests: {metrics.get('tests_passed') or 0} of {metrics['tests_total']} passed.")
    if feedback.get("timed_out") or (metrics or {}).get("timed_out"):
        parts.append("Timed out.")
    elif feedback.get("killed_by"):
        parts.append(f"Killed by the {feedback['killed_by']} limit.")
    elif feedback.get("exit_code") not in (0, None) and not (metrics or {}).get("tests_total"):
        parts.append(f"Exit code {feedback['exit_code']}.")
    return " ".join(parts) or "Failed."


SHOWN_EXPECTED = 1 / 3
"""Of a task's hidden calls, the share whose expected value an observation may show: the first
floor(n / 3). A failed call past them shows what the answer gave, not what it should have: an
observation is not an answer key, so an answer that special-cases what it was shown still fails the
calls it was not shown (a task with one call, such as arithmetic's, shows none)."""


def call_describer(spec: TaskSpec) -> Callable[[dict], str]:
    """`f(3): expected 6, got 5` for a check_calls failure among the first SHOWN_EXPECTED of the
    hidden calls ("args [3]: expected 6, got 5"), `f(3): got 5, wrong` for the others; `test_x:
    assert 1 == 2` for pytest's ("FAILED: assert 1 == 2"); else `name: detail`."""
    entry = next((s.entry_point for s in spec.execution_steps if isinstance(s, CheckCalls)), None)
    shown = int(len(spec.tests) * SHOWN_EXPECTED)

    def describe(t: dict) -> str:
        name, detail = t.get("name") or "", t.get("detail") or ""
        m = re.match(r"args \[(.*)\]: expected (.*), got (.*)$", detail, re.S)
        if entry is not None and m and name.startswith("call "):
            index = int(name.split()[1]) if name.split()[1].isdigit() else len(spec.tests)
            if index < shown:
                return f"{entry}({m.group(1)}): expected {m.group(2)}, got {m.group(3)}"
            return f"{entry}({m.group(1)}): got {m.group(3)}, wrong"
        name = name.rsplit("::", 1)[-1]
        detail = re.sub(r"^(FAILED|ERROR): ", "", detail)
        return f"{name}: {detail}" if detail not in ("FAILED", "ERROR", "") else f"{name}: {detail.lower() or 'failed'}"
    return describe


def _last_lines(text: str) -> list[str]:
    """The last ERROR_LINES telling lines: not blank, not a cut marker, not a bare ^^^ pointer."""
    keep = [ln.strip() for ln in text.splitlines()
            if ln.strip() and not re.fullmatch(r"[\s^~]+", ln) and not re.match(r"\[\.\.\. \d+ bytes cut\]", ln)]
    return keep[-ERROR_LINES:]


def _unique(items: list) -> list:
    out = []
    for x in items:
        if x not in out:
            out.append(x)
    return out


def _cut(line: str) -> str:
    return line if len(line) <= LINE_CHARS else line[:LINE_CHARS - 3] + "..."


def _line_end(text: str) -> str:
    return text if not text or text.endswith("\n") else text + "\n"
