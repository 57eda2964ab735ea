"""A DeepSpeed ZeRO-2 job with qzero's quantized post-step weight gather.

    torchrun --nproc_per_node=2 examples/deepspeed_zero2.py              # CPU (gloo) or GPUs (NCCL)
    torchrun --nproc_per_node=2 examples/deepspeed_zero2.py --no-quant   # DeepSpeed's own gather

Compared with a plain DeepSpeed script, two things change: the import of
``initialize`` and two keys in ``zero_optimization``.
"""

import argparse
import math
import time

import torch
import torch.nn.functional as F

from qzero.integrations.deepspeed import initialize  # was: from deepspeed import initialize


def make_config(quantize: bool) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 32,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": 2,
            "overlap_comm": True,
            "allgather_bucket_size": 5e7,
            "reduce_bucket_size": 5e7,
            "zero_quantized_weights": quantize,  # added
            "zero_quantized_weights_group_size": 64,  # added
        },
    }


class MLP(torch.nn.Module):
    def __init__(self, d=512, layers=4, classes=16):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(layers))
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(d) for _ in range(layers))
        self.head = torch.nn.Linear(d, classes)

    def forward(self, x):
        for block, norm in zip(self.blocks, self.norms):
            x = x + torch.relu(block(norm(x)))
        return self.head(x)


def batch(step: int, rank: int, device, d=512, classes=16, n=32):
    """Fresh samples every step: noise, with the coordinate of the sample's class raised by 3
    (a rule the model learns in a few dozen steps)."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(n, d, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    x[torch.arange(n), y] += 3.0
    return x.to(device, torch.bfloat16), y.to(device)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-quant", action="store_true", help="DeepSpeed's own bf16 gather")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    engine, _, _, _ = initialize(model=model, optimizer=optimizer, config=make_config(not args.no_quant))
    rank = engine.global_rank

    start = time.perf_counter()
    total, first = 0.0, 0  # the loss summed since the last print (fresh batches: one step's loss is noisy)
    for step in range(args.steps):
        x, y = batch(step, rank, engine.device)
        loss = F.cross_entropy(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        total = total + loss.detach()
        if step % 10 == 9 or step == args.steps - 1:
            if rank == 0:
                print(f"steps {first:3d}-{step:3d}  loss {total.item() / (step + 1 - first):.4f}  "
                      f"(chance: {math.log(16):.4f})", flush=True)
            total, first = 0.0, step + 1
    elapsed = time.perf_counter() - start

    if rank == 0:
        gather = getattr(engine, "qzero_gather", None)
        if gather is None:
            print(f"DeepSpeed's own gather; {elapsed / args.steps * 1e3:.1f} ms/step")
        else:
            print(
                f"qzero gather: {gather.calls} gathers, {gather.bytes_sent / gather.calls / 1e6:.3f} MB sent per "
                f"rank per step ({gather.bytes_sent / gather.plain_bytes:.2f}x the bf16 gather); "
                f"{elapsed / args.steps * 1e3:.1f} ms/step"
            )


if __name__ == "__main__":
    main()
