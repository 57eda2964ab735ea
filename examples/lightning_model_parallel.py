"""Lightning's ModelParallelStrategy (FSDP2) with qzero's quantized weight gather.

    python examples/lightning_model_parallel.py                 # 2 processes, CPU (gloo) or 2 GPUs
    python examples/lightning_model_parallel.py --no-quant      # plain FSDP2, to compare
    python examples/lightning_model_parallel.py --per-group     # one quantized gather per FSDP module

Lightning leaves the parallelism to ``LightningModule.configure_model``, so qzero goes there:
``quantize_weight_gathers(model, mesh=dp_mesh)`` on the fp32 model before ``fully_shard``, or
``quantize_group_gathers(model)`` after it. The mesh is the strategy's data-parallel
sub-mesh (``self.device_mesh["data_parallel"]``), the one ``fully_shard`` gets; with
``tensor_parallel_size > 1`` the TP-sharded (DTensor) parameters keep FSDP2's own gather
(docs/lightning.md). The model is a tiny Qwen3 built from a config (nothing downloaded); the
text is this Python's standard-library sources, as bytes.
"""

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader

from qzero.fsdp import gather_report, quantize_group_gathers, quantize_weight_gathers
from qzero.app.workload import PRESETS, build_model, global_batch, load_corpus, model_config

PRESET = "tiny"
SEQ, MICRO_BATCH, LR = 64, 4, 3e-3
SMALL = PRESETS[PRESET].small_param_numel


class TinyLM(L.LightningModule):
    def __init__(self, quantize: str | None = "parameter"):
        super().__init__()
        self.quantize = quantize  # None, "parameter" (before fully_shard) or "group" (after it)
        self.model = build_model(model_config(PRESET), torch.float32, torch.device("cpu"), seed=0)  # fp32 masters
        self.losses: list[float] = []
        self.report = None

    def configure_model(self):
        dp_mesh = self.device_mesh["data_parallel"]
        if self.quantize == "parameter":  # the qzero line, before fully_shard, on the data-parallel mesh
            quantize_weight_gathers(self.model, group_size=64, small_param_numel=SMALL, mesh=dp_mesh)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=True)
        fully_shard(self.model, mesh=dp_mesh, mp_policy=policy)
        if self.quantize == "group":  # or this one, after fully_shard
            self.report = quantize_group_gathers(self.model, group_size=64, small_param_numel=SMALL)

    def training_step(self, tokens, batch_idx):
        logits = self.model(input_ids=tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        return loss

    def on_train_end(self):
        if self.quantize == "parameter":
            self.report = gather_report(self.model)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)


def train(*, quantize: str | None = "parameter", steps: int = 10, devices: int = 2, corpus=None) -> TinyLM:
    """Train ``steps`` steps; the module, with its per-step (rank-local) losses and report."""
    corpus = load_corpus(limit=1_000_000) if corpus is None else corpus
    data = global_batch(corpus, 0, MICRO_BATCH * devices * steps, SEQ, seed=0)  # DistributedSampler splits it
    module = TinyLM(quantize)
    trainer = L.Trainer(
        accelerator="auto", devices=devices, max_steps=steps,
        strategy=ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(data, batch_size=MICRO_BATCH))
    return module


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quant", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--per-group", action="store_true", help="quantize_group_gathers after fully_shard")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    quantize = None if not args.quant else "group" if args.per_group else "parameter"
    module = train(quantize=quantize, steps=args.steps, devices=args.devices)
    if module.global_rank == 0:
        for step, loss in enumerate(module.losses):
            print(f"step {step:3d}  loss {loss:.4f}")
        if module.report is not None:
            print(module.report.summary())


if __name__ == "__main__":
    main()
