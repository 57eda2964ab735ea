"""A :class:`qzero.plan.arms.Workload` from a model's parameter shapes: how many elements it
has, which travel exactly (small parameters), and the padded flat buffer and flat order that
qzero's planner (:func:`qzero.layout.plan_flat_layout`) gives it at a world size."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..layout.flat_layout import DEFAULT_SMALL_PARAM_NUMEL, is_small_param, plan_flat_layout
from ..layout.gather_planner import DEFAULT_BUCKET_NUMEL
from .arms import Workload
from .payloads import Payload, weight_payload


def workload_from_shapes(shapes: Sequence[Sequence[int]], world: int, *, units: int = 1,
                         small_param_numel: int = DEFAULT_SMALL_PARAM_NUMEL, flat_order: str = "auto",
                         allgather_bucket: int = DEFAULT_BUCKET_NUMEL,
                         reduce_bucket: int = DEFAULT_BUCKET_NUMEL,
                         payloads: Sequence[Payload] | None = None) -> Workload:
    """The workload of parameters of ``shapes`` trained by qzero on ``world`` ranks (``auto``
    resolved as the planner resolves it), with the weight gather's bytes for each of
    ``payloads`` (default: INT8 weights and INT4 differences, the default arms') from its planner.
    Planning costs a few tens of milliseconds for a 4B model at a thousand ranks."""
    if payloads is None:
        payloads = (weight_payload(False), weight_payload(True))
    sizes = [math.prod(s) for s in shapes]
    layout = plan_flat_layout(shapes, world, small_param_numel=small_param_numel, flat_order=flat_order)
    exact = sum(n for n in sizes if n > 0 and is_small_param(n, small_param_numel))
    slots = []
    for payload in payloads:
        gather = plan_flat_layout(shapes, world, small_param_numel=small_param_numel, flat_order=layout.order,
                                  allgather_bucket_size=allgather_bucket, zero_quantized_weights_format=payload.fmt,
                                  zero_quantized_weights_group_size=payload.group_size).gather
        slots.append((payload.fmt, payload.group_size,
                      sum(c.payload_bytes for c in gather.chunks) * world / gather.numel))
    return Workload(sum(sizes), exact, units=units, allgather_bucket=allgather_bucket, reduce_bucket=reduce_bucket,
                    order=layout.order, flat_numel=layout.numel, gather_slots=tuple(slots))
