"""Bytes against error of delta weight gathers, on the real AdamW updates of a small model (CPU).

One process trains a Qwen3-shaped model (bf16 weights, fp32 AdamW masters, real text) and after
every step replays, for each candidate setting, the delta gather's closed loop over the model's
flat buffer ([Note: delta payload] in ``qzero/quant/reference.py``): each setting keeps its own
bf16 replica ``r``, quantizes ``bf16(master) - r`` group-wise (small parameters exact) and adds the
result. The training itself uses ``bf16(master)`` (the exact weights), so every setting sees the
same updates; the error of each setting is that of its replica against ``bf16(master)``. Direct
quantization of the weights (what ``zero_quantized_weights`` sends today) is measured on the
same weights for comparison. The resync interval is measured on the winner: the error against
steps since the last exact resync.

Scale dtypes: ``fp32`` (the reference) and ``bf16`` (the fp32 scale rounded to nearest bf16, the
reciprocal taken from the rounded scale, values clamped to the format's range).

    python benchmarks/scripts/delta_fidelity.py --preset small --steps 300 --lr 3e-4 --out OUT/delta_fidelity
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from qzero.layout import plan_flat_layout
from qzero.app.qualify.env import _cpu_name
from qzero.quant import reference
from qzero.quant.formats import SCALE_BYTES, get_format
from qzero.app.workload import PRESETS, build_model, global_batch, load_corpus, model_config

GROUPS = (32, 64, 128, 256, 512, 1024, 2048)
#: Resync intervals measured on int4, group 256, fp32 scales (0: never).
RESYNCS = (10, 100)


def quantize_with(x32: torch.Tensor, group_size: int, fmt: str, scale_dtype: str, exact: torch.Tensor | None):
    """Dequantized ``x32`` (fp32, exact elements zeroed in the result), group-wise."""
    f = get_format(fmt)
    if scale_dtype == "fp32":
        values, scales = reference.quantize(x32, group_size, fmt, exact)
        return reference.dequantize(values, scales, x32.numel(), group_size, fmt, torch.float32)
    x = x32.clone()
    if exact is not None:
        x[exact] = 0.0
    n = x.numel()
    g = -(-n // group_size)
    y = torch.nn.functional.pad(x, (0, g * group_size - n)).view(g, group_size)
    scale = reference.group_scales(x, group_size, f).to(torch.bfloat16).float()
    scale = torch.clamp_min(scale, reference.FLT_MIN)
    q = torch.round(y * (torch.ones_like(scale) / scale)[:, None]).clamp_(-f.qmax, f.qmax)
    return (q * scale[:, None]).flatten()[:n]


def bytes_per_param(fmt: str, group_size: int, scale_dtype: str) -> float:
    scale = SCALE_BYTES if scale_dtype == "fp32" else 2
    return get_format(fmt).bits / 8 + scale / group_size


def lag(err: torch.Tensor, update: torch.Tensor) -> float:
    """How far an error ``replica - target`` lies behind along the step's ``update`` (the
    target's change), in updates: ``-<err, update> / <update, update>``. 0: the error is
    uncorrelated with the update; 1: the replica is where the target was a step ago."""
    uu = float(update.double().square().sum())
    return -float((err.double() * update.double()).sum()) / uu if uu > 0 else 0.0


class DeltaReplica:
    """One setting's replica, updated by the closed loop each step."""

    def __init__(self, start: torch.Tensor, fmt: str, group_size: int, scale_dtype: str, resync: int = 0):
        self.r = start.clone()
        self.fmt, self.group_size, self.scale_dtype, self.resync = fmt, group_size, scale_dtype, resync
        self.since = 0
        self.trace: list[float] = []  # relative L2 error against bf16(master) after each step
        self.lags: list[float] = []  # lag() of the error after each step, along that step's update
        self.held: list[float] = []  # of the elements whose target moved in a step, the share whose replica did not
        self._target = start.clone()

    def step(self, target16: torch.Tensor, exact: torch.Tensor) -> None:
        before, prev_target, self._target = self.r, self._target, target16
        if self.resync and self.since >= self.resync - 1:
            self.r = target16.clone()
            self.since = 0
        else:
            d = target16.float() - self.r.float()
            dq = quantize_with(d, self.group_size, self.fmt, self.scale_dtype, exact)
            self.r = (self.r.float() + dq).to(torch.bfloat16)
            self.r[exact] = target16[exact]
            self.since += 1
        err = (self.r.float() - target16.float())
        self.trace.append(float(err.norm() / target16.float().norm()))
        self.lags.append(lag(err, target16.float() - prev_target.float()))
        moved = target16 != prev_target
        self.held.append(float((moved & (self.r == before)).sum()) / max(1, int(moved.sum())))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--groups", default=",".join(map(str, GROUPS)), help="group sizes to measure")
    ap.add_argument("--formats", default="int4,int8")
    ap.add_argument("--scales", default="fp32,bf16", help="scale dtypes to measure")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    preset = PRESETS[args.preset]
    model = build_model(model_config(args.preset, max_positions=args.seq), torch.bfloat16, torch.device("cpu"), seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    layout = plan_flat_layout([tuple(p.shape) for p in params], 1, zero_quantized_weights_group_size=8,
                              small_param_numel=preset.small_param_numel,
                              zero_quantized_weights_format="int8")
    exact = (torch.cat([torch.arange(a, b) for a, b in layout.exact_ranges]) if layout.exact_ranges
             else torch.empty(0, dtype=torch.long))
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(masters, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    corpus = load_corpus()

    def flat16() -> torch.Tensor:
        return torch.cat([m.detach().reshape(-1) for m in masters]).to(torch.bfloat16)

    start = flat16()
    settings = {}
    groups = [int(g) for g in args.groups.split(",")]
    for fmt in args.formats.split(","):
        for g in groups:
            for sd in args.scales.split(","):
                settings[(fmt, g, sd, 0)] = DeltaReplica(start, fmt, g, sd)
    if 256 in groups and "int4" in args.formats and "fp32" in args.scales:
        for k in RESYNCS:
            settings[("int4", 256, "fp32", k)] = DeltaReplica(start, "int4", 256, "fp32", k)
    direct = {(fmt, g): [] for fmt in ("int8", "int4") for g in (64, 256)}
    direct_lags = {k: [] for k in direct}
    update = []
    losses = []
    prev = start
    t0 = time.perf_counter()
    for step in range(args.steps):
        tokens = global_batch(corpus, step, args.batch, args.seq, 0)
        for p, m in zip(params, masters):
            p.data.copy_(m.detach())
            p.grad = None
        logits = model(input_ids=tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                 tokens[:, 1:].reshape(-1))
        loss.backward()
        for p, m in zip(params, masters):
            m.grad = p.grad.float()
        torch.nn.utils.clip_grad_norm_(masters, args.clip)
        opt.step()
        losses.append(loss.item())
        t16 = flat16()
        update.append(float((t16.float() - prev.float()).norm() / t16.float().norm()))
        for rep in settings.values():
            rep.step(t16, exact)
        for (fmt, g), trace in direct.items():
            got = quantize_with(t16.float(), g, fmt, "fp32", exact)
            got[exact] = t16[exact].float()
            err = got.to(torch.bfloat16).float() - t16.float()
            trace.append(float(err.norm() / t16.float().norm()))
            direct_lags[(fmt, g)].append(lag(err, t16.float() - prev.float()))
        prev = t16
        if step % 25 == 0:
            print(f"step {step} loss {loss.item():.4f} ({time.perf_counter() - t0:.0f}s)", flush=True)
    tail = slice(args.steps // 3, None)  # after the first third: the steady state

    def mean(xs):
        xs = list(xs)
        return sum(xs) / len(xs)

    rows = []
    for (fmt, g, sd, k), rep in settings.items():
        rows.append(dict(fmt=fmt, group_size=g, scale_dtype=sd, resync=k, bytes_per_param=bytes_per_param(fmt, g, sd),
                         rel_err_mean=mean(rep.trace[tail]), rel_err_max=max(rep.trace[tail]),
                         rel_err_first_third=mean(rep.trace[: args.steps // 3]),
                         rel_err_last_tenth=mean(rep.trace[-max(1, args.steps // 10):]),
                         lag_mean=mean(rep.lags[tail]), held_mean=mean(rep.held[tail])))
    direct_rows = [dict(fmt=fmt, group_size=g, bytes_per_param=bytes_per_param(fmt, g, "fp32"),
                        rel_err_mean=mean(t[tail]), rel_err_max=max(t[tail]),
                        lag_mean=mean(direct_lags[(fmt, g)][tail]))
                   for (fmt, g), t in direct.items()]
    result = dict(
        preset=args.preset, params=sum(p.numel() for p in params), exact_params=int(exact.numel()),
        steps=args.steps, lr=args.lr, seq=args.seq, batch=args.batch, clip=args.clip,
        loss_first=losses[0], loss_last=mean(losses[-10:]),
        update_rel_mean=mean(update[tail]),
        delta=rows, direct=direct_rows,
        traces={f"{fmt}-g{g}-{sd}": rep.trace for (fmt, g, sd, k), rep in settings.items() if k == 0},
        environment=dict(torch=torch.__version__, python=platform.python_version(), device="CPU: " + _cpu_name(),
                         threads=args.threads, seconds=time.perf_counter() - t0),
    )
    os.makedirs(args.out, exist_ok=True)
    name = f"{args.preset}_lr{args.lr:g}"
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    md = markdown(result)
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write(md)
    print(md)


def markdown(r: dict) -> str:
    lines = [
        f"# Delta gathers: bytes against error, {r['preset']} ({r['params']:,} parameters, "
        f"{r['exact_params']:,} exact), "
        f"AdamW lr {r['lr']:g}, {r['steps']} steps",
        "",
        f"Loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}. "
        "Mean step update ||bf16(m_t) - bf16(m_t-1)|| / ||bf16(m_t)||: "
        f"{r['update_rel_mean']:.2e}. Error: ||replica - bf16(master)|| / ||bf16(master)|| after each step, "
        "mean (and max) "
        f"over steps {r['steps'] // 3 + 1}-{r['steps']}; bytes per parameter exclude exact parameters and alignment.",
        "",
        "Lag: how far the error lies behind along the step's update, ``-<replica - target, update> / |update|^2``, in",
        "updates (0: uncorrelated with it; 1: the replica is where the target was a step before); "
        "held: of the elements",
        "whose target moved in a step, the share whose replica did not move. Means over the same steps.",
        "",
        "| payload | scale | group | bytes/param | rel. error mean | max | first third | last tenth | lag | held |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in sorted(r["delta"], key=lambda x: (x["fmt"], x["scale_dtype"], x["resync"], x["group_size"])):
        resync = f", resync every {row['resync']}" if row["resync"] else ""
        lines.append(f"| {row['fmt']} delta{resync} | {row['scale_dtype']} | {row['group_size']} | "
                     f"{row['bytes_per_param']:.4f} | "
                     f"{row['rel_err_mean']:.2e} | {row['rel_err_max']:.2e} | {row['rel_err_first_third']:.2e} | "
                     f"{row['rel_err_last_tenth']:.2e} | {row['lag_mean']:.3f} | {row['held_mean']:.3f} |")
    for row in r["direct"]:
        lines.append(f"| {row['fmt']} weights (direct) | fp32 | {row['group_size']} | {row['bytes_per_param']:.4f} | "
                     f"{row['rel_err_mean']:.2e} | {row['rel_err_max']:.2e} | | | {row['lag_mean']:.3f} | |")
    lines += ["", f"Environment: {r['environment']}", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
