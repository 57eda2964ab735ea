"""The HF Trainer with DeepSpeed ZeRO-1/2 and qzero's quantized post-step weight gather.

    torchrun --nproc_per_node=2 examples/deepspeed_hf_trainer.py              # GPUs (NCCL)
    torchrun --nproc_per_node=2 examples/deepspeed_hf_trainer.py --cpu        # CPU (gloo)
    torchrun --nproc_per_node=2 examples/deepspeed_hf_trainer.py --cpu --zero1-fp32-accum
    torchrun --nproc_per_node=2 examples/deepspeed_hf_trainer.py --cpu --no-quant   # plain, to compare

The Trainer builds the DeepSpeed engine itself, so instead of swapping ``initialize``
the DeepSpeed config gets ``zero_quantized_weights: true`` and the Trainer gets
``QZeroCallback`` (qzero's other settings are its arguments: DeepSpeed's config refuses keys it
does not know). ``--zero1-fp32-accum`` is ZeRO stage 1 with ``data_types.grad_accum_dtype:
"fp32"``, for which DeepSpeed builds its BF16_Optimizer; the callback handles both. The model
is a tiny Qwen3 built from a config (nothing downloaded); the text is this Python's
standard-library sources, as bytes.
"""

import argparse
import tempfile

import torch
from transformers import Trainer, TrainingArguments

from qzero.integrations.hf import QZeroCallback
from qzero.app.workload import PRESETS, build_model, global_batch, load_corpus, model_config

PRESET = "tiny"
SEQ, MICRO_BATCH = 64, 4


def ds_config(quantize: bool = True, zero1_fp32_accum: bool = False) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "bf16": {"enabled": "auto"},
        "gradient_clipping": "auto",
        "steps_per_print": 10**9,
        # the one key a DeepSpeed user adds (the bucket makes several chunks on this tiny model)
        "zero_optimization": {"stage": 2, "allgather_bucket_size": 50_000, "zero_quantized_weights": quantize},
    }
    if zero1_fp32_accum:
        config["zero_optimization"]["stage"] = 1
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def windows(corpus, n: int = 128) -> list[dict]:
    return [{"input_ids": w, "labels": w} for w in global_batch(corpus, 0, n, SEQ, seed=0)]


def train(output_dir: str, *, quantize: bool = True, zero1_fp32_accum: bool = False, steps: int = 10,
          cpu: bool = False, corpus=None, callbacks=()) -> dict:
    """Train ``steps`` steps; the logged per-step losses (averaged over ranks) and the callback."""
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=MICRO_BATCH,
        max_steps=steps,
        learning_rate=3e-3,
        bf16=True,
        use_cpu=cpu,
        deepspeed=ds_config(quantize, zero1_fp32_accum),
        optim="adamw_torch" if cpu else "adamw_torch_fused",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    callback = QZeroCallback(group_size=64, small_param_numel=PRESETS[PRESET].small_param_numel)
    model = build_model(model_config(PRESET), torch.float32, torch.device("cpu"), seed=0)
    corpus = load_corpus(limit=1_000_000) if corpus is None else corpus
    trainer = Trainer(model, args, train_dataset=windows(corpus), callbacks=[callback, *callbacks])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"losses": losses, "callback": callback, "trainer": trainer}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--quant", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--zero1-fp32-accum", action="store_true")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        run = train(out, quantize=args.quant, zero1_fp32_accum=args.zero1_fp32_accum, steps=args.steps, cpu=args.cpu)
    if run["trainer"].is_world_process_zero():
        for step, loss in enumerate(run["losses"]):
            print(f"step {step:3d}  loss {loss:.4f}")
        report = run["callback"].report()
        if report is not None:
            print(report.summary())


if __name__ == "__main__":
    main()
