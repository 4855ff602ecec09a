"""The task spec: the unit of environment production (DESIGN.md, "Task spec").

A spec says what the model is asked (`prompt`), the runtime it runs in
(`environment_config`), what is done with its completion (`execution_steps`, where the
literal `<model_generated_code>` is replaced by the completion), how the outcome becomes a
reward (`reward_logic`), and the hidden material the model never sees (`tests`,
`test_files`, `reference_solution`). `reference_solution` is None when the spec carries no
reference (a user's task file need not have one); code that runs or trains on the reference
must skip such specs.

Users hand ratchet a JSONL of these (`ratchet envs import`); families produce them.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

COMPLETION = "<model_generated_code>"


class _Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EnvironmentConfig(_Spec):
    runtime: str = Field("python3.11", description="Interpreter the task runs under.")
    dependencies: tuple[str, ...] = Field((), description="Pinned requirements, e.g. 'pytest==9.2.0'.")


class OverwriteFile(_Spec):
    action: Literal["overwrite_file"] = "overwrite_file"
    path: str = Field(description="File in the task's workdir (absolute /app/... or relative).")
    content: str = Field(description=f"New content; {COMPLETION} is replaced by the completion.")


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


class RewardRule(_Spec):
    metric: str = Field(min_length=1, description="Verifier metric, e.g. test_pass_rate, execution_time_ms.")
    weight: float = Field(gt=0, description="Weight in the composite's weighted mean.")
    aggregation: Literal["max", "min", "mean", "last"] = Field("mean", description="How repeated measurements reduce to one.")
    threshold: float | None = Field(None, gt=0, description="Scale of a lower-is-better metric: score = clip(1 - v/threshold, 0, 1).")


class RewardLogic(_Spec):
    type: Literal["composite"] = "composite"
    rules: tuple[RewardRule, ...] = Field(
        (RewardRule(metric="test_pass_rate", weight=1.0, aggregation="max"),), min_length=1
    )


class CallTest(_Spec):
    """One hidden unit test of a function task: positional args and expected return, as JSON."""

    args: str = Field(description="JSON array of positional arguments.")
    expected: str = Field(description="JSON of the expected return value.")

    @field_validator("args", "expected")
    @classmethod
    def _is_json(cls, v: str) -> str:
        json.loads(v)
        return v


class TaskSpec(_Spec):
    task_id: str = Field(min_length=1, max_length=256)
    family: str = Field(min_length=1)
    difficulty: int = Field(1, ge=1, le=5)
    version: str = "v1"
    split: Literal["train", "heldout"] = "train"
    prompt: str = Field(min_length=1, description="What the model sees.")
    environment_config: EnvironmentConfig = Field(default_factory=EnvironmentConfig)
    execution_steps: tuple[Step, ...] = Field(min_length=1)
    reward_logic: RewardLogic = Field(default_factory=RewardLogic)
    files: dict[str, str] = Field(default_factory=dict, description="Starting snapshot of the workdir.")
    tests: tuple[CallTest, ...] = Field((), description="Hidden call tests (for check_calls).")
    test_files: dict[str, str] = Field(default_factory=dict, description="Hidden test files, placed after the completion, read-only.")
    reference_solution: str | None = Field(
        None, min_length=1, description="A completion that passes every test; None: the spec has no reference.")
    metadata: dict[str, Any] = Field(default_factory=dict)

    def with_completion(self, completion: str) -> tuple[Step, ...]:
        """The execution steps with the completion substituted."""
        return tuple(
            s.model_copy(update={"content": s.content.replace(COMPLETION, completion)})
            if isinstance(s, OverwriteFile) else s
            for s in self.execution_steps
        )
