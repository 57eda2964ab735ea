"""Does FSDP2's group gather (qzero.fsdp.quantize_group_gathers) synchronize the host? (one GPU)

Rank 0 of a fake DP2 world (``bench/one_gpu.py``), six bf16 MLP blocks under ``fully_shard``
with ``reshard_after_forward=True``, plain FSDP2 and then with the group gather: after three
warm-up steps one forward and backward run under ``torch.cuda.set_sync_debug_mode("error")``,
so the first synchronizing CUDA call raises and its stack is printed; then the host's time to
enqueue a step and the step's wall time, over 10 steps. A gather that synchronizes the host
on every call makes FSDP2's prefetch wait for the link each time.

Usage (repository root, one GPU): ``PYTHONPATH=src python3 bench/fsdp2_group_sync_check.py``
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def build(group: bool) -> torch.nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    layers = [torch.nn.Sequential(torch.nn.Linear(2048, 8192), torch.nn.GELU(), torch.nn.Linear(8192, 2048),
                                  torch.nn.LayerNorm(2048)) for _ in range(6)]
    model = torch.nn.Sequential(*layers).cuda()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mp_policy=mp, reshard_after_forward=True)
    if group:
        from qzero.fsdp import quantize_group_gathers

        quantize_group_gathers(model)
    return model


def check(group: bool) -> bool:
    """True when one forward and backward made no synchronizing CUDA call."""
    model = build(group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randn(4096, 2048, device="cuda")

    def step():
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    clean = True
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(x).float().pow(2).mean().backward()
        print(f"group={group}: no synchronizing call in forward+backward")
    except RuntimeError as e:
        clean = False
        print(f"group={group}: SYNC in forward/backward: {e}")
        traceback.print_exc(limit=40)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    opt.zero_grad()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        step()
    host = (time.perf_counter() - t) / 10
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / 10
    print(f"group={group}: host {host * 1e3:.1f} ms/step to enqueue, wall {wall * 1e3:.1f} ms/step")
    return clean


def main() -> int:
    from one_gpu import init_fake_world

    init_fake_world(2)
    torch.manual_seed(0)
    return 0 if all([check(False), check(True)]) else 1


if __name__ == "__main__":
    sys.exit(main())
