"""Convergence study: does training with the quantized weight gather (and, at DP2, the quantized
gradient reduction) reach the loss of bf16?

Arms (default): ``bf16`` (plain gather, ``quantized=false``), ``int8-g64``, ``int8-g8192``,
``fp8-g64`` and ``int4-g64``. An arm name is a weight spec (``bf16`` or ``<fmt>-g<group size>``)
optionally followed by ``+gq-<fmt>-g<group size>``, the quantized gradient reduction
(``zero_quantized_gradients=true`` with that format, int8, fp8 or int4, and group size; then
``-h<block>`` for the Hadamard rotation or ``-noh`` for none, which int4 must state, and
``-ef`` for error feedback), e.g. ``int8-g64+gq-int8-g64`` or ``int8-g64+gq-int4-g64-h32-ef``.
Every arm trains the same randomly initialised Qwen3-shaped
model (preset ``qwen3-125m-byte``: hidden 768, 12 layers, 12 heads / 4 KV heads, head_dim 64,
MLP 3840, byte vocabulary, 125,456,640 parameters) on the same batches of real text (by
default :func:`qzero.app.workload.load_corpus`: this Python's standard-library ``*.py`` sources,
byte level, 8 MB) with the same seed, in bf16, ZeRO-2, AdamW (constant LR, no weight decay)
with global-norm clipping, through :func:`qzero.app.train.launch` (which records the loss of every
step). Nothing is downloaded. ``--micro-batch`` is the global batch of a step (sequences, all
ranks together).

World size 1 (the default): each arm runs as its own single-process run, all arms at once (on a
GPU host spread round-robin over the visible GPUs: 3 on GPU 0 and 2 on GPU 1 with two GPUs). qzero
quantizes at world size 1 exactly as at DP2: the optimizer runs the same reduce / update /
gather phases, and the gather quantizes the rank's own partition and dequantizes it into the
flat buffer (``tests/test_convergence.py`` checks that the weights after a step are the
dequantized masters). The quantization groups match DP2's. Partitions hold whole groups, so
groups start at multiples of the group size from flat index 0 at any world size. With group
64 every quantized parameter of this model starts at a multiple of 64 and holds a multiple of
64 elements in either flat order, so its groups are its own aligned 64-element blocks, at world
size 1 and at DP2 alike. With group 8192 the 768-element norms between the matrices shift the
alignment: the groups equal those of DP2 in the contiguous flat order (every parameter at the
same offset), while DP2's interleaved order (``flat_order="auto"``'s usual choice at DP2)
cuts the 8192-element groups at other places (same size, other neighbours). A world-1 arm
with micro-batch 16 sees the global batch of a DP2 run with micro-batch 8 per rank.

``--world-size N`` (N > 1; needed by the ``+gq`` arms: at world size 1 the gradient reduction
sends nothing, a rank's own slice is never quantized): every arm is one data-parallel job of N
processes (gloo on the CPU, NCCL on CUDA, its own rendezvous port), all arms at once; on CUDA
rank r of every arm uses the r-th GPU of ``--gpus`` (N = 2 on a 2-GPU host: every arm on both
GPUs). Each rank trains on ``micro-batch / N`` sequences of the step's global batch, so
``--world-size 2 --micro-batch 16`` trains on exactly the batches of ``--micro-batch 16`` at
world size 1 (8 per rank). Default arms at N > 1: ``bf16,int8-g64,int8-g64+gq-int8-g64,
int8-g64+gq-int8-g256`` (the gradient study). For the ``+gq`` arms the gradient error of the
quantized reduction is measured every ``--grad-error-every`` steps (and at the last):
``reduced_rel_err`` = ||Q - E|| / ||E||, Q the fp32 sums the reduction gave the owners, E the
exact fp32 sums of the same staged gradients, and ``payload_rel_err`` = ||deq(payload) - g|| /
||g|| of what was sent (see :class:`GradErrorProbe`). The table adds the gradient bytes a rank
sends per step relative to the plain reduction and the mean ``reduced_rel_err``.

Held-out loss: the last ``--heldout`` of the corpus (default 5%) is held out of training
(``TrainSettings.heldout``: the batches are drawn from the rest) and every arm measures its loss on
the same ``--eval-sequences`` fixed windows of it every ``--eval-every`` steps and after the last
(``eval_every``, ``eval_sequences``; ``--heldout 0``: none). The final held-out loss is the one after
the last step every arm measured; its difference from bf16 is in the table and the verdicts. An arm
stopped by ``--time-limit`` writes no record and so has none.

Outputs in ``--out``: ``convergence.png`` (raw and smoothed loss of every arm with its held-out
loss, and the smoothed difference from bf16), ``convergence.md`` (final loss = mean of the last 100 steps,
its difference from bf16 in absolute and %, each arm against the 0.5% target, the final held-out loss and
its difference from bf16 in %), ``convergence.json``
(every per-step loss, gradient norm and step time, held-out losses, gradient errors, the settings, versions,
date) and per-arm logs (every rank's stderr). The table is printed last. With ``--time-limit`` the arms
still running when it expires are stopped and the report compares all arms over the steps every
arm completed.

``--from-arms DIR`` rebuilds ``convergence.json`` (in ``--out``) from the per-arm records
``DIR/arm_<name>.json`` of a run whose combined output was lost, and renders it: the settings,
losses, gradient norms, bytes and memory come from the records; what only the parent process
knew (the run's wall time, environment, per-arm GPUs, exit codes and streamed step times) comes
from ``--wall-s``, ``--env KEY=VALUE`` and ``--gpus`` or is left null; ``--note`` says why.

    python benchmarks/scripts/convergence.py                      # the world-1 GPU study (defaults)
    python benchmarks/scripts/convergence.py --world-size 2 --micro-batch 8 --time-limit 330 \\
        --out OUT                                    # the DP2 gradient study on a 2-GPU host
    python benchmarks/scripts/convergence.py --preset tiny --steps 20 --seq-len 64 --micro-batch 4 \\
        --arms bf16,int8-g64 --device cpu --out /tmp/conv   # a CPU smoke run
    python benchmarks/scripts/convergence.py --world-size 2 --preset tiny --steps 20 --seq-len 64 --micro-batch 4 \\
        --arms bf16,int8-g64+gq-int8-g64 --device cpu --out /tmp/conv2   # a DP2 CPU smoke run
    python benchmarks/scripts/convergence.py --from-arms OUT --gpus 0,1 --wall-s 188 --env torch=2.11.0+cu130 \\
        --note "..." --out OUT                             # rebuild OUT/convergence.json from OUT/arm_*.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import queue
import re
import shlex
import subprocess
import sys
import threading
import time

try:
    import qzero  # noqa: F401
except ImportError:  # run from a checkout that is not installed
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))

from qzero.vocabulary import DELTA_FORMATS, GRADIENT_FORMATS  # noqa: E402
from qzero.vocabulary import WEIGHT_FORMATS as FORMATS  # noqa: E402

DEFAULT_ARMS = "bf16,int8-g64,int8-g8192,fp8-g64,int4-g64"
#: An arm name's replicate suffix (``bf16-rep2``: the arm ``bf16`` trained again beside it).
REPLICATE = re.compile(r"-rep([1-9][0-9]*)$")
DP_ARMS = "bf16,int8-g64,int8-g64+gq-int8-g64,int8-g64+gq-int8-g256"  # the gradient study, --world-size 2
#: The delta study (docs/delta-gathers.md): --world-size 2 --share-gpu --arms "$DELTA_ARMS"
DELTA_ARMS = "bf16,int8-g64,int4-g64,int4-delta-g256,int4-delta-g2048"
TARGET_ARM, TARGET_PCT = "int8-g64", 0.5  # INT8 g64 must finish within 0.5% of bf16
DELTA_TARGET_PCT = 0.25  # a delta arm must finish within 0.25% of bf16 (closer than INT8 weights)
MARK = "@@conv"  # progress lines a worker prints on stdout
GRAD_MARK = "@@gerr"  # gradient-error lines (step, reduced and payload error, gradient bytes sent and plain)
REPLICA_MARK = "@@rerr"  # replica-error lines (step, ||replica - bf16(master)|| / ||bf16(master)||)
GROUPS_NOTE = (
    "qzero quantizes the rank's own partition at world size 1 exactly as each rank does at DP2, with DP2's "
    "groups (preset qwen3-125m-byte): the g64 arms' groups are each matrix's aligned 64-element blocks in "
    "either flat order; the g8192 "
    "arm's groups are those of DP2 in the contiguous flat order (DP2's interleaved order cuts the 8192-element "
    "groups at other places)."
)
# Throughput assumed for the wall-time estimate: training costs ~6 * params FLOPs per token, and
# arms sharing a GPU take turns. EFFECTIVE_FLOPS is what the world-1 study of 2026-11-30 reached
# (OUT/convergence): three arms of 8 x 512 tokens sharing one H200 at a median step of
# ~83 ms = 3 x 6 x 125.5M x 4096 / 0.083 s = ~111 TFLOP/s per GPU, with every step's progress
# sync and small-batch overheads included. At DP2 each rank also sends, per step, about half the
# parameters' bf16 gradients and receives half the weights (less when quantized), taken at
# LINK_BYTES_PER_S over NVLink for each arm in turn. Start-up (imports, CUDA and NCCL init, model
# build, compile of the quantization kernels) adds ~30-60 s.
EFFECTIVE_FLOPS = 110e12
LINK_BYTES_PER_S = 100e9


# ---------------------------------------------------------------------- arms


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    quantized: bool
    fmt: str = "int8"
    group_size: int = 64
    grad_quantized: bool = False  # zero_quantized_gradients (does something only at world size >= 2)
    grad_fmt: str = "int8"
    grad_group_size: int = 64
    grad_rotation: int = 0  # zero_quantized_gradients_rotation_block with the Hadamard rotation; 0: none
    grad_error_feedback: bool = False  # zero_quantized_gradients_error_feedback
    delta: bool = False  # zero_quantized_weights_delta: the weights' differences, closed loop
    ranks_per_node: int = 0  # >0: two-level collectives over pseudo-nodes of this many ranks; 0: flat

    @property
    def label(self) -> str:
        rep = REPLICATE.search(self.name)
        return self._settings_label + (f", replicate {rep.group(1)}" if rep else "")

    @property
    def _settings_label(self) -> str:
        nodes = f", two-level, {self.ranks_per_node} ranks a node" if self.ranks_per_node else ""
        return self._format_label + nodes

    @property
    def _format_label(self) -> str:
        weights = ("bf16 (plain gather)" if not self.quantized else
                   f"{self.fmt.upper()}{' delta' if self.delta else ''} g{self.group_size}")
        if not self.grad_quantized:
            return weights
        return (("bf16 gather" if not self.quantized else weights)
                + f" + grad {self.grad_fmt.upper()} g{self.grad_group_size}"
                + (f" H{self.grad_rotation}" if self.grad_rotation else "")
                + (" +EF" if self.grad_error_feedback else ""))

    def zero_fields(self) -> dict:
        """The arm's own ZeroConfig fields (every other setting is shared by all arms)."""
        from qzero.config import DEFAULT_ROTATION_BLOCK

        return {
            "zero_quantized_weights": self.quantized,
            "zero_quantized_weights_format": self.fmt,
            "zero_quantized_weights_group_size": self.group_size,
            **({"zero_quantized_weights_delta": True} if self.delta else {}),
            "zero_quantized_gradients": self.grad_quantized,
            "zero_quantized_gradients_format": self.grad_fmt,
            "zero_quantized_gradients_group_size": self.grad_group_size,
            "zero_quantized_gradients_rotation": "hadamard" if self.grad_rotation else "none",
            "zero_quantized_gradients_rotation_block": self.grad_rotation or DEFAULT_ROTATION_BLOCK,
            "zero_quantized_gradients_error_feedback": self.grad_error_feedback,
            **({"ranks_per_node": self.ranks_per_node, "hierarchical_collectives": "true"}
               if self.ranks_per_node else {}),
        }


def _spec(text: str, formats: tuple[str, ...], arm: str, what: str) -> tuple[str, int]:
    fmt, _, group = text.partition("-g")
    if fmt not in formats or not group.isdigit() or int(group) <= 0 or int(group) % 8:
        raise ValueError(f"arm {arm!r}: {what} {text!r} is not <fmt>-g<group size> with fmt in {formats} and a "
                         "group size that is a positive multiple of 8, e.g. int8-g64")
    return fmt, int(group)


def parse_arm(name: str) -> Arm:
    """``<weights>`` or ``<weights>+gq-<gradients>``. Weights: ``bf16`` (the plain gather),
    ``<fmt>-g<group size>`` (``int8-g64``, ``fp8-g64``, ``int4-g64``) or ``<fmt>-delta-g<group
    size>`` (delta gathers, ``zero_quantized_weights_delta``; fmt int4 or int8, e.g.
    ``int4-delta-g256``). Gradients (the quantized gradient reduction, ``zero_quantized_gradients``):
    ``gq-<fmt>-g<group size>`` with fmt int8, fp8 or int4, then optionally ``-h<block>`` (the
    Hadamard rotation over blocks of that many elements; int4 needs it or ``-noh``, no rotation,
    said explicitly) and ``-ef`` (error feedback), e.g. ``int8-g64+gq-int8-g64``,
    ``bf16+gq-int8-g256``, ``int8-g64+gq-int4-g64-h32``, ``int8-g64+gq-int4-g64-noh``,
    ``int8-g64+gq-int4-g64-h32-ef``. A suffix ``@L<k>`` runs the arm with two-level collectives
    over pseudo-nodes of ``k`` ranks (``ranks_per_node=k``, ``hierarchical_collectives=true``),
    e.g. ``int4-delta-g64+gq-int4-g256-h32@L2`` at world size 4: 2 nodes of 2. A suffix ``-rep<k>``
    (``bf16-rep2``) names a replicate:
    the same settings, seed and batches as the arm without it, trained again beside it, so
    the report's difference between the two is the run-to-run spread of the GPU's
    nondeterministic kernels alone, the floor under every other arm's difference."""

    name = name.strip()
    spec, at, nodes = REPLICATE.sub("", name).partition("@")
    if at and not (nodes.startswith("L") and nodes[1:].isdigit() and int(nodes[1:]) >= 1):
        raise ValueError(f"arm {name!r}: after '@' expected L<ranks per node>, e.g. @L2, got {nodes!r}")
    weights, plus, grads = spec.partition("+")
    if weights == "bf16":
        arm = dict(quantized=False)
    elif "-delta-g" in weights:
        fmt, group = _spec(weights.replace("-delta-g", "-g", 1), DELTA_FORMATS, name, "delta weight spec")
        arm = dict(quantized=True, fmt=fmt, group_size=group, delta=True)
    else:
        fmt, group = _spec(weights, FORMATS, name, "weight spec")
        arm = dict(quantized=True, fmt=fmt, group_size=group)
    if plus:
        if not grads.startswith("gq-"):
            raise ValueError(f"arm {name!r}: after '+' expected a gradient spec gq-<fmt>-g<group size>, "
                             f"e.g. int8-g64+gq-int8-g64, got {grads!r}")
        parts = grads[3:].split("-")
        fmt, group = _spec("-".join(parts[:2]), GRADIENT_FORMATS, name, "gradient spec")
        options = parts[2:]
        rotation, ef, said = 0, False, False
        for opt in options:
            if opt == "ef" and not ef:
                ef = True
            elif opt == "noh" and not said:
                said = True
            elif opt.startswith("h") and opt[1:].isdigit() and not said:
                rotation, said = int(opt[1:]), True
            else:
                raise ValueError(f"arm {name!r}: gradient option {opt!r} is not -h<block>, -noh or -ef")
        if fmt == "int4" and not said:
            raise ValueError(f"arm {name!r}: gq-int4 needs -h<block> (the Hadamard rotation) or -noh (none), "
                             "e.g. gq-int4-g64-h32")
        arm.update(grad_quantized=True, grad_fmt=fmt, grad_group_size=group, grad_rotation=rotation,
                   grad_error_feedback=ef)
    arm = Arm(name, **arm, ranks_per_node=int(nodes[1:]) if at else 0)
    from qzero import ZeroConfig

    try:
        ZeroConfig(**arm.zero_fields())
    except ValueError as e:
        raise ValueError(f"arm {name!r}: {e}") from None
    return arm


def parse_arms(text: str) -> list[Arm]:
    arms = [parse_arm(a) for a in text.split(",") if a.strip()]
    names = [a.name for a in arms]
    if not arms or len(set(names)) != len(names):
        raise ValueError(f"--arms must name at least one arm, each once: {text!r}")
    return arms


def arm_settings(arm: Arm, args):
    """The arm's TrainSettings. ``args.micro_batch`` is the global batch of a step; each of
    ``args.world_size`` ranks trains on its share (the same sequences at any world size)."""
    from qzero.app.train import TrainSettings

    world = getattr(args, "world_size", 1)
    return TrainSettings(
        preset=args.preset,
        data=args.data,
        world_size=world,
        device=args.device,
        precision="bf16",
        zero={
            "stage": 2,
            **arm.zero_fields(),
            **({"gradient_clipping": args.clip} if args.clip > 0 else {}),
        },
        seq_len=args.seq_len,
        micro_batch=args.micro_batch // world,
        steps=args.steps,
        warmup=max(0, min(10, args.steps - 2)),  # steps left out of the step-time median only
        lr=args.lr,
        lr_warmup=getattr(args, "lr_warmup", 0),
        seed=args.seed,
        heldout=getattr(args, "heldout", 0.0),
        eval_every=getattr(args, "eval_every", 0) if getattr(args, "heldout", 0.0) else 0,
        eval_sequences=getattr(args, "eval_sequences", 32),
    )


# ---------------------------------------------------------------------- the numbers


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what exists so far)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _schedule(study: dict) -> str:
    """The learning-rate schedule in words (a study recorded before ``lr_warmup`` had none)."""
    warm = study.get("lr_warmup") or 0
    return f"linear warmup over {warm} steps, then constant" if warm else "constant"


def final_losses(losses: dict[str, list[float]], reference: str, last: int = 100) -> dict:
    """Final loss per arm (mean of the last ``last`` steps that *every* arm completed) and its
    difference from ``reference``: absolute, in %, and the standard error of the paired
    per-step differences (the arms see the same batches)."""
    common = min(len(v) for v in losses.values())
    if common == 0:
        raise ValueError("an arm recorded no steps")
    lo = max(0, common - last)
    ref = losses[reference][lo:common]
    ref_mean = sum(ref) / len(ref)
    rows = {}
    for name, vals in losses.items():
        window = vals[lo:common]
        mean = sum(window) / len(window)
        diffs = [a - b for a, b in zip(window, ref)]
        n = len(diffs)
        var = sum((d - (mean - ref_mean)) ** 2 for d in diffs) / (n - 1) if n > 1 else 0.0
        rows[name] = {
            "final_loss": mean,
            "diff": mean - ref_mean,
            "diff_pct": 100.0 * (mean - ref_mean) / ref_mean,
            "diff_se": math.sqrt(var / n) if n > 1 else 0.0,
        }
    return {"steps_compared": common, "window": [lo, common], "reference": reference, "arms": rows}


def final_heldout(entries: dict[str, dict], reference: str) -> dict | None:
    """The final held-out loss per arm: the one after the last step that every arm with held-out
    losses measured (``heldout_losses``: ``[step, loss]`` pairs), and its difference from
    ``reference`` in % (None where the reference has none). None when no arm has any (older
    records, ``--heldout 0``)."""
    curves = {name: {step: loss for step, loss in e["heldout_losses"]}
              for name, e in entries.items() if e.get("heldout_losses")}
    common = set.intersection(*(set(c) for c in curves.values())) if curves else set()
    if not common:
        return None
    step = max(common)
    ref = curves.get(reference, {}).get(step)
    return {"step": step, "reference": reference, "arms": {
        name: {"loss": c[step], "diff_pct": 100.0 * (c[step] - ref) / ref if ref else None}
        for name, c in curves.items()}}


def markdown_table(summary: dict, arms: list[Arm], payload: dict[str, float] | None = None,
                   grad: dict[str, tuple[float | None, float | None]] | None = None,
                   heldout: dict | None = None) -> str:
    """The results table; ``payload`` (optional): gather bytes per step relative to a plain
    gather, per arm (evidence that the arm's weights really went through the quantizer);
    ``grad`` (optional, DP runs): per arm, the gradient bytes a rank sent per step relative to
    the plain reduction, and the gradient error of the quantized reduction (None: not measured);
    ``heldout`` (optional, :func:`final_heldout`): the final held-out loss per arm and its Δ % from
    the reference (— for an arm without one)."""
    lo, hi = summary["window"]
    ref = summary["reference"]
    extra = payload is not None
    lines = [
        f"| arm | final loss (mean of steps {lo + 1}–{hi}) | Δ vs {ref} | Δ % | paired SE of Δ |"
        + (f" held-out loss (final, after step {heldout['step']}) | Δ held-out vs {heldout['reference']} % |"
           if heldout else "")
        + (" gather bytes vs plain |" if extra else "")
        + (" grad bytes vs plain | grad rel. error |" if grad is not None else ""),
        "|---|---|---|---|---|" + ("---|---|" if heldout else "") + ("---|" if extra else "")
        + ("---|---|" if grad is not None else ""),
    ]
    for arm in arms:
        r = summary["arms"][arm.name]
        if arm.name == ref:
            row = f"| {arm.label} | {r['final_loss']:.4f} | — | — | — |"
        else:
            row = (f"| {arm.label} | {r['final_loss']:.4f} | {r['diff']:+.4f} | {r['diff_pct']:+.2f}% "
                   f"| {r['diff_se']:.4f} |")
        if heldout:
            h = heldout["arms"].get(arm.name)
            row += f" {h['loss']:.4f} |" if h else " — |"
            row += (" — |" if not h or h["diff_pct"] is None or arm.name == heldout["reference"]
                    else f" {h['diff_pct']:+.2f}% |")
        if extra:
            ratio = payload.get(arm.name)
            row += f" {ratio:.3f} |" if ratio is not None else " — |"
        if grad is not None:
            ratio, err = grad.get(arm.name, (None, None))
            row += ((f" {ratio:.3f} |" if ratio is not None else " — |")
                    + (f" {err:.4f} |" if err is not None else " — |"))
        lines.append(row)
    return "\n".join(lines)


def _verdict_line(label: str, r: dict, target: float = TARGET_PCT) -> str:
    ok = abs(r["diff_pct"]) <= target
    return f"{label} vs bf16: {r['diff_pct']:+.2f}% — {'within' if ok else 'OUTSIDE'} the {target}% target"


def verdict(summary: dict) -> str | None:
    r = summary["arms"].get(TARGET_ARM)
    if r is None or summary["reference"] != "bf16":
        return None
    return (_verdict_line("INT8 g64", r)
            + f" (mean of the last {summary['window'][1] - summary['window'][0]} steps).")


def verdicts(summary: dict, arms: list[Arm], heldout: dict | None = None) -> list[str]:
    """One line per arm other than bf16: its Δ % and whether it is within the target, and its
    held-out Δ % where both it and bf16 have one (``heldout``: :func:`final_heldout`)."""
    if summary["reference"] != "bf16":
        return []
    n = summary["window"][1] - summary["window"][0]

    def held(name: str) -> str:
        h = (heldout or {}).get("arms", {}).get(name)
        if not h or h["diff_pct"] is None or heldout["reference"] != "bf16":
            return ""
        return f"; held-out loss {h['diff_pct']:+.2f}% (after step {heldout['step']})"

    return [_verdict_line(a.label, summary["arms"][a.name], DELTA_TARGET_PCT if a.delta else TARGET_PCT)
            + f" (mean of the last {n} steps){held(a.name)}." for a in arms
            if a.name != "bf16" and a.name in summary["arms"]]


def plot(path: str, losses: dict[str, list[float]], arms: list[Arm], reference: str, window: int, title: str,
         heldout: dict[str, list] | None = None):
    """``heldout`` (optional): per arm its ``[step, loss]`` held-out losses, drawn as markers
    joined by a dashed line in the arm's colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, dx) = plt.subplots(2, 1, figsize=(10, 8), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ref_s = smooth(losses[reference], window)
    for i, arm in enumerate(arms):
        y = losses[arm.name]
        x = range(1, len(y) + 1)
        c = colors[i % len(colors)]
        ax.plot(x, y, color=c, alpha=0.25, linewidth=0.6)
        ys = smooth(y, window)
        ax.plot(x, ys, color=c, linewidth=1.6, label=f"{arm.label} (smoothed)")
        points = (heldout or {}).get(arm.name)
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], color=c, linestyle="--", marker="o",
                    markersize=4, linewidth=1.0, label=f"{arm.label} (held-out)")
        if arm.name != reference:
            n = min(len(ys), len(ref_s))
            dx.plot(range(1, n + 1), [a - b for a, b in zip(ys[:n], ref_s[:n])], color=c, label=arm.label)
            ref_points = dict((heldout or {}).get(reference) or [])
            both = [(step, loss - ref_points[step]) for step, loss in points or [] if step in ref_points]
            if both:
                dx.plot([p[0] for p in both], [p[1] for p in both], color=c, linestyle="--", marker="o",
                        markersize=4, linewidth=1.0)
    ax.set_yscale("log")
    from matplotlib.ticker import ScalarFormatter

    for axis_formatter in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        axis_formatter(ScalarFormatter())
    ax.set_ylabel("training loss (raw: faint; smoothed: bold)"
                  + ("; held-out: dashed" if heldout and any(heldout.values()) else ""))
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3, which="both")
    dx.axhline(0.0, color="black", linewidth=0.8)
    dx.set_ylabel(f"smoothed loss − {reference}"
                  + ("\n(held-out: dashed)" if heldout and any(heldout.values()) else ""))
    dx.set_xlabel("step")
    dx.grid(alpha=0.3)
    if len(arms) > 1:
        dx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------- one arm (a worker process)


class GradErrorProbe:
    """What the quantized gradient reduction produced, against the exact reduction of the same
    gradients, at chosen steps (0-based step indices), measured from outside the optimizer.

    At a measured step, for every bucket (and solo parameter) a rank hands to the quantized
    exchange (:class:`qzero.wire.quantized_reduce.QuantizedExchange`):

    * **reduced**: before the exchange starts, each piece of the staged bucket (the rank's
      own gradient values in the reduce dtype) is also summed exactly, in fp32, to its owner
      (``dist.reduce``). When the exchange finishes, the owner's fp32 sum ``Q`` (its own piece
      unquantized plus the others' dequantized payloads) is compared with that exact sum ``E``.
    * **payload**: each payload the rank sends is dequantized with the torch reference
      (:func:`qzero.quant.gradients.dequantize_piece`; exact elements from the side channel,
      as the owner takes them) and compared with the piece it was packed from.

    Per step, the squared error norms and squared reference norms are summed over every piece
    on every rank; the figures are ``sqrt(sum ||Q - E||^2 / sum ||E||^2)`` and the same for
    the payloads. Exact (small-parameter) elements count in both norms with error zero. The
    training itself is unchanged: the probe only reads the buffers."""

    def __init__(self, steps: set[int]):
        self.steps = steps
        self.step = 0
        self.active = 0 in steps
        self.acc = None  # [reduced err^2, reduced ref^2, payload err^2, payload ref^2], float64, on the device
        self.records: list[tuple[int, object]] = []
        self._exact: dict = {}

    def _add(self, i: int, value) -> None:
        import torch

        if self.acc is None:
            self.acc = torch.zeros(4, dtype=torch.float64, device=value.device)
        self.acc[i] += value.to(torch.float64)

    def install(self) -> None:
        import torch
        import torch.distributed as dist

        from qzero.optim import zero
        from qzero.wire.quantized_reduce import QuantizedExchange
        from qzero.quant.gradients import dequantize_piece, hadamard

        probe = self
        launch, finish, step = QuantizedExchange.launch, QuantizedExchange.finish, zero.ZeroOptimizer.step

        def exact_index(piece, device):
            if not piece.exact:
                return None
            return torch.cat([torch.arange(a, b, dtype=torch.int64) for a, b in piece.exact]).to(device)

        def probed_launch(ex, buf, key, parts):
            if not probe.active:
                return launch(ex, buf, key, parts)
            pieces = ex.pieces(key, parts)
            for p in pieces:  # the exact fp32 sum of every piece, to its owner (same order on every rank)
                t = buf[p.offset : p.offset + p.numel].to(torch.float32, copy=True)
                dst = p.dest if ex.pg is None else dist.get_global_rank(ex.pg, p.dest)
                dist.reduce(t, dst=dst, group=ex.pg)
                if p.dest == ex.rank:
                    probe._exact[(id(ex), key)] = t
            pending, sent = launch(ex, buf, key, parts)
            at = 0
            for p in pieces:
                if p.dest == ex.rank:
                    continue
                payload = pending.send[at : at + p.layout.nbytes]
                at += p.layout.nbytes
                src = buf[p.offset : p.offset + p.numel].to(torch.float32)
                got = dequantize_piece(payload, p.layout, p.numel, ex.group_size, ex.fmt)
                if ex.rotation:  # the payload holds the rotated piece: rotate it back
                    got = hadamard(got, ex.rotation)
                idx = exact_index(p, src.device)
                if idx is not None:
                    got[idx] = src[idx]
                d = got - src
                probe._add(2, d.dot(d))
                probe._add(3, src.dot(src))
            return pending, sent

        def probed_finish(ex, pending, key):
            res = finish(ex, pending, key)
            exact = probe._exact.pop((id(ex), key), None)
            if exact is not None and res is not None:
                d = res[0] - exact
                probe._add(0, d.dot(d))
                probe._add(1, exact.dot(exact))
            return res

        def probed_step(opt, *a, **k):
            took = step(opt, *a, **k)
            if probe.active:  # every rank's sums added up (every rank is here: same steps)
                sums = probe.acc if probe.acc is not None else torch.zeros(4, dtype=torch.float64,
                                                                                device=opt.groups[0].device)
                probe.acc = None
                if dist.is_initialized() and dist.get_world_size() > 1:
                    dist.all_reduce(sums)
                e_r, r_r, e_p, r_p = sums.tolist()
                reduced = math.sqrt(e_r / r_r) if r_r > 0 else None
                payload = math.sqrt(e_p / r_p) if r_p > 0 else None
                sent, plain = sum(x.bytes_sent for x in opt.last_reduce), sum(x.plain_bytes for x in opt.last_reduce)
                probe.records.append((probe.step + 1, reduced, payload))
                if not dist.is_initialized() or dist.get_rank() == 0:  # the study reads it even if the arm is stopped
                    print(f"{GRAD_MARK} {probe.step + 1} {reduced!r} {payload!r} {sent} {plain}", flush=True)
            probe.step += 1
            probe.active = probe.step in probe.steps
            return took

        QuantizedExchange.launch, QuantizedExchange.finish = probed_launch, probed_finish
        zero.ZeroOptimizer.step = probed_step

    def result(self, every: int) -> dict | None:
        """The figures per measured step (1-based steps, as the loss curves)."""
        if not self.records:
            return None
        return grad_error_record(self.records, every)


def grad_error_record(rows, every: int) -> dict:
    """``rows``: ``(step, reduced_rel_err, payload_rel_err)`` per measured step."""
    return {
        "steps": [r[0] for r in rows],
        "reduced_rel_err": [r[1] for r in rows],
        "payload_rel_err": [r[2] for r in rows],
        "every": every,
        "definition": GRAD_ERROR_NOTE,
    }


GRAD_ERROR_NOTE = (
    "reduced_rel_err: ||Q - E|| / ||E|| over every rank's pieces, Q = the fp32 sum the quantized reduction gave the "
    "owner (its own piece unquantized plus the other ranks' dequantized payloads), E = the exact fp32 sum of the same "
    "staged gradients (an extra dist.reduce at measured steps only). payload_rel_err: ||deq(payload) - g|| / ||g|| "
    "over every payload sent (torch-reference dequantization of the bytes actually sent, exact elements from the "
    "side channel). Both before averaging and clipping; both over all elements, small parameters (sent exactly) "
    "included."
)


def grad_error_steps(steps: int, every: int) -> set[int]:
    """0-based steps measured: 0, every, 2 * every, ... and the last."""
    if every <= 0:
        return set()
    return set(range(0, steps, every)) | {steps - 1}


class ReplicaErrorProbe:
    """How far the weights every rank holds (the replica in the flat buffers) are from the bf16
    rounding of the fp32 masters, at chosen steps (0-based step indices), read from outside the
    optimizer: ``sqrt(sum ||replica - bf16(master)||^2 / sum ||bf16(master)||^2)`` over every
    rank's own partitions (the replicas are identical, so each partition counts once), and the
    largest ``|replica - bf16(master)|``. Zero for the plain gather; the quantization error of the
    weights for a direct quantized gather; the closed loop's tracking error for a delta gather
    (which must stay flat over the run). A measured step waits for its gather to finish
    (``wait_for_weights``); the bits of the training do not change."""

    def __init__(self, steps: set[int]):
        self.steps = steps
        self.step = 0
        self.records: list[tuple[int, float, float]] = []

    def install(self) -> None:
        import torch
        import torch.distributed as dist

        from qzero.optim import zero

        probe, step = self, zero.ZeroOptimizer.step

        def probed_step(opt, *a, **k):
            took = step(opt, *a, **k)
            if probe.step in probe.steps:
                opt.wait_for_weights()
                sums = torch.zeros(3, dtype=torch.float64, device=opt.groups[0].device)
                for g in opt.groups:
                    t = g.master.to(g.dtype).to(torch.float64)
                    d = g.own.to(torch.float64) - t
                    sums += torch.stack([d.dot(d), t.dot(t), d.abs().max() if d.numel() else d.new_zeros(())])
                if dist.is_initialized() and dist.get_world_size() > 1:
                    big = sums[2:].clone()
                    dist.all_reduce(sums)
                    dist.all_reduce(big, op=dist.ReduceOp.MAX)
                    sums[2] = big[0]
                err, ref, worst = sums.tolist()
                rel = math.sqrt(err / ref) if ref > 0 else 0.0
                probe.records.append((probe.step + 1, rel, worst))
                if not dist.is_initialized() or dist.get_rank() == 0:
                    print(f"{REPLICA_MARK} {probe.step + 1} {rel!r} {worst!r}", flush=True)
            probe.step += 1
            return took

        zero.ZeroOptimizer.step = probed_step

    def result(self, every: int) -> dict | None:
        return replica_error_record(self.records, every) if self.records else None


def replica_error_record(rows, every: int) -> dict:
    """``rows``: ``(step, rel_err, max_abs_err)`` per measured step."""
    return {"steps": [r[0] for r in rows], "rel_err": [r[1] for r in rows], "max_abs_err": [r[2] for r in rows],
            "every": every, "definition": REPLICA_ERROR_NOTE}


REPLICA_ERROR_NOTE = (
    "rel_err: ||replica - bf16(master)|| / ||bf16(master)|| over every rank's own partition of the flat buffers (the "
    "weights every rank holds after the step's gather against the bf16 rounding of the fp32 masters); max_abs_err: "
    "the largest |replica - bf16(master)|. Small parameters (sent exactly) included."
)


def worker(settings_json: str, out_path: str, threads: int, rank: int = 0, port: int = 0, grad_every: int = 0,
           share_gpu: bool = False, replica_every: int = 0) -> None:
    """Run one rank of one arm in this process through qzero.app.train.launch (rank 0 prints a
    progress line per step on stdout). World size 1: the process sets up its own rank 0 of 1.
    Larger: the study started ``world_size`` such processes with ``rank`` and one ``port``;
    with ``share_gpu`` all of them on the arm's one GPU, their collectives through each other's
    device memory (``one_gpu.SharedGPU``)."""
    import torch

    if share_gpu:  # before qzero is imported: it must see the routed collectives
        import torch.distributed as dist

        from one_gpu import route_collectives

        route_collectives()
    from qzero.app import train

    settings = train.TrainSettings(**json.loads(settings_json))
    world = settings.world_size
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0" if share_gpu else str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port or train._free_port()))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS handle
    if threads > 0:
        torch.set_num_threads(threads)
    if share_gpu:
        from one_gpu import share_one_gpu

        torch.cuda.set_device(0)
        dist.init_process_group("gloo")
        share_one_gpu()

    class Report:  # stands in for train._progress: one line per step
        def __init__(self, total):
            self.n = 0

        def update(self, loss, seconds, saved):
            self.n += 1
            print(f"{MARK} {self.n} {loss!r} {seconds!r}", flush=True)

        def close(self):
            pass

    if not hasattr(train, "_progress"):
        print("note: qzero.app.train has no _progress to replace: no per-step progress from this arm", file=sys.stderr)
    train._progress = Report
    probe = replicas = None
    if world > 1 and settings.zero.zero_quantized_gradients and grad_every > 0:
        probe = GradErrorProbe(grad_error_steps(settings.steps, grad_every))
        probe.install()
    if settings.backend == "qzero" and settings.zero.zero_quantized_weights and replica_every > 0:
        replicas = ReplicaErrorProbe(grad_error_steps(settings.steps, replica_every))
        replicas.install()
    train.launch(settings, out_path, show_progress=True)
    extra = {"grad_error": probe.result(grad_every) if probe is not None else None,
             "replica_error": replicas.result(replica_every) if replicas is not None else None}
    if rank == 0 and any(v is not None for v in extra.values()):
        with open(out_path) as f:
            record = json.load(f)
        record.update({k: v for k, v in extra.items() if v is not None})
        with open(out_path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(out_path + ".tmp", out_path)
    if world == 1:
        return
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    # as qzero.app.train's own ranks do: leave without the interpreter's finalization (gloo's
    # threads can abort it now and then after a run that succeeded)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------------- the study


class Running:
    """One arm: its processes (rank 0 first; rank 0's stdout carries the progress lines)."""

    def __init__(self, arm: Arm, procs: list[subprocess.Popen], log, device_label: str, record: str):
        self.arm, self.procs, self.log, self.device_label, self.record = arm, procs, log, device_label, record
        self.proc = procs[0]
        self.terminated = False
        self.losses: list[float] = []
        self.seconds: list[float] = []
        self.grad_rows: list[tuple] = []  # streamed gradient-error lines: (step, reduced, payload)
        self.grad_bytes: tuple[int, int] | None = None  # (sent, plain) of the last measured step
        self.replica_rows: list[tuple] = []  # streamed replica-error lines: (step, rel_err, max_abs_err)
        self.lines: queue.Queue = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def drain(self):
        while True:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                return
            if line is None:
                return
            if line.startswith(MARK):
                _, step, loss, secs = line.split()
                self.losses.append(float(loss))
                self.seconds.append(float(secs))
            elif line.startswith(GRAD_MARK):
                _, step, reduced, payload, sent, plain = line.split()
                num = lambda x: None if x == "None" else float(x)  # noqa: E731
                self.grad_rows.append((int(step), num(reduced), num(payload)))
                self.grad_bytes = (int(sent), int(plain))
            elif line.startswith(REPLICA_MARK):
                _, step, rel, worst = line.split()
                self.replica_rows.append((int(step), float(rel), float(worst)))
            else:
                self.log.write(line)
                self.log.flush()

    def poll(self) -> int | None:
        """None while any rank runs; then the first non-zero exit status (rank order), else 0."""
        codes = [p.poll() for p in self.procs]
        if any(c is None for c in codes):
            return None
        return next((c for c in codes if c != 0), 0)

    def failed_rank(self) -> bool:
        """A rank ended with an error while another still runs (it would wait for it forever)."""
        codes = [p.poll() for p in self.procs]
        return any(c not in (None, 0) for c in codes) and any(c is None for c in codes)

    def terminate(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()


def count_params(preset: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from qzero.app.workload import model_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(preset))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def estimate_seconds(params: int, tokens_per_rank: int, steps: int, arms_per_device: int, world: int = 1) -> float:
    """6 N T FLOPs per rank and step at EFFECTIVE_FLOPS, arms sharing a device one after another;
    at world > 1 plus each rank's plain bf16 gradient and weight traffic at LINK_BYTES_PER_S."""
    compute = 6 * params * tokens_per_rank * steps * arms_per_device / EFFECTIVE_FLOPS
    link = 0.0 if world == 1 else 2 * params * 2 * (world - 1) / world * steps * arms_per_device / LINK_BYTES_PER_S
    return compute + link


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default=None,
                    help=f"comma list: bf16 or <fmt>-g<N>, each optionally +gq-<fmt>-g<N> (quantized gradient "
                         f"reduction, world size >= 2 only) (default: {DEFAULT_ARMS}; with --world-size 2 or "
                         f"more: {DP_ARMS})")
    ap.add_argument("--world-size", type=int, default=1,
                    help="data-parallel ranks per arm (default 1: every arm one process). N > 1: every arm is one "
                         "DP-N job; on CUDA rank r of every arm uses GPU r (of --gpus)")
    ap.add_argument("--share-gpu", action="store_true",
                    help="with --world-size N > 1 on CUDA: all ranks of an arm on one GPU (arms spread over the "
                         "GPUs), their collectives through each other's device memory (NCCL refuses two ranks on "
                         "one GPU; benchmarks/scripts/one_gpu.py). The same numerics as on N GPUs; "
                         "step times not comparable")
    ap.add_argument("--preset", default="qwen3-125m-byte")
    ap.add_argument("--data", default=None, help="text file to train on (default: the stdlib sources corpus)")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=16,
                    help="sequences per step, all ranks together (the global batch); each of --world-size ranks "
                         "trains on micro-batch / world-size of them, the same sequences at any world size")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--lr-warmup", type=int, default=0, metavar="N",
                    help="linear learning-rate warmup over the first N steps, in every arm (default 0: constant lr)")
    ap.add_argument("--clip", type=float, default=1.0, help="global-norm gradient clipping (0: off)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--gpus", default=None, help="GPU indices to spread the arms over (default: all visible)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads per arm (default: cores / arms)")
    ap.add_argument("--last", type=int, default=100, help="final loss = mean of this many last steps")
    ap.add_argument("--smooth", type=int, default=50, help="moving-average window of the smoothed curves")
    ap.add_argument("--time-limit", type=float, default=0, help="stop arms after this many seconds (0: none)")
    ap.add_argument("--grad-error-every", type=int, default=100,
                    help="gradient-quantization arms: measure the gradient error every this many steps (and at "
                         "the last; 0: never)")
    ap.add_argument("--replica-error-every", type=int, default=20,
                    help="quantized arms: measure ||replica - bf16(master)|| / ||bf16(master)|| every this many steps "
                         "(and at the last; 0: never). A measured step waits for its gather to finish")
    ap.add_argument("--heldout", type=float, default=0.05,
                    help="hold out this fraction of the data (its end) and measure every arm's loss on it "
                         "(default 0.05; 0: none)")
    ap.add_argument("--eval-every", type=int, default=200,
                    help="with --heldout: measure the held-out loss every this many steps (and after the last)")
    ap.add_argument("--eval-sequences", type=int, default=32,
                    help="held-out windows of --seq-len + 1 tokens the held-out loss is measured on (default 32)")
    ap.add_argument("--progress-every", type=float, default=10.0, help="seconds between progress lines")
    ap.add_argument("--out", default="OUT/convergence")
    ap.add_argument("--render", default=None, metavar="JSON",
                    help="only rewrite convergence.md/.png (next to JSON) from a saved convergence.json")
    ap.add_argument("--from-arms", default=None, metavar="DIR",
                    help="rebuild convergence.json in --out from the arm_<name>.json records in DIR (the arms of "
                         "--arms that have one, in that order), then render it")
    ap.add_argument("--wall-s", type=float, default=None, help="with --from-arms: the run's wall time (seconds)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="with --from-arms: an environment field of the run (repeatable; date= also sets the date)")
    ap.add_argument("--note", default=None, help="with --from-arms: a note stored in the JSON and shown in the .md")
    ap.add_argument("--worker", nargs=8, metavar=("SETTINGS", "OUT", "THREADS", "RANK", "PORT", "GRAD_EVERY", "SHARE",
                                                  "REPLICA_EVERY"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.arms is None:
        args.arms = DEFAULT_ARMS if args.world_size == 1 else DP_ARMS
    if args.worker is None and args.render is None:
        for name in ("steps", "seq_len", "micro_batch", "last", "smooth"):
            if getattr(args, name) < 1:
                ap.error(f"--{name.replace('_', '-')} must be at least 1")
        try:
            args.arm_list = parse_arms(args.arms)
        except ValueError as e:
            ap.error(str(e))
        if args.world_size < 1:
            ap.error(f"--world-size must be at least 1, got {args.world_size}")
        if args.micro_batch % args.world_size:
            ap.error(f"--micro-batch {args.micro_batch} (the global batch) is not a multiple of --world-size "
                     f"{args.world_size}")
        if args.share_gpu and args.world_size < 2:
            ap.error(f"--share-gpu puts the ranks of a DP arm on one GPU: it needs --world-size 2 or more, "
                     f"got {args.world_size}")
        if args.share_gpu and args.device == "cpu":
            ap.error("--share-gpu is for CUDA (on the CPU every rank already shares the machine): drop it or use "
                     "--device cuda")
        if not 0 <= args.heldout < 1:
            ap.error(f"--heldout must be a fraction of the data, 0 <= heldout < 1, got {args.heldout}")
        if args.eval_every < 0 or args.eval_sequences < 1:
            ap.error(f"--eval-every must be 0 or more and --eval-sequences at least 1, got {args.eval_every} and "
                     f"{args.eval_sequences}")
        if args.grad_error_every < 0:
            ap.error(f"--grad-error-every must be 0 or more, got {args.grad_error_every}")
        if not 0 <= args.lr_warmup <= args.steps:
            ap.error(f"--lr-warmup must be from 0 to --steps ({args.steps}) steps, got {args.lr_warmup}")
        gq = [a.name for a in args.arm_list if a.grad_quantized]
        if gq and args.world_size < 2 and args.from_arms is None:
            ap.error(f"arm(s) {', '.join(gq)} quantize the gradient reduction, which sends nothing at world size 1 "
                     "(a rank's own slice is never quantized): use --world-size 2")
    args.env_fields = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            ap.error(f"--env expects KEY=VALUE, got {item!r}")
        args.env_fields[key.strip()] = value
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        settings, out, threads, rank, port, every, share, replica_every = args.worker
        worker(settings, out, int(threads), int(rank), int(port), int(every), share == "1", int(replica_every))
        return 0
    if args.render is not None:
        with open(args.render) as f:
            render(json.load(f), os.path.dirname(os.path.abspath(args.render)))
        return 0
    if args.from_arms is not None:
        records = {}
        for arm in args.arm_list:
            path = os.path.join(args.from_arms, f"arm_{arm.name}.json")
            if os.path.exists(path):
                with open(path) as f:
                    records[arm.name] = json.load(f)
        if not records:
            print(f"no arm_<name>.json record in {args.from_arms} for the arms {args.arms}", file=sys.stderr)
            return 1
        study = study_from_records(
            records, args.arm_list, gpus=[int(g) for g in args.gpus.split(",")] if args.gpus else None,
            last=args.last, smooth_window=args.smooth, wall_s=args.wall_s, environment=args.env_fields,
            note=args.note, source=args.from_arms, shared=args.share_gpu)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "convergence.json"), "w") as f:  # compact: it sits next to the records
            json.dump(study, f, separators=(",", ":"))
        render(study, args.out)
        return 0

    import torch

    from qzero.app.qualify.env import describe
    from qzero.app.train import resolve_device, validate

    arms: list[Arm] = args.arm_list
    world = args.world_size
    first = arm_settings(arms[0], args)
    device = resolve_device(first)
    args.device = device
    # ranks sharing a GPU need one GPU per arm, not one per rank
    validate(dataclasses.replace(first, device=device, world_size=1 if args.share_gpu else first.world_size))
    if device == "cuda":
        gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else list(range(torch.cuda.device_count()))
        if len(gpus) < world and not args.share_gpu:
            raise SystemExit(f"--world-size {world} needs {world} GPUs; --gpus / the visible GPUs give {gpus} "
                             "(--share-gpu runs an arm's ranks on one GPU)")
        # world 1 (or ranks sharing a GPU): 5 arms on 2 GPUs, 3 + 2; world 2: all on both
        slots = arm_slots(len(arms), "cuda", gpus, 1 if args.share_gpu else world)
        visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    else:
        slots, visible = ["cpu"] * len(arms), []
    threads = args.threads or max(1, (os.cpu_count() or 1) // (len(arms) * world))  # the ranks share the cores
    os.makedirs(args.out, exist_ok=True)
    params = count_params(args.preset)
    tokens = args.micro_batch * args.seq_len
    per_device = max(slots.count(s) for s in set(slots))
    est = estimate_seconds(params, tokens // world, args.steps, per_device, world)
    print(f"convergence: preset {args.preset} ({params:,} parameters), {len(arms)} arms at world size {world}, "
          f"{args.steps} steps of {args.micro_batch} x {args.seq_len} tokens"
          + (f" ({args.micro_batch // world} sequences per rank)" if world > 1 else "")
          + f", bf16, lr {args.lr:g}" + (f" (warmup {args.lr_warmup} steps)" if args.lr_warmup else "")
          + f", seed {args.seed}, device {device}", flush=True)
    if device == "cuda":
        print(f"  estimate: 6 x {params / 1e6:.1f}M x {tokens // world} tokens = "
              f"{6 * params * tokens / world / 1e12:.2f} TFLOP/step per rank; at {EFFECTIVE_FLOPS / 1e12:.0f} TFLOP/s "
              f"effective per GPU and {per_device} arms on the busiest GPU"
              + (f", plus {2 * params * 2 * (world - 1) / world / 1e6:.0f} MB of plain gradient and weight traffic "
                 f"per rank and step at {LINK_BYTES_PER_S / 1e9:.0f} GB/s" if world > 1 else "")
              + f": ~{est:.0f} s of training (plus ~30-60 s of start-up)", flush=True)

    started = time.time()
    running: list[Running] = []
    ports: set[int] = set()
    for arm, slot in zip(arms, slots):
        settings = dataclasses.replace(arm_settings(arm, args), device=device)
        env = dict(os.environ, PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE=os.environ.get("NCCL_NVLS_ENABLE", "0"))
        if slot.startswith("cuda:"):  # the arm sees its GPUs (indices into the visible ones); rank r uses the r-th
            indices = [int(i) for i in slot.split(":")[1].split(",")]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[i] if i < len(visible) else str(i) for i in indices)
        record = os.path.join(args.out, f"arm_{arm.name}.json")
        if os.path.exists(record):
            os.remove(record)
        log = open(os.path.join(args.out, f"arm_{arm.name}.log"), "a")  # every rank appends to it
        log.truncate(0)
        port = 0
        if world > 1:  # one rendezvous port per arm
            from qzero.app.train import _free_port

            port = _free_port()
            while port in ports:
                port = _free_port()
            ports.add(port)
        procs = []
        for rank in range(world):
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(dataclasses.asdict(settings)),
                   record, str(threads), str(rank), str(port), str(args.grad_error_every),
                   "1" if args.share_gpu and device == "cuda" else "0", str(args.replica_error_every)]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE if rank == 0 else log, stderr=log, text=True,
                                          env=env))
        running.append(Running(arm, procs, log, slot, record))
        print(f"  started {arm.name:12s} on {slot} (pid{'s' if world > 1 else ''} "
              f"{' '.join(str(p.pid) for p in procs)})", flush=True)

    stopped = False
    last_report = 0.0
    while True:
        for r in running:
            r.drain()
            if r.failed_rank():  # its other ranks would wait for it until a collective times out
                r.terminate()
        done = all(r.poll() is not None for r in running)
        now = time.time() - started
        if done or now - last_report >= args.progress_every:
            last_report = now
            parts = [f"{r.arm.name} {len(r.losses)}/{args.steps}"
                     + (f" loss {r.losses[-1]:.3f}" if r.losses else "")
                     + ("" if r.poll() is None else
                        " done" if r.poll() == 0 else " stopped" if r.terminated else " FAILED")
                     for r in running]
            print(f"  [{now:5.0f} s] " + " | ".join(parts), flush=True)
        if done:
            break
        if args.time_limit and now > args.time_limit and not stopped:
            print(f"  time limit {args.time_limit:.0f} s reached: stopping the arms still running", flush=True)
            for r in running:
                if r.poll() is None:
                    r.terminate()
                    r.terminated = True
            stopped = True
        time.sleep(0.5)
    for r in running:
        for p in r.procs:
            p.wait()
        r.reader.join(timeout=10)  # the rest of its stdout
        r.drain()
        r.log.close()
    wall = time.time() - started

    records = {}
    for r in running:
        if os.path.exists(r.record):
            with open(r.record) as f:
                records[r.arm.name] = json.load(f)
            r.losses = records[r.arm.name]["losses"]  # the run's own record (the same values as streamed)
    failed = [r for r in running if not r.losses or (r.poll() != 0 and not r.terminated)]
    for r in failed:
        print(f"arm {r.arm.name} failed (exit {r.poll()}); last lines of {r.log.name}:", file=sys.stderr)
        with open(r.log.name) as f:
            print("".join(f.readlines()[-15:]), file=sys.stderr)
    if not any(r.losses for r in running):
        return 1

    env_info = describe(device)
    env_info["command"] = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    data_desc = args.data or DEFAULT_DATA
    study = {
        "date": env_info["date"],
        "complete": all(len(r.losses) == args.steps for r in running) and not failed,
        "wall_s": wall,
        "preset": args.preset,
        "params": params,
        "data": data_desc,
        "steps": args.steps,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "lr": args.lr,
        "lr_warmup": args.lr_warmup,
        "clip": args.clip,
        "seed": args.seed,
        "last": args.last,
        "smooth": args.smooth,
        "world_size": world,
        "world_size_note": world_note(world, args.share_gpu and device == "cuda"),
        "arm_devices": {r.arm.name: r.device_label for r in running},
        "estimate_s": est if device == "cuda" else None,
        "estimate_basis": estimate_basis(per_device, world),
        "settings": {r.arm.name: dataclasses.asdict(dataclasses.replace(arm_settings(r.arm, args), device=device))
                     for r in running},
        "target": {"arm": TARGET_ARM, "max_abs_diff_pct": TARGET_PCT},
        "arms": {
            r.arm.name: arm_entry(r.arm, records.get(r.arm.name) or streamed_record(r, args.grad_error_every),
                                  losses=r.losses, exit_code=r.poll(), step_seconds=r.seconds)
            for r in running
        },
        "environment": env_info,
    }
    if world > 1:
        study["micro_batch_per_rank"] = args.micro_batch // world
    usable = [a for a in arms if study["arms"][a.name]["losses"]]
    losses = {a.name: study["arms"][a.name]["losses"] for a in usable}
    study["summary"] = final_losses(losses, "bf16" if "bf16" in losses else usable[0].name, args.last)
    study["heldout_summary"] = final_heldout(study["arms"], study["summary"]["reference"])
    study["target"]["verdict"] = verdict(study["summary"])
    with open(os.path.join(args.out, "convergence.json"), "w") as f:
        json.dump(study, f, indent=1)
    render(study, args.out)
    return 0 if not failed else 1


def streamed_record(r: Running, every: int) -> dict:
    """What an arm without a record (stopped by --time-limit) streamed: its gradient errors and bytes."""
    out = {}
    if r.grad_rows:
        out["grad_error"] = grad_error_record(r.grad_rows, every)
    if r.grad_bytes is not None:
        out["grad_bytes_sent_per_step"], out["grad_plain_bytes_per_step"] = r.grad_bytes
    if r.replica_rows:
        out["replica_error"] = replica_error_record(r.replica_rows, 0)
    return out


def world_note(world: int, shared: bool = False) -> str:
    if world == 1:
        return GROUPS_NOTE
    where = ("all ranks of an arm on one GPU, their collectives through each other's device memory: the values "
             f"NCCL delivers at world size {world}, step times not comparable" if shared else
             "on CUDA rank r on the r-th GPU of the arm's, the arms sharing the GPUs")
    return (f"ZeRO-2 partitions over {world} ranks, the gradients reduced and the weights gathered between them "
            f"({where}). The global batch of a step "
            f"is split evenly over the ranks, so every arm trains on the sequences a world-1 run of the same "
            f"--micro-batch does.")


def estimate_basis(per_device, world: int) -> str:
    return (f"6 * params * tokens/step/rank FLOPs at {EFFECTIVE_FLOPS:.3g} FLOP/s per GPU, {per_device} arms "
            f"sharing the busiest device"
            + (f", plus plain bf16 gradient + weight bytes per rank at {LINK_BYTES_PER_S:.3g} B/s"
               if world > 1 else ""))


def arm_entry(arm: Arm, record: dict, *, losses, exit_code, step_seconds) -> dict:
    """The study's entry for one arm: what the run streamed and what its record holds."""
    return {
        "label": arm.label,
        "steps_completed": len(losses),
        "exit_code": exit_code,
        "losses": losses,
        "step_seconds": step_seconds,
        "grad_norms": record.get("grad_norms"),
        "heldout_losses": record.get("heldout_losses"),  # [step, loss]; None: not measured (older records too)
        "peak_allocated_bytes": record.get("peak_allocated_bytes"),
        "bytes_sent_per_step": record.get("bytes_sent_per_step"),
        "plain_bytes_per_step": record.get("plain_bytes_per_step"),
        "grad_bytes_sent_per_step": record.get("grad_bytes_sent_per_step"),
        "grad_plain_bytes_per_step": record.get("grad_plain_bytes_per_step"),
        "grad_error": record.get("grad_error"),
        "replica_error": record.get("replica_error"),
        "weight_bytes_per_param": record.get("weight_bytes_per_param"),
        "replicas_identical": record.get("replicas_identical"),
        "median_step_s": _median(record.get("step_times")),
    }


def arm_slots(n_arms: int, device: str, gpus: list[int] | None, world: int = 1) -> list[str | None]:
    """The devices of each arm as the study assigns them: world 1, round-robin over ``gpus`` (5 arms
    on 2 GPUs: 3 + 2); world N, round-robin over consecutive groups of N of ``gpus`` (``cuda:0,1``:
    rank r on the r-th), every arm on both GPUs of a 2-GPU host at N = 2."""
    if device != "cuda":
        return [device] * n_arms
    if not gpus:
        return [None] * n_arms
    if world == 1:
        return [f"cuda:{gpus[i % len(gpus)]}" for i in range(n_arms)]
    groups = [gpus[i : i + world] for i in range(0, len(gpus) - world + 1, world)]
    return [f"cuda:{','.join(map(str, groups[i % len(groups)]))}" for i in range(n_arms)]


def study_from_records(records: dict[str, dict], arm_order: list[Arm], *, gpus: list[int] | None = None,
                       last: int = 100, smooth_window: int = 50, wall_s: float | None = None,
                       environment: dict | None = None, note: str | None = None, source: str | None = None,
                       shared: bool = False) -> dict:
    """A study record (the schema ``main`` writes) rebuilt from per-arm records (``qzero.app.train.launch``'s
    output, ``arm_<name>.json``) of a run whose ``convergence.json`` was lost. ``arm_order`` is the run's
    ``--arms`` (it fixes the arms' GPUs, given the run's ``gpus``); arms without a record are left out and
    listed under ``rebuilt_from``. What the records do not hold is null: exit codes, the streamed per-step
    seconds (the records' ``step_times`` give ``median_step_s``), and whatever ``environment`` / ``wall_s``
    leave out."""
    from qzero.app.train import TrainSettings, flat_settings

    present = [a for a in arm_order if a.name in records]
    if not present:
        raise ValueError("no arm has a record")
    first = records[present[0].name]
    flat = {a.name: flat_settings(records[a.name]["settings"]) for a in present}  # older records too
    # what the arms share: every setting but the gather's format (and gather-ahead, which follows it)
    own = (*Arm("", False).zero_fields(), "overlap_param_gather", "zero_quantized_weights_delta")
    # a setting an older record lacks is the TrainSettings default the code then had
    defaults = {f.name: f.default for f in dataclasses.fields(TrainSettings)
                if f.default is not dataclasses.MISSING}
    for arm in present:
        s, f = flat[arm.name], flat[present[0].name]
        diff = [k for k in sorted(set(s) | set(f))
                if k not in own and s.get(k, defaults.get(k)) != f.get(k, defaults.get(k))]
        if diff or records[arm.name].get("params") != first.get("params"):
            raise ValueError(f"arm {arm.name}: its record differs from {present[0].name}'s in {diff or ['params']}")
        q, fmt, group = (s["zero_quantized_weights"], s["zero_quantized_weights_format"],
                         s["zero_quantized_weights_group_size"])
        delta = bool(s.get("zero_quantized_weights_delta", False))
        if bool(q) != arm.quantized or (arm.quantized and (fmt, group, delta) != (arm.fmt, arm.group_size, arm.delta)):
            raise ValueError(f"arm {arm.name}: its record's settings are quantized={q} fmt={fmt} group_size={group} "
                             f"delta={delta}")
        gq = bool(s.get("zero_quantized_gradients", False))
        gfmt, ggroup = s.get("zero_quantized_gradients_format"), s.get("zero_quantized_gradients_group_size")
        if gq != arm.grad_quantized or (gq and (gfmt, ggroup) != (arm.grad_fmt, arm.grad_group_size)):
            raise ValueError(f"arm {arm.name}: its record's settings are zero_quantized_gradients={gq} "
                             f"format={gfmt} group_size={ggroup}")
        own_fields = arm.zero_fields()
        for key in ("zero_quantized_gradients_rotation", "zero_quantized_gradients_error_feedback"):
            if gq and s.get(key, own_fields[key] if key.endswith("feedback") else "none") != own_fields[key]:
                raise ValueError(f"arm {arm.name}: its record's {key} is {s.get(key)!r}, the arm's {own_fields[key]!r}")
    st = flat[present[0].name]
    device = st["device"]
    world = st.get("world_size") or first.get("world_size") or 1
    slots = dict(zip([a.name for a in arm_order], arm_slots(len(arm_order), device, gpus, 1 if shared else world)))
    known = [s for s in slots.values() if s]
    per_device = max(known.count(s) for s in set(known)) if known else None
    params = first["params"]
    est = (estimate_seconds(params, st["micro_batch"] * st["seq_len"], st["steps"], per_device, world)
           if device == "cuda" and per_device else None)
    env_info = dict(environment or {})
    clip = st.get("gradient_clipping", 0.0)
    study = {
        "date": env_info.get("date"),
        "complete": all(len(records[a.name]["losses"]) == st["steps"] for a in present),
        "wall_s": wall_s,
        "preset": st["preset"],
        "params": params,
        "data": st["data"] or DEFAULT_DATA,
        "steps": st["steps"],
        "seq_len": st["seq_len"],
        "micro_batch": st["micro_batch"] * world,  # the global batch (the records hold a rank's)
        "lr": st["lr"],
        "lr_warmup": st.get("lr_warmup", 0),  # arms recorded before the setting existed ran without warmup
        "clip": clip,
        "seed": st["seed"],
        "last": last,
        "smooth": smooth_window,
        "world_size": world,
        "world_size_note": world_note(world, shared and device == "cuda"),
        "arm_devices": {a.name: slots[a.name] for a in present},
        "estimate_s": est,
        "estimate_basis": estimate_basis(per_device, world),
        "settings": {a.name: records[a.name]["settings"] for a in present},
        "target": {"arm": TARGET_ARM, "max_abs_diff_pct": TARGET_PCT},
        "arms": {a.name: arm_entry(a, records[a.name], losses=records[a.name]["losses"], exit_code=None,
                                   step_seconds=None)
                 for a in present},
        "environment": env_info,
        "rebuilt_from": {
            "records": [f"arm_{a.name}.json" for a in present],
            "source": source,
            "missing_arms": [a.name for a in arm_order if a.name not in records],
            "not_in_records": "exit_code and step_seconds (null); median_step_s is the median of the record's "
                              "step_times (warm-up steps left out); arm_devices follow --arms and --gpus",
        },
    }
    if world > 1:
        study["micro_batch_per_rank"] = st["micro_batch"]
    if note:
        study["note"] = note
    losses = {a.name: study["arms"][a.name]["losses"] for a in present}
    study["summary"] = final_losses(losses, "bf16" if "bf16" in losses else present[0].name, last)
    study["heldout_summary"] = final_heldout(study["arms"], study["summary"]["reference"])
    study["target"]["verdict"] = verdict(study["summary"])
    return study


DEFAULT_DATA = "the standard-library *.py sources of this Python (qzero.app.workload.load_corpus default), byte level"


def render(study: dict, out: str) -> None:
    """Write convergence.md and convergence.png from a study record; print the table last."""
    arms = [parse_arm(name) for name, a in study["arms"].items() if a["losses"]]
    losses = {a.name: study["arms"][a.name]["losses"] for a in arms}
    summary = study["summary"]
    reference = summary["reference"]
    payload = {name: a["bytes_sent_per_step"] / a["plain_bytes_per_step"] for name, a in study["arms"].items()
               if a.get("bytes_sent_per_step") and a.get("plain_bytes_per_step")}
    world = study.get("world_size", 1)
    grad = None
    if world > 1:  # the gradient reduction sends something only between ranks
        grad = {}
        for name, a in study["arms"].items():
            sent, plain = a.get("grad_bytes_sent_per_step"), a.get("grad_plain_bytes_per_step")
            errs = [e for e in ((a.get("grad_error") or {}).get("reduced_rel_err") or []) if e is not None]
            grad[name] = (sent / plain if sent is not None and plain else None, sum(errs) / len(errs) if errs else None)
    heldout = final_heldout({a.name: study["arms"][a.name] for a in arms}, reference)
    table = markdown_table(summary, arms, payload, grad, heldout)
    lines = verdicts(summary, arms, heldout)
    env_info = study["environment"]
    wall = f"{study['wall_s']:.0f} s" if study.get("wall_s") is not None else "not recorded"
    steps_done = ", ".join(f"{name} {a['steps_completed']}" for name, a in study["arms"].items())
    try:
        title = (f"{study['preset']} ({study['params'] / 1e6:.1f}M params), {study['micro_batch']}x{study['seq_len']} "
                 f"tokens/step, bf16, lr {study['lr']:g}" + (f", DP{world}" if world > 1 else ""))
        plot(os.path.join(out, "convergence.png"), losses, arms, reference, study["smooth"], title,
             {a.name: study["arms"][a.name].get("heldout_losses") for a in arms})
        plotted = "Curves: `convergence.png`"
    except ImportError as e:  # no matplotlib here: render the plot elsewhere with --render
        print(f"no plot ({e}); run benchmarks/scripts/convergence.py --render {out}/convergence.json "
              "where matplotlib is installed")
        plotted = "No plot (matplotlib missing)"
    md = [
        f"# Convergence: quantized weight gather{' and gradient reduction' if world > 1 else ''} vs bf16 "
        f"({study['date']})",
        "",
        f"Model `{study['preset']}` ({study['params']:,} parameters, Qwen3-shaped, random init), data: "
        f"{study['data']}; {study['steps']} steps of {study['micro_batch']} x {study['seq_len']} tokens, bf16, "
        f"ZeRO-2, AdamW lr {study['lr']:g} ({_schedule(study)}, no weight decay), gradient clipping {study['clip']:g}, "
        f"seed {study['seed']} — the same model, batches and seed in every arm. "
        + ("Each arm is an independent world-size-1 run: " if world == 1 else
           f"Each arm is a DP{world} run ({study['micro_batch'] // world} sequences per rank): ")
        + f"{study['world_size_note']} Devices: "
        + ", ".join(f"{name} {dev or 'not recorded'}" for name, dev in study["arm_devices"].items()) + ".",
        "",
        f"Environment: {env_info.get('device', 'not recorded')}, torch {env_info.get('torch', 'not recorded')}, "
        f"qzero {env_info.get('qzero', 'not recorded')}, transformers {env_info.get('transformers', 'not recorded')}. "
        f"Wall time {wall}.",
        "",
    ]
    if study.get("note"):
        md += [f"**Note:** {study['note']}", ""]
    if not study["complete"]:
        md += [f"**Incomplete:** steps completed per arm: {steps_done}; the arms are compared over the first "
               f"{summary['steps_compared']} steps.", ""]
    md += [table, ""]
    if lines:
        md += ["\n".join(f"- {x}" for x in lines), ""]
    md += [f"Δ = arm − {reference}; paired SE = standard error of the per-step differences over the window "
           "(the arms see the same batches; steps are autocorrelated, so read it as a lower bound); gather "
           "bytes vs plain = the payload of the post-step gather per step relative to a plain bf16 gather "
           "(below 1: the weights went through the quantizer). "
           f"{plotted}; every per-step loss: `convergence.json`.", ""]
    if heldout:
        st = study["settings"][next(iter(heldout["arms"]))]
        md += [f"Held-out loss = the mean next-token loss on {st.get('eval_sequences')} fixed windows of "
               f"{study['seq_len'] + 1} tokens of the last {st.get('heldout', 0):g} of the data, which no arm trains "
               f"on, measured every {st.get('eval_every')} steps and after the last; final = after step "
               f"{heldout['step']}, the last step every arm measured (— : no held-out loss). Every measurement: "
               "`convergence.json` (`heldout_losses` of each arm).", ""]
    if grad is not None:
        md += [f"Grad bytes vs plain = the gradient bytes a rank sends per step relative to the plain bf16 reduction "
               f"(below 1: the gradients went through the quantizer). Grad rel. error = the mean over the measured "
               f"steps of {GRAD_ERROR_NOTE}", ""]
        for name, a in study["arms"].items():
            ge = a.get("grad_error")
            if ge:
                fmt = lambda x: "—" if x is None else f"{x:.4f}"  # noqa: E731
                md += [f"Gradient error of {a['label']} (step: reduced / payload): " + ", ".join(
                    f"{st}: {fmt(r)} / {fmt(p)}"
                    for st, r, p in zip(ge["steps"], ge["reduced_rel_err"], ge["payload_rel_err"])) + ".", ""]
    md += replica_error_lines(study, out)
    with open(os.path.join(out, "convergence.md"), "w") as f:
        f.write("\n".join(md))
    print(f"wrote {out}/convergence.json, convergence.md, convergence.png (wall {wall})")
    if not study["complete"]:
        print(f"INCOMPLETE: steps completed per arm: {steps_done}; compared over the first "
              f"{summary['steps_compared']} steps")
    for x in lines:
        print(x)
    print(table)


def replica_error_lines(study: dict, out: str) -> list[str]:
    """The replica error of every arm that measured it: a plot (``replica_error.png``) and a line each
    (mean, first and last measured value: a delta arm's must stay flat), and bytes per parameter."""
    rows = {name: a for name, a in study["arms"].items() if (a.get("replica_error") or {}).get("steps")}
    if not rows:
        return []
    lines = [f"Replica error, {REPLICA_ERROR_NOTE} "
             f"Measured every {next(iter(rows.values()))['replica_error']['every']} steps:", ""]
    for name, a in rows.items():
        e = a["replica_error"]["rel_err"]
        per_param = a.get("weight_bytes_per_param")
        lines.append(f"- {a['label']}: mean {sum(e) / len(e):.3e}, first {e[0]:.3e}, last {e[-1]:.3e}, max "
                     f"{max(e):.3e}"
                     + (f"; {per_param:.3f} weight-gather bytes per parameter per step" if per_param else ""))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(10, 4))
        for name, a in rows.items():
            e = a["replica_error"]
            if any(x > 0 for x in e["rel_err"]):
                ax.plot(e["steps"], e["rel_err"], label=a["label"])
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("||replica - bf16(master)|| / ||bf16(master)||")
        ax.set_title("weights every rank holds against the rounded masters")
        ax.grid(alpha=0.3, which="both")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out, "replica_error.png"), dpi=110)
        plt.close(fig)
        lines += ["", "Curves: `replica_error.png`."]
    except ImportError:
        lines += ["", "No replica-error plot (matplotlib missing)."]
    return lines + [""]


def _median(xs):
    if not xs:
        return None
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


if __name__ == "__main__":
    sys.exit(main())
