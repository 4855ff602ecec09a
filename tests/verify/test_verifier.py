"""run_command verification: pytest and script tasks built here, run in the real sandbox.

    .venv/bin/pytest tests/verify/test_verifier.py -q
"""

import sys

import polars as pl
import pytest

from envs.spec import COMPLETION, CallTest, CheckCalls, OverwriteFile, RewardLogic, RunCommand, TaskSpec
from ratchet.config import RewardConfig
from ratchet.reward import score
from ratchet.reward.metrics import penalised_flags
from ratchet.sandbox.model import Limits
from ratchet.verify import verify_many
from ratchet.verify.commands import json_report_counts, parse_command, pytest_counts, pytest_report
from ratchet.data.schemas import METRICS
from ratchet.verify.verifier import Plan, _call_detail, _command_passed, _raised_calls
from ratchet.sandbox import Payload, RunResult
from ratchet.sandbox.harness import MARK
from ratchet.sandbox.host import host_python

TEST_A = "from solution import f\n\n\ndef test_one():\n    assert f(1) == 2\n\n\ndef test_two():\n    assert f(5) == 6\n"
TEST_B = "from solution import f\n\n\ndef test_three():\n    assert f(-1) == 0\n"
CHECK = "from solution import f\nassert f(1) == 2 and f(5) == 6, 'wrong'\nprint('ok')\n"
GOOD, HALF, BROKEN = "def f(x):\n    return x + 1\n", "def f(x):\n    return 2 if x == 1 else 0\n", "def f(x:\n"

LIMITS = Limits(wall_s=60, cpu_s=30, memory_mb=1024)      # generous: a loaded 2-core machine; limits are not what is tested


def task(command, task_id="pyt", **kw):
    return TaskSpec(task_id=task_id, family="cmd", prompt="# add one\ndef f(x):\n",
                    execution_steps=(OverwriteFile(path="/app/solution.py", content=COMPLETION), RunCommand(command=command)),
                    test_files={"tests/test_a.py": TEST_A, "tests/test_b.py": TEST_B, "check.py": CHECK},
                    reference_solution=GOOD, **kw)


PYTEST = task("pytest -q /app/tests/ --json-report")
SCRIPT = task("python check.py", task_id="script")


@pytest.fixture(scope="module")
def runs():
    """Every sandbox run of this module in one wave (each pytest run costs ~0.3-1 s on 2 cores)."""
    items = [(PYTEST, GOOD), (PYTEST, HALF), (PYTEST, BROKEN), (SCRIPT, GOOD), (SCRIPT, HALF)]
    return dict(zip(["pytest_good", "pytest_half", "pytest_broken", "script_good", "script_half"], verify_many(items, LIMITS)))


# --- commands -> the sandbox's line ----------------------------------------------------------------------

@pytest.mark.parametrize("command, expected", [
    ("pytest -q /app/tests/ --json-report", ("pytest", "python3 -m pytest -q tests/")),
    ("python -m pytest tests --rootdir=/app", ("pytest", "python -m pytest tests --rootdir=.")),
    ("python3.11 /app/check.py --n 3", ("shell", "python3.11 /app/check.py --n 3")),     # /app is the workdir
    ("make test", ("shell", "make test")),
])
def test_parse_command_kinds(command, expected):
    cmd = parse_command(command)
    assert (cmd.kind, cmd.line) == expected


@pytest.mark.parametrize("command", ["   ", "echo 'unclosed"])
def test_unparseable_commands_are_named(command):
    with pytest.raises(ValueError, match="run_command"):
        parse_command(command)


# --- pytest output -> counts --------------------------------------------------------------------------

@pytest.mark.parametrize("stdout, counts", [
    ("..F\n2 passed, 1 failed in 0.12s\n", {"passed": 2, "failed": 1, "errors": 0}),
    ("x\n===== 1 failed, 3 passed, 2 warnings in 1.01s =====\n", {"passed": 3, "failed": 1, "errors": 0}),
    ("ERROR tests/test_a.py\n!!! Interrupted: 2 errors during collection !!!\n2 errors in 0.09s\n",
     {"passed": 0, "failed": 0, "errors": 2}),
    ("\nno tests ran in 0.01s\n", {"passed": 0, "failed": 0, "errors": 0}),
    # killed before the summary: the -rA outcome lines (each test once)
    ("PASSED tests/t.py::a\nFAILED tests/t.py::b - assert\nPASSED tests/t.py::c\n", {"passed": 2, "failed": 1, "errors": 0}),
])
def test_pytest_counts(stdout, counts):
    assert pytest_counts(stdout) == counts


def test_json_report_counts():
    report = '{"created": 1.0, "summary": {"passed": 4, "failed": 1, "error": 1, "total": 6}}'
    assert json_report_counts("noise\n" + report + "\n") == {"passed": 4, "failed": 1, "errors": 1}
    assert json_report_counts("3 passed in 0.1s") is None
    # printed on stdout it is not trusted: stdout is parsed as pytest's terminal output only
    assert pytest_counts(report + "\n1 failed in 0.1s\n") == {"passed": 0, "failed": 1, "errors": 0}


@pytest.mark.parametrize("stdout, coherent", [
    ("PASSED t.py::a\nFAILED t.py::b - x\n1 failed, 1 passed in 0.1s\n", True),
    ("PASSED t.py::a\nERROR t.py::a - teardown\n1 passed, 1 error in 0.1s\n", True),     # error at teardown
    ("PASSED t.py::a\nFAILED t.py::b - x\n1 failed, 1 passed in 0.1s\n==== 2 passed in 0.1s ====\n", False),
    ("FAILED t.py::a - x\nPASSED t.py::a\n1 passed in 0.1s\n", False),
])
def test_pytest_report_coherence(stdout, coherent):
    assert pytest_report(stdout)[1] is coherent


def test_pytest_counts_none_without_a_report():
    assert pytest_counts("Traceback ...\nSegmentation fault\n") is None


def test_a_summary_count_too_long_to_be_real_counts_nothing():
    """int() refuses a string of over 4300 digits: a summary line an answer printed with one raised out of
    verify_many. A count of more than 9 digits is no count (no real run has a billion tests)."""
    zero = {"passed": 0, "failed": 0, "errors": 0}
    assert pytest_counts("1" * 5000 + " passed in 0.01s\n") == zero
    assert pytest_counts("2 passed in 0.1s " + "9" * 5000 + " failed\n") == {**zero, "passed": 2}
    assert pytest_counts("=== 123456789 passed in 0.1s ===\n") == {**zero, "passed": 123456789}


# --- real runs --------------------------------------------------------------------------------------------

def test_pytest_task_counts_tests(runs):
    good, half, broken = runs["pytest_good"].metrics, runs["pytest_half"].metrics, runs["pytest_broken"].metrics
    assert (good["tests_passed"], good["tests_total"], good["test_pass_rate"]) == (3, 3, 1.0)
    # HALF: f(1) == 2 passes; f(5) == 6 fails; f(-1) == 0 passes -> 2 of 3
    assert (half["tests_passed"], half["tests_total"]) == (2, 3) and half["test_pass_rate"] == pytest.approx(2 / 3)
    # a syntax error: both test files fail to collect -> 0 of 2 errors
    assert (broken["tests_passed"], broken["test_pass_rate"], broken["syntax_ok"], broken["format_ok"]) == (0, 0.0, False, False)
    for v in runs.values():
        assert not v.env_error and v.metrics["timed_out"] is False and v.metrics["execution_time_ms"] > 0
    # pytest's own process spawns / cache writes are reported, not penalised: full pass scores 1.0
    assert score(good, RewardLogic(), RewardConfig()) == 1.0
    assert score(half, RewardLogic(), RewardConfig()) == pytest.approx(2 / 3)


def test_script_task_passes_on_exit_zero(runs):
    assert runs["script_good"].metrics["test_pass_rate"] == 1.0 and runs["script_good"].metrics["tests_total"] == 1
    assert runs["script_half"].metrics["test_pass_rate"] == 0.0 and runs["script_half"].metrics["tests_passed"] == 0


def test_runtime_python_is_used():
    seen = []

    def resolver(env):
        seen.append(env)
        return host_python()

    [a, b] = verify_many([(PYTEST, GOOD), (SCRIPT, HALF)], LIMITS, runtime_python=resolver)
    assert (a.metrics["tests_passed"], b.metrics["tests_passed"]) == (3, 0)
    assert seen == [PYTEST.environment_config]        # resolved once per environment per call


def test_runtime_without_pytest_is_an_env_error():
    [v] = verify_many([(PYTEST, GOOD)], LIMITS, runtime_python=lambda env: "/usr/bin/python3")
    assert v.env_error and v.env_error_kind == "runtime: pytest is not installed for /usr/bin/python3"


def test_runtime_python_can_be_a_venv():
    [v] = verify_many([(PYTEST, GOOD)], LIMITS, runtime_python=lambda env: sys.executable)
    assert not v.env_error and v.metrics["tests_passed"] == 3


def test_misconfigured_task_is_an_env_error_not_a_model_failure():
    two_steps = PYTEST.model_copy(update={"task_id": "two", "execution_steps": (*PYTEST.execution_steps, CheckCalls(entry_point="f"))})
    unclosed = task("python 'check.py", task_id="unclosed")
    [a, b] = verify_many([(two_steps, GOOD), (unclosed, GOOD)], LIMITS)
    assert a.env_error and a.env_error_kind.startswith("task: task two: expected exactly one check_calls or run_command")
    assert b.env_error and "cannot parse the command line" in b.env_error_kind


def _result(stdout, exit_code, killed_by=None):
    return RunResult(exit_code=exit_code, signal=None, killed_by=killed_by, timed_out=killed_by == "wall", stdout=stdout,
                     stderr="", truncated=False, wall_ms=1.0, cpu_ms=1.0, peak_memory_mb=1.0)


@pytest.mark.parametrize("stdout, exit_code, expected", [
    ("PASSED t.py::a\nFAILED t.py::b - x\n1 failed, 1 passed in 0.1s\n", 1, (1, 2, [])),
    ("PASSED t.py::a\n1 passed in 0.1s\n", 0, (1, 1, [])),
    ("SKIPPED [1] t.py:3: no numpy\n1 skipped in 0.1s\n", 0, (0, 0, [])),       # all skipped: exit 0, nothing ran
    ("\nno tests ran in 0.01s\n", 5, (0, 0, [])),
    ("PASSED t.py::a\n1 passed in 0.1s\n", 1, (0, 1, ["inconsistent_test_report"])),           # passed, yet exit 1
    ("FAILED t.py::a - x\n1 failed in 0.1s\n", 0, (0, 1, ["inconsistent_test_report"])),       # failed, yet exit 0
    ("PASSED t.py::a\n", None, (1, 1, [])),                                                   # killed before the summary
    ("Traceback (most recent call last):\n", 1, (0, 0, [])),
])
def test_command_passed_checks_the_exit_code(stdout, exit_code, expected):
    p = Plan(Payload(argv=("-m", "pytest")), "pytest")
    killed = "wall" if exit_code is None else None
    assert _command_passed(p, _result(stdout, exit_code, killed)) == expected


def test_script_passes_only_on_clean_exit():
    p = Plan(Payload(program=("/bin/sh", "-c", "python check.py")), "shell", command=parse_command("python check.py"))
    assert _command_passed(p, _result("", 0)) == (1, 1, [])
    assert _command_passed(p, _result("", 1)) == (0, 1, [])
    assert _command_passed(p, _result("", 0, killed_by="output")) == (0, 1, [])


@pytest.mark.parametrize("line", ["cd /app && python -m pytest -q tests/", "python -m pytest tests/ | tail -3"])
def test_a_line_that_runs_pytest_without_its_counts_passes_nothing(line):
    """An answer that ends pytest before its summary (os._exit(0) at import) leaves no counts; the line's exit
    code is then the answer's own or tail's: it says nothing of the tests. Scored as a lone pytest is: 0."""
    p = Plan(Payload(program=("/bin/sh",)), "shell", command=parse_command(line))
    assert _command_passed(p, _result("", 0)) == (0, 0, [])
    assert _command_passed(p, _result("PASSED tests/t.py::a\n1 passed in 0.1s\n", 0)) == (1, 1, [])


def test_metrics_fit_the_trajectory_schema(runs):
    fields = set(METRICS.to_schema())
    assert all(set(v.metrics) == fields for v in runs.values())
    series = pl.Series("metrics", [v.metrics or None for v in runs.values()], dtype=METRICS)
    assert series.struct.field("tests_passed").to_list() == [3, 2, 0, 1, 0]


def test_a_long_call_detail_keeps_what_the_call_got():
    assert _call_detail("[1]", "2", "3") == "args [1]: expected 2, got 3"             # short: whole
    got = "no result (the call never ran)"
    cut = _call_detail(str(list(range(300))), "7", got)                                # long args: cut there,
    assert len(cut) == 300 and cut.startswith("args [0, 1, 2") and cut.endswith("...]: expected 7, got " + got)
    assert _call_detail("x" * 400, "7", got).endswith("x...: expected 7, got " + got)     # inside their brackets
    cut = _call_detail("[1]", "x" * 400, "y" * 400)                                    # long values: each cut
    assert len(cut) <= 300 and cut.startswith("args [1]: expected xxx") and cut.endswith("y...")


def test_raised_calls_read_only_call_numbers():
    """"²".isdigit() is true and int("²") raises: a result line the answer printed with it ended verify_many."""
    lines = [f"{MARK}\t\u00b2\t!x", f"{MARK}\t{'1' * 5000}\t!y", f"{MARK}\t3\t!ValueError: no"]
    assert _raised_calls("\n".join(lines) + "\n") == {3: "raised ValueError: no"}


def test_output_no_parser_can_read_fails_that_answer_flagged(monkeypatch):
    """The backstop behind the parsers' own guards: any exception while reading a run's output (which the
    answer wrote) is that answer's failure, flagged and penalised; never a raise out of verify_many (the
    whole wave, eval or audit) nor an env_error (which retries and excludes the group)."""
    import ratchet.verify.verifier as verifier

    def bug(*args, **kwargs):
        raise RuntimeError("a parser met output it could not read")
    monkeypatch.setattr(verifier, "same", bug)
    monkeypatch.setattr(verifier, "pytest_report", bug)
    calls = TaskSpec(task_id="calls", family="cmd", prompt="# add one\ndef f(x):\n", tests=(CallTest(args="[1]", expected="2"),),
                     execution_steps=(OverwriteFile(path="/app/solution.py", content=COMPLETION), CheckCalls(entry_point="f")),
                     reference_solution=GOOD)
    for v in verify_many([(calls, GOOD), (PYTEST, GOOD)], LIMITS):
        assert not v.env_error and not v.passed and v.metrics["tests_passed"] == 0
        assert penalised_flags(v.metrics["security_flags"]) == ["unparseable_result"]
        assert v.feedback["exit_code"] == 0 and v.feedback["failed_tests"] == []
