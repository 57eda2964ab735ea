"""Settings the plan recommends for qzero on a cluster: the mode, two-level collectives on or
off, and bucket sizes that grow with the world.

[Note: buckets that grow with the world]
A collective pays its latency steps (``P-1`` for a ring over the world) before its bytes, so
at a fixed bucket size the latency share grows with the world. The plan picks, from
:data:`BUCKET_CHOICES`, the smallest bucket whose collectives spend at most
:data:`LATENCY_SHARE` of their time in latency (the largest choice if none does): smaller
buckets start overlapping the backward sooner and hold less memory; each bucket in flight
holds a staging buffer of its size in the reduce dtype, so the largest choice is bounded.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .arms import Arm, Workload, calls
from .cluster import Cluster
from .collectives import collective_cost
from .step import Prediction, predict

LATENCY_SHARE = 0.05
#: The order ``auto`` did not pick is advised only where it pads the parameters at most this much
#: (every shard, gather and optimizer state grows by it) and saves at least :data:`ORDER_GAIN` of
#: the step.
MAX_ORDER_PADDING = 0.6
ORDER_GAIN = 0.05
BUCKET_CHOICES = (10_000_000, 25_000_000, 50_000_000, 100_000_000, 200_000_000, 500_000_000, 1_000_000_000)


@dataclass(frozen=True)
class Recommendation:
    arm: str
    two_level: bool
    allgather_bucket_size: int
    reduce_bucket_size: int
    step_ms: float
    speedup_vs_fsdp2: float
    intra_node: str = "none"
    """``zero_quantized_gradients_intra_node`` of the arm."""
    flat_order: str | None = None
    """``flat_order`` to set where the other order than ``auto``'s wins (None: leave ``auto``)."""
    padding: float = 0.0
    """How much that order pads the parameters (0.25: every shard and state a quarter larger)."""

    def describe(self) -> str:
        intra = f"zero_quantized_gradients_intra_node={self.intra_node}, " if self.intra_node != "none" else ""
        if self.flat_order is not None:
            intra += (f"flat_order={self.flat_order} (pads the parameters by {self.padding:.0%}: every shard, "
                      "gather and optimizer state grows by that much), ")
        return (f"{self.arm}: two-level collectives {'on' if self.two_level else 'off'}, {intra}"
                f"allgather_bucket_size={self.allgather_bucket_size:.3g}, "
                f"reduce_bucket_size={self.reduce_bucket_size:.3g}"
                f" -> {self.step_ms:,.1f} ms a step projected ({self.speedup_vs_fsdp2:.2f}x FSDP2)")


def latency_share(arm: Arm, w: Workload, cluster: Cluster, phase: str) -> float:
    costs = [collective_cost(cluster, c.op, c.scope, c.nbytes, c.incast) for c in calls(arm, w, cluster)
             if c.phase == phase or (phase == "forward" and c.phase == "sync" and "weight" in c.label)
             or (phase == "backward" and c.phase == "after_backward")]
    total = sum(c.seconds for c in costs)
    return sum(c.latency for c in costs) / total if total else 0.0


def bucket_for(arm: Arm, w: Workload, cluster: Cluster, field: str, phase: str) -> int:
    """The smallest of :data:`BUCKET_CHOICES` whose ``phase`` collectives keep latency under
    :data:`LATENCY_SHARE` (see the note)."""
    for b in BUCKET_CHOICES:
        if latency_share(arm, dataclasses.replace(w, **{field: b}), cluster, phase) <= LATENCY_SHARE:
            return b
    return BUCKET_CHOICES[-1]


def recommend(arms: list[Arm], w: Workload, cluster: Cluster, compute: float,
              other_order: Workload | None = None) -> Recommendation:
    """The fastest projected qzero arm with buckets sized for ``cluster`` (see the note), in
    ``w``'s flat order or, where given and faster, ``other_order``'s (the same model in the
    order ``flat_order="auto"`` did not pick: ``flat_order`` is then part of the advice)."""
    best = _fastest(arms, w, cluster, compute)
    if other_order is not None and other_order.moved / other_order.params - 1 <= MAX_ORDER_PADDING:
        other = _fastest(arms, other_order, cluster, compute)
        if other is not None and best is not None and other[0].step_ms <= (1 - ORDER_GAIN) * best[0].step_ms:
            best = other
    if best is None:
        raise ValueError("no qzero arm to recommend")
    p, arm, sized = best
    fsdp2 = next((predict(a, w, cluster, compute).step_ms for a in arms if a.system == "fsdp2"), p.step_ms)
    order = sized.order if sized.order != w.order else None
    return Recommendation(arm.name, arm.two_level, sized.allgather_bucket, sized.reduce_bucket, p.step_ms,
                          fsdp2 / p.step_ms, arm.intra_node.fmt if arm.intra_node is not None else "none",
                          order, sized.moved / sized.params - 1 if order else 0.0)


def _fastest(arms: list[Arm], load: Workload, cluster: Cluster, compute: float):
    """``(prediction, arm, sized workload)`` of the fastest qzero arm on ``load`` (None: none)."""
    best: tuple[Prediction, Arm, Workload] | None = None
    for arm in arms:
        if arm.system != "qzero" or (arm.two_level and (cluster.nodes == 1 or cluster.gpus_per_node == 1)):
            continue
        sized = dataclasses.replace(
            load, allgather_bucket=bucket_for(arm, load, cluster, "allgather_bucket", "forward"),
            reduce_bucket=bucket_for(arm, load, cluster, "reduce_bucket", "backward"))
        p = predict(arm, sized, cluster, compute)
        if best is None or p.step_ms < best[0].step_ms:
            best = (p, arm, sized)
    return best
