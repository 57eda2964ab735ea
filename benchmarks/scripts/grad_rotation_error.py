"""Gradient error of the quantized gradient reduction against the rotation block, on real
gradients of a small transformer (CPU, minutes; how the INT4 defaults were chosen).

A Qwen3-shaped model (preset ``small``: hidden 256, 4 layers, byte vocabulary, 3.4M
parameters) trains in fp32 with AdamW on real text (:func:`qzero.app.workload.load_corpus`, the
standard library's sources) for ``--steps`` steps. At ``--probe`` steps the gradient of
each of ``--world`` simulated ranks (each its own sequences of the step's batch) is taken
in bf16, and every parameter larger than the preset's ``small_param_numel`` (the ones the
reduction quantizes) is pushed, as one piece, through the product's reference arithmetic
(:func:`qzero.quant.gradients.pack_gradient` / :func:`~qzero.quant.gradients.dequantize_sum`)
for each format, group size and rotation block:

* ``payload_rel_err`` = ||deq(pack(g_r)) - g_r|| / ||g_r|| over all ranks and parameters;
* ``reduced_rel_err`` = ||Q - E|| / ||E||: Q the fp32 sums the owner (rank 0, its own piece
  unquantized) gets, E the exact sum of the same bf16 gradients;
* with ``--steps-ef`` consecutive probes, the same with error feedback (``_ef`` columns: the
  error of the *cumulative* reduced gradient over those steps, what the update integrates).

    python benchmarks/scripts/grad_rotation_error.py --out OUT/grad_rotation/cpu_small.json

Prints a markdown table and writes the JSON (settings, versions, every number).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))


def collect(preset: str, steps: int, probes: list[int], world: int, seq: int, per_rank: int, seed: int,
            only: str | None):
    """``{probe step: [per rank: [bf16 gradient of each quantized parameter]]}`` and the names
    (``only``: a regular expression the measured parameters' names must match)."""
    import re

    from qzero.app.workload import PRESETS, build_model, global_batch, load_corpus, model_config

    corpus = load_corpus(limit=2_000_000)
    model = build_model(model_config(preset), torch.float32, torch.device("cpu"), seed)
    small = PRESETS[preset].small_param_numel
    names = [n for n, p in model.named_parameters() if p.numel() > small and (only is None or re.search(only, n))]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    out = {}
    for step in range(1, steps + 1):
        batch = global_batch(corpus, step, world * per_rank, seq, seed)
        grads = []
        for r in range(world):
            part = batch[r * per_rank : (r + 1) * per_rank]
            loss = model(input_ids=part[:, :-1], labels=part[:, 1:].contiguous()).loss / world
            loss.backward()
            if step in probes:
                grads.append([dict(model.named_parameters())[n].grad.detach().clone() for n in names])
        if step in probes:  # each rank's own gradient: the differences of the running sums
            per_rank_grads = [grads[0]] + [[b - a for a, b in zip(grads[r - 1], grads[r])] for r in range(1, world)]
            out[step] = [[(g * world).reshape(-1).to(torch.bfloat16) for g in rank] for rank in per_rank_grads]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return out, names


def reduce_once(pieces: list[torch.Tensor], fmt: str, group: int, rotation: int, residuals=None):
    """Rank 0's fp32 sum of one parameter's piece over all ranks, and the payload errors."""
    from qzero.layout import aligned_layout
    from qzero.quant import gradients as ref
    from qzero.quant.formats import get_format

    world, n = len(pieces), pieces[0].numel()
    layout = aligned_layout(get_format(fmt).value_bytes(n), -(-n // group), 0, 2)
    payloads, perr, pnorm = [], 0.0, 0.0
    for s in range(1, world):
        buf = torch.zeros(layout.nbytes, dtype=torch.uint8)
        res = None if residuals is None else residuals[s]
        ref.pack_gradient(pieces[s], buf, layout, group, fmt, None, rotation, res)
        # the payload's own error: decode it alone (the owner's sum of one payload, nothing of its own)
        alone = torch.empty(n, dtype=torch.float32)
        ref.dequantize_sum(buf, torch.zeros(n, dtype=torch.bfloat16), alone, layout, 0, 2, group, fmt, None, rotation)
        perr += float((alone.double() - pieces[s].double()).pow(2).sum())
        pnorm += float(pieces[s].double().pow(2).sum())
        payloads.append(buf)
    out = torch.empty(n, dtype=torch.float32)
    ref.dequantize_sum(torch.cat(payloads), pieces[0], out, layout, 0, world, group, fmt, None, rotation)
    return out, perr, pnorm


def crest(g: torch.Tensor, group: int, rotation: int) -> float:
    """Mean over groups of absmax / RMS (rotated first when ``rotation``): what sets a group's step."""
    from qzero.quant.gradients import hadamard

    x = g.float()
    x = hadamard(x, rotation) if rotation else x
    x = x[: x.numel() // group * group].view(-1, group)
    rms = x.pow(2).mean(1).sqrt()
    keep = rms > 0
    return float((x.abs().amax(1)[keep] / rms[keep]).mean())


def measure(grads: dict, fmt: str, group: int, rotation: int, ef_steps: list[int], names: list[str]) -> dict:
    from qzero.quant.gradients import RESIDUAL_DTYPE

    num = den = pnum = pden = 0.0
    per_param = {n: [0.0, 0.0] for n in names}
    for step, ranks in grads.items():
        if step in ef_steps[1:]:
            continue  # single-step errors: the first of the consecutive probes stands for them
        world = len(ranks)
        for k in range(len(ranks[0])):
            pieces = [ranks[r][k] for r in range(world)]
            exact = sum(p.double() for p in pieces)
            got, pe, pn = reduce_once(pieces, fmt, group, rotation)
            e2, x2 = float((got.double() - exact).pow(2).sum()), float(exact.pow(2).sum())
            num, den = num + e2, den + x2
            per_param[names[k]][0] += e2
            per_param[names[k]][1] += x2
            pnum, pden = pnum + pe, pden + pn
    row = {"reduced_rel_err": (num / den) ** 0.5, "payload_rel_err": (pnum / pden) ** 0.5,
           "reduced_rel_err_by_parameter": {n: (a / b) ** 0.5 if b else 0.0 for n, (a, b) in per_param.items()},
           "crest_by_parameter": {n: crest(grads[min(grads)][1][k], group, rotation) for k, n in enumerate(names)}}
    for ef in (False, True):  # the cumulative reduced gradient over consecutive steps
        world, params = len(grads[ef_steps[0]]), len(grads[ef_steps[0]][0])
        num = den = 0.0
        for k in range(params):
            n = grads[ef_steps[0]][0][k].numel()
            residuals = [torch.zeros(n, dtype=RESIDUAL_DTYPE) for _ in range(world)] if ef else None
            got_total = torch.zeros(n, dtype=torch.float64)
            exact_total = torch.zeros(n, dtype=torch.float64)
            for step in ef_steps:
                pieces = [grads[step][r][k] for r in range(world)]
                got, _, _ = reduce_once(pieces, fmt, group, rotation, residuals)
                got_total += got.double()
                exact_total += sum(p.double() for p in pieces)
            num += float((got_total - exact_total).pow(2).sum())
            den += float(exact_total.pow(2).sum())
        row["cumulative_rel_err" + ("_ef" if ef else "")] = (num / den) ** 0.5
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=100, help="training steps (the last probe is at most this)")
    p.add_argument("--probe", default="30,97,98,99,100", help="steps whose gradients are measured")
    p.add_argument("--steps-ef", default="97,98,99,100", help="consecutive probes for the cumulative error")
    p.add_argument("--only", default=r"embed|lm_head|layers\.(0|3)\.",
                   help="regular expression: measure the parameters whose names match (default: the "
                   "embedding, the head, the first and the last layer)")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--per-rank", type=int, default=2, help="sequences per rank and step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arms", default=None,
                   help="comma-separated <fmt>-g<group>-h<block> (h0: no rotation); default: the table's twelve")
    p.add_argument("--by-parameter", action="store_true", help="also print each parameter's error and crest factor")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # a shared machine: intra-op threads only contend
    probes = [int(s) for s in args.probe.split(",")]
    ef_steps = [int(s) for s in args.steps_ef.split(",")]
    t0 = time.time()
    grads, names = collect(args.preset, args.steps, probes, args.world, args.seq, args.per_rank, args.seed, args.only)
    arms = [("int8", 64, 0), ("int4", 32, 0), ("int4", 32, 8), ("int4", 32, 16), ("int4", 32, 32),
            ("int4", 64, 0), ("int4", 64, 16), ("int4", 64, 32), ("int4", 64, 64),
            ("int4", 128, 0), ("int4", 128, 32), ("int4", 128, 128)]
    if args.arms:
        arms = [(f, int(g), int(h)) for f, g, h in (a.replace("-g", " ").replace("-h", " ").split()
                                                    for a in args.arms.split(","))]
    rows = []
    for fmt, group, rotation in arms:
        row = {"format": fmt, "group_size": group, "rotation_block": rotation,
               **measure(grads, fmt, group, rotation, ef_steps, names)}
        row["bits_per_element"] = (4 if fmt == "int4" else 8) + 32 / group
        rows.append(row)
        print(f"{fmt} g{group} H{rotation or '-'}: reduced {row['reduced_rel_err']:.4f}", file=sys.stderr, flush=True)
    print("| format | group | rotation block | bits/element | payload rel. err | reduced rel. err (4 ranks) "
          "| cumulative, 4 steps | cumulative with error feedback |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['format']} | {r['group_size']} | {r['rotation_block'] or 'none'} | {r['bits_per_element']:.2f} | "
              f"{r['payload_rel_err']:.4f} | {r['reduced_rel_err']:.4f} | {r['cumulative_rel_err']:.4f} | "
              f"{r['cumulative_rel_err_ef']:.4f} |")
    if args.by_parameter:
        print("\n| parameter | "
              + " | ".join(f"{r['format']} g{r['group_size']} H{r['rotation_block'] or '-'} err / crest" for r in rows)
              + " |")
        print("|---|" + "---|" * len(rows))
        for n in names:
            print(f"| {n} | "
                  + " | ".join(f"{r['reduced_rel_err_by_parameter'][n]:.4f} / {r['crest_by_parameter'][n]:.2f}"
                               for r in rows) + " |")
    record = {
        "what": "gradient relative error of the quantized reduction vs rotation block (torch reference, CPU)",
        "settings": vars(args), "parameters_measured": names,
        "numel_measured": sum(g.numel() for g in grads[probes[0]][0]),
        "rows": rows, "wall_s": time.time() - t0,
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "device": f"CPU ({platform.machine()})", "link": "none (arithmetic only, no communication)",
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
