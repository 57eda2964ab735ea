"""The arms the plan compares, and the collectives each one runs in a training step.

[Note: the arms' collectives]
Per step, for a model of ``D`` parameters on ``P = n·L`` ranks (stage 2, bf16 weights and
gradient reduction; a bucket of ``B`` elements):

* **FSDP2** (``reshard_after_forward=False``): per unit (a layer; ``units`` of them) one bf16
  all-gather over the world in the forward (prefetched) and one bf16 reduce-scatter in the
  backward.
* **FSDP2 HSDP** (shard inside the node, replicate across): the all-gather and the
  reduce-scatter over the node, then an all-reduce of the node's ``1/L`` shard over the rail.
* **DeepSpeed ZeRO-2**: each bucket reduced to its owners (one ``reduce`` per owner's range,
  the partitions owner-contiguous: about ``max(P, D/B)`` reduces a step), then the bf16
  all-gather of the updated partitions after the step, synchronous.
* **qzero, flat** (today): the weight gather all-gathers each chunk's payload over the world
  (``qzero plain``: bf16, synchronous after the step; quantized: with gather-ahead, under the
  next forward). Gradients per bucket: plain, a bf16 reduce-scatter (interleaved order) or
  reduces to the bucket's owner (contiguous); quantized, one all-to-all over the world whose
  pieces are ``1/P`` of the bucket for every rank. In the contiguous order that bucket is a
  window of every partition, complete only when the backward ends: the exchange runs after it
  (phase ``after_backward``; on two ranks a flat range goes to its owner under the backward).
* **qzero, two-level**: gradients per bucket, a bf16 reduce-scatter inside the node (each
  local rank gets ``1/L``, summed over the node), then over the rail (``n`` ranks) on that
  ``1/L``: the quantized all-to-all (never an incast: ownership is renumbered rail-major), or
  for plain gradients a bf16 reduce-scatter. Quantized, in the contiguous order, the windows run
  after the backward as in the flat case. Weights: the payload all-gathered over the rail
  (each rank owning ``D/P``), then over the node, payload bytes. The two stages pipeline
  bucket by bucket (:mod:`qzero.plan.step`). With a quantized node stage (``INT8 inside``:
  ``zero_quantized_gradients_intra_node="int8"``) the node's reduce-scatter is an all-to-all of
  INT8 pieces of ``1/L`` of the bucket for every local rank, and the rail's pieces carry small
  parameters in fp32 (the node's sums).

Not modelled: the exact resync of delta gathers (a plain gather every
``zero_quantized_weights_delta_resync_steps``-th step: +0.3% of the bytes at the default), the
flat buffer's padding, the small collectives of agreement checks, loss and norms.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..layout.gather_planner import DEFAULT_BUCKET_NUMEL
from ..vocabulary import FLAT_ORDERS
from .cluster import Cluster
from .payloads import Payload, gradient_payload, intra_node_payload, weight_payload

#: DeepSpeed's default ``reduce_bucket_size`` and ``allgather_bucket_size`` (elements).
DEEPSPEED_BUCKET = 500_000_000
PHASES = ("forward", "backward", "after_backward", "sync")


@dataclass(frozen=True)
class Workload:
    """The model as the plan sees it: ``params`` trainable elements, ``exact_params`` of them in
    small parameters (sent exactly), ``units`` FSDP2 units (layers), the buckets qzero uses
    (elements), the flat order of qzero's arms, and element sizes (bf16: 2 bytes)."""

    params: int
    exact_params: int = 0
    units: int = 1
    allgather_bucket: int = DEFAULT_BUCKET_NUMEL
    reduce_bucket: int = DEFAULT_BUCKET_NUMEL
    order: str = "interleaved"
    weight_bytes: int = 2
    reduce_bytes: int = 2
    flat_numel: int = 0
    """Elements of qzero's padded flat buffer (0: ``params``, no padding): what qzero's arms move."""
    gather_slots: tuple = ()
    """``((fmt, group_size, bytes per element), ...)``: what the weight gather's planner sends per
    element of the flat buffer for a payload format (every rank sends its chunk's slot, the
    largest rank's payload: where small parameters crowd into a few partitions this is more
    than the average); a format not listed is costed by :meth:`Payload.bytes_per_element`."""

    def __post_init__(self):
        if self.params < 1 or not 0 <= self.exact_params <= self.params:
            raise ValueError(f"params must be >= 1 and exact_params in [0, params], got {self.params}, "
                             f"{self.exact_params}")
        for name in ("units", "allgather_bucket", "reduce_bucket"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.flat_numel and self.flat_numel < self.params:
            raise ValueError(f"flat_numel {self.flat_numel} is below params {self.params}")
        if self.order not in FLAT_ORDERS[1:]:
            raise ValueError(f"order must be interleaved or contiguous, got {self.order!r}")

    @property
    def exact_share(self) -> float:
        return self.exact_params / self.moved

    def gather_bytes_per_element(self, payload: Payload | None) -> float:
        """Bytes the weight gather sends per flat element with ``payload`` (None: plain)."""
        if payload is None:
            return float(self.weight_bytes)
        for fmt, group, per in self.gather_slots:
            if (fmt, group) == (payload.fmt, payload.group_size):
                return per
        return payload.bytes_per_element(self.exact_share)

    @property
    def moved(self) -> int:
        """Elements qzero's collectives carry: the flat buffer, padding included."""
        return self.flat_numel or self.params


@dataclass(frozen=True)
class Arm:
    """One way to train: ``system`` (fsdp2, hsdp, deepspeed, qzero), qzero's weight and gradient
    payloads (None: plain), delta gathers, two-level collectives, gather-ahead."""

    name: str
    system: str
    weights: Payload | None = None
    gradients: Payload | None = None
    two_level: bool = False
    gather_ahead: bool = False
    intra_node: Payload | None = None
    """The quantized node stage's payload (two-level, quantized gradients), or None: plain."""


def default_arms() -> list[Arm]:
    """FSDP2, FSDP2 HSDP, DeepSpeed ZeRO-2, qzero's four modes flat and two-level, and the two
    quantized-gradient modes two-level with an INT8 node stage."""
    int8, delta = weight_payload(False), weight_payload(True)
    modes = [("plain", None, None), ("INT8", int8, None), ("INT8 + INT8 grads", int8, gradient_payload("int8")),
             ("INT4 delta + INT4 grads", delta, gradient_payload("int4"))]
    arms = [Arm("FSDP2", "fsdp2"), Arm("FSDP2 HSDP", "hsdp"), Arm("DeepSpeed ZeRO-2", "deepspeed")]
    for two_level in (False, True):
        for label, w, g in modes:
            name = f"qzero {label}" + (" (two-level)" if two_level else "")
            arms.append(Arm(name, "qzero", w, g, two_level, gather_ahead=w is not None))
    for label, w, g in modes[2:]:
        arms.append(Arm(f"qzero {label} (two-level, INT8 inside)", "qzero", w, g, True, gather_ahead=True,
                        intra_node=intra_node_payload(g)))
    return arms


@dataclass(frozen=True)
class Call:
    """``count`` collectives ``op`` on every group of ``scope`` at once, each of ``nbytes`` (as
    :func:`qzero.plan.collectives.collective_cost` reads it), in ``phase`` (``forward``: hidden
    under the forward, ``backward``: under the backward, ``after_backward`` and ``sync``:
    exposed); ``stage`` orders the two stages of a two-level collective, which pipeline."""

    label: str
    op: str
    scope: str
    nbytes: float
    count: int
    phase: str
    incast: bool = False
    stage: int = 0


def calls(arm: Arm, w: Workload, cluster: Cluster) -> list[Call]:
    """The collectives of one step of ``arm`` (see [Note: the arms' collectives])."""
    if arm.system == "fsdp2":
        return _fsdp2(w, cluster, hybrid=False)
    if arm.system == "hsdp":
        return _fsdp2(w, cluster, hybrid=True)
    if arm.system == "deepspeed":
        return _deepspeed(w, cluster)
    if arm.system == "qzero":
        return _qzero_weights(arm, w, cluster) + _qzero_gradients(arm, w, cluster)
    raise ValueError(f"unknown system {arm.system!r}")


def _fsdp2(w: Workload, cluster: Cluster, hybrid: bool) -> list[Call]:
    P, L, u = cluster.world, cluster.gpus_per_node, w.units
    unit = w.params / u
    if not hybrid:
        return [Call("weight all-gather", "all_gather", "world", unit / P * w.weight_bytes, u, "forward"),
                Call("gradient reduce-scatter", "reduce_scatter", "world", unit * w.reduce_bytes, u, "backward")]
    return [Call("weight all-gather (node)", "all_gather", "node", unit / L * w.weight_bytes, u, "forward"),
            Call("gradient reduce-scatter (node)", "reduce_scatter", "node", unit * w.reduce_bytes, u, "backward"),
            Call("gradient all-reduce (rail)", "all_reduce", "rail", unit / L * w.reduce_bytes, u, "backward",
                 stage=1)]


def _owner_reduces(numel: int, w: Workload, cluster: Cluster, bucket: int, label: str) -> Call:
    """Buckets reduced to owner-contiguous partitions: one chain reduce per owner's range."""
    count = max(cluster.world, math.ceil(numel / bucket)) if cluster.world > 1 else 1
    return Call(label, "reduce", "world", numel / count * w.reduce_bytes, count, "backward")


def _deepspeed(w: Workload, cluster: Cluster) -> list[Call]:
    chunks = math.ceil(w.params / DEEPSPEED_BUCKET)
    return [_owner_reduces(w.params, w, cluster, DEEPSPEED_BUCKET, "gradient reduces to owners"),
            Call("weight all-gather", "all_gather", "world", w.params / chunks / cluster.world * w.weight_bytes,
                 chunks, "sync")]


def _qzero_weights(arm: Arm, w: Workload, cluster: Cluster) -> list[Call]:
    P, L = cluster.world, cluster.gpus_per_node
    moved = w.moved
    chunks = math.ceil(moved / w.allgather_bucket)
    per = w.gather_bytes_per_element(arm.weights)
    phase = "forward" if arm.gather_ahead else "sync"
    chunk = moved / chunks
    if not arm.two_level:
        return [Call("weight all-gather", "all_gather", "world", chunk / P * per, chunks, phase)]
    return [Call("weight all-gather (rail)", "all_gather", "rail", chunk / P * per, chunks, phase),
            Call("weight all-gather (node)", "all_gather", "node", chunk / L * per, chunks, phase, stage=1)]


def _qzero_gradients(arm: Arm, w: Workload, cluster: Cluster) -> list[Call]:
    P, L = cluster.world, cluster.gpus_per_node
    buckets = math.ceil(w.moved / w.reduce_bucket)
    bucket = w.moved / buckets
    q = arm.gradients.bytes_per_element(w.exact_share) if arm.gradients else None
    # quantized windows of the contiguous order complete when the backward ends
    windows = "after_backward" if q is not None and w.order == "contiguous" else "backward"
    if arm.two_level and arm.intra_node is not None:
        node = arm.intra_node.bytes_per_element(w.exact_share)
        rail = dataclasses.replace(arm.gradients, plain_bytes=4).bytes_per_element(w.exact_share)  # fp32 sums
        return [Call("quantized gradient all-to-all (node)", "all_to_all", "node", bucket / L * node, buckets,
                     windows),
                Call("quantized gradient all-to-all (rail)", "all_to_all", "rail", bucket / P * rail, buckets,
                     windows, stage=1)]
    if q is None and w.order == "contiguous":  # flat ranges reduced to their owners, two-level or not
        return [_owner_reduces(w.moved, w, cluster, w.reduce_bucket, "gradient reduces to owners")]
    if arm.two_level:
        first = Call("gradient reduce-scatter (node)", "reduce_scatter", "node", bucket * w.reduce_bytes, buckets,
                     windows)
        if q is None:
            return [first, Call("gradient reduce-scatter (rail)", "reduce_scatter", "rail",
                                bucket / L * w.reduce_bytes, buckets, "backward", stage=1)]
        return [first, Call("quantized gradient all-to-all (rail)", "all_to_all", "rail", bucket / P * q, buckets,
                            windows, stage=1)]
    if q is None:
        return [Call("gradient reduce-scatter", "reduce_scatter", "world", bucket * w.reduce_bytes, buckets,
                     "backward")]
    if w.order == "contiguous" and P <= 2:  # a flat range to its owner, the other rank
        return [Call("quantized gradient all-to-all (owner)", "all_to_all", "world", bucket * q, buckets,
                     "backward", incast=True)]
    return [Call("quantized gradient all-to-all", "all_to_all", "world", bucket / P * q, buckets, windows)]
