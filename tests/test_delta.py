"""Delta weight gathers on real gloo groups ([Note: delta loop] in qzero/optim/delta.py).

After every step: the replicas are bit-identical on every rank; each rank's partition of the
replica is within one quantization step of bf16(master) (its group's scale, recomputed here
from the replica before the step), its small parameters exactly bf16(master); the gathers due
to be exact resyncs are, and leave the replica exactly bf16(master). Worlds 2 and 3, stages 1
and 2, both flat orders, accumulation, fp16 with loss scaling (and a skipped step), gather-ahead
on and off (the same bits).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from _support.distributed import run_distributed
from test_optim import ADAMW, batch, make_model, rank_slice

import qzero

GS = 16
BASE = dict(zero_quantized_weights=True, zero_quantized_weights_delta=True, zero_quantized_weights_group_size=GS,
            small_param_numel=40, reduce_dtype="fp32")
QMAX = {"int4": 7.0, "int8": 127.0}


def step_record(opt, before: list[torch.Tensor]) -> dict:
    """This rank's view of the step just taken: what travelled, the replica's bits, and how far
    its own partition is from bf16(master), in units of each group's quantization step."""
    cfg = opt.config
    qmax = QMAX[cfg.zero_quantized_weights_format]
    out = {"payload": [s.payload for s in opt.last_gather],
           "bytes_per_param": [s.bytes_per_param for s in opt.last_gather],
           "flats": [g.flat.clone() for g in opt.groups], "steps": [], "exact_ok": True, "resynced": []}
    for g, prev in zip(opt.groups, before):
        t = g.master.to(g.dtype)
        own, was = g.own, prev[g.lo : g.hi]
        exact = torch.zeros(g.hi - g.lo, dtype=torch.bool)
        for a, b in g.gather_plan.exact_ranges:
            a, b = max(a, g.lo) - g.lo, min(b, g.hi) - g.lo
            if a < b:
                exact[a:b] = True
        out["exact_ok"] &= torch.equal(own[exact].view(torch.int16), t[exact].view(torch.int16))
        out["resynced"].append(torch.equal(own.view(torch.int16), t.view(torch.int16)))
        d = torch.where(exact, 0.0, t.float() - was.float())
        n = d.numel()
        groups = -(-n // GS)
        absmax = torch.nn.functional.pad(d.abs(), (0, groups * GS - n)).view(groups, GS).amax(dim=1)
        scale = torch.clamp_min(absmax.double() / qmax, 2.0**-126).repeat_interleave(GS)[:n]
        err = (own.double() - t.double()).abs()
        out["steps"].append(float((err / scale).max()))
    return out


def backward(opt, model, rank, world, step, micro=0, overflow=False) -> float:
    """One micro-batch's backward (rank 1's loss made Inf with ``overflow``); the mean loss over ranks."""
    tokens, targets = batch(step, micro)
    loss = model(rank_slice(tokens, rank, world), rank_slice(targets, rank, world))
    opt.backward(loss * torch.inf if overflow and rank == 1 else loss)
    mean = loss.detach().float().reshape(1).clone()
    dist.all_reduce(mean)
    return mean.item() / world


def delta_run(rank, world, cfg_kwargs, steps, micro=1, dtype=torch.bfloat16, overflow_step=None):
    model = make_model(dtype, seed=rank)  # replicas start different: rank 0's weights must win
    opt = qzero.ZeroOptimizer(model, ADAMW, config=qzero.ZeroConfig(**cfg_kwargs))
    records, losses = [], []
    for step in range(steps):
        step_loss = sum(backward(opt, model, rank, world, step, m, step == overflow_step) for m in range(micro))
        before = [g.flat.clone() for g in opt.groups]
        took = opt.step()
        opt.wait_for_weights()
        if not took:
            rec = {"skipped": True, "flats": [g.flat.clone() for g in opt.groups],
                   "unchanged": all(torch.equal(a, g.flat) for a, g in zip(before, opt.groups))}
        else:
            rec = step_record(opt, before) if opt.config.zero_quantized_weights_delta else {}
        records.append(rec)
        losses.append(step_loss / micro)
        opt.zero_grad()
    return {"records": records, "losses": losses}


def check_run(results, resync_steps: int, fmt: str = "int4"):
    """Every step: identical replicas, within one step, exact where due."""
    gathers = 0
    for step, rec in enumerate(results[0]["records"]):
        for other in results[1:]:
            for a, b in zip(rec["flats"], other["records"][step]["flats"]):
                assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"replicas differ after step {step + 1}"
        if rec.get("skipped"):
            assert all(r["records"][step]["unchanged"] for r in results), "a skipped step changed the replica"
            continue
        exact_due = gathers == 0 or (resync_steps > 0 and gathers % resync_steps == 0)
        gathers += 1
        for r in results:
            got = r["records"][step]
            assert got["exact_ok"], f"small parameters differ from bf16(master) after step {step + 1}"
            assert all(s <= 1.0 for s in got["steps"]), f"step {step + 1}: {got['steps']} quantization steps off"
            assert got["payload"] == ["plain" if exact_due else f"{fmt} delta"] * len(got["payload"]), (step, got)
            if exact_due:
                assert all(got["resynced"]), f"the resync of step {step + 1} did not make the replica bf16(master)"
    return gathers


CASES = {
    # world, stage, flat order, gather-ahead, accumulation, extra settings
    "w2-s1-contiguous-sync-accum": (2, 1, "contiguous", False, 2, {}),
    "w3-s2-interleaved-ahead": (3, 2, "interleaved", True, 1, {}),
    "w3-s1-interleaved-ahead-resync3": (3, 1, "interleaved", True, 1, {"zero_quantized_weights_delta_resync_steps": 3}),
    "w2-s2-contiguous-sync-int8": (2, 2, "contiguous", False, 1, {"zero_quantized_weights_format": "int8"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_replicas_identical_within_one_step_and_resync_when_due(case):
    world, stage, order, ahead, micro, extra = CASES[case]
    cfg = dict(BASE, stage=stage, flat_order=order, overlap_param_gather=ahead,
               allgather_bucket_size=world * GS * 6, **extra)
    steps = 5
    results = run_distributed(delta_run, world, cfg, steps, micro)
    resync = extra.get("zero_quantized_weights_delta_resync_steps",
                       qzero.ZeroConfig(**cfg).zero_quantized_weights_delta_resync_steps)
    check_run(results, resync, extra.get("zero_quantized_weights_format", "int4"))
    if case == "w3-s2-interleaved-ahead":  # gather-ahead off: the same bits, step by step
        off = run_distributed(delta_run, world, dict(cfg, overlap_param_gather=False), steps, micro)
        for a, b in zip(results[0]["records"], off[0]["records"]):
            for x, y in zip(a["flats"], b["flats"]):
                assert torch.equal(x.view(torch.int16), y.view(torch.int16)), "gather-ahead changed the bits"


def test_fp16_loss_scaling_skips_without_advancing_the_loop():
    """fp16 with dynamic loss scaling, an overflow on rank 1 at step 3: nothing is gathered,
    every replica is unchanged, and the loop's count of deltas does not move."""
    cfg = dict(BASE, stage=2, allgather_bucket_size=2 * GS * 6, zero_quantized_weights_delta_resync_steps=3,
               initial_scale_power=8)
    results = run_distributed(delta_run, 2, cfg, 6, 1, torch.float16, 2)
    assert results[0]["records"][2].get("skipped")
    gathers = check_run(results, 3)
    assert gathers == 5


# ---------------------------------------------------------------------------------- the loop's resets


def reset_run(rank, world):
    model = make_model(seed=rank)
    cfg = qzero.ZeroConfig(**BASE, stage=2, allgather_bucket_size=world * GS * 6)
    opt = qzero.ZeroOptimizer(model, ADAMW, config=cfg)
    payloads = []
    for step in range(4):
        tokens, targets = batch(step, 0)
        opt.backward(model(rank_slice(tokens, rank, world), rank_slice(targets, rank, world)))
        opt.step()
        opt.zero_grad()
        payloads.append(opt.last_gather[0].payload)
        if step == 1:
            opt.gather_exact_weights()
            g = opt.groups[0]
            exact = torch.equal(g.own.view(torch.int16), g.master.to(g.dtype).view(torch.int16))
            loop = g.delta.state_dict()
    return payloads, exact, loop, repr(opt.last_gather[0])


def test_gather_exact_weights_is_an_exact_resync():
    """gather_exact_weights() makes the replica bf16(master) and restarts the loop from it:
    the following gathers are deltas against that replica."""
    for payloads, exact, loop, text in run_distributed(reset_run, 2):
        assert payloads == ["plain", "int4 delta", "int4 delta", "int4 delta"]
        assert exact and loop == {"state": "tracking", "deltas": 0}
        assert "bytes_per_param=" in text and "payload='int4 delta'" in text


# ---------------------------------------------------------------------------------- refusals


def non_finite_run(rank, world, how):
    model = make_model(torch.float16, seed=rank)
    # check_finite off: with it, step() refuses both masters before the gather (tests/test_dtype_overflow.py)
    cfg = qzero.ZeroConfig(**BASE, stage=2, allgather_bucket_size=world * GS * 6, check_finite=False)
    opt = qzero.ZeroOptimizer(model, functools.partial(torch.optim.SGD, lr=0.0), config=cfg)
    tokens, targets = batch(0, 0)

    def step():
        opt.backward(model(rank_slice(tokens, rank, world), rank_slice(targets, rank, world)))
        opt.step()
        opt.zero_grad()

    step()  # the first gather: an exact resync
    g = opt.groups[0]
    # rank 1's first quantized (not exact) element, in its partition's second group
    exact = {i for a, b in g.gather_plan.exact_ranges for i in range(a, b)}
    at = next(i for i in range(g.lo, g.hi) if i not in exact and i - g.lo >= GS)
    if rank == 1:  # this rank's master there: finite, but beyond fp16 (it rounds to Inf), or NaN
        g.master[at - g.lo] = 7e4 if how.startswith("beyond fp16") else float("nan")
    before = g.flat.clone()
    msg = None
    try:
        step()
        opt.wait_for_weights()
    except FloatingPointError as e:
        msg = str(e)
    return msg, bool(torch.isfinite(g.flat).all()), g.flat.clone(), before, at


@pytest.mark.parametrize("how", ["beyond fp16, check_finite off", "nan master, check_finite off"])
def test_non_finite_differences_are_refused_on_every_rank(how):
    results = run_distributed(non_finite_run, 2, how, timeout=120)
    for msg, finite, flat, before, at in results:
        assert msg is not None and "non-finite differences" in msg, msg
        assert finite, "a non-finite value reached a replica"
    assert torch.equal(results[0][2].view(torch.int16), results[1][2].view(torch.int16))
    at, lo = results[1][4], results[1][2].numel() // 2
    start = lo + (at - lo) // GS * GS
    group = slice(start, start + GS)
    for msg, *_ in results:  # named: the parameter and the refused group's flat index
        assert f"flat index {start})" in msg, msg
    for _, _, flat, before, _ in results:  # the refused group kept its bits on every rank
        assert torch.equal(flat[group].view(torch.int16), before[group].view(torch.int16))


STEP_PATHS = {  # how step() reaches its update, and so where it reads the refusal flags
    "sliced AdamW": (ADAMW, torch.bfloat16, {}),
    "sliced AdamW, check_finite off": (ADAMW, torch.bfloat16, dict(check_finite=False)),
    "SGD, whole update": (functools.partial(torch.optim.SGD, lr=1e-2), torch.bfloat16, {}),
    "fp16 loss scaling": (ADAMW, torch.float16, {}),
}


def flagged_step_run(rank, world, path):
    make_opt, dtype, extra = STEP_PATHS[path]
    model = make_model(dtype, seed=rank)
    cfg = qzero.ZeroConfig(**BASE, stage=2, allgather_bucket_size=world * GS * 6, **extra)
    opt = qzero.ZeroOptimizer(model, make_opt, config=cfg)
    tokens, targets = batch(0, 0)

    def step():
        opt.backward(model(rank_slice(tokens, rank, world), rank_slice(targets, rank, world)))
        opt.step()
        opt.zero_grad()

    for _ in range(3):  # past the exact resync and the first (whole) update
        step()
    opt.wait_for_weights()
    g = opt.groups[0]
    g.delta.refused.fill_(g.lo + GS)  # what an unpack that refused that group leaves, on every rank
    masters, state = g.master.clone(), opt.steps_taken
    msg = None
    try:
        step()
    except FloatingPointError as e:
        msg = str(e)
    return msg, torch.equal(g.master, masters), opt.steps_taken == state


@pytest.mark.parametrize("path", list(STEP_PATHS))
def test_a_refusal_is_raised_by_the_next_step_before_its_update_on_every_rank(path):
    """step() reads the refusal flags at a synchronisation it makes anyway (the finite check,
    the loss scaler's exchange) or at its own, and raises on every rank before the update."""
    for msg, masters_kept, not_counted in run_distributed(flagged_step_run, 2, path, timeout=120):
        assert msg is not None and "non-finite differences" in msg, msg
        assert masters_kept, "the update ran before the refusal was raised"
        assert not_counted


# ---------------------------------------------------------------------------------- bad input


MISMATCHES = {
    "zero_quantized_weights_delta": (True, False),
    "zero_quantized_weights_group_size": (16, 32),
    "zero_quantized_weights_format": ("int4", "int8"),
    "zero_quantized_weights_delta_resync_steps": (0, 10),
}


def mismatch_run(rank, world):
    msgs = {}
    for field, values in MISMATCHES.items():
        kwargs = dict(BASE, stage=2)
        kwargs[field] = values[rank]
        try:
            qzero.ZeroOptimizer(make_model(), ADAMW, config=qzero.ZeroConfig(**kwargs))
        except ValueError as e:
            msgs[field] = str(e)
    return msgs


def test_delta_settings_that_differ_across_ranks_are_refused_on_every_rank():
    for msgs in run_distributed(mismatch_run, 2, timeout=120):
        for field in MISMATCHES:
            assert field in msgs and f"{field} differs between ranks" in msgs[field], (field, msgs.get(field))


@pytest.mark.parametrize("kwargs,match", [
    (dict(zero_quantized_weights=True, zero_quantized_weights_delta=True, zero_quantized_weights_format="fp8"),
     "zero_quantized_weights_format='fp8'.*int4"),
    (dict(zero_quantized_weights=True, zero_quantized_weights_delta=True, zero_quantized_weights_group_size=100),
     "group_size must be a positive multiple of 8, got 100"),
    (dict(zero_quantized_weights_delta=True), "needs zero_quantized_weights=true"),
    (dict(zero_quantized_weights=True, zero_quantized_weights_delta="yes"),
     "zero_quantized_weights_delta must be true or false"),
    (dict(zero_quantized_weights=True, zero_quantized_weights_delta=True, zero_quantized_weights_delta_resync_steps=-1),
     "resync_steps must be >= 0"),
    (dict(zero_quantized_weights_delta_resync_steps=1.5), "resync_steps must be an integer"),
])
def test_bad_delta_settings_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        qzero.ZeroConfig(**kwargs)


def test_defaults_and_every_way_in():
    off = qzero.ZeroConfig()
    assert (off.zero_quantized_weights_delta, off.zero_quantized_weights_format,
            off.zero_quantized_weights_group_size) == (
        False, "int8", 64)
    on = qzero.ZeroConfig.from_dict({"zero_quantized_weights": True, "zero_quantized_weights_delta": True,
                                     "zero_quantized_weights_delta_resync_steps": 50})
    assert (on.zero_quantized_weights_format, on.zero_quantized_weights_group_size) == ("int4", 64)
    assert on.zero_quantized_weights_delta_resync_steps == 50
    assert qzero.ZeroConfig(**on.to_dict()) == on
    from qzero.app.train import settings_from

    arm = settings_from({"quantized": True, "zero_quantized_weights_delta": True, "group_size": 512})
    assert arm.zero.zero_quantized_weights_delta and arm.zero.zero_quantized_weights_group_size == 512
    from qzero.app.train import validate
    from qzero.app.workload import WorkloadError

    for backend in ("deepspeed", "fsdp2"):  # their gathers send no delta payloads: refused, not ignored
        with pytest.raises(WorkloadError, match="zero_quantized_weights_delta is a setting of the qzero backend"):
            validate(settings_from({"backend": backend, "quantized": True, "zero_quantized_weights_delta": True}))
    from qzero.integrations.deepspeed_config import prepare_config

    ds = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2, "zero_quantized_weights": True}}
    with pytest.raises(ValueError, match="does not send delta gathers"):
        prepare_config({**ds, "zero_optimization": {**ds["zero_optimization"], "zero_quantized_weights_delta": True}})
    with pytest.raises(ValueError, match="resync_steps must be >= 0"):
        prepare_config({**ds, "zero_optimization": {**ds["zero_optimization"],
                                                    "zero_quantized_weights_delta_resync_steps": -2}})
    kept = prepare_config({**ds, "zero_optimization": {**ds["zero_optimization"],
                                                       "zero_quantized_weights_delta": False}})
    assert "zero_quantized_weights_delta" not in kept.ds_config["zero_optimization"]


# ---------------------------------------------------------------------------------- checkpoints


def checkpoint_run(rank, world, path, mode, order="contiguous", delta=True):
    model = make_model(seed=rank if mode == "save" else rank + 10)  # a loaded run must not depend on its init
    cfg = qzero.ZeroConfig(**{**BASE, "zero_quantized_weights_delta": delta}, allgather_bucket_size=world * GS * 8,
                           flat_order=order)
    opt = qzero.ZeroOptimizer(model, ADAMW, config=cfg)
    losses, payloads = [], []

    def train(steps, offset):
        for step in range(offset, offset + steps):
            losses.append(backward(opt, model, rank, world, step))
            opt.step()
            opt.zero_grad()
            payloads.append(opt.last_gather[0].payload)

    exact_after_load = None
    if mode == "save":
        train(3, 0)
        opt.save_checkpoint(path)
        train(3, 3)
    else:
        opt.load_checkpoint(path)
        g = opt.groups[0]
        exact_after_load = torch.equal(g.own.view(torch.int16), g.master.to(g.dtype).view(torch.int16))
        train(3, 3)
    opt.wait_for_weights()
    return losses[-3:], [g.flat.clone() for g in opt.groups], payloads[-3:], exact_after_load


def test_resume_at_the_same_world_size_is_bit_exact(tmp_path):
    """The replica is saved with the masters: a resumed run continues bit for bit (losses and
    replicas), its gathers deltas against the restored replica, not an exact resync."""
    path = str(tmp_path / "ckpt")
    saved = run_distributed(checkpoint_run, 2, path, "save")
    resumed = run_distributed(checkpoint_run, 2, path, "load")
    for a, b in zip(saved, resumed):
        assert a[0] == b[0], "losses after resume differ"
        for x, y in zip(a[1], b[1]):
            assert torch.equal(x.view(torch.int16), y.view(torch.int16)), "replicas after resume differ"
        assert b[2] == ["int4 delta"] * 3
        assert b[3] is False  # the restored replica is the loop's, not bf16(master)


def test_reshard_resumes_from_an_exact_resync(tmp_path):
    """Saved at world 2, loaded at world 3 in the other flat order: the load ends with an exact
    resync (the replica is bf16(master)), then deltas; a checkpoint saved without delta gathers
    loads the same way."""
    path = str(tmp_path / "ckpt")
    run_distributed(checkpoint_run, 2, path, "save", "interleaved")
    resumed = run_distributed(checkpoint_run, 3, path, "load", "contiguous")
    for r in resumed:
        assert r[3] is True and r[2] == ["int4 delta"] * 3
    for r in resumed[1:]:
        assert all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(r[1], resumed[0][1]))
    plain_path = str(tmp_path / "plain")
    run_distributed(checkpoint_run, 2, plain_path, "save", "contiguous", False)
    for r in run_distributed(checkpoint_run, 2, plain_path, "load", "contiguous"):
        assert r[3] is True and r[2] == ["int4 delta"] * 3


def test_the_emulated_matrix_passes_delta_inputs_through_its_pack_wrapper():
    """benchmarks/scripts/emulated_matrix.py wraps the engine's pack_chunk (to clear side channels); a delta
    gather calls it with its DeltaInputs, which must reach the real pack."""
    from qzero.wire.chunks import DeltaInputs
    from qzero.layout import plan_gather
    from qzero.quant import reference

    from _support import bench_scripts

    emulated_matrix = bench_scripts.load("emulated_matrix")
    seen = []
    pack = emulated_matrix._clearing_side_channel(lambda *args: seen.append(args) or "slot")
    plan = plan_gather(64, 1, zero_quantized_weights_format="int4", zero_quantized_weights_group_size=8,
                       allgather_bucket_size=64, exact_ranges=[(0, 4)], zero_quantized_weights_delta=True)
    buf = torch.ones(plan.chunks[0].payload_bytes, dtype=torch.uint8)
    inputs = DeltaInputs(torch.zeros(64), reference.refusal_flag("cpu"))
    flat = torch.zeros(64, dtype=torch.bfloat16)
    assert pack(flat, plan, plan.chunks[0], 0, buf, reference, inputs) == "slot"
    assert seen[0][-1] is inputs
