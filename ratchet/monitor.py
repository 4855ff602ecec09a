"""Health monitors over a run's waves: a training run that goes bad stops before promotion.

    alarms = check_health(history, cfg.monitor)   # history: each wave's stats.json, in step order
    if alarms:
        raise HealthCheckFailed(alarms)           # "entropy collapse at wave 7: sampled_entropy 0.018 < floor 0.02 ..."

Each monitor reads one signal of a wave's stats (`ratchet.stages.wave_stats` and the trainer's
metrics, `Trainer.train_wave`) and says whether wave t breaches its threshold:

    monitor           signal                   breach at wave t
    reward_collapse   reward_mean              its `reward_window`-wave mean < reward_collapse_frac x the
                                               running best of that mean (once the best >= reward_min_best)
    entropy_collapse  sampled_entropy          < entropy_floor, or < entropy_min_ratio x baseline
    kl_blowup         kl                       > max_kl (KL to the reference, when it is in the loss)
    kl_blowup         approx_kl                > max_approx_kl (KL between a minibatch's pi_old and the policy after
                                               its earlier steps; recorded with train.updates_per_batch >= 2)
    length_drift      completion_tokens_mean   > length_drift_factor x baseline, or < baseline / factor
    env_error_spike   env_error_rate           > max_env_error_rate
    zero_variance     zero_variance_frac       > max_zero_variance_frac

The baseline is the mean of the run's first `baseline_waves` waves; baseline monitors judge only
the waves after them. A value that is not finite (a NaN KL) breaches any threshold. A monitor
trips at the newest wave when its signal breached at each of the last `patience` waves; a wave
without the signal (one that trained nothing has no approx_kl) does not breach. Waves are
numbered as in the store (runs/<run_id>/waves/<step>, from 0).

Pure: no Prefect, no store. `tasks/gate.py:check_health` runs it after each recorded wave.
Tests: `pytest tests/test_monitor.py -q`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from ratchet.config import MonitorConfig
from ratchet.errors import picklable


@dataclass(frozen=True)
class Breach:
    value: float        # the signal as judged (the moving average, for the reward)
    threshold: float    # the bound it crossed
    rule: str           # the bound in words, e.g. "< floor 0.02"


@dataclass(frozen=True)
class Alarm:
    """A tripped monitor: its signal breached at each of `waves` (the last is the wave it tripped at)."""

    monitor: str                 # e.g. "entropy_collapse"
    signal: str                  # the stats key, e.g. "sampled_entropy"
    wave: int
    waves: tuple[int, ...]       # the breaching waves, `patience` of them
    values: tuple[float, ...]    # the signal at each
    threshold: float             # the bound at the last wave
    rule: str

    def message(self) -> str:
        """One line: which signal, at which wave, with which values."""
        text = f"{NAMES[self.monitor]} at wave {self.wave}: {self.signal} {self.values[-1]:.4g} {self.rule}"
        if len(self.waves) > 1:
            shown = ", ".join(f"{v:.4g}" for v in self.values)
            text += f" for {len(self.waves)} waves in a row (waves {self.waves[0]}-{self.waves[-1]}: {shown})"
        return text

    def to_dict(self) -> dict:
        return {"monitor": self.monitor, "signal": self.signal, "wave": self.wave, "waves": list(self.waves),
                "values": list(self.values), "threshold": self.threshold, "rule": self.rule, "message": self.message()}


@picklable
class HealthCheckFailed(RuntimeError):
    """A health monitor tripped: the run stops before promotion. Deterministic (never retried)."""

    def __init__(self, alarms: list[Alarm]):
        super().__init__("; ".join(a.message() for a in alarms))
        self.alarms = alarms


Series = list  # list[float | None]: a signal per wave, None where the wave lacks it
Rule = Callable[[Series, int, MonitorConfig], "Breach | None"]


def _not_finite(x: float) -> Breach | None:
    return None if math.isfinite(x) else Breach(x, math.nan, "is not finite")


def _baseline(xs: Series, t: int, cfg: MonitorConfig) -> float | None:
    """Mean of the first `baseline_waves` waves' values; None while wave t is one of them."""
    if t < cfg.baseline_waves:
        return None
    early = [x for x in xs[:cfg.baseline_waves] if x is not None and math.isfinite(x)]
    return sum(early) / len(early) if early else None


def _moving_mean(xs: Series, t: int, window: int) -> float | None:
    """Mean of waves t-window+1..t; None unless all of them have the value."""
    part = xs[t - window + 1:t + 1] if t + 1 >= window else []
    return sum(part) / window if part and all(x is not None for x in part) else None


def _ceiling(limit_of: Callable[[MonitorConfig], float | None]) -> Rule:
    def rule(xs: Series, t: int, cfg: MonitorConfig) -> Breach | None:
        limit, x = limit_of(cfg), xs[t]
        if limit is None or x is None:
            return None
        if not math.isfinite(x):
            return _not_finite(x)
        return Breach(x, limit, f"> ceiling {limit:g}") if x > limit else None
    return rule


def _reward_collapse(xs: Series, t: int, cfg: MonitorConfig) -> Breach | None:
    frac, w = cfg.reward_collapse_frac, cfg.reward_window
    if frac is None:
        return None
    means = [_moving_mean(xs, i, w) for i in range(t + 1)]
    now = means[t]
    if now is None:
        return None
    if not math.isfinite(now):
        return _not_finite(now)
    best = max(m for m in means if m is not None and math.isfinite(m))
    if best < cfg.reward_min_best or now >= frac * best:
        return None
    window = f" ({w}-wave means)" if w > 1 else ""
    return Breach(now, frac * best, f"< {frac:g} x its running best {best:.4g} = {frac * best:.4g}{window}")


def _entropy_collapse(xs: Series, t: int, cfg: MonitorConfig) -> Breach | None:
    x = xs[t]
    if x is None:
        return None
    if not math.isfinite(x):
        return _not_finite(x)
    if cfg.entropy_floor is not None and x < cfg.entropy_floor:
        return Breach(x, cfg.entropy_floor, f"< floor {cfg.entropy_floor:g}")
    base = _baseline(xs, t, cfg)
    ratio = cfg.entropy_min_ratio
    if ratio is not None and base is not None and x < ratio * base:
        return Breach(x, ratio * base, f"< {ratio:g} x baseline {base:.4g} = {ratio * base:.4g}")
    return None


def _length_drift(xs: Series, t: int, cfg: MonitorConfig) -> Breach | None:
    x, f = xs[t], cfg.length_drift_factor
    if f is None or x is None:
        return None
    if not math.isfinite(x):
        return _not_finite(x)
    base = _baseline(xs, t, cfg)
    if base is None or base <= 0:
        return None
    if x > f * base:
        return Breach(x, f * base, f"> {f:g} x baseline {base:.4g} = {f * base:.4g}")
    if x < base / f:
        return Breach(x, base / f, f"< baseline {base:.4g} / {f:g} = {base / f:.4g}")
    return None


NAMES = {"reward_collapse": "reward collapse", "entropy_collapse": "entropy collapse", "kl_blowup": "KL blow-up",
         "length_drift": "completion-length drift", "env_error_spike": "env_error spike",
         "zero_variance": "zero-variance share"}   # as messages say them

MONITORS: list[tuple[str, str, Rule]] = [   # (monitor, signal, rule)
    ("reward_collapse", "reward_mean", _reward_collapse),
    ("entropy_collapse", "sampled_entropy", _entropy_collapse),
    ("kl_blowup", "kl", _ceiling(lambda c: c.max_kl)),
    ("kl_blowup", "approx_kl", _ceiling(lambda c: c.max_approx_kl)),
    ("length_drift", "completion_tokens_mean", _length_drift),
    ("env_error_spike", "env_error_rate", _ceiling(lambda c: c.max_env_error_rate)),
    ("zero_variance", "zero_variance_frac", _ceiling(lambda c: c.max_zero_variance_frac)),
]


def _series(history: list[dict], signal: str) -> Series:
    out = []
    for i, wave in enumerate(history):
        x = wave.get(signal)
        if x is not None and (isinstance(x, bool) or not isinstance(x, (int, float))):
            raise ValueError(f"health check: wave {wave.get('step', i)} has {signal}={x!r}; expected a number")
        out.append(None if x is None else float(x))
    return out


def check_health(history: list[dict], cfg: MonitorConfig) -> list[Alarm]:
    """The monitors that trip at the newest wave of `history` (the run's waves' stats, oldest first)."""
    if not cfg.enabled or not history:
        return []
    steps = [wave.get("step", i) for i, wave in enumerate(history)]
    bad = next((i for i in range(1, len(steps)) if not steps[i] > steps[i - 1]), None)
    if bad is not None:
        raise ValueError(f"health check: waves out of order: step {steps[bad]} after step {steps[bad - 1]}")
    n, k = len(history), cfg.patience
    alarms = []
    for monitor, signal, rule in MONITORS:
        if n < k:
            break
        xs = _series(history, signal)
        breaches = [rule(xs, t, cfg) for t in range(n - k, n)]
        if all(b is not None for b in breaches):
            alarms.append(Alarm(monitor, signal, steps[-1], tuple(steps[n - k:]), tuple(b.value for b in breaches),
                                breaches[-1].threshold, breaches[-1].rule))
    return alarms


def replay(history: list[dict], cfg: MonitorConfig) -> list[Alarm]:
    """Every alarm the monitors would have raised, wave by wave, over a recorded history
    (the run would have stopped at the first; this shows what else was coming)."""
    return [a for t in range(1, len(history) + 1) for a in check_health(history[:t], cfg)]
