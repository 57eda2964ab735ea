"""Nothing is sent twice: exact groups carry no codes, and no gather sends more than a plain one.

See ``[Note: exact groups]`` in ``qzero/layout/gather_plan.py``. Small parameters travel in the side
channel only; a group all (or most) of whose elements are exact sends no values and no
scale, each rank's payload has its own layout where ranks differ, and a chunk that no rank
codes is sent as it is. So for any model the quantized gather sends at most the bytes of a
plain gather, exactly as many when every parameter is small, and every element that is
still quantized has the reference quantizer's bits.
"""

from __future__ import annotations

import math

import pytest
import torch
from _support.distributed import run_distributed
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from _support.simulate import bits, expected_gather, simulate_gather

import qzero
from qzero.wire.engine import stats_of
from qzero.layout import DEFAULT_SMALL_PARAM_NUMEL, PayloadKind, plan_flat_layout, plan_gather
from qzero.quant import reference

FAST = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# ------------------------------------------------------------------ models as parameter shapes


def small_shapes(threshold: int):
    """Shapes of at most ``threshold`` elements: norms, biases, small matrices."""
    side = max(1, math.isqrt(threshold))
    return st.one_of(
        st.tuples(st.integers(1, threshold)),
        st.tuples(st.integers(1, side), st.integers(1, side)),
    )


def large_shapes(threshold: int, limit: int):
    """Shapes of more than ``threshold`` elements (quantized), about ``limit`` at most."""
    top = max(threshold + 1, limit)
    return st.one_of(
        st.tuples(st.integers(threshold + 1, top)),
        st.tuples(st.integers(2, 9), st.integers(threshold // 2 + 1, max(threshold // 2 + 1, top // 9))),
    )


@st.composite
def models(draw, limit=400_000):
    """A model as ordered parameter shapes: all small, all large, or mixed, with the default
    threshold or a low one (as the CPU presets use), and how it is gathered: parameters of
    about ``limit`` elements at most (thresholds above it are not drawn), a few dozen chunks."""
    threshold = draw(st.sampled_from([t for t in (DEFAULT_SMALL_PARAM_NUMEL, 1024, 100) if 4 * t <= limit]))
    kind = draw(st.sampled_from(["all-small", "all-large", "mixed"]))
    count = draw(st.integers(1, 12))
    small, large = small_shapes(threshold), large_shapes(threshold, limit // 2)
    pick = {"all-small": small, "all-large": large, "mixed": st.one_of(small, large)}[kind]
    shapes = [draw(pick) for _ in range(count)]
    if kind == "mixed":
        shapes += [draw(small), draw(large)]  # both kinds, whatever was drawn
    total = sum(math.prod(s) for s in shapes)
    world = draw(st.integers(1, 3))
    group = draw(st.sampled_from([64, 64, 8, 16, 128]))
    fmt = draw(st.sampled_from(["int8", "int8", "int4", "fp8"]))
    order = draw(st.sampled_from(["contiguous", "interleaved"]))
    unit = world * group
    least = max(unit, total // 40)  # at most about 40 chunks a partition
    bucket = draw(st.one_of(st.just(500_000_000), st.integers(least, max(least, total // 3 + unit))))
    elem = draw(st.sampled_from([2, 2, 4]))
    return shapes, threshold, world, group, fmt, order, bucket, elem


def plan_of(shapes, threshold, world, group, fmt, order, bucket, elem):
    return plan_flat_layout(shapes, world, elem_size=elem, zero_quantized_weights_group_size=group,
                            small_param_numel=threshold,
                            allgather_bucket_size=bucket, zero_quantized_weights_format=fmt, flat_order=order)


# ------------------------------------------------------------------ bytes


@settings(max_examples=400, **FAST)
@given(models())
def test_quantized_gather_never_sends_more_than_plain(model):
    lay = plan_of(*model)
    stats = stats_of(lay.gather)
    assert stats.plain_bytes == lay.partition_numel * model[-1]
    assert stats.bytes_sent <= stats.plain_bytes, model
    for c in lay.gather.chunks:
        assert c.payload_bytes <= c.numel * model[-1], (c, model)


def all_small_model() -> torch.nn.Module:
    """131,712 parameters, none above 65,536 elements (as a tiny language model's)."""
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (torch.nn.LayerNorm(128), torch.nn.Linear(128, 128), torch.nn.GELU())]
    return torch.nn.Sequential(torch.nn.Embedding(256, 128), *layers, torch.nn.Linear(128, 256)).bfloat16()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_all_small_model_sends_exactly_the_plain_bytes(world):
    """Every parameter is small: the quantized gather sends each element once, verbatim, as a
    plain gather would (ratio 1, exactly; it was 1.53 when the whole partition was quantized
    and the exact elements went on top)."""
    shapes = [tuple(p.shape) for p in all_small_model().parameters()]
    assert max(math.prod(s) for s in shapes) <= DEFAULT_SMALL_PARAM_NUMEL
    lay = plan_flat_layout(shapes, world)
    stats = stats_of(lay.gather)
    assert stats.ratio == 1.0 and stats.bytes_sent == lay.partition_numel * 2


def all_small_step_worker(rank, world):
    import functools

    model = all_small_model()
    opt = qzero.ZeroOptimizer(model, functools.partial(torch.optim.AdamW, lr=1e-2),
                              config=qzero.ZeroConfig(zero_quantized_weights=True))
    x = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(rank))
    opt.backward(model(x).float().logsumexp(-1).mean())
    opt.step()
    opt.wait_for_weights()
    return ([(s.bytes_sent, s.plain_bytes) for s in opt.last_gather],
            torch.nn.utils.parameters_to_vector(model.parameters()))


def test_all_small_model_trains_with_plain_bytes_and_identical_replicas():
    """The same through ZeroOptimizer on two gloo ranks: one step's gather sends the plain bytes."""
    by_rank = run_distributed(all_small_step_worker, 2, timeout=120)
    for stats, weights in by_rank:
        (sent, plain), = stats
        assert sent == plain > 0
        assert torch.equal(weights.view(torch.int16), by_rank[0][1].view(torch.int16))


def test_mixed_model_bytes_by_hand():
    """One 90,000-element matrix and three 300-element norms after it, group 64, one rank: the
    matrix's last 16 elements share a group with 48 norm elements (cheaper verbatim: an exact
    group), the norms fill 13 whole groups, and the last group (20 norm elements, 44 of
    padding) is coded. Payload: 1,407 coded groups of 64 values and a scale, then 916 side
    elements, rounded up to 16 bytes."""
    lay = plan_flat_layout([(300, 300), (300,), (300,), (300,)], 1)
    assert lay.numel == 90_944
    (chunk,) = lay.gather.chunks
    assert chunk.kind is PayloadKind.PER_RANK
    assert chunk.runs == (((0, 89_984, 0), (89_984, 90_880, -1), (90_880, 90_944, 1406)),)
    values, scales, side = 1407 * 64, 1407 * 4, 916 * 2
    assert chunk.layouts[0][:4] == (0, values, values + scales, 916)
    assert chunk.payload_bytes == -(-(values + scales + side) // 16) * 16 == 97_520
    assert stats_of(lay.gather).bytes_sent == 97_520  # plain: 181,888


def test_groups_with_few_exact_elements_are_still_coded():
    """A bias of 10 elements inside a group of a large matrix does not make that group exact:
    coding it is still cheaper than sending it verbatim."""
    plan = plan_gather(4096, 1, zero_quantized_weights_group_size=64, exact_ranges=[(100, 110)])
    (chunk,) = plan.chunks
    assert chunk.kind is PayloadKind.SHARED and chunk.payload.exact_numel == 10
    assert plan.side_ranges(chunk, 0) == [(100, 110)]


# ------------------------------------------------------------------ bits


@settings(max_examples=30, **FAST)
@given(models(limit=12_000), st.integers(0, 2**31 - 1))
def test_simulated_gather_of_any_model_matches_the_reference(model, seed):
    """Every rank ends with the same bits; exact and verbatim-sent elements are the owner's
    bits, every other element is the reference quantizer's value (and the independent numpy
    model's), whatever the chunking."""
    shapes, threshold, world, group, fmt, order, bucket, elem = model
    dtype = torch.float32 if elem == 4 else torch.bfloat16
    if dtype == torch.float32:
        return  # the quantized gather takes 16-bit buffers; 4-byte plans are checked for bytes above
    lay = plan_of(*model)
    plan = lay.gather
    gen = torch.Generator().manual_seed(seed)
    truth = (torch.randn(plan.numel, generator=gen) * torch.rand(plan.numel, generator=gen) * 4).to(dtype)
    copies = simulate_gather(truth, plan, garbage_seed=seed)
    for r in range(1, world):
        assert torch.equal(bits(copies[r]), bits(copies[0])), f"replica {r} differs"
    want = expected_gather(truth, world, group, plan.exact_ranges, fmt)
    assert torch.equal(bits(copies[0]), bits(want))
    # per partition, what the reference quantizer gives with the plan's side elements exact
    p = plan.partition_numel
    for r in range(world):
        part = truth[r * p : (r + 1) * p]
        side = [(c.offset + a, c.offset + b) for c in plan.chunks for a, b in plan.side_ranges(c, r)]
        idx = torch.cat([torch.arange(a, b) for a, b in side]) if side else None
        deq = reference.dequantize(*reference.quantize(part, group, fmt, idx), p, group, fmt, dtype)
        if idx is not None:
            deq[idx] = part[idx]
        assert torch.equal(bits(copies[0][r * p : (r + 1) * p]), bits(deq))


def test_coded_groups_keep_the_codes_of_the_whole_slice():
    """The payload of a slice with exact groups holds exactly the values and scales that
    quantizing the whole slice gives its coded groups, in order (no group's codes move)."""
    gen = torch.Generator().manual_seed(3)
    n, gs = 64 * 20 + 24, 64
    x = (torch.randn(n, generator=gen) * 3).bfloat16()
    exact = [(0, 70), (200, 400), (1000, 1001), (1250, n)]
    plan = plan_gather(n, 1, zero_quantized_weights_group_size=gs, exact_ranges=exact, allgather_bucket_size=n + gs)
    (chunk,) = plan.chunks
    runs = plan.group_runs(chunk, 0)
    assert runs is not None and runs.coded_groups() < -(-n // gs)
    from qzero.wire.chunks import exact_index

    idx = exact_index(plan, chunk, 0, torch.device("cpu"))
    buf = torch.zeros(chunk.payload_bytes, dtype=torch.uint8)
    layout = plan.payload_of(chunk, 0)
    reference.pack_payload(x, buf, layout, gs, "int8", idx, runs)
    values, scales = reference.quantize(x, gs, "int8", idx)
    coded = [g for lo, hi, first in runs.rows[0] if first >= 0 for g in range(lo // gs, -(-hi // gs))]
    want_values = torch.cat([values[g * gs : min((g + 1) * gs, n)] for g in coded])
    assert torch.equal(buf[: want_values.numel()], want_values)
    got_scales = buf[layout.scales_offset : layout.scales_offset + 4 * len(coded)].view(torch.float32)
    assert torch.equal(got_scales, scales[coded])
    side = buf[layout.exact_offset : layout.exact_offset + 2 * idx.numel()].view(torch.bfloat16)
    assert torch.equal(side.view(torch.int16), x[idx].view(torch.int16))


# ------------------------------------------------------------------ real processes


MIXED = [(300, 300), (300,), (64, 65), (7,), (70_000,), (1000,), (2, 5000), (3,)]


def mixed_worker(rank, world):
    lay = plan_flat_layout(MIXED, world, small_param_numel=5000, allgather_bucket_size=world * 64 * 200)
    gen = torch.Generator().manual_seed(7)
    truth = torch.randn(lay.numel, generator=gen).bfloat16()
    p = lay.partition_numel
    flat = torch.full_like(truth, float("nan"))
    flat[rank * p : (rank + 1) * p] = truth[rank * p : (rank + 1) * p]
    stats = qzero.quantized_all_gather(flat, exact_ranges=lay.exact_ranges,
                                       allgather_bucket_size=lay.gather.allgather_bucket_size)
    return flat, stats, truth


@pytest.mark.parametrize("world", [2, 3])
def test_real_gather_of_a_mixed_model(world):
    """On gloo ranks: replicas bit-identical, equal to the numpy model, every kind of chunk
    payload on the way (shared, per rank, plain), never more than the plain bytes."""
    lay = plan_flat_layout(MIXED, world, small_param_numel=5000, allgather_bucket_size=world * 64 * 200)
    kinds = {c.kind for c in lay.gather.chunks}
    assert PayloadKind.PER_RANK in kinds and PayloadKind.SHARED in kinds
    by_rank = run_distributed(mixed_worker, world, timeout=120)
    truth = by_rank[0][2]
    want = expected_gather(truth, world, 64, lay.exact_ranges, "int8")
    for r in range(world):
        flat, stats, _ = by_rank[r]
        assert torch.equal(bits(flat), bits(want)), f"rank {r}"
        assert stats.bytes_sent == stats_of(lay.gather).bytes_sent <= stats.plain_bytes
