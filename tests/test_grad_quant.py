"""Quantized gradient reduction (``zero_quantized_gradients``) against independent references.

* The Triton kernels against the torch reference, byte for byte and sum for sum (CPU
  interpreter here, compiled on a GPU machine).
* The reduced gradient shards on real gloo groups (worlds 2, 3, 4; both flat orders;
  stages 1 and 2; two micro-batches) against an fp64 average of every rank's gradient:
  each element within half a quantization step of each other sender's group (plus fp32
  rounding), small parameters bit-exact, replicas identical, the traffic counted.
* NaN and Inf: found (check_finite, fp16 overflow skip), exactly where a sender had them.
* Training tracks the plain reduction; bad settings raise on every rank, changing nothing.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from _support.distributed import run_distributed

import qzero
from qzero.layout import aligned_layout
from qzero.quant import gradients as ref
from qzero.quant.formats import get_format

# ------------------------------------------------------------------ a model with chosen gradients

SHAPES = [(40, 24), (7,), (24, 36), (5,), (3, 50), (300,), (6,)]
SMALL = 40  # small_param_numel: the (7,), (5,) and (6,) parameters reduce exactly
GS = 16


class Chosen(torch.nn.Module):
    """``loss = sum(p * c)``: the gradient of every parameter is the coefficient ``c``."""

    def __init__(self, dtype):
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in SHAPES])

    def forward(self, coeffs):
        return sum((p.float() * c).sum() for p, c in zip(self.ps, coeffs))


def coeffs(rank: int, micro: int, dtype=torch.bfloat16) -> list[torch.Tensor]:
    """``k * 2**e`` (|k| < 128, e in [-20, 0]): exact in bf16 and fp16, magnitudes mixed in every group."""
    g = torch.Generator().manual_seed(7919 * rank + 104729 * micro + 1)
    out = []
    for s in SHAPES:
        k = torch.randint(-127, 128, s, generator=g).float()
        e = torch.randint(-20, 1, s, generator=g).float()
        out.append((k * torch.pow(2.0, e)).to(dtype).float())
    return out


ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)


def grad_worker(rank, world, cfg_kwargs, micro, dtype=torch.bfloat16, poison=None):
    torch.manual_seed(0)
    model = Chosen(dtype)
    opt = qzero.ZeroOptimizer(model, ADAMW, config=qzero.ZeroConfig(**cfg_kwargs))
    error = None
    for m in range(micro):
        cs = coeffs(rank, m, dtype)
        if poison is not None and rank == poison["rank"]:
            for i, j, v in poison["at"]:
                cs[i].view(-1)[j] = v
        opt.backward(model(cs))
    try:
        took = opt.step()
    except FloatingPointError as e:
        took, error = None, str(e)
    g = opt.groups[0]
    quant = opt.grads[0].reducer.quant
    pieces = [(p.flat_lo, p.numel) for plan in quant._plans.values() for p in plan if p.dest == rank] if quant else []
    units = len(opt.grads[0].reducer.buckets) + len(opt.grads[0].reducer.solo)
    return {
        "shard": g.grad.clone(),
        "lo": g.lo,
        "slots": [(s.start, s.numel, s.exact) for s in g.layout.slots],
        "numel": g.layout.numel,
        "pieces": pieces,
        "units": units,
        "stats": [tuple(s) for s in opt.last_reduce],
        "flat": g.flat.clone(),
        "took": took,
        "error": error,
    }


# ------------------------------------------------------------------ the fp64 reference and the bound


def contributions(res, world, micro, stage, dtype=torch.bfloat16):
    """Per reduction, every rank's flat gradient as the reducer sent it (fp64 values).
    Stage 1 reduces once the micro-batches' sum, accumulated in the parameter dtype."""
    numel, slots = res["numel"], res["slots"]

    def flat_of(per_param):
        f = torch.zeros(numel, dtype=torch.float64)
        for (start, n, _), c in zip(slots, per_param):
            f[start : start + n] = c.reshape(-1).double()
        return f

    if stage == 1:
        out = []
        for r in range(world):
            acc = [torch.zeros(s, dtype=dtype) for s in SHAPES]
            for m in range(micro):
                acc = [a + c.to(dtype) for a, c in zip(acc, coeffs(r, m, dtype))]  # bf16 adds, as AccumulateGrad
            out.append(flat_of(acc))
        return [out]
    return [[flat_of(coeffs(r, m, dtype)) for r in range(world)] for m in range(micro)]


def half_steps(x: torch.Tensor, exact: torch.Tensor, fmt: str) -> torch.Tensor:
    """Half the quantization step at every element of one sender's group ``x`` (fp64)."""
    f = get_format(fmt)
    absmax = x.masked_fill(exact, 0).abs().max()
    scale = max(float(absmax) / f.qmax, torch.finfo(torch.float32).tiny)
    if fmt in ("int8", "int4"):  # integers: one step per group
        return torch.full_like(x, scale / 2)
    y = (x.abs() / scale).clamp_min(2.0**-6)  # e4m3: quantum 2**(E - 3), E >= -6
    return torch.pow(2.0, torch.floor(torch.log2(y)) - 3) / 2 * scale


def check_shards(results, world, micro, stage, fmt="int8"):
    exact_mask = torch.zeros(results[0]["numel"], dtype=torch.bool)
    for start, n, is_exact in results[0]["slots"]:
        exact_mask[start : start + n] = is_exact
    rounds = contributions(results[0], world, micro, stage)
    checked_exact = 0
    for r, res in enumerate(results):
        shard, lo = res["shard"], res["lo"]
        hi = lo + shard.numel()
        want = torch.zeros(shard.numel(), dtype=torch.float64)
        bound = torch.zeros(shard.numel(), dtype=torch.float64)
        exact_want = torch.zeros(shard.numel(), dtype=torch.float32)
        for xs in rounds:
            want += sum(x[lo:hi] for x in xs) / world
            slack = sum(x[lo:hi].abs() for x in xs) * 2.0**-21
            bound += slack + 1e-30
            for flat_lo, n in res["pieces"]:
                for g0 in range(flat_lo, flat_lo + n, GS):
                    g1 = min(g0 + GS, flat_lo + n)
                    for s, x in enumerate(xs):
                        if s != r:
                            bound[g0 - lo : g1 - lo] += half_steps(x[g0:g1], exact_mask[g0:g1], fmt) / world
            summed = torch.zeros(shard.numel(), dtype=torch.float32)
            for x in xs:  # rank order, fp32, from zero
                summed += x[lo:hi].float()
            exact_want.add_(summed, alpha=1.0 / world)
        covered = torch.zeros(shard.numel(), dtype=torch.bool)
        for flat_lo, n in res["pieces"]:
            covered[flat_lo - lo : flat_lo - lo + n] = True
        used = torch.zeros(shard.numel(), dtype=torch.bool)
        for start, n, _ in res["slots"]:
            a, b = max(start, lo), min(start + n, hi)
            if a < b:
                used[a - lo : b - lo] = True
        assert bool(covered[used].all()), f"rank {r}: every gradient element it owns arrives in some piece"
        err = (shard.double() - want).abs()
        assert bool((err <= bound).all()), f"rank {r}: worst excess {float((err - bound).max()):.3g}"
        ex = exact_mask[lo:hi]
        checked_exact += int(ex.sum())
        assert torch.equal(shard[ex], exact_want[ex]), f"rank {r}: small parameters are not exact"
    assert checked_exact == int(exact_mask.sum())


# every world with both orders and both stages (the full cross product adds time, not coverage)
MATRIX = [(2, "contiguous", 1), (2, "interleaved", 2), (3, "contiguous", 2), (3, "interleaved", 1),
          (4, "interleaved", 2), (4, "contiguous", 1)]


@pytest.mark.parametrize("world,order,stage", MATRIX)
def test_shards_within_half_a_step_of_fp64(world, order, stage):
    micro = 2
    kwargs = dict(stage=stage, flat_order=order, reduce_bucket_size=300, small_param_numel=SMALL,
                  zero_quantized_gradients=True, zero_quantized_gradients_group_size=GS, solo_reduce=stage == 2)
    results = run_distributed(grad_worker, world, kwargs, micro)
    check_shards(results, world, micro, stage)
    for res in results[1:]:
        assert torch.equal(res["flat"].view(torch.int16), results[0]["flat"].view(torch.int16)), "replicas differ"
    units = results[0]["units"]
    for res in results:
        (sent, plain, collectives, quantized, _), = res["stats"]
        assert quantized and collectives == units * (1 if stage == 1 else micro)  # stage 1: once per step
        assert 0 < sent < 0.8 * plain  # 1 + 4/16 bytes per element instead of 2, plus exact elements


def test_fp8_fp32_reduce_dtype_and_overlap_off():
    world, micro = 3, 1
    kwargs = dict(stage=2, flat_order="interleaved", reduce_bucket_size=300, small_param_numel=SMALL,
                  reduce_dtype="fp32", overlap_comm=False, zero_quantized_gradients=True,
                  zero_quantized_gradients_group_size=GS, zero_quantized_gradients_format="fp8")
    results = run_distributed(grad_worker, world, kwargs, micro)
    check_shards(results, world, micro, 2, fmt="fp8")
    (sent, plain, _, _, _), = results[0]["stats"]
    assert sent < 0.4 * plain  # fp32 elements: 4 bytes each


# ------------------------------------------------------------------ NaN and Inf


INT4_ROTATED = {"zero_quantized_gradients_format": "int4", "zero_quantized_gradients_rotation_block": 8}


@pytest.mark.parametrize("order,stage,extra", [("interleaved", 2, {}), ("contiguous", 1, {}),
                                               ("interleaved", 2, INT4_ROTATED)])
def test_non_finite_gradients_are_found_where_they_are(order, stage, extra):
    world = 3
    block = extra.get("zero_quantized_gradients_rotation_block", 0)
    # rank 1: NaN in a large parameter, +Inf in a small (exact) one, -Inf in another large one
    poison = {"rank": 1, "at": [(2, 5, float("nan")), (1, 2, float("inf")), (4, 0, float("-inf"))]}
    kwargs = dict(stage=stage, flat_order=order, reduce_bucket_size=300, small_param_numel=SMALL,
                  zero_quantized_gradients=True, zero_quantized_gradients_group_size=GS, **extra)
    results = run_distributed(grad_worker, world, kwargs, 1, torch.bfloat16, poison)
    assert all(res["error"] and "qzero: non-finite" in res["error"] for res in results)  # raised on every rank
    slots = results[0]["slots"]
    exact = {k for start, m, is_exact in slots if is_exact for k in range(start, start + m)}
    expected = set()
    for i, j, _ in poison["at"]:
        f = slots[i][0] + j
        if slots[i][2]:
            expected.add(f)  # exact: just that element
            continue
        owner = next(r for r, res in enumerate(results) if res["lo"] <= f < res["lo"] + res["shard"].numel())
        flat_lo, n = next((a, n) for a, n in results[owner]["pieces"] if a <= f < a + n)
        if owner == poison["rank"]:  # the owner's own piece: that element (rotated: its block, but a partial tail)
            b0 = flat_lo + (f - flat_lo) // block * block if block else f
            span = range(b0, b0 + block) if block and b0 + block <= flat_lo + n else [f]
        else:  # a quantized group arrives as NaN: the whole group of the owner's piece
            g0 = flat_lo + (f - flat_lo) // GS * GS
            span = range(g0, min(g0 + GS, flat_lo + n))
        expected.update(set(span) - exact)  # exact elements stay exact
    found = set()
    for res in results:
        found.update(int(k) + res["lo"] for k in (~torch.isfinite(res["shard"])).nonzero().flatten())
    assert found == expected
    inf_at = slots[1][0] + 2
    owner = next(res for res in results if res["lo"] <= inf_at < res["lo"] + res["shard"].numel())
    assert owner["shard"][inf_at - owner["lo"]] == float("inf")  # exact elements keep their value


def test_fp16_overflow_is_skipped_on_every_rank():
    kwargs = dict(stage=2, flat_order="interleaved", reduce_bucket_size=300, small_param_numel=SMALL,
                  initial_scale_power=0, zero_quantized_gradients=True, zero_quantized_gradients_group_size=GS)
    clean = run_distributed(grad_worker, 2, kwargs, 1, torch.float16)
    assert all(res["took"] is True for res in clean)
    poison = {"rank": 0, "at": [(5, 17, float("inf"))]}
    results = run_distributed(grad_worker, 2, kwargs, 1, torch.float16, poison)
    assert all(res["took"] is False for res in results)


# ------------------------------------------------------------------ training


@pytest.mark.parametrize("order,stage", [("interleaved", 2), ("contiguous", 1)])
def test_training_tracks_plain_reduction(order, stage):
    from test_optim import reference_run, zero_run

    world, steps, micro = 3, 4, 2
    base = dict(stage=stage, flat_order=order, reduce_bucket_size=300, allgather_bucket_size=world * 64 * 3,
                small_param_numel=40)
    quant = run_distributed(zero_run, world, steps, {**base, "zero_quantized_gradients": True}, micro)
    ref_losses, _, _ = reference_run(world, steps, stage=stage, micro=micro)
    for res in quant[1:]:
        for a, b in zip(res["flats"], quant[0]["flats"]):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), "replicas differ"
    assert max(abs(a - b) for a, b in zip(quant[0]["losses"], ref_losses)) < 0.01


def test_off_is_the_plain_reduction_bit_for_bit():
    from test_optim import zero_run

    kwargs = dict(stage=2, flat_order="interleaved", reduce_bucket_size=300, small_param_numel=40)
    a = run_distributed(zero_run, 2, 2, kwargs)
    b = run_distributed(zero_run, 2, 2, {**kwargs, "zero_quantized_gradients": False,
                                        "zero_quantized_gradients_group_size": 8})
    for x, y in zip(a[0]["flats"] + [t for t in a[0]["params"]], b[0]["flats"] + [t for t in b[0]["params"]]):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))


def stats_worker(rank, world, quantized):
    model = Chosen(torch.bfloat16)
    cfg = qzero.ZeroConfig(stage=1, flat_order="contiguous", reduce_bucket_size=500, small_param_numel=SMALL,
                           zero_quantized_gradients=quantized)
    opt = qzero.ZeroOptimizer(model, ADAMW, config=cfg)
    opt.backward(model(coeffs(rank, 0)))
    opt.step()
    return [tuple(s) for s in opt.last_reduce]


def test_plain_bytes_are_what_the_plain_reduction_sends():
    plain = run_distributed(stats_worker, 2, False)
    quant = run_distributed(stats_worker, 2, True)
    for p, q in zip(plain, quant):
        (p_sent, p_plain, p_n, p_q, _), = p
        (q_sent, q_plain, q_n, q_q, _) = q[0]
        assert p_sent == p_plain == q_plain and p_n == q_n and not p_q and q_q
        assert q_sent < 0.6 * q_plain  # group 64: 1.0625 bytes instead of 2, plus exact elements


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(zero_quantized_gradients_group_size=12), "zero_quantized_gradients_group_size"),
        (dict(zero_quantized_gradients_group_size=0), "zero_quantized_gradients_group_size"),
        (dict(zero_quantized_gradients_group_size=True), "zero_quantized_gradients_group_size"),
        (dict(zero_quantized_gradients_format="bf16"), "zero_quantized_gradients_format"),
        (dict(zero_quantized_gradients="yes"), "zero_quantized_gradients must be true or false"),
    ],
)
def test_bad_settings_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        qzero.ZeroConfig(**bad)
    with pytest.raises(ValueError, match=match):
        qzero.ZeroConfig.from_dict({"stage": 2, "zero_quantized_gradients": True, **bad})


def differing_worker(rank, world):
    model = Chosen(torch.bfloat16)
    before = [p.data_ptr() for p in model.parameters()]
    cfg = qzero.ZeroConfig(zero_quantized_gradients=rank == 0, small_param_numel=SMALL)
    try:
        qzero.ZeroOptimizer(model, ADAMW, config=cfg)
    except ValueError as e:
        return str(e), [p.data_ptr() for p in model.parameters()] == before
    return None, False


def test_settings_that_differ_across_ranks_raise_on_every_rank():
    for msg, untouched in run_distributed(differing_worker, 2):
        assert msg is not None and "config" in msg and "differs between ranks" in msg
        assert untouched


# ------------------------------------------------------------------ kernels against the reference

try:
    from qzero.quant.triton import AVAILABLE as HAVE_KERNELS
except ImportError:  # pragma: no cover
    HAVE_KERNELS = False

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"


def piece(n, dtype, gen, device):
    mags = torch.pow(10.0, torch.empty(n).uniform_(-6, 3, generator=gen))
    x = torch.randn(n, generator=gen) * mags
    x[8:16] = 0.0
    x[16:24] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5])
    return x.to(dtype).to(device)


def assert_kernels_match_reference(dtype, fmt, group_size, rotation=0, error_feedback=False):
    """Payloads (and residuals), then fp32 sums, of the kernels and the torch reference: equal
    bit for bit, with NaN and Inf in quantized groups, in an exact element and in the owner's
    own piece."""
    from qzero.quant.triton import TritonKernels
    from qzero.quant.triton_launch import KernelTuning, Launcher

    device = "cuda" if CUDA else "cpu"
    n = 200_003 if CUDA else 331  # odd: a lone int4 nibble, a partial rotation block
    gen = torch.Generator().manual_seed(group_size + rotation + 7 * len(fmt))
    kernels = TritonKernels(Launcher(KernelTuning(block_elems=64, exact_block_elems=64)))  # many programs
    world = 4
    idx = torch.tensor([3, 4, 5, 6, 100, 101, n - 1], dtype=torch.int64, device=device)
    f = get_format(fmt)
    layout = aligned_layout(f.value_bytes(n), -(-n // group_size), idx.numel(), dtype.itemsize)
    payloads = []
    for s in range(world - 1):
        x = piece(n, dtype, gen, device)
        x[40 + s] = float("nan")  # a NaN group, an Inf group, an Inf exact element
        x[140 + s] = float("-inf")
        x[101] = float("inf")
        a = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
        b = a.clone()
        ra = (piece(n, torch.float32, gen, device) * 1e-2).to(ref.RESIDUAL_DTYPE) if error_feedback else None
        rb = ra.clone() if error_feedback else None
        for _ in range(2 if error_feedback else 1):  # the second pack adds the residual the first left
            ref.pack_gradient(x, a, layout, group_size, fmt, idx, rotation, ra)
            kernels.pack_gradient(x, b, layout, group_size, fmt, idx, rotation, rb)
            assert torch.equal(a, b), f"payload {s} differs at bytes {(a != b).nonzero()[:5].flatten().tolist()}"
            if error_feedback:
                assert torch.equal(ra.view(torch.int16), rb.view(torch.int16)), "residuals differ"
                assert bool(torch.isfinite(ra).all()) and bool(ra[idx].eq(0).all())
        payloads.append(a)
    payloads = torch.cat(payloads)
    own = piece(n, dtype, gen, device)
    own[77] = float("nan")
    for rank in (0, 2, world - 1):
        want = torch.empty(n, dtype=torch.float32, device=device)
        got = torch.empty_like(want)
        ref.dequantize_sum(payloads, own, want, layout, rank, world, group_size, fmt, idx, rotation)
        kernels.dequantize_sum(payloads, own, got, layout, rank, world, group_size, fmt, idx, rotation)
        assert torch.equal(want.view(torch.int32), got.view(torch.int32))
        nonfinite = ~torch.isfinite(want)
        assert nonfinite[40].item() and nonfinite[141].item() and nonfinite[77].item()
        assert want[101] == float("inf")  # exact: its own value (with a rotation: not spread)


@pytest.mark.skipif(not HAVE_KERNELS, reason="Triton (or its interpreter) is not available")
@pytest.mark.filterwarnings("ignore:invalid value encountered")  # NaN groups, under the interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("group_size", [8, 24, 64])
def test_kernels_match_reference(dtype, fmt, group_size):
    assert_kernels_match_reference(dtype, fmt, group_size)


@pytest.mark.skipif(not HAVE_KERNELS, reason="Triton (or its interpreter) is not available")
def test_gradient_launchers_pass_constexprs_in_kernel_order():
    """The gradient kernels go through the weight kernels' launcher (cached compiled
    launches on a GPU): runtime arguments first, then the constexprs in the kernel's order."""
    from _support.kernel_checks import checking_kernels
    from qzero.quant import gradients_triton

    kernels = checking_kernels()
    n, gs, world = 200, 64, 2
    device = "cuda" if CUDA else "cpu"
    gen = torch.Generator().manual_seed(3)
    idx = torch.tensor([5, 6, 7], dtype=torch.int64, device=device)
    layout = aligned_layout(n, -(-n // gs), idx.numel(), 2)
    x, own = piece(n, torch.bfloat16, gen, device), piece(n, torch.bfloat16, gen, device)
    payload = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
    kernels.pack_gradient(x, payload, layout, gs, "int8", idx)
    out = torch.empty(n, dtype=torch.float32, device=device)
    kernels.dequantize_sum(payload, own, out, layout, 0, world, gs, "int8", idx)
    want = torch.empty_like(out)
    ref.dequantize_sum(payload, own, want, layout, 0, world, gs, "int8", idx)
    assert torch.equal(out, want)
    assert kernels.launcher.seen == {gradients_triton._grad_pack_kernel, gradients_triton._dequantize_sum_kernel}


def test_reference_pack_leaves_finite_groups_alone():
    """The non-finite rule changes nothing else: finite groups pack as the weight quantizer does."""
    from qzero.quant import reference as weights

    gen = torch.Generator().manual_seed(3)
    x = piece(250, torch.bfloat16, gen, "cpu")
    idx = torch.tensor([1, 2, 200], dtype=torch.int64)
    layout = aligned_layout(250, -(-250 // 64), 3, 2)
    a = torch.zeros(layout.nbytes, dtype=torch.uint8)
    b = a.clone()
    ref.pack_gradient(x, a, layout, 64, "int8", idx)
    weights.pack_payload(x, b, layout, 64, "int8", idx)
    assert torch.equal(a, b)



# ------------------------------------------------------------------ qualify / train plumbing


def test_qualify_candidate_takes_zero_config_keys():
    from qzero.app.cli import _overrides
    from qzero.app.train import settings_from

    got = _overrides(["zero_quantized_gradients=true", "quantized=true"], "--candidate")
    assert got == {"zero_quantized_gradients": True, "zero_quantized_weights": True}
    cfg = settings_from(got).zero
    assert cfg.zero_quantized_gradients and cfg.zero_quantized_weights
    with pytest.raises(ValueError, match="ZeroConfig field"):
        _overrides(["zero_quantized_gradient=true"], "--candidate")


def test_report_shows_gradient_bytes_beside_weight_bytes():
    from test_qualify_stats import arm

    from qzero.app.qualify import Thresholds, analyse
    from qzero.app.qualify.report import markdown
    from qzero.app.train import TrainSettings

    arms = [arm("baseline", 1, [3.0, 2.0], [1.0, 1.1], [1.0]), arm("candidate", 2, [3.0, 2.0], [0.5, 0.6], [1.0])]
    arms[0].update(grad_bytes_sent_per_step=2 * 2**20, grad_plain_bytes_per_step=2 * 2**20)
    arms[1].update(grad_bytes_sent_per_step=2**20, grad_plain_bytes_per_step=2 * 2**20)
    base = TrainSettings(device="cuda")
    r = analyse(arms, base, base, TrainSettings(device="cuda", zero={"zero_quantized_gradients": True}), "BC",
                Thresholds())
    r["environment"] = {"link_regime": "test"}
    text = markdown(r)
    assert "gradients sent/rank/step" in text and "1.0 MiB of 2.0 MiB plain" in text
    assert "zero_quantized_gradients" in text  # the arms differ in it


def test_deepspeed_adapter_parses_the_gradient_keys():
    from qzero.integrations import deepspeed as qds

    def cfg(stage, **zero):
        return {"bf16": {"enabled": True}, "zero_optimization": {"stage": stage, **zero}}

    # off (explicitly, with qzero's refinements): the refinements are taken out of DeepSpeed's copy
    given = cfg(2, zero_quantized_weights=True, zero_quantized_gradients=False,
                zero_quantized_gradients_group_size=32, zero_quantized_gradients_format="fp8")
    prepared = qds.prepare_config(given)
    zero = prepared.ds_config["zero_optimization"]
    assert "zero_quantized_gradients_group_size" not in zero and "zero_quantized_gradients_format" not in zero
    assert given["zero_optimization"]["zero_quantized_gradients_group_size"] == 32  # the caller's dict is untouched
    on = qds.prepare_config(cfg(2, zero_quantized_gradients=True))  # stage 2: qzero's quantized reduction
    assert on.gradients is not None and "zero_quantized_gradients" not in on.ds_config["zero_optimization"]
    with pytest.raises(ValueError, match="at stage 1"):
        qds.prepare_config(cfg(1, zero_quantized_gradients=True))
    with pytest.raises(ValueError, match="zero_quantized_gradients_group_size"):
        qds.prepare_config(cfg(1, zero_quantized_gradients_group_size=12))
    with pytest.raises(ValueError, match="zero_quantized_gradients_format"):
        qds.prepare_config(cfg(2, zero_quantized_gradients_format="int3"))
    assert qds.prepare_config(cfg(3, zero_quantized_gradients=True)).ds_config["zero_optimization"][
        "zero_quantized_gradients"]  # DeepSpeed's own ZeRO++ at stage 3, untouched
    with pytest.raises(ValueError, match="stage 3"):
        qds.prepare_config(cfg(3, zero_quantized_gradients=True, zero_quantized_gradients_group_size=32))


def test_steps_matrix_arms_take_zero_config_keys():
    from qzero.app.benchmarks import steps as sm

    name, o = sm.parse_arm("qg:quantized=true,zero_quantized_gradients=true,zero_quantized_gradients_format=fp8")
    assert o == {"zero_quantized_weights": True, "zero_quantized_gradients": True,
                 "zero_quantized_gradients_format": "fp8"}
