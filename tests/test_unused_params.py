"""Stage 2 with a parameter that gets no gradient on some ranks only (a skipped branch, an MoE
expert no token chose, LayerDrop): every rank issues its reductions in the same order
([Note: one launch order] in qzero/optim/grads.py), so the gradient shard is the average
of the ranks' gradients, as an independent reference computes it (fp32, one process)."""

from __future__ import annotations

import functools

import pytest
import torch
from _support.distributed import run_distributed

import qzero

LAYERS, WIDTH = 5, 24


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(WIDTH) * 0.1)  # first in the layout
        self.layers = torch.nn.ModuleList([torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])

    def forward(self, x, skip):
        x = x + self.embed
        for i, layer in enumerate(self.layers):
            if i not in skip:
                x = torch.tanh(layer(x))
        return x.pow(2).mean()


def _skip(rank):
    return {rank % LAYERS, (2 * rank + 1) % LAYERS} if rank else set()  # rank 0 uses every layer


def _run(rank, world, flat_order, solo, quantized):
    model = Net()
    cfg = qzero.ZeroConfig(stage=2, reduce_bucket_size=WIDTH * WIDTH, flat_order=flat_order, overlap_comm=True,
                           solo_reduce=solo, small_param_numel=8, reduce_buckets_in_flight=1,
                           zero_quantized_gradients=quantized)
    opt = qzero.ZeroOptimizer(model, functools.partial(torch.optim.SGD, lr=1.0), config=cfg)
    for micro in range(2):  # accumulation: the order is the same in every backward
        x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(10 * rank + micro))
        opt.backward(model(x, _skip(rank)))
    g = opt.groups[0]
    shard = g.grad_shard().clone()
    ref = Net()
    for r in range(world):
        for micro in range(2):
            x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(10 * r + micro))
            (ref(x, _skip(r)) / world).backward()
    full = torch.zeros(g.layout.numel)
    for slot, p in zip(g.layout.slots, ref.parameters()):
        if p.grad is not None:
            full[slot.start : slot.stop] = p.grad.reshape(-1)
    want = full[g.lo : g.hi]
    return float((shard - want).abs().max()), float(want.abs().max()), len(opt.grads[0].buckets)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("flat_order,solo", [("interleaved", False), ("interleaved", True), ("contiguous", False)])
def test_parameters_unused_on_some_ranks_only_reduce_to_the_average(world, flat_order, solo):
    for err, scale, buckets in run_distributed(_run, world, flat_order, solo, False):
        assert buckets >= 3
        assert err <= 1e-6 * scale, (err, scale)


def test_with_quantized_gradients_too():
    for err, scale, _ in run_distributed(_run, 2, "interleaved", False, True):
        assert err <= 0.02 * scale, (err, scale)  # INT8 gradients: quantization error only


def _launch_points(rank, world):
    """Per backward: at which gradient hook each bucket completed and at which it launched."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    opt = qzero.ZeroOptimizer(model, functools.partial(torch.optim.AdamW, lr=1e-3),
                              config=qzero.ZeroConfig(stage=2, reduce_bucket_size=2_000, small_param_numel=8))
    grads = opt.grads[0]
    hooks, launched, completed = [0], {}, {}
    on_grad, launch = grads._on_grad, grads._launch

    def counting_on_grad(i, p):
        hooks[0] += 1
        before = {b.index for b in grads.buckets if grads._missing[b.index] == 0}
        on_grad(i, p)
        for b in grads.buckets:
            if grads._missing[b.index] == 0 and b.index not in before:
                completed[b.index] = hooks[0]

    def counting_launch(bucket):
        launched[bucket.index] = hooks[0]
        return launch(bucket)

    grads._on_grad, grads._launch = counting_on_grad, counting_launch
    for h in grads._handles:  # rebind the hooks to the counting method
        h.remove()
    grads._handles = [p.register_post_accumulate_grad_hook(lambda p, i=i: grads._on_grad(i, p))
                      for i, p in enumerate(grads.group.params)]
    out = []
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        hooks[0] = 0
        launched.clear()
        completed.clear()
        opt.backward(model(input_ids=x, labels=x).loss)
        out.append((dict(completed), dict(launched), len(grads.buckets)))
    return out


def test_after_the_first_backward_buckets_launch_as_soon_as_they_complete():
    """The first backward launches in the plan's order (a layer's norms, laid out after its
    matrices but reached later, hold some buckets back); from the second on, in rank 0's
    completion order, which on these ranks is each bucket's own completion."""
    for (first_done, first_launch, n), (done, launch, _) in run_distributed(_launch_points, 2):
        assert n >= 6 and len(done) == len(launch) == n
        assert all(launch[b] == done[b] for b in done), (done, launch)
        assert any(first_launch[b] > first_done[b] for b in first_done)  # what the learned order gains
