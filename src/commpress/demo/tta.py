"""Time to accuracy (TTA) against a baseline: targets, crossings, speedups, intervals.

The rules ``commpress demo`` uses (the design is argued in docs/demo.md):

* **Smoothing** (:func:`smooth`): an eval curve is replaced by its centred moving average over
  ``window`` evaluations (fewer at the ends). One noisy evaluation can then neither set a
  target nor reach one.
* **Targets** (:func:`targets_from_baseline`): the baseline's smoothed eval loss at several
  fractions of its run (by default 80 %, 90 % and 100 % of its steps), not only its last
  evaluation.
* **Crossing** (:func:`time_to_target`): the first point where a smoothed curve is at or below
  a target, linearly interpolated between the two evaluations around it (in training time and
  in steps), so the resolution is finer than the evaluation interval.
* **Budget**: every other run may train past the baseline's step count (``budget`` times it);
  a target it does not cross within its run is "not reached within the budget".
* **Speedup of one seed** (:func:`seed_speedup`): the geometric mean over the targets of
  ``baseline time / run time``; ``None`` when the run missed any target.
* **Over seeds** (:func:`summarize`): the median of the seeds' speedups, and their range
  (lowest to highest) as the interval; a run that missed a target in some seed is reported
  as reaching it in ``k of n`` seeds.

All functions are pure (lists in, numbers out), so the stopping rule in the training workers
and the analysis in the command use the same code.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from commpress.errors import CommpressError

#: Fractions of the baseline's run at which targets are taken.
DEFAULT_FRACTIONS: tuple[float, ...] = (0.8, 0.9, 1.0)
#: Evaluations averaged by the centred moving average.
DEFAULT_WINDOW = 3
#: How far past the baseline's step count the other runs may train.
DEFAULT_BUDGET = 2.0


def smooth(values: Sequence[float], window: int = DEFAULT_WINDOW) -> list[float]:
    """Centred moving average over ``window`` points (odd; fewer points at the ends).

    ``window=1`` returns the values unchanged.
    """
    if not isinstance(window, int) or isinstance(window, bool) or window < 1 or window % 2 == 0:
        raise CommpressError(f"the smoothing window must be an odd int >= 1, got {window!r}")
    half = window // 2
    n = len(values)
    out = []
    for i in range(n):
        part = values[max(0, i - half): min(n, i + half + 1)]
        out.append(math.fsum(part) / len(part))
    return out


def check_fractions(fractions: Sequence[float]) -> tuple[float, ...]:
    """Validated, sorted, distinct target fractions in (0, 1]."""
    if not fractions:
        raise CommpressError("at least one target fraction is needed (e.g. 0.5 0.75 1)")
    for f in fractions:
        if not (isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f <= 1):
            raise CommpressError(f"target fractions must be in (0, 1], got {f!r}")
    return tuple(sorted(set(float(f) for f in fractions)))


def _value_at_step(steps: Sequence[int], values: Sequence[float], step: float) -> float:
    """``values`` linearly interpolated at ``step`` (clamped to the curve's ends)."""
    if step <= steps[0]:
        return values[0]
    for i in range(1, len(steps)):
        if step <= steps[i]:
            s0, s1 = steps[i - 1], steps[i]
            w = (step - s0) / (s1 - s0) if s1 > s0 else 1.0
            return values[i - 1] + w * (values[i] - values[i - 1])
    return values[-1]


def targets_from_baseline(
    eval_steps: Sequence[int],
    eval_losses: Sequence[float],
    *,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    window: int = DEFAULT_WINDOW,
) -> list[float]:
    """Target losses: the baseline's smoothed eval curve at ``fractions`` of its last step.

    Returned in the order of ``fractions`` (sorted), so the last one is the hardest. A
    target is never above the curve's start (the initial loss).
    """
    fr = check_fractions(fractions)
    if len(eval_steps) != len(eval_losses) or len(eval_steps) < 2:
        raise CommpressError(
            f"the baseline needs at least 2 evaluations to set targets, got {len(eval_steps)}"
        )
    if not all(math.isfinite(v) for v in eval_losses):
        raise CommpressError("the baseline's eval losses are not all finite: no target can be "
                             "taken from them")
    curve = smooth(list(eval_losses), window)
    last = eval_steps[-1]
    return [_value_at_step(eval_steps, curve, f * last) for f in fr]


@dataclass(frozen=True)
class Crossing:
    """Where a smoothed curve first reached a target (interpolated)."""

    time_s: float
    step: float


def time_to_target(
    eval_steps: Sequence[int],
    eval_times: Sequence[float],
    eval_losses: Sequence[float],
    target: float,
    *,
    window: int = DEFAULT_WINDOW,
    settled: bool = False,
) -> Crossing | None:
    """First time the smoothed curve is at or below ``target`` (``None``: never).

    Between the evaluation before and the one at the crossing, time and step are
    interpolated linearly in the loss. ``settled=True`` only accepts crossings at points
    whose smoothing window is complete (not the last ``window // 2`` points): the rule the
    workers use to stop a run early, since later evaluations cannot move those points.
    """
    curve = smooth(list(eval_losses), window)
    limit = len(curve) - (window // 2 if settled else 0)
    for i in range(min(limit, len(curve))):
        if curve[i] <= target:
            if i == 0:
                return Crossing(float(eval_times[0]), float(eval_steps[0]))
            hi, lo = curve[i - 1], curve[i]
            w = (hi - target) / (hi - lo) if hi > lo else 1.0
            t = eval_times[i - 1] + w * (eval_times[i] - eval_times[i - 1])
            s = eval_steps[i - 1] + w * (eval_steps[i] - eval_steps[i - 1])
            return Crossing(float(t), float(s))
    return None


def reached_all(eval_steps: Sequence[int], eval_losses: Sequence[float],
                targets: Sequence[float], *, window: int = DEFAULT_WINDOW) -> bool:
    """Whether every target has a settled crossing (the early-stopping rule)."""
    times = [float(s) for s in eval_steps]
    return all(time_to_target(eval_steps, times, eval_losses, t, window=window, settled=True)
               is not None for t in targets)


def seed_speedup(base: Sequence[Crossing | None], run: Sequence[Crossing | None]
                 ) -> float | None:
    """Geometric mean over targets of baseline time / run time (``None``: a target missed)."""
    ratios = []
    for b, r in zip(base, run, strict=True):
        if b is None or r is None:
            return None
        if r.time_s <= 0 or b.time_s <= 0:
            continue
        ratios.append(b.time_s / r.time_s)
    if not ratios:
        return None
    return math.exp(math.fsum(math.log(x) for x in ratios) / len(ratios))


@dataclass(frozen=True)
class Summary:
    """One codec over all seeds.

    Attributes:
        label: the codec's row name.
        speedups: per seed, its speedup (``None``: a target missed in that seed).
        reached: seeds in which every target was reached.
        seeds: seeds run.
    """

    label: str
    speedups: tuple[float | None, ...]

    @property
    def seeds(self) -> int:
        return len(self.speedups)

    @property
    def reached(self) -> int:
        return sum(s is not None for s in self.speedups)

    @property
    def values(self) -> list[float]:
        return [s for s in self.speedups if s is not None]

    @property
    def median(self) -> float | None:
        """Median speedup over the seeds that reached every target (``None``: none did)."""
        vals = self.values
        return statistics.median(vals) if vals else None

    @property
    def interval(self) -> tuple[float, float] | None:
        """Lowest and highest speedup over the seeds that reached every target."""
        vals = self.values
        return (min(vals), max(vals)) if vals else None

    def describe(self) -> str:
        """``"2.10x [1.80-2.40x]"``, ``"2.10x [1.80-2.40x], in 2 of 3 seeds"`` or ``"never"``."""
        med, iv = self.median, self.interval
        if med is None or iv is None:
            return "never"
        text = f"{med:.2f}x [{iv[0]:.2f}-{iv[1]:.2f}x]" if self.seeds > 1 else f"{med:.2f}x"
        if self.reached < self.seeds:
            text += f", in {self.reached} of {self.seeds} seeds"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "speedups": list(self.speedups), "median": self.median,
                "interval": list(self.interval) if self.interval else None,
                "reached_seeds": self.reached, "seeds": self.seeds}


def summarize(label: str, speedups: Sequence[float | None]) -> Summary:
    return Summary(label, tuple(speedups))


def _names(names: Sequence[str]) -> str:
    if len(names) == 1:
        return names[0]
    return ", ".join(names[:-1]) + " and " + names[-1]


def verdict(summaries: Sequence[Summary], *, baseline: str, budget: float) -> str:
    """The one-line verdict: the fastest codec to the baseline's loss, and which miss it.

    ``summaries`` exclude the baseline.
    """
    reach = [s for s in summaries if s.reached == s.seeds and s.median is not None]
    partial = [s for s in summaries if 0 < s.reached < s.seeds]
    missing = [s for s in summaries if s.reached == 0]
    parts: list[str] = []
    n = max((s.seeds for s in summaries), default=1)
    over = f" over {n} seeds" if n > 1 else " (1 seed)"
    if reach:
        best = max(reach, key=lambda s: s.median or 0.0)
        iv = best.interval
        assert best.median is not None and iv is not None
        word = "sooner" if best.median >= 1 else "later (slower)"
        factor = best.median if best.median >= 1 else 1 / best.median
        span = f" [{iv[0]:.1f}-{iv[1]:.1f}x{over}]" if n > 1 else over
        parts.append(f"on this network {best.label} reaches {baseline}'s loss {factor:.1f}x "
                     f"{word}{span}")
    else:
        parts.append(f"on this network no codec reaches {baseline}'s loss in every seed")
    if partial:
        parts.append(_names([f"{s.label} ({s.reached} of {s.seeds} seeds)" for s in partial])
                     + f" reach{'es' if len(partial) == 1 else ''} it only sometimes")
    if missing:
        verb = "does" if len(missing) == 1 else "do"
        parts.append(f"{_names([s.label for s in missing])} {verb} not reach it within "
                     f"{budget:g}x {baseline}'s steps")
    return "; ".join(parts)


__all__ = [
    "DEFAULT_BUDGET",
    "DEFAULT_FRACTIONS",
    "DEFAULT_WINDOW",
    "Crossing",
    "Summary",
    "check_fractions",
    "reached_all",
    "seed_speedup",
    "smooth",
    "summarize",
    "targets_from_baseline",
    "time_to_target",
    "verdict",
]
