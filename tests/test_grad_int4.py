"""INT4 gradients with the Hadamard rotation, and error feedback, against independent references.

* The rotation: the fp64 Sylvester Hadamard matrix, orthonormal (its own inverse within fp32
  rounding), a trailing partial block untouched.
* The kernels (CPU interpreter here, compiled on a GPU machine) against the torch reference:
  payload bytes, residuals and sums, bit for bit, every source dtype, NaN/Inf included.
* Reduced shards on gloo groups (worlds 2, 3, 4; both flat orders; stages 1 and 2; two
  micro-batches): in the rotated domain, every element within half an INT4 step of each
  other sender's rotated group (plus fp32 rounding); small parameters bit-exact; replicas
  identical. (NaN/Inf with the rotation: ``test_grad_quant.py``'s non-finite test.)
* Error feedback: the residual is what the payload missed; over steps everything the owners
  received plus the residuals still held is the sum of the gradients; the residuals follow
  the fp16 loss scale; they are checkpointed, resumed bit-exactly and resharded.
* Bad settings raise on construction, on every rank, changing nothing.
"""

from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch
from _support.distributed import run_distributed
from test_grad_quant import (ADAMW, GS, HAVE_KERNELS, SHAPES, SMALL, Chosen, assert_kernels_match_reference, coeffs,
                             contributions, grad_worker)

import qzero
from qzero.layout import aligned_layout
from qzero.quant import gradients as ref
from qzero.quant.formats import get_format

H = 8  # rotation block in the distributed tests: two blocks per 16-element group


def sylvester(n: int) -> torch.Tensor:
    m = torch.ones(1, 1, dtype=torch.float64)
    while m.shape[0] < n:
        m = torch.cat((torch.cat((m, m), 1), torch.cat((m, -m), 1)), 0)
    return m / math.sqrt(n)


def rotated64(x: torch.Tensor, block: int) -> torch.Tensor:
    """fp64 rotation of a 1-D tensor's whole blocks (the independent reference)."""
    whole = x.numel() // block * block
    out = x.clone().double()
    out[:whole] = (out[:whole].view(-1, block) @ sylvester(block).T).reshape(-1)
    return out


# ------------------------------------------------------------------ the rotation


@pytest.mark.parametrize("block", [2, 8, 32, 128])
def test_rotation_is_the_orthonormal_hadamard_and_its_own_inverse(block):
    gen = torch.Generator().manual_seed(block)
    n = 5 * block + max(block // 2 - 1, 1)  # five blocks and a partial one
    x = torch.randn(n, generator=gen) * torch.pow(10.0, torch.empty(n).uniform_(-3, 3, generator=gen))
    y = ref.hadamard(x, block)
    want = rotated64(x, block)
    tail = 5 * block
    assert torch.equal(y[tail:], x[tail:]), "a trailing partial block is left as it is"
    norm = x[:tail].view(-1, block).abs().sum(1, keepdim=True).double()  # |entries| <= block-sum / sqrt(block)
    steps = block.bit_length()  # butterfly stages and the scaling, each one fp32 rounding
    assert bool(((y[:tail].double() - want[:tail]).view(-1, block).abs() <= norm * steps * 2.0**-23).all())
    back = ref.hadamard(y, block)
    assert bool(((back[:tail].double() - x[:tail].double()).view(-1, block).abs() <= norm * 2 * steps * 2.0**-23).all())
    # orthonormal: norms are kept (within fp32 rounding)
    torch.testing.assert_close(y.double().norm(), x.double().norm(), rtol=1e-6, atol=0)


def test_rotation_scale_is_the_fp32_reciprocal_square_root():
    for block in (2, 4, 8, 16, 32, 64, 128, 256):
        c = ref.rotation_scale(block)
        assert torch.tensor(c, dtype=torch.float32).item() == c
        assert abs(c - 1 / math.sqrt(block)) <= 2.0**-24 / math.sqrt(block)
        if block.bit_length() % 2:  # 4**k: an exact power of two
            assert c == 2.0 ** -((block.bit_length() - 1) // 2)


# ------------------------------------------------------------------ kernels against the reference

@pytest.mark.skipif(not HAVE_KERNELS, reason="Triton (or its interpreter) is not available")
@pytest.mark.filterwarnings("ignore:invalid value encountered")  # NaN groups, under the interpreter
@pytest.mark.parametrize("dtype,fmt,group_size,rotation,ef", [
    (torch.bfloat16, "int4", 24, 8, True),
    (torch.float16, "int4", 24, 8, True),
    (torch.float32, "int4", 24, 8, True),
    (torch.bfloat16, "int4", 64, 32, False),
    (torch.bfloat16, "int4", 16, 0, True),
    (torch.bfloat16, "int8", 32, 32, True),
    (torch.float32, "fp8", 16, 16, True),
])
def test_kernels_match_reference(dtype, fmt, group_size, rotation, ef):
    assert_kernels_match_reference(dtype, fmt, group_size, rotation, ef)


def test_rotation_lowers_the_error_of_a_group_with_an_outlier():
    """What the rotation is for: one large element no longer sets the step of its whole group."""
    gen = torch.Generator().manual_seed(5)
    n, gs = 4096, 64
    x = torch.randn(n, generator=gen)
    x[::97] *= 30.0  # outliers
    x = x.bfloat16()
    layout = aligned_layout(get_format("int4").value_bytes(n), n // gs, 0, 2)
    errs = {}
    for rotation in (0, 32):
        p = torch.zeros(layout.nbytes, dtype=torch.uint8)
        ref.pack_gradient(x, p, layout, gs, "int4", None, rotation)
        got = torch.empty(n)
        ref.dequantize_sum(p, torch.zeros(n, dtype=torch.bfloat16), got, layout, 0, 2, gs, "int4", None, rotation)
        errs[rotation] = float((got - x.float()).norm() / x.float().norm())
    assert errs[32] < 0.75 * errs[0], errs


# ------------------------------------------------------------------ reduced shards against fp64


def _group_scale(z: torch.Tensor) -> float:
    return max(float(z.abs().max()) / 7.0, torch.finfo(torch.float32).tiny)


def check_rotated_shards(results, world, micro, stage, block):
    """Every owner's shard against the fp64 average: per rotation block of each piece it owns,
    in the rotated domain, within half an INT4 step of every other sender's rotated group."""
    numel = results[0]["numel"]
    exact_mask = torch.zeros(numel, dtype=torch.bool)
    for start, n, is_exact in results[0]["slots"]:
        exact_mask[start : start + n] = is_exact
    rounds = [[x.masked_fill(exact_mask, 0.0) for x in xs] for xs in contributions(results[0], world, micro, stage)]
    blocks_checked = 0
    for r, res in enumerate(results):
        shard, lo = res["shard"].double(), res["lo"]
        for flat_lo, n in res["pieces"]:
            bound = torch.zeros(n, dtype=torch.float64)  # per element of the piece, rotated domain
            want = torch.zeros(n, dtype=torch.float64)
            for xs in rounds:
                for s, x in enumerate(xs):
                    part = x[flat_lo : flat_lo + n]
                    want += part / world
                    z = rotated64(part, block)
                    for g0 in range(0, n, GS):
                        g1 = min(g0 + GS, n)
                        bound[g0:g1] += part[g0:g1].abs().sum() * 2.0**-19 / world  # fp32 rounding
                        if s != r:
                            bound[g0:g1] += _group_scale(z[g0:g1]) / 2 / world
            got = shard[flat_lo - lo : flat_lo - lo + n]
            ex = exact_mask[flat_lo : flat_lo + n]
            err = (got - want).masked_fill(ex, 0.0)
            whole = n // block * block
            for b0 in range(0, whole, block):
                e, bd = err[b0 : b0 + block], bound[b0 : b0 + block]
                if bool(ex[b0 : b0 + block].any()):  # exact values replaced what the rotation left there
                    assert float(e.norm()) <= float(bd.norm()) + 1e-30, (r, flat_lo, b0)
                else:
                    rot = e @ sylvester(block).T
                    assert bool((rot.abs() <= bd + 1e-30).all()), (r, flat_lo, b0, float((rot.abs() - bd).max()))
                blocks_checked += 1
            assert bool((err[whole:].abs() <= bound[whole:] + 1e-30).all()), "the unrotated tail"
    assert blocks_checked > 10


def check_exact_and_covered(results, world, micro, stage):
    exact_mask = torch.zeros(results[0]["numel"], dtype=torch.bool)
    for start, n, is_exact in results[0]["slots"]:
        exact_mask[start : start + n] = is_exact
    rounds = contributions(results[0], world, micro, stage)
    for r, res in enumerate(results):
        lo, shard = res["lo"], res["shard"]
        hi = lo + shard.numel()
        exact_want = torch.zeros(shard.numel(), dtype=torch.float32)
        for xs in rounds:
            summed = torch.zeros(shard.numel(), dtype=torch.float32)
            for x in xs:
                summed += x[lo:hi].float()
            exact_want.add_(summed, alpha=1.0 / world)
        ex = exact_mask[lo:hi]
        assert torch.equal(shard[ex], exact_want[ex]), f"rank {r}: small parameters are not exact"
        covered = torch.zeros(shard.numel(), dtype=torch.bool)
        for flat_lo, n in res["pieces"]:
            covered[flat_lo - lo : flat_lo - lo + n] = True
        for start, n, _ in res["slots"]:
            a, b = max(start, lo), min(start + n, hi)
            if a < b:
                assert bool(covered[a - lo : b - lo].all()), f"rank {r}: an owned element arrived in no piece"


MATRIX = [(2, "interleaved", 1), (3, "contiguous", 2), (4, "contiguous", 1), (4, "interleaved", 2)]


@pytest.mark.parametrize("world,order,stage", MATRIX)
def test_int4_rotated_shards_within_half_a_step_of_fp64(world, order, stage):
    micro = 2
    kwargs = dict(stage=stage, flat_order=order, reduce_bucket_size=300, small_param_numel=SMALL,
                  zero_quantized_gradients=True, zero_quantized_gradients_group_size=GS,
                  zero_quantized_gradients_format="int4", zero_quantized_gradients_rotation_block=H)
    # (no solo_reduce: its windows carry zeros where the solo parameter is, and their rotated
    # error lands there too, so two pieces' errors add up at one element; the error-feedback
    # test below runs it)
    results = run_distributed(grad_worker, world, kwargs, micro)
    check_rotated_shards(results, world, micro, stage, H)
    check_exact_and_covered(results, world, micro, stage)
    for res in results[1:]:
        assert torch.equal(res["flat"].view(torch.int16), results[0]["flat"].view(torch.int16)), "replicas differ"
    for res in results:
        (sent, plain, collectives, quantized, _), = res["stats"]
        assert quantized and collectives == res["units"] * (1 if stage == 1 else micro)
        # 0.5 + 4/16 bytes an element, not 2; plus exact elements and the sections' alignment
        assert 0 < sent < 0.6 * plain


def test_int4_without_rotation_within_half_a_step():
    from test_grad_quant import check_shards

    world, micro = 3, 1
    kwargs = dict(stage=2, flat_order="interleaved", reduce_bucket_size=300, small_param_numel=SMALL,
                  zero_quantized_gradients=True, zero_quantized_gradients_group_size=GS,
                  zero_quantized_gradients_format="int4", zero_quantized_gradients_rotation="none")
    results = run_distributed(grad_worker, world, kwargs, micro)
    check_shards(results, world, micro, 2, fmt="int4")


# ------------------------------------------------------------------ error feedback


def test_residual_is_what_the_payload_missed_and_the_sum_telescopes():
    """Reference mechanics, over rounds: residual = bf16(g + previous residual - what the payload
    decodes to), zero at exact elements; what was sent plus the last residual is the sum of the
    gradients; and the cumulative error is smaller than without error feedback."""
    gen = torch.Generator().manual_seed(11)
    n, gs, rounds = 1000, 32, 8
    idx = torch.tensor([10, 11, 12, 500], dtype=torch.int64)
    layout = aligned_layout(get_format("int4").value_bytes(n), -(-n // gs), idx.numel(), 2)

    def decoded(g, res):
        p = torch.zeros(layout.nbytes, dtype=torch.uint8)
        ref.pack_gradient(g, p, layout, gs, "int4", idx, 32, res)
        got = torch.empty(n)
        ref.dequantize_sum(p, torch.zeros(n, dtype=torch.bfloat16), got, layout, 0, 2, gs, "int4", idx, 32)
        return got.index_fill(0, idx, 0.0).double()  # the owner takes exact elements from the side channel

    base = torch.randn(n, generator=gen)
    residual = torch.zeros(n, dtype=ref.RESIDUAL_DTYPE)
    sent = torch.zeros(n, dtype=torch.float64)
    plain = torch.zeros(n, dtype=torch.float64)
    grads = torch.zeros(n, dtype=torch.float64)
    storage = torch.zeros(n, dtype=torch.float64)  # bound of the residuals' bf16 roundings
    for _ in range(rounds):
        g = (base + 0.3 * torch.randn(n, generator=gen)).bfloat16()
        x = (g.double() + residual.double()).index_fill(0, idx, 0.0)
        got = decoded(g, residual)
        missed = x - got
        fp32 = float(x.abs().max()) * 2.0**-20  # the fp32 sum and rotations
        assert bool(((residual.double() - missed).abs() <= missed.abs() * 2.0**-8 + fp32).all())
        assert residual[idx].eq(0).all() and float(residual.abs().max()) > 0
        storage += missed.abs() * 2.0**-8 + fp32
        sent += got
        plain += decoded(g, None)
        grads += g.double().index_fill(0, idx, 0.0)
    # telescoping: what was sent plus the final residual is the sum of the gradients
    assert bool(((sent + residual.double() - grads).abs() <= storage).all())
    ef_err, plain_err = float((sent - grads).norm()), float((plain - grads).norm())
    assert ef_err < 0.5 * plain_err, (ef_err, plain_err)


def ef_worker(rank, world, cfg_kwargs, steps, micro):
    torch.manual_seed(0)
    model = Chosen(torch.bfloat16)
    opt = qzero.ZeroOptimizer(model, ADAMW, config=qzero.ZeroConfig(**cfg_kwargs))
    g = opt.groups[0]
    shards = []
    for t in range(steps):
        for m in range(micro):
            opt.backward(model(coeffs(rank, t * micro + m)))
        opt.step()
        shards.append(g.grad.clone())
        opt.zero_grad()
    ef = opt.error_feedback[0]
    return {"shards": shards, "lo": g.lo, "numel": g.layout.numel, "P": g.layout.partition_numel,
            "slots": [(s.start, s.numel, s.exact) for s in g.layout.slots], "residual": ef.residual.clone(),
            "flat": g.flat.clone(), "nbytes": ef.residual.numel() * ef.residual.element_size()}


def _residual_flat(res, rank, world):
    """A rank's residuals as a flat-sized fp64 tensor (zeros on its own partition)."""
    p = res["P"]
    out = torch.zeros(world * p, dtype=torch.float64)
    for q in range(world):
        if q != rank:
            at = (q - (q > rank)) * p
            out[q * p : (q + 1) * p] = res["residual"][at : at + p].double()
    return out


@pytest.mark.parametrize("world,order,stage,micro", [(2, "interleaved", 2, 2), (3, "contiguous", 1, 2)])
def test_error_feedback_carries_the_error_to_the_next_reduction(world, order, stage, micro):
    """Over 3 steps: everything the owners received, plus every rank's residuals left, is the sum
    of all gradients as they were reduced (within the residuals' bf16 roundings and fp32 sums;
    without the feedback the gap would be the quantization errors of every step); replicas identical."""
    steps = 3
    kwargs = dict(stage=stage, flat_order=order, reduce_bucket_size=300, small_param_numel=SMALL,
                  zero_quantized_gradients=True, zero_quantized_gradients_group_size=GS,
                  zero_quantized_gradients_format="int4", zero_quantized_gradients_rotation_block=H,
                  zero_quantized_gradients_error_feedback=True, solo_reduce=order == "interleaved")
    results = run_distributed(ef_worker, world, kwargs, steps, micro)
    numel, slots = results[0]["numel"], results[0]["slots"]
    assert results[0]["nbytes"] == 2 * (world - 1) * results[0]["P"]  # 2 (world - 1) / world bytes per element
    reductions = steps * (micro if stage == 2 else 1)
    grads = torch.zeros(numel, dtype=torch.float64)
    largest = torch.zeros(numel, dtype=torch.float64)  # per parameter: its largest gradient element sent
    for t in range(steps):
        for r in range(world):
            staged = [torch.zeros(shape, dtype=torch.bfloat16) for shape in SHAPES]
            for m in range(micro):
                cs = coeffs(r, t * micro + m)
                if stage == 2:
                    staged = cs
                else:  # stage 1 reduces the micro-batches' bf16 sum
                    staged = [a + c.to(torch.bfloat16) for a, c in zip(staged, cs)]
                if stage == 2 or m == micro - 1:
                    for (start, n, _), c in zip(slots, staged):
                        grads[start : start + n] += c.reshape(-1).double()
                        largest[start : start + n] = largest[start : start + n].clamp_min(float(c.abs().max()))
    residuals = sum(_residual_flat(res, r, world) for r, res in enumerate(results))
    exact = torch.zeros(numel, dtype=torch.bool)
    for start, n, is_exact in slots:
        exact[start : start + n] = is_exact
    assert bool((residuals[exact] == 0).all())
    assert float(residuals.abs().max()) > 0, "error feedback left nothing behind"
    # a residual is at most half a step of its rotated group, spread over a block: H * largest / 14
    rounding = reductions * (world - 1) * (H * largest / 14) * 2.0**-8
    for r, res in enumerate(results):
        lo, hi = res["lo"], res["lo"] + res["shards"][0].numel()
        received = sum(s.double() for s in res["shards"]) * world
        gap = (received + residuals[lo:hi] - grads[lo:hi]).abs()
        slack = rounding[lo:hi] + largest[lo:hi] * reductions * world * 2.0**-20
        assert bool((gap <= slack).all()), f"rank {r}: worst {float((gap - slack).max()):.3g}"
    for res in results[1:]:
        assert torch.equal(res["flat"].view(torch.int16), results[0]["flat"].view(torch.int16)), "replicas differ"


def fp16_scale_worker(rank, world):
    model = Chosen(torch.float16)
    cfg = qzero.ZeroConfig(stage=2, reduce_bucket_size=300, small_param_numel=SMALL, initial_scale_power=4,
                           loss_scale_window=1, zero_quantized_gradients=True, zero_quantized_gradients_group_size=GS,
                           zero_quantized_gradients_format="int4", zero_quantized_gradients_rotation_block=H,
                           zero_quantized_gradients_error_feedback=True)
    opt = qzero.ZeroOptimizer(model, ADAMW, config=cfg)
    ef = opt.error_feedback[0]
    out = {}
    opt.backward(model(coeffs(rank, 0, torch.float16)))
    before, scale = ef.residual.clone(), opt.loss_scale
    assert opt.step()
    out["doubled"] = opt.loss_scale == 2 * scale and torch.equal(ef.residual, before * 2) and bool(before.ne(0).any())
    opt.zero_grad()
    cs = coeffs(rank, 1, torch.float16)
    if rank == 0:
        cs[5].view(-1)[17] = float("inf")
    opt.backward(model(cs))
    out["skipped"] = opt.step() is False and bool(ef.residual.eq(0).all())
    return out


def test_residuals_follow_the_fp16_loss_scale():
    for res in run_distributed(fp16_scale_worker, 2):
        assert res == {"doubled": True, "skipped": True}


# ------------------------------------------------------------------ checkpoints of the residuals


def ckpt_worker(rank, world, path, mode, order="contiguous"):
    from test_optim import make_model, train_steps

    from qzero.optim.checkpoint.logical import logical_pieces_between

    model = make_model(seed=rank if mode == "save" else rank + 10)
    cfg = qzero.ZeroConfig(reduce_dtype="fp32", small_param_numel=40, flat_order=order, zero_quantized_gradients=True,
                           zero_quantized_gradients_group_size=GS, zero_quantized_gradients_format="int4",
                           zero_quantized_gradients_rotation_block=H, zero_quantized_gradients_error_feedback=True)
    opt = qzero.ZeroOptimizer(model, ADAMW, config=cfg)
    losses = []

    def logical_residuals():  # this rank's residuals in logical coordinates (fp32, zeros on its own partition)
        ef, layout = opt.error_feedback[0], opt.groups[0].layout
        out = torch.zeros(layout.used_numel, dtype=torch.float32)
        for q in range(world):
            if q != rank:
                src = ef.partition_view(q)
                for local, length, at in logical_pieces_between(layout, q * ef.partition, (q + 1) * ef.partition):
                    out[at : at + length] = src[local : local + length].float()
        return out

    if mode == "save":
        train_steps(model, opt, rank, world, range(0, 3), losses)
        opt.save_checkpoint(path)
    else:
        opt.load_checkpoint(path)
    at_save = logical_residuals()
    train_steps(model, opt, rank, world, range(3, 5), losses)
    return {"losses": losses[-2:], "at_save": at_save, "residual": opt.error_feedback[0].residual.clone(),
            "flat": opt.groups[0].flat.clone()}


def test_residuals_resume_bit_exactly_and_reshard():
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        saved = run_distributed(ckpt_worker, 2, path, "save")
        resumed = run_distributed(ckpt_worker, 2, path, "load")
        for a, b in zip(saved, resumed):
            assert a["losses"] == b["losses"], "losses after resume differ"
            assert torch.equal(a["at_save"], b["at_save"]), "residuals were not restored"
            assert torch.equal(a["residual"].view(torch.int16), b["residual"].view(torch.int16))
            assert torch.equal(a["flat"].view(torch.int16), b["flat"].view(torch.int16))
        assert float(saved[0]["at_save"].abs().max()) > 0
        # at another world size (and flat order): every element's residuals summed, carried by one rank
        wider = run_distributed(ckpt_worker, 3, path, "load", "interleaved")
    total = torch.zeros_like(saved[0]["at_save"])
    for res in saved:  # fp32, in the saved ranks' order
        total += res["at_save"]
    want = total.to(ref.RESIDUAL_DTYPE).float()
    got = [res["at_save"] for res in wider]
    assert torch.equal(sum(got), want)
    assert bool(((torch.stack(got) != 0).sum(0) <= 1).all()), "one rank carries each element"
    assert all(math.isfinite(x) for res in wider for x in res["losses"])


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("bad,match", [
    (dict(zero_quantized_gradients_rotation_block=24), "rotation_block must be a power of two"),
    (dict(zero_quantized_gradients_rotation_block=1), "rotation_block must be a power of two"),
    (dict(zero_quantized_gradients_rotation_block=True), "rotation_block must be a power of two"),
    (dict(zero_quantized_gradients_format="int4", zero_quantized_gradients_group_size=16,
          zero_quantized_gradients_rotation_block=32),
     "rotation_block 32 is larger than zero_quantized_gradients_group_size 16"),
    (dict(zero_quantized_gradients_group_size=24, zero_quantized_gradients_rotation="hadamard",
          zero_quantized_gradients_rotation_block=16), "rotation_block 16 does not divide"),
    (dict(zero_quantized_gradients_format="int4", zero_quantized_gradients_group_size=12), "multiple of 8"),
    (dict(zero_quantized_gradients_rotation="fourier"), "zero_quantized_gradients_rotation must be one of"),
    (dict(zero_quantized_gradients=False, zero_quantized_gradients_error_feedback=True),
     "needs zero_quantized_gradients=true"),
    (dict(zero_quantized_gradients_error_feedback=1), "zero_quantized_gradients_error_feedback must be true or false"),
])
def test_bad_settings_are_refused(bad, match):
    settings = {"zero_quantized_gradients": True, **bad}
    with pytest.raises(ValueError, match=match):
        qzero.ZeroConfig(**settings)
    with pytest.raises(ValueError, match=match):
        qzero.ZeroConfig.from_dict({"stage": 2, **settings})


def test_rotation_defaults_follow_the_format():
    assert qzero.ZeroConfig(zero_quantized_gradients_format="int4").zero_quantized_gradients_rotation == "hadamard"
    assert qzero.ZeroConfig().zero_quantized_gradients_rotation == "none"
    # int8 with small groups is not held to the (unused) rotation block
    assert qzero.ZeroConfig(zero_quantized_gradients_group_size=8).zero_quantized_gradients_rotation_block == 32


def differing_worker(rank, world):
    model = Chosen(torch.bfloat16)
    before = [p.data_ptr() for p in model.parameters()]
    cfg = qzero.ZeroConfig(zero_quantized_gradients=True, zero_quantized_gradients_format="int4",
                           zero_quantized_gradients_rotation_block=16 if rank == 0 else 32, small_param_numel=SMALL)
    try:
        qzero.ZeroOptimizer(model, ADAMW, config=cfg)
    except ValueError as e:
        return str(e), [p.data_ptr() for p in model.parameters()] == before
    return None, False


def test_rotation_settings_that_differ_across_ranks_raise_on_every_rank():
    for msg, untouched in run_distributed(differing_worker, 2):
        assert msg is not None and "differs between ranks" in msg
        assert untouched


def test_error_feedback_is_refused_by_the_other_backends():
    from qzero.app.train import settings_from, validate
    from qzero.app.workload import WorkloadError

    s = settings_from({"backend": "fsdp2", "zero_quantized_gradients": True,
                       "zero_quantized_gradients_error_feedback": True})
    with pytest.raises(WorkloadError, match="zero_quantized_gradients_error_feedback is a setting of the qzero"):
        validate(s)


# ------------------------------------------------------------------ qualify / adapters


def test_qualify_candidate_takes_the_int4_format():
    from qzero.app.cli import _overrides
    from qzero.app.train import settings_from

    got = _overrides(['zero_quantized_gradients_format="int4"', "zero_quantized_gradients=true",
                      "zero_quantized_gradients_error_feedback=true"], "--candidate")
    cfg = settings_from(got).zero
    assert cfg.zero_quantized_gradients_format == "int4" and cfg.zero_quantized_gradients_rotation == "hadamard"
    assert cfg.zero_quantized_gradients_error_feedback


def test_report_shows_bits_per_parameter_for_weights_and_gradients():
    from test_qualify_stats import arm

    from qzero.app.qualify import Thresholds, analyse
    from qzero.app.qualify.report import markdown
    from qzero.app.train import TrainSettings

    arms = [arm("baseline", 1, [3.0, 2.0], [1.0, 1.1], [1.0]), arm("candidate", 2, [3.0, 2.0], [0.5, 0.6], [1.0])]
    # plain bf16 gradients; INT4 g64 (0.5625 bytes an element) against 2 bytes plain
    arms[0].update(grad_bytes_sent_per_step=2 * 2**20, grad_plain_bytes_per_step=2 * 2**20)
    arms[1].update(grad_bytes_sent_per_step=int(0.5625 * 2**20), grad_plain_bytes_per_step=2 * 2**20)
    for a in arms:
        a.update(bytes_sent_per_step=int(1.0625 * 2**20), plain_bytes_per_step=2 * 2**20)
    base = TrainSettings(device="cuda")
    cand = TrainSettings(device="cuda", zero={"zero_quantized_gradients": True,
                                              "zero_quantized_gradients_format": "int4"})
    r = analyse(arms, base, base, cand, "BC", Thresholds())
    r["environment"] = {"link_regime": "test"}
    text = markdown(r)
    assert "bits/parameter/step" in text
    assert "| 8.50 + 16.00 |" in text and "| 8.50 + 4.50 |" in text
    # an fp32 reduce dtype: plain sends 4 bytes an element
    cand32 = TrainSettings(device="cuda", zero={"zero_quantized_gradients": True, "reduce_dtype": "fp32"})
    arms[1].update(grad_bytes_sent_per_step=int(1.0625 * 2**20), grad_plain_bytes_per_step=4 * 2**20)
    r = analyse(arms, base, base, cand32, "BC", Thresholds())
    r["environment"] = {"link_regime": "test"}
    assert "| 8.50 + 8.50 |" in markdown(r)


def test_deepspeed_adapter_parses_the_new_gradient_keys():
    from qzero.integrations import deepspeed as qds

    def cfg(stage, **zero):
        return {"bf16": {"enabled": True}, "zero_optimization": {"stage": stage, **zero}}

    prepared = qds.prepare_config(cfg(2, zero_quantized_gradients=False, zero_quantized_gradients_rotation="none",
                                      zero_quantized_gradients_rotation_block=16))
    zero = prepared.ds_config["zero_optimization"]
    assert "zero_quantized_gradients_rotation" not in zero and "zero_quantized_gradients_rotation_block" not in zero
    with pytest.raises(ValueError, match="rotation_block must be a power of two"):
        qds.prepare_config(cfg(2, zero_quantized_gradients_rotation_block=48))
    with pytest.raises(ValueError, match="needs zero_quantized_gradients=true"):
        qds.prepare_config(cfg(2, zero_quantized_gradients_error_feedback=True))


def test_qualify_refuses_a_gradient_refinement_without_quantized_gradients(capsys):
    from qzero.app.cli import main

    code = main(["qualify", "--candidate", 'zero_quantized_gradients_format="int4"', "--out", "/nonexistent/qz"])
    err = capsys.readouterr().err.strip().splitlines()
    assert (code == 2 and len(err) == 1
            and err[0].startswith("qzero: error: --candidate zero_quantized_gradients_format"))
    assert "add --candidate zero_quantized_gradients=true" in err[0]


def test_the_reference_pack_never_asks_the_device_whether_a_group_is_refused(monkeypatch):
    """The reference pack (the kernels' specification, and the path without Triton) refuses a
    non-finite group without reading a tensor back on the host: on CUDA every such read waits
    for the device, once per piece of every bucket."""
    gen = torch.Generator().manual_seed(11)
    n, gs = 1000, 64
    layout = aligned_layout(get_format("int4").value_bytes(n), math.ceil(n / gs), 0, 2)
    for poison in (None, 130):
        x = torch.randn(n, generator=gen).bfloat16()
        if poison is not None:
            x[poison] = float("nan")
        p = torch.zeros(layout.nbytes, dtype=torch.uint8)

        def no_host_read(*_):
            raise AssertionError("the pack read a tensor's value on the host")

        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "__bool__", no_host_read)
            m.setattr(torch.Tensor, "item", no_host_read)
            ref.pack_gradient(x, p, layout, gs, "int4", None, 0)
        _, scales, _ = ref.sections(p, layout, n, gs, "int4", x.dtype)
        refused = torch.isnan(scales).nonzero().flatten().tolist()
        assert refused == ([] if poison is None else [poison // gs])
