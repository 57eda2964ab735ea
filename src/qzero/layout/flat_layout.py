"""The flat layout: where every parameter of a group sits in its flat buffer.

:func:`plan_flat_layout` packs parameters of the given shapes into one flat buffer padded
to whole partitions (:func:`padded_flat_numel`) in the flat order (``flat_order``:
``contiguous``, or ``interleaved`` by :func:`interleaved_starts`), makes the small
parameters exact ranges (:func:`is_small_param`), and plans the buffer's gather
(:func:`qzero.layout.gather_planner.plan_gather`). The :class:`FlatLayout` it returns is
what the optimizer's flat groups (:mod:`qzero.optim.flat`) and the gradient reduction's
planner (:mod:`qzero.buckets`) read. Pure: no process group, no tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..quant.formats import DEFAULT_FORMAT, DEFAULT_GROUP_SIZE, check_group_size
from ..vocabulary import FLAT_ORDERS, RENAMED_GATHER_KEYWORDS, refuse_renamed
from .gather_plan import GatherPlan, Range, merge_adjacent
from .gather_planner import DEFAULT_BUCKET_NUMEL, check_format, check_positive_int, plan_gather, round_up

#: ``small_param_numel``'s default: parameters with at most this many elements travel exactly.
DEFAULT_SMALL_PARAM_NUMEL = 65_536
#: ``flat_order="auto"`` takes the interleaved order unless it pads more than this share of the
#: parameters (a very large parameter placed late can leave partitions unbalanced).
AUTO_INTERLEAVE_MAX_PADDING = 0.03


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in the flat buffer."""

    index: int
    shape: tuple[int, ...]
    start: int
    numel: int
    exact: bool

    @property
    def stop(self) -> int:
        return self.start + self.numel


@dataclass(frozen=True)
class FlatLayout:
    """Parameters packed in order into one padded flat buffer, and its gather plan."""

    slots: tuple[ParamSlot, ...]
    used_numel: int
    numel: int
    world_size: int
    alignment: int
    gather: GatherPlan
    order: str = "contiguous"
    """How parameters were placed: ``contiguous`` or ``interleaved`` (the ``flat_order`` it was
    planned with, ``auto`` resolved; see :func:`plan_flat_layout`)."""

    @property
    def padding(self) -> int:
        return self.numel - self.used_numel

    @property
    def partition_numel(self) -> int:
        return self.numel // self.world_size

    def partition(self, rank: int) -> Range:
        return self.gather.partition(rank)

    @property
    def exact_ranges(self) -> tuple[Range, ...]:
        return self.gather.exact_ranges

    def padding_ranges(self, lo: int, hi: int) -> list[Range]:
        """The parts of ``[lo, hi)`` no parameter occupies, relative to ``lo``."""
        taken = sorted((max(s.start, lo), min(s.stop, hi)) for s in self.slots if s.start < hi and lo < s.stop)
        out, pos = [], lo
        for a, b in taken:
            if a > pos:
                out.append((pos - lo, a - lo))
            pos = max(pos, b)
        if pos < hi:
            out.append((pos - lo, hi - lo))
        return out

    def slots_in(self, lo: int, hi: int) -> list[tuple[ParamSlot, Range]]:
        """Parameters overlapping ``[lo, hi)``, each with the overlapping flat range."""
        out = []
        for s in self.slots:
            a, b = max(s.start, lo), min(s.stop, hi)
            if a < b:
                out.append((s, (a, b)))
        return out


@refuse_renamed(**RENAMED_GATHER_KEYWORDS)
def plan_flat_layout(
    shapes: Sequence[Sequence[int]],
    world_size: int,
    *,
    elem_size: int = 2,
    alignment: int | None = None,
    zero_quantized_weights_group_size: int = DEFAULT_GROUP_SIZE,
    small_param_numel: int = DEFAULT_SMALL_PARAM_NUMEL,
    allgather_bucket_size: int = DEFAULT_BUCKET_NUMEL,
    zero_quantized_weights_format: str | None = DEFAULT_FORMAT,
    flat_order: str = "contiguous",
    zero_quantized_weights_delta: bool = False,
) -> FlatLayout:
    """Pack parameters of ``shapes`` into a flat buffer and plan its gather.

    ``flat_order="contiguous"`` packs them back to back in the given order, padding at the tail;
    ``flat_order="interleaved"`` places them with :func:`interleaved_starts` (each partition in
    model order; padding at the end of every partition), which lets a gather that runs
    ahead of the forward finish chunks in the order the forward needs them.
    ``flat_order="auto"`` takes the interleaved order unless it pads more than
    :data:`AUTO_INTERLEAVE_MAX_PADDING` of the parameters beyond what the contiguous order pads.
    ``alignment`` defaults to the group size (so partitions hold whole groups).
    Parameters with at most ``small_param_numel`` elements become exact ranges. The format
    (None: the plain gather) and ``zero_quantized_weights_delta`` are :func:`plan_gather`'s.
    """
    fmt, group_size, order = zero_quantized_weights_format, zero_quantized_weights_group_size, flat_order
    check_positive_int("world_size", world_size)
    if fmt is not None:
        check_group_size(group_size, "zero_quantized_weights_group_size")
        check_format(fmt)
    alignment = group_size if alignment is None else alignment
    check_positive_int("alignment", alignment)
    if isinstance(small_param_numel, bool) or not isinstance(small_param_numel, int) or small_param_numel < 0:
        raise ValueError(f"small_param_numel must be an integer >= 0, got {small_param_numel!r}")
    sizes, shapes_t = [], []
    for i, shape in enumerate(shapes):
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"parameter {i} has a negative dimension in shape {shape}")
        shapes_t.append(shape)
        sizes.append(math.prod(shape))
    if order not in FLAT_ORDERS:
        raise ValueError(f"flat_order must be one of {FLAT_ORDERS}, got {order!r}")
    contiguous_numel = padded_flat_numel(sum(sizes), world_size, alignment)
    if order != "contiguous":
        starts, numel = interleaved_starts(sizes, world_size, alignment)
        if order == "auto":
            extra = numel - contiguous_numel
            order = "interleaved" if extra <= AUTO_INTERLEAVE_MAX_PADDING * sum(sizes) else "contiguous"
    if order == "contiguous":
        starts = [0] * len(sizes)
        for i in range(1, len(sizes)):
            starts[i] = starts[i - 1] + sizes[i - 1]
        numel = contiguous_numel
    slots = tuple(
        ParamSlot(i, shape, start, n, n > 0 and is_small_param(n, small_param_numel))
        for i, (shape, start, n) in enumerate(zip(shapes_t, starts, sizes))
    )
    exact = sorted((s.start, s.stop) for s in slots if s.exact) if fmt is not None else []
    gather = plan_gather(
        numel,
        world_size,
        elem_size=elem_size,
        allgather_bucket_size=allgather_bucket_size,
        zero_quantized_weights_format=fmt,
        zero_quantized_weights_group_size=group_size,
        exact_ranges=merge_adjacent(exact),
        zero_quantized_weights_delta=zero_quantized_weights_delta,
    )
    return FlatLayout(slots, sum(sizes), numel, world_size, alignment, gather, order)


def interleaved_starts(sizes: Sequence[int], world_size: int, alignment: int) -> tuple[list[int], int]:
    """Place parameters (in model order) so that each partition's local offsets follow model order.

    Every parameter goes to the partition filled least so far (ties: the lowest rank), at
    the end of what that partition holds. A parameter at model-order position ``x`` then
    sits near local offset ``x / world_size`` in its partition, so gather chunk ``k`` (local
    offsets ``[k c, (k+1) c)`` of every partition) holds one contiguous stretch of the model,
    and a forward that runs in model order needs the chunks in gather order. Partitions are
    padded to the fullest one (rounded up to ``alignment``); the imbalance is at most one
    parameter.
    """
    fills = [0] * world_size
    placed = []
    for n in sizes:
        r = min(range(world_size), key=lambda k: (fills[k], k))
        placed.append((r, fills[r]))
        fills[r] += n
    partition = max(round_up(max(fills, default=0), alignment), alignment)
    return [r * partition + off for r, off in placed], world_size * partition


def padded_flat_numel(used_numel: int, world_size: int, alignment: int) -> int:
    """Tail padding rule: the flat buffer is a multiple of ``world_size * alignment``
    (so every partition is a whole number of alignment units), and never empty."""
    return max(round_up(used_numel, world_size * alignment), world_size * alignment)


def is_small_param(numel: int, threshold: int) -> bool:
    """Small parameters (norms, biases, small embeddings) travel exactly."""
    return numel <= threshold
