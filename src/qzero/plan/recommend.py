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

    def describe(self) -> str:
        intra = f"zero_quantized_gradients_intra_node={self.intra_node}, " if self.intra_node != "none" else ""
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


def recommend(arms: list[Arm], w: Workload, cluster: Cluster, compute: float) -> Recommendation:
    """The fastest projected qzero arm with buckets sized for ``cluster`` (see the note)."""
    best: tuple[Prediction, Arm, Workload] | None = None
    for arm in arms:
        if arm.system != "qzero" or (arm.two_level and (cluster.nodes == 1 or cluster.gpus_per_node == 1)):
            continue
        sized = dataclasses.replace(w, allgather_bucket=bucket_for(arm, w, cluster, "allgather_bucket", "forward"),
                                    reduce_bucket=bucket_for(arm, w, cluster, "reduce_bucket", "backward"))
        p = predict(arm, sized, cluster, compute)
        if best is None or p.step_ms < best[0].step_ms:
            best = (p, arm, sized)
    if best is None:
        raise ValueError("no qzero arm to recommend")
    p, arm, sized = best
    fsdp2 = next((predict(a, w, cluster, compute).step_ms for a in arms if a.system == "fsdp2"), p.step_ms)
    return Recommendation(arm.name, arm.two_level, sized.allgather_bucket, sized.reduce_bucket, p.step_ms,
                          fsdp2 / p.step_ms, arm.intra_node.fmt if arm.intra_node is not None else "none")
