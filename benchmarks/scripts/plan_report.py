"""What qzero's planner decides for a model at several world sizes, without any process group.

For each world size: the flat order ``auto`` picks and its padding, the weight gather's
chunks and receive buffers (synchronous and gather-ahead), the gradient buckets, and the
largest reduce staging a backward holds (with ``--solo-reduce``, as with
``ZeroConfig.solo_reduce``, solo parameters need none: their own gradient is reduced), found by
replaying the backward's gradient order (reverse model order; a tied embedding's gradient
arrives last) over the bucket plan.
Model shapes come from a ``transformers`` config on the meta device (nothing is allocated).

    python benchmarks/scripts/plan_report.py --preset qwen3-4b --worlds 2,4,8 --allgather-bucket-size 5e7 \\
        --reduce-bucket-size 2.6e7
"""

from __future__ import annotations

import argparse

import torch

from qzero.buckets import plan_reduce_buckets, plan_scatter_buckets, solo_slots
from qzero.layout import plan_flat_layout
from qzero.wire.engine import fitting_plan
from qzero.app.workload import model_config


def model_shapes(preset: str):
    from transformers import AutoModelForCausalLM

    cfg = model_config(preset, None)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    params = list(model.parameters())  # tied weights appear once
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    return [tuple(p.shape) for p in params], tied


def staging_peak(layout, buckets, numel_of, tied: bool, elem: int = 2) -> int:
    """Largest sum of open staging buffers while gradients arrive in backward order."""
    n = len(layout.slots)
    order = list(range(n - 1, -1, -1))
    if tied:  # the shared embedding (first parameter) accumulates its last gradient at the very end
        order = [i for i in order if i != 0] + [0]
    missing = {b.index: len(b.slots) for b in buckets}
    of: dict[int, list] = {}
    for b in buckets:
        for i in b.slots:
            of.setdefault(i, []).append(b)
    open_, peak = set(), 0
    for i in order:
        for b in of.get(i, ()):
            open_.add(b.index)
            missing[b.index] -= 1
        peak = max(peak, sum(numel_of(b) for b in buckets if b.index in open_) * elem)
        open_ -= {b.index for b in of.get(i, ()) if missing[b.index] == 0}
    return peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-1.7b")
    ap.add_argument("--worlds", default="2,4,8")
    ap.add_argument("--allgather-bucket-size", type=float, default=5e8, help="ZeroConfig.allgather_bucket_size")
    ap.add_argument("--reduce-bucket-size", type=float, default=5e7, help="ZeroConfig.reduce_bucket_size")
    ap.add_argument("--group-size", type=int, default=64, help="ZeroConfig.zero_quantized_weights_group_size")
    ap.add_argument("--solo-reduce", action="store_true", help="as ZeroConfig.solo_reduce (default off)")
    a = ap.parse_args()
    shapes, tied = model_shapes(a.preset)
    used = sum(int(torch.Size(s).numel()) for s in shapes)
    ag, rb = int(a.allgather_bucket_size), int(a.reduce_bucket_size)
    print(f"{a.preset}: {len(shapes)} parameters, {used:,} elements, tied embedding: {tied}; "
          f"gather bucket {ag:,}, reduce bucket {rb:,}, INT8 g{a.group_size}\n")
    print("| world | order (auto) | padding | chunks sync / ahead | recv MiB sync / ahead | grad buckets | "
          "kind | staging peak MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for w in (int(x) for x in a.worlds.split(",")):
        kw = dict(zero_quantized_weights_group_size=a.group_size, zero_quantized_weights_format="int8",
                  flat_order="auto")
        sync = plan_flat_layout(shapes, w, allgather_bucket_size=ag, **kw)
        ahead = fitting_plan(sync.gather, 2)  # two chunks in flight, within the same bucket
        if sync.order == "interleaved":
            solo = solo_slots(sync, rb) if a.solo_reduce else ()
            buckets = plan_scatter_buckets(sync, rb, exclude=solo)
            kind = f"reduce-scatter + {len(solo)} solo"
            peak = staging_peak(sync, buckets, lambda b: w * b.width, tied)
        else:
            buckets, kind = plan_reduce_buckets(sync, rb), "reduce to owner"
            peak = staging_peak(sync, buckets, lambda b: b.numel, tied)
        recv = (sync.gather.max_recv_bytes / 2**20, 2 * ahead.max_recv_bytes / 2**20)
        print(f"| {w} | {sync.order} | {sync.padding / used:.2%} | {len(sync.gather.chunks)} / {len(ahead.chunks)} "
              f"| {recv[0]:.0f} / {recv[1]:.0f} | {len(buckets)} | {kind} | {peak / 2**20:.0f} |")


if __name__ == "__main__":
    main()
