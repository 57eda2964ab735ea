"""Stage 2 with a parameter whose gradient hook fires more than once in one backward (shared by
two blocks under reentrant activation checkpointing): every contribution reaches the sum, with
gradient accumulation too, as stage 1 computes it; a backward that fires a hook more often than
the first one did, after its bucket was sent, is refused on every rank naming the parameter
([Note: counted hooks] in qzero/optim/grads.py)."""

from __future__ import annotations

import functools

import pytest
import torch
from _support.distributed import run_distributed
from torch.utils.checkpoint import checkpoint

import qzero

WIDTH = 12


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(WIDTH, WIDTH)
        self.shared = torch.nn.Linear(WIDTH, WIDTH)  # used by every block
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(WIDTH, WIDTH) for _ in range(3)])
        self.head = torch.nn.Linear(WIDTH, 1)

    def _block(self, i, x):
        return torch.tanh(self.blocks[i](torch.tanh(self.shared(x))))

    def forward(self, x, blocks=3):
        x = self.embed(x)
        for i in range(blocks):
            x = checkpoint(functools.partial(self._block, i), x, use_reentrant=True)
        return self.head(x).pow(2).mean()


def _batch(rank, step, micro):
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1000 * step + 10 * micro + rank))


def _run(rank, world, ahead):
    def make(stage):
        model = Net()
        cfg = qzero.ZeroConfig(stage=stage, reduce_bucket_size=WIDTH * WIDTH + WIDTH, small_param_numel=4,
                               reduce_buckets_in_flight=1, overlap_param_gather=ahead, reduce_dtype="fp32")
        return model, qzero.ZeroOptimizer(model, functools.partial(torch.optim.SGD, lr=0.5), config=cfg)

    out = {}
    for stage in (1, 2):
        model, opt = make(stage)
        for step in range(3):
            for micro in range(2):  # gradient accumulation
                opt.backward(model(_batch(rank, step, micro)))
            opt.step()
            opt.zero_grad()
        opt.wait_for_weights()
        out[stage] = torch.cat([g.master for g in opt.groups])
    # A later backward that uses the shared layer in more blocks than the first one did: its
    # extra firings either still reach their unsent bucket (then the result is stage 1's), or
    # come after it was sent (then the step is refused, naming the layer).
    for stage in (1, 2):
        model, opt = make(stage)
        opt.backward(model(_batch(rank, 0, 0), blocks=1))
        opt.step()
        opt.zero_grad()
        before = torch.cat([g.master for g in opt.groups]).clone()
        opt.backward(model(_batch(rank, 1, 0), blocks=3))
        try:
            opt.step()
            out["late", stage] = "not refused"
        except RuntimeError as e:
            out["late", stage] = str(e)
        out["late unchanged", stage] = torch.equal(before, torch.cat([g.master for g in opt.groups]))
        opt.zero_grad()  # and the loop goes on
        opt.backward(model(_batch(rank, 2, 0), blocks=1))
        opt.step()
        opt.wait_for_weights()
        out["late masters", stage] = torch.cat([g.master for g in opt.groups])
    return out


@pytest.mark.parametrize("world, ahead", [(1, False), (2, True), (3, False)])
def test_every_firing_of_a_repeated_hook_reaches_the_sum(world, ahead):
    for out in run_distributed(_run, world, ahead):
        torch.testing.assert_close(out[2], out[1], rtol=1e-6, atol=1e-6)  # stage 2 as stage 1
        late = out["late", 2]
        assert out["late", 1] == "not refused"
        if world == 1 or late != "not refused":  # at world 1 the shared layer's bucket goes first
            assert "parameter 'shared." in late and "use_reentrant=False" in late, late
            assert out["late unchanged", 2]
        else:
            torch.testing.assert_close(out["late masters", 2], out["late masters", 1], rtol=1e-6, atol=1e-6)
