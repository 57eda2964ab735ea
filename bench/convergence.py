"""Convergence study: does training with the quantized weight gather reach the loss of bf16?

Arms (default): ``bf16`` (plain gather, ``quantized=false``), ``int8-g64``, ``int8-g8192``,
``fp8-g64`` and ``int4-g64``. Every arm trains the same randomly initialised Qwen3-shaped
model (preset ``qwen3-125m-byte``: hidden 768, 12 layers, 12 heads / 4 KV heads, head_dim 64,
MLP 3840, byte vocabulary, 125,456,640 parameters) on the same batches of real text (by
default :func:`qzero.workload.load_corpus`: this Python's standard-library ``*.py`` sources,
byte level, 8 MB) with the same seed, in bf16, ZeRO-2, AdamW (constant LR, no weight decay)
with global-norm clipping, through :func:`qzero.train.launch` (which records the loss of every
step). Nothing is downloaded.

Each arm runs as its own single-process run at world size 1, all arms at once (on a GPU host
spread round-robin over the visible GPUs: 3 on GPU 0 and 2 on GPU 1 with two GPUs). qzero
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
with micro-batch 16 sees the global batch of a DP2 run with micro-batch 8.

Outputs in ``--out``: ``convergence.png`` (raw and smoothed loss of every arm, and the
smoothed difference from bf16), ``convergence.md`` (final loss = mean of the last 100 steps,
its difference from bf16 in absolute and %), ``convergence.json`` (every per-step loss,
gradient norm and step time, the settings, versions, date) and per-arm logs. The table is
printed last. With ``--time-limit`` the arms still running when it expires are stopped and
the report compares all arms over the steps every arm completed.

``--from-arms DIR`` rebuilds ``convergence.json`` (in ``--out``) from the per-arm records
``DIR/arm_<name>.json`` of a run whose combined output was lost, and renders it: the settings,
losses, gradient norms, bytes and memory come from the records; what only the parent process
knew (the run's wall time, environment, per-arm GPUs, exit codes and streamed step times) comes
from ``--wall-s``, ``--env KEY=VALUE`` and ``--gpus`` or is left null; ``--note`` says why.

    python bench/convergence.py                      # the GPU study (defaults)
    python bench/convergence.py --preset tiny --steps 20 --seq-len 64 --micro-batch 4 \\
        --arms bf16,int8-g64 --device cpu --out /tmp/conv   # a CPU smoke run
    python bench/convergence.py --from-arms OUT --gpus 0,1 --wall-s 188 --env torch=2.11.0+cu130 \\
        --note "..." --out OUT                             # rebuild OUT/convergence.json from OUT/arm_*.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import queue
import shlex
import subprocess
import sys
import threading
import time

try:
    import qzero  # noqa: F401
except ImportError:  # run from a checkout that is not installed
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

DEFAULT_ARMS = "bf16,int8-g64,int8-g8192,fp8-g64,int4-g64"
FORMATS = ("int8", "fp8", "int4")
TARGET_ARM, TARGET_PCT = "int8-g64", 0.5  # INT8 g64 must finish within 0.5% of bf16
MARK = "@@conv"  # progress lines a worker prints on stdout
GROUPS_NOTE = (
    "qzero quantizes the rank's own partition at world size 1 exactly as each rank does at DP2, with DP2's "
    "groups (preset qwen3-125m-byte): the g64 arms' groups are each matrix's aligned 64-element blocks in either flat order; the g8192 "
    "arm's groups are those of DP2 in the contiguous flat order (DP2's interleaved order cuts the 8192-element "
    "groups at other places)."
)
# Throughput assumed for the wall-time estimate: training costs ~6 * params FLOPs per token.
# The default study: 125.5M parameters x 16 x 512 = 8192 tokens per step = 6.17 TFLOP per step,
# ~31 ms at 200 TFLOP/s effective; 2000 steps = ~62 s per arm on a GPU of its own, ~185 s for the
# three arms sharing GPU 0 (~123 s for the two on GPU 1), plus ~30-60 s of start-up (imports,
# CUDA and NCCL init, model build): about 4 minutes of wall time on a 2 x H200 host.
EFFECTIVE_FLOPS = 200e12


# ---------------------------------------------------------------------- arms


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    quantized: bool
    fmt: str = "int8"
    group_size: int = 64

    @property
    def label(self) -> str:
        return "bf16 (plain gather)" if not self.quantized else f"{self.fmt.upper()} g{self.group_size}"


def parse_arm(name: str) -> Arm:
    """``bf16`` (the plain gather) or ``<fmt>-g<group size>``, e.g. ``int8-g64``, ``fp8-g64``."""
    name = name.strip()
    if name == "bf16":
        return Arm(name, quantized=False)
    fmt, _, group = name.partition("-g")
    if fmt not in FORMATS or not group.isdigit() or int(group) <= 0 or int(group) % 8:
        raise ValueError(f"arm {name!r}: expected bf16 or <fmt>-g<group size> with fmt in {FORMATS} "
                         "and a group size that is a positive multiple of 8, e.g. int8-g64")
    return Arm(name, quantized=True, fmt=fmt, group_size=int(group))


def parse_arms(text: str) -> list[Arm]:
    arms = [parse_arm(a) for a in text.split(",") if a.strip()]
    names = [a.name for a in arms]
    if not arms or len(set(names)) != len(names):
        raise ValueError(f"--arms must name at least one arm, each once: {text!r}")
    return arms


def arm_settings(arm: Arm, args):
    from qzero.train import TrainSettings

    return TrainSettings(
        preset=args.preset,
        data=args.data,
        world_size=1,
        device=args.device,
        precision="bf16",
        zero={
            "stage": 2,
            "zero_quantized_weights": arm.quantized,
            "zero_quantized_weights_format": arm.fmt,
            "zero_quantized_weights_group_size": arm.group_size,
            **({"gradient_clipping": args.clip} if args.clip > 0 else {}),
        },
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        steps=args.steps,
        warmup=max(0, min(10, args.steps - 2)),  # steps left out of the step-time median only
        lr=args.lr,
        seed=args.seed,
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


def markdown_table(summary: dict, arms: list[Arm], payload: dict[str, float] | None = None) -> str:
    """The results table; ``payload`` (optional): gather bytes per step relative to a plain
    gather, per arm (evidence that the arm's weights really went through the quantizer)."""
    lo, hi = summary["window"]
    ref = summary["reference"]
    extra = payload is not None
    lines = [
        f"| arm | final loss (mean of steps {lo + 1}–{hi}) | Δ vs {ref} | Δ % | paired SE of Δ |"
        + (" gather bytes vs plain |" if extra else ""),
        "|---|---|---|---|---|" + ("---|" if extra else ""),
    ]
    for arm in arms:
        r = summary["arms"][arm.name]
        if arm.name == ref:
            row = f"| {arm.label} | {r['final_loss']:.4f} | — | — | — |"
        else:
            row = (f"| {arm.label} | {r['final_loss']:.4f} | {r['diff']:+.4f} | {r['diff_pct']:+.2f}% "
                   f"| {r['diff_se']:.4f} |")
        if extra:
            ratio = payload.get(arm.name)
            row += f" {ratio:.3f} |" if ratio is not None else " — |"
        lines.append(row)
    return "\n".join(lines)


def verdict(summary: dict) -> str | None:
    r = summary["arms"].get(TARGET_ARM)
    if r is None or summary["reference"] != "bf16":
        return None
    ok = abs(r["diff_pct"]) <= TARGET_PCT
    return (f"INT8 g64 vs bf16: {r['diff_pct']:+.2f}% — {'within' if ok else 'OUTSIDE'} the {TARGET_PCT}% target "
            f"(mean of the last {summary['window'][1] - summary['window'][0]} steps).")


def plot(path: str, losses: dict[str, list[float]], arms: list[Arm], reference: str, window: int, title: str):
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
        if arm.name != reference:
            n = min(len(ys), len(ref_s))
            dx.plot(range(1, n + 1), [a - b for a, b in zip(ys[:n], ref_s[:n])], color=c, label=arm.label)
    ax.set_yscale("log")
    from matplotlib.ticker import ScalarFormatter

    for axis_formatter in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        axis_formatter(ScalarFormatter())
    ax.set_ylabel("training loss (raw: faint; smoothed: bold)")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3, which="both")
    dx.axhline(0.0, color="black", linewidth=0.8)
    dx.set_ylabel(f"smoothed loss − {reference}")
    dx.set_xlabel("step")
    dx.grid(alpha=0.3)
    if len(arms) > 1:
        dx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------- one arm (a worker process)


def worker(settings_json: str, out_path: str, threads: int) -> None:
    """Run one arm in this process as rank 0 of 1 through qzero.train.launch, printing a
    progress line per step on stdout."""
    import torch

    from qzero import train

    settings = train.TrainSettings(**json.loads(settings_json))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(train._free_port()))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS handle
    if threads > 0:
        torch.set_num_threads(threads)

    class Report:  # stands in for train._progress: one line per step
        def __init__(self, total):
            self.n = 0

        def update(self, loss, seconds, saved):
            self.n += 1
            print(f"{MARK} {self.n} {loss!r} {seconds!r}", flush=True)

        def close(self):
            pass

    if not hasattr(train, "_progress"):
        print("note: qzero.train has no _progress to replace: no per-step progress from this arm", file=sys.stderr)
    train._progress = Report
    train.launch(settings, out_path, show_progress=True)


# ---------------------------------------------------------------------- the study


class Running:
    def __init__(self, arm: Arm, proc: subprocess.Popen, log, device_label: str, record: str):
        self.arm, self.proc, self.log, self.device_label, self.record = arm, proc, log, device_label, record
        self.terminated = False
        self.losses: list[float] = []
        self.seconds: list[float] = []
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
            else:
                self.log.write(line)
                self.log.flush()


def count_params(preset: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from qzero.workload import model_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(preset))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def estimate_seconds(params: int, tokens_per_step: int, steps: int, arms_per_device: int) -> float:
    """6 N T FLOPs per step at EFFECTIVE_FLOPS, arms sharing a device one after another."""
    return 6 * params * tokens_per_step * steps * arms_per_device / EFFECTIVE_FLOPS


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default=DEFAULT_ARMS, help=f"comma list: bf16 or <fmt>-g<N> (default {DEFAULT_ARMS})")
    ap.add_argument("--preset", default="qwen3-125m-byte")
    ap.add_argument("--data", default=None, help="text file to train on (default: the stdlib sources corpus)")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--clip", type=float, default=1.0, help="global-norm gradient clipping (0: off)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--gpus", default=None, help="GPU indices to spread the arms over (default: all visible)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads per arm (default: cores / arms)")
    ap.add_argument("--last", type=int, default=100, help="final loss = mean of this many last steps")
    ap.add_argument("--smooth", type=int, default=50, help="moving-average window of the smoothed curves")
    ap.add_argument("--time-limit", type=float, default=0, help="stop arms after this many seconds (0: none)")
    ap.add_argument("--progress-every", type=float, default=10.0, help="seconds between progress lines")
    ap.add_argument("--out", default="bench/results/convergence")
    ap.add_argument("--render", default=None, metavar="JSON",
                    help="only rewrite convergence.md/.png (next to JSON) from a saved convergence.json")
    ap.add_argument("--from-arms", default=None, metavar="DIR",
                    help="rebuild convergence.json in --out from the arm_<name>.json records in DIR (the arms of "
                         "--arms that have one, in that order), then render it")
    ap.add_argument("--wall-s", type=float, default=None, help="with --from-arms: the run's wall time (seconds)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="with --from-arms: an environment field of the run (repeatable; date= also sets the date)")
    ap.add_argument("--note", default=None, help="with --from-arms: a note stored in the JSON and shown in the .md")
    ap.add_argument("--worker", nargs=3, metavar=("SETTINGS", "OUT", "THREADS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is None and args.render is None:
        for name in ("steps", "seq_len", "micro_batch", "last", "smooth"):
            if getattr(args, name) < 1:
                ap.error(f"--{name.replace('_', '-')} must be at least 1")
        try:
            args.arm_list = parse_arms(args.arms)
        except ValueError as e:
            ap.error(str(e))
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
        worker(args.worker[0], args.worker[1], int(args.worker[2]))
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
            note=args.note, source=args.from_arms)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "convergence.json"), "w") as f:  # compact: it sits next to the records
            json.dump(study, f, separators=(",", ":"))
        render(study, args.out)
        return 0

    import torch

    from qzero.qualify.env import describe
    from qzero.train import resolve_device, validate

    arms: list[Arm] = args.arm_list
    first = arm_settings(arms[0], args)
    device = resolve_device(first)
    args.device = device
    validate(dataclasses.replace(first, device=device))
    if device == "cuda":
        gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else list(range(torch.cuda.device_count()))
        slots = arm_slots(len(arms), "cuda", gpus)  # 5 arms on 2 GPUs: 3 + 2
        visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    else:
        slots, visible = ["cpu"] * len(arms), []
    threads = args.threads or max(1, (os.cpu_count() or 1) // len(arms))  # the arms share the cores
    os.makedirs(args.out, exist_ok=True)
    params = count_params(args.preset)
    tokens = args.micro_batch * args.seq_len
    per_device = max(slots.count(s) for s in set(slots))
    est = estimate_seconds(params, tokens, args.steps, per_device)
    print(f"convergence: preset {args.preset} ({params:,} parameters), {len(arms)} arms at world size 1, "
          f"{args.steps} steps of {args.micro_batch} x {args.seq_len} tokens, bf16, device {device}", flush=True)
    if device == "cuda":
        print(f"  estimate: 6 x {params / 1e6:.1f}M x {tokens} tokens = {6 * params * tokens / 1e12:.2f} TFLOP/step; "
              f"at {EFFECTIVE_FLOPS / 1e12:.0f} TFLOP/s effective per GPU and {per_device} arms on the busiest GPU: "
              f"~{est:.0f} s of training", flush=True)

    started = time.time()
    running: list[Running] = []
    for arm, slot in zip(arms, slots):
        settings = dataclasses.replace(arm_settings(arm, args), device=device)
        env = dict(os.environ, PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE=os.environ.get("NCCL_NVLS_ENABLE", "0"))
        if slot.startswith("cuda:"):  # each arm sees one GPU (an index into the visible ones)
            index = int(slot.split(":")[1])
            env["CUDA_VISIBLE_DEVICES"] = visible[index] if index < len(visible) else str(index)
        record = os.path.join(args.out, f"arm_{arm.name}.json")
        if os.path.exists(record):
            os.remove(record)
        log = open(os.path.join(args.out, f"arm_{arm.name}.log"), "w")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker",
               json.dumps(dataclasses.asdict(settings)), record, str(threads)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        running.append(Running(arm, proc, log, slot, record))
        print(f"  started {arm.name:12s} on {slot} (pid {proc.pid})", flush=True)

    stopped = False
    last_report = 0.0
    while True:
        for r in running:
            r.drain()
        done = all(r.proc.poll() is not None for r in running)
        now = time.time() - started
        if done or now - last_report >= args.progress_every:
            last_report = now
            parts = [f"{r.arm.name} {len(r.losses)}/{args.steps}"
                     + (f" loss {r.losses[-1]:.3f}" if r.losses else "")
                     + ("" if r.proc.poll() is None else
                        " done" if r.proc.returncode == 0 else " stopped" if r.terminated else " FAILED")
                     for r in running]
            print(f"  [{now:5.0f} s] " + " | ".join(parts), flush=True)
        if done:
            break
        if args.time_limit and now > args.time_limit and not stopped:
            print(f"  time limit {args.time_limit:.0f} s reached: stopping the arms still running", flush=True)
            for r in running:
                if r.proc.poll() is None:
                    r.proc.terminate()
                    r.terminated = True
            stopped = True
        time.sleep(0.5)
    for r in running:
        r.proc.wait()
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
    failed = [r for r in running if not r.losses or (r.proc.returncode != 0 and not r.terminated)]
    for r in failed:
        print(f"arm {r.arm.name} failed (exit {r.proc.returncode}); last lines of {r.log.name}:", file=sys.stderr)
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
        "clip": args.clip,
        "seed": args.seed,
        "last": args.last,
        "smooth": args.smooth,
        "world_size": 1,
        "world_size_note": GROUPS_NOTE,
        "arm_devices": {r.arm.name: r.device_label for r in running},
        "estimate_s": est if device == "cuda" else None,
        "estimate_basis": f"6 * params * tokens/step FLOPs at {EFFECTIVE_FLOPS:.3g} FLOP/s per GPU, "
                          f"{per_device} arms sharing the busiest device",
        "settings": {r.arm.name: dataclasses.asdict(dataclasses.replace(arm_settings(r.arm, args), device=device))
                     for r in running},
        "target": {"arm": TARGET_ARM, "max_abs_diff_pct": TARGET_PCT},
        "arms": {
            r.arm.name: {
                "label": r.arm.label,
                "steps_completed": len(r.losses),
                "exit_code": r.proc.returncode,
                "losses": r.losses,
                "step_seconds": r.seconds,
                "grad_norms": records.get(r.arm.name, {}).get("grad_norms"),
                "peak_allocated_bytes": records.get(r.arm.name, {}).get("peak_allocated_bytes"),
                "bytes_sent_per_step": records.get(r.arm.name, {}).get("bytes_sent_per_step"),
                "plain_bytes_per_step": records.get(r.arm.name, {}).get("plain_bytes_per_step"),
                "median_step_s": _median(records.get(r.arm.name, {}).get("step_times")),
            }
            for r in running
        },
        "environment": env_info,
    }
    usable = [a for a in arms if study["arms"][a.name]["losses"]]
    losses = {a.name: study["arms"][a.name]["losses"] for a in usable}
    study["summary"] = final_losses(losses, "bf16" if "bf16" in losses else usable[0].name, args.last)
    study["target"]["verdict"] = verdict(study["summary"])
    with open(os.path.join(args.out, "convergence.json"), "w") as f:
        json.dump(study, f, indent=1)
    render(study, args.out)
    return 0 if not failed else 1


def arm_slots(n_arms: int, device: str, gpus: list[int] | None) -> list[str | None]:
    """The device of each arm as the study assigns them: round-robin over ``gpus`` (5 arms on 2 GPUs: 3 + 2)."""
    if device != "cuda":
        return [device] * n_arms
    if not gpus:
        return [None] * n_arms
    return [f"cuda:{gpus[i % len(gpus)]}" for i in range(n_arms)]


def study_from_records(records: dict[str, dict], arm_order: list[Arm], *, gpus: list[int] | None = None,
                       last: int = 100, smooth_window: int = 50, wall_s: float | None = None,
                       environment: dict | None = None, note: str | None = None, source: str | None = None) -> dict:
    """A study record (the schema ``main`` writes) rebuilt from per-arm records (``qzero.train.launch``'s
    output, ``arm_<name>.json``) of a run whose ``convergence.json`` was lost. ``arm_order`` is the run's
    ``--arms`` (it fixes the arms' GPUs, given the run's ``gpus``); arms without a record are left out and
    listed under ``rebuilt_from``. What the records do not hold is null: exit codes, the streamed per-step
    seconds (the records' ``step_times`` give ``median_step_s``), and whatever ``environment`` / ``wall_s``
    leave out."""
    from qzero.train import flat_settings

    present = [a for a in arm_order if a.name in records]
    if not present:
        raise ValueError("no arm has a record")
    first = records[present[0].name]
    flat = {a.name: flat_settings(records[a.name]["settings"]) for a in present}  # older records too
    # what the arms share: every setting but the gather's format (and gather-ahead, which follows it)
    own = ("zero_quantized_weights", "zero_quantized_weights_format", "zero_quantized_weights_group_size",
           "overlap_param_gather")
    for arm in present:
        s, f = flat[arm.name], flat[present[0].name]
        diff = [k for k in sorted(set(s) | set(f)) if k not in own and s.get(k) != f.get(k)]
        if diff or records[arm.name].get("params") != first.get("params"):
            raise ValueError(f"arm {arm.name}: its record differs from {present[0].name}'s in {diff or ['params']}")
        q, fmt, group = s["zero_quantized_weights"], s["zero_quantized_weights_format"], s["zero_quantized_weights_group_size"]
        if bool(q) != arm.quantized or (arm.quantized and (fmt, group) != (arm.fmt, arm.group_size)):
            raise ValueError(f"arm {arm.name}: its record's settings are quantized={q} fmt={fmt} group_size={group}")
    st = flat[present[0].name]
    device = st["device"]
    slots = dict(zip([a.name for a in arm_order], arm_slots(len(arm_order), device, gpus)))
    known = [s for s in slots.values() if s]
    per_device = max(known.count(s) for s in set(known)) if known else None
    params = first["params"]
    est = (estimate_seconds(params, st["micro_batch"] * st["seq_len"], st["steps"], per_device)
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
        "micro_batch": st["micro_batch"],
        "lr": st["lr"],
        "clip": clip,
        "seed": st["seed"],
        "last": last,
        "smooth": smooth_window,
        "world_size": 1,
        "world_size_note": GROUPS_NOTE,
        "arm_devices": {a.name: slots[a.name] for a in present},
        "estimate_s": est,
        "estimate_basis": f"6 * params * tokens/step FLOPs at {EFFECTIVE_FLOPS:.3g} FLOP/s per GPU, "
                          f"{per_device} arms sharing the busiest device",
        "settings": {a.name: records[a.name]["settings"] for a in present},
        "target": {"arm": TARGET_ARM, "max_abs_diff_pct": TARGET_PCT},
        "arms": {
            a.name: {
                "label": a.label,
                "steps_completed": len(records[a.name]["losses"]),
                "exit_code": None,
                "losses": records[a.name]["losses"],
                "step_seconds": None,
                "grad_norms": records[a.name].get("grad_norms"),
                "peak_allocated_bytes": records[a.name].get("peak_allocated_bytes"),
                "bytes_sent_per_step": records[a.name].get("bytes_sent_per_step"),
                "plain_bytes_per_step": records[a.name].get("plain_bytes_per_step"),
                "median_step_s": _median(records[a.name].get("step_times")),
            }
            for a in present
        },
        "environment": env_info,
        "rebuilt_from": {
            "records": [f"arm_{a.name}.json" for a in present],
            "source": source,
            "missing_arms": [a.name for a in arm_order if a.name not in records],
            "not_in_records": "exit_code and step_seconds (null); median_step_s is the median of the record's "
                              "step_times (warm-up steps left out); arm_devices follow --arms and --gpus",
        },
    }
    if note:
        study["note"] = note
    losses = {a.name: study["arms"][a.name]["losses"] for a in present}
    study["summary"] = final_losses(losses, "bf16" if "bf16" in losses else present[0].name, last)
    study["target"]["verdict"] = verdict(study["summary"])
    return study


DEFAULT_DATA = "the standard-library *.py sources of this Python (qzero.workload.load_corpus default), byte level"


def render(study: dict, out: str) -> None:
    """Write convergence.md and convergence.png from a study record; print the table last."""
    arms = [parse_arm(name) for name, a in study["arms"].items() if a["losses"]]
    losses = {a.name: study["arms"][a.name]["losses"] for a in arms}
    summary = study["summary"]
    reference = summary["reference"]
    payload = {name: a["bytes_sent_per_step"] / a["plain_bytes_per_step"] for name, a in study["arms"].items()
               if a.get("bytes_sent_per_step") and a.get("plain_bytes_per_step")}
    table = markdown_table(summary, arms, payload)
    line = verdict(summary)
    env_info = study["environment"]
    wall = f"{study['wall_s']:.0f} s" if study.get("wall_s") is not None else "not recorded"
    steps_done = ", ".join(f"{name} {a['steps_completed']}" for name, a in study["arms"].items())
    try:
        title = (f"{study['preset']} ({study['params'] / 1e6:.1f}M params), {study['micro_batch']}x{study['seq_len']} "
                 f"tokens/step, bf16, lr {study['lr']:g}")
        plot(os.path.join(out, "convergence.png"), losses, arms, reference, study["smooth"], title)
        plotted = "Curves: `convergence.png`"
    except ImportError as e:  # no matplotlib here: render the plot elsewhere with --render
        print(f"no plot ({e}); run bench/convergence.py --render {out}/convergence.json where matplotlib is installed")
        plotted = "No plot (matplotlib missing)"
    md = [
        f"# Convergence: quantized weight gather vs bf16 ({study['date']})",
        "",
        f"Model `{study['preset']}` ({study['params']:,} parameters, Qwen3-shaped, random init), data: "
        f"{study['data']}; {study['steps']} steps of {study['micro_batch']} x {study['seq_len']} tokens, bf16, "
        f"ZeRO-2, AdamW lr {study['lr']:g} (constant, no weight decay), gradient clipping {study['clip']:g}, "
        f"seed {study['seed']} — the same model, batches and seed in every arm. Each arm is an independent "
        f"world-size-1 run: {study['world_size_note']} Devices: "
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
    if line:
        md += [line, ""]
    md += [f"Δ = arm − {reference}; paired SE = standard error of the per-step differences over the window "
           "(the arms see the same batches; steps are autocorrelated, so read it as a lower bound); gather "
           "bytes vs plain = the payload of the post-step gather per step relative to a plain bf16 gather "
           "(below 1: the weights went through the quantizer). "
           f"{plotted}; every per-step loss: `convergence.json`.", ""]
    with open(os.path.join(out, "convergence.md"), "w") as f:
        f.write("\n".join(md))
    print(f"wrote {out}/convergence.json, convergence.md, convergence.png (wall {wall})")
    if not study["complete"]:
        print(f"INCOMPLETE: steps completed per arm: {steps_done}; compared over the first "
              f"{summary['steps_compared']} steps")
    if line:
        print(line)
    print(table)


def _median(xs):
    if not xs:
        return None
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


if __name__ == "__main__":
    sys.exit(main())
