"""Quantized gradients never take the contiguous flat order by themselves on more than two
ranks: there every rank would send its quantized piece of a bucket to the bucket's one or two
owners at once (an incast). ``flat_order="auto"`` picks the interleaved order for them even
where that pads more; an explicit ``"contiguous"`` is honoured with a warning on every rank."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

from _support.distributed import run_distributed
from qzero import ZeroConfig, ZeroOptimizer
from qzero.layout.flat_layout import plan_flat_layout

SHAPES = [(100,), (70,), (900,)]  # interleaving these over 3 ranks pads far more than 3%


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.p = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(*s)) for s in SHAPES)


def _orders(rank, world, flat_order, quantized):
    torch.manual_seed(0)
    config = ZeroConfig(stage=2, zero_quantized_gradients=quantized, flat_order=flat_order, small_param_numel=0,
                        zero_quantized_gradients_format="int8")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = ZeroOptimizer(Model(), functools.partial(torch.optim.SGD, lr=0.1), config=config)
    incast = [str(w.message) for w in caught if "incast" in str(w.message)]
    return [g.layout.order for g in opt.groups], incast


def test_the_shapes_pad_enough_that_auto_alone_picks_contiguous():
    assert plan_flat_layout(SHAPES, 3, small_param_numel=0, flat_order="auto").order == "contiguous"


@pytest.mark.parametrize("world", [2, 3])
def test_auto_takes_the_interleaved_order_for_quantized_gradients_above_two_ranks(world):
    for orders, incast in run_distributed(_orders, world, "auto", True):
        assert orders == (["interleaved"] if world > 2 else ["contiguous"]) and not incast
    for orders, incast in run_distributed(_orders, world, "auto", False):  # plain gradients: by padding, as before
        assert orders == ["contiguous"] and not incast


def test_an_explicit_contiguous_order_warns_of_the_incast_on_every_rank():
    results = run_distributed(_orders, 3, "contiguous", True)
    assert len(results) == 3
    for orders, incast in results:
        assert orders == ["contiguous"]
        assert len(incast) == 1 and "flat_order='interleaved'" in incast[0] and "3 ranks" in incast[0]
