"""A quantized gradient exchange on more than two ranks never pays for its flat order silently
([Note: quantized gradients and the flat order] in qzero/optim/flat.py). ``auto`` takes the
interleaved order unless it pads more than 3%, flat or two-level collectives alike; in the
contiguous order quantized gradients are reduced in windows ([Note: windows in the contiguous
order] in qzero/optim/grads.py): no all-to-all concentrates on an owner (every rank receives
the same bytes in every one), and every rank warns that the reduction waits for the end of
backward, naming the padding the interleaved order would take. Two ranks, plain gradients and
an unpadded interleaved order say nothing."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.distributed as dist

from _support.distributed import run_distributed
from qzero import ZeroConfig, ZeroOptimizer
from qzero.layout.flat_layout import plan_flat_layout

PADDED = [(100,), (70,), (900,)]  # interleaving these over 3+ ranks pads far more than 3% (one large parameter)
EVEN = [(64 * 12,), (64 * 12,), (64 * 12,), (64 * 12,)]  # interleaving these pads nothing
TWO_LEVEL = {"ranks_per_node": 2, "hierarchical_collectives": "true"}


class Model(torch.nn.Module):
    def __init__(self, shapes):
        super().__init__()
        self.p = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(*s)) for s in shapes)

    def forward(self, x):
        return sum((p * x[: p.numel()].view(p.shape)).sum() for p in self.p)


def _build(rank, world, shapes, quantized, settings):
    torch.manual_seed(0)
    config = ZeroConfig(stage=2, zero_quantized_gradients=quantized, small_param_numel=0,
                        zero_quantized_gradients_format="int8", **settings)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = ZeroOptimizer(Model(shapes), functools.partial(torch.optim.SGD, lr=0.1), config=config)
    said = [str(w.message) for w in caught if "flat order" in str(w.message)]
    return [g.layout.order for g in opt.groups], said


def test_the_shapes_pad_as_the_cases_need():
    assert plan_flat_layout(PADDED, 4, small_param_numel=0, flat_order="auto").order == "contiguous"
    assert plan_flat_layout(EVEN, 4, small_param_numel=0, flat_order="auto").order == "interleaved"


@pytest.mark.parametrize("world,flat_order,settings", [
    (3, "auto", {}), (3, "contiguous", {}), (4, "auto", TWO_LEVEL), (4, "contiguous", TWO_LEVEL)])
def test_a_contiguous_quantized_exchange_warns_of_the_wait_on_every_rank(world, flat_order, settings):
    results = run_distributed(_build, world, PADDED, True, {"flat_order": flat_order, **settings})
    assert len(results) == world
    pads = plan_flat_layout(PADDED, world, small_param_numel=0, flat_order="interleaved")
    padding = f"{pads.padding / pads.used_numel:.0%}"
    for orders, said in results:
        assert orders == ["contiguous"]
        assert len(said) == 1 and f"{world} ranks" in said[0] and "end of backward" in said[0], said
        assert "incast" not in said[0] and f"padding this model's parameters by {padding}" in said[0], said


def test_auto_takes_the_interleaved_order_where_it_pads_little_two_level_too():
    for orders, said in run_distributed(_build, 4, EVEN, True, TWO_LEVEL):
        assert orders == ["interleaved"] and said == []


@pytest.mark.parametrize("world,shapes,quantized,settings", [
    (2, PADDED, True, {}),  # two ranks: every exchange is between the two, and overlaps backward
    (3, PADDED, False, {}),  # plain gradients: reduce-scatters and reduces, no all-to-all, few ranks
    (4, EVEN, True, {}),  # interleaved, unpadded
    (4, EVEN, False, TWO_LEVEL),  # plain gradients, two-level reduce-scatters
])
def test_nothing_is_said_where_nothing_is_paid(world, shapes, quantized, settings):
    for _, said in run_distributed(_build, world, shapes, quantized, settings):
        assert said == []


def _received(rank, world, settings):
    """Bytes this rank receives in each quantized all-to-all of two steps (contiguous order)."""
    torch.manual_seed(0)
    model = Model(EVEN)
    config = ZeroConfig(flat_order="contiguous", zero_quantized_gradients=True, small_param_numel=0,
                        reduce_bucket_size=96 * world, **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = ZeroOptimizer(model, functools.partial(torch.optim.SGD, lr=0.1), config=config)
    got, real = [], dist.all_to_all_single

    def booked(output, input, output_split_sizes=None, input_split_sizes=None, **kw):
        splits = output_split_sizes or [output.numel() // world] * world
        got.append(sum(splits) * output.element_size())
        return real(output, input, output_split_sizes, input_split_sizes, **kw)

    dist.all_to_all_single = booked
    try:
        for step in range(2):
            x = torch.randn(64 * 12, generator=torch.Generator().manual_seed(10 * rank + step))
            opt.backward(model(x))
            opt.step()
            opt.zero_grad()
    finally:
        dist.all_to_all_single = real
    return got, opt.groups[0].layout.order


@pytest.mark.parametrize("world,settings", [(3, {}), (4, {}), (4, TWO_LEVEL), (8, {"ranks_per_node": 4})])
def test_no_exchange_of_the_contiguous_order_concentrates_on_an_owner(world, settings):
    """In an owner's flat range every rank would send its piece to the one or two owners; in windows
    every rank receives the same bytes in every all-to-all (several windows a step here)."""
    results = run_distributed(_received, world, settings)
    assert all(order == "contiguous" for _, order in results)
    calls = [got for got, _ in results]
    assert len(calls[0]) >= 4 and all(len(c) == len(calls[0]) for c in calls)
    for k, per_rank in enumerate(zip(*calls)):
        assert min(per_rank) > 0 and len(set(per_rank)) == 1, f"all-to-all {k}: received {per_rank}"


def test_plain_gradients_that_are_not_two_level_say_so_on_every_rank():
    """Plain gradients in the contiguous order go to their owners by chain reduces over the
    whole group: on declared nodes that is not the two-level reduction the user asked for."""
    results = run_distributed(_build, 4, PADDED, False, TWO_LEVEL)
    assert len(results) == 4
    for orders, said in results:
        assert orders == ["contiguous"] and len(said) == 1, said
        assert "chain reduce per owner and bucket over all 4 ranks, not in two levels" in said[0], said
        assert "zero_quantized_gradients=true reduces them in windows in two levels" in said[0], said
