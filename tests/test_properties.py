"""Property-based tests (hypothesis) of the planner and the gather.

* Planner: random ordered parameter shapes (zero-size and 1-element ones included),
  world sizes 1..1024, group sizes 8..8192, thresholds and buckets; every invariant of
  :func:`plan_flat_layout`, :func:`plan_gather`, :func:`plan_reduce_buckets` and
  :func:`owners` is checked against an independent computation.
* Gather, without processes: ``tests/_support/simulate.py`` runs pack/all-gather/unpack for all
  ranks in one process; the result must be the same on every simulated rank, equal
  bit for bit to an independent numpy model, and independent of the bucket size.
* Gather, with processes: a few examples on real gloo groups (world 2-3).
"""

from __future__ import annotations

import bisect
import math
import os

import numpy as np
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from _support.simulate import bits, expected_gather, poisoned_copy, simulate_gather

from qzero.buckets import (owners, plan_reduce_buckets, plan_scatter_buckets, scatter_pieces, scatter_window_numel,
                           solo_slots)
from qzero.layout import PAYLOAD_ALIGN, PayloadKind, plan_flat_layout, plan_gather
from qzero.quant.formats import SCALE_BYTES, get_format

FAST = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

#: The share of each property's full example count the run tries (``QZERO_PROPERTY_SCALE``,
#: default 0.3, so that the suite stays short on two cores; 1 for the full counts).
PROPERTY_SCALE = float(os.environ.get("QZERO_PROPERTY_SCALE", "0.3"))


def examples(n: int) -> int:
    """``n`` examples scaled by :data:`PROPERTY_SCALE`, at least 25."""
    return max(25, round(n * PROPERTY_SCALE))

FORMATS = ["int8", "fp8", "int4"]
DTYPES = [torch.bfloat16, torch.float16]

# ------------------------------------------------------------------ independent helpers


class ExactCounter:
    """Counts exact elements in any flat interval by interval arithmetic (prefix sums)."""

    def __init__(self, ranges):
        self.starts = [a for a, _ in ranges]
        self.stops = [b for _, b in ranges]
        self.prefix = [0]
        for a, b in ranges:
            self.prefix.append(self.prefix[-1] + b - a)

    def upto(self, x: int) -> int:
        """Exact elements in [0, x)."""
        i = bisect.bisect_right(self.starts, x)  # ranges starting at or before x
        if i == 0:
            return 0
        total = self.prefix[i - 1]
        return total + min(self.stops[i - 1], x) - self.starts[i - 1]

    def count(self, lo: int, hi: int) -> int:
        return self.upto(hi) - self.upto(lo)


def merged_runs(mask_ranges):
    """Maximal runs of a union of intervals (adjacent ones joined)."""
    out = []
    for a, b in sorted(mask_ranges):
        if a == b:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def exact_mask(plan):
    exact = np.zeros(plan.numel, bool)
    for a, b in plan.exact_ranges:
        exact[a:b] = True
    return exact


def brute_exact_max(plan, chunk, exact):
    """Most exact elements any rank has in ``chunk``, element by element (small plans only)."""
    best = 0
    for r in range(plan.world_size):
        lo = r * plan.partition_numel + chunk.offset
        best = max(best, int(exact[lo : lo + chunk.numel].sum()))
    return best


def check_gather_plan(plan, *, brute=False):
    """Every structural invariant of a GatherPlan."""
    w, p = plan.world_size, plan.partition_numel
    assert plan.numel == w * p
    assert [plan.partition(r) for r in range(w)] == [(r * p, (r + 1) * p) for r in range(w)]
    unit = plan.group_size if plan.quantized else 1
    # the bucket rule, and the chunk is the largest that obeys it (or the whole partition)
    assert w * plan.chunk_numel <= plan.allgather_bucket_size
    assert plan.max_recv_numel <= plan.allgather_bucket_size
    assert plan.chunk_numel % unit == 0 and plan.chunk_numel >= unit
    whole = -(-max(p, 1) // unit) * unit
    assert plan.chunk_numel == whole or w * (plan.chunk_numel + unit) > plan.allgather_bucket_size
    # chunks tile the partition, in order, on group boundaries
    pos = 0
    for i, c in enumerate(plan.chunks):
        assert c.index == i and c.offset == pos
        assert 0 < c.numel <= plan.chunk_numel
        assert c.offset % unit == 0
        assert c.numel == plan.chunk_numel or c.offset + c.numel == p, "only the last chunk is short"
        pos += c.numel
    assert pos == p
    # exact ranges: sorted, disjoint, inside the buffer
    prev = 0
    for a, b in plan.exact_ranges:
        assert prev <= a < b <= plan.numel
        prev = b
    counter = ExactCounter(plan.exact_ranges)
    mask = exact_mask(plan) if brute and plan.quantized else None
    es = plan.elem_size
    for c in plan.chunks:
        if not plan.quantized or c.kind is PayloadKind.PLAIN:
            assert c.kind is PayloadKind.PLAIN
            assert c.payload_bytes == c.payload.nbytes == c.numel * es and c.payload.exact_numel == 0
            continue
        f = get_format(plan.fmt)
        # never more bytes than the plain slice when it is whole groups (see [Note: exact groups])
        if c.numel % plan.group_size == 0:
            assert c.payload_bytes <= c.numel * es
        assert c.payload_bytes % PAYLOAD_ALIGN == 0, "every rank's payload starts 16-byte aligned"
        ends = []
        for r in range(w) if w <= 16 else (0, w - 1):
            pl = plan.payload_of(c, r)
            runs = plan.group_runs(c, r)
            coded = c.numel if runs is None else runs.coded_numel()
            groups = -(-coded // plan.group_size)
            assert pl.values_offset == 0 and pl.nbytes == c.payload_bytes
            assert pl.scales_offset == -(-f.value_bytes(coded) // SCALE_BYTES) * SCALE_BYTES, "no padding inside"
            assert pl.exact_offset == -(-(pl.scales_offset + groups * SCALE_BYTES) // es) * es
            ends.append(pl.exact_offset + pl.exact_numel * es)
            side = sum(b - a for a, b in plan.side_ranges(c, r))
            lo = r * p + c.offset
            if c.kind is PayloadKind.SHARED:
                assert runs is None and side == counter.count(lo, lo + c.numel)
            else:
                assert pl.exact_numel == side >= counter.count(lo, lo + c.numel)
            assert pl.exact_numel <= c.numel
        assert c.payload_bytes - max(ends) < PAYLOAD_ALIGN or w > 16
        if c.kind is PayloadKind.SHARED:
            # the side channel: the worst rank's exact elements in this chunk, never above the chunk
            want = max(counter.count(r * p + c.offset, r * p + c.offset + c.numel) for r in range(w))
            assert c.payload.exact_numel == want
            if brute:
                assert c.payload.exact_numel == brute_exact_max(plan, c, mask)
        # the local exact ranges the kernels use are the clipped global ones
        for r in range(w) if w <= 16 else (0, w - 1):
            lo = r * p + c.offset
            local = plan.exact_local_ranges(c, r)
            assert sum(b - a for a, b in local) == counter.count(lo, lo + c.numel)
            assert all(0 <= a < b <= c.numel for a, b in local)
            assert all(counter.count(lo + a, lo + b) == b - a for a, b in local)


# ------------------------------------------------------------------ strategies

dims = st.one_of(st.just(0), st.just(1), st.integers(2, 9), st.integers(10, 300), st.integers(300, 5000))
# parameters up to 1M elements (the planner is pure math, but the checks walk every chunk)
shape_st = st.lists(dims, min_size=0, max_size=3).map(tuple).filter(lambda s: math.prod(s) <= 1_000_000)
shapes_st = st.lists(shape_st, min_size=0, max_size=12)
worlds = st.one_of(st.integers(1, 9), st.integers(10, 1024), st.sampled_from([16, 64, 256, 1024]))
group_sizes = st.one_of(st.sampled_from([8, 16, 64, 128, 8192]), st.integers(1, 1024).map(lambda k: 8 * k))
thresholds = st.one_of(st.just(0), st.integers(0, 100), st.integers(0, 70_000), st.just(65_536))
formats = st.sampled_from(["int8", "fp8", "int4", None])


@st.composite
def layouts(draw, world=worlds, group=group_sizes):
    shapes = draw(shapes_st)
    w = draw(world)
    g = draw(group)
    fmt = draw(formats)
    threshold = draw(thresholds)
    alignment = draw(st.one_of(st.none(), st.sampled_from([1, 8, 64, 512])))
    a = g if alignment is None else alignment
    used = sum(math.prod(s) for s in shapes)
    numel = max(-(-used // (w * a)) * (w * a), w * a)
    # buckets >= world x group: sometimes tight, sometimes one extra partial group, sometimes
    # huge; never so small that the checks (which visit every rank of every chunk) crawl
    unit = g if fmt is not None else 1
    need = max(1, -(-numel // (unit * min(2000 * w, 20_000))))
    mult = draw(st.one_of(st.integers(need, need + 4), st.integers(need, need + 1000)))
    bucket = w * unit * mult + draw(st.integers(0, w * unit - 1))
    elem = draw(st.sampled_from([2, 4]))
    return shapes, w, g, fmt, threshold, alignment, a, bucket, elem


# ------------------------------------------------------------------ planner properties


def check_flat_layout(shapes, w, g, fmt, threshold, alignment, a, bucket, elem, brute=False):
    lay = plan_flat_layout(
        shapes,
        w,
        elem_size=elem,
        alignment=alignment,
        zero_quantized_weights_group_size=g,
        small_param_numel=threshold,
        allgather_bucket_size=bucket,
        zero_quantized_weights_format=fmt,
    )
    # flat ranges: contiguous, in order, one per parameter
    assert len(lay.slots) == len(shapes)
    pos = 0
    for i, (s, shape) in enumerate(zip(lay.slots, shapes)):
        assert s.index == i and s.shape == tuple(shape)
        assert s.start == pos and s.numel == math.prod(shape) and s.stop == pos + s.numel
        pos = s.stop
    assert lay.used_numel == pos
    # padding rule
    assert lay.numel % (w * a) == 0 and lay.numel >= lay.used_numel and lay.numel > 0
    assert lay.padding < w * a or (lay.used_numel == 0 and lay.padding == w * a)
    assert lay.partition_numel * w == lay.numel
    # exact ranges: exactly the small (non-empty) parameters, adjacent ones merged
    want_exact = [(s.start, s.stop) for s in lay.slots if 0 < s.numel <= threshold] if fmt is not None else []
    for s in lay.slots:
        assert s.exact == (0 < s.numel <= threshold)
    assert list(lay.exact_ranges) == merged_runs(want_exact)
    # no two exact ranges touch (they would have been merged)
    assert all(b1 < a2 for (_, b1), (a2, _) in zip(lay.exact_ranges, lay.exact_ranges[1:]))
    plan = lay.gather
    assert (plan.numel, plan.world_size, plan.fmt, plan.allgather_bucket_size) == (lay.numel, w, fmt, bucket)
    assert plan.group_size == (g if fmt is not None else 1)
    check_gather_plan(plan, brute=brute)
    # slots_in agrees with plain interval overlap
    lo, hi = lay.partition(0)
    got = [(s.index, rng) for s, rng in lay.slots_in(lo, hi)]
    want = [(s.index, (max(s.start, lo), min(s.stop, hi))) for s in lay.slots if max(s.start, lo) < min(s.stop, hi)]
    assert got == want
    return lay


@settings(max_examples=examples(1500), **FAST)
@given(layouts())
def test_flat_layout_and_gather_plan_invariants(args):
    check_flat_layout(*args)


@settings(max_examples=examples(500), **FAST)
@given(
    layouts(
        world=st.integers(1, 8),
        group=st.sampled_from([8, 16, 24, 64]),
    )
)
def test_side_channel_matches_brute_force(args):
    shapes, w, g, fmt, threshold, alignment, a, bucket, elem = args
    assume(sum(math.prod(s) for s in shapes) <= 60_000)
    check_flat_layout(shapes, w, g, fmt, min(threshold, 400), alignment, a, bucket, elem, brute=True)


@st.composite
def raw_gather_args(draw):
    """plan_gather on its own: random sorted disjoint exact ranges, partitions that are
    not a whole number of groups."""
    w = draw(st.integers(1, 12))
    p = draw(st.one_of(st.integers(0, 40), st.integers(40, 3000)))
    numel = w * p
    g = draw(st.sampled_from([8, 16, 24, 64, 256]))
    unit = g
    bucket = w * unit * draw(st.integers(1, 40)) + draw(st.integers(0, w * unit - 1))
    cuts = sorted(set(draw(st.lists(st.integers(0, numel), max_size=12))))
    ranges = [(cuts[i], cuts[i + 1]) for i in range(0, len(cuts) - 1, 2)]
    fmt = draw(st.sampled_from(FORMATS))
    return numel, w, g, bucket, ranges, fmt


@settings(max_examples=examples(600), **FAST)
@given(raw_gather_args())
def test_plan_gather_with_arbitrary_exact_ranges(args):
    numel, w, g, bucket, ranges, fmt = args
    plan = plan_gather(numel, w, allgather_bucket_size=bucket, zero_quantized_weights_group_size=g,
                       exact_ranges=ranges, zero_quantized_weights_format=fmt)
    assert plan.exact_ranges == tuple(ranges)
    check_gather_plan(plan, brute=True)


@settings(max_examples=examples(800), **FAST)
@given(layouts(world=st.integers(1, 64)), st.data())
def test_reduce_buckets_tile_the_used_buffer(args, data):
    shapes, w, g, fmt, threshold, alignment, a, bucket, elem = args
    used = sum(math.prod(s) for s in shapes)
    least = max(1, used // 2000)  # at most ~2000 buckets, so the checks stay fast
    rbucket = data.draw(st.one_of(st.integers(least, least + 50), st.integers(least, least + 20_000)))
    lay = plan_flat_layout(shapes, w, alignment=alignment, zero_quantized_weights_group_size=g,
                           small_param_numel=threshold,
                           allgather_bucket_size=bucket, zero_quantized_weights_format=fmt)
    buckets = plan_reduce_buckets(lay, rbucket)
    assert [b.index for b in buckets] == list(range(len(buckets)))
    # tiles [0, used_numel): sorted by start they are contiguous
    ordered = sorted(buckets, key=lambda b: b.start)
    pos = 0
    for b in ordered:
        assert b.start == pos and 0 < b.numel <= rbucket and b.numel == b.stop - b.start
        pos = b.stop
    assert pos == lay.used_numel
    # backward order: bucket 0 holds the end of the buffer
    assert [b.start for b in buckets] == sorted((b.start for b in buckets), reverse=True)
    starts_stops = {s.start for s in lay.slots} | {s.stop for s in lay.slots}
    for b in buckets:
        want = tuple(s.index for s in lay.slots if s.numel and s.start < b.stop and b.start < s.stop)
        assert b.slots == want, "a bucket waits for exactly the parameters overlapping it"
        # edges fall on parameter edges, except inside a parameter larger than the bucket
        for e in (b.start, b.stop):
            if e not in starts_stops:
                assert any(s.start < e < s.stop and s.numel > rbucket for s in lay.slots)
    # every non-empty parameter is waited for by at least one bucket
    covered = {i for b in buckets for i in b.slots}
    assert covered == {s.index for s in lay.slots if s.numel}


@settings(max_examples=examples(1000), **FAST)
@given(st.integers(1, 1024), st.integers(1, 5000), st.data())
def test_owners_partition_a_range(world, p, data):
    numel = world * p
    start = data.draw(st.integers(0, numel))
    stop = data.draw(st.integers(start, numel))
    out = owners(start, stop, p)
    if start == stop:
        assert out == []
        return
    assert out[0][1] == start and out[-1][2] == stop
    for (r, a, b), nxt in zip(out, out[1:] + [None]):
        assert 0 <= r < world
        assert r * p <= a < b <= (r + 1) * p, "each piece lies in its owner's partition"
        if nxt is not None:
            assert nxt[0] == r + 1 and nxt[1] == b, "pieces are contiguous, one per rank"
    assert [r for r, _, _ in out] == list(range(start // p, (stop - 1) // p + 1))


# ------------------------------------------------------------------ the gather, simulated


def make_values(n: int, dtype, seed: int, profile: str) -> torch.Tensor:
    """Mixed magnitudes, whole zero groups, huge and tiny values; always finite."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    big, tiny = (6e4, 6e-8) if dtype == torch.float16 else (1e38, 1e-38)
    if profile == "logspace":
        x *= np.float32(10.0) ** rng.uniform(-6, 3, n).astype(np.float32)
    elif profile == "zeros":
        x[rng.random(n) < 0.6] = 0
    elif profile == "extremes":
        k = rng.random(n)
        x[k < 0.1] = big * rng.uniform(-1, 1, (k < 0.1).sum())
        x[(k >= 0.1) & (k < 0.3)] = tiny * rng.uniform(-1, 1, ((k >= 0.1) & (k < 0.3)).sum())
        x[(k >= 0.3) & (k < 0.4)] = 0
    elif profile == "constant":
        x[:] = rng.standard_normal()
    t = torch.from_numpy(x).to(dtype)
    t[~torch.isfinite(t)] = 0  # rounding of huge fp32 values to fp16 could overflow
    # whole zero groups at random places
    if n and rng.random() < 0.5:
        a = int(rng.integers(0, n))
        t[a : a + 64] = 0
    return t


@st.composite
def gather_cases(draw):
    w = draw(st.integers(1, 9))
    g = draw(st.sampled_from([8, 16, 24, 32, 64]))
    # partitions: not always a whole number of groups (short last group), sometimes empty
    p = draw(st.one_of(st.integers(0, 3 * g), st.integers(3 * g, 12 * g)))
    numel = w * p
    cuts = sorted(set(draw(st.lists(st.integers(0, numel), max_size=10))))
    ranges = [(cuts[i], cuts[i + 1]) for i in range(0, len(cuts) - 1, 2)]
    if numel and draw(st.booleans()):
        ranges = [(0, numel)] if draw(st.integers(0, 9)) == 0 else ranges  # all exact, rarely
    fmt = draw(st.sampled_from(FORMATS))
    dtype = draw(st.sampled_from(DTYPES))
    b1 = w * g * draw(st.integers(1, 5)) + draw(st.integers(0, w * g - 1))
    b2 = draw(st.one_of(st.just(10**9), st.integers(w * g, 20 * w * g)))
    profile = draw(st.sampled_from(["normal", "logspace", "zeros", "extremes", "constant"]))
    seed = draw(st.integers(0, 2**31 - 1))
    return w, g, numel, ranges, fmt, dtype, (b1, b2), profile, seed


@settings(max_examples=examples(600), **FAST)
@given(gather_cases())
def test_simulated_gather_matches_numpy_model(case):
    w, g, numel, ranges, fmt, dtype, buckets, profile, seed = case
    truth = make_values(numel, dtype, seed, profile)
    want = expected_gather(truth, w, g, ranges, fmt)
    assert not torch.isnan(want).any()
    results = []
    for i, bucket in enumerate(buckets):
        plan = plan_gather(numel, w, elem_size=truth.element_size(), allgather_bucket_size=bucket,
                           zero_quantized_weights_format=fmt, zero_quantized_weights_group_size=g,
                           exact_ranges=ranges)
        copies = simulate_gather(truth, plan, garbage_seed=seed + i)
        for r in range(1, w):
            assert torch.equal(bits(copies[r]), bits(copies[0])), f"replica {r} differs (bucket {bucket})"
        assert torch.equal(bits(copies[0]), bits(want)), f"differs from the model (bucket {bucket})"
        for a, b in ranges:
            assert torch.equal(bits(copies[0][a:b]), bits(truth[a:b])), "exact ranges arrive bit-exact"
        results.append(copies[0])
    assert torch.equal(bits(results[0]), bits(results[1])), "the result depends on the bucket size"


@settings(max_examples=examples(200), **FAST)
@given(gather_cases())
def test_simulated_plain_gather_is_exact(case):
    w, g, numel, _, _, dtype, buckets, profile, seed = case
    truth = make_values(numel, dtype, seed, profile)
    for bucket in buckets:
        plan = plan_gather(numel, w, elem_size=truth.element_size(), allgather_bucket_size=bucket,
                           zero_quantized_weights_format=None)
        check_gather_plan(plan)
        for c in simulate_gather(truth, plan, garbage_seed=seed):
            assert torch.equal(bits(c), bits(truth))


@settings(max_examples=examples(150), **FAST)
@given(gather_cases())
def test_simulated_gather_matches_reference_quantizer_per_partition(case):
    """The chunked payload path equals quantize/dequantize of each whole partition, with the
    side elements (exact elements and exact groups) the plan names exact."""
    from qzero.quant.reference import dequantize, quantize

    w, g, numel, ranges, fmt, dtype, buckets, profile, seed = case
    truth = make_values(numel, dtype, seed, profile)
    plan = plan_gather(numel, w, elem_size=truth.element_size(), allgather_bucket_size=buckets[0],
                       zero_quantized_weights_format=fmt, zero_quantized_weights_group_size=g,
                       exact_ranges=ranges)
    got = simulate_gather(truth, plan, garbage_seed=None)[w - 1]
    p = numel // w
    want = torch.empty_like(truth)
    for r in range(w):
        part = truth[r * p : (r + 1) * p]
        local = [(c.offset + a, c.offset + b) for c in plan.chunks for a, b in plan.side_ranges(c, r)]
        idx = torch.unique(torch.cat([torch.arange(a, b) for a, b in local])) if local else None
        v, s = quantize(part, g, fmt, idx)
        deq = dequantize(v, s, p, g, fmt, dtype)
        if idx is not None:
            deq[idx] = part[idx]
        want[r * p : (r + 1) * p] = deq
    assert torch.equal(bits(got), bits(want))


# ------------------------------------------------------------------ the gather, real processes


def gather_worker(rank, world, cases):
    import qzero

    out = []
    for numel, g, ranges, fmt, dtype, bucket, profile, seed in cases:
        truth = make_values(numel, dtype, seed, profile)
        flat = poisoned_copy(truth, rank, world)
        qzero.quantized_all_gather(flat, zero_quantized_weights_group_size=g, exact_ranges=ranges,
                                   allgather_bucket_size=bucket, zero_quantized_weights_format=fmt)
        out.append(flat)
    return out


@st.composite
def distributed_batches(draw):
    world = draw(st.integers(2, 3))
    cases = []
    for _ in range(draw(st.integers(1, 8))):
        g = draw(st.sampled_from([8, 16, 64]))
        p = draw(st.integers(1, 10 * g))
        numel = world * p
        cuts = sorted(set(draw(st.lists(st.integers(0, numel), max_size=6))))
        ranges = [(cuts[i], cuts[i + 1]) for i in range(0, len(cuts) - 1, 2)]
        bucket = world * g * draw(st.integers(1, 4)) + draw(st.integers(0, world * g - 1))
        cases.append(
            (numel, g, ranges, draw(st.sampled_from(FORMATS)), draw(st.sampled_from(DTYPES)), bucket,
             draw(st.sampled_from(["normal", "logspace", "zeros", "extremes"])), draw(st.integers(0, 2**31 - 1)))
        )
    return world, cases


@settings(max_examples=20, **FAST)
@given(distributed_batches())
def test_real_gather_equals_simulation(batch):
    """Each example spawns one gloo group and runs a batch of random gathers on it; every
    rank's result equals the simulation (and hence the numpy model)."""
    from _support.distributed import run_distributed

    world, cases = batch
    by_rank = run_distributed(gather_worker, world, cases, timeout=60)
    for i, (numel, g, ranges, fmt, dtype, bucket, profile, seed) in enumerate(cases):
        truth = make_values(numel, dtype, seed, profile)
        want = expected_gather(truth, world, g, ranges, fmt)
        for r in range(world):
            assert torch.equal(bits(by_rank[r][i]), bits(want)), f"case {i} rank {r}"


@settings(max_examples=examples(600), **FAST)
@given(layouts(world=st.integers(1, 16)), st.sampled_from(["contiguous", "interleaved"]), st.data())
def test_scatter_buckets_stage_every_gradient_element_once(args, order, data):
    """Windows tile the partitions (windows nobody touches left out), last first; every element
    of every parameter but the solo ones lands in exactly one staging position, at its rank's
    row of the window."""
    shapes, w, g, fmt, threshold, alignment, a, bucket, elem = args
    used = sum(math.prod(s) for s in shapes)
    lay = plan_flat_layout(shapes, w, alignment=alignment, zero_quantized_weights_group_size=g,
                           small_param_numel=threshold,
                           allgather_bucket_size=bucket, zero_quantized_weights_format=fmt, flat_order=order)
    p = lay.partition_numel
    least = max(w, w * (p // 500))  # at most ~500 windows, so the checks stay fast
    rbucket = data.draw(st.integers(least, least + 20_000))
    solo = solo_slots(lay, rbucket)
    buckets = plan_scatter_buckets(lay, rbucket, exclude=solo)
    width = scatter_window_numel(p, w, rbucket)
    for i in solo:  # reduced on their own: they start a partition, span several windows, in no window
        s = lay.slots[i]
        assert s.start % p == 0 and s.numel > width and all(i not in b.slots for b in buckets)
    assert w * width <= max(rbucket, w) and width <= p
    assert [b.index for b in buckets] == list(range(len(buckets)))
    assert [b.lo for b in buckets] == sorted((b.lo for b in buckets), reverse=True)
    for b in buckets:
        assert b.lo % width == 0 and b.hi == min(b.lo + width, p)
    seen = {}
    for s in lay.slots:
        if s.index in solo:
            continue
        got = 0
        for b in buckets:
            pieces = scatter_pieces(b, s.start, s.stop, p)
            assert bool(pieces) == (s.numel > 0 and s.index in b.slots), "a bucket waits for exactly its parameters"
            for x, y, off in pieces:
                r = x // p
                assert (y - 1) // p == r and off == r * b.width + x - r * p - b.lo
                assert 0 <= off and off + y - x <= w * b.width
                for pos in range(off, off + y - x) if y - x < 64 else (off, off + y - x - 1):
                    assert (b.index, pos) not in seen, "two elements staged at one position"
                    seen[(b.index, pos)] = s.index
                got += y - x
        assert got == s.numel, "every element of every parameter is staged exactly once"
    assert sum(s.numel for s in lay.slots) == used
