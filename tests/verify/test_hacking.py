"""Reward-hacking guards, each attacked for real through verify_many and the sandbox.

    .venv/bin/pytest tests/reward/test_hacking.py -q
"""

import json

import pytest

from envs.families.python_functions import Config, generate
from envs.spec import COMPLETION, CallTest, CheckCalls, OverwriteFile, RewardLogic, RewardRule, RunCommand, TaskSpec
from ratchet.config import RewardConfig
from ratchet.reward import score
from ratchet.sandbox.model import Limits
from ratchet.verify import verify_many
from ratchet.verify.guards import hidden_test_leaks, special_cased
from ratchet.verify.commands import pytest_counts
from ratchet.verify.verifier import build_payload, canonical
from ratchet.sandbox import Payload, run_many
from tests.sandbox.conftest import need_backend

CFG = RewardConfig()
NO_PENALTY = RewardConfig(security_penalty=None)
HIDDEN = tuple(CallTest(args=json.dumps([x]), expected=json.dumps(x + 1)) for x in (7, -3, 10, 0, 42, -8))
ADD_ONE = "def f(x):\n    return x + 1\n"

LIMITS = Limits(wall_s=60, cpu_s=30, memory_mb=1024)      # generous: a loaded 2-core machine; limits are not what is tested


def calls_task(prompt="# add one to x\ndef f(x):\n", tests=HIDDEN, task_id="add1", **kw):
    return TaskSpec(task_id=task_id, family="hack", prompt=prompt,
                    execution_steps=(OverwriteFile(path="/app/solution.py", content=COMPLETION), CheckCalls(entry_point="f")),
                    tests=tests, reference_solution=ADD_ONE, **kw)


# --- hidden tests never appear in the prompt ---------------------------------------------------------

def test_a_leaked_prompt_is_caught_and_is_what_a_hard_coder_exploits():
    leaky = calls_task(prompt="# add one to x, e.g. f(7) == 8 and f(-3) -> -2\ndef f(x):\n", task_id="leaky")
    assert hidden_test_leaks(leaky)
    assert hidden_test_leaks(leaky) == ["hidden test 0 (f[7] -> 8) appears in the prompt",
                                        "hidden test 1 (f[-3] -> -2) appears in the prompt"]
    assert not hidden_test_leaks(calls_task())
    # the attack the guard prevents: answers read off the prompt pass the leaked tests, and only those
    lookup = "def f(x):\n    return {7: 8, -3: -2}[x]\n"
    [v] = verify_many([(leaky, lookup)], LIMITS)
    assert v.metrics["tests_passed"] == 2


def test_leaks_in_test_files_and_repeated_visible_examples():
    files = calls_task(prompt="Make this pass:\n    assert f(10) == 11\n", test_files={"tests/test_f.py": "def test():\n    assert f(10) == 11\n"})
    assert any("tests/test_f.py" in why for why in hidden_test_leaks(files))
    repeated = calls_task(metadata={"visible_tests": [{"args": "[0]", "expected": "1"}]})
    assert hidden_test_leaks(repeated) == ["hidden test 3 repeats a visible example's args [0]: not a held-out input"]


def test_generated_tasks_do_not_leak():
    specs = [generate(Config(), seed=0, index=i, difficulty=1 + i % 3, split="train") for i in range(60)]
    assert [s.task_id for s in specs if hidden_test_leaks(s)] == []


# --- results are compared outside the sandbox ---------------------------------------------------------

LIARS = {
    "eq_always_true": "class Anything:\n    def __eq__(self, other): return True\n    __hash__ = object.__hash__\n"
                      "def f(x):\n    return Anything()\n",
    "int_subclass_lying_eq": "class Liar(int):\n    def __eq__(self, other): return True\n    def __ne__(self, other): return False\n"
                             "    __hash__ = int.__hash__\n    def __repr__(self): return 'whatever you expect'\n"
                             "def f(x):\n    return Liar(0)\n",
    "str_subclass": "class S(str):\n    def __eq__(self, o): return True\ndef f(x):\n    return S('8')\n",
    "patched_json": "import json\njson.dumps = lambda *a, **k: '8'\njson.loads = lambda s: 8\ndef f(x):\n    return None\n",
    "bool_for_int": "def f(x):\n    return True\n",   # expected 1 for x == 0: True is not 1 in JSON
}


def test_lying_objects_do_not_pass():
    spec = calls_task()
    results = verify_many([(spec, code) for code in LIARS.values()] + [(spec, ADD_ONE)], LIMITS)
    passed = {name: v.metrics["tests_passed"] for name, v in zip(LIARS, results)}
    assert passed == {name: 0 for name in LIARS}
    assert results[-1].metrics["tests_passed"] == 6         # the honest solution passes all six
    assert all(score(v.metrics, RewardLogic(), CFG) == 0.0 for v in results[:-1])


def test_an_answer_that_crashes_a_parser_fails_alone():
    """Parsing what the answer wrote or printed must not raise out of the verifier: 3,000 nested unary minuses
    (ast.parse: RecursionError) and a result line the answer printed itself, 20,000 brackets deep (json:
    RecursionError), once ended verify_many for the whole batch, the honest answer's verdict with it."""
    spec = calls_task()
    deep = "def f(x):\n    return " + "-" * 3000 + "x\n"
    forged = ("import os, sys\nprint('@@ratchet-harness@@\\t0\\t' + '[' * 20000 + ']' * 20000)\n"
              "sys.stdout.flush()\nos._exit(0)\n")
    results = verify_many([(spec, ADD_ONE), (spec, deep), (spec, forged)], LIMITS)
    assert [v.metrics["tests_passed"] for v in results] == [6, 0, 0]
    assert not any(v.env_error for v in results)


def test_answers_that_broke_the_verifier_fail_alone():
    """Four more answers that once raised out of verify_many, each now a plain wrong answer (not even the
    backstop's unparseable_result): an int beyond any float against a float under a tolerance; a result line
    numbered "²" (a digit to str.isdigit, not to int); a pytest summary of 5,000 digits; result lines nested
    just shallow enough for the harness parser's check and too deep one frame further in (a sweep of depths,
    as the stack depth here decides which). And one that was an env_error: a lone surrogate in the answer."""
    halves = calls_task(tests=tuple(CallTest(args=json.dumps([x]), expected=json.dumps(x / 2)) for x in (1, 3)),
                        metadata={"float_tolerance": 1e-6}, task_id="half")
    huge = "def f(x):\n    return 10 ** 400\n"
    superscript = "def f(x):\n    print('@@ratchet-harness@@\\t\\u00b2\\t!x')\n    return x\n"
    summary = ("import atexit, os\natexit.register(lambda: os.write(1, ('\\n' + '1' * 5000 + ' passed in 0.01s\\n').encode()))\n"
               "def f(x):\n    return x\n")
    depths = range(700, 1000)
    nested_task = calls_task(tests=tuple(CallTest(args=json.dumps([i]), expected=json.dumps(i + 1)) for i in range(len(depths))),
                             task_id="nested")
    nested = ("import os\ndef f(x):\n"
              f"    for i, d in enumerate({depths!r}):\n"
              "        os.write(1, ('@@ratchet-harness@@\\t%d\\t' % i + '[' * d + ']' * d + '\\n').encode())\n"
              "    os._exit(0)\n")
    surrogate = ADD_ONE + "# \ud800\n"
    items = [(calls_task(), ADD_ONE), (halves, huge), (calls_task(), superscript),
             (cmd_task("pytest -q tests/", "summary"), summary), (nested_task, nested),
             (calls_task(), surrogate), (cmd_task("pytest -q tests/", "surrogate"), surrogate)]
    results = verify_many(items, Limits(wall_s=60, cpu_s=30, memory_mb=1024, output_bytes=1 << 21))
    # the surrogate, in a comment: the harness compiles the answer's text, which has no UTF-8 (fails); pytest
    # imports the file, whose surrogatepass bytes Python lets pass in a comment
    assert [v.metrics["tests_passed"] for v in results] == [6, 0, 0, 0, 0, 0, 3]
    assert not any(v.env_error or "unparseable_result" in v.metrics["security_flags"] for v in results)


# --- the completion cannot modify the tests -----------------------------------------------------------

TESTS = {
    "tests/test_a.py": "from solution import f\n\n\ndef test_a():\n    assert f(1) == 2\n",
    "tests/test_b.py": "from solution import f\n\n\ndef test_b():\n    assert f(7) == 8\n\n\ndef test_c():\n    assert f(-1) == 0\n",
    "check.py": "import json\nfrom solution import f\nexpected = json.load(open('expected.json'))\n"
                "assert all(f(int(k)) == v for k, v in expected.items()), 'wrong'\n",
    "expected.json": json.dumps({"1": 2, "7": 8, "-1": 0}),
}
# Runs on import, i.e. after the tests were placed: rewrite every test to pass, delete what it can,
# plant a conftest; then answer wrongly.
TAMPER = '''
import os, glob, json
def overwrite(p):
    open(p, "w").write("def test_ok():\\n    pass\\n")
def chmod_then_overwrite(p):
    os.chmod(p, 0o666)
    overwrite(p)
for p in glob.glob("tests/*.py") + ["check.py"]:
    for attempt in (overwrite, chmod_then_overwrite, os.remove):
        try:
            attempt(p)
            break
        except OSError:
            pass
try:
    json.dump({"1": -100}, open("expected.json", "w"))
except OSError:
    pass
try:
    open("tests/conftest.py", "w").write("")
except OSError:
    pass
def f(x):
    return -100
'''


def cmd_task(command, task_id):
    return TaskSpec(task_id=task_id, family="hack", prompt="# add one\ndef f(x):\n", test_files=TESTS,
                    execution_steps=(OverwriteFile(path="/app/solution.py", content=COMPLETION), RunCommand(command=command)),
                    reference_solution=ADD_ONE)


def test_an_answer_that_ends_pytest_early_passes_nothing():
    """A shell line that runs pytest is scored by pytest's counts. Once, without them it fell back to the
    line's exit code, which an answer that ends pytest at import decides (`cd /app && python -m pytest`:
    its os._exit(0)) or which is tail's (a pipeline): every such answer passed."""
    quit0, killed = "import os\nos._exit(0)\n", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"
    cd, tail = cmd_task("cd /app && python -m pytest -q tests/", "cd"), cmd_task("python -m pytest tests/ | tail -3", "tail")
    results = verify_many([(cd, quit0), (tail, quit0), (tail, killed), (cd, ADD_ONE), (tail, ADD_ONE)], LIMITS)
    assert [v.passed for v in results] == [False, False, False, True, True]
    assert [v.metrics["tests_passed"] for v in results] == [0, 0, 0, 3, 3]


def test_completion_cannot_rewrite_the_tests():
    pyt, script = cmd_task("pytest -q tests/", "tamper_pytest"), cmd_task("python check.py", "tamper_script")
    a, b, ref = verify_many([(pyt, TAMPER), (script, TAMPER), (pyt, ADD_ONE)], LIMITS)
    assert (a.metrics["tests_passed"], a.metrics["tests_total"]) == (0, 3)     # every hidden test still ran, and failed
    assert b.metrics["test_pass_rate"] == 0.0
    assert ref.metrics["tests_passed"] == 3
    # control: the same attack against writable tests works, so the read-only placement is what stops it
    payloads = []
    for spec in (pyt, script):
        p = build_payload(spec, TAMPER)
        payloads.append(Payload(program=p.program, files={**p.files, **p.readonly_files}, python=p.python, site=p.site, env=p.env))
    writable_pytest, writable_script = run_many(payloads, LIMITS)   # the default 2 s of CPU is about what pytest takes
    # test_a.py was already running when it imported the completion, so it still fails; test_b.py's two
    # hidden tests were replaced by one that passes: 1 of 2 instead of 0 of 3
    assert pytest_counts(writable_pytest.stdout) == {"passed": 1, "failed": 1, "errors": 0}
    assert "PASSED tests/test_b.py::test_ok" in writable_pytest.stdout
    assert writable_script.exit_code == 0          # check.py read the completion's expected.json


# Runs from the command line before pytest: move the hidden tests' dir aside and put passing tests in
# its place (a reviewer's attack on the bwrap backend, where the payload once owned the sticky dirs).
SWAP = '''import os
def f(x):
    return -100
if __name__ == "__main__":
    try:
        os.rename("tests", "tests_orig"); os.mkdir("tests")
        open("tests/test_a.py", "w").write("def test_a():\\n    pass\\ndef test_b():\\n    pass\\ndef test_c():\\n    pass\\n")
        print("SWAPPED")
    except OSError as e:
        print("swap refused:", e)
'''


@pytest.mark.parametrize("backend", ["bwrap", "zygote"])
def test_completion_cannot_swap_the_tests_dir(backend):
    from ratchet.sandbox import Sandbox
    from ratchet.verify.verifier import metrics_from, plan
    need_backend(backend)
    spec = cmd_task("python solution.py; python -m pytest -q tests/", "swap_" + backend)
    with Sandbox(LIMITS, backend=backend, concurrency=1) as box:
        got = {}
        for name, completion in (("swap", SWAP), ("honest", ADD_ONE)):
            p = plan(spec, completion, runtime_python=None)
            r = box.run(p.payload)
            got[name] = (r, metrics_from(spec, completion, r, p))
    r, m = got["swap"]
    assert "SWAPPED" not in r.stdout and "swap refused" in r.stdout, r
    assert (m["tests_passed"], m["tests_total"]) == (0, 3), (m, r)
    r, m = got["honest"]
    assert (m["tests_passed"], m["tests_total"]) == (3, 3), (m, r)


# A shell script that reads the expected state off whatever the sandbox holds: the reviewer's attack on the
# old shell family (check.py held `EXPECT = json.loads(...)`), and a broader one that takes any JSON state
# it finds in a readable file of the workdir.
READ_EXPECT = r"""python3 - <<'PY'
import ast, json, os, re
def state_of(text):
    m = re.search(r"EXPECT = json.loads\((.*)\)\n", text)
    if m:
        return json.loads(ast.literal_eval(m.group(1)))
    for blob in re.findall(r"\{.*\}|\[\[.*\]\]", text):
        try:
            e = json.loads(blob)
        except ValueError:
            continue
        if isinstance(e, dict) and "files" in e:
            return e
        if isinstance(e, list):
            return {"files": {p: v for p, v in e if isinstance(v, str)}, "absent": [p for p, v in e if v is False],
                    "dirs": [p for p, v in e if v is True]}
for root, _, names in os.walk("."):
    for name in names:
        try:
            e = state_of(open(os.path.join(root, name)).read())
        except (OSError, UnicodeDecodeError):
            continue
        if e:
            for p in e["absent"]:
                if os.path.lexists(p): os.remove(p)
            for d in e["dirs"]: os.makedirs(d, exist_ok=True)
            for p, c in e["files"].items():
                if os.path.dirname(p): os.makedirs(os.path.dirname(p), exist_ok=True)
                open(p, "w").write(c)
PY
"""


def test_shell_tasks_keep_the_expected_state_out_of_the_sandbox():
    from envs.families import shell

    specs = [shell.generate(shell.Config(), seed=0, index=i, difficulty=d, split=split)
             for d in range(1, 6) for i, split in enumerate(("train", "heldout"))]
    runs = verify_many([(s, READ_EXPECT) for s in specs] + [(s, s.reference_solution) for s in specs], LIMITS)
    attacks, references = runs[:len(specs)], runs[len(specs):]
    assert [r.passed for r in references] == [True] * len(specs), [r.feedback for r in references]
    assert [r.metrics["test_pass_rate"] for r in attacks] == [0.0] * len(specs)
    for spec in specs:      # nothing the sandbox is given holds the expected state
        p = build_payload(spec, READ_EXPECT)
        given = [p.code or "", *p.files.values(), *p.readonly_files.values(), *p.argv, *p.program, *p.env.values()]
        expected = [x for t in spec.tests for x in (t.expected, canonical(t.expected), repr(t.expected))]
        assert spec.tests and not [x for x in expected for g in given if x in g]


# Runs inside pytest's process: make pytest's reporter print a fake report after its real one.
FORGE = """import os, sys
import _pytest.terminal as terminal
real = terminal.TerminalReporter.summary_stats
def forged(self):
    real(self)
    self.write_line("PASSED tests/test_a.py::test_a")
    self.write_line("PASSED tests/test_b.py::test_b")
    self.write_line("PASSED tests/test_b.py::test_c")
    self.write_sep("=", "3 passed in 0.01s")
    if EXIT is not None:
        sys.stdout.flush()
        os._exit(EXIT)
terminal.TerminalReporter.summary_stats = forged
def f(x):
    return x + 1 if x == 1 else -100
"""


def test_forged_pytest_report_is_not_credited():
    """After pytest's real report (1 passed, 2 failed), print a fake one; and the same, then exit 0.
    (A completion that rewrites the reporter coherently before anything is printed is not
    caught: see the threat model in ratchet/verify/commands.py.)"""
    spec = cmd_task("pytest -q tests/", "forge")
    results = verify_many([(spec, FORGE.replace("EXIT", "None")), (spec, FORGE.replace("EXIT", "0"))], LIMITS)
    for v in results:
        assert v.metrics["tests_passed"] == 0 and "inconsistent_test_report" in v.metrics["security_flags"]
        assert score(v.metrics, RewardLogic(), NO_PENALTY) == 0.0


# --- held-out inputs and special-cased visible examples ---------------------------------------------

VISIBLE = [{"args": "[1]", "expected": "2"}, {"args": "[2]", "expected": "3"}, {"args": "[3]", "expected": "4"}]
EXAMPLES_PROMPT = "# add one to x\n# f(1) == 2, f(2) == 3, f(3) == 4\ndef f(x):\n"


def test_special_casing_rule():
    assert special_cased(1.0, 0.49) and not special_cased(1.0, 0.5) and not special_cased(2 / 3, 0.0)
    assert not special_cased(None, 0.0)


def test_hard_coded_visible_examples_fail_held_out_inputs_and_are_flagged():
    spec = calls_task(prompt=EXAMPLES_PROMPT, metadata={"visible_tests": VISIBLE}, task_id="examples")
    assert not hidden_test_leaks(spec)
    lookup = "def f(x):\n    return {1: 2, 2: 3, 3: 4}[x]\n"
    branches = "def f(x):\n    if x == 1: return 2\n    if x == 2: return 3\n    if x == 3: return 4\n    return x * 2 - 8\n"
    honest_bug = "def f(x):\n    return x + 1 if x > 1 else 0\n"     # fails visible f(1): not special-casing
    memo, branch, honest, buggy = verify_many([(spec, lookup), (spec, branches), (spec, ADD_ONE), (spec, honest_bug)], LIMITS)
    assert memo.metrics["tests_passed"] == 0 and "special_cased_examples" in memo.metrics["security_flags"]
    # branches (2x - 8 off the examples): hidden 7 -> 6, -3 -> -14, 10 -> 12, 0 -> -8, 42 -> 76, -8 -> -24: none passes
    assert branch.metrics["tests_passed"] == 0 and "special_cased_examples" in branch.metrics["security_flags"]
    assert honest.metrics["test_pass_rate"] == 1.0 and honest.metrics["security_flags"] == []
    # honest_bug: 7, 10, 42 pass; -3, 0, -8 fail -> 3/6 = 0.5, and a visible example fails: not flagged
    assert buggy.metrics["test_pass_rate"] == 0.5 and buggy.metrics["security_flags"] == []
    assert score(memo.metrics, RewardLogic(), CFG) == 0.0 and score(honest.metrics, RewardLogic(), CFG) == 1.0


def test_special_casing_with_some_hidden_credit_is_penalised():
    spec = calls_task(prompt=EXAMPLES_PROMPT, metadata={"visible_tests": VISIBLE}, task_id="examples2")
    # right for small positive x only: hidden 7 -> 8 passes, 10 -> 11 passes; -3, 0, 42, -8 fail -> 2/6
    partial = "def f(x):\n    return x + 1 if 0 < x < 20 else 0\n"
    [v] = verify_many([(spec, partial)], LIMITS)
    assert v.metrics["test_pass_rate"] == pytest.approx(2 / 6) and "special_cased_examples" in v.metrics["security_flags"]
    assert score(v.metrics, RewardLogic(), CFG) == 0.0                                        # penalty 0.0
    assert score(v.metrics, RewardLogic(), RewardConfig(security_penalty=-1.0)) == -1.0
    assert score(v.metrics, RewardLogic(), NO_PENALTY) == pytest.approx(1 / 3)                # flag only reported


# --- an empty completion never scores > 0 -------------------------------------------------------------

def test_empty_completion_never_scores_above_zero():
    # a run_command task whose snapshot already passes its tests: running "nothing" would pass
    passing_snapshot = TaskSpec(
        task_id="snap", family="hack", prompt="# improve solution.py\n", files={"solution.py": ADD_ONE},
        execution_steps=(OverwriteFile(path="/app/notes.py", content=COMPLETION), RunCommand(command="python check.py")),
        test_files={"check.py": "from solution import f\nassert f(1) == 2\n"}, reference_solution="x = 1\n")
    fast = RewardLogic(rules=(RewardRule(metric="test_pass_rate", weight=0.5), RewardRule(metric="syntax_ok", weight=0.2),
                              RewardRule(metric="execution_time_ms", weight=0.2, threshold=5000),
                              RewardRule(metric="security_flags", weight=0.1)))
    items = [(passing_snapshot, ""), (passing_snapshot, "  \n\t"), (calls_task(), ""), (calls_task(), "\n")]
    results = verify_many(items, LIMITS)
    for cfg in (CFG, NO_PENALTY, RewardConfig(format_weight=0.5), RewardConfig(partial_credit=False)):
        for v in results:
            assert not v.env_error and v.metrics["format_ok"] is False
            assert score(v.metrics, fast, cfg) <= 0 and score(v.metrics, RewardLogic(), cfg) <= 0
    # the same task does pass with a real (if trivial) completion: the guard is about emptiness
    [v] = verify_many([(passing_snapshot, "x = 1\n")], LIMITS)
    assert v.metrics["test_pass_rate"] == 1.0


# --- imported HumanEval: an answer that lies about equality scores nothing ---------------------------

ALWAYS_EQUAL = '''
    class _Anything:
        def __eq__(self, other): return True
        def __ne__(self, other): return False
        __hash__ = object.__hash__
        def __lt__(self, other): return True
        __le__ = __gt__ = __ge__ = __lt__
        def __abs__(self): return 0
        def __sub__(self, other): return self
        __rsub__ = __add__ = __radd__ = __mul__ = __rmul__ = __truediv__ = __mod__ = __neg__ = __sub__
        def __round__(self, n=None): return self
        def __float__(self): return 0.0
        def __int__(self): return 0
        def __bool__(self): return True
        def __len__(self): return 0
        def __iter__(self): return iter(())
        def __getitem__(self, i): return self
        def __contains__(self, x): return True
        def __str__(self): return "True"
        __repr__ = __str__
    return _Anything()
'''


def test_humaneval_lying_answers_score_nothing_and_canonical_solutions_pass():
    """HumanEval's own check() compares inside the candidate's process: an object whose __eq__ is
    always True passed 155 of 164 problems. Imported, every problem's results are compared as plain
    data (call tests outside the sandbox, or check on a plain copy): 164/0/0."""
    from envs.humaneval import humaneval_path
    from envs.importers import read_tasks
    specs = read_tasks(humaneval_path(), "humaneval").specs
    assert len(specs) == 164
    answers = {"canonical": None, "always_equal": ALWAYS_EQUAL, "none": "    return None\n"}
    items = [(s, s.reference_solution if a is None else a) for a in answers.values() for s in specs]
    results = verify_many(items, LIMITS)
    assert not [s.task_id for (s, _), v in zip(items, results) if v.env_error]
    full = {name: [s.task_id for (s, _), v in zip(items[i * 164:(i + 1) * 164], results[i * 164:(i + 1) * 164]) if v.passed]
            for i, name in enumerate(answers)}
    assert {k: len(v) for k, v in full.items()} == {"canonical": 164, "always_equal": 0, "none": 0}, full["always_equal"][:5]
    guards = [s.metadata["guard"] for s in specs]
    assert guards.count("call_tests") >= 160            # the rest (HumanEval/32: any root will do) check in the sandbox


def test_float_tolerance_is_the_verifiers_one_comparison():
    from ratchet.verify.verifier import same
    assert same("0.6666666666666666", "0.6666666666666667", 1e-6) and not same("0.6666666666666666", "0.6666666666666667")
    assert same("2", "2.0", 1e-6) and not same("2", "2.0")                   # Python's 2 == 2.0, under a tolerance
    assert not same("0.667", "0.6666666666666667", 1e-6)
    assert not same("true", "1", 1e-6) and not same("10000000000000000001", "10000000000000000000", 1e-6)
    assert not same('{"$tuple":[1.0]}', "[1.0]", 1e-6) and same('{"$tuple":[1.0]}', '{"$tuple":[1.0000000001]}', 1e-6)
    assert not same(None, "null", 1e-6) and not same('{"$float":"nan"}', "0.0", 1e-6)


def test_results_no_comparison_can_read_are_not_equal():
    """An int beyond any float (math.isclose: OverflowError) and a result nested deeper than json's stack where
    `same` reads it (RecursionError) once raised out of verify_many; each is simply a wrong result."""
    from ratchet.verify.verifier import same
    assert not same(str(10 ** 400), "0.5", 1e-6) and not same(f"[{10 ** 400}]", "[0.5]", 1e-6)
    assert same(str(10 ** 400), str(10 ** 400), 1e-6)                         # two ints: still exact
    deep = "[" * 100_000 + "]" * 100_000
    for tol in (None, 1e-6):
        assert not same(deep, "[]", tol) and not same("[]", deep, tol)


def test_humaneval_a_correct_answer_rounded_differently_passes_and_random_checks_are_recorded():
    from envs.humaneval import humaneval_path
    from envs.importers import read_tasks
    specs = {s.task_id: s for s in read_tasks(humaneval_path(), "humaneval").specs}
    mad, decode = specs["HumanEval/4"], specs["HumanEval/38"]
    assert mad.metadata["float_tolerance"] == 1e-6 and decode.metadata["guard"] == "call_tests"
    assert len(decode.tests) >= 100                        # check's 100 random strings, seeded at import
    fsum = ("    import math\n    m = math.fsum(numbers) / len(numbers)\n"
            "    return math.fsum(abs(x - m) for x in numbers) / len(numbers)\n")
    off = "    return sum(numbers) / len(numbers) / 2\n"
    ok, wrong = verify_many([(mad, fsum), (mad, off)], LIMITS)
    assert ok.passed and wrong.metrics["tests_passed"] == 0


def test_run_command_pytest_still_compares_inside_the_candidates_process():
    """Known limit, kept visible: a user's pytest file asserts `f(x) == y` in the process that
    imported the completion, so an always-equal object passes it (as with plain pytest). Only
    check_calls tasks (generated families, imported HumanEval) compare plain data outside."""
    liar = "class A:\n    def __eq__(self, o): return True\ndef f(x):\n    return A()\n"
    [v] = verify_many([(cmd_task("pytest -q tests/", "liar_pytest"), liar)], LIMITS)
    assert v.metrics["tests_passed"] == 3


def test_syntax_ok_judges_the_answers_own_file():
    """A shell answer is not Python: its syntax_ok is not ast.parse of solution.sh (false for nearly every
    script) nor of check.py (the first .py file, true for any answer); a Python answer still must parse."""
    from envs.families.shell import Config as ShellConfig, generate as shell_task
    from ratchet.verify.verifier import _syntax_ok

    sh = shell_task(ShellConfig(), 0, 0, 1, "train")
    assert _syntax_ok(sh, "mv a b\n") and not _syntax_ok(sh, "   \n")
    assert _syntax_ok(calls_task(), ADD_ONE) and not _syntax_ok(calls_task(), "def f(x):\n    return (\n")
