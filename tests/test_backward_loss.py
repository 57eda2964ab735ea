"""``ZeroOptimizer.backward(loss)`` refuses what is not a loss, saying what is wrong, and changes nothing."""

from __future__ import annotations

import functools

import pytest
import torch

import qzero


class Output:
    """Stands for a model output object (what ``model(x)`` returns, ``.loss`` inside)."""

    def __init__(self, loss):
        self.loss = loss


def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).bfloat16()
    opt = qzero.ZeroOptimizer(model, functools.partial(torch.optim.AdamW, lr=1e-2),
                              config=qzero.ZeroConfig(zero_quantized_weights=True))
    return model, opt


def x():
    return torch.randn(4, 8).bfloat16()


BAD = [
    ("None (an HF model called without labels)", lambda m: None, TypeError, r"got NoneType.*without labels"),
    ("a model output", lambda m: Output(m(x()).float().mean()), TypeError,
     r"got Output \(a model output: pass its \.loss\)"),
    ("a float", lambda m: 3.0, TypeError, r"loss must be a torch\.Tensor, got float"),
    ("an integer tensor", lambda m: torch.tensor(3), TypeError, r"floating-point tensor, got dtype torch\.int64"),
    ("not a scalar", lambda m: m(x()).float().sum(dim=1), ValueError, r"scalar \(one element\), got shape \(4,\)"),
    ("no grad", lambda m: m(x()).float().mean().detach(), ValueError, r"does not require grad"),
]


@pytest.mark.parametrize("make_loss, exc, match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_loss_is_refused_and_changes_nothing(make_loss, exc, match):
    model, opt = make()
    loss = make_loss(model)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(exc, match=match):
        opt.backward(loss)
    assert all(p.grad is None for p in model.parameters())
    assert all(g.grad is None for g in opt.groups), "a gradient shard was made"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # and the optimizer still works afterwards
    opt.backward(model(x()).float().mean())
    assert opt.step()


def test_one_element_losses_are_accepted():
    model, opt = make()
    opt.backward(model(x()).float().mean().reshape(1, 1))
    assert opt.step()
