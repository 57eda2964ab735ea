"""``qzero qualify``: A/B arms in fresh processes, order-balanced, and their verdict.

Two settings (the common ones, each with its arm's own on top) run as arms in the order given
(``BCCB`` by default: baseline, candidate, candidate, baseline), each arm in a
fresh process with the same seed and data. Arms of one setting must reproduce
each other exactly. The speedup is the ratio of the median measured step times
(warm-up excluded), with a 95% interval from a two-level bootstrap (arms, then
steps within arms: :func:`qzero.app.qualify.stats.bootstrap_ci_arms`), so that it
shows the spread between runs of one setting and not only between the steps of
one run; the gates check accuracy, replica identity and memory (:class:`Thresholds`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from ..launcher import without_launcher
from ..train import TrainSettings, flat_settings, resolve_device, validate
from . import stats
from .env import describe


@dataclass
class Thresholds:
    """Gate limits: the project's accuracy and memory gates (also used by
    ``tests/gpu/workers/deepspeed_gpu_check.py``)."""

    max_loss_diff: float = 0.05
    atol: float = 0.02
    rtol: float = 0.02
    max_allocated_fraction: float = 0.90
    max_reserved_fraction: float = 0.95
    memory_vs_baseline: float = 0.01
    cpu_memory_slack_bytes: int = 16 * 2**20
    """On the CPU the memory figure is the process's peak RSS, which moves by a few MiB
    between identical runs; the baseline comparison allows this much on top of 1%."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise ValueError(f"threshold {f.name} must be a finite number >= 0, got {v!r}")


class ArmFailed(RuntimeError):
    pass


def run_arm(settings: TrainSettings, out_path: str, log_path: str, env: dict[str, str] | None = None) -> dict:
    """Run one arm in a fresh Python process (which starts its own ranks); ``env`` adds
    environment variables for that process only."""
    # --parent: the arm (and with it its ranks) dies with this process, even when it is SIGKILLed
    cmd = [sys.executable, "-m", "qzero", "_arm", json.dumps(dataclasses.asdict(settings)), out_path,
           "--parent", str(os.getpid())]
    # the arm starts its own ranks: nothing of a launcher's may reach them ([Note: launcher variables])
    extra, env = env or {}, without_launcher()
    env.update(extra)
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0 or not os.path.isfile(out_path):
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise ArmFailed(f"an arm exited with code {proc.returncode} (log: {log_path}); last output:\n{tail}")
    with open(out_path) as f:
        return json.load(f)


def qualify(
    base: TrainSettings,
    baseline: TrainSettings,
    candidate: TrainSettings,
    *,
    order: str = "BCCB",
    out_dir: str,
    thresholds: Thresholds | None = None,
    progress=None,
) -> dict:
    """Run the arms and build the report (a dict; see :func:`qzero.app.qualify.report.write`).
    ``base`` holds the settings common to both arms (what the report's scope describes);
    ``baseline`` and ``candidate`` are the arms' whole settings."""
    thresholds = thresholds or Thresholds()
    settings = {"B": baseline, "C": candidate}
    for s in settings.values():
        validate(s)
    os.makedirs(out_dir, exist_ok=True)
    arms = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, letter in enumerate(order):
            if progress:
                progress(i, len(order), letter)
            out = os.path.join(tmp, f"arm{i}.json")
            log = os.path.join(out_dir, f"arm{i}_{letter}.log")
            result = run_arm(settings[letter], out, log)
            if os.path.getsize(log) == 0:  # keep only logs with something in them
                os.remove(log)
            result["arm"] = f"{letter}{i + 1}"
            result["role"] = "baseline" if letter == "B" else "candidate"
            arms.append(result)
    if progress:
        progress(len(order), len(order), "")
    report = analyse(arms, base, baseline, candidate, order, thresholds)
    report["environment"] = describe(resolve_device(base))
    return report


def differing(baseline: TrainSettings, candidate: TrainSettings) -> dict[str, tuple]:
    """The settings the arms differ in, by name (ZeroConfig's fields by theirs), as
    (baseline, candidate) pairs; empty when the arms are the same run."""
    b_set, c_set = flat_settings(baseline), flat_settings(candidate)
    return {k: (b_set[k], c_set[k]) for k in sorted(b_set) if b_set[k] != c_set[k]}


def analyse(arms: list[dict], base: TrainSettings, baseline: TrainSettings, candidate: TrainSettings, order: str,
            t: Thresholds) -> dict:
    """Statistics and gates from finished arms (pure: testable on synthetic arms)."""
    b = [a for a in arms if a["role"] == "baseline"]
    c = [a for a in arms if a["role"] == "candidate"]
    if not b or not c:
        raise ValueError(f"order {order!r} must contain at least one B and one C arm")
    b_times = [x for a in b for x in a["step_times"]]
    c_times = [x for a in c for x in a["step_times"]]
    ratio = stats.speedup(b_times, c_times)
    ci = stats.bootstrap_ci_arms([a["step_times"] for a in b], [a["step_times"] for a in c])
    agreement = stats.param_agreement(c[0]["sample"], b[0]["sample"], t.atol, t.rtol)
    loss_diff = stats.max_loss_diff(b[0]["losses"], c[0]["losses"])
    device = resolve_device(base)
    on_cpu = device == "cpu"
    b_alloc = max(a["peak_allocated_bytes"] for a in b)
    c_alloc = max(a["peak_allocated_bytes"] for a in c)
    total = arms[0]["device_memory_bytes"]
    slack = t.memory_vs_baseline * b_alloc + (t.cpu_memory_slack_bytes if on_cpu else 0)
    gates = {
        "baseline_reproducible": stats.reproduced(b),
        "candidate_reproducible": stats.reproduced(c),
        "max_loss_diff": loss_diff <= t.max_loss_diff,
        "param_tolerance": agreement["tolerance_violations"] == 0,
        # backends without replicated weights (FSDP2) report None: nothing to compare there
        "replicas_identical": all(a["replicas_identical"] is not False for a in arms),
        "peak_allocated_fraction": max(a["peak_allocated_bytes"] for a in arms) <= t.max_allocated_fraction * total,
        "peak_reserved_fraction": max(a["peak_reserved_bytes"] for a in arms) <= t.max_reserved_fraction * total,
        "memory_vs_baseline": c_alloc <= b_alloc + slack,
    }
    b_median, c_median = stats.statistics.median(b_times), stats.statistics.median(c_times)
    spreads = [x for x in (stats.relative_spread([stats.statistics.median(a["step_times"]) for a in arms_])
                           for arms_ in (b, c)) if x is not None]
    within = max(spreads) if spreads else None
    between = abs(b_median - c_median) / min(b_median, c_median)
    b_bytes = stats.statistics.median(a["bytes_sent_per_step"] for a in b)
    c_bytes = stats.statistics.median(a["bytes_sent_per_step"] for a in c)
    return {
        "speedup": ratio,
        "speedup_ci95": list(ci),
        "speedup_ci95_covers": stats.interval_covers(len(b), len(c)),
        "baseline_median_s": b_median,
        "candidate_median_s": c_median,
        # arms of one setting that differ by more than the settings do: the run cannot decide
        "noise": {"within_setting": within, "between_settings": between,
                  "too_noisy": within is not None and within > between},
        "device": device,
        "bytes_sent_per_step": {"baseline": b_bytes, "candidate": c_bytes,
                                "ratio": c_bytes / b_bytes if b_bytes else None},
        "max_loss_diff": loss_diff,
        **agreement,
        "replicas_identical": gates["replicas_identical"],
        "gates": gates,
        "passed": all(gates.values()),
        "thresholds": dataclasses.asdict(t),
        "order": order,
        "differing_settings": {k: list(v) for k, v in differing(baseline, candidate).items()},
        "settings": dataclasses.asdict(base),
        "scope": {
            "model": base.model_config or base.preset,
            "params": arms[0]["params"],
            "world_size": arms[0]["world_size"],
            "steps": base.steps,
            "warmup": base.warmup,
            "seq_len": base.seq_len,
            "micro_batch": base.micro_batch,
            "precision": base.precision,
            "stage": base.zero.stage,
        },
        "environment": {"link_regime": "unknown"},
        "memory_kind": arms[0]["memory_kind"],
        "arms": [
            {
                "arm": a["arm"],
                "role": a["role"],
                "losses": a["losses"],
                "grad_norms": a["grad_norms"],
                "step_times": a["step_times"],
                "median_step_s": stats.statistics.median(a["step_times"]),
                "peak_allocated_bytes": a["peak_allocated_bytes"],
                "peak_reserved_bytes": a["peak_reserved_bytes"],
                "bytes_sent_per_step": a["bytes_sent_per_step"],
                "plain_bytes_per_step": a["plain_bytes_per_step"],
                "weight_bytes_per_param": a.get("weight_bytes_per_param"),
                "grad_bytes_sent_per_step": a.get("grad_bytes_sent_per_step"),
                "grad_plain_bytes_per_step": a.get("grad_plain_bytes_per_step"),
                "sample_hash": a["sample_hash"],
                "replicas_identical": a["replicas_identical"],
                "skipped_steps": a["skipped_steps"],
            }
            for a in arms
        ],
    }
