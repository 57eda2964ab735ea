"""The other ways in on several nodes (``ranks_per_node``, ``hierarchical_collectives``), on gloo
pseudo-nodes: world 4 as 2 nodes x 2 ranks (``ranks_per_node=2`` on one host).

* The DeepSpeed adapter's quantized gradients (a flat, owner-contiguous all-to-all) are refused
  on every rank, naming the settings to use; ``hierarchical_collectives=false`` runs them as
  before, bit for bit; settings that differ between ranks are refused.
* qzero.fsdp's group reduce-scatter runs in two stages: every rank's output bit for bit a
  reference built from every rank's input (each node's fp32 sum, the other node's quantized),
  and not the flat exchange's; ``false`` is the flat exchange bit for bit; an HSDP mesh that
  shards inside the node stays flat; the group gather takes the settings.
"""

from __future__ import annotations

import os
import warnings

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
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["flat"] = _partitions(
            build(qds.initialize, ds_config(**GRADS, **TWO_BY_TWO, hierarchical_collectives=False)), rank)
        out["today"] = _partitions(build(qds.initialize, ds_config(**GRADS)), rank)
    out["incast warnings"] = sum("an incast up to 4-1 times slower" in str(w.message) for w in caught)
    mine = ds_config(**GRADS, ranks_per_node=2 if rank == 0 else 0, hierarchical_collectives=False)
    out["differs"] = expect_error(lambda: build(qds.initialize, mine), "ranks_per_node differs")
    dist.barrier()
    return out


def test_deepspeed_quantized_gradients_on_pseudo_nodes():
    pytest.importorskip("deepspeed")
    for r in run_distributed(deepspeed_worker, 4, timeout=300):
        assert r["refused"] == "ok", r["refused"]
        assert r["differs"] == "ok", r["differs"]
        assert r["incast warnings"] == 2, "every rank warns of the incast, flat and one-node alike"
        assert len(r["flat"]) == len(r["today"]) > 0
        for a, b in zip(r["flat"], r["today"]):
            assert torch.equal(a, b), "hierarchical_collectives=false must be the flat exchange, bit for bit"


# ------------------------------------------------------------------ qzero.fsdp, world 4


def _shard(mesh, dtype=torch.bfloat16):
    from test_fsdp import build
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = build()
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    for child in (model.up, model.mid, model.odd):
        fully_shard(child, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _grads(model, rank):
    from test_fsdp import batch

    model(batch(0, rank)).float().pow(2).mean().backward()
    return {n: p.grad.to_local().detach().clone() for n, p in model.named_parameters()}


def _reduce_comms(model):
    return [m._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm
            for m in model.modules() if hasattr(m, "_get_fsdp_state")]


def _reduce_types(model):
    return sorted({type(c).__name__ for c in _reduce_comms(model)})


def fsdp_worker(rank, world):
    from test_fsdp import GS, SMALL
    from test_fsdp_reduce import _record
    from torch.distributed.device_mesh import init_device_mesh

    from qzero.fsdp import quantize_group_gathers, quantize_group_reduces

    settings = dict(zero_quantized_gradients_group_size=GS, small_param_numel=SMALL, quant_kernels="reference")
    flat_mesh = init_device_mesh("cpu", (world,))
    out = {}
    # two-level on 2 x 2 pseudo-nodes: every module's first reduce-scatter recorded (fp32: the node
    # stage sums two values, exactly as any order would)
    model = _shard(flat_mesh, torch.float32)
    out["bad_node"] = attempt(lambda: quantize_group_reduces(model, **settings, ranks_per_node=3))
    out["gathers"] = attempt(lambda: quantize_group_gathers(model, group_size=GS, **TWO_BY_TWO))
    report = quantize_group_reduces(model, **settings, **TWO_BY_TWO)
    out["two_level"] = [c.two_level is not None for c in _reduce_comms(model)]
    logs = {}
    _record(model, logs)
    _grads(model, rank)
    out["logs"] = {name: entries[0] for name, entries in logs.items()}
    out["sent"] = (report.bytes_sent, sum(c.inner.bytes_sent for c in _reduce_comms(model)))
    # hierarchical_collectives=false: the flat exchange, bit for bit as without the settings
    flat = _shard(flat_mesh)
    flat_report = quantize_group_reduces(flat, **settings, **TWO_BY_TWO, hierarchical_collectives=False)
    out["flat_two_level"] = [c.two_level is not None for c in _reduce_comms(flat)]
    out["across"] = (report.bytes_across_nodes, flat_report.bytes_across_nodes, flat_report.bytes_sent)
    out["flat"] = _grads(flat, rank)
    today = _shard(flat_mesh)
    quantize_group_reduces(today, **settings)
    out["today"] = _grads(today, rank)
    bf16 = _shard(flat_mesh)  # bf16 node sums: the reduce dtype's rounding, then the rail's quantization
    quantize_group_reduces(bf16, **settings, **TWO_BY_TWO)
    out["bf16"] = _grads(bf16, rank)
    # HSDP: shard inside the (pseudo-)node, replicate across: the reduce-scatter stays inside it
    hsdp = _shard(init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    out["hsdp"] = attempt(lambda: quantize_group_reduces(hsdp, **settings, **TWO_BY_TWO))
    out["hsdp_two_level"] = [c.two_level is not None for c in _reduce_comms(hsdp)]
    dist.barrier()
    return out


def two_level_expected(inputs, dest, exact):
    """Rank ``dest``'s output on 2 x 2 nodes: each node's fp32 sum of its two ranks' parts, the
    other node's quantized (``exact``: the small parameters' indices, carried exactly), summed
    with this node's, averaged over 4."""
    from test_fsdp import GS

    from qzero.quant import reference

    m = inputs[0].numel() // 4
    node_sums = [inputs[2 * k][dest * m:(dest + 1) * m] + inputs[2 * k + 1][dest * m:(dest + 1) * m] for k in (0, 1)]
    mine = dest // 2
    other = node_sums[1 - mine]
    values, scales = reference.quantize(other, GS, "int8", exact)
    c = reference.dequantize(values, scales, m, GS, "int8", torch.float32)
    c[exact] = other[exact]
    return (node_sums[mine] + c) * 0.25


def _exact_index(names, world):
    from test_fsdp import SMALL, build
    from test_fsdp_reduce import _padded

    sizes, idx, offset = _padded(world), [], 0
    for name in names:
        if build().get_parameter(name).numel() <= SMALL:
            idx.append(torch.arange(offset, offset + sizes[name][0]))
        offset += sizes[name][0]
    return torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long)


def test_fsdp_group_reduces_on_pseudo_nodes():
    from test_fsdp_group import GROUPS
    from test_fsdp_reduce import expected_output

    results = run_distributed(fsdp_worker, 4, timeout=300)
    for rank, r in enumerate(results):
        assert "ranks_per_node=3 does not divide the world size 4" in (r["bad_node"] or ""), r["bad_node"]
        assert r["gathers"] is None, r["gathers"]  # the all-gather crosses each node boundary once: accepted
        assert r["two_level"] and all(r["two_level"])
        assert r["sent"][0] == r["sent"][1], "the report's bytes are what one backward sent"
        differs = False
        for module, (x, got, kind, _) in r["logs"].items():
            assert kind == "AVG"
            inputs = [results[s]["logs"][module][0] for s in range(4)]
            want = two_level_expected(inputs, rank, _exact_index(GROUPS[module], 4))
            assert torch.equal(got, want), (module, float((got - want).abs().max()))
            flat, _ = expected_output(inputs, rank, 4, GROUPS[module], "AVG", None)
            differs |= not torch.equal(got, flat)
        assert differs, "the two-level result is the flat exchange's: the two stages did not run"
        two, flat, flat_sent = r["across"]  # across nodes: the rail's one part a node, not the other node's two
        assert 0 < flat_sent and 0.4 * flat < two < 0.6 * flat, r["across"]
        assert not any(r["flat_two_level"]) and r["flat"].keys() == r["today"].keys()
        for name in r["flat"]:
            assert torch.equal(r["flat"][name], r["today"][name]), name
            a, b = r["bf16"][name].float(), r["today"][name].float()
            if b.numel():
                assert float((a - b).norm()) <= 2e-2 * float(b.norm()) + 1e-6, name
        assert r["hsdp"] is None and r["hsdp_two_level"] and not any(r["hsdp_two_level"]), r["hsdp"]
