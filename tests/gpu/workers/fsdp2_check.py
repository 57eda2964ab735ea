"""GPU check of qzero.fsdp: FSDP2's quantized weight gathers on NCCL, against the reference.

    torchrun --nproc_per_node=2 tests/gpu/workers/fsdp2_check.py [--out DIR]

For both modes (``parameter``: :func:`qzero.fsdp.quantize_weight_gathers`; ``group``:
:func:`qzero.fsdp.quantize_group_gathers`), both reshard modes and both compute dtypes
(bf16, fp16), a small Qwen3-shaped model (tied embedding, as the benchmarked presets) is
sharded with the quantized gather and trained two steps. The weights each rank computes
with in the second forward (captured by forward pre-hooks, so the re-gather path is the
one checked) must equal, bit for bit, the torch reference quantizer applied on the CPU to
that step's fp32 masters, on every rank:

* parameter: each parameter's fp32 master shard quantized on its own (small parameters:
  the master rounded to the compute dtype);
* group: per ``fully_shard`` module, each rank's padded shards of its parameters, rounded
  to the compute dtype and laid back to back (FSDP2's all-gather input), quantized in
  groups from the start of that input, small parameters exact.

This checks the Triton kernels and the NCCL path together (and, in group mode, that every
gather went through the engine). The ``reduce`` cases check
:func:`qzero.fsdp.quantize_group_reduces` (both reshard modes, fp32 and bf16 reduce dtype):
every rank's reduce-scatter output of every ``fully_shard`` module, after one backward,
bitwise the reference quantizer applied on the CPU to all ranks' recorded inputs. Prints one
PASS/FAIL line per case; exit status 1 on any failure. ``--out`` gets ``fsdp2_check.json``.
"""

from __future__ import annotations

import argparse
import itertools
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


def expected_group(masters: dict, names: list, world: int, dtype, small: int, group_size: int, fmt: str) -> dict:
    """What every rank computes with when the parameters ``names`` (one FSDP module's, in
    order) are gathered by quantize_group_gathers, from their fp32 masters."""
    rows = {n: -(-masters[n].shape[0] // world) for n in names}
    parts = {n: [] for n in names}
    for r in range(world):
        pieces, exact, offset = [], [], 0
        for n in names:
            w = masters[n].cpu().to(dtype)
            padded = torch.zeros((rows[n], *w.shape[1:]), dtype=dtype)
            mine = w[r * rows[n] : (r + 1) * rows[n]]
            padded[: mine.shape[0]] = mine
            flat = padded.reshape(-1)
            if w.numel() <= small:
                exact.append(torch.arange(offset, offset + flat.numel()))
            pieces.append(flat)
            offset += flat.numel()
        x = torch.cat(pieces)
        idx = torch.cat(exact) if exact else None
        values, scales = reference.quantize(x, group_size, fmt, idx)
        y = reference.dequantize(values, scales, x.numel(), group_size, fmt, dtype)
        if idx is not None:
            y[idx] = x[idx]
        offset = 0
        for n, flat in zip(names, pieces):
            seg = y[offset : offset + flat.numel()].view(rows[n], *masters[n].shape[1:])
            parts[n].append(seg[: max(0, min(rows[n], masters[n].shape[0] - r * rows[n]))])
            offset += flat.numel()
    return {n: torch.cat(parts[n]) for n in names}


def fsdp_module_params(model) -> dict:
    """Each fully_shard module's own parameters (those of no sharded submodule), in order."""
    from torch.distributed.fsdp import FSDPModule

    sharded = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    out = {n: [] for n in sharded}
    for pname, _ in model.named_parameters():
        owner = max((n for n in sharded if n == "" or pname.startswith(n + ".")), key=len)
        out[owner].append(pname)
    return out



def build_model(device):
    """The check's model: a small Qwen3 (fp32 masters, random init, the same on every rank)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=1024, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def run_case(mode: str, reshard: bool, dtype, device, world: int) -> tuple[bool, str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from qzero.fsdp import gather_report, quantize_group_gathers, quantize_weight_gathers

    model = build_model(device)
    small = 4096
    if mode == "parameter":
        quantize_weight_gathers(model, small_param_numel=small)
        quantized = set(gather_report(model).quantized)
    mesh = init_device_mesh(device.type, (world,))
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    if mode == "group":
        report = quantize_group_gathers(model, small_param_numel=small)
        quantized = {n for n, p in model.named_parameters() if p.numel() > small}
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
    if mode == "group":
        want = {}
        for names in fsdp_module_params(model).values():
            want.update(expected_group(masters, names, world, dtype, small, 64, "int8"))
    else:
        want = {name: expected(full, world, name in quantized, dtype, 64, "int8") for name, full in masters.items()}
    bad = [name for name in masters if name in seen and not torch.equal(seen[name].cpu(), want[name])]
    checked = sum(name in seen for name in masters)
    detail = f"{len(quantized)} quantized, {len(masters) - len(quantized)} exact; {checked} checked"
    if mode == "group":
        calls = [m._get_fsdp_state()._fsdp_param_group._all_gather_comm.calls
                 for m in model.modules() if hasattr(m, "_get_fsdp_state")]
        plain_calls = sum(c["plain"] for c in calls)
        if plain_calls or not all(c["quantized"] for c in calls):
            bad.append(f"gathers not through the engine: {calls}")
        detail += f"; {report.bytes_sent / report.plain_bytes:.3f} of the plain bytes"
    detail += f"; mismatches here: {bad[:4]}"
    ok = torch.tensor([0 if bad or not checked else 1], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item()), detail


def expected_reduce(inputs: list, dest: int, names: list, sizes: dict, small: int, kind: str, factor,
                    group_size: int, fmt: str) -> torch.Tensor:
    """Rank ``dest``'s quantized reduce-scatter output from every rank's input (CPU, reference):
    the fp32 sum in rank order of its own part and the others' parts quantized and back
    (small parameters exact), then the op."""
    world = len(inputs)
    n = inputs[0].numel() // world
    exact, offset = [], 0
    for name in names:
        numel, full = sizes[name]
        if full <= small:
            exact.append(torch.arange(offset, offset + numel))
        offset += numel
    idx = torch.cat(exact) if exact else None
    total = torch.zeros(n, dtype=torch.float32)
    for s, x in enumerate(inputs):
        x = x[dest * n : (dest + 1) * n].clone()
        if kind == "PREMUL_SUM":
            x.mul_(factor)
        if s == dest:
            c = x.to(torch.float32)
        else:
            values, scales = reference.quantize(x, group_size, fmt, idx)
            c = reference.dequantize(values, scales, n, group_size, fmt, torch.float32)
            if idx is not None:
                c[idx] = x[idx].to(torch.float32)
        total += c
    if kind == "AVG":
        total.mul_(1.0 / world)
    return total.to(inputs[0].dtype)


def run_reduce_case(reshard: bool, reduce_dtype, device, world: int) -> tuple[bool, str]:
    """quantize_group_reduces: every rank's reduce-scatter output of every group, bitwise the
    reference applied to all ranks' recorded inputs (kernels 'auto': Triton on CUDA)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    from qzero.fsdp import quantize_group_reduces

    class Recorder(ReduceScatter):
        def __init__(self, inner, log):
            self.inner, self.log = inner, log

        def allocate(self, size, *, dtype, device):
            return self.inner.allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            x = input_tensor.clone()
            self.inner(output_tensor, input_tensor, group, op, async_op)
            kind = getattr(op, "op", op)
            self.log.append((x, output_tensor.clone(), str(kind).split(".")[-1], getattr(op, "factor", None)))

    model = build_model(device)
    small = 4096
    mesh = init_device_mesh(device.type, (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    report = quantize_group_reduces(model, small_param_numel=small)
    sizes = {n: (-(-p.shape[0] // world) * (p.numel() // p.shape[0]), p.numel()) for n, p in model.named_parameters()}
    logs = {}
    for name, m in model.named_modules():
        if hasattr(m, "_get_fsdp_state"):
            pg = m._get_fsdp_state()._fsdp_param_group
            logs[name] = []
            pg._reduce_scatter_comm = Recorder(pg._reduce_scatter_comm, logs[name])
    g = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, 1024, (2, 64), generator=g).to(device)
    model(input_ids=ids).logits.float().pow(2).mean().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    bad, checked = [], 0
    for module, names in fsdp_module_params(model).items():
        if not logs.get(module):
            bad.append(f"{module or '<root>'}: not reduced")
            continue
        x, got, kind, factor = logs[module][0]
        inputs = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(inputs, x)
        want = expected_reduce([t.cpu() for t in inputs], dist.get_rank(), names, sizes, small, kind, factor, 64,
                               "int8")
        checked += 1
        if not torch.equal(got.cpu(), want):
            bad.append(module or "<root>")
    detail = (f"{checked} groups checked; {report.bytes_sent / report.plain_bytes:.3f} of the plain bytes; "
              f"mismatches here: {bad[:4]}")
    ok = torch.tensor([0 if bad or not checked else 1], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
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
    cases = itertools.product(("parameter", "group"), (True, False), (torch.bfloat16, torch.float16))
    for mode, reshard, dtype in cases:
        ok, detail = run_case(mode, reshard, dtype, device, world)
        failed |= not ok
        case = f"{mode} reshard_after_forward={reshard} {str(dtype).removeprefix('torch.')}"
        results.append({"case": case, "ok": ok, "detail": detail})
        if dist.get_rank() == 0:
            print(f"{'PASS' if ok else 'FAIL'} {case}: {detail}", flush=True)
    for reshard, reduce_dtype in itertools.product((True, False), (torch.float32, torch.bfloat16)):
        ok, detail = run_reduce_case(reshard, reduce_dtype, device, world)
        failed |= not ok
        case = f"reduce reshard_after_forward={reshard} reduce_dtype={str(reduce_dtype).removeprefix('torch.')}"
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
