"""The gather plan as a value: what the runners of the weight gather read.

A :class:`GatherPlan` fixes, once, how the gather of a flat buffer of ``numel`` elements
shared by ``world_size`` ranks is cut into chunks (:class:`ChunkPlan`: the same slice of
every partition) and what each rank sends for each chunk (:class:`PayloadLayout`,
:class:`PayloadKind`, :class:`GroupRuns`). It is a pure value: host integers and tuples,
equal plans equal; what running it derives (device index tensors, the kernels' tables) is
kept by the object that runs it (:class:`qzero.wire.chunks.GatherCache`). Plans are made by
:mod:`qzero.layout.gather_planner`; the gather engine, the chunk unit and the kernels only
read them. The terms (flat buffer, partition, chunk, payload, exact range) are defined in
``docs/design.md``; the words of a payload are defined here:

[Note: exact groups]

A rank's slice of a chunk is quantized in groups of ``group_size`` consecutive elements,
counted from its partition's start (chunks start on group boundaries, so a group never
depends on the chunking; only a partition's last group may be short). Nothing travels
twice and nothing travels in a form larger than itself:

* A group with exact elements is **coded** (values and a scale sent, its exact elements
  zeroed before the scale and sent verbatim in the side channel) only if that costs at
  least ``SCALE_BYTES`` less than sending all its elements verbatim
  (:func:`~qzero.layout.gather_planner.codes_pay`). Otherwise it is an **exact group**: it sends no values and no
  scale, and *all* its elements travel in the side channel, the few that belong to no
  exact range included (they arrive bit-exact, which is never less accurate). A group
  wholly inside exact ranges is always an exact group. Groups without exact elements are
  always coded.
* A rank's **side elements** are its exact elements and the other elements of its exact
  groups; its **group runs** (:func:`~qzero.layout.gather_planner.slice_runs`) cut its slice into maximal runs of coded
  and of exact groups, ``(lo, hi, first)``, ``first`` being the index of the run's first
  group among the payload's coded groups, or ``-1`` for a run of exact groups.
* A payload is, with no padding inside: the coded groups' values back to back in slice
  order (coded group ``k`` starts at value ``k * group_size``), their fp32 scales in the
  same order (from the next multiple of 4 bytes), then the side elements in slice order
  in the flat buffer's dtype (:func:`~qzero.layout.gather_planner.compact_layout`). Every rank's payload occupies the
  same slot of ``payload_bytes`` (the largest payload, rounded up to
  :data:`~qzero.layout.gather_planner.PAYLOAD_ALIGN`).

How a chunk's payloads are laid out is its :class:`PayloadKind`: ``SHARED`` when every
rank codes every group (one layout for all, the side channel sized for the rank with the
most exact elements), ``PER_RANK`` when some rank has an exact group (each rank its own
layout and runs; only then do the kernels take group runs), ``PLAIN`` when no rank codes
any group (the payload is the slice itself, as in a plain gather: every element of it
is a side element anyway).

So every coded group saves at least ``SCALE_BYTES`` over its plain bytes, which pays for
the padding before the scales, and a payload is never larger than the plain slice when
the slice is a whole number of groups: ``payload_bytes <= numel * elem_size`` for every
chunk of a flat layout (:func:`qzero.layout.flat_layout.plan_flat_layout`), whatever the model. Codes of coded
groups are those the reference quantizer gives for the whole slice with its side elements
zeroed; dropping the exact groups moves no other group's codes.
"""

from __future__ import annotations

import bisect
import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

#: ``(start, stop)``: a range of flat indices (or of offsets in a slice), ``stop`` excluded.
Range = tuple[int, int]

Run = tuple[int, int, int]
"""``(lo, hi, first)``: a run of groups of a slice (see [Note: exact groups])."""


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
        return clip_ranges(self.exact_ranges, lo, lo + chunk.numel)

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


# --------------------------------------------------------------------------- ranges of flat indices


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


def clip_ranges(ranges: Sequence[Range], lo: int, hi: int) -> list[Range]:
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
