"""Statistics of a qualification: ratio of medians with a bootstrap interval, and the gates.

[Note: what the interval covers]
Step times of one run are not independent draws of the setting's speed: a run lands on a
quieter or busier stretch of the machine, a different placement, a warmer cache, and all its
steps share that. Resampling the steps of all arms pooled (:func:`bootstrap_ci`) then measures
only step-to-step noise within runs, and two runs of one command can give intervals that do
not overlap. :func:`bootstrap_ci_arms` resamples at both levels: the arms of each setting
(the runs the order repeats, ``BCCB``: two of each), then the steps within each drawn arm. Its
interval includes the run-to-run spread the arms show; with as few as two arms a setting it
still understates what more repeats would show, and with one arm a setting it reduces to the
step-level interval (:func:`interval_covers` says which, in words, for the report).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence


def speedup(baseline: Sequence[float], candidate: Sequence[float]) -> float:
    """How many times faster the candidate is: median baseline time / median candidate time."""
    return statistics.median(baseline) / statistics.median(candidate)


def relative_spread(values: Sequence[float]) -> float | None:
    """(largest - smallest) / smallest; None for fewer than two values."""
    if len(values) < 2:
        return None
    return (max(values) - min(values)) / min(values)


def bootstrap_ci(
    baseline: Sequence[float], candidate: Sequence[float], *, resamples: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of :func:`speedup`, resampling each arm's times independently."""
    if not baseline or not candidate:
        raise ValueError("bootstrap_ci needs at least one time in each arm")
    rng = random.Random(seed)
    return _percentiles([
        speedup(rng.choices(baseline, k=len(baseline)), rng.choices(candidate, k=len(candidate)))
        for _ in range(resamples)
    ], level)


def _percentiles(ratios: list[float], level: float) -> tuple[float, float]:
    """The central ``level`` interval of bootstrap resamples."""
    ratios = sorted(ratios)
    n = len(ratios)
    return ratios[int(math.floor((1 - level) / 2 * (n - 1)))], ratios[int(math.ceil((1 + level) / 2 * (n - 1)))]


def bootstrap_ci_arms(
    baseline: Sequence[Sequence[float]], candidate: Sequence[Sequence[float]], *, resamples: int = 2000,
    level: float = 0.95, seed: int = 0,
) -> tuple[float, float]:
    """Two-level percentile bootstrap interval of :func:`speedup` (see [Note: what the interval
    covers]): per resample, draw each setting's arms with replacement, then each drawn arm's
    step times with replacement, and take the ratio of the pooled medians."""
    if not baseline or not candidate or not all(baseline) or not all(candidate):
        raise ValueError("bootstrap_ci_arms needs at least one arm with step times in each setting")
    rng = random.Random(seed)

    def draw(arms: Sequence[Sequence[float]]) -> list[float]:
        return [t for arm in rng.choices(arms, k=len(arms)) for t in rng.choices(arm, k=len(arm))]

    return _percentiles([speedup(draw(baseline), draw(candidate)) for _ in range(resamples)], level)


def interval_covers(baseline_arms: int, candidate_arms: int) -> str:
    """What the interval of :func:`bootstrap_ci_arms` covers for these arm counts, in words."""
    if min(baseline_arms, candidate_arms) >= 2:
        return (f"run-to-run spread as far as {baseline_arms} baseline and {candidate_arms} candidate arms show it "
                "(arms resampled, then steps within arms); more repeats (--repeats) can widen it")
    return ("mostly step-to-step noise within runs: a setting with a single arm shows nothing of the spread "
            "between its runs, so the interval understates it (use an order with two arms of each, e.g. BCCB)")


def param_agreement(a: Sequence[float], b: Sequence[float], atol: float = 0.02, rtol: float = 0.02) -> dict:
    """Relative L2, max abs difference and violations of ``|a - b| <= atol + rtol * |b|``."""
    if len(a) != len(b):
        raise ValueError(f"parameter samples differ in length: {len(a)} vs {len(b)}")
    diff = [x - y for x, y in zip(a, b)]
    norm_b = math.sqrt(sum(y * y for y in b))
    return {
        "param_rel_l2": math.sqrt(sum(d * d for d in diff)) / norm_b if norm_b else 0.0,
        "param_max_abs_diff": max((abs(d) for d in diff), default=0.0),
        "tolerance_violations": sum(1 for d, y in zip(diff, b) if not abs(d) <= atol + rtol * abs(y)),
    }


def max_loss_diff(a: Sequence[float], b: Sequence[float]) -> float:
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def reproduced(arms: Sequence[dict]) -> bool:
    """Arms of one setting must agree exactly: losses, gradient norms, sampled weights."""
    first = arms[0]
    return all(
        a["losses"] == first["losses"] and a["grad_norms"] == first["grad_norms"]
        and a["sample_hash"] == first["sample_hash"]
        for a in arms[1:]
    )
