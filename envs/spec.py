"""The task spec: the unit of environment production (DESIGN.md, "Task spec").

A spec says what the model is asked (`prompt`), the runtime it runs in
(`environment_config`), what is done with its completion (`execution_steps`, where the
literal `<model_generated_code>` is replaced by the completion; a check_calls task that writes
no .py file runs the completion itself as the module), how the outcome becomes a
reward (`reward_logic`), and the hidden material the model never sees (`tests`,
`test_files`, `reference_solution`). `reference_solution` is None when the spec carries no
reference (a user's task file need not have one); code that runs or trains on the reference
must skip such specs.

Users hand ratchet a JSONL of these (`ratchet envs import`); families produce them.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Sequence, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from ratchet.sandbox.model import check_relpath

COMPLETION = "<model_generated_code>"


class SpecError(ValueError):
    """Rules of the spec broken below the field being validated: (path under it, why) pairs, so
    that an importer names `metadata.float_tolerance`, and each problem once."""

    def __init__(self, *errors: tuple[tuple[str | int, ...], str]):
        self.errors = tuple(errors)
        super().__init__("; ".join(".".join(map(str, loc)) + (": " if loc else "") + why for loc, why in errors))


def for_task(task_id: str, rule, value, where: str = ""):
    """`rule(value)`, one of the schema's rules below, on a spec that skipped validation (model_copy):
    its SpecError as a ValueError naming the task (`where`: the field's prefix, e.g. "metadata.")."""
    try:
        return rule(value)
    except SpecError as e:
        raise ValueError(f"task {task_id}: {where}{e}") from e


def key_part(name: str) -> bool:
    """`name` is usable as one component of a store key (envs/<family>/<version>/...)."""
    return bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name)) and ".." not in name


def workdir_path(path: str) -> str:
    """A spec path ("/app/main.py") as a path in the sandbox's workdir ("main.py")."""
    return path.removeprefix("/app/").lstrip("/")


def workdir_files(files: dict[str, str]) -> dict[str, str]:
    """A spec's `files` or `test_files` as the sandbox's workdir holds them (`workdir_path` of each name)."""
    return {workdir_path(name): content for name, content in files.items()}


def in_workdir(path: str) -> str:
    """`path` as the verifier places it (`workdir_path`), or SpecError: the sandbox refuses a path that
    names no file or leaves the workdir (`check_relpath`), which the audit would report as an env_error."""
    where = workdir_path(path)
    try:
        check_relpath(where)
    except ValueError:
        raise SpecError(((), f"{path!r} is not a file in the workdir: give a relative path or /app/<path>, "
                             "with no '..' out of it")) from None
    return where


class _Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EnvironmentConfig(_Spec):
    runtime: str = Field("python3.11", description="Interpreter the task runs under.")
    dependencies: tuple[str, ...] = Field((), description="Pinned requirements, e.g. 'pytest==9.2.0'.")


class OverwriteFile(_Spec):
    action: Literal["overwrite_file"] = "overwrite_file"
    path: str = Field(description="File in the task's workdir (absolute /app/... or relative).")
    content: str = Field(description=f"New content; {COMPLETION} is replaced by the completion.")

    @field_validator("path")
    @classmethod
    def _in_workdir(cls, v: str) -> str:
        in_workdir(v)
        return v


class Report(_Spec):
    """A test report file the command writes; its counts become tests_passed / tests_total."""

    path: str = Field(min_length=1, description="Report file in the workdir (absolute /app/... or relative), e.g. report.xml.")
    format: Literal["junit", "pytest-json"] = Field(
        description="junit: JUnit XML (pytest --junitxml=...); pytest-json: pytest-json-report's JSON document.")


class RunCommand(_Spec):
    action: Literal["run_command"] = "run_command"
    command: str = Field(min_length=1, description="Command line run by /bin/sh -c in the workdir (/app) after the files "
                                                   "are placed, with the runtime's python and pytest first on PATH.")
    report: Report | None = Field(None, description="Test report file the command writes (None: pytest's terminal "
                                                    "output, else the exit code, is what is scored).")


NEVER_RAN = "no result (the call never ran)"
"""What a failed check_calls call "got" in the verifier's feedback when the harness has no result for
it (the module did not load); an observation then shows the error first (envs/episode.py)."""


class CheckCalls(_Spec):
    """Call `entry_point` on each hidden test's arguments; results are serialised inside the
    sandbox and compared with the expected values outside it."""

    action: Literal["check_calls"] = "check_calls"
    entry_point: str = Field(min_length=1, description="Name of the function under test.")


Step = Annotated[Union[OverwriteFile, RunCommand, CheckCalls], Field(discriminator="action")]


Aggregation = Literal["max", "min", "mean", "last"]


class RewardRule(_Spec):
    metric: str = Field(min_length=1, description="Verifier metric, e.g. test_pass_rate, execution_time_ms.")
    weight: float = Field(gt=0, strict=True, allow_inf_nan=False, description="Weight in the composite's weighted mean.")
    aggregation: Aggregation = Field("mean", description="How repeated measurements reduce to one.")
    threshold: float | None = Field(None, gt=0, strict=True, allow_inf_nan=False,
                                    description="Scale of a lower-is-better metric: score = clip(1 - v/threshold, 0, 1).")


class RewardLogic(_Spec):
    type: Literal["composite"] = "composite"
    rules: tuple[RewardRule, ...] = Field(
        (RewardRule(metric="test_pass_rate", weight=1.0, aggregation="max"),), min_length=1
    )


# The metric registry: every verifier metric a reward rule may name, and its kind (how
# `ratchet.reward.metrics` scores it). It lives here, below the reward layer, so that a rule
# naming an unknown metric or misusing one is a bad task line at import, not a wave that
# cannot be scored. A new metric is one `register_metric(...)` line.
KINDS = ("fraction", "flag", "bad_flag", "cost", "count", "no_flags")
DIMENSIONS = ("completion", "format", "security", "efficiency")
_NEEDS_THRESHOLD = {"cost", "count"}


class RewardLogicError(SpecError):
    """A reward_logic names a metric or aggregation ratchet does not know, or misuses one."""


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str        # one of KINDS
    dimension: str   # one of DIMENSIONS
    doc: str


METRICS: dict[str, Metric] = {}


def register_metric(name: str, kind: str, dimension: str, doc: str) -> Metric:
    if kind not in KINDS or dimension not in DIMENSIONS:
        raise ValueError(f"metric {name!r}: kind must be one of {KINDS}, dimension one of {DIMENSIONS}")
    METRICS[name] = Metric(name, kind, dimension, doc)
    return METRICS[name]


def validate_rule(rule: RewardRule, loc: tuple[str | int, ...] = ("rule",)) -> Metric:
    """The rule's Metric, or RewardLogicError naming the rule's field (`loc`: the rule's own path)."""
    metric = METRICS.get(rule.metric)
    if metric is None:
        raise RewardLogicError(((*loc, "metric"), f"unknown metric {rule.metric!r}; known metrics: {sorted(METRICS)}"))
    if rule.aggregation not in get_args(Aggregation):
        raise RewardLogicError(((*loc, "aggregation"), f"unknown aggregation {rule.aggregation!r} for metric "
                                                       f"{rule.metric!r}; known: {sorted(get_args(Aggregation))}"))
    if metric.kind in _NEEDS_THRESHOLD and rule.threshold is None:
        raise RewardLogicError(((*loc, "threshold"), f"metric {rule.metric!r} ({metric.kind}) needs a threshold, "
                                                     f"e.g. {{\"metric\": \"{rule.metric}\", \"threshold\": 5000}}"))
    if metric.kind not in _NEEDS_THRESHOLD and rule.threshold is not None:
        raise RewardLogicError(((*loc, "threshold"), f"metric {rule.metric!r} ({metric.kind}) takes no threshold, "
                                                     f"got {rule.threshold}"))
    if not 0 < rule.weight < math.inf:
        raise RewardLogicError(((*loc, "weight"), f"weight of metric {rule.metric!r} must be a finite number > 0, "
                                                  f"got {rule.weight}"))
    return metric


def validate_logic(logic: RewardLogic, loc: tuple[str | int, ...] = ("reward_logic",)) -> RewardLogic:
    """Check every rule against the registry; returns `logic` unchanged, or raises RewardLogicError
    naming each bad rule (`reward_logic.rules.1.metric: unknown metric ...`)."""
    if logic.type != "composite":
        raise RewardLogicError(((*loc, "type"), f"unknown type {logic.type!r}; known: ['composite']"))
    if not logic.rules:
        raise RewardLogicError(((*loc, "rules"), "at least one rule is needed"))
    errors = []
    for i, rule in enumerate(logic.rules):
        try:
            validate_rule(rule, (*loc, "rules", i))
        except RewardLogicError as e:
            errors += e.errors
    if errors:
        raise RewardLogicError(*errors)
    return logic


register_metric("test_pass_rate", "fraction", "completion", "hidden tests passed / total")
register_metric("tests_passed", "count", "completion", "hidden tests passed (threshold: how many make full credit)")
register_metric("syntax_ok", "flag", "format", "the solution file parses (an empty completion does not count)")
register_metric("format_ok", "flag", "format", "the completion is non-empty, parseable code")
register_metric("timed_out", "bad_flag", "efficiency", "the run hit its wall-clock limit")
register_metric("execution_time_ms", "cost", "efficiency", "wall-clock time of the run, ms")
register_metric("peak_memory_mb", "cost", "efficiency", "peak memory of the run, MB")
register_metric("output_bytes", "cost", "efficiency", "bytes written to stdout + stderr")
register_metric("security_flags", "no_flags", "security", "what the sandbox refused or noticed; empty is good")


class CallTest(_Spec):
    """One hidden unit test of a function task: positional args and expected return, as JSON."""

    args: str = Field(description="JSON array of positional arguments.")
    expected: str = Field(description="JSON of the expected return value.")

    @field_validator("args", "expected")
    @classmethod
    def _is_json(cls, v: str, info: ValidationInfo) -> str:
        try:
            value = json.loads(v)
        except RecursionError:    # pydantic lets it through: one such line once stopped the whole import
            raise ValueError("JSON nested deeper than the parser goes") from None
        if info.field_name == "args" and not isinstance(value, list):   # the harness calls f(*args)
            raise ValueError('must be a JSON array of the positional arguments (f(5): "[5]")')
        return v


def judge_step(steps: Sequence[Step]) -> CheckCalls | RunCommand:
    """The step that judges the completion: the verifier runs exactly one check_calls or run_command."""
    judges = [s for s in steps if isinstance(s, (CheckCalls, RunCommand))]
    if len(judges) != 1:
        raise SpecError(((), f"expected exactly one check_calls or run_command step, found {len(judges)}"))
    return judges[0]


def module_step(steps: Sequence[Step]) -> OverwriteFile | None:
    """The module check_calls imports: the first .py file an overwrite_file writes (None: the
    completion itself is the module)."""
    return next((s for s in steps if isinstance(s, OverwriteFile) and s.path.endswith(".py")), None)


def answer_lands(steps: Sequence[Step]) -> None:
    """The completion reaches what judges it: some overwrite_file holds COMPLETION, or a check_calls
    task writes no .py file (the completion is the module). Otherwise the verifier would judge the
    files as written and discard every answer (a typo such as `<model_generated_code >`)."""
    if any(isinstance(s, OverwriteFile) and COMPLETION in s.content for s in steps):
        return
    if isinstance(judge_step(steps), CheckCalls) and module_step(steps) is None:
        return
    raise SpecError(((), f"no overwrite_file step's content holds {COMPLETION} (spelled exactly), "
                         "so the model's answer would go nowhere"))


def tolerance_of(metadata: dict) -> float | None:
    """`metadata["float_tolerance"]`, the verifier's tolerance for floats (None: results must be equal)."""
    tol = metadata.get("float_tolerance")
    if tol is None:
        return None
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 <= tol < 1:
        raise SpecError((("float_tolerance",), f"must be a number in [0, 1), got {tol!r}"))
    return float(tol)


METADATA_DEPTH = 64   # pydantic stops serialising near 255 levels; the store saves each spec as JSON


def utf8(text: str) -> bool:
    """`text` can be written as UTF-8: a JSON escape of a lone surrogate ("\\ud800") reads as a str
    that cannot, and the store would fail on it (or, in a key, save something else)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def storable(metadata: dict) -> dict:
    """`metadata` is what the store saves as it is: nested no deeper than METADATA_DEPTH levels
    (dicts and lists), its text UTF-8 (`utf8`), its numbers finite (JSON has no NaN or Infinity:
    the store would save null). Otherwise the spec would pass validation and fail, or change, where
    it is saved, naming no task."""
    todo = [((), metadata)]
    while todo:
        loc, value = todo.pop()
        if isinstance(value, str) and not utf8(value):
            raise SpecError((loc, f"is not UTF-8 text (a lone surrogate): {value[:40]!r}"))
        if isinstance(value, float) and not math.isfinite(value):
            raise SpecError((loc, f"must be a finite number, got {json.dumps(value)} (saved, it would be null)"))
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
        for key, inner in items:
            if len(loc) + 1 > METADATA_DEPTH:
                raise SpecError((loc[:3], f"nests deeper than {METADATA_DEPTH} levels (dicts and lists)"))
            if isinstance(key, str) and not utf8(key):    # named by its parent: the key cannot be printed
                raise SpecError((loc, f"has a key that is not UTF-8 text (a lone surrogate): {key[:40]!r}"))
            todo.append(((*loc, key), inner))
    return metadata


def visible_tests_of(metadata: dict) -> tuple[CallTest, ...]:
    """`metadata["visible_tests"]`, the visible examples the verifier runs beside the hidden tests."""
    raw = metadata.get("visible_tests") or []
    if not isinstance(raw, (list, tuple)):
        raise SpecError((("visible_tests",), f"must be a list of {{'args', 'expected'}} objects, got {type(raw).__name__}"))
    out, errors = [], []
    for i, item in enumerate(raw):
        if isinstance(item, CallTest):
            out.append(item)
        elif not isinstance(item, dict):
            errors.append((("visible_tests", i), f"must be an {{'args', 'expected'}} object, got {type(item).__name__}"))
        else:
            try:
                out.append(CallTest.model_validate(item))
            except ValidationError as e:      # every error of the entry, each at its own key
                errors += [(("visible_tests", i, *x["loc"]), x["msg"] + ("" if x["type"] == "missing" else
                                                                         f" (got {x['input']!r})")) for x in e.errors()]
    if errors:
        raise SpecError(*errors)
    return tuple(out)


def trivial_answers_of(metadata: dict) -> list[str] | None:
    """`metadata["trivial_answers"]`, completions the audit requires to fail (None: not given, the audit's own)."""
    raw = metadata.get("trivial_answers")
    if "trivial_answers" in metadata and not (isinstance(raw, (list, tuple)) and all(isinstance(a, str) for a in raw)):
        raise SpecError((("trivial_answers",), f"must be a list of strings (answers that must fail), "
                                               f"got {json.dumps(raw, default=str)[:60]}"))
    return raw


class TaskSpec(_Spec):
    task_id: str = Field(min_length=1, max_length=256)
    family: str = Field(min_length=1, description="A store folder's name: letters, digits and '._-'.")
    difficulty: int = Field(1, ge=1, le=5)   # `true` or "3" is a mistake, not 1 or 3: _a_number
    version: str = "v1"
    split: Literal["train", "heldout"] = "train"
    prompt: str = Field(min_length=1, description="What the model sees.")
    environment_config: EnvironmentConfig = Field(default_factory=EnvironmentConfig)
    execution_steps: tuple[Step, ...] = Field(min_length=1, description="Exactly one check_calls or run_command among them.")
    reward_logic: RewardLogic = Field(default_factory=RewardLogic)
    files: dict[str, str] = Field(default_factory=dict, description="Starting snapshot of the workdir.")
    tests: tuple[CallTest, ...] = Field((), validate_default=True, description="Hidden call tests (for check_calls).")
    test_files: dict[str, str] = Field(default_factory=dict, description="Hidden test files, placed after the completion, read-only.")
    reference_solution: str | None = Field(
        None, min_length=1, description="A completion that passes every test; None: the spec has no reference.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Free, except what the verifier reads: "
                                     "float_tolerance (a number in [0, 1)), visible_tests (a list of CallTests), "
                                     "trivial_answers (a list of strings).")

    # The verifier's own rules (ratchet.verify reads these through the same functions), held here
    # so that a task it cannot run is a bad line at import, not an env_error or an aborted audit.
    # Field validators, not a model one: each runs even when another field is bad (every error at once).
    @field_validator("difficulty", mode="before")
    @classmethod
    def _a_number(cls, v: Any) -> Any:
        """A JSON number, not a bool or a string; 3.0 is 3 (a Parquet column with nulls is Float64)."""
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise SpecError(((), f"must be a whole number 1 to 5, got {json.dumps(v, default=str)[:60]}"))
        return int(v) if isinstance(v, float) and v.is_integer() else v

    @field_validator("prompt")
    @classmethod
    def _asks_something(cls, v: str) -> str:
        """Not blank: the task gate (`prompt_not_empty`) would refuse it and stop the run that trains on it."""
        if not v.strip():
            raise SpecError(((), "is blank (whitespace only): the model would be asked nothing"))
        return v

    @field_validator("family")
    @classmethod
    def _family_is_a_folder(cls, v: str) -> str:
        if not key_part(v):
            raise SpecError(((), f"{v!r} cannot name a store folder: letters, digits and '._-' only"))
        return v

    @field_validator("files", "test_files")
    @classmethod
    def _files_in_workdir(cls, v: dict[str, str]) -> dict[str, str]:
        """Each name is a file the verifier can place (`workdir_files`: /app/x is x, as step paths are); one
        the sandbox would refuse is this field's error, not an env_error in the audit."""
        seen, errors = set(), []
        for name in v:
            if not utf8(name):     # named in the message: the name cannot be printed as a field path
                errors.append(((), f"has a file name that is not UTF-8 text (a lone surrogate): {name[:40]!r}"))
                continue
            try:
                where = in_workdir(name)
            except SpecError as e:
                errors += [((name,), why) for _, why in e.errors]
                continue
            if where in seen:
                errors.append(((name,), f"names the same file ({where!r}) as an earlier name"))
            seen.add(where)
        if errors:
            raise SpecError(*errors)
        return v

    @field_validator("execution_steps")
    @classmethod
    def _one_judge(cls, v: tuple[Step, ...]) -> tuple[Step, ...]:
        judge_step(v)
        answer_lands(v)
        return v

    @field_validator("tests")
    @classmethod
    def _a_check_calls_task_is_scored(cls, v: tuple[CallTest, ...], info: ValidationInfo) -> tuple[CallTest, ...]:
        """Its hidden tests are its score (tests_total; visible examples are not counted): with none, no
        answer passes, the reference included."""
        steps = info.data.get("execution_steps")     # absent when that field is bad: its own error says why
        if not v and steps is not None and isinstance(judge_step(steps), CheckCalls):
            raise SpecError(((), "a check_calls task needs at least one test (metadata.visible_tests are shown, "
                                 "not scored)"))
        return v

    @field_validator("reward_logic")
    @classmethod
    def _scorable(cls, v: RewardLogic) -> RewardLogic:
        """The scorer's rules: a rule it would refuse must not wait for the wave that scores it."""
        return validate_logic(v, loc=())

    @field_validator("metadata")
    @classmethod
    def _verifiable_metadata(cls, v: dict[str, Any]) -> dict[str, Any]:
        errors = []
        for rule in (storable, tolerance_of, visible_tests_of, trivial_answers_of):
            try:
                rule(v)
            except SpecError as e:
                errors += e.errors
        if errors:
            raise SpecError(*errors)
        return v

    def python_file(self) -> OverwriteFile | None:
        """The .py file the completion is written into (None: the answer is not Python, e.g. solution.sh)."""
        return next((s for s in self.execution_steps
                     if isinstance(s, OverwriteFile) and COMPLETION in s.content and s.path.endswith(".py")), None)

    def with_completion(self, completion: str) -> tuple[Step, ...]:
        """The execution steps with the completion substituted."""
        return tuple(
            s.model_copy(update={"content": s.content.replace(COMPLETION, completion)})
            if isinstance(s, OverwriteFile) else s
            for s in self.execution_steps
        )
