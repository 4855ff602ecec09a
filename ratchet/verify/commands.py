"""`run_command` steps: a spec's shell command -> sandbox argv, and its output -> test counts.

    kind, argv = command_argv("pytest /app/tests/ -q")   # ("pytest", ("-m", "pytest", "tests/", "-q", "-rA", ...))
    counts, coherent = pytest_report(stdout)             # {"passed": 3, "failed": 1, "errors": 0}, True

Only Python commands run (the sandbox runs `python <argv>` with the task's interpreter):
`pytest ...`, `python -m pytest ...`, `python script.py ...`. Paths under `/app/` become
workdir-relative. `--json-report*` options are dropped: the report file would stay inside
the sandbox, and a runtime without the pytest-json-report plugin would fail on them (a
failure that is not the model's). The terminal output is parsed instead: `-rA` outcome lines
and the last summary line. (`json_report_counts` reads a pytest-json-report document, for a
report obtained outside the sandbox; one printed on stdout is not trusted, anyone can print it.)

Threat model. Covered: a completion that prints a fake summary (e.g. from an atexit hook
after pytest's real one) or fake outcome lines that contradict the real ones, or that exits
with a code that contradicts the report: it is credited nothing and flagged
`inconsistent_test_report`. Not covered: the completion runs inside pytest's own process, so
it can rewrite pytest's reporting before any line is printed (patch the terminal reporter)
and invent a coherent report. Tasks where that matters should use `check_calls`, whose
results are serialised inside the sandbox and compared outside it.
"""

from __future__ import annotations

import json
import re
import shlex

PYTEST_EXTRA = ("-rA", "-p", "no:cacheprovider")
"""Appended to every pytest command: per-test outcome lines, and no cache dir written into the workdir."""

_PYTHON = re.compile(r"(.*/)?python(\d+(\.\d+)*)?")
_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected|warnings?)\b")
_SUMMARY = re.compile(r"^=*\s*(no tests ran|(\d+ \w+(, )?)+)( in [\d.]+s.*)?\s*=*$")
_OUTCOME = re.compile(r"^(PASSED|FAILED|ERROR|XPASS|XFAIL|SKIPPED) (\S+)")


def _workdir_arg(word: str) -> str:
    """/app/tests/ -> tests/ ; --rootdir=/app -> --rootdir=."""
    if "=" in word and word.startswith("-"):
        opt, val = word.split("=", 1)
        return f"{opt}={_workdir_arg(val)}"
    if word in ("/app", "/app/"):
        return "."
    return word.removeprefix("/app/")


def command_argv(command: str) -> tuple[str, tuple[str, ...]]:
    """("pytest" | "script", argv after the interpreter) for a run_command; ValueError for other programs."""
    words = shlex.split(command)
    if not words:
        raise ValueError("run_command: empty command")
    if words[0] in ("pytest", "py.test"):
        words = ["-m", "pytest", *words[1:]]
    elif _PYTHON.fullmatch(words[0]):
        words = words[1:]
    else:
        raise ValueError(f"run_command {command!r}: only python and pytest commands are supported, not {words[0]!r}")
    if not words:
        raise ValueError(f"run_command {command!r}: nothing to run")
    words = [_workdir_arg(w) for w in words]
    if words[:2] == ["-m", "pytest"]:
        kept = [w for w in words if not w.startswith("--json-report")]
        return "pytest", (*kept, *PYTEST_EXTRA)
    return "script", tuple(words)


def _summary_counts(line: str) -> dict[str, int]:
    counts = {"passed": 0, "failed": 0, "errors": 0}
    for n, what in _COUNT.findall(line):
        if what in ("passed", "failed"):
            counts[what] += int(n)
        elif what in ("error", "errors"):
            counts["errors"] += int(n)
    return counts


def json_report_counts(text: str) -> dict[str, int] | None:
    """Counts from a pytest-json-report document ({"summary": {"passed", "failed", "error"}}) on one
    line of `text`, the last such line; None if there is none."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if not (line.startswith("{") and '"summary"' in line):
            continue
        try:
            summary = json.loads(line)["summary"]
        except (ValueError, KeyError, TypeError):
            continue
        if isinstance(summary, dict):
            return {"passed": int(summary.get("passed", 0)), "failed": int(summary.get("failed", 0)),
                    "errors": int(summary.get("error", 0))}
    return None


def outcome_counts(stdout: str) -> tuple[dict[str, int], bool] | None:
    """Counts of pytest's -rA outcome lines ("PASSED tests/t.py::a"), and whether they are
    coherent (no test both PASSED and FAILED); None when there are none."""
    seen: dict[str, set[str]] = {}
    counts = {"passed": 0, "failed": 0, "errors": 0}
    key = {"PASSED": "passed", "FAILED": "failed", "ERROR": "errors"}
    for line in stdout.splitlines():
        m = _OUTCOME.match(line.strip())
        if m and m.group(1) in key:
            counts[key[m.group(1)]] += 1
            seen.setdefault(m.group(2), set()).add(m.group(1))
    if not seen:
        return None
    return counts, not any({"PASSED", "FAILED"} <= outcomes for outcomes in seen.values())


def _last_summary(stdout: str) -> dict[str, int] | None:
    for line in reversed([ln.strip() for ln in stdout.splitlines()]):
        if _SUMMARY.match(line) and (" in " in line or line.startswith("=")):
            return _summary_counts(line)
    return None


def pytest_report(stdout: str) -> tuple[dict[str, int] | None, bool]:
    """({"passed", "failed", "errors"} or None, coherent) from pytest's output: the last summary
    line ("2 failed, 3 passed in 0.1s"), else the -rA outcome lines. Incoherent: the -rA lines
    contradict each other (a test both PASSED and FAILED) or the summary (a forged summary)."""
    summary, outcomes = _last_summary(stdout), outcome_counts(stdout)
    if outcomes is None:
        return summary, True
    lines, coherent = outcomes
    if summary is None:
        return lines, coherent
    return summary, coherent and summary == lines


def pytest_counts(stdout: str) -> dict[str, int] | None:
    """The counts of `pytest_report`, whether coherent or not."""
    return pytest_report(stdout)[0]
