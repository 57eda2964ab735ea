"""The HF Trainer with DeepSpeed ZeRO-2 and qzero's quantized post-step weight gather.

    torchrun --nproc_per_node=2 examples/deepspeed_hf_trainer.py              # GPUs (NCCL)
    torchrun --nproc_per_node=2 examples/deepspeed_hf_trainer.py --cpu        # CPU (gloo)

The Trainer builds the DeepSpeed engine itself, so instead of swapping ``initialize``
the DeepSpeed config gets ``zero_quantized_weights: true`` and the Trainer gets
``QZeroCallback``. The model is a tiny byte-level Llama made from a config and the text is
this Python's standard library sources: nothing is downloaded. The Trainer logs the loss
every 5 steps; it falls from about ln 256 = 5.5.
"""

import argparse
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from qzero.integrations.hf import QZeroCallback
from qzero.workload import load_corpus

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "bf16": {"enabled": "auto"},
    "gradient_clipping": "auto",
    "steps_per_print": 10**9,
    "zero_optimization": {"stage": 2, "overlap_comm": True, "zero_quantized_weights": True},
}


def tiny_llama(vocab=256):
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config)


def text_rows(n=256, seq=128):
    """``n`` sequences of ``seq`` byte tokens of text (the model learns to predict the next byte)."""
    data = load_corpus(limit=n * seq)
    return [{"input_ids": ids, "labels": ids} for ids in data.view(n, seq)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as out:
        training_args = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=4,
            max_steps=args.steps,
            learning_rate=1e-3,
            bf16=True,
            use_cpu=args.cpu,
            deepspeed=DS_CONFIG,
            optim="adamw_torch_fused" if not args.cpu else "adamw_torch",
            logging_steps=5,
            save_strategy="no",
            report_to=[],
        )
        callback = QZeroCallback(group_size=64)
        trainer = Trainer(tiny_llama(), training_args, train_dataset=text_rows(), callbacks=[callback])
        trainer.train()
    if trainer.is_world_process_zero():
        g = callback.gather
        print(f"qzero gather: {g.calls} gathers, {g.bytes_sent / g.plain_bytes:.2f}x the bytes of the bf16 gather")


if __name__ == "__main__":
    main()
