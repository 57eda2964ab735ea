"""fp16 models: a master that is finite in fp32 but beyond what fp16 holds (above 65,504) never
reaches a replica. ``step()`` raises ``FloatingPointError`` on every rank, naming the parameter
and the value, before the weight gather (plain, INT8, or a delta run's exact resync; SGD's whole
update and AdamW's sliced one), and so does ``gather_exact_weights()`` ([Note: masters the
model's dtype cannot hold] in qzero/optim/zero.py)."""

from __future__ import annotations

import functools

import pytest
import torch
from _support.distributed import run_distributed

import qzero

WIDTH = 16
GATHERS = {
    "plain": {},
    "int8": {"zero_quantized_weights": True},
    "delta resync": {"zero_quantized_weights": True, "zero_quantized_weights_delta": True,
                     "zero_quantized_weights_delta_resync_steps": 1},  # every gather an exact resync
}


def _run(rank, world, ahead):
    out = {}
    for gather, extra in GATHERS.items():
        for inner, lrs in (("SGD", (1.0, 400.0)), ("AdamW", (1.0, 600.0))):
            torch.manual_seed(0)
            model = torch.nn.Linear(WIDTH, WIDTH).half()
            with torch.no_grad():
                model.weight[0, 0] = 65280.0  # fp16 holds it; 65,520 and up round to Inf
            cfg = qzero.ZeroConfig(stage=2, loss_scale=1.0, small_param_numel=4, overlap_param_gather=ahead, **extra)
            opt = qzero.ZeroOptimizer(model, functools.partial(getattr(torch.optim, inner), lr=lrs[0],
                                                               weight_decay=0.0), config=cfg)

            def step():
                # the gradient of weight[0, 0] is -1 on every rank: the update raises it by about lr
                loss = -model.weight[0, 0] + 0.0 * sum(p.float().sum() for p in model.parameters())
                opt.backward(loss)
                opt.step()

            step()  # AdamW: its state exists from now on, so the next update is sliced
            opt.zero_grad()
            opt.wait_for_weights()
            for group in opt.param_groups:
                group["lr"] = lrs[1]
            flat = torch.cat([g.flat for g in opt.groups]).clone()
            case = f"{gather}, {inner}"
            try:
                step()
                out[case] = "not refused"
            except FloatingPointError as e:
                out[case] = str(e)
            try:
                opt.gather_exact_weights()
                out[case, "gather_exact_weights"] = "not refused"
            except FloatingPointError as e:
                out[case, "gather_exact_weights"] = str(e)
            now = torch.cat([g.flat for g in opt.groups])  # every replica as it was
            out[case, "replica unchanged"] = bool(torch.equal(now, flat) and torch.isfinite(now).all())
    return out


@pytest.mark.parametrize("world, ahead", [(1, False), (2, True), (3, False)])
def test_a_master_beyond_fp16_is_refused_before_the_gather(world, ahead):
    for rank, out in enumerate(run_distributed(_run, world, ahead)):
        for key, seen in out.items():
            if isinstance(key, tuple) and key[1] == "replica unchanged":
                assert seen, (rank, key)
            else:
                assert "overflow the model's dtype torch.float16" in seen and "'weight'" in seen, (rank, key, seen)
                assert "rank 0's shard: 6" in seen, (rank, key, seen)  # the value, 65,680 or so
