"""Pure layout math of the gradient reduction: buckets and windows over a flat layout.

Backward produces gradients last parameter first; they are reduced to their owners in units
planned here, from the end of the buffer backwards. In the contiguous flat order a unit is a
:class:`ReduceBucket` (a flat range, reduced to each partition it overlaps); in the
interleaved order a :class:`ScatterBucket` (a *window*: the same local range of every
partition, reduce-scattered), and parameters that would hold windows back are reduced on their
own (:func:`solo_slots`). The terms are defined in ``docs/design.md``. Like
:mod:`qzero.layout`, nothing here touches a process group or allocates a tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .layout.flat_layout import FlatLayout
from .layout.gather_planner import check_positive_int


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


def plan_reduce_buckets(layout: FlatLayout, reduce_bucket_size: int) -> tuple[ReduceBucket, ...]:
    """Cut the span the parameters occupy into buckets of at most ``reduce_bucket_size`` elements
    (padding between partitions rides along as zeros).

    Buckets are formed from the end of the buffer backwards, because backward
    produces the last parameters' gradients first. Bucket edges fall on parameter
    edges, except inside a parameter larger than the bucket, which is split.
    """
    check_positive_int("reduce_bucket_size", reduce_bucket_size)
    in_flat_order = sorted((s for s in layout.slots if s.numel), key=lambda s: s.start)
    if not in_flat_order:
        return ()
    edges = [in_flat_order[-1].stop]  # descending; the open bucket is [?, edges[-1])
    for s in reversed(in_flat_order):
        if edges[-1] - s.start <= reduce_bucket_size:
            continue  # fits in the open bucket
        if edges[-1] > s.stop:
            edges.append(s.stop)  # close the open bucket at this parameter's end
        while edges[-1] - s.start > reduce_bucket_size:
            edges.append(edges[-1] - reduce_bucket_size)  # split a parameter larger than the bucket
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


def scatter_window_numel(partition_numel: int, world_size: int, reduce_bucket_size: int) -> int:
    """Window width of a scatter bucket: ``world * width <= reduce_bucket_size`` (at least one
    element, at most the partition)."""
    check_positive_int("reduce_bucket_size", reduce_bucket_size)
    return min(max(reduce_bucket_size // world_size, 1), max(partition_numel, 1))


def solo_slots(layout: FlatLayout, reduce_bucket_size: int) -> tuple[int, ...]:
    """Parameters whose gradient is reduced to its owner on its own instead of in windows:
    those that start a partition and span more than one window (the embedding, typically).

    In the interleaved order such a parameter shares its windows with several layers of
    every other partition. Its gradient comes last in backward (it is used first, and a
    tied embedding accumulates a second gradient at the very end), so those windows, with
    ``world`` rows each, would be staged from the first of those layers' gradients until
    the end of backward: ``world x`` its size. Reduced alone, from its own gradient, it
    needs no staging and does not hold the windows back."""
    p = layout.partition_numel
    width = scatter_window_numel(p, layout.world_size, reduce_bucket_size)
    return tuple(s.index for s in layout.slots if s.numel > width and s.start % p == 0 and s.stop <= s.start + p)


def plan_scatter_buckets(layout: FlatLayout, reduce_bucket_size: int,
                         exclude: Sequence[int] = ()) -> tuple[ScatterBucket, ...]:
    """Cut the partitions into windows for reduce-scatter, last window first (backward
    produces the last parameters' gradients first; in the interleaved order a window is
    one stretch of the model). Windows no parameter touches on any rank are left out, and
    so are the parameters in ``exclude`` (reduced on their own: :func:`solo_slots`)."""
    p, world = layout.partition_numel, layout.world_size
    width = scatter_window_numel(p, world, reduce_bucket_size)
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
