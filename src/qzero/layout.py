"""Pure layout math: flat ranges, partitions, padding, exact ranges and gather chunks.

Nothing here touches a process group or allocates a tensor, so a DP1024 plan can be
checked on a laptop. Two plans are built:

* :func:`plan_gather` — for a flat buffer of ``numel`` elements shared by
  ``world_size`` ranks: the chunk boundaries inside every partition, and for each
  chunk the exact payload layout (values, scales, side channel), fixed once.
* :func:`plan_flat_layout` — from ordered parameter shapes: each parameter's flat
  range, the tail padding, the exact ranges of small parameters, and its gather plan.

The bucket rule is a requirement, not a tuning knob: what one chunk gathers across
all ranks is bounded, ``world_size * chunk_numel <= bucket_numel``. The terms (flat
buffer, partition, chunk, payload, exact range, window) are defined in ``docs/design.md``.
"""

from __future__ import annotations

import bisect
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

from .quant.formats import SCALE_BYTES, check_group_size, get_format

DEFAULT_BUCKET_NUMEL = 500_000_000
DEFAULT_SMALL_PARAM_NUMEL = 65_536
FLAT_ORDERS = ("contiguous", "interleaved")
#: ``order="auto"`` takes the interleaved order unless it pads more than this share of the
#: parameters (a very large parameter placed late can leave partitions unbalanced).
AUTO_INTERLEAVE_MAX_PADDING = 0.03
#: Payload sections and whole payloads start on this many bytes.
PAYLOAD_ALIGN = 16
#: Formats whose payload may carry differences (``ZeroConfig.zero_quantized_weights_delta``).
DELTA_FORMATS = ("int4", "int8")

Range = tuple[int, int]


# --------------------------------------------------------------------------- padding rules


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def padded_flat_numel(used_numel: int, world_size: int, alignment: int) -> int:
    """Tail padding rule: the flat buffer is a multiple of ``world_size * alignment``
    (so every partition is a whole number of alignment units), and never empty."""
    return max(round_up(used_numel, world_size * alignment), world_size * alignment)


def chunk_numel_per_rank(partition_numel: int, world_size: int, bucket_numel: int, unit: int) -> int:
    """Elements of every partition that one chunk moves.

    The largest multiple of ``unit`` (a group, or one element for the plain gather)
    with ``world_size * chunk <= bucket_numel``, never below one unit, never above
    the partition (rounded up to a unit).
    """
    per_rank = (bucket_numel // world_size) // unit * unit
    per_rank = max(per_rank, unit)
    return min(per_rank, round_up(max(partition_numel, 1), unit))


def is_small_param(numel: int, threshold: int) -> bool:
    """Small parameters (norms, biases, small embeddings) travel exactly."""
    return numel <= threshold


# --------------------------------------------------------------------------- gather plan


@dataclass(frozen=True)
class PayloadLayout:
    """Byte offsets of one rank's payload for one chunk. The same on every rank."""

    values_offset: int
    scales_offset: int
    exact_offset: int
    exact_numel: int
    nbytes: int


@dataclass(frozen=True)
class ChunkPlan:
    """One round of the gather: ``[offset, offset + numel)`` of every partition."""

    index: int
    offset: int
    numel: int
    payload: PayloadLayout

    @property
    def payload_bytes(self) -> int:
        return self.payload.nbytes


@dataclass(frozen=True)
class GatherPlan:
    """Static plan of one (quantized or plain) gather over a flat buffer."""

    numel: int
    world_size: int
    elem_size: int
    bucket_numel: int
    fmt: str | None  # None: the plain gather, original dtype
    group_size: int
    chunk_numel: int
    chunks: tuple[ChunkPlan, ...]
    exact_ranges: tuple[Range, ...]
    delta: bool = False
    """The payload carries quantized differences against the replica ([Note: delta payload] in
    :mod:`qzero.quant.reference`); the same sections and layout as a weight payload."""
    _cache: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def partition_numel(self) -> int:
        return self.numel // self.world_size

    @property
    def quantized(self) -> bool:
        return self.fmt is not None

    @property
    def payload(self) -> str:
        """What a payload is: ``plain`` (the original elements), a format name (quantized
        weights) or ``<format> delta``."""
        return "plain" if self.fmt is None else f"{self.fmt} delta" if self.delta else self.fmt

    def partition(self, rank: int) -> Range:
        p = self.partition_numel
        return rank * p, (rank + 1) * p

    @property
    def max_recv_numel(self) -> int:
        """Largest number of elements one chunk gathers across all ranks."""
        return self.world_size * max((c.numel for c in self.chunks), default=0)

    @property
    def max_payload_bytes(self) -> int:
        return max((c.payload_bytes for c in self.chunks), default=0)

    @property
    def max_recv_bytes(self) -> int:
        return self.world_size * self.max_payload_bytes

    @property
    def bytes_per_rank(self) -> int:
        """Bytes each rank contributes to the whole gather."""
        return sum(c.payload_bytes for c in self.chunks)

    @property
    def plain_bytes_per_rank(self) -> int:
        """Bytes each rank would contribute to a plain gather of the same buffer."""
        return self.partition_numel * self.elem_size

    def exact_local_ranges(self, chunk: ChunkPlan, rank: int) -> list[Range]:
        """Exact ranges inside ``rank``'s slice of ``chunk``, relative to that slice."""
        lo = rank * self.partition_numel + chunk.offset
        return _clip_ranges(self.exact_ranges, lo, lo + chunk.numel)


def _clip_ranges(ranges: Sequence[Range], lo: int, hi: int) -> list[Range]:
    """The parts of sorted, disjoint ``ranges`` inside ``[lo, hi)``, shifted by ``-lo``."""
    out = []
    i = max(bisect.bisect_right(ranges, (lo, math.inf)) - 1, 0)
    while i < len(ranges) and ranges[i][0] < hi:
        a, b = ranges[i]
        a, b = max(a, lo), min(b, hi)
        if a < b:
            out.append((a - lo, b - lo))
        i += 1
    return out


def check_exact_ranges(exact_ranges, numel: int) -> tuple[Range, ...]:
    """Exact ranges must be sorted, non-empty, non-overlapping and inside ``[0, numel)``."""
    out: list[Range] = []
    prev_stop = 0
    for i, r in enumerate(exact_ranges):
        try:
            a, b = (operator.index(v) for v in r)  # integers only: 1.5 or "3" are refused, not truncated
        except (TypeError, ValueError):
            raise TypeError(f"exact_ranges[{i}] = {r!r} is not a (start, stop) pair of integers") from None
        if not 0 <= a < b <= numel:
            raise ValueError(f"exact_ranges[{i}] = ({a}, {b}) is out of range for a flat buffer of {numel} elements")
        if a < prev_stop:
            raise ValueError(
                f"exact_ranges[{i}] = ({a}, {b}) overlaps or precedes the previous range ending at {prev_stop}; "
                "ranges must be sorted and non-overlapping"
            )
        out.append((a, b))
        prev_stop = b
    return tuple(out)


def _exact_counts(exact_ranges: Sequence[Range], partition: int, chunk: int, n_chunks: int) -> list[int]:
    """For every chunk, the most exact elements any single rank has in it."""
    counts: dict[tuple[int, int], int] = {}
    for a, b in exact_ranges:
        pos = a
        while pos < b:
            rank, off = divmod(pos, partition)
            c = off // chunk
            stop = min(b, rank * partition + min((c + 1) * chunk, partition))
            counts[(rank, c)] = counts.get((rank, c), 0) + stop - pos
            pos = stop
    best = [0] * n_chunks
    for (_, c), k in counts.items():
        best[c] = max(best[c], k)
    return best


def plan_gather(
    numel: int,
    world_size: int,
    *,
    elem_size: int = 2,
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
    fmt: str | None = "int8",
    group_size: int = 64,
    exact_ranges: Sequence[Range] = (),
    delta: bool = False,
) -> GatherPlan:
    """Plan a gather of a flat buffer of ``numel`` elements over ``world_size`` ranks.

    ``fmt=None`` plans the plain gather (payload = the original elements). ``delta``: the
    payloads carry differences against the replica (``fmt`` one of :data:`DELTA_FORMATS`).
    Raises ``ValueError``/``TypeError`` naming the bad value.
    """
    if delta and fmt not in DELTA_FORMATS:
        raise ValueError(f"a delta payload is one of the formats {list(DELTA_FORMATS)}, got {fmt!r}")
    _check_positive_int("world_size", world_size)
    _check_positive_int("bucket_numel", bucket_numel)
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be a non-negative integer, got {numel!r}")
    if numel % world_size:
        raise ValueError(f"flat numel {numel} is not divisible by the world size {world_size}")
    if fmt is None:
        unit, group_size = 1, 1
        exact = ()
    else:
        f = get_format(fmt)
        unit = check_group_size(group_size)
        exact = check_exact_ranges(exact_ranges, numel)
    if bucket_numel < world_size * unit:
        raise ValueError(
            f"bucket_numel {bucket_numel} is smaller than one {'group' if fmt else 'element'} per rank "
            f"({world_size} x {unit} = {world_size * unit})"
        )
    partition = numel // world_size
    chunk = chunk_numel_per_rank(partition, world_size, bucket_numel, unit)
    n_chunks = -(-partition // chunk) if partition else 0
    exact_counts = _exact_counts(exact, partition, chunk, n_chunks) if exact else [0] * n_chunks
    chunks = []
    for c in range(n_chunks):
        offset = c * chunk
        n = min(chunk, partition - offset)
        if fmt is None:
            layout = PayloadLayout(0, 0, 0, 0, n * elem_size)
        else:
            layout = _payload_layout(n, f.value_bytes(n), -(-n // group_size), exact_counts[c], elem_size)
        chunks.append(ChunkPlan(c, offset, n, layout))
    return GatherPlan(
        numel=numel,
        world_size=world_size,
        elem_size=elem_size,
        bucket_numel=bucket_numel,
        fmt=fmt,
        group_size=group_size,
        chunk_numel=chunk,
        chunks=tuple(chunks),
        exact_ranges=exact,
        delta=delta,
    )


def quantized_payload_layout(numel: int, group_size: int, fmt: str) -> PayloadLayout:
    """Layout of one payload of ``numel`` quantized values and their scales, no exact elements."""
    return _payload_layout(numel, get_format(fmt).value_bytes(numel), -(-numel // group_size), 0, 2)


def _payload_layout(numel: int, value_bytes: int, groups: int, exact_numel: int, elem_size: int) -> PayloadLayout:
    scales_offset = round_up(value_bytes, PAYLOAD_ALIGN)
    exact_offset = round_up(scales_offset + groups * SCALE_BYTES, PAYLOAD_ALIGN)
    nbytes = round_up(exact_offset + exact_numel * elem_size, PAYLOAD_ALIGN)
    return PayloadLayout(0, scales_offset, exact_offset, exact_numel, nbytes)


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


# --------------------------------------------------------------------------- flat layout


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
    """How parameters were placed: ``contiguous`` or ``interleaved`` (see :func:`plan_flat_layout`)."""

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


def plan_flat_layout(
    shapes: Sequence[Sequence[int]],
    world_size: int,
    *,
    elem_size: int = 2,
    alignment: int | None = None,
    group_size: int = 64,
    small_param_numel: int = DEFAULT_SMALL_PARAM_NUMEL,
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
    fmt: str | None = "int8",
    order: str = "contiguous",
    delta: bool = False,
) -> FlatLayout:
    """Pack parameters of ``shapes`` into a flat buffer and plan its gather.

    ``order="contiguous"`` packs them back to back in the given order, padding at the tail;
    ``order="interleaved"`` places them with :func:`interleaved_starts` (each partition in
    model order; padding at the end of every partition), which lets a gather that runs
    ahead of the forward finish chunks in the order the forward needs them.
    ``order="auto"`` takes the interleaved order unless it pads more than
    :data:`AUTO_INTERLEAVE_MAX_PADDING` of the parameters beyond what the contiguous order pads.
    ``alignment`` defaults to the group size (so partitions hold whole groups).
    Parameters with at most ``small_param_numel`` elements become exact ranges. ``delta``
    plans delta payloads (see :func:`plan_gather`).
    """
    _check_positive_int("world_size", world_size)
    if fmt is not None:
        check_group_size(group_size)
        get_format(fmt)
    alignment = group_size if alignment is None else alignment
    _check_positive_int("alignment", alignment)
    if isinstance(small_param_numel, bool) or not isinstance(small_param_numel, int) or small_param_numel < 0:
        raise ValueError(f"small_param_numel must be an integer >= 0, got {small_param_numel!r}")
    sizes, shapes_t = [], []
    for i, shape in enumerate(shapes):
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"parameter {i} has a negative dimension in shape {shape}")
        shapes_t.append(shape)
        sizes.append(math.prod(shape))
    if order not in FLAT_ORDERS + ("auto",):
        raise ValueError(f"order must be auto or one of {FLAT_ORDERS}, got {order!r}")
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
        bucket_numel=bucket_numel,
        fmt=fmt,
        group_size=group_size,
        exact_ranges=merge_adjacent(exact),
        delta=delta,
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


def merge_adjacent(ranges: Sequence[Range]) -> list[Range]:
    """Sorted ranges with touching neighbours joined: ``[(0, 4), (4, 6), (8, 9)]`` gives
    ``[(0, 6), (8, 9)]``."""
    out: list[Range] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


# --------------------------------------------------------------------------- gradient buckets


@dataclass(frozen=True)
class ReduceBucket:
    """A contiguous flat range whose gradient is reduced as one unit, and the
    parameters (slot indices) that must deliver their gradients before it can go."""

    index: int
    start: int
    stop: int
    slots: tuple[int, ...]

    @property
    def numel(self) -> int:
        return self.stop - self.start


def plan_reduce_buckets(layout: FlatLayout, bucket_numel: int) -> tuple[ReduceBucket, ...]:
    """Cut the span the parameters occupy into buckets of at most ``bucket_numel`` elements
    (padding between partitions rides along as zeros).

    Buckets are formed from the end of the buffer backwards, because backward
    produces the last parameters' gradients first. Bucket edges fall on parameter
    edges, except inside a parameter larger than the bucket, which is split.
    """
    _check_positive_int("bucket_numel", bucket_numel)
    in_flat_order = sorted((s for s in layout.slots if s.numel), key=lambda s: s.start)
    if not in_flat_order:
        return ()
    edges = [in_flat_order[-1].stop]  # descending; the open bucket is [?, edges[-1])
    for s in reversed(in_flat_order):
        if edges[-1] - s.start <= bucket_numel:
            continue  # fits in the open bucket
        if edges[-1] > s.stop:
            edges.append(s.stop)  # close the open bucket at this parameter's end
        while edges[-1] - s.start > bucket_numel:
            edges.append(edges[-1] - bucket_numel)  # split a parameter larger than the bucket
    if edges[-1] != 0:
        edges.append(0)
    buckets = []
    for i in range(len(edges) - 1):
        stop, start = edges[i], edges[i + 1]
        if start == stop:
            continue
        slots = tuple(s.index for s in layout.slots if s.numel and s.start < stop and start < s.stop)
        buckets.append(ReduceBucket(len(buckets), start, stop, slots))
    return tuple(buckets)


def bucket_pieces(bucket: ReduceBucket, start: int, stop: int) -> list[tuple[int, int, int]]:
    """``(a, b, offset)``: the part of flat ``[start, stop)`` inside the bucket, and where it
    sits in the bucket's staging buffer."""
    a, b = max(start, bucket.start), min(stop, bucket.stop)
    return [(a, b, a - bucket.start)] if a < b else []


def owners(start: int, stop: int, partition_numel: int) -> list[tuple[int, int, int]]:
    """``(rank, a, b)`` for every partition that ``[start, stop)`` overlaps."""
    out = []
    r = start // partition_numel
    while start < stop:
        b = min(stop, (r + 1) * partition_numel)
        out.append((r, start, b))
        start, r = b, r + 1
    return out


@dataclass(frozen=True)
class ScatterBucket:
    """The same window ``[lo, hi)`` of local offsets in every partition, reduce-scattered as
    one unit: rank ``r`` receives the summed gradient of flat ``[r P + lo, r P + hi)``.

    Every rank sends and receives ``(world - 1) / world`` of the window at once, so the link
    carries traffic both ways; a reduce to one owner at a time uses one direction only.
    """

    index: int
    lo: int
    hi: int
    slots: tuple[int, ...]

    @property
    def width(self) -> int:
        return self.hi - self.lo


def scatter_pieces(bucket: ScatterBucket, start: int, stop: int, partition_numel: int) -> list[tuple[int, int, int]]:
    """``(a, b, offset)`` for the parts of flat ``[start, stop)`` inside the bucket's windows:
    flat ``[a, b)`` sits at ``offset`` of the bucket's ``[world, width]`` staging buffer."""
    out = []
    for r, a, b in owners(start, stop, partition_numel):
        base = r * partition_numel
        a, b = max(a, base + bucket.lo), min(b, base + bucket.hi)
        if a < b:
            out.append((a, b, r * bucket.width + a - base - bucket.lo))
    return out


def scatter_window_numel(partition_numel: int, world_size: int, bucket_numel: int) -> int:
    """Window width of a scatter bucket: ``world * width <= bucket_numel`` (at least one
    element, at most the partition)."""
    _check_positive_int("bucket_numel", bucket_numel)
    return min(max(bucket_numel // world_size, 1), max(partition_numel, 1))


def solo_slots(layout: FlatLayout, bucket_numel: int) -> tuple[int, ...]:
    """Parameters whose gradient is reduced to its owner on its own instead of in windows:
    those that start a partition and span more than one window (the embedding, typically).

    In the interleaved order such a parameter shares its windows with several layers of
    every other partition. Its gradient comes last in backward (it is used first, and a
    tied embedding accumulates a second gradient at the very end), so those windows, with
    ``world`` rows each, would be staged from the first of those layers' gradients until
    the end of backward: ``world x`` its size. Reduced alone, from its own gradient, it
    needs no staging and does not hold the windows back."""
    p = layout.partition_numel
    width = scatter_window_numel(p, layout.world_size, bucket_numel)
    return tuple(s.index for s in layout.slots if s.numel > width and s.start % p == 0 and s.stop <= s.start + p)


def plan_scatter_buckets(layout: FlatLayout, bucket_numel: int, exclude: Sequence[int] = ()) -> tuple[ScatterBucket, ...]:
    """Cut the partitions into windows for reduce-scatter, last window first (backward
    produces the last parameters' gradients first; in the interleaved order a window is
    one stretch of the model). Windows no parameter touches on any rank are left out, and
    so are the parameters in ``exclude`` (reduced on their own: :func:`solo_slots`)."""
    p, world = layout.partition_numel, layout.world_size
    width = scatter_window_numel(p, world, bucket_numel)
    n = -(-p // width)
    touching: list[list[int]] = [[] for _ in range(n)]
    skip = set(exclude)
    for s in layout.slots:
        if not s.numel or s.index in skip:
            continue
        for _, a, b in owners(s.start, s.stop, p):
            local = a % p
            for k in range(local // width, (local + b - a - 1) // width + 1):
                if not touching[k] or touching[k][-1] != s.index:
                    touching[k].append(s.index)
    buckets = []
    for k in reversed(range(n)):
        if touching[k]:
            slots = tuple(sorted(set(touching[k])))
            buckets.append(ScatterBucket(len(buckets), k * width, min((k + 1) * width, p), slots))
    return tuple(buckets)
