"""Changes made behind the ZeroOptimizer's back are refused at the next step, on every rank
(also where only some ranks made them), before any update ([Note: the model belongs to the optimizer] in
qzero/optim/guard.py); and the loop's order (opt.backward, step, opt.zero_grad) is enforced.

Each case builds a fresh model and optimizer on two gloo ranks, trains one step, makes one
change (on both ranks), and runs the next step: it must raise naming the change, and leave
the fp32 masters as they were."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from _support.distributed import run_distributed

import qzero
from qzero.optim.guard import ModelChangedError


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)).bfloat16()


def _loss(model, rank):
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank)).to(model[0].weight.dtype)
    return F.mse_loss(model(x).float(), torch.zeros(4, 16))


def _load(model, opt):
    model.load_state_dict({k: torch.zeros_like(v) for k, v in model.state_dict().items()})


def _init(model, opt):
    torch.nn.init.zeros_(model[0].weight)


def _to_fp32(model, opt):
    model.float()


def _replace(model, opt):
    model[2].weight = torch.nn.Parameter(model[2].weight.detach().clone())


def _freeze(model, opt):
    model[0].weight.requires_grad_(False)


def _add_group(model, opt):
    opt.optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})


CHANGES = {  # change -> what the error names
    "load_state_dict": (_load, "was written outside the optimizer"),
    "nn.init": (_init, "'0.weight' was written outside the optimizer"),
    "model.float()": (_to_fp32, "no longer lives in the optimizer's flat buffer"),
    "replaced parameter": (_replace, "is not one the optimizer holds"),
    "requires_grad_(False)": (_freeze, "'0.weight' changed requires_grad to False"),
    "add_param_group": (_add_group, "inner optimizer's parameter groups were changed"),
}


def _one(rank, change, stage, cfg):
    model = _model()
    opt = qzero.ZeroOptimizer(model, functools.partial(torch.optim.AdamW, lr=1e-2),
                              config=qzero.ZeroConfig(stage=stage, small_param_numel=8, **cfg))
    opt.backward(_loss(model, rank))
    opt.step()
    opt.zero_grad()
    opt.wait_for_weights()
    CHANGES[change][0](model, opt)
    masters = [g.master.clone() for g in opt.groups]
    try:
        opt.backward(_loss(model, rank))
        opt.step()
        raised = None
    except ModelChangedError as e:
        raised = str(e)
    return raised, all(torch.equal(a, g.master) for a, g in zip(masters, opt.groups))


def _changes_run(rank, world, stage, cfg):
    return {c: _one(rank, c, stage, cfg) for c in CHANGES}


@pytest.mark.parametrize("stage,cfg", [
    (1, {}),
    (2, {"zero_quantized_weights": True}),  # gather-ahead on
    (2, {"zero_quantized_weights": True, "zero_quantized_weights_format": "int4",
         "zero_quantized_weights_delta": True, "zero_quantized_weights_group_size": 16}),
], ids=["stage1-plain", "stage2-int8-ahead", "stage2-int4-delta"])
def test_a_change_behind_the_optimizers_back_is_refused_before_any_update(stage, cfg):
    for rank, seen in enumerate(run_distributed(_changes_run, 2, stage, cfg)):
        for change, (raised, masters_unchanged) in seen.items():
            assert raised is not None, f"rank {rank}: {change} was not refused"
            assert CHANGES[change][1] in raised and "qzero:" in raised, (change, raised)
            assert masters_unchanged, f"rank {rank}: {change}: the masters moved before the refusal"


def _one_rank_run(rank, world, change, stage, where):
    """``change`` on rank 0 only, between steps (``where="backward"``: found at the next
    backward) or between backward and step (``"step"``)."""
    model = _model()
    opt = qzero.ZeroOptimizer(model, functools.partial(torch.optim.AdamW, lr=1e-2),
                              config=qzero.ZeroConfig(stage=stage, small_param_numel=8))
    opt.backward(_loss(model, rank))
    opt.step()
    opt.zero_grad()
    masters = [g.master.clone() for g in opt.groups]
    raised = None
    try:
        if where == "step":
            opt.backward(_loss(model, rank))
        if rank == 0:
            CHANGES[change][0](model, opt)
        if where == "backward":
            opt.backward(_loss(model, rank))
        opt.step()
    except ModelChangedError as e:
        raised = str(e)
    return raised, all(torch.equal(a, g.master) for a, g in zip(masters, opt.groups))


@pytest.mark.parametrize("world,stage,where", [(2, 1, "backward"), (2, 2, "backward"), (3, 2, "step"),
                                               (3, 1, "step")])
@pytest.mark.parametrize("change", ["load_state_dict", "replaced parameter"])
def test_a_change_on_one_rank_only_is_refused_on_every_rank(world, stage, where, change):
    """The ranks agree on the check: the others do not run on into the step's collectives (a
    hang before: rank 0 raised, the others waited for it), they raise naming rank 0's change."""
    seen = run_distributed(_one_rank_run, world, change, stage, where, timeout=120)
    for rank, (raised, masters_unchanged) in enumerate(seen):
        assert raised is not None, f"rank {rank}: a change on rank 0 only was not refused"
        assert CHANGES[change][1] in raised, (rank, raised)
        if rank:
            assert "rank(s) [0] changed the model" in raised and "this rank did not" in raised, raised
        assert masters_unchanged, f"rank {rank}: the masters moved before the refusal"


def _between_micro_batches_run(rank, world):
    model = _model()
    opt = qzero.ZeroOptimizer(model, functools.partial(torch.optim.AdamW, lr=1e-2),
                              config=qzero.ZeroConfig(stage=2, small_param_numel=8))
    opt.backward(_loss(model, rank))
    _load(model, opt)  # on every rank, between the two micro-batches of one step
    try:
        opt.backward(_loss(model, rank))
    except ModelChangedError as e:
        return str(e)
    return None


def test_a_change_between_micro_batches_is_refused_at_the_next_one():
    for raised in run_distributed(_between_micro_batches_run, 2):
        assert raised is not None and "was written outside the optimizer before optimizer step 1" in raised


def _allowed_run(rank, world):
    """What a loop may change freely: learning rates (by hand or by a scheduler on the inner
    optimizer), eval/train mode, an evaluation under no_grad, a state_dict read."""
    model = _model()
    opt = qzero.ZeroOptimizer(model, functools.partial(torch.optim.AdamW, lr=1e-2),
                              config=qzero.ZeroConfig(zero_quantized_weights=True))
    sched = torch.optim.lr_scheduler.LambdaLR(opt.optimizer, lambda s: 1.0 / (1 + s))
    for step in range(4):
        opt.backward(_loss(model, rank))
        opt.step()
        sched.step()
        opt.zero_grad()
        opt.param_groups[0]["weight_decay"] = 0.01 * step
        model.eval()
        with torch.no_grad():
            _loss(model, rank)
        model.train()
        model.state_dict()
    return opt.param_groups[0]["lr"]


def test_learning_rates_modes_and_reads_are_not_changes():
    assert run_distributed(_allowed_run, 2) == [pytest.approx(1e-2 / 5)] * 2


def _order_run(rank, world, stage):
    out = {}
    model = _model()
    opt = qzero.ZeroOptimizer(model, functools.partial(torch.optim.AdamW, lr=1e-2),
                              config=qzero.ZeroConfig(stage=stage))
    opt.backward(_loss(model, rank))
    opt.step()
    model.zero_grad()  # not the optimizer's: its gradient buffers still hold the last step's sums
    try:
        opt.backward(_loss(model, rank))
        out["model.zero_grad()"] = None
    except RuntimeError as e:
        out["model.zero_grad()"] = str(e)
    opt.zero_grad()
    masters = [g.master.clone() for g in opt.groups]
    try:
        opt.step()  # no backward since zero_grad()
        out["step without backward"] = None
    except RuntimeError as e:
        out["step without backward"] = str(e)
    out["unchanged"] = all(torch.equal(a, g.master) for a, g in zip(masters, opt.groups))
    # the loop goes on after the refusals
    opt.zero_grad()
    opt.backward(_loss(model, rank))
    opt.step()
    opt.zero_grad()
    if stage == 2:  # a plain loss.backward(): the hooks reduce, but nothing finishes the reduction
        _loss(model, rank).backward()
        try:
            opt.step()
            out["loss.backward()"] = None
        except RuntimeError as e:
            out["loss.backward()"] = str(e)
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_the_loop_order_is_enforced(stage):
    for seen in run_distributed(_order_run, 2, stage):
        assert "Call opt.zero_grad() after step()" in seen["model.zero_grad()"]
        assert "without opt.backward(loss)" in seen["step without backward"]
        assert seen["unchanged"]
        if stage == 2:
            assert "without opt.backward(loss)" in seen["loss.backward()"]
