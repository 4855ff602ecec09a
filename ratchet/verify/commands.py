"""`run_command` steps: any command line -> one sandbox program, and what it printed or wrote -> test counts.

    cmd = parse_command("pytest /app/tests/ -q")        # Command(kind="pytest", line="python -m pytest tests/ -q", ...)
    cmd = parse_command("make test | tail -3")          # kind="shell", programs=("make", "tail")
    counts, coherent = pytest_report(stdout)            # {"passed": 3, "failed": 1, "errors": 0}, True
    counts, coherent = report_counts(data, "junit")     # from a report file the command wrote

A command line runs as `/bin/sh -c LINE` in the workdir (also reachable as /app, the spec's
layout), with PATH = the task runtime's bin directory, then /usr/local/bin:/usr/bin:/bin: so
`pytest`, `python`, `python3.X`, `make`, pipelines `a | b`, `&&` chains all work, under the same
limits and isolation as any run (no network). `PYTEST_ADDOPTS` adds `-rA -p no:cacheprovider`
to every pytest the line starts (per-test outcome lines; no cache written into the workdir).

Two kinds:
- "pytest": the line is one pytest command (`pytest ...`, `python -m pytest ...`, no shell
  operators). It runs as `python -m pytest ...` (so the workdir is on the import path, as a
  task's `from solution import f` expects), paths under `/app/` made workdir-relative. pytest's counts must agree with its
  own exit code (anti-forgery, below). Without a declared `pytest-json` report, `--json-report*`
  options are dropped (the terminal output is parsed instead; a runtime without the plugin would
  fail on them, a failure that is not the model's).
- "shell": anything else. Counts come from the declared report file, else from pytest's output
  if the line printed one, else, if the line does not run pytest, the exit code (passed 1 of 1 when
  it exits 0; a line that runs pytest and printed no counts passes nothing: its exit code may be
  the answer's own os._exit or the last program of a pipeline's). A line that exits
  non-zero although its report says every test passed failed elsewhere: that counts as one more
  failed test (tests_total + 1), so it never passes.

Report files (`RunCommand.report`: path + format "junit" | "pytest-json"): after the line ends,
a small reader (the runtime's python, -I -S) prints the file, zlib-compressed and base64-encoded,
after a marker on stdout; `split_report` takes the last such line back out. At most
`REPORT_MAX_BYTES` are read; a missing, oversized or malformed report scores nothing.

Before a run (`runtime_problem`), the programs at command positions of the line (`programs`)
must exist on the sandbox's PATH and the runtime must import pytest (and pytest_jsonreport when
`--json-report` is asked for): else the task gets an env_error naming what is missing. This is
decided on the host, never from the run's output, which the completion could forge.

Threat model. Covered: a completion that prints a fake summary (e.g. from an atexit hook after
pytest's real one) or fake outcome lines that contradict the real ones, or that exits with a code
that contradicts the report (pytest kind), or writes a report file that contradicts pytest's own
output or exit code (pytest kind): it is credited nothing and flagged `inconsistent_test_report`.
Not covered: the completion runs inside the processes of the line (pytest's, a script's), so it
can rewrite pytest's reporting before any line is printed, or write a coherent report file, and
invent a coherent result; in a "shell" line no exit code ties the counts down. Tasks where that
matters should use `check_calls`, whose results are serialised inside the sandbox and compared
outside it.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import re
import shlex
import subprocess
import xml.etree.ElementTree as ET
import zlib
from dataclasses import dataclass

PYTEST_EXTRA = ("-rA", "-p", "no:cacheprovider")
"""Added to every pytest run (PYTEST_ADDOPTS): per-test outcome lines, and no cache dir written into the workdir."""
REPORT_MAX_BYTES = 1 << 20
REPORT_MARK = "@@ratchet-report@@"
SH = "/bin/sh"

_PYTHON = re.compile(r"(.*/)?python(\d+(\.\d+)*)?")
# a count is a whole number of at most 9 digits: no real run has more tests, and int() refuses a string
# of over 4300 digits, which an answer may print
_COUNT = re.compile(r"(?<!\d)(\d{1,9}) (passed|failed|errors?|skipped|xfailed|xpassed|deselected|warnings?)\b")
_SUMMARY = re.compile(r"^=*\s*(no tests ran|(\d+ \w+(, )?)+)( in [\d.]+s.*)?\s*=*$")
_OUTCOME = re.compile(r"^(PASSED|FAILED|ERROR|XPASS|XFAIL|SKIPPED) (\S+)")
_ASSIGN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*", re.S)
_NAME = re.compile(r"[A-Za-z0-9_.+-]+")
_OPERATORS = {"|", "||", "&&", ";", "&", "(", ")", ";;", "|&", "{", "}", "!"}
_REDIRECTS = {"<", ">", ">>", "<<", "<<<", ">&", "<&", "&>", "&>>", ">|", "<>"}
_LEADS = {"if", "then", "else", "elif", "do", "while", "until", "exec", "command", "time", "nohup", "!"}
_SHELL_WORDS = set("""case esac fi done in for function select ! [[ ]] cd echo printf test [ exit export set
unset shift read eval exec true false pwd umask wait trap return break continue : . source alias ulimit type
command getopts hash times kill jobs fg bg local readonly""".split()) | _LEADS

# Runs after the line (python -I -S -c EMIT PATH CAP): the report file, compressed, after the marker.
_EMIT = f"""import base64, sys, zlib
try:
    with open(sys.argv[1], "rb") as f:
        data = f.read(int(sys.argv[2]) + 1)
    body = "!too-large" if len(data) > int(sys.argv[2]) else base64.b64encode(zlib.compress(data, 6)).decode()
except OSError:
    body = "!missing"
sys.stdout.write("\\n{REPORT_MARK}\\t" + body + "\\n")
"""
_WRAP = f'{SH} -c "$1"; rc=$?; "$2" -I -S -c "$3" "$4" "$5"; exit $rc'


@dataclass(frozen=True)
class Command:
    """A run_command line as the sandbox runs it."""

    kind: str                       # "pytest": one pytest command | "shell": any other line
    line: str                       # what /bin/sh -c runs
    programs: tuple[str, ...] = ()  # programs at command positions, checked on PATH before the run
    pytest: bool = False            # the line runs pytest (its module must be importable)
    json_report: bool = False       # the line asks pytest for --json-report (the plugin must be importable)


def _workdir_arg(word: str) -> str:
    """/app/tests/ -> tests/ ; --rootdir=/app -> --rootdir=."""
    if "=" in word and word.startswith("-"):
        opt, val = word.split("=", 1)
        return f"{opt}={_workdir_arg(val)}"
    if word in ("/app", "/app/"):
        return "."
    return word.removeprefix("/app/")


def _tokens(command: str) -> list[str]:
    lex = shlex.shlex(command.replace("\n", " ; "), posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    lex.commenters = ""
    try:
        return list(lex)
    except ValueError as e:
        raise ValueError(f"run_command {command!r}: cannot parse the command line ({e})") from None


def command_words(tokens: list[str]) -> list[str]:
    """The words at command positions (first word of each simple command), skipping assignments
    and the file names after redirections. A heuristic: what it cannot see is not pre-checked."""
    out, expect, skip_next = [], True, False
    for tok in tokens:
        if skip_next:
            skip_next = False
            continue
        if tok in _REDIRECTS:
            skip_next = True
            continue
        if tok in _OPERATORS:
            expect = True
            continue
        if expect and _ASSIGN.fullmatch(tok):
            continue
        if expect:
            out.append(tok)
            expect = tok in _LEADS
    return out


def _is_pytest(words: list[str]) -> bool:
    return bool(words) and (words[0] in ("pytest", "py.test") or (
        _PYTHON.fullmatch(words[0]) is not None and words[1:3] == ["-m", "pytest"]))


def parse_command(command: str, json_report: bool = False, python: str = "python3") -> Command:
    """The Command for a run_command line; ValueError (naming the line) if it cannot be parsed.
    `json_report`: the task declares a pytest-json report, so `--json-report*` options are kept.
    `python`: the runtime's interpreter, which runs a lone `pytest ...` as `python -m pytest ...`."""
    tokens = _tokens(command)
    if not tokens:
        raise ValueError("run_command: empty command")
    words = command_words(tokens)
    defined = {t for i, t in enumerate(tokens[:-1]) if tokens[i + 1] == "()" or tokens[i + 1:i + 3] == ["(", ")"]}   # f() {...}
    programs = tuple(dict.fromkeys(w for w in words if _NAME.fullmatch(w) and w not in _SHELL_WORDS and w not in defined))
    simple = not any(t in _OPERATORS or t in _REDIRECTS for t in tokens) and not any(c in command for c in "$`\n")
    uses_pytest = any(w in ("pytest", "py.test") for w in words) or "-m pytest" in " ".join(tokens)
    asks_json = any(t.startswith("--json-report") for t in tokens)
    if simple and _is_pytest(tokens):
        kept = [_workdir_arg(t) for t in tokens[1 if tokens[0] in ("pytest", "py.test") else 3:]
                if json_report or not t.startswith("--json-report")]
        exe = python if tokens[0] in ("pytest", "py.test") else tokens[0]
        needs = (exe,) if _NAME.fullmatch(exe) else ()
        return Command("pytest", shlex.join([exe, "-m", "pytest", *kept]), needs, True, json_report and asks_json)
    return Command("shell", command, programs, uses_pytest, asks_json)


def shell_program(cmd: Command, python: str, report_path: str | None) -> tuple[str, ...]:
    """The sandbox program for a command: `/bin/sh -c LINE`, or with a report file, LINE in a
    child shell followed by the reader of the report (`python`: the runtime's interpreter)."""
    line = f"exec {cmd.line}" if cmd.kind == "pytest" else cmd.line   # pytest is the run's process, as before
    if report_path is None:
        return (SH, "-c", line)
    return (SH, "-c", _WRAP, "sh", line, python, _EMIT, report_path, str(REPORT_MAX_BYTES))


def split_report(stdout: str) -> tuple[str, bytes | None]:
    """(stdout without the report line, the report's bytes or None) from a run with a report."""
    lines = stdout.split("\n")
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith(REPORT_MARK + "\t"):
            body = lines[i].split("\t", 1)[1].strip()
            rest = "\n".join(lines[:i - 1 if i and not lines[i - 1] else i] + lines[i + 1:])
            if body.startswith("!"):
                return rest, None
            try:
                return rest, zlib.decompress(base64.b64decode(body, validate=True))[:REPORT_MAX_BYTES]
            except (ValueError, zlib.error):
                return rest, None
    return stdout, None


# --- runtime checks (on the host, before any run) --------------------------------------------------

@functools.lru_cache(maxsize=256)
def _imports(python: str, module: str) -> bool:
    try:
        return subprocess.run([python, "-I", "-c", f"import {module}"], capture_output=True, timeout=60,
                              env={"PATH": "/usr/bin:/bin"}).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def runtime_problem(cmd: Command, python: str, path: str) -> str | None:
    """What the task's runtime lacks for `cmd` ("runtime: ..."), or None. `path`: the run's PATH."""
    dirs = [d for d in path.split(":") if d]
    missing = [p for p in cmd.programs if not any(os.access(os.path.join(d, p), os.X_OK) for d in dirs)]
    if missing:
        return f"runtime: command not found: {', '.join(missing)} (PATH {path})"
    if cmd.pytest and not _imports(python, "pytest"):
        return f"runtime: pytest is not installed for {python}"
    if cmd.json_report and not _imports(python, "pytest_jsonreport"):
        return f"runtime: pytest-json-report (--json-report) is not installed for {python}"
    return None


# --- counts ---------------------------------------------------------------------------------------

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
        if line.startswith("{") and '"summary"' in line:
            counts, _ = report_counts(line.encode(), "pytest-json")
            if counts is not None:
                return counts
    return None


def report_counts(data: bytes | None, fmt: str) -> tuple[dict[str, int] | None, bool]:
    """({"passed", "failed", "errors"} or None, coherent) from a report file's bytes.
    junit: counted from its <testcase> elements (failure / error / skipped children); a DOCTYPE is
    refused. pytest-json: its "summary", checked against its "tests" outcomes when it lists them."""
    if data is None:
        return None, True
    if fmt == "junit":
        if b"<!DOCTYPE" in data or b"<!ENTITY" in data:
            return None, True
        try:
            root = ET.fromstring(data)
        except ET.ParseError:
            return None, True
        counts = {"passed": 0, "failed": 0, "errors": 0}
        for case in root.iter("testcase"):
            tags = {child.tag for child in case}
            if "error" in tags:
                counts["errors"] += 1
            elif "failure" in tags:
                counts["failed"] += 1
            elif "skipped" not in tags:
                counts["passed"] += 1
        return counts, True
    try:
        doc = json.loads(data)
        summary = doc["summary"]
        counts = {"passed": int(summary.get("passed", 0)), "failed": int(summary.get("failed", 0)),
                  "errors": int(summary.get("error", 0))}
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None, True
    tests = doc.get("tests")
    if isinstance(tests, list) and all(isinstance(t, dict) for t in tests):
        listed = {k: 0 for k in counts}
        for t in tests:
            key = {"passed": "passed", "failed": "failed", "error": "errors"}.get(t.get("outcome"))
            if key:
                listed[key] += 1
        return counts, listed == counts
    return counts, True


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


def pytest_report(stdout: str, strict: bool = True) -> tuple[dict[str, int] | None, bool]:
    """({"passed", "failed", "errors"} or None, coherent) from pytest's output: the last summary
    line ("2 failed, 3 passed in 0.1s"), else the -rA outcome lines. Incoherent: the -rA lines
    contradict each other (a test both PASSED and FAILED) or, if `strict`, the summary (a forged
    summary). Not strict: for a shell line, whose pipeline may keep only part of the output."""
    summary, outcomes = _last_summary(stdout), outcome_counts(stdout)
    if outcomes is None:
        return summary, True
    lines, coherent = outcomes
    if summary is None:
        return lines, coherent
    return summary, coherent and (summary == lines or not strict)


def pytest_counts(stdout: str) -> dict[str, int] | None:
    """The counts of `pytest_report`, whether coherent or not."""
    return pytest_report(stdout)[0]
