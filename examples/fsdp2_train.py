"""Train a small Qwen3-shaped model with PyTorch FSDP2 and qzero's quantized weight gather.

    torchrun --nproc_per_node=2 examples/fsdp2_train.py             # CPU (gloo) or one GPU per rank (NCCL)
    torchrun --nproc_per_node=2 examples/fsdp2_train.py --no-quant  # plain FSDP2, for comparison
    torchrun --nproc_per_node=2 examples/fsdp2_train.py --reshard-after-forward
    torchrun --nproc_per_node=2 examples/fsdp2_train.py --per-group   # one quantized gather per FSDP module

The only qzero line is ``quantize_weight_gathers(model)`` before ``fully_shard``: FSDP2 then
all-gathers every large weight as INT8 with one fp32 scale per 64 elements of each rank's
fp32 shard, and computes in bf16 with bit-identical weights on every rank. With
``--per-group`` the line is ``quantize_group_gathers(model)`` after ``fully_shard`` instead:
each FSDP module's whole all-gather buffer (the bf16 copies FSDP2 makes) goes through qzero's
gather engine at once, with less host time per step than one hook per parameter. The model is
built from a ``transformers`` config (random init, nothing downloaded); the text is this
Python's standard library sources, as bytes.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM, Qwen3Config

from qzero.fsdp import gather_report, quantize_group_gathers, quantize_weight_gathers
from qzero.app.workload import global_batch, load_corpus


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quant", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--reshard-after-forward", action="store_true")
    parser.add_argument("--per-group", action="store_true", help="quantize_group_gathers after fully_shard")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    config = Qwen3Config(vocab_size=256, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=32, tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # fp32 masters

    if args.quant and not args.per_group:  # the one added line (the small threshold suits this small model)
        model = quantize_weight_gathers(model, group_size=64, fmt="int8", small_param_numel=4096)
        if rank == 0:
            print(gather_report(model).summary())

    mesh = init_device_mesh(device.type, (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=args.reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=args.reshard_after_forward)
    if args.quant and args.per_group:  # or this one, after fully_shard
        report = quantize_group_gathers(model, group_size=64, fmt="int8", small_param_numel=4096)
        if rank == 0:
            print(report.summary())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    corpus = load_corpus(limit=1_000_000)
    start = time.perf_counter()
    for step in range(args.steps):
        tokens = global_batch(corpus, step, 4 * world, args.seq, seed=0).view(world, 4, -1)[rank].to(device)
        logits = model(input_ids=tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 5 == 0 or step == args.steps - 1:
            loss = loss.detach()
            dist.all_reduce(loss)
            if rank == 0:
                print(f"step {step:3d}  loss {loss.item() / world:.4f}  ({time.perf_counter() - start:.1f} s)",
                      flush=True)
    if rank == 0:
        mode = ("INT8 g64 per FSDP module" if args.per_group else "INT8 g64") if args.quant else "plain"
        print(f"{args.steps} steps, {mode} gather: {time.perf_counter() - start:.1f} s")
    dist.barrier()  # every rank done before any leaves: a rank that exits first can abort another's exit
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
