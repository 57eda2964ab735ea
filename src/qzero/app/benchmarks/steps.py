"""Whole-step benchmark matrix: many named arms, order-balanced rounds, fresh processes.

Every arm is a :class:`qzero.app.train.TrainSettings` (the common flags below, plus the
arm's own ``key=value`` settings: workload fields such as ``backend``, ZeroConfig fields
such as ``zero_quantized_weights``, or the short names of ``qzero.vocabulary.ZERO_ALIASES``:
``quantized``, ``overlap``, ``fmt``, ``group_size``, ``allgather_bucket``, ``reduce_bucket``) and runs
through :func:`qzero.app.qualify.run.run_arm`,
a fresh process with the same seed and data, once per round. Round ``r`` runs the arms
in the order given, odd rounds in reverse (ABCD, DCBA, ABCD, ...), so slow drift of the
machine falls on every arm alike. An arm that fails (a peer that is not installed, an
out-of-memory) is recorded with the tail of its output and the other arms go on.

    qzero bench steps --device cuda --world-size 2 --preset qwen3-1.7b \\
        --seq-len 2048 --micro-batch 2 --steps 8 --warmup 2 --allgather-bucket-size 5e8 \\
        --reduce-bucket-size 5e7 --lr 1e-4 --rounds 2 --peers deepspeed,fsdp2 \\
        --arm plain: --arm int8:quantized=true,overlap=false --arm int8_ahead:quantized=true,overlap=true \\
        --arm deepspeed:backend=deepspeed --arm fsdp2:backend=fsdp2 --out OUTDIR

Per arm: the median of all its rounds' measured step times (warm-up excluded); the ratio
``median(reference) / median(arm)`` (> 1: the arm is faster than the reference) with a
bootstrap 95% interval, and the same against each ``--peers`` arm; peak allocated and
reserved memory; bytes each rank sent per step; whether its rounds reproduced each other
exactly; whether its replicas were bit-identical; the largest loss difference and the
agreement of sampled weights against the reference arm.

``--out`` gets ``matrix.json`` (settings, environment, every run's summary without its
weight sample, the statistics), ``matrix.md`` (the table), ``steps.png`` (step times per
arm) and ``logs/`` (each run's output). The JSON and Markdown are rewritten after every
run, so a run cut short by a time limit leaves what it measured. The Markdown table is
printed last. Exit status: 0 when the reference arm ran at least once, 1 otherwise, 2 for
bad arguments (refused before anything runs). ``qzero bench steps --compare DIR/matrix.json
BASE:ARM`` sets two arms of a saved matrix side by side. Link regimes on one host:
``benchmarks/scripts/run_matrix.sh`` runs this command in each (``benchmarks/README.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import re
import shlex
import statistics
import sys
import tempfile

from qzero.app.qualify import stats
from qzero.app.qualify.env import describe
from qzero.app.qualify.run import ArmFailed, run_arm
from qzero.config import ZeroConfig
from qzero.vocabulary import PRECISIONS, ZERO_ALIASES
from qzero.app.train import TrainSettings, flat_settings, resolve_device, setting_name, settings_from, validate

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
KEY_RE = re.compile(r"^\s*(env\.)?[A-Za-z_][A-Za-z0-9_-]*\s*=")
#: What an arm's ``key=value`` may set: TrainSettings' own fields and ZeroConfig's (by field name).
FIELDS = {f.name: f for cls in (TrainSettings, ZeroConfig) for f in dataclasses.fields(cls) if f.name != "zero"}


class SpecError(ValueError):
    """A bad ``--arm``, ``--reference`` or ``--peers`` (refused before anything runs)."""


# ---------------------------------------------------------------------- arms and their order


def schedule(names: list[str], rounds: int) -> list[tuple[int, str]]:
    """Order-balanced runs: round ``r`` in the given order when ``r`` is even, reversed when odd."""
    if rounds < 1:
        raise SpecError(f"--rounds must be at least 1, got {rounds}")
    out = []
    for r in range(rounds):
        out += [(r, n) for n in (names if r % 2 == 0 else list(reversed(names)))]
    return out


def _split_pairs(text: str) -> list[str]:
    """Split ``k=v,k=v`` on the commas that start a new ``key=``, so JSON values may hold commas."""
    pairs: list[str] = []
    for token in text.split(","):
        if pairs and not KEY_RE.match(token):
            pairs[-1] += "," + token
        else:
            pairs.append(token)
    return [p for p in pairs if p.strip()]


def _typed(key: str, raw: str, shown: str | None = None):
    """The value of TrainSettings or ZeroConfig field ``key`` from its text: JSON where possible,
    then its type (messages name ``shown``, the key as given)."""
    shown = shown or key
    raw = raw.strip()
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    kind = str(FIELDS[key].type)
    optional = "None" in kind
    kind = kind.replace("| None", "").replace("None |", "").strip()
    if value is None:
        if optional:
            return None
        raise SpecError(f"setting {shown!r} cannot be null")
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "no", "off"):
            return False
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
    elif kind == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)  # 5e7
    elif kind == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif kind == "str":
        return value if isinstance(value, str) else raw
    elif kind == "dict":
        if isinstance(value, dict):
            return value
    else:
        return value
    raise SpecError(f"setting {shown!r} expects {kind}{' or null' if optional else ''}, got {raw!r}")


def parse_arm(spec: str) -> tuple[str, dict]:
    """``NAME:key=value,key=value`` (or ``NAME:`` / ``NAME``) -> (name, overrides by field name:
    short names such as ``quantized`` become ZeroConfig's, ``zero_quantized_weights``).

    ``env.VAR=value`` sets an environment variable for this arm's processes only (under
    ``overrides["env"]``), e.g. an NCCL variable such as ``env.NCCL_ALGO=Ring``."""
    name, _, rest = spec.partition(":")
    name = name.strip()
    if not NAME_RE.match(name):
        raise SpecError(f"--arm {spec!r}: the name must be letters, digits, '_', '-', '.' or '+'")
    overrides: dict = {}
    for pair in _split_pairs(rest):
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep:
            raise SpecError(f"--arm {spec!r}: expected key=value, got {pair!r}")
        if key.startswith("env."):  # an environment variable of this arm's processes only
            var = key[4:]
            if not ENV_RE.match(var):
                raise SpecError(f"--arm {name}: {key!r} does not name an environment variable")
            overrides.setdefault("env", {})[var] = raw.strip()
            continue
        try:
            field = setting_name(key)
        except ValueError as e:  # a setting of an earlier release
            raise SpecError(f"--arm {name}: {e}") from None
        if field is None:
            raise SpecError(
                f"--arm {name}: unknown setting {key!r}; settings are {', '.join(FIELDS)}, and the short names "
                + ", ".join(f"{k}={v}" for k, v in ZERO_ALIASES.items())
            )
        if field in overrides:
            raise SpecError(f"--arm {name}: setting {field!r} given twice")
        try:
            overrides[field] = _typed(field, raw, key)
        except SpecError as e:
            raise SpecError(f"--arm {name}: {e}") from None
    return name, overrides


def settings_diff(base: TrainSettings, settings: TrainSettings) -> dict:
    """The fields (ZeroConfig's by their names) in which ``settings`` differs from the common ``base``."""
    a, b = flat_settings(base), flat_settings(settings)
    return {k: b[k] for k in b if b[k] != a[k]}


def _fmt_diff(diff: dict) -> str:
    if not diff:
        return "(common)"
    return ", ".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in diff.items())


# ---------------------------------------------------------------------- statistics


def _ok_runs(runs: list[dict]) -> list[dict]:
    return [r for r in runs if not r.get("failed")]


def _times(runs: list[dict]) -> list[float]:
    return [t for r in _ok_runs(runs) for t in (r.get("step_times") or [])]


def _ratio(base_times: list[float], arm_times: list[float], resamples: int) -> dict | None:
    """median(base) / median(arm) with its bootstrap 95% interval; None without times on either side."""
    if not base_times or not arm_times:
        return None
    lo, hi = stats.bootstrap_ci(base_times, arm_times, resamples=resamples)
    return {"ratio": stats.speedup(base_times, arm_times), "ci95": [lo, hi]}


def _replicas(runs: list[dict]):
    flags = [r.get("replicas_identical") for r in runs]
    if any(f is False for f in flags):
        return False
    if any(f is True for f in flags):
        return True
    return None  # backends without replicated flat buffers (FSDP2) have nothing to compare


def _reproduced(runs: list[dict]):
    if len(runs) < 2:
        return None
    try:
        return stats.reproduced(runs)
    except KeyError:
        return None


def _last_line(error: str) -> str:
    lines = [ln.strip() for ln in (error or "").splitlines() if ln.strip()]
    return lines[-1] if lines else "failed"


def analyse(
    arm_runs: dict[str, list[dict]],
    reference: str,
    peers: list[str] | tuple[str, ...] = (),
    *,
    atol: float = 0.02,
    rtol: float = 0.02,
    resamples: int = 2000,
) -> dict:
    """Per-arm statistics from the runs of every arm (pure: testable on synthetic summaries).

    ``arm_runs`` maps each arm's name (in the order given) to its runs: run summaries
    as :func:`run_arm` returns them, or ``{"failed": True, "error": TEXT}`` records.
    Ratios are ``median(other) / median(arm)``: > 1 means the arm is faster than the other.
    """
    if reference not in arm_runs:
        raise SpecError(f"reference arm {reference!r} is not one of {', '.join(arm_runs)}")
    for p in peers:
        if p not in arm_runs:
            raise SpecError(f"peer arm {p!r} is not one of {', '.join(arm_runs)}")
    ref_ok = _ok_runs(arm_runs[reference])
    ref_times = _times(arm_runs[reference])
    ref_first = ref_ok[0] if ref_ok else None
    rows = []
    for name, runs in arm_runs.items():
        ok = _ok_runs(runs)
        failed = [r for r in runs if r.get("failed")]
        times = _times(runs)
        row: dict = {
            "arm": name,
            # missing: no run of it finished or failed (a budget, or an interrupted run, stopped first)
            "status": "missing" if not runs else "failed" if not ok else ("partial" if failed else "ok"),
            "runs_ok": len(ok),
            "runs_failed": len(failed),
            "errors": [r.get("error", "") for r in failed],
            "error_line": _last_line(failed[0].get("error", "")) if failed else None,
            "step_times_by_run": [list(r.get("step_times") or []) for r in ok],
            "rounds": [r.get("round") for r in ok],
            "measured_steps": len(times),
            "median_step_s": statistics.median(times) if times else None,
            # wall time of the measured steps back to back between two device-wide syncs, per step
            "wall_step_s": (statistics.median(r["wall_seconds"] / r["wall_steps"] for r in ok if r.get("wall_seconds"))
                            if any(r.get("wall_seconds") for r in ok) else None),
            "vs_reference": _ratio(ref_times, times, resamples),
            "vs_peers": {p: (_ratio(_times(arm_runs[p]), times, resamples) if p != name else None) for p in peers},
            "peak_allocated_bytes": max((r["peak_allocated_bytes"] for r in ok
                                         if r.get("peak_allocated_bytes") is not None), default=None),
            "peak_reserved_bytes": max((r["peak_reserved_bytes"] for r in ok
                                        if r.get("peak_reserved_bytes") is not None), default=None),
            "bytes_sent_per_step": ok[0].get("bytes_sent_per_step") if ok else None,
            "plain_bytes_per_step": ok[0].get("plain_bytes_per_step") if ok else None,
            "grad_bytes_sent_per_step": ok[0].get("grad_bytes_sent_per_step") if ok else None,
            "reproducible": _reproduced(ok),
            "replicas_identical": _replicas(ok),
            "final_loss": ok[0]["losses"][-1] if ok and ok[0].get("losses") else None,
            "max_loss_diff": None,
            "param_agreement": None,
            "param_agreement_note": None,
        }
        if ok and ref_first is not None:
            first = ok[0]
            if first.get("losses") and ref_first.get("losses"):
                row["max_loss_diff"] = stats.max_loss_diff(ref_first["losses"], first["losses"])
            a, b = first.get("sample"), ref_first.get("sample")
            if a is None or b is None:
                row["param_agreement_note"] = "no weight sample"
            elif len(a) != len(b):
                row["param_agreement_note"] = f"samples differ in length ({len(a)} vs {len(b)})"
            else:
                row["param_agreement"] = stats.param_agreement(a, b, atol, rtol)
        rows.append(row)
    return {
        "reference": reference,
        "peers": list(peers),
        "ratio_definition": "median step time of the other arm / median step time of this arm "
                            "(> 1: this arm is faster)",
        "tolerance": {"atol": atol, "rtol": rtol},
        "bootstrap_resamples": resamples,
        "arms": rows,
    }


# ---------------------------------------------------------------------- outputs


def _ci(r: dict | None) -> str:
    if r is None:
        return "—"
    lo, hi = r["ci95"]
    return f"{r['ratio']:.3f} [{lo:.3f}, {hi:.3f}]"


def _wall(row: dict) -> str:
    return f"{1e3 * row['wall_step_s']:.1f}" if row.get("wall_step_s") is not None else "—"


def _flag(v) -> str:
    return "—" if v is None else ("yes" if v else "**NO**")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(m: dict) -> str:
    a = m["analysis"]
    s, env = flat_settings(m["settings"]), m["environment"]  # older matrices: their flat settings
    peers = a["peers"]
    diffs = {x["name"]: x["diff"] for x in m.get("arms", [])}
    model = s.get("model_config") or s["preset"]
    params = next((r["params"] for runs in m["runs"].values() for r in runs
                   if not r.get("failed") and "params" in r), None)
    lines = [
        f"# Whole-step matrix{': ' + m['regime_label'] if m.get('regime_label') else ''}",
        "",
        f"- model {model}{f' ({params:,} trainable parameters)' if params else ''}, {s['precision']}, "
        f"world size {s['world_size']}, sequence {s['seq_len']}, micro-batch {s['micro_batch']} per rank, "
        f"stage {s['stage']}, buckets {s['allgather_bucket_size']:.3g}/{s['reduce_bucket_size']:.3g}",
        f"- {s['steps']} steps per run, first {s['warmup']} and the last not timed (a step is timed from its "
        f"start to the next one's, on the compute stream, no sync between); "
        f"wall ms/step: the steps after the warm-up back to back between two device-wide syncs (the last step "
        f"and its gather included), median over runs; {m['rounds']} round(s), order-balanced "
        f"(odd rounds reversed), each run a fresh process",
        f"- device {env.get('device')} · link {env.get('link_regime')} · {env.get('date')}"
        + ("" if m.get("complete") else f" · **incomplete: {m['runs_done']}/{m['runs_total']} runs**"),
        f"- ratio = median step of the named arm / median step of this arm (> 1: this arm is faster), "
        f"[bootstrap 95% CI]; accuracy against `{a['reference']}`",
        "",
        "| arm | settings | median ms | wall ms/step | vs " + a["reference"] + " [CI] | "
        + "".join(f"vs {p} [CI] | " for p in peers)
        + "peak alloc GiB | GB sent/rank/step (weights + grad) | reproducible | replicas | max loss diff "
        "| weights vs ref |",
        "|---|---|---|---|---|" + "---|" * len(peers) + "---|---|---|---|---|---|",
    ]
    for row in a["arms"]:
        name = row["arm"]
        diff = _cell(_fmt_diff(diffs.get(name, {})))
        if row["status"] in ("failed", "missing"):
            why = _cell(_last_line(row["errors"][0] if row["errors"] else ""))[:140]
            what = (f"FAILED ({row['runs_failed']} run(s)): {why}" if row["status"] == "failed"
                    else "NOT RUN (no run finished)")
            lines.append(f"| {name} | {diff} | {what} |" + " — |" * (8 + len(peers)))
            continue
        med = f"{1e3 * row['median_step_s']:.1f}" if row["median_step_s"] is not None else "—"
        if row["status"] == "partial":
            med += f" ({row['runs_ok']}/{row['runs_ok'] + row['runs_failed']} runs)"
        alloc = f"{row['peak_allocated_bytes'] / 2**30:.2f}" if row["peak_allocated_bytes"] is not None else "—"
        sent = f"{row['bytes_sent_per_step'] / 1e9:.3g}" if row["bytes_sent_per_step"] is not None else "—"
        if row.get("grad_bytes_sent_per_step") is not None:
            sent += f" + {row['grad_bytes_sent_per_step'] / 1e9:.3g} grad"
        loss = f"{row['max_loss_diff']:.4g}" if row["max_loss_diff"] is not None else "—"
        pa = row["param_agreement"]
        weights = (f"{pa['tolerance_violations']} viol., rel L2 {pa['param_rel_l2']:.2g}" if pa
                   else _cell(row["param_agreement_note"] or "—"))
        lines.append(
            f"| {name} | {diff} | {med} | {_wall(row)} | {_ci(row['vs_reference'])} | "
            + "".join(f"{_ci(row['vs_peers'].get(p))} | " for p in peers)
            + f"{alloc} | {sent} | {_flag(row['reproducible'])} | {_flag(row['replicas_identical'])} | "
            f"{loss} | {weights} |"
        )
    return "\n".join(lines) + "\n"


def plot(m: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = m["analysis"]["arms"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(rows) + 2), 4.5))
    data = [[1e3 * t for ts in r["step_times_by_run"] for t in ts] for r in rows]
    pos = [i + 1 for i, d in enumerate(data) if d]
    if pos:
        ax.boxplot([d for d in data if d], positions=pos, widths=0.5, showfliers=False)
    markers = "os^vD<>p*h"
    for i, r in enumerate(rows):
        for k, (rnd, ts) in enumerate(zip(r["rounds"], r["step_times_by_run"])):
            n = len(ts)
            xs = [i + 1 + 0.3 * ((j + 0.5) / max(n, 1) - 0.5) for j in range(n)]
            rnd = rnd if rnd is not None else k
            ax.scatter(xs, [1e3 * t for t in ts], s=14, alpha=0.7, marker=markers[rnd % len(markers)],
                       color=f"C{rnd % 10}", label=f"round {rnd + 1}")
    ref = next((r for r in rows if r["arm"] == m["analysis"]["reference"]), None)
    if ref and ref["median_step_s"]:
        ax.axhline(1e3 * ref["median_step_s"], color="grey", ls="--", lw=0.8, label=f"{ref['arm']} median")
    labels = []
    for r in rows:
        if r["status"] in ("failed", "missing"):
            labels.append(f"{r['arm']}\n({'failed' if r['status'] == 'failed' else 'not run'})")
        elif r["vs_reference"]:
            labels.append(f"{r['arm']}\n{r['vs_reference']['ratio']:.3f}x")
        else:
            labels.append(r["arm"])
    ax.set_xticks(range(1, len(rows) + 1), labels, fontsize=8)
    ax.set_xlim(0.4, len(rows) + 0.6)
    ax.set_ylabel("measured step time (ms)")
    title = "step time per arm (ratio vs " + m["analysis"]["reference"] + ")"
    ax.set_title(f"{m['regime_label']}: {title}" if m.get("regime_label") else title, fontsize=10)
    handles, names = ax.get_legend_handles_labels()
    uniq = dict(zip(names, handles))
    if uniq:
        ax.legend(uniq.values(), uniq.keys(), fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _strip(run: dict) -> dict:
    return {k: v for k, v in run.items() if k != "sample"}


def write(m: dict, out_dir: str, with_plot: bool) -> str:
    """Write matrix.json and matrix.md (and steps.png); return the Markdown."""
    text = markdown(m)
    blob = dict(m, runs={n: [_strip(r) for r in runs] for n, runs in m["runs"].items()})
    tmp = os.path.join(out_dir, "matrix.json.tmp")
    with open(tmp, "w") as f:
        json.dump(blob, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, "matrix.json"))
    with open(os.path.join(out_dir, "matrix.md"), "w") as f:
        f.write(text)
    if with_plot:
        try:
            plot(m, os.path.join(out_dir, "steps.png"))
        except Exception as e:  # a plot is not worth the measurements
            print(f"steps_matrix: plot failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    return text


# ---------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    d = TrainSettings()
    p = argparse.ArgumentParser(prog="qzero bench steps", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    w = p.add_argument_group("common settings (every arm)")
    w.add_argument("--device", choices=("auto", "cpu", "cuda"), default=d.device)
    w.add_argument("--world-size", type=int, default=d.world_size)
    w.add_argument("--preset", default=d.preset)
    w.add_argument("--model-config", default=d.model_config, metavar="JSON")
    w.add_argument("--data", default=d.data, metavar="FILE")
    w.add_argument("--seq-len", type=int, default=d.seq_len)
    w.add_argument("--micro-batch", type=int, default=d.micro_batch)
    w.add_argument("--grad-accum", type=int, default=d.grad_accum)
    w.add_argument("--steps", type=int, default=d.steps)
    w.add_argument("--warmup", type=int, default=d.warmup)
    w.add_argument("--stage", type=int, choices=(1, 2), default=d.zero.stage)
    w.add_argument("--allgather-bucket-size", type=float, default=d.zero.allgather_bucket_size,
                   help="ZeroConfig.allgather_bucket_size of every arm (an arm's own setting wins)")
    w.add_argument("--reduce-bucket-size", type=float, default=d.zero.reduce_bucket_size,
                   help="ZeroConfig.reduce_bucket_size of every arm (an arm's own setting wins)")
    w.add_argument("--lr", type=float, default=d.lr)
    w.add_argument("--precision", choices=PRECISIONS, default=d.precision)
    w.add_argument("--seed", type=int, default=d.seed)
    m = p.add_argument_group("matrix")
    m.add_argument("--arm", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                   help="a named arm and the settings it changes: TrainSettings or ZeroConfig fields, or the short "
                   f"names {', '.join(ZERO_ALIASES)} (repeat; values parsed as JSON where possible)")
    m.add_argument("--rounds", type=int, default=2, help="rounds of all arms, odd rounds reversed (default 2)")
    m.add_argument("--reference", help="the arm ratios and accuracy are measured against (default: the first)")
    m.add_argument("--peers", default="", help="comma-separated arms to give ratios against too, e.g. deepspeed,fsdp2")
    m.add_argument("--tolerance", type=float, default=0.02, help="atol = rtol for sampled weights (default 0.02)")
    m.add_argument("--regime-label", default="", help="names the link regime in the outputs")
    m.add_argument("--out", default="steps-matrix", help="output folder (default ./steps-matrix)")
    m.add_argument("--compare", nargs=2, metavar=("MATRIX_JSON", "BASE:ARM"),
                   help="only print median(BASE) / median(ARM) of a saved matrix.json with its bootstrap 95%% "
                   "interval (two arms its table does not set side by side), and exit")
    return p


def compare(matrix: dict, base: str, arm: str, resamples: int = 2000) -> dict:
    """``median(base) / median(arm)`` over a saved matrix's runs, with the analysis's bootstrap."""
    for name in (base, arm):
        if name not in matrix.get("runs", {}):
            raise SpecError(f"arm {name!r} is not in the matrix ({', '.join(matrix.get('runs', {}))})")
    r = _ratio(_times(matrix["runs"][base]), _times(matrix["runs"][arm]), resamples)
    if r is None:
        raise SpecError(f"{base!r} or {arm!r} has no measured steps")
    return r


def plan(args: argparse.Namespace, check=validate
         ) -> tuple[TrainSettings, dict[str, TrainSettings], dict[str, dict], str, list[str]]:
    """Common settings, each arm's settings and diff, reference and peers; validated by ``check``
    (``qzero.app.train.validate``; the emulated link checks them as on one rank). Raises SpecError."""
    if not args.arm:
        raise SpecError("give at least one --arm NAME:key=value,...")
    given = dict(
        device=args.device, world_size=args.world_size, preset=args.preset, model_config=args.model_config,
        data=args.data, seq_len=args.seq_len, micro_batch=args.micro_batch, grad_accum=args.grad_accum,
        steps=args.steps, warmup=args.warmup, stage=args.stage, allgather_bucket_size=args.allgather_bucket_size,
        reduce_bucket_size=args.reduce_bucket_size, lr=args.lr, precision=args.precision, seed=args.seed,
    )
    try:
        base = settings_from(given)
    except (ValueError, TypeError) as e:
        raise SpecError(str(e).splitlines()[0]) from None
    arms: dict[str, TrainSettings] = {}
    diffs: dict[str, dict] = {}
    for spec in args.arm:
        name, overrides = parse_arm(spec)
        if name in arms:
            raise SpecError(f"--arm {name} given twice")
        arm_env = overrides.pop("env", {})
        try:  # the arm's settings on top of the common ones (ZeroConfig re-derives what depends on them)
            s = settings_from({**given, **overrides})
            check(s)
        except (ValueError, TypeError) as e:
            raise SpecError(f"--arm {name}: {str(e).splitlines()[0]}") from None
        arms[name] = s
        diffs[name] = settings_diff(base, s)
        if arm_env:
            diffs[name]["env"] = arm_env
    reference = args.reference or next(iter(arms))
    if reference not in arms:
        raise SpecError(f"--reference {reference!r} is not one of the arms ({', '.join(arms)})")
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    for p in peers:
        if p not in arms:
            raise SpecError(f"--peers: {p!r} is not one of the arms ({', '.join(arms)})")
    schedule(list(arms), args.rounds)  # checks --rounds
    return base, arms, diffs, reference, peers


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.compare:
        path, pair = args.compare
        base_arm, sep, arm = pair.partition(":")
        try:
            if not sep:
                raise SpecError(f"--compare takes BASE:ARM, not {pair!r}")
            with open(path) as f:
                r = compare(json.load(f), base_arm, arm)
        except (SpecError, OSError, ValueError) as e:
            parser.error(str(e))
        print(f"{base_arm} / {arm}: {r['ratio']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]")
        return 0
    try:
        base, arms, diffs, reference, peers = plan(args)
    except SpecError as e:
        parser.error(str(e))
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    env = describe(resolve_device(base))
    env["command"] = " ".join(shlex.quote(a) for a in
                              ["qzero", "bench", "steps", *(sys.argv[1:] if argv is None else argv)])
    order = schedule(list(arms), args.rounds)
    runs: dict[str, list[dict]] = {n: [] for n in arms}
    matrix = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "regime_label": args.regime_label,
        "settings": dataclasses.asdict(base),
        "arms": [{"name": n, "diff": diffs[n], "settings": dataclasses.asdict(s)} for n, s in arms.items()],
        "reference": reference,
        "peers": peers,
        "rounds": args.rounds,
        "schedule": [{"round": r, "arm": n} for r, n in order],
        "environment": env,
        "runs_total": len(order),
        "runs_done": 0,
        "complete": False,
        "runs": runs,
    }
    with tempfile.TemporaryDirectory() as tmp:
        for i, (r, name) in enumerate(order):
            print(f"steps_matrix: [{i + 1}/{len(order)}] round {r + 1}/{args.rounds} arm {name} "
                  f"- {_fmt_diff(diffs[name])}", flush=True)
            out = os.path.join(tmp, f"r{r}_{name}.json")
            log = os.path.join(args.out, "logs", f"r{r}_{name}.log")
            try:
                result = run_arm(arms[name], out, log, env=diffs[name].get("env"))
                result["round"], result["index"] = r, i
                runs[name].append(result)
                times = result.get("step_times") or []
                med = f"{1e3 * statistics.median(times):.1f} ms median" if times else "no measured steps"
                print(f"steps_matrix:   {name}: {med}", flush=True)
            except (ArmFailed, OSError, ValueError) as e:
                runs[name].append({"failed": True, "round": r, "index": i, "error": str(e)[-3000:]})
                print(f"steps_matrix:   {name}: FAILED: {_last_line(str(e))[:200]} (log {log})", flush=True)
            matrix["runs_done"] = i + 1
            matrix["complete"] = i + 1 == len(order)
            matrix["analysis"] = analyse(runs, reference, peers, atol=args.tolerance, rtol=args.tolerance)
            text = write(matrix, args.out, with_plot=matrix["complete"])
    print(f"steps_matrix: wrote {os.path.join(args.out, 'matrix.json')}, matrix.md, steps.png", flush=True)
    print()
    print(text, end="", flush=True)
    return 0 if _ok_runs(runs[reference]) else 1


if __name__ == "__main__":
    sys.exit(main())
