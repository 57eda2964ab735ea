"""qzero's profiler labels ([Note: profiler labels] in qzero/wire/labels.py): a step of every way
in, on two gloo ranks under ``torch.profiler.profile()``, shows each label in its trace."""

from __future__ import annotations

import functools

import torch

from _support.distributed import run_distributed


def _names(prof) -> set[str]:
    return {e.name for e in prof.events()}


def _zero_worker(rank, world):
    import qzero
    from torch.profiler import profile

    seen = {}
    for ahead in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.LayerNorm(128),
                                    torch.nn.Linear(128, 16)).bfloat16()
        opt = qzero.ZeroOptimizer(model, functools.partial(torch.optim.AdamW, lr=1e-2),
                                  config=qzero.ZeroConfig(zero_quantized_weights=True, stage=2,
                                                          overlap_param_gather=ahead,
                                                          allgather_bucket_size=world * 64 * 16))
        # two steps: the first updates the master shard whole, the second sliced
        with profile() as prof:
            for step in range(2):
                x = torch.randn(4, 64, generator=torch.Generator().manual_seed(10 * step + rank)).bfloat16()
                opt.backward(model(x).float().square().mean())
                opt.step()
                opt.zero_grad()
            opt.wait_for_weights()
        seen[ahead] = _names(prof)
        opt.close()
    return seen


def _fsdp_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.profiler import profile

    from qzero.fsdp import quantize_group_gathers, quantize_group_reduces, quantize_weight_gathers

    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    seen = {}
    for way in ("per parameter", "per group"):
        torch.manual_seed(0)
        # 128 x 640 weights: more than the default small_param_numel, so they travel quantized
        model = torch.nn.Sequential(torch.nn.Linear(640, 128), torch.nn.ReLU(), torch.nn.Linear(128, 640))
        if way == "per parameter":
            quantize_weight_gathers(model)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        if way == "per group":
            quantize_group_gathers(model)
            quantize_group_reduces(model)
        with profile() as prof:
            x = torch.randn(2, 640, generator=torch.Generator().manual_seed(rank))
            model(x).float().square().mean().backward()
        seen[way] = _names(prof)
    return seen


def test_zero_optimizer_step_shows_every_label():
    from qzero.wire.labels import LABELS

    for seen in run_distributed(_zero_worker, 2):
        for ahead in (False, True):
            missing = [name for name in LABELS if name not in seen[ahead]]
            assert not missing, f"gather-ahead {ahead}: labels missing from the trace: {missing}"


def test_fsdp2_paths_show_their_labels():
    from qzero.wire.labels import ALL_GATHER, GATHER, PACK, REDUCE_GRADIENTS, UNPACK

    for seen in run_distributed(_fsdp_worker, 2):
        # FSDP2 runs the all-gather of the per-parameter path itself (FSDP::all_gather)
        assert {PACK, UNPACK} <= seen["per parameter"], seen["per parameter"]
        assert {GATHER, PACK, ALL_GATHER, UNPACK, REDUCE_GRADIENTS} <= seen["per group"], seen["per group"]
