"""A backward that raises, or a gradient from a plain ``loss.backward()``, leaves nothing behind
once ``opt.zero_grad()`` has run: the next step is bit for bit the step of an optimizer that
never saw them. Until then ``step()`` and ``backward()`` refuse, on every rank, naming
``opt.zero_grad()`` ([Note: an interrupted backward] in qzero/optim/zero.py, [Note: gradients
outside opt.backward] in qzero/optim/grads.py)."""

from __future__ import annotations

import functools

import pytest
import torch
from _support.distributed import run_distributed

import qzero

WIDTH, LAYERS, BOOM_AFTER = 16, 6, 3


class Boom(torch.autograd.Function):
    """Identity whose backward raises while ``armed`` (a bad batch, a failing kernel)."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if Boom.armed:
            raise ValueError("bad batch")
        return g


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == BOOM_AFTER:  # the layers after it have their gradients (and buckets sent) first
                x = Boom.apply(x)
        return x.pow(2).mean()


def _batch(rank, step):
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(100 * step + rank))


def _refused(fn) -> str:
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    return "not refused"


def _run(rank, world, stage, ahead):
    cfg = qzero.ZeroConfig(stage=stage, reduce_bucket_size=WIDTH * WIDTH + WIDTH, small_param_numel=4,
                           reduce_buckets_in_flight=1, overlap_param_gather=ahead, zero_quantized_weights=True)

    def make():
        model = Net().to(torch.bfloat16)
        return model, qzero.ZeroOptimizer(model, functools.partial(torch.optim.AdamW, lr=1e-2), config=cfg)

    def good_step(model, opt, step):
        opt.backward(model(_batch(rank, step).to(torch.bfloat16)))
        opt.step()
        opt.zero_grad()

    clean_model, clean = make()
    model, opt = make()
    out = {}
    for case in ("plain backward", "plain backward after opt.backward", "backward raised",
                 "backward raised at the second micro-batch"):
        if case == "plain backward":
            model(_batch(rank, 50).to(torch.bfloat16)).backward()
            out[case, "step"] = _refused(opt.step)
            out[case, "backward"] = _refused(lambda: opt.backward(model(_batch(rank, 51).to(torch.bfloat16))))
        elif case == "plain backward after opt.backward":
            opt.backward(model(_batch(rank, 52).to(torch.bfloat16)))
            if rank == world - 1:  # on one rank only: every rank refuses, the others naming it
                model(_batch(rank, 53).to(torch.bfloat16)).backward()
            out[case, "step"] = _refused(opt.step)
        else:
            if case.endswith("micro-batch"):
                opt.backward(model(_batch(rank, 54).to(torch.bfloat16)))
            Boom.armed = True
            try:
                opt.backward(model(_batch(rank, 55).to(torch.bfloat16)))
            except ValueError:
                pass
            finally:
                Boom.armed = False
            out[case, "step"] = _refused(opt.step)
            out[case, "backward"] = _refused(lambda: opt.backward(model(_batch(rank, 56).to(torch.bfloat16))))
        opt.zero_grad()  # the recovery: the next step is the clean optimizer's
        step = len(out)
        good_step(model, opt, step)
        good_step(clean_model, clean, step)
        opt.wait_for_weights()
        clean.wait_for_weights()
        out[case, "same masters"] = all(torch.equal(a.master, b.master) for a, b in zip(opt.groups, clean.groups))
        out[case, "same weights"] = all(torch.equal(a.flat, b.flat) for a, b in zip(opt.groups, clean.groups))
    return out


@pytest.mark.parametrize("world, stage, ahead", [(1, 2, False), (2, 2, True), (3, 2, False), (2, 1, False)])
def test_zero_grad_recovers_from_a_raised_or_plain_backward(world, stage, ahead):
    for rank, out in enumerate(run_distributed(_run, world, stage, ahead)):
        for (case, what), seen in out.items():
            if what.startswith("same"):
                assert seen is True, (case, what)
            elif case.startswith("plain backward"):
                if what == "step" and case == "plain backward":  # no opt.backward at all since zero_grad()
                    assert "without opt.backward(loss)" in seen, (case, seen)
                elif case == "plain backward after opt.backward" and rank != world - 1:
                    assert f"rank(s) [{world - 1}] refused optimizer step" in seen, seen
                    assert "plain loss.backward()" in seen and "opt.zero_grad()" in seen, seen
                else:
                    assert "plain loss.backward()" in seen and "opt.zero_grad()" in seen, (case, what, seen)
            elif what == "step" and case == "backward raised":  # its first micro-batch raised
                assert "without opt.backward(loss)" in seen, (case, seen)
            else:
                assert "ValueError: bad batch" in seen and "opt.zero_grad()" in seen, (case, what, seen)
