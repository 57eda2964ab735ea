"""torchtitan's parallelize hook with qzero's quantized weight gather.

    torchrun --nproc_per_node=2 examples/torchtitan_parallelize.py              # CPU (gloo) or GPUs
    torchrun --nproc_per_node=2 examples/torchtitan_parallelize.py --no-quant   # plain, to compare
    torchrun --nproc_per_node=2 examples/torchtitan_parallelize.py --per-group

torchtitan applies every parallelism in its model spec's ``parallelize_fn``; qzero wraps that
function (:func:`with_quantized_gathers`): ``quantize_weight_gathers`` on the (meta-device,
fp32) model before it, with the data-parallel mesh torchtitan gives ``fully_shard``
(``parallel_dims.get_mesh("fsdp")``), or ``quantize_group_gathers`` after it. In torchtitan's
own trainer (which needs CUDA) the wrapped function goes into the model spec::

    spec = dataclasses.replace(spec, parallelize_fn=with_quantized_gathers(spec.parallelize_fn))

The per-parameter mode needs ``parallelism.spmd_backend = "partial_dtensor"`` (DTensor for the
model-parallel axes only): the other backends make every parameter a DTensor on the full SPMD
mesh before ``fully_shard``, which replaces qzero's wrappers (qzero then refuses the forward);
see docs/torchtitan.md. This script calls the wrapped ``parallelize_llama`` itself and trains a
tiny Llama-3 for a few steps (SDPA attention: torchtitan's FlexAttention has no CPU backward),
on this Python's standard-library sources as bytes.
"""

import argparse
import functools
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from qzero.fsdp import gather_report, quantize_group_gathers, quantize_weight_gathers
from qzero.app.workload import BYTE_VOCAB, global_batch, load_corpus

SEQ, MICRO_BATCH, LR, SMALL = 64, 4, 3e-3, 1024  # SMALL: this tiny model's matrices are quantized


def with_quantized_gathers(parallelize_fn, mode: str = "parameter", **qzero_kwargs):
    """``parallelize_fn`` (torchtitan's hook) with qzero's quantized gather: ``mode`` is
    ``"parameter"`` (before it) or ``"group"`` (after it)."""

    @functools.wraps(parallelize_fn)
    def parallelize(model, *, parallel_dims, **kwargs):
        if mode == "parameter":
            names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
            quantize_weight_gathers(model, mesh=parallel_dims.get_mesh(names), **qzero_kwargs)
        model = parallelize_fn(model, parallel_dims=parallel_dims, **kwargs)
        if mode == "group":
            quantize_group_gathers(model, **qzero_kwargs)
        return model

    return parallelize


def tiny_llama3_config(dim: int = 64, layers: int = 2, heads: int = 4):
    """A tiny Llama-3 of torchtitan's own building blocks, SDPA attention."""
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention

    config = llama3.Llama3Model.Config(
        dim=dim,
        vocab_size=BYTE_VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=BYTE_VOCAB, embedding_dim=dim,
                                        param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=BYTE_VOCAB, param_init=llama3._output_linear_init(dim)),
        layers=llama3._build_llama3_layers(
            fuse_qkv=True, n_layers=layers, dim=dim, n_heads=heads, hidden_dim=3 * dim, attn_backend="flex",
            rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=4 * SEQ, theta=10000, scaling="none"),
        ),
    )
    for layer in config.layers:  # as torchtitan's own tests do for SDPA
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def train(*, quantize: str | None = "parameter", steps: int = 10, device_type: str = "cpu", corpus=None) -> dict:
    """Build on meta, parallelize through the (wrapped) hook, initialise, train ``steps`` steps."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims, parallel_dims as parallel_dims_module
    from torchtitan.models.llama3 import parallelize_llama

    world, rank = dist.get_world_size(), dist.get_rank()
    parallel_dims_module.device_type = device_type  # torchtitan picks its mesh device once, at import
    parallel_dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1, world_size=world,
                                 spmd_backend="partial_dtensor")
    parallel_dims.build_mesh()
    with torch.device("meta"):
        model = tiny_llama3_config().build()
    parallelize = parallelize_llama if quantize is None else with_quantized_gathers(
        parallelize_llama, quantize, group_size=64, small_param_numel=SMALL)
    model = parallelize(model, parallel_dims=parallel_dims, training=TrainingConfig(),
                        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"), compile_config=CompileConfig(),
                        ac_config=None, dump_folder="")
    if device_type == "cpu":  # gloo has no PREMUL_SUM, which torchtitan's gradient scaling asks FSDP2 for
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device=device_type)
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    corpus = load_corpus(limit=1_000_000) if corpus is None else corpus
    losses = []
    for step in range(steps):
        tokens = global_batch(corpus, step, MICRO_BATCH * world, SEQ, seed=0).view(world, MICRO_BATCH, -1)[rank]
        tokens = tokens.to(device_type)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "model": model, "report": gather_report(model) if quantize == "parameter" else None}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quant", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--per-group", action="store_true", help="quantize_group_gathers after parallelize_fn")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    quantize = None if not args.quant else "group" if args.per_group else "parameter"
    out = train(quantize=quantize, steps=args.steps, device_type="cuda" if cuda else "cpu")
    if dist.get_rank() == 0:
        for step, loss in enumerate(out["losses"]):
            print(f"step {step:3d}  loss {loss:.4f}")
        if out["report"] is not None:
            print(out["report"].summary())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
