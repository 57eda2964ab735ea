"""A quantized gradient exchange on more than two ranks never pays for its flat order silently
([Note: quantized gradients and the flat order] in qzero/optim/flat.py): the contiguous order
(an incast on each bucket's owner) and the padding two-level collectives take on are warned of
on every rank; two ranks, plain gradients and an unpadded interleaved order say nothing."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

from _support.distributed import run_distributed
from qzero import ZeroConfig, ZeroOptimizer
from qzero.layout.flat_layout import plan_flat_layout

PADDED = [(100,), (70,), (900,)]  # interleaving these over 3+ ranks pads far more than 3%
EVEN = [(64 * 12,), (64 * 12,), (64 * 12,), (64 * 12,)]  # interleaving these pads nothing


class Model(torch.nn.Module):
    def __init__(self, shapes):
        super().__init__()
        self.p = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(*s)) for s in shapes)


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


@pytest.mark.parametrize("flat_order", ["auto", "contiguous"])
def test_a_contiguous_quantized_exchange_on_three_ranks_warns_of_the_incast_on_every_rank(flat_order):
    results = run_distributed(_build, 3, PADDED, True, {"flat_order": flat_order})
    assert len(results) == 3
    for orders, said in results:
        assert orders == ["contiguous"]
        assert len(said) == 1 and "incast" in said[0] and "3 ranks" in said[0], said


def test_two_level_warns_of_the_padding_it_takes_on_every_rank():
    results = run_distributed(_build, 4, PADDED, True, {"ranks_per_node": 2, "hierarchical_collectives": "true"})
    for orders, said in results:
        assert orders == ["interleaved"]
        assert len(said) == 1 and "pads" in said[0] and "hierarchical_collectives=false" in said[0], said


@pytest.mark.parametrize("world,shapes,quantized,settings", [
    (2, PADDED, True, {}),  # two ranks: every exchange is between the two
    (3, PADDED, False, {}),  # plain gradients: reduce-scatters and reduces, no all-to-all
    (4, EVEN, True, {}),  # interleaved, unpadded
    (4, EVEN, True, {"ranks_per_node": 2, "hierarchical_collectives": "true"}),
])
def test_nothing_is_said_where_nothing_is_paid(world, shapes, quantized, settings):
    for _, said in run_distributed(_build, world, shapes, quantized, settings):
        assert said == []
