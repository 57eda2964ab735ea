"""The pure layout planner: padding, parameter ranges, exact ranges, chunks and bounds."""

import math
import random

import pytest
from _support.simulate import exact_group

from qzero.layout import PayloadKind, padded_flat_numel, plan_flat_layout, plan_gather
from qzero.quant.formats import get_format

QWEN3_4B_SHAPES = (
    [(151936, 2560)]
    + [
        s
        for _ in range(36)
        for s in [
            (2560,), (4096, 2560), (1024, 2560), (1024, 2560), (2560, 4096), (128,), (128,),
            (2560,), (9728, 2560), (9728, 2560), (2560, 9728),
        ]
    ]
    + [(2560,)]
)


def brute_force_sides(plan, chunk):
    """Per rank, the side elements of ``chunk`` (slice offsets), element by element: its exact
    elements and every element of a group that the rule sends verbatim; and whether that rank
    codes at least one group."""
    exact = set()
    for a, b in plan.exact_ranges:
        exact.update(range(a, b))
    sides, codes = [], []
    for r in range(plan.world_size):
        lo = r * plan.partition_numel + chunk.offset
        side, coded = set(), False
        for g0 in range(0, chunk.numel, plan.group_size):
            g1 = min(g0 + plan.group_size, chunk.numel)
            e = {i for i in range(g0, g1) if lo + i in exact}
            if exact_group(g1 - g0, len(e), plan.fmt, plan.elem_size):
                side.update(range(g0, g1))
            else:
                side |= e
                coded = True
        sides.append(side)
        codes.append(coded)
    return sides, codes


def check_plan_invariants(plan, brute=False):
    p = plan.partition_numel
    assert plan.world_size * plan.chunk_numel <= plan.allgather_bucket_size, "bucket rule"
    assert plan.max_recv_numel <= plan.allgather_bucket_size
    assert plan.chunk_numel % plan.group_size == 0 and plan.chunk_numel >= plan.group_size
    f = get_format(plan.fmt)
    es = plan.elem_size
    pos = 0
    for i, c in enumerate(plan.chunks):
        assert c.index == i and c.offset == pos and 0 < c.numel <= plan.chunk_numel
        assert c.offset % plan.group_size == 0, "groups never cross chunks"
        if c.numel % plan.group_size == 0:
            assert c.payload_bytes <= c.numel * es, "never more than the plain slice"
        sides = [sum(b - a for a, b in plan.side_ranges(c, r)) for r in range(plan.world_size)]
        if c.kind is PayloadKind.PLAIN:
            assert c.payload_bytes == c.numel * es and sides == [c.numel] * plan.world_size
        else:
            assert c.payload_bytes % 16 == 0
            for r in range(plan.world_size):
                pl = plan.payload_of(c, r)
                runs = plan.group_runs(c, r)
                coded = c.numel if runs is None else runs.coded_numel()
                groups = -(-c.numel // plan.group_size) if runs is None else runs.coded_groups()
                assert pl.values_offset == 0 and pl.scales_offset >= f.value_bytes(coded)
                assert pl.scales_offset % 4 == 0 and pl.exact_offset % es == 0
                assert pl.exact_offset >= pl.scales_offset + 4 * groups
                assert pl.nbytes == c.payload_bytes >= pl.exact_offset + pl.exact_numel * es
                assert sides[r] <= pl.exact_numel <= c.numel, "side channel bounded by the chunk"
                if c.kind is PayloadKind.PER_RANK:
                    assert pl.exact_numel == sides[r]
            if c.kind is PayloadKind.SHARED:
                assert c.payload.exact_numel == max(sides)
        if brute:
            want, codes = brute_force_sides(plan, c)
            got = [{a + k for a, b in plan.side_ranges(c, r) for k in range(b - a)} for r in range(plan.world_size)]
            assert got == want
            assert (c.kind is PayloadKind.PLAIN) == (not any(codes))
        pos += c.numel
    assert pos == p


def test_padding_rule():
    assert padded_flat_numel(0, 4, 64) == 256
    assert padded_flat_numel(1000, 3, 64) == 1152
    assert padded_flat_numel(1152, 3, 64) == 1152


def test_flat_layout_ranges_padding_and_exact():
    shapes = [(10, 30), (30,), (7,), (64, 64), (3, 5, 2)]
    lay = plan_flat_layout(shapes, world_size=3, zero_quantized_weights_group_size=64, small_param_numel=100,
                           allgather_bucket_size=3 * 128)
    starts = [s.start for s in lay.slots]
    assert starts == [0, 300, 330, 337, 337 + 4096]
    assert lay.used_numel == 337 + 4096 + 30
    assert lay.numel % (3 * 64) == 0 and 0 <= lay.padding < 3 * 64
    assert [s.exact for s in lay.slots] == [False, True, True, False, True]
    # adjacent small parameters merge into one exact range
    assert lay.exact_ranges == ((300, 337), (4433, 4463))
    # partitions cover the buffer; a parameter straddles the 0|1 boundary
    p = lay.partition_numel
    assert [lay.partition(r) for r in range(3)] == [(0, p), (p, 2 * p), (2 * p, 3 * p)]
    straddlers = [s for s in lay.slots if s.start < p < s.stop]
    assert straddlers, "test layout must have a parameter straddling partitions"
    check_plan_invariants(lay.gather)


def test_no_exact_ranges_for_plain_layout_or_zero_threshold():
    assert plan_flat_layout([(5,), (9, 9)], 2, zero_quantized_weights_format=None).exact_ranges == ()
    assert plan_flat_layout([(5,), (9, 9)], 2, small_param_numel=0).exact_ranges == ()


@pytest.mark.parametrize("seed", range(40))
def test_random_plans_obey_bounds_and_side_channel_sizes(seed):
    rng = random.Random(seed)
    world = rng.choice([1, 2, 3, 4, 5, 8])
    group = rng.choice([8, 16, 64, 72])
    partition = rng.randrange(1, 40) * rng.choice([1, group])
    numel = partition * world
    bucket = world * group * rng.randrange(1, 6) + rng.randrange(0, world * group)
    # random sorted disjoint ranges
    cuts = sorted(rng.sample(range(numel + 1), min(numel + 1, 2 * rng.randrange(0, 6))))
    ranges = [(cuts[i], cuts[i + 1]) for i in range(0, len(cuts) - 1, 2) if cuts[i] < cuts[i + 1]]
    plan = plan_gather(numel, world, allgather_bucket_size=bucket, zero_quantized_weights_group_size=group,
                       exact_ranges=ranges)
    check_plan_invariants(plan, brute=True)


@pytest.mark.parametrize("world", [4, 8, 64, 1024])
def test_large_world_plans_stay_within_the_bucket(world):
    bucket = 50_000_000
    lay = plan_flat_layout(QWEN3_4B_SHAPES, world, allgather_bucket_size=bucket)
    plan = lay.gather
    check_plan_invariants(plan)
    assert plan.max_recv_numel <= bucket
    # the receive buffer in bytes is below a bf16 bucket (the payload is ~1.06 B/elem)
    assert plan.max_recv_bytes <= 2 * bucket
    assert lay.used_numel == sum(math.prod(s) for s in QWEN3_4B_SHAPES)
    assert plan.bytes_per_rank < 0.6 * plan.plain_bytes_per_rank  # side channel sized for the worst rank


def test_default_bytes_per_parameter():
    plan = plan_gather(2 * 64 * 1000, 2, zero_quantized_weights_group_size=64)
    assert plan.bytes_per_rank == 64 * 1000 * (1 + 4 / 64)
    assert plan.plain_bytes_per_rank == 64 * 1000 * 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(numel=10, world_size=3), "not divisible by the world size 3"),
        (dict(numel=64, world_size=0), "world_size"),
        (dict(numel=128, world_size=2, allgather_bucket_size=0), "allgather_bucket_size"),
        (dict(numel=128, world_size=2, allgather_bucket_size=5e8), "allgather_bucket_size"),
        (dict(numel=128, world_size=2, allgather_bucket_size=100), "smaller than one group per rank"),
        (dict(numel=128, world_size=2, zero_quantized_weights_group_size=12), "zero_quantized_weights_group_size"),
        (dict(numel=128, world_size=2, zero_quantized_weights_format="int2"),
         "zero_quantized_weights_format: unknown quantization format 'int2'"),
        (dict(numel=128, world_size=2, exact_ranges=[(5, 9), (1, 3)]), r"exact_ranges\[1\]"),
        (dict(numel=128, world_size=2, exact_ranges=[(5, 9), (8, 12)]), "overlaps"),
        (dict(numel=128, world_size=2, exact_ranges=[(120, 129)]), "out of range"),
        (dict(numel=128, world_size=2, exact_ranges=[(7, 7)]), "out of range"),
        (dict(numel=-2, world_size=2), "numel"),
    ],
)
def test_bad_plan_arguments(kwargs, match):
    numel = kwargs.pop("numel")
    world = kwargs.pop("world_size")
    with pytest.raises(ValueError, match=match):
        plan_gather(numel, world, **kwargs)


@pytest.mark.parametrize("world", [4, 8])
def test_dp4_dp8_qwen3_4b_plans(world):
    """A DP4 setting (and DP8): Qwen3-4B, 50M gather bucket, 26M reduce bucket.
    Transient gather memory stays within the bucket whatever the world size, with gather-ahead's
    two chunks in flight planned at half the bucket each."""
    from qzero.buckets import plan_reduce_buckets

    for depth in (1, 2):
        lay = plan_flat_layout(QWEN3_4B_SHAPES, world, allgather_bucket_size=50_000_000 // depth)
        plan = lay.gather
        check_plan_invariants(plan)
        assert depth * plan.max_recv_numel <= 50_000_000
        assert depth * plan.max_recv_bytes <= 1.1 * 50_000_000  # ~1.07 B/element: about half a bf16 bucket
    buckets = plan_reduce_buckets(lay, 26_000_000)
    assert max(b.numel for b in buckets) <= 26_000_000
    assert sum(b.numel for b in buckets) == lay.used_numel


@pytest.mark.parametrize("world", [2, 3, 8])
def test_interleaved_order_follows_the_model_in_every_partition(world):
    """Each partition holds its parameters in model order, and the gather chunk a parameter
    needs grows with its model position: a forward in model order meets chunks in gather order."""
    from qzero.wire.overlap import last_chunk_needed

    shapes = QWEN3_4B_SHAPES[: 1 + 11 * 8]  # embedding + 8 layers
    lay = plan_flat_layout(shapes, world, allgather_bucket_size=world * 64 * 2048, flat_order="interleaved")
    check_plan_invariants(lay.gather)
    p = lay.partition_numel
    assert lay.numel == world * p and p % 64 == 0
    largest = max(s.numel for s in lay.slots)
    assert lay.padding < world * (largest + 64)
    by_rank = {}
    for s in lay.slots:  # model order
        r = s.start // p
        assert (s.stop - 1) // p == r, "parameters do not straddle partitions in the interleaved order"
        by_rank.setdefault(r, []).append(s.start)
    for starts in by_rank.values():
        assert starts == sorted(starts)
    # After the embedding (needed first, whatever the order), chunks are needed in gather order,
    # give or take the partitions' imbalance (at most one parameter).
    slack = largest // lay.gather.chunk_numel + 1
    needed = [last_chunk_needed(lay.gather, s.start, s.stop) for s in lay.slots[1:]]
    running = 0
    for k in needed:
        assert k >= running - slack, "a later parameter needs a much earlier chunk"
        running = max(running, k)
    # whereas in the contiguous order the parameter straddling the first partition boundary
    # (about 1/world of the way through the model) already needs the last chunk
    contiguous = plan_flat_layout(shapes, world, allgather_bucket_size=world * 64 * 2048)
    q = contiguous.partition_numel
    straddler = next((s for s in contiguous.slots if s.start < q < s.stop), None)
    if straddler is not None:
        assert (last_chunk_needed(contiguous.gather, straddler.start, straddler.stop)
                == len(contiguous.gather.chunks) - 1)


def test_interleaved_with_one_rank_is_contiguous():
    shapes = [(10, 30), (30,), (7,), (64, 64)]
    a = plan_flat_layout(shapes, 1, flat_order="interleaved")
    b = plan_flat_layout(shapes, 1)
    assert [s.start for s in a.slots] == [s.start for s in b.slots] and a.numel == b.numel


def test_auto_order_interleaves_unless_that_pads_much():
    """``order="auto"``: the interleaved order for ordinary models; the contiguous order when
    interleaving would pad more than 3% (one very large parameter placed last)."""
    llm = QWEN3_4B_SHAPES
    for world in (2, 3, 8):
        auto = plan_flat_layout(llm, world, flat_order="auto")
        assert auto.order == "interleaved"
        assert auto.numel == plan_flat_layout(llm, world, flat_order="interleaved").numel
    lopsided = [(64, 64)] * 10 + [(4096, 1024)]  # the last parameter is 98% of the model
    auto = plan_flat_layout(lopsided, 2, flat_order="auto")
    interleaved = plan_flat_layout(lopsided, 2, flat_order="interleaved")
    assert interleaved.padding > 0.4 * interleaved.used_numel
    assert auto.order == "contiguous" and auto.padding < 2 * 64
    assert plan_flat_layout(lopsided, 2).order == "contiguous"  # the planner's own default
    with pytest.raises(ValueError, match="order must be"):
        plan_flat_layout(llm, 2, flat_order="zigzag")
