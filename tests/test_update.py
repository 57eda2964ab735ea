"""Sliced update: the inner optimizer stepped chunk by chunk gives the bits of one whole step."""

import functools

import pytest
import torch
import torch.nn.functional as F
from _support.distributed import run_distributed

import qzero
from qzero.optim import update as sliced_update


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(41, 48)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(48, 48) for _ in range(6))
        self.norm = torch.nn.LayerNorm(48)
        self.head = torch.nn.Linear(48, 41, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return self.head(self.norm(x))


OPTIMIZERS = {
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
    "adamw_foreach": functools.partial(torch.optim.AdamW, lr=1e-2, foreach=True),
    "adamw_fused": functools.partial(torch.optim.AdamW, lr=1e-2, fused=True),
    "adam_amsgrad": functools.partial(torch.optim.Adam, lr=1e-2, amsgrad=True, foreach=False),
    "sgd": functools.partial(torch.optim.SGD, lr=1e-2, momentum=0.9),
}


def train(rank, world, cfg, optimizer, steps, sliced, nan_at=None):
    torch.manual_seed(0)
    model = Net().bfloat16()
    opt = qzero.ZeroOptimizer(model, OPTIMIZERS[optimizer], config=qzero.ZeroConfig(**cfg, sliced_update=sliced))
    calls = []
    real_step = opt.optimizer.step
    opt.optimizer.step = lambda *a, **k: (calls.append(1), real_step(*a, **k))[1]  # counts inner steps, no hook
    losses, error = [], None
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, 41, (world * 2, 9), generator=g)[rank * 2 : rank * 2 + 2]
        loss = F.cross_entropy(model(tokens[:, :-1]).float().reshape(-1, 41), tokens[:, 1:].reshape(-1))
        opt.backward(loss * (float("nan") if step == nan_at and rank == world - 1 else 1.0))
        masters = [g.master.clone() for g in opt.groups]
        flats = [g.flat.clone() for g in opt.groups]
        try:
            opt.step()
        except FloatingPointError as e:
            error = (str(e), all(torch.equal(a, g.master) for a, g in zip(masters, opt.groups)),
                     all(torch.equal(a, g.flat) for a, g in zip(flats, opt.groups)))
            break
        opt.zero_grad()
        losses.append(loss.item())
    opt.wait_for_weights()
    state = opt.optimizer.state[opt.groups[0].master]
    return {
        "losses": losses,
        "flat": [g.flat.clone() for g in opt.groups],
        "masters": [g.master.clone() for g in opt.groups],
        "state": {k: v.clone() for k, v in state.items() if torch.is_tensor(v)},
        "calls": len(calls),
        "chunks": sum(len(g.gather_plan.chunks) for g in opt.groups),
        "error": error,
    }


BASE = dict(small_param_numel=40, allgather_bucket_size=4 * 64 * 5, flat_order="interleaved")
CASES = [
    (2, dict(stage=2, zero_quantized_weights=True), "adamw"),
    (3, dict(stage=2, zero_quantized_weights=True), "adamw_foreach"),
    (3, dict(stage=1, zero_quantized_weights=True, overlap_param_gather=True), "adamw"),
    (2, dict(stage=2, overlap_param_gather=True), "adamw_fused"),
    (2, dict(stage=2, zero_quantized_weights=True, overlap_param_gather=True, flat_order="contiguous"), "adam_amsgrad"),
    (1, dict(stage=2, zero_quantized_weights=True), "adamw"),
    (2, dict(stage=2, gradient_clipping=0.05), "adamw"),
]


@pytest.mark.parametrize("world, cfg, optimizer", CASES)
def test_sliced_update_is_bitwise_one_whole_step(world, cfg, optimizer):
    steps = 4
    cfg = {**BASE, **cfg}
    whole = run_distributed(train, world, cfg, optimizer, steps, False)
    sliced = run_distributed(train, world, cfg, optimizer, steps, True)
    chunks = None
    for w, s in zip(whole, sliced):
        assert w["losses"] == s["losses"]
        for a, b in zip(w["flat"] + w["masters"], s["flat"] + s["masters"]):
            assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                               b.view(torch.int16) if b.dtype == torch.bfloat16 else b)
        assert w["state"].keys() == s["state"].keys()
        for k in w["state"]:
            assert torch.equal(w["state"][k], s["state"][k]), k
        assert float(s["state"]["step"]) == steps
        assert w["calls"] == steps
        calls, chunks = s["calls"], s["chunks"]
    # the first step is whole (it creates the state); later ones in slices that at least
    # double, so a step makes about log2(chunks) optimizer calls, not one per chunk
    assert calls > steps, "the update was not sliced"
    if chunks > 4:
        assert calls - 1 <= (steps - 1) * (chunks.bit_length() + 1) < (steps - 1) * chunks


def test_optimizers_that_are_not_elementwise_step_whole():
    out = run_distributed(train, 2, {**BASE, "zero_quantized_weights": True}, "sgd", 3, True)
    assert all(r["calls"] == 3 for r in out)


def test_sliceable_needs_state_no_hooks_and_the_masters_alone():
    master = torch.zeros(128)
    master.grad = torch.ones(128)
    opt = torch.optim.AdamW([master], lr=1e-3)
    assert not sliced_update.sliceable(opt, [master])  # no state before the first step
    opt.step()
    assert sliced_update.sliceable(opt, [master])
    handle = opt.register_step_post_hook(lambda *a: None)
    assert not sliced_update.sliceable(opt, [master])
    handle.remove()
    assert sliced_update.sliceable(opt, [master])
    other = torch.zeros(4, requires_grad=True)
    opt.add_param_group({"params": [other]})
    assert not sliced_update.sliceable(opt, [master])
    assert not sliced_update.sliceable(torch.optim.SGD([master], lr=1.0), [master])


@pytest.mark.parametrize("overlap", [False, True])
def test_non_finite_gradients_are_refused_before_a_sliced_update(overlap):
    cfg = {**BASE, "zero_quantized_weights": True, "overlap_param_gather": overlap}
    for r in run_distributed(train, 2, cfg, "adamw", 4, True, 2):
        msg, masters_unchanged, flat_unchanged = r["error"]
        assert "non-finite gradients" in msg and "step 3" in msg and "rank 1's shard" in msg
        assert masters_unchanged and flat_unchanged
