"""GPU check of qzero.fsdp: FSDP2's quantized weight gather on NCCL, against the reference.

    torchrun --nproc_per_node=2 bench/fsdp2_check.py [--out DIR]

For both reshard modes and both compute dtypes (bf16, fp16), a small Qwen3-shaped model
(tied embedding, as the benchmarked presets) is sharded with the quantized gather and
trained two steps. The weights each rank computes with in the second forward (captured
by forward pre-hooks, so the in-place re-gather path is the one checked) must equal,
bit for bit, the torch reference quantizer applied on the CPU to that step's fp32 master
shards (small parameters: the master rounded to the compute dtype), on every rank. This
checks the Triton kernels (pack from fp32, unpack) and the NCCL path together. Prints one
PASS/FAIL line per case; exit status 1 on any failure. ``--out`` gets ``fsdp2_check.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from qzero.quant import reference


def expected(full: torch.Tensor, world: int, quantized: bool, dtype, group_size: int, fmt: str) -> torch.Tensor:
    full = full.cpu()
    if not quantized:
        return full.to(dtype)
    parts = []
    for piece in full.chunk(world, dim=0):
        flat = piece.reshape(-1)
        values, scales = reference.quantize(flat, group_size, fmt)
        parts.append(reference.dequantize(values, scales, flat.numel(), group_size, fmt, dtype))
    return torch.cat(parts).view(full.shape)


def run_case(reshard: bool, dtype, device, world: int) -> tuple[bool, str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM, Qwen3Config

    from qzero.fsdp import gather_report, quantize_weight_gathers

    config = Qwen3Config(vocab_size=1024, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    quantize_weight_gathers(model, small_param_numel=4096)
    quantized = set(gather_report(model).quantized)
    mesh = init_device_mesh(device.type, (world,))
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen = {}

    def capture(module, args, prefix):
        for k, p in module.named_parameters(recurse=False):
            seen[prefix + k] = p.detach().clone()

    names = {id(m): n for n, m in model.named_modules()}
    for m in model.modules():
        if any(True for _ in m.parameters(recurse=False)):
            m.register_forward_pre_hook(lambda mod, args, prefix=names[id(m)] + ".": capture(mod, args, prefix))
    g = torch.Generator().manual_seed(dist.get_rank())
    for step in range(2):
        if step == 1:
            masters = {k: p.full_tensor() for k, p in model.named_parameters()}
            seen.clear()
        ids = torch.randint(0, 1024, (2, 64), generator=g).to(device)
        model(input_ids=ids).logits.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    bad = []
    for name, full in masters.items():
        if name not in seen:
            continue
        want = expected(full, world, name in quantized, dtype, 64, "int8")
        if not torch.equal(seen[name].cpu(), want):
            bad.append(name)
    ok = torch.tensor([0 if bad else 1], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    detail = f"{len(quantized)} quantized, {len(masters) - len(quantized)} plain; mismatches here: {bad[:4]}"
    return bool(ok.item()), detail


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available()  # without CUDA: gloo on the CPU (the reference path), for a dry run
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    results, failed = [], False
    for reshard in (True, False):
        for dtype in (torch.bfloat16, torch.float16):
            ok, detail = run_case(reshard, dtype, device, world)
            failed |= not ok
            case = f"reshard_after_forward={reshard} {str(dtype).removeprefix('torch.')}"
            results.append({"case": case, "ok": ok, "detail": detail})
            if dist.get_rank() == 0:
                print(f"{'PASS' if ok else 'FAIL'} {case}: {detail}", flush=True)
    if dist.get_rank() == 0 and args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fsdp2_check.json"), "w") as f:
            json.dump({"world_size": world, "torch": torch.__version__, "results": results}, f, indent=1)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
