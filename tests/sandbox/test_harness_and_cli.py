"""The call harness (plain data out, compared outside) and the CLI, without a sandbox where
possible: the harness's program also runs under a plain interpreter."""
import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from ratchet.sandbox.cli import app
from ratchet.sandbox.harness import MARK, RAISED_MESSAGE_CHARS, call_harness, parse_harness_output

pytestmark = pytest.mark.timeout(60)


def _run_plain(code: str) -> str:
    return subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=30).stdout


def test_harness_encodes_plain_data_and_types():
    comp = "def f(x):\n    return x\n"
    args = ['[1]', '[[1, 2]]', '[{"a": [true, null]}]', '[1.5]', '["é"]', "[(1, 2)]", "[{3, 1}]"]
    got = parse_harness_output(_run_plain(call_harness(comp, "f", args)))
    assert got == ["1", "[1,2]", '{"$dict":[["\\"a\\"",[true,null]]]}'.replace('"\\"a\\""', '"a"'), "1.5",
                   '"\\u00e9"', '{"$tuple":[1,2]}', '{"$set":[1,3]}']


def test_harness_defeats_eq_and_subclass_tricks():
    comp = ("class A:\n    def __eq__(s, o): return True\n"
            "class S(str):\n    def __eq__(s, o): return True\n    def __str__(s): return 'forged'\n"
            "def f(k):\n    return {'obj': A(), 'str': S('real'), 'raise': None}[k] if k != 'raise' else 1 / 0\n")
    got = parse_harness_output(_run_plain(call_harness(comp, "f", ['["obj"]', '["str"]', '["raise"]'])))
    assert got == [None, '"real"', None]


def test_harness_completion_that_does_not_import():
    out = _run_plain(call_harness("def f(:\n", "f", ["[1]", "[2]"]))
    assert parse_harness_output(out, n=2) == [None, None]


def _run_plain_both(code: str) -> tuple[str, str]:
    res = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=30)
    return res.stdout, res.stderr


def test_harness_says_why_a_call_raised_on_one_cut_line():
    comp = ("class Loud(Exception):\n    def __str__(s): raise RuntimeError\n"
            "def f(k):\n    if k == 1: return [][1]\n    if k == 2: raise ValueError('a\\nb\\t' + 'x' * 500)\n"
            "    if k == 3: raise Loud()\n    raise KeyError\n")
    out = _run_plain(call_harness(comp, "f", ["[1]", "[2]", "[3]", "[4]"]))
    lines = [ln.split("\t", 2)[2] for ln in out.splitlines() if ln.startswith(MARK + "\t") and ln.split("\t")[1].isdigit()]
    assert lines[0] == "!IndexError: list index out of range"
    assert lines[1] == f"!ValueError: a b {'x' * (RAISED_MESSAGE_CHARS - 4)}..."     # one line, tabs too
    assert lines[2:] == ["!Loud", "!KeyError"]          # a message that cannot be read, an empty one: the type
    assert parse_harness_output(out) == [None] * 4


def test_harness_traceback_shows_the_answers_line_not_the_harness():
    comp = "def f(x):\n    return x\n\nvalue = {}['missing']\n"
    out, err = _run_plain_both(call_harness(comp, "f", ["[1]"]))
    assert parse_harness_output(out, n=1) == [None]
    lines = err.splitlines()        # (a caret line under the code, or none, depending on Python's version)
    assert lines[:3] == ["Traceback (most recent call last):", '  File "solution.py", line 4, in <module>',
                         "    value = {}['missing']"] and lines[-1] == "KeyError: 'missing'"
    assert err.count("File ") == 1                      # the harness's own frame is not shown


def test_harness_fills_its_template_once():
    comp = "ARGS_ = 'ENTRY_'\ndef f(x):\n    return [ARGS_, 'MARK_', 'COMPLETION_', 'MSG_', x]\n"
    got = parse_harness_output(_run_plain(call_harness(comp, "f", ['["ENTRY_"]'])))
    assert got == ['["ENTRY_","MARK_","COMPLETION_","MSG_","ENTRY_"]']


def test_harness_last_line_wins_over_forged_lines():
    comp = f"print({MARK!r} + '\\t0\\t42')\ndef f():\n    print({MARK!r} + '\\t1\\t99')\n    return 7\n"
    assert parse_harness_output(_run_plain(call_harness(comp, "f", ["[]", "[]"]))) == ["7", "7"]


def test_cli_run_and_doctor(tmp_path):
    f = tmp_path / "hello.py"
    f.write_text("print('hello from the sandbox')\n")
    runner = CliRunner()
    res = runner.invoke(app, ["run", str(f), "--timeout", "5", "--json"])
    assert res.exit_code == 0, res.output
    body = json.loads(res.output)
    assert body["stdout"] == "hello from the sandbox\n" and body["ok"] is True
    res = runner.invoke(app, ["doctor"])
    assert res.exit_code == 0 and "backend:" in res.output and "pids" in res.output


@pytest.mark.timeout(30)
def test_cli_exit_code_follows_payload(tmp_path):
    f = tmp_path / "fail.py"
    f.write_text("import sys; sys.exit(4)\n")
    res = CliRunner().invoke(app, ["run", str(f)])
    assert res.exit_code == 4
