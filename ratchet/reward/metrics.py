"""How each verifier metric a reward rule may name scores.

    s = metric_score(rule, metrics)            # one rule's score in [0, 1]

The registry itself (METRICS, register_metric, validate_logic) is `envs.spec`'s, so that the
task schema refuses a rule that names a metric wrongly at import, not when a wave is scored.

A metric value may be a scalar (one run) or a list (several runs or turns); the rule's
`aggregation` reduces the list to one value first (max, min, mean, last). Then the metric's
kind turns that value into a score in [0, 1]:

| kind       | meaning                          | score                            | threshold |
|------------|----------------------------------|----------------------------------|-----------|
| fraction   | higher is better, in [0, 1]      | clip(v, 0, 1)                    | forbidden |
| flag       | True is good (format_ok)         | 1 if v else 0 (mean: share True) | forbidden |
| bad_flag   | True is bad (timed_out)          | 1 - (1 if v else 0)              | forbidden |
| cost       | lower is better (execution_time) | clip(1 - v/threshold, 0, 1)      | required  |
| count      | higher is better, unbounded      | clip(v/threshold, 0, 1)          | required  |
| no_flags   | list of flags, empty is good     | 1 if the run raised no penalised flag else 0 | forbidden |

Security flags come from the sandbox's events and from the verifier. Some are what ordinary
runtimes do (pytest spawns processes and writes caches outside the workdir) and are only
reported; the others are penalised (`FLAGS`; a flag not registered there is penalised).

Each metric also belongs to a reward dimension (completion, format, security, efficiency);
`ratchet.reward.composite` scores efficiency and security rules 0 when no test passed. A new
metric of one of these kinds is one `register_metric(...)` line in `envs/spec.py`.
"""

from __future__ import annotations

from statistics import fmean
from typing import Any, Callable

from envs.spec import METRICS, RewardRule, validate_rule

FLAGS: dict[str, bool] = {}
"""security flag -> penalised? (unregistered flags are penalised)."""

AGGREGATIONS: dict[str, Callable[[list], Any]] = {
    "max": max,
    "min": min,
    "mean": lambda vs: fmean(float(v) for v in vs),
    "last": lambda vs: vs[-1],
}


def register_flag(name: str, penalised: bool) -> None:
    FLAGS[name] = penalised


def penalised_flags(flags: list[str]) -> list[str]:
    """The flags that cost reward: every flag except those registered as reported-only."""
    return [f for f in flags if FLAGS.get(f, True)]


def measurements(value: Any) -> list:
    """A metric value as a list of measurements (one per run/turn), nulls dropped."""
    if value is None:
        return []
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    return [v for v in values if v is not None]


def flag_runs(value: Any) -> list[list]:
    """security_flags of one run (list of str) or of several runs (list of lists)."""
    if value is None:
        return []
    value = list(value)
    if value and all(isinstance(v, (list, tuple)) for v in value):
        return [list(v) for v in value]
    return [value]


def aggregate(rule: RewardRule, metrics: dict) -> Any:
    """The rule's metric reduced to one value by its aggregation; None when never measured."""
    metric = METRICS[rule.metric]
    if metric.kind == "no_flags":
        values = [not penalised_flags(run) for run in flag_runs(metrics.get(rule.metric))]
    else:
        values = measurements(metrics.get(rule.metric))
    return AGGREGATIONS[rule.aggregation](values) if values else None


def _clip01(x: float) -> float:
    return min(1.0, max(0.0, float(x)))


def metric_score(rule: RewardRule, metrics: dict) -> float:
    """One rule's score in [0, 1] from the table in the module docstring; an unmeasured metric scores 0."""
    metric = validate_rule(rule)
    v = aggregate(rule, metrics)
    if v is None:
        return 0.0
    if metric.kind in ("fraction", "flag", "no_flags"):
        return _clip01(v)
    if metric.kind == "bad_flag":
        return 1.0 - _clip01(v)
    if metric.kind == "cost":
        return _clip01(1.0 - float(v) / rule.threshold)
    return _clip01(float(v) / rule.threshold)  # count


for _flag in ("network_attempt", "signal_attempt", "fork_limit", "daemon_left",      # sandbox: misbehaviour
              "special_cased_examples", "inconsistent_test_report",                 # verifier: hacking
              "unparseable_result"):                                                # verifier: output it could not read
    register_flag(_flag, penalised=True)
for _flag in ("process_spawn", "write_refused", "native_code", "memory_limit", "output_held_open"):
    register_flag(_flag, penalised=False)   # ordinary runtimes do these (pytest spawns, caches); kernel refuses the harm
