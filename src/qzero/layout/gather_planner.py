"""Planning the weight gather: :func:`plan_gather` cuts a flat buffer into chunks and lays out
every rank's payload of each chunk (the :class:`~qzero.layout.gather_plan.GatherPlan` it
returns is what the runners read).

The bucket rule is a requirement, not a tuning knob: what one chunk gathers across all
ranks is bounded, ``world_size * chunk_numel <= allgather_bucket_size``
(:func:`chunk_numel_per_rank`). Inside a chunk, which groups are coded and which travel in
the side channel, and where each section of a payload starts, follow [Note: exact groups]
in :mod:`qzero.layout.gather_plan` (:func:`codes_pay`, :func:`slice_runs`,
:func:`compact_layout`). The arguments are checked first, each error naming its setting as
:class:`qzero.ZeroConfig` does. Pure: nothing here touches a process group or allocates a
tensor, so a DP1024 plan can be checked on a laptop.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from ..quant.formats import DEFAULT_FORMAT, DEFAULT_GROUP_SIZE, SCALE_BYTES, QuantFormat, check_group_size, get_format
from ..vocabulary import DELTA_FORMATS, RENAMED_GATHER_KEYWORDS, refuse_renamed
from .gather_plan import ChunkPlan, GatherPlan, PayloadKind, PayloadLayout, Range, Run, merge_adjacent

#: ``allgather_bucket_size``'s default: elements one chunk gathers across all ranks.
DEFAULT_BUCKET_NUMEL = 500_000_000
#: Payload sections and whole payloads start on this many bytes.
PAYLOAD_ALIGN = 16


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
            plain = PayloadLayout(0, 0, 0, 0, n * elem_size)
            chunks.append(ChunkPlan(c, offset, n, n * elem_size, PayloadKind.PLAIN, plain))
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


# --------------------------------------------------------------------------- chunks


def chunk_numel_per_rank(partition_numel: int, world_size: int, allgather_bucket_size: int, unit: int) -> int:
    """Elements of every partition that one chunk moves.

    The largest multiple of ``unit`` (a group, or one element for the plain gather)
    with ``world_size * chunk <= allgather_bucket_size``, never below one unit, never above
    the partition (rounded up to a unit).
    """
    per_rank = (allgather_bucket_size // world_size) // unit * unit
    per_rank = max(per_rank, unit)
    return min(per_rank, round_up(max(partition_numel, 1), unit))


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


# --------------------------------------------------------------------------- the exact-group rule


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


# --------------------------------------------------------------------------- payloads without exact groups


def quantized_payload_layout(numel: int, group_size: int, fmt: str) -> PayloadLayout:
    """Layout of one payload of ``numel`` quantized values and their scales, no exact elements."""
    return aligned_layout(get_format(fmt).value_bytes(numel), -(-numel // group_size), 0, 2)


def aligned_layout(value_bytes: int, groups: int, exact_numel: int, elem_size: int) -> PayloadLayout:
    """A payload whose sections each start on ``PAYLOAD_ALIGN`` bytes: ``value_bytes`` of values,
    one fp32 scale per group of ``groups``, then ``exact_numel`` side elements of ``elem_size``
    bytes; ``nbytes`` rounded up too. The layout of a gradient piece
    (:mod:`qzero.wire.quantized_reduce`) and of FSDP2's per-parameter shard
    (:func:`quantized_payload_layout`)."""
    scales_offset = round_up(value_bytes, PAYLOAD_ALIGN)
    exact_offset = round_up(scales_offset + groups * SCALE_BYTES, PAYLOAD_ALIGN)
    nbytes = round_up(exact_offset + exact_numel * elem_size, PAYLOAD_ALIGN)
    return PayloadLayout(0, scales_offset, exact_offset, exact_numel, nbytes)


# --------------------------------------------------------------------------- checks and arithmetic


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


def check_format(fmt: object) -> QuantFormat:
    """The format named ``fmt`` (``zero_quantized_weights_format``), or ``ValueError`` naming it."""
    try:
        return get_format(fmt)
    except ValueError as e:
        raise ValueError(f"zero_quantized_weights_format: {e}") from None


def check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
