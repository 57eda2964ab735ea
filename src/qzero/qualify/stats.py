"""Statistics of a qualification: ratio of medians with a bootstrap interval, and the gates."""

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
    ratios = sorted(
        speedup(rng.choices(baseline, k=len(baseline)), rng.choices(candidate, k=len(candidate)))
        for _ in range(resamples)
    )
    lo = ratios[int(math.floor((1 - level) / 2 * (resamples - 1)))]
    hi = ratios[int(math.ceil((1 + level) / 2 * (resamples - 1)))]
    return lo, hi


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
        a["losses"] == first["losses"] and a["grad_norms"] == first["grad_norms"] and a["sample_hash"] == first["sample_hash"]
        for a in arms[1:]
    )
