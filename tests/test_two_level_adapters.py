"""The other ways in on several nodes (``ranks_per_node``, ``hierarchical_collectives``): the
DeepSpeed adapter's quantized gradients and qzero.fsdp's group reduce-scatter are flat
all-to-alls, so over several nodes of several ranks they are refused on every rank, naming the
settings to use; ``hierarchical_collectives=false`` runs them as before, bit for bit. On gloo
pseudo-nodes: world 4 as 2 nodes x 2 ranks (``ranks_per_node=2`` on one host).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from _support.distributed import run_distributed

import qzero

TWO_BY_TWO = dict(ranks_per_node=2)


def attempt(fn):
    try:
        fn()
        return None
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"


# ------------------------------------------------------------------ settings, pure


def test_the_settings_are_accepted_and_checked_by_the_deepspeed_config():
    pytest.importorskip("deepspeed")
    from qzero.integrations.deepspeed_config import prepare_config

    zero = {"stage": 2, "zero_quantized_gradients": True, "ranks_per_node": 8, "hierarchical_collectives": "false"}
    prepared = prepare_config({"bf16": {"enabled": True}, "zero_optimization": zero})
    assert prepared.topology == (8, False)
    assert not {"ranks_per_node", "hierarchical_collectives"} & set(prepared.ds_config["zero_optimization"])
    assert prepare_config({"zero_optimization": {"stage": 2}}).topology == (0, "auto")
    assert qzero.ZeroConfig.from_dict(zero).hierarchical_collectives is False
    for bad, words in (({"ranks_per_node": -1}, "ranks_per_node must be an int >= 0"),
                       ({"hierarchical_collectives": "maybe"}, "hierarchical_collectives must be"),
                       ({"stage": 3, "ranks_per_node": 2}, "ZeRO stage 3 with ['ranks_per_node']")):
        with pytest.raises(ValueError, match=None) as e:
            prepare_config({"zero_optimization": {"stage": 2, **bad}})
        assert words in str(e.value), str(e.value)


# ------------------------------------------------------------------ DeepSpeed, world 4


def _partitions(engine, rank):
    from test_deepspeed import data

    x, y = data(0, rank)
    engine.backward(torch.nn.functional.mse_loss(engine(x.to(torch.bfloat16)).float(), y))
    opt = engine.optimizer
    return [torch.cat([t.reshape(-1) for t in opt.averaged_gradients[i]]) for i in sorted(opt.averaged_gradients)]


def deepspeed_worker(rank, world):
    from test_deepspeed import build, ds_config, expect_error
    from test_deepspeed_grads import GRADS

    from qzero.integrations import deepspeed as qds

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    out = {"refused": expect_error(lambda: build(qds.initialize, ds_config(**GRADS, **TWO_BY_TWO)),
                                   "2 nodes x 2 ranks", "zero_quantized_gradients=false",
                                   "hierarchical_collectives=false", "qzero.ZeroOptimizer")}
    out["flat"] = _partitions(build(qds.initialize, ds_config(**GRADS, **TWO_BY_TWO, hierarchical_collectives=False)),
                              rank)
    out["today"] = _partitions(build(qds.initialize, ds_config(**GRADS)), rank)
    mine = ds_config(**GRADS, ranks_per_node=2 if rank == 0 else 0, hierarchical_collectives=False)
    out["differs"] = expect_error(lambda: build(qds.initialize, mine), "ranks_per_node differs")
    dist.barrier()
    return out


def test_deepspeed_quantized_gradients_on_pseudo_nodes():
    pytest.importorskip("deepspeed")
    for r in run_distributed(deepspeed_worker, 4, timeout=300):
        assert r["refused"] == "ok", r["refused"]
        assert r["differs"] == "ok", r["differs"]
        assert len(r["flat"]) == len(r["today"]) > 0
        for a, b in zip(r["flat"], r["today"]):
            assert torch.equal(a, b), "hierarchical_collectives=false must be the flat exchange, bit for bit"


# ------------------------------------------------------------------ qzero.fsdp, world 4


def _shard(mesh):
    from test_fsdp import build
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = build()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for child in (model.up, model.mid, model.odd):
        fully_shard(child, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _grads(model, rank):
    from test_fsdp import batch

    model(batch(0, rank)).float().pow(2).mean().backward()
    return {n: p.grad.to_local().detach().clone() for n, p in model.named_parameters()}


def _reduce_types(model):
    return sorted({type(m._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm).__name__
                   for m in model.modules() if hasattr(m, "_get_fsdp_state")})


def fsdp_worker(rank, world):
    from test_fsdp import GS, SMALL
    from torch.distributed.device_mesh import init_device_mesh

    from qzero.fsdp import quantize_group_gathers, quantize_group_reduces

    settings = dict(zero_quantized_gradients_group_size=GS, small_param_numel=SMALL, quant_kernels="reference")
    flat_mesh = init_device_mesh("cpu", (world,))
    out = {}
    model = _shard(flat_mesh)
    out["refused"] = attempt(lambda: quantize_group_reduces(model, **settings, **TWO_BY_TWO))
    out["untouched"] = _reduce_types(model)
    out["bad_node"] = attempt(lambda: quantize_group_reduces(model, **settings, ranks_per_node=3))
    out["gathers"] = attempt(lambda: quantize_group_gathers(model, group_size=GS, **TWO_BY_TWO))
    quantize_group_reduces(model, **settings, **TWO_BY_TWO, hierarchical_collectives=False)
    out["installed"] = _reduce_types(model)
    out["flat"] = _grads(model, rank)
    today = _shard(flat_mesh)
    quantize_group_reduces(today, **settings)
    out["today"] = _grads(today, rank)
    # HSDP: shard inside the (pseudo-)node, replicate across: the reduce-scatter stays inside it
    hsdp = _shard(init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    out["hsdp"] = attempt(lambda: quantize_group_reduces(hsdp, **settings, **TWO_BY_TWO))
    out["hsdp_installed"] = _reduce_types(hsdp)
    dist.barrier()
    return out


def test_fsdp_group_reduces_on_pseudo_nodes():
    for r in run_distributed(fsdp_worker, 4, timeout=300):
        assert r["refused"] is not None and all(w in r["refused"] for w in (
            "2 nodes x 2 ranks", "HSDP mesh", "hierarchical_collectives=false")), r["refused"]
        assert r["untouched"] == ["DefaultReduceScatter"]
        assert "ranks_per_node=3 does not divide the world size 4" in (r["bad_node"] or ""), r["bad_node"]
        assert r["gathers"] is None, r["gathers"]  # the all-gather crosses each node boundary once: accepted
        assert r["installed"] == ["GroupQuantizedReduceScatter"]
        assert r["flat"].keys() == r["today"].keys()
        for name in r["flat"]:
            assert torch.equal(r["flat"][name], r["today"][name]), name
        assert r["hsdp"] is None and r["hsdp_installed"] == ["GroupQuantizedReduceScatter"], r["hsdp"]
