"""Accelerate with FSDP2 and qzero's quantized weight gather.

    accelerate launch --num_processes 2 examples/accelerate_fsdp2.py             # one GPU per rank
    accelerate launch --num_processes 2 examples/accelerate_fsdp2.py --no-quant  # plain, to compare
    accelerate launch --num_processes 2 examples/accelerate_fsdp2.py --cpu-ram-efficient-loading
    torchrun --nproc_per_node=2 examples/accelerate_fsdp2.py --cpu-fsdp2      # CPU, see below

The script gives Accelerate its FSDP2 plugin itself, so no ``accelerate config`` is needed.
The one qzero line is ``quantize_weight_gathers(model)`` on the fp32 model *before*
``accelerator.prepare`` (which is where Accelerate calls ``fully_shard``): every large
weight is then all-gathered as INT8 with one fp32 scale per 64 elements. Accelerate's
default device mesh is all ranks, the data-parallel mesh qzero assumes; with a
``ParallelismConfig`` pass ``mesh=`` the FSDP sub-mesh (docs/accelerate.md). The model is
a tiny Qwen3 built from a config (nothing downloaded); the text is this Python's
standard-library sources, as bytes. On a machine without GPUs Accelerate does not choose
FSDP; ``--cpu-fsdp2`` reaches the same FSDP2 path there by setting Accelerate's state by
hand (``fsdp2_accelerator``), which is how this script is tested on CPU.
"""

import argparse

import torch
import torch.nn.functional as F
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from torch.distributed.fsdp import MixedPrecisionPolicy

from qzero.fsdp import gather_report, quantize_weight_gathers
from qzero.app.workload import PRESETS, build_model, global_batch, load_corpus, model_config

PRESET = "tiny"
SEQ, MICRO_BATCH, LR = 64, 4, 3e-3


def fsdp2_plugin(cpu_ram_efficient_loading: bool = False) -> FullyShardedDataParallelPlugin:
    return FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Qwen3DecoderLayer"],
        reshard_after_forward=True,
        mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        cpu_ram_efficient_loading=cpu_ram_efficient_loading,
    )


def fsdp2_accelerator(cpu_ram_efficient_loading: bool = False, cpu_by_hand: bool = False) -> Accelerator:
    """An Accelerator with the FSDP2 plugin. ``cpu_by_hand``: on CPU, where Accelerate never
    chooses FSDP, set its state to FSDP2 by hand (what it sets itself on GPUs). A fresh
    state each call: Accelerate's FSDP2 ``prepare`` of a second model in one Accelerator
    hands back the first."""
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType

    AcceleratorState._reset_state()
    GradientState._reset_state()
    plugin = fsdp2_plugin(cpu_ram_efficient_loading)
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=cpu_by_hand)
    if cpu_by_hand:
        # On the shared state, which every AcceleratorState() (prepare() makes some) copies from:
        # set on accelerator.state alone, prepare() reverts it to MULTI_CPU and save_state fails.
        PartialState().distributed_type = DistributedType.FSDP
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
    return accelerator


def train(accelerator: Accelerator, *, quantize: bool = True, steps: int = 10, corpus=None) -> dict:
    """Train ``steps`` steps; the per-step losses (averaged over ranks), the prepared model
    and, when quantized, its gather report."""
    model = build_model(model_config(PRESET), torch.float32, accelerator.device, seed=0)  # fp32 masters
    if quantize:  # the qzero line: before prepare, which calls fully_shard
        quantize_weight_gathers(model, group_size=64, small_param_numel=PRESETS[PRESET].small_param_numel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)

    corpus = load_corpus(limit=1_000_000) if corpus is None else corpus
    world, rank = accelerator.num_processes, accelerator.process_index
    losses = []
    for step in range(steps):
        tokens = global_batch(corpus, step, MICRO_BATCH * world, SEQ, seed=0).view(world, MICRO_BATCH, -1)[rank]
        tokens = tokens.to(accelerator.device)
        logits = model(input_ids=tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
    return {"losses": losses, "model": model, "report": gather_report(model) if quantize else None}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quant", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--cpu-ram-efficient-loading", action="store_true")
    parser.add_argument("--cpu-fsdp2", action="store_true", help="CPU: set Accelerate's state to FSDP2 by hand")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    accelerator = fsdp2_accelerator(args.cpu_ram_efficient_loading, cpu_by_hand=args.cpu_fsdp2)
    if not accelerator.is_fsdp2:
        raise SystemExit("Accelerate did not choose FSDP2 here (it needs GPUs); try --cpu-fsdp2")
    out = train(accelerator, quantize=args.quant, steps=args.steps)
    if accelerator.is_main_process:
        for step, loss in enumerate(out["losses"]):
            print(f"step {step:3d}  loss {loss:.4f}")
        if out["report"] is not None:
            print(out["report"].summary())


if __name__ == "__main__":
    main()
