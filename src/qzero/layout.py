"""Pure layout math: flat ranges, partitions, padding, exact ranges and gather chunks.

Nothing here touches a process group or allocates a tensor, so a DP1024 plan can be
checked on a laptop. Two plans are built:

* :func:`plan_gather` — for a flat buffer of ``numel`` elements shared by
  ``world_size`` ranks: the chunk boundaries inside every partition, and for each
  chunk the exact payload layout (values, scales, side channel), fixed once.
* :func:`plan_flat_layout` — from ordered parameter shapes: each parameter's flat
  range, the tail padding, the exact ranges of small parameters, and its gather plan.

The bucket rule is a requirement, not a tuning knob: what one chunk gathers across
all ranks is bounded, ``world_size * chunk_numel <= allgather_bucket_size``. The terms (flat
buffer, partition, chunk, payload, exact range) are defined in ``docs/design.md``; the
gradient reduction's buckets and windows are planned in :mod:`qzero.buckets`.

[Note: exact groups]

A rank's slice of a chunk is quantized in groups of ``group_size`` consecutive elements,
counted from its partition's start (chunks start on group boundaries, so a group never
depends on the chunking; only a partition's last group may be short). Nothing travels
twice and nothing travels in a form larger than itself:

* A group with exact elements is **coded** (values and a scale sent, its exact elements
  zeroed before the scale and sent verbatim in the side channel) only if that costs at
  least ``SCALE_BYTES`` less than sending all its elements verbatim
  (:func:`codes_pay`). Otherwise it is an **exact group**: it sends no values and no
  scale, and *all* its elements travel in the side channel, the few that belong to no
  exact range included (they arrive bit-exact, which is never less accurate). A group
  wholly inside exact ranges is always an exact group. Groups without exact elements are
  always coded.
* A rank's **side elements** are its exact elements and the other elements of its exact
  groups; its **group runs** (:func:`slice_runs`) cut its slice into maximal runs of coded
  and of exact groups, ``(lo, hi, first)``, ``first`` being the index of the run's first
  group among the payload's coded groups, or ``-1`` for a run of exact groups.
* A payload is, with no padding inside: the coded groups' values back to back in slice
  order (coded group ``k`` starts at value ``k * group_size``), their fp32 scales in the
  same order (from the next multiple of 4 bytes), then the side elements in slice order
  in the flat buffer's dtype (:func:`compact_layout`). Every rank's payload occupies the
  same slot of ``payload_bytes`` (the largest payload, rounded up to ``PAYLOAD_ALIGN``).

How a chunk's payloads are laid out is its :class:`PayloadKind`: ``SHARED`` when every
rank codes every group (one layout for all, the side channel sized for the rank with the
most exact elements), ``PER_RANK`` when some rank has an exact group (each rank its own
layout and runs; only then do the kernels take group runs), ``PLAIN`` when no rank codes
any group (the payload is the slice itself, as in a plain gather: every element of it
is a side element anyway).

So every coded group saves at least ``SCALE_BYTES`` over its plain bytes, which pays for
the padding before the scales, and a payload is never larger than the plain slice when
the slice is a whole number of groups: ``payload_bytes <= numel * elem_size`` for every
chunk of a flat layout (:func:`plan_flat_layout`), whatever the model. Codes of coded
groups are those the reference quantizer gives for the whole slice with its side elements
zeroed; dropping the exact groups moves no other group's codes.
"""

from __future__ import annotations

import bisect
import enum
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from .vocabulary import DELTA_FORMATS, FLAT_ORDERS, RENAMED_GATHER_KEYWORDS, refuse_renamed
from .quant.formats import DEFAULT_FORMAT, DEFAULT_GROUP_SIZE, SCALE_BYTES, QuantFormat, check_group_size, get_format

DEFAULT_BUCKET_NUMEL = 500_000_000
DEFAULT_SMALL_PARAM_NUMEL = 65_536
#: ``flat_order="auto"`` takes the interleaved order unless it pads more than this share of the
#: parameters (a very large parameter placed late can leave partitions unbalanced).
AUTO_INTERLEAVE_MAX_PADDING = 0.03
#: Payload sections and whole payloads start on this many bytes.
PAYLOAD_ALIGN = 16

Range = tuple[int, int]


# --------------------------------------------------------------------------- padding rules


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def padded_flat_numel(used_numel: int, world_size: int, alignment: int) -> int:
    """Tail padding rule: the flat buffer is a multiple of ``world_size * alignment``
    (so every partition is a whole number of alignment units), and never empty."""
    return max(round_up(used_numel, world_size * alignment), world_size * alignment)


def chunk_numel_per_rank(partition_numel: int, world_size: int, allgather_bucket_size: int, unit: int) -> int:
    """Elements of every partition that one chunk moves.

    The largest multiple of ``unit`` (a group, or one element for the plain gather)
    with ``world_size * chunk <= allgather_bucket_size``, never below one unit, never above
    the partition (rounded up to a unit).
    """
    per_rank = (allgather_bucket_size // world_size) // unit * unit
    per_rank = max(per_rank, unit)
    return min(per_rank, round_up(max(partition_numel, 1), unit))


def is_small_param(numel: int, threshold: int) -> bool:
    """Small parameters (norms, biases, small embeddings) travel exactly."""
    return numel <= threshold


# --------------------------------------------------------------------------- gather plan


class PayloadLayout(NamedTuple):
    """Byte offsets of one rank's payload for one chunk (``exact_*``: its side channel);
    ``nbytes``: its slot in the receive buffer, what every rank sends for the chunk."""

    values_offset: int
    scales_offset: int
    exact_offset: int
    exact_numel: int
    nbytes: int


class PayloadKind(enum.Enum):
    """How a chunk's payloads are laid out (see [Note: exact groups])."""

    PLAIN = "plain"  # the slice itself: a plain gather, or no rank codes any group of the chunk
    SHARED = "shared"  # every rank codes every group: one layout for every rank
    PER_RANK = "per_rank"  # some rank has an exact group: a layout and group runs per rank


Run = tuple[int, int, int]
"""``(lo, hi, first)``: a run of groups of a slice (see [Note: exact groups])."""


@dataclass(frozen=True)
class ChunkPlan:
    """One round of the gather: ``[offset, offset + numel)`` of every partition.

    ``payload_bytes``: every rank's slot in the receive buffer. ``payload``: every rank's
    layout (``PLAIN``, ``SHARED``), or None (``PER_RANK``: rank ``r``'s is ``layouts[r]``,
    its group runs ``runs[r]``; :meth:`GatherPlan.payload_of`)."""

    index: int
    offset: int
    numel: int
    payload_bytes: int
    kind: PayloadKind
    payload: PayloadLayout | None
    layouts: tuple[PayloadLayout, ...] = ()
    runs: tuple[tuple[Run, ...], ...] = ()


@dataclass(frozen=True)
class GatherPlan:
    """Static plan of one (quantized or plain) gather over a flat buffer."""

    numel: int
    world_size: int
    elem_size: int
    allgather_bucket_size: int
    fmt: str | None  # None: the plain gather, original dtype
    group_size: int
    chunk_numel: int
    chunks: tuple[ChunkPlan, ...]
    exact_ranges: tuple[Range, ...]
    delta: bool = False
    """The payload carries quantized differences against the replica ([Note: delta payload] in
    :mod:`qzero.quant.reference`); the same sections and layout as a weight payload.

    A pure value: what running it derives (device index tensors, group runs) is kept by the
    object that runs it (:class:`qzero.wire.chunks.GatherCache`)."""

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

    def payload_of(self, chunk: ChunkPlan, rank: int) -> PayloadLayout:
        """``rank``'s payload layout of ``chunk``."""
        return chunk.payload if chunk.payload is not None else chunk.layouts[rank]

    def side_ranges(self, chunk: ChunkPlan, rank: int) -> list[Range]:
        """``rank``'s side elements of ``chunk`` (its exact elements and the rest of its exact
        groups; a ``PLAIN`` chunk of a quantized plan: all), as ranges relative to its slice,
        in order: what arrives bit-exact."""
        if chunk.kind is PayloadKind.PLAIN:
            return [(0, chunk.numel)] if self.quantized else []
        local = self.exact_local_ranges(chunk, rank)
        if chunk.kind is PayloadKind.SHARED:
            return local
        groups = [(lo, hi) for lo, hi, first in chunk.runs[rank] if first < 0]
        return merge_adjacent(sorted(local + groups))

    def group_runs(self, chunk: ChunkPlan, rank: int | None = None) -> GroupRuns | None:
        """What the kernels need of a ``PER_RANK`` chunk: the group runs and layouts of every
        rank's payload (``rank=None``: rows in rank order, for the unpack) or of ``rank``'s
        alone (one row, for its pack; None when that rank codes every group). None for the
        other kinds. A new object each call (a runner keeps it: :class:`qzero.wire.chunks.GatherCache`)."""
        if chunk.kind is not PayloadKind.PER_RANK:
            return None
        if rank is None:
            return GroupRuns(chunk.numel, self.group_size, chunk.runs, chunk.layouts, chunk.payload_bytes)
        if any(first < 0 for _, _, first in chunk.runs[rank]):
            return GroupRuns(chunk.numel, self.group_size, (chunk.runs[rank],), (chunk.layouts[rank],),
                             chunk.payload_bytes)
        return None


@dataclass(frozen=True, eq=False)
class GroupRuns:
    """The group runs (``rows[i]``: runs ``(lo, hi, first)`` covering ``[0, numel)`` in order)
    and layouts of one or more payloads of one ``PER_RANK`` chunk, each ``payload_bytes``
    apart in a receive buffer (see [Note: exact groups]). The Triton launcher derives device
    tables from them (:meth:`qzero.quant.triton_launch.Launcher.runs_table`), kept as long as
    this object lives: as long as the :class:`qzero.wire.chunks.GatherCache` that keeps it,
    that is as long as the owner of the gathers."""

    numel: int
    group_size: int
    rows: tuple[tuple[Run, ...], ...]
    layouts: tuple[PayloadLayout, ...]
    payload_bytes: int

    def coded_groups(self, row: int = 0) -> int:
        return sum(-(-(hi - lo) // self.group_size) for lo, hi, first in self.rows[row] if first >= 0)

    def row(self, r: int) -> GroupRuns:
        """Payload ``r`` alone (one row)."""
        return GroupRuns(self.numel, self.group_size, (self.rows[r],), (self.layouts[r],), self.payload_bytes)

    def coded_numel(self, row: int = 0) -> int:
        return sum(hi - lo for lo, hi, first in self.rows[row] if first >= 0)


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


def codes_pay(numel: int, exact: int, fmt: QuantFormat, elem_size: int) -> bool:
    """Whether a group of ``numel`` elements, ``exact`` of them exact, is coded: its values, its
    scale and its exact elements must cost at least ``SCALE_BYTES`` less than all its elements
    sent verbatim (that margin pays for the padding before the scales section). A group
    without exact elements is always coded."""
    if exact == 0:
        return True
    return fmt.value_bytes(numel) + 2 * SCALE_BYTES + exact * elem_size <= numel * elem_size


def slice_runs(exact_local: Sequence[Range], numel: int, group_size: int, fmt: QuantFormat,
               elem_size: int) -> tuple[tuple[Run, ...], int]:
    """The group runs of a slice of ``numel`` elements whose exact elements are the sorted,
    disjoint ``exact_local`` ranges, and its number of side elements (see [Note: exact groups]).
    Runs of the same kind never touch; a slice without exact groups is one coded run."""
    exact_groups: list[Range] = []  # sorted, disjoint group spans
    partial: dict[int, int] = {}  # group -> exact elements, for groups not wholly exact
    side = 0
    for a, b in merge_adjacent(exact_local):
        side += b - a
        g0, g1 = exact_group_span(a, b, numel, group_size)
        if g0 < g1:
            exact_groups.append((g0, g1))
        for lo, hi in ((a, min(b, g0 * group_size)), (max(a, g1 * group_size, g0 * group_size), b)):
            if lo < hi:  # the partly exact groups at either end of the range
                g = lo // group_size
                partial[g] = partial.get(g, 0) + hi - lo
    for g, e in partial.items():
        n = min(group_size, numel - g * group_size)
        if not codes_pay(n, e, fmt, elem_size):
            exact_groups.append((g, g + 1))
            side += n - e
    runs: list[Run] = []
    pos = coded = 0
    for g0, g1 in merge_adjacent(sorted(exact_groups)):
        lo, hi = g0 * group_size, min(g1 * group_size, numel)
        if lo > pos:
            runs.append((pos, lo, coded))
            coded += (lo - pos) // group_size
        runs.append((lo, hi, -1))
        pos = hi
    if pos < numel or not runs:
        runs.append((pos, numel, coded))
    return tuple(runs), side


def exact_group_span(a: int, b: int, numel: int, group_size: int) -> tuple[int, int]:
    """``(g0, g1)``: the groups of a slice of ``numel`` elements that lie wholly inside its
    ``[a, b)`` (the last, short group counts as whole); ``g0 == g1`` when there are none."""
    g0 = -(-a // group_size)
    g1 = -(-numel // group_size) if b >= numel else b // group_size
    return g0, max(g0, g1)


def compact_layout(value_bytes: int, groups: int, exact_numel: int, elem_size: int) -> PayloadLayout:
    """A payload without padding inside (see [Note: exact groups]): values, then the scales
    from the next multiple of ``SCALE_BYTES``, then the side channel; ``nbytes`` is its end
    (the plan rounds it up to the chunk's slot)."""
    scales = round_up(value_bytes, SCALE_BYTES)
    side = round_up(scales + groups * SCALE_BYTES, elem_size)
    return PayloadLayout(0, scales, side, exact_numel, side + exact_numel * elem_size)


def _slice_pieces(exact_ranges: Sequence[Range], partition: int, chunk: int) -> dict[tuple[int, int], list[Range]]:
    """``(rank, chunk) -> exact ranges inside that slice, relative to it``, for the slices that have any."""
    pieces: dict[tuple[int, int], list[Range]] = {}
    for a, b in merge_adjacent(exact_ranges):  # touching ranges may together cover a group
        pos = a
        while pos < b:
            rank, off = divmod(pos, partition)
            c = off // chunk
            lo = rank * partition + c * chunk
            stop = min(b, lo + min(chunk, partition - c * chunk))
            pieces.setdefault((rank, c), []).append((pos - lo, stop - lo))
            pos = stop
    return pieces


def _quantized_chunk(c: int, offset: int, n: int, world: int, f: QuantFormat, group_size: int, elem_size: int,
                     pieces: dict[tuple[int, int], list[Range]]) -> ChunkPlan:
    """One chunk of a quantized plan, its kind and layouts decided (see [Note: exact groups])."""
    groups = -(-n // group_size)
    whole = ((0, n, 0),)
    runs, layouts, sides = [], [], []
    for r in range(world):
        local = pieces.get((r, c))
        row, side = slice_runs(local, n, group_size, f, elem_size) if local else (whole, 0)
        runs.append(row)
        sides.append(side)
    if all(len(row) == 1 and row[0][2] == 0 for row in runs):  # every rank codes every group
        layout = _in_slot(compact_layout(f.value_bytes(n), groups, max(sides), elem_size))
        return ChunkPlan(c, offset, n, layout.nbytes, PayloadKind.SHARED, layout)
    if all(first < 0 for row in runs for _, _, first in row):  # no rank codes any group
        return ChunkPlan(c, offset, n, n * elem_size, PayloadKind.PLAIN, PayloadLayout(0, 0, 0, 0, n * elem_size))
    distinct: dict = {}  # most ranks share a layout (those without exact elements here, at least)
    for row, side in zip(runs, sides):
        if (row, side) not in distinct:
            coded = sum(hi - lo for lo, hi, first in row if first >= 0)
            coded_groups = sum(-(-(hi - lo) // group_size) for lo, hi, first in row if first >= 0)
            distinct[row, side] = compact_layout(f.value_bytes(coded), coded_groups, side, elem_size)
        layouts.append(distinct[row, side])
    slot = round_up(max(lay.nbytes for lay in distinct.values()), PAYLOAD_ALIGN)
    in_slot = {key: lay._replace(nbytes=slot) for key, lay in distinct.items()}
    layouts = [in_slot[row, side] for row, side in zip(runs, sides)]
    return ChunkPlan(c, offset, n, slot, PayloadKind.PER_RANK, None, tuple(layouts), tuple(runs))


def _in_slot(layout: PayloadLayout) -> PayloadLayout:
    """``layout`` with ``nbytes`` rounded up to a whole slot (``PAYLOAD_ALIGN``)."""
    return layout._replace(nbytes=round_up(layout.nbytes, PAYLOAD_ALIGN))


@refuse_renamed(**RENAMED_GATHER_KEYWORDS)
def plan_gather(
    numel: int,
    world_size: int,
    *,
    elem_size: int = 2,
    allgather_bucket_size: int = DEFAULT_BUCKET_NUMEL,
    zero_quantized_weights_format: str | None = DEFAULT_FORMAT,
    zero_quantized_weights_group_size: int = DEFAULT_GROUP_SIZE,
    exact_ranges: Sequence[Range] = (),
    zero_quantized_weights_delta: bool = False,
) -> GatherPlan:
    """Plan a gather of a flat buffer of ``numel`` elements over ``world_size`` ranks.

    The settings are :class:`qzero.ZeroConfig`'s, with one difference:
    ``zero_quantized_weights_format=None`` plans the plain gather (payload = the original
    elements; ZeroConfig says it with ``zero_quantized_weights=False``). With
    ``zero_quantized_weights_delta`` the payloads carry differences against the replica (the
    format one of :data:`DELTA_FORMATS`). Raises ``ValueError``/``TypeError`` naming the bad value.
    """
    fmt, group_size = zero_quantized_weights_format, zero_quantized_weights_group_size
    delta = zero_quantized_weights_delta
    if delta and fmt not in DELTA_FORMATS:
        raise ValueError(f"zero_quantized_weights_delta: a delta payload is one of the formats {list(DELTA_FORMATS)}, "
                         f"got zero_quantized_weights_format={fmt!r}")
    check_positive_int("world_size", world_size)
    check_positive_int("allgather_bucket_size", allgather_bucket_size)
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be a non-negative integer, got {numel!r}")
    if numel % world_size:
        raise ValueError(f"flat numel {numel} is not divisible by the world size {world_size}")
    if fmt is None:
        unit, group_size = 1, 1
        exact = ()
    else:
        f = check_format(fmt)
        unit = check_group_size(group_size, "zero_quantized_weights_group_size")
        exact = check_exact_ranges(exact_ranges, numel)
    if allgather_bucket_size < world_size * unit:
        raise ValueError(
            f"allgather_bucket_size {allgather_bucket_size} is smaller than one {'group' if fmt else 'element'} "
            f"per rank ({world_size} x {unit} = {world_size * unit})"
        )
    partition = numel // world_size
    chunk = chunk_numel_per_rank(partition, world_size, allgather_bucket_size, unit)
    n_chunks = -(-partition // chunk) if partition else 0
    pieces = _slice_pieces(exact, partition, chunk) if exact else {}
    chunks = []
    for c in range(n_chunks):
        offset = c * chunk
        n = min(chunk, partition - offset)
        if fmt is None:
            chunks.append(ChunkPlan(c, offset, n, n * elem_size, PayloadKind.PLAIN, PayloadLayout(0, 0, 0, 0, n * elem_size)))
        else:
            chunks.append(_quantized_chunk(c, offset, n, world_size, f, group_size, elem_size, pieces))
    return GatherPlan(
        numel=numel,
        world_size=world_size,
        elem_size=elem_size,
        allgather_bucket_size=allgather_bucket_size,
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


def check_format(fmt: object) -> QuantFormat:
    """The format named ``fmt`` (``zero_quantized_weights_format``), or ``ValueError`` naming it."""
    try:
        return get_format(fmt)
    except ValueError as e:
        raise ValueError(f"zero_quantized_weights_format: {e}") from None


def check_positive_int(name: str, value: object) -> None:
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


def merge_adjacent(ranges: Sequence[Range]) -> list[Range]:
    """Ranges sorted by start with touching (or overlapping) neighbours joined:
    ``[(0, 4), (4, 6), (8, 9)]`` gives ``[(0, 6), (8, 9)]``; the result is their union as
    sorted ranges of which no two touch."""
    out: list[Range] = []
    for a, b in ranges:
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
