"""A step's predicted time: the 1-GPU compute step plus the communication it cannot hide.

[Note: overlap]
Inputs: ``compute`` (seconds), the 1-GPU step of the whole model at the per-rank micro-batch
(forward, backward, optimizer; no communication), and ``forward_share`` of it spent in the
forward (1/3 by default: a backward does about twice a forward's arithmetic). The phases of an
arm's collectives (:class:`qzero.plan.arms.Call`):

* ``forward``: prefetched under the forward (FSDP2's all-gathers, qzero's gather-ahead). The
  first unit or chunk must arrive before the forward can start, so the exposed time is
  ``max(first call, phase - forward)``.
* ``backward``: stage-2 gradient reduction, under the backward; the last bucket is ready only
  when the backward ends: ``max(last call, phase - backward)``.
* ``after_backward``: a reduction that can start only when the backward ends (qzero's quantized
  windows in the contiguous order: every window holds a stretch of partition 0, the model's
  first layers, whose gradients come last): all of it.
* ``sync``: after the step, waited for (qzero's plain gather, DeepSpeed's all-gather): all of it.

A phase's link time is the sum of its collectives (they run one after another on one stream);
the two stages of a two-level collective run on different links (the node's fabric, then the
NIC) and pipeline bucket by bucket: ``max(stage 0, stage 1) + min(one call of each)``.

What is assumed and not calibrated: that communication does not slow the compute it overlaps
(NCCL's kernels take SMs and memory bandwidth: a few percent of a step, measured on one GPU
in the link-emulation notes), that a collective runs at its modelled rate from the moment it is
issued, and the pack/unpack kernels of the quantized arms (about 10 ms a step for a 4B model on
an H200, not included). Predictions are projections.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .arms import Arm, Call, Workload, calls
from .cluster import Cluster
from .collectives import collective_cost
from .cost import Cost

DEFAULT_FORWARD_SHARE = 1 / 3


@dataclass(frozen=True)
class CallCost:
    call: Call
    one: Cost  # one collective of the call

    @property
    def total(self) -> float:
        return self.one.seconds * self.call.count


@dataclass
class Prediction:
    """One arm on one cluster: what the plan projects."""

    arm: str
    nodes: int
    gpus_per_node: int
    bits_per_param_per_node: float
    link_ms: float
    exposed_ms: float
    step_ms: float
    efficiency: float
    phases_ms: dict = field(default_factory=dict)
    calls: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"arm": self.arm, "nodes": self.nodes, "gpus_per_node": self.gpus_per_node,
                "bits_per_param_per_node": self.bits_per_param_per_node, "link_ms": self.link_ms,
                "exposed_ms": self.exposed_ms, "step_ms": self.step_ms, "scaling_efficiency": self.efficiency,
                "phases_ms": self.phases_ms, "collectives": self.calls}


def phase_seconds(costs: list[CallCost]) -> float:
    """Link time of one phase (see the note)."""
    stages = {}
    for c in costs:
        stages.setdefault(c.call.stage, []).append(c)
    if len(stages) < 2:
        return sum(c.total for c in costs)
    totals = [sum(c.total for c in s) for s in stages.values()]
    ones = [sum(c.one.seconds for c in s) for s in stages.values()]
    return max(totals) + min(ones)


def _one_unit(costs: list[CallCost]) -> float:
    """One call of each stage: what cannot overlap at a phase's edge."""
    return sum(c.one.seconds for c in costs)


def predict(arm: Arm, workload: Workload, cluster: Cluster, compute: float,
            forward_share: float = DEFAULT_FORWARD_SHARE) -> Prediction:
    """Project one step of ``arm`` (see the note); ``compute`` in seconds."""
    costs = [CallCost(c, collective_cost(cluster, c.op, c.scope, c.nbytes, c.incast))
             for c in calls(arm, workload, cluster)]
    hide = {"forward": compute * forward_share, "backward": compute * (1 - forward_share), "after_backward": 0.0,
            "sync": 0.0}
    phases, exposed = {}, 0.0
    for phase, under in hide.items():
        mine = [c for c in costs if c.call.phase == phase]
        if not mine:
            continue
        t = phase_seconds(mine)
        phases[phase] = 1e3 * t
        exposed += t if not under else max(_one_unit(mine), t - under)
    nic = sum(c.one.nic_sent * c.call.count for c in costs)
    bits = 8 * nic / cluster.nodes / workload.params
    link = sum(phases.values())
    step = 1e3 * (compute + exposed)
    rows = [{"collective": c.call.label, "op": c.call.op, "scope": c.call.scope, "count": c.call.count,
             "bytes": c.call.nbytes, "ms_each": 1e3 * c.one.seconds, "ms": 1e3 * c.total, "phase": c.call.phase,
             "bound_by": c.one.busiest} for c in costs]
    return Prediction(arm.name, cluster.nodes, cluster.gpus_per_node, bits, link, 1e3 * exposed, step,
                      1e3 * compute / step if step else 1.0, phases, rows)
