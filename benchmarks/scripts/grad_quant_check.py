"""GPU check of the quantized gradient reduction: kernel speed on one GPU, then training arms on
every visible GPU (NCCL) with and without ``zero_quantized_gradients``.

    python3 benchmarks/scripts/grad_quant_check.py OUTDIR [--preset small] [--steps 30] [--numel 50000000]

1. ``pack_gradient`` and ``dequantize_sum`` (Triton) on a bf16 bucket of ``--numel`` elements,
   for int8, fp8 and int4, and int4 with the Hadamard rotation (blocks of 32 and 64, alone
   and with error feedback, whose residual the pack reads and writes): bit-identical to the
   torch reference on the same GPU (payload bytes, residuals, fp32 sums), and their time
   (CUDA events). ``rotation_cost`` is the rotated kernels' time over the unrotated int4's.
2. Arms of ``qzero.app.train`` (stage 2 and stage 1, both flat orders) with quantized gradients
   (int8, fp8, int4 with and without the rotation, int4 with error feedback) against the
   plain reduction: final loss, gradient bytes per rank and step, replicas identical, median
   step time. The link is whatever the host has (NVLink here: the step
   times say nothing about slow links; ``qzero bench steps`` (``qzero.app.benchmarks.steps``) with ``NCCL_P2P_DISABLE=1``
   / ``NCCL_SHM_DISABLE=1`` arms does).

Prints a table and writes ``OUTDIR/grad_quant_check.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch


#: (format, rotation block, error feedback) of the kernel check.
KERNEL_VARIANTS = [("int8", 0, False), ("fp8", 0, False), ("int4", 0, False), ("int4", 32, False),
                   ("int4", 64, False), ("int4", 32, True), ("int8", 32, True)]


def kernel_check(numel: int, world: int = 2, device: str = "cuda") -> list[dict]:
    from qzero.layout import aligned_layout
    from qzero.quant import gradients as ref
    from qzero.quant import gradients_triton as kernels
    from qzero.quant.formats import get_format

    rows = []
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(numel, device=dev, generator=gen) * 1e-3).to(torch.bfloat16)
    x[::4099] *= 40  # outliers, as real gradients have
    idx = torch.arange(1000, 1512, device=dev, dtype=torch.int64)
    for fmt, rot, ef in KERNEL_VARIANTS:
        gs = 64
        layout = aligned_layout(get_format(fmt).value_bytes(numel), -(-numel // gs), idx.numel(), 2)
        a = torch.zeros(layout.nbytes, dtype=torch.uint8, device=dev)  # alignment padding: the same zeros
        b = torch.zeros_like(a)
        ra = (torch.randn(numel, device=dev, generator=gen) * 1e-5).to(ref.RESIDUAL_DTYPE) if ef else None
        rb = ra.clone() if ef else None
        ref.pack_gradient(x, a, layout, gs, fmt, idx, rot, ra)
        kernels.pack_gradient(x, b, layout, gs, fmt, idx, rot, rb)
        same_pack = bool(torch.equal(a, b)) and (not ef or bool(torch.equal(ra.view(torch.int16), rb.view(torch.int16))))
        payloads = a.repeat(world - 1)
        want = torch.empty(numel, dtype=torch.float32, device=dev)
        got = torch.empty_like(want)
        ref.dequantize_sum(payloads, x, want, layout, 0, world, gs, fmt, idx, rot)
        kernels.dequantize_sum(payloads, x, got, layout, 0, world, gs, fmt, idx, rot)
        same_sum = bool(torch.equal(want.view(torch.int32), got.view(torch.int32)))
        rel_err = float((want - x.float() * world).norm() / (x.float() * world).norm())  # own + one payload of x

        def timed(fn, reps=20):
            fn()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            stop.record()
            stop.synchronize()
            return start.elapsed_time(stop) / reps

        pack_ms = timed(lambda: kernels.pack_gradient(x, b, layout, gs, fmt, idx, rot, rb))
        sum_ms = timed(lambda: kernels.dequantize_sum(payloads, x, got, layout, 0, world, gs, fmt, idx, rot))
        read = numel * 2 * (2 if ef else 1)  # the bucket (and the residual)
        rows.append({"fmt": fmt, "rotation": rot, "error_feedback": ef, "numel": numel, "pack_identical": same_pack,
                     "sum_identical": same_sum, "sum_rel_err": rel_err, "pack_ms": pack_ms, "dequantize_sum_ms": sum_ms,
                     "pack_GBps": read / pack_ms / 1e6, "sum_GBps": numel * 2 * world / sum_ms / 1e6})
    plain4 = next(r for r in rows if (r["fmt"], r["rotation"], r["error_feedback"]) == ("int4", 0, False))
    for r in rows:
        if r["fmt"] == "int4":
            r["rotation_cost"] = {"pack": r["pack_ms"] / plain4["pack_ms"],
                                  "dequantize_sum": r["dequantize_sum_ms"] / plain4["dequantize_sum_ms"]}
    return rows


def train_arms(preset: str, steps: int, world: int) -> list[dict]:
    from qzero.app.train import launch, settings_from

    arms = [
        ("plain s2", dict(stage=2), {}),
        ("qgrad s2", dict(stage=2), {"zero_quantized_gradients": True}),
        ("qgrad s2 fp8", dict(stage=2), {"zero_quantized_gradients": True, "zero_quantized_gradients_format": "fp8"}),
        ("plain s1 contiguous", dict(stage=1), {"flat_order": "contiguous"}),
        ("qgrad s1 contiguous", dict(stage=1), {"flat_order": "contiguous", "zero_quantized_gradients": True}),
        ("qgrad s2 accum 2", dict(stage=2, grad_accum=2), {"zero_quantized_gradients": True}),
        ("qgrad s2 int4 H32", dict(stage=2), {"zero_quantized_gradients": True, "zero_quantized_gradients_format": "int4"}),
        ("qgrad s2 int4 no rotation", dict(stage=2), {"zero_quantized_gradients": True,
                                                       "zero_quantized_gradients_format": "int4",
                                                       "zero_quantized_gradients_rotation": "none"}),
        ("qgrad s2 int4 H32 +EF", dict(stage=2), {"zero_quantized_gradients": True,
                                                  "zero_quantized_gradients_format": "int4",
                                                  "zero_quantized_gradients_error_feedback": True}),
        ("qgrad s1 contiguous int4 H32 +EF", dict(stage=1), {"flat_order": "contiguous", "zero_quantized_gradients": True,
                                                             "zero_quantized_gradients_format": "int4",
                                                             "zero_quantized_gradients_error_feedback": True}),
        ("qgrad s2 accum 2 int4 H32 +EF", dict(stage=2, grad_accum=2), {"zero_quantized_gradients": True,
                                                                        "zero_quantized_gradients_format": "int4",
                                                                        "zero_quantized_gradients_error_feedback": True}),
    ]
    rows = []
    for name, settings, extra in arms:
        s = settings_from(dict(preset=preset, world_size=world, device="cuda", steps=steps, warmup=2,
                               zero_quantized_weights=True, reduce_bucket_size=5_000_000, **extra, **settings))
        r = launch(s, None, show_progress=False)
        rows.append({"arm": name, "first_loss": r["losses"][0], "final_loss": r["losses"][-1],
                     "median_step_ms": 1e3 * statistics.median(r["step_times"]),
                     "grad_sent": r["grad_bytes_sent_per_step"], "grad_plain": r["grad_plain_bytes_per_step"],
                     "replicas_identical": r["replicas_identical"], "skipped": r["skipped_steps"]})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--numel", type=int, default=50_000_000)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("grad_quant_check: needs CUDA", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    kernels = kernel_check(args.numel)
    for k in kernels:
        name = k["fmt"] + (f" H{k['rotation']}" if k["rotation"] else "") + (" +EF" if k["error_feedback"] else "")
        print(f"kernels {name}: pack identical {k['pack_identical']}, sum identical {k['sum_identical']}; "
              f"pack {k['pack_ms']:.3f} ms ({k['pack_GBps']:.0f} GB/s read), dequantize-sum {k['dequantize_sum_ms']:.3f} ms"
              f"; sum rel. err {k['sum_rel_err']:.4f}"
              + (f"; vs int4 unrotated x{k['rotation_cost']['pack']:.2f} / x{k['rotation_cost']['dequantize_sum']:.2f}"
                 if "rotation_cost" in k else ""))
    arms = train_arms(args.preset, args.steps, torch.cuda.device_count())
    print("| arm | loss first -> final | median step ms | grad MB sent/plain per rank-step | replicas | skipped |")
    print("|---|---|---|---|---|---|")
    for a in arms:
        print(f"| {a['arm']} | {a['first_loss']:.4f} -> {a['final_loss']:.4f} | {a['median_step_ms']:.1f} | "
              f"{a['grad_sent'] / 1e6:.2f} / {a['grad_plain'] / 1e6:.2f} | {a['replicas_identical']} | {a['skipped']} |")
    with open(os.path.join(args.out, "grad_quant_check.json"), "w") as f:
        json.dump({"kernels": kernels, "arms": arms, "preset": args.preset, "steps": args.steps}, f, indent=1)
    ok = all(k["pack_identical"] and k["sum_identical"] for k in kernels) and all(a["replicas_identical"] for a in arms)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
