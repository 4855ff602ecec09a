"""run_command runs any command line (`/bin/sh -c`) in the real sandbox: pipelines, make targets,
report files (JUnit XML, a pytest-json document), exit codes; a runtime the worker lacks and a
dependency set that cannot be installed are env_errors naming them, never model failures.

    .venv/bin/python -m pytest tests/verify/test_commands_any.py -q
"""

import json

import pytest

from envs.runtime import RuntimeUnavailable, available_runtimes, ensure_runtimes, env_key, resolve
from envs.spec import COMPLETION, EnvironmentConfig, OverwriteFile, Report, RunCommand, TaskSpec
from ratchet.reward import score
from ratchet.config import RewardConfig
from ratchet.sandbox import Limits
from ratchet.store import open_store
from ratchet.verify import verify_many
from ratchet.verify.commands import parse_command, report_counts, split_report, REPORT_MARK

TESTS = {
    "tests/test_a.py": "from solution import f\n\n\ndef test_one():\n    assert f(1) == 2\n\n\ndef test_two():\n    assert f(5) == 6\n",
    "tests/test_b.py": "from solution import f\n\n\ndef test_three():\n    assert f(-1) == 0\n",
}
GOOD, HALF = "def f(x):\n    return x + 1\n", "def f(x):\n    return 2 if x == 1 else 0\n"
MAKEFILE = "check:\n\tpython3 -c 'from solution import f; assert [f(1), f(5), f(-1)] == [2, 6, 0]'\n\t@echo checked\n"
# a hand-written runner that writes a pytest-json-report style document
RUNNER = '''import json
from solution import f
tests = [("one", f(1) == 2), ("two", f(5) == 6), ("three", f(-1) == 0)]
ok = sum(r for _, r in tests)
json.dump({"summary": {"passed": ok, "failed": len(tests) - ok, "total": len(tests)},
           "tests": [{"nodeid": n, "outcome": "passed" if r else "failed"} for n, r in tests]}, open("out/report.json", "w"))
'''
SUM = "import sys\nprint(sum(int(w) for w in sys.stdin.read().split()))\n"   # the pipeline task's reference
# after pytest's real run (and its junit file), rewrite the report to say everything passed
FORGE_XML = '''import atexit
def forge():
    open("report.xml", "w").write('<testsuite><testcase name="a"/><testcase name="b"/><testcase name="c"/></testsuite>')
atexit.register(forge)
def f(x):
    return x + 1 if x == 1 else -100
'''


def task(command, task_id, files=None, test_files=None, report=None, env=None, path="/app/solution.py"):
    return TaskSpec(task_id=task_id, family="cmd", prompt="# add one\ndef f(x):\n",
                    execution_steps=(OverwriteFile(path=path, content=COMPLETION), RunCommand(command=command, report=report)),
                    files=files or {}, test_files=TESTS if test_files is None else test_files,
                    environment_config=env or EnvironmentConfig(), reference_solution=GOOD)


PIPE = task("printf '3 4\\n' | python solution.py | grep -qx 7", "pipe", test_files={}, path="/app/solution.py")
MAKE = task("cd /app && make -s check", "make", test_files={"Makefile": MAKEFILE})
JUNIT = task("pytest -q /app/tests/ --junitxml=/app/report.xml", "junit", report=Report(path="/app/report.xml", format="junit"))
# shell lines: pytest's output thrown away, so the counts can only come from the report file; and a
# line that fails after a full pass
JUNIT_QUIET = task("python -m pytest -q tests --junitxml=report.xml > /dev/null", "junit_quiet",
                   report=Report(path="report.xml", format="junit"))
JUNIT_AND = task("python -m pytest -q tests --junitxml=report.xml && false", "junit_and",
                 report=Report(path="report.xml", format="junit"))
RUNNER_JSON = task("mkdir -p out && python3 run_tests.py", "runner", test_files={"run_tests.py": RUNNER},
                   report=Report(path="out/report.json", format="pytest-json"))
EXIT = task("python -c 'from solution import f; raise SystemExit(0 if f(5) == 6 else 3)'", "exit", test_files={})
LIMITS = Limits(wall_s=60, cpu_s=30, memory_mb=1024)      # generous: a loaded 2-core machine; limits are not what is tested
MISSING_REPORT = task("python -c 'import solution'", "no_report", test_files={}, report=Report(path="r.xml", format="junit"))


@pytest.fixture(scope="module")
def runs():
    """Every sandbox run of this module in one batch (a pytest run costs ~0.3-1 s on 2 cores)."""
    items = {"pipe_good": (PIPE, SUM), "pipe_bad": (PIPE, "print(12)\n"),
             "make_good": (MAKE, GOOD), "make_half": (MAKE, HALF),
             "junit_good": (JUNIT, GOOD), "junit_quiet_half": (JUNIT_QUIET, HALF), "junit_and_good": (JUNIT_AND, GOOD),
             "runner_good": (RUNNER_JSON, GOOD), "runner_half": (RUNNER_JSON, HALF),
             "exit_good": (EXIT, GOOD), "exit_half": (EXIT, HALF), "no_report": (MISSING_REPORT, GOOD),
             "forged_junit": (JUNIT, FORGE_XML)}
    return dict(zip(items, verify_many(list(items.values()), LIMITS)))


def counts(v):
    assert not v.env_error, v.env_error_kind
    return v.metrics["tests_passed"], v.metrics["tests_total"]


def test_shell_pipeline(runs):
    assert counts(runs["pipe_good"]) == (1, 1) and runs["pipe_good"].passed and runs["pipe_good"].metrics["exit_code"] == 0
    assert counts(runs["pipe_bad"]) == (0, 1) and runs["pipe_bad"].metrics["exit_code"] == 1      # grep -q found no 7


def test_makefile_target(runs):
    assert counts(runs["make_good"]) == (1, 1) and runs["make_good"].passed
    assert counts(runs["make_half"]) == (0, 1) and runs["make_half"].metrics["exit_code"] == 2     # make's failed recipe


def test_junit_report_file(runs):
    assert counts(runs["junit_good"]) == (3, 3) and runs["junit_good"].passed
    assert REPORT_MARK not in runs["junit_good"].feedback["stdout_tail"]          # the report's copy is not output
    # pytest's output went to /dev/null: the counts can only have come from report.xml (f(5) == 6 fails)
    assert counts(runs["junit_quiet_half"]) == (2, 3)
    # every test passed, then the line failed (`&& false`): one more failed check, so not passed
    assert counts(runs["junit_and_good"]) == (3, 4) and not runs["junit_and_good"].passed
    assert score(runs["junit_quiet_half"].metrics, JUNIT.reward_logic, RewardConfig()) == pytest.approx(2 / 3)


def test_json_report_written_by_a_script(runs):
    assert counts(runs["runner_good"]) == (3, 3) and runs["runner_good"].passed
    assert counts(runs["runner_half"]) == (2, 3)


def test_exit_code_only(runs):
    assert counts(runs["exit_good"]) == (1, 1) and runs["exit_good"].metrics["exit_code"] == 0
    assert counts(runs["exit_half"]) == (0, 1) and runs["exit_half"].metrics["exit_code"] == 3


def test_a_pipeline_may_keep_part_of_pytests_output():
    """`pytest ... | tail -2` keeps one outcome line and the summary: counted from the summary, not flagged
    (in a one-pytest line the same mismatch is a forged report)."""
    from ratchet.sandbox import Payload, RunResult
    from ratchet.verify.verifier import Plan, _command_passed
    out = "FAILED tests/test_a.py::test_two - assert 0 == 6\n1 failed, 2 passed in 0.1s\n"
    res = RunResult(exit_code=0, signal=None, killed_by=None, timed_out=False, stdout=out, stderr="", truncated=False,
                    wall_ms=1.0, cpu_ms=1.0, peak_memory_mb=1.0)
    line = parse_command("pytest -q tests | tail -2")
    assert _command_passed(Plan(Payload(program=("/bin/sh",)), "shell", command=line), res) == (2, 3, [])
    one = parse_command("pytest -q tests")
    res1 = RunResult(**{**res.__dict__, "exit_code": 1})
    assert _command_passed(Plan(Payload(program=("/bin/sh",)), "pytest", command=one), res1) == (0, 3, ["inconsistent_test_report"])


def test_missing_report_scores_nothing(runs):
    assert counts(runs["no_report"]) == (0, 0) and not runs["no_report"].passed


def test_report_contradicting_pytest_is_flagged(runs):
    v = runs["forged_junit"]
    assert v.metrics["tests_passed"] == 0 and "inconsistent_test_report" in v.metrics["security_flags"]


def test_unknown_runtime_is_a_named_env_error():
    spec = task("pytest -q tests", "py399", env=EnvironmentConfig(runtime="python3.99"))
    [v] = verify_many([(spec, GOOD)], LIMITS)
    assert v.env_error and not v.metrics
    assert "python3.99" in v.env_error_kind and "available here" in v.env_error_kind
    assert all(name in v.env_error_kind for name in available_runtimes())
    assert "Traceback" not in v.env_error_kind


def test_missing_program_is_an_env_error_decided_before_the_run():
    [v] = verify_many([(task("cd /app && nosuchtool --check | tail -1", "tool", test_files={}), GOOD)], LIMITS)
    assert v.env_error and v.env_error_kind.startswith("runtime: command not found: nosuchtool")


def test_json_report_plugin_missing_is_an_env_error():
    """pytest-json-report is not in this runtime: asking for --json-report is the task's environment's
    problem, decided on the host (a completion cannot fake it by printing pytest's usage error)."""
    from ratchet.sandbox.host import host_python
    from ratchet.verify.commands import _imports
    if _imports(host_python(), "pytest_jsonreport"):
        pytest.skip("pytest-json-report is installed in this runtime")
    spec = task("pytest -q tests --json-report --json-report-file=report.json", "jsonrep",
                report=Report(path="report.json", format="pytest-json"))
    [v] = verify_many([(spec, GOOD)], LIMITS)
    assert v.env_error and "pytest-json-report (--json-report) is not installed" in v.env_error_kind


MISSING = "/nonexistent/ratchet-missing-0.0-py3-none-any.whl"   # fails without any network


def test_failed_install_is_an_env_error_for_exactly_its_tasks(tmp_path):
    bad_env = EnvironmentConfig(dependencies=(MISSING,))
    bad, good = task("pytest -q tests", "bad", env=bad_env), task("pytest -q tests", "good")
    built = ensure_runtimes([bad, good, bad.model_copy(update={"task_id": "bad2"})], store=open_store(tmp_path / "store"),
                            root=tmp_path / "runtimes")
    assert set(built) == {env_key(bad_env), env_key(good.environment_config)}         # each distinct set once
    assert "cannot build runtime" in built[env_key(bad_env)].error and MISSING in built[env_key(bad_env)].error
    ok = built[env_key(good.environment_config)]
    assert ok.error is None and any(d.startswith("pytest==") for d in ok.freeze)
    manifest = json.loads((tmp_path / "store" / "envs" / "runtimes" / f"{env_key(bad_env)}.json").read_text())
    assert manifest["dependencies"] == [MISSING] and "cannot build runtime" in manifest["error"]
    rb, rg = verify_many([(bad, GOOD), (good, GOOD)], LIMITS,
                         runtime_python=lambda env: resolve(env, root=tmp_path / "runtimes"))
    assert rb.env_error and "cannot build runtime" in rb.env_error_kind and MISSING in rb.env_error_kind
    assert not rg.env_error and rg.passed


# --- parsing, no sandbox ----------------------------------------------------------------------------

@pytest.mark.parametrize("command, kind, line, programs", [
    ("pytest -q /app/tests/ --json-report", "pytest", "python3 -m pytest -q tests/", ("python3",)),
    ("python3.11 -m pytest tests --rootdir=/app", "pytest", "python3.11 -m pytest tests --rootdir=.", ("python3.11",)),
    ("cd /app && make test | tee log.txt", "shell", None, ("make", "tee")),
    ("X=1 python check.py 2>&1 >out.txt; echo done", "shell", None, ("python",)),
    ("f() { python run.py; }; f || exit 1", "shell", None, ("python",)),
    ("./run.sh && /usr/bin/env python3 x.py", "shell", None, ()),
])
def test_parse_command(command, kind, line, programs):
    cmd = parse_command(command)
    assert (cmd.kind, cmd.programs) == (kind, programs)
    assert cmd.line == (line if line is not None else command)


def test_parse_command_bad_line_is_named():
    with pytest.raises(ValueError, match="cannot parse"):
        parse_command("echo 'unclosed")


def test_report_counts():
    xml = (b'<testsuites><testsuite><testcase name="a"/><testcase name="b"><failure message="x"/></testcase>'
           b'<testcase name="c"><error/></testcase><testcase name="d"><skipped/></testcase></testsuite></testsuites>')
    assert report_counts(xml, "junit") == ({"passed": 1, "failed": 1, "errors": 1}, True)
    assert report_counts(b'<!DOCTYPE x [<!ENTITY a "b">]><testsuite/>', "junit") == (None, True)
    assert report_counts(b"not xml", "junit") == (None, True)
    doc = {"summary": {"passed": 2, "failed": 1}, "tests": [{"outcome": "passed"}] * 2 + [{"outcome": "failed"}]}
    assert report_counts(json.dumps(doc).encode(), "pytest-json") == ({"passed": 2, "failed": 1, "errors": 0}, True)
    doc["summary"]["passed"] = 3       # a summary that contradicts its own test list
    assert report_counts(json.dumps(doc).encode(), "pytest-json")[1] is False


def test_split_report_takes_the_last_marker():
    import base64
    import zlib
    body = base64.b64encode(zlib.compress(b"<testsuite/>")).decode()
    out, data = split_report(f"hello\n{REPORT_MARK}\tAAAA\nmore\n\n{REPORT_MARK}\t{body}\n")
    assert data == b"<testsuite/>" and REPORT_MARK in out and out.startswith("hello")
    assert split_report(f"x\n{REPORT_MARK}\t!missing\n")[1] is None
