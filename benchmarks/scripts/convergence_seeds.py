"""Convergence over several runs: does an arm's final loss differ from bf16 by more than a
target, once the spread between runs is counted?

One run of ``benchmarks/scripts/convergence.py`` gives each arm's final loss (mean of the last ``--last``
steps) and its difference from the reference arm of the same run (bf16, same batches). Two
runs of the same arm differ by a few tenths of a percent (non-deterministic kernels; other
seeds), so a single run cannot decide a target of that size. This script reads the
``convergence.json`` of several runs (other seeds, or repeats of one seed) and, per arm:

* the difference from the reference in every run (Δ %, paired within the run: the reference
  saw the same batches), and their mean, standard deviation and a two-sided 95% interval
  of the mean (Student's t over the runs);
* a two-sided p-value that the mean Δ is zero (Student's t): whether the arm differs from the
  reference at all, which a verdict of "undecided" leaves open;
* the same for the final held-out loss, where the runs measured one; and over the run, the Δ of
  every held-out evaluation the runs share, and (``--heldout-last K``) of each run's mean over its
  last K evaluations (one evaluation of a few windows is noisier than 100 steps of training loss);
* a verdict against ``--target`` (percent): **within** when the whole interval lies inside
  ±target, **outside** when the whole interval lies outside it, **undecided** otherwise
  (too few runs, or a mean near the edge). One run is always undecided.
* how many runs of the measured spread would put that interval inside ±target, if the true
  difference is zero and if it is the mean measured (none: no number of runs does, the mean
  being at or past the target): what deciding an undecided arm would take.

The reference's own spread is reported too, where two runs share a seed: the difference
between their reference arms' final losses is what one run's Δ can be off by. So is its spread
from seed to seed (the SD of its final loss over the seeds): what changing the seed alone moves.

Over the run (``--window`` steps, default 200): per arm, the Δ % of each window's mean loss,
and its mean and interval over the runs that kept their per-step losses — whether an arm lags
bf16 on the way and catches up, or drifts away, which the final loss alone does not show.

With ``--floor ARM`` (a replicate of the reference: the same settings, a second arm of the same
run, so its Δ is the reference's own non-determinism), every other arm's SD of Δ is set against
the floor's: the ratio and a one-sided F-test (does the arm's Δ move from run to run more than
the reference's own does?). An arm can be unbiased (its mean Δ zero) and still move a run much
further than non-determinism does: that is a different claim from the mean's, and this names it.

    python benchmarks/scripts/convergence_seeds.py OUT/convergence/dp2_delta_gathers/seed0 \\
        OUT/convergence/dp2_delta_gathers/seed1 --target 0.25 --out OUT

Writes ``OUT/seeds.md``, ``OUT/seeds.json``, ``OUT/seeds.png`` (each run's Δ, the mean and
its interval against the band) and ``OUT/seeds_over_steps.png`` (the Δ over the run) and prints
the tables. Pure Python: no GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys

#: Two-sided 97.5% quantiles of Student's t by degrees of freedom (1..30); larger: the normal's.
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042]


def t975(dof: int) -> float:
    if dof < 1:
        raise ValueError(f"degrees of freedom must be at least 1, got {dof}")
    return _T975[dof - 1] if dof <= len(_T975) else 1.960


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b) (continued fraction, modified Lentz)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):  # the fraction converges fast below the mean only
        return 1.0 - _betainc(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 500):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < 1e-14:
            break
    return front * f


def t_p_two_sided(t: float, dof: int) -> float:
    """P(|T| >= |t|) for Student's t with ``dof`` degrees of freedom."""
    if dof < 1:
        raise ValueError(f"degrees of freedom must be at least 1, got {dof}")
    return _betainc(dof / 2.0, 0.5, dof / (dof + t * t))


def f_sf(x: float, d1: int, d2: int) -> float:
    """P(F > x) for Fisher's F with (d1, d2) degrees of freedom."""
    if d1 < 1 or d2 < 1:
        raise ValueError(f"degrees of freedom must be at least 1, got ({d1}, {d2})")
    if x <= 0.0:
        return 1.0
    return _betainc(d2 / 2.0, d1 / 2.0, d2 / (d2 + d1 * x))


_HEADER = re.compile(r"convergence: preset (?P<preset>\S+) .*? at world size (?P<world>\d+), (?P<steps>\d+) steps "
                     r"of (?P<batch>\d+) x (?P<seq>\d+) tokens(?P<rest>.*)")


def load_log(file: str) -> dict:
    """A run from the log ``benchmarks/scripts/convergence.py`` printed (what ``run_convergence.sh SEEDS=...``
    keeps as ``seedN.log``): its header, the arms it started and the table it printed last.
    For a run whose ``convergence.json`` was not kept; Δ % as printed (two decimals). The seed
    is the header's, or else the ``seedN`` of the file's name."""
    with open(file) as f:
        lines = f.read().splitlines()
    head = next((m for m in map(_HEADER.match, lines) if m), None)
    if head is None:
        raise ValueError(f"{file}: not a benchmarks/scripts/convergence.py log (no 'convergence: preset ...' line)")
    rest = head["rest"]
    seed = re.search(r"\bseed (\d+)", rest) or re.search(r"seed(\d+)\.log$", os.path.basename(file))
    if seed is None:
        raise ValueError(f"{file}: the log names no seed (neither its header nor a file name like seed9.log)")
    lr = re.search(r"\blr ([0-9.e+-]+)", rest)
    warm = re.search(r"\(warmup (\d+) steps\)", rest)
    names = [m[1] for m in (re.match(r"\s+started (\S+)\s+on ", line) for line in lines) if m]
    table = [i for i, line in enumerate(lines) if line.startswith("| arm | final loss (mean of steps ")]
    if not table or not names:
        raise ValueError(f"{file}: the run did not finish (no final table, or no arm started)")
    top = table[-1]
    cols = [c.strip() for c in lines[top].strip("|").split("|")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[top + 2:top + 2 + len(names)]]
    if len(rows) != len(names) or any(len(r) != len(cols) for r in rows):
        raise ValueError(f"{file}: its final table does not hold one row per started arm ({names})")
    span = re.search(r"steps (\d+)\D(\d+)\)", cols[1])
    held_col = next((i for i, c in enumerate(cols) if c.startswith("Δ held-out vs ")), None)

    def pct(text: str) -> float | None:
        return None if text in ("—", "") else float(text.rstrip("%"))

    reference = names[[r[2] for r in rows].index("—")]
    arms = {n: {"final_loss": float(r[1]), "diff_pct": pct(r[3]) or 0.0} for n, r in zip(names, rows)}
    run = {"preset": head["preset"], "steps": int(head["steps"]), "seq_len": int(head["seq"]),
           "micro_batch": int(head["batch"]), "world_size": int(head["world"]),
           "lr": float(lr[1]) if lr else None, "lr_warmup": int(warm[1]) if warm else 0,
           "last": int(span[2]) - int(span[1]) + 1 if span else None,
           "seed": int(seed[1]), "from_log": True,
           "summary": {"reference": reference, "arms": arms},
           "arms": {n: {"label": r[0]} for n, r in zip(names, rows)}}
    if held_col is not None:
        run["heldout_summary"] = {"reference": reference, "arms": {
            n: {"diff_pct": 0.0 if n == reference else pct(r[held_col])} for n, r in zip(names, rows)}}
    return run


def load_run(path: str) -> dict:
    """A run's ``convergence.json`` (``path`` is the file or its folder), checked for what the
    aggregation needs; a ``.log`` file is read by :func:`load_log`."""
    if path.endswith(".log") and os.path.isfile(path):
        run = load_log(path)
        run["_file"] = path
        return run
    file = os.path.join(path, "convergence.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(f"{path}: no convergence.json there")
    with open(file) as f:
        run = json.load(f)
    summary = run.get("summary")
    if not isinstance(summary, dict) or "arms" not in summary or "reference" not in summary:
        raise ValueError(f"{file}: not a benchmarks/scripts/convergence.py study "
                         "(no summary with arms and a reference)")
    run.setdefault("lr_warmup", 0)  # a study recorded before the setting existed ran without warmup
    run["_file"] = file
    return run


def interval(values: list[float]) -> dict:
    """Mean, standard deviation and the 95% interval of the mean (None with one value)."""
    n = len(values)
    mean = statistics.fmean(values)
    if n < 2:
        return {"n": n, "mean": mean, "sd": None, "lo": None, "hi": None, "p_zero": None}
    sd = statistics.stdev(values)
    half = t975(n - 1) * sd / math.sqrt(n)
    p_zero = t_p_two_sided(mean / (sd / math.sqrt(n)), n - 1) if sd > 0 else (1.0 if mean == 0 else 0.0)
    return {"n": n, "mean": mean, "sd": sd, "lo": mean - half, "hi": mean + half, "p_zero": p_zero}


def runs_needed(sd: float | None, target: float, mean: float = 0.0, most: int = 1000) -> int | None:
    """How many runs of this SD put the 95% interval of the mean inside ±``target`` if the true
    difference were ``mean``: the smallest ``n`` with ``|mean| + t(n-1) sd / sqrt(n) <= target``;
    None when no number of runs up to ``most`` does (``|mean|`` at or past the target), or
    without an SD."""
    if sd is None or abs(mean) >= target:
        return None
    for n in range(2, most + 1):
        if abs(mean) + t975(n - 1) * sd / math.sqrt(n) <= target:
            return n
    return None


def verdict(stats: dict, target: float) -> str:
    """``within``, ``outside`` or ``undecided`` (see the module note)."""
    if stats["lo"] is None:
        return "undecided"
    if -target <= stats["lo"] and stats["hi"] <= target:
        return "within"
    if stats["lo"] > target or stats["hi"] < -target:
        return "outside"
    return "undecided"


def aggregate(runs: list[dict], target: float, floor: str | None = None, window: int = 200,
              heldout_last: int = 1) -> dict:
    """Per arm, over the runs that have it: Δ % of the final loss (and of the final held-out
    loss) from each run's reference, their interval and the verdict; with ``floor`` (an arm
    that replicates the reference), every other arm's spread against the floor's."""
    references = {r["summary"]["reference"] for r in runs}
    if len(references) != 1:
        raise ValueError(f"the runs compare against different reference arms: {sorted(references)}")
    reference = references.pop()
    # a field a run's log does not print (lr in older logs) is not held against it
    keys = ("preset", "steps", "seq_len", "micro_batch", "world_size", "lr", "lr_warmup", "last")
    differ = [k for k in keys if len({r.get(k) for r in runs if not (r.get("from_log") and r.get(k) is None)}) > 1]
    if differ:
        shapes = {tuple(r.get(k) for k in keys) for r in runs}
        raise ValueError(f"the runs are of different studies ({', '.join(differ)} differ; each run's "
                         f"{', '.join(keys)}): {sorted(map(str, shapes))}")
    names = []
    for r in runs:
        names += [n for n in r["summary"]["arms"] if n not in names]
    arms = {}
    for name in names:
        if name == reference:
            continue
        have = [r for r in runs if name in r["summary"]["arms"]]
        deltas = [r["summary"]["arms"][name]["diff_pct"] for r in have]
        held = [r["heldout_summary"]["arms"][name]["diff_pct"] for r in have
                if (r.get("heldout_summary") or {}).get("arms", {}).get(name, {}).get("diff_pct") is not None]
        stats = interval(deltas)
        arms[name] = {
            "label": have[0]["arms"].get(name, {}).get("label", name),
            "runs": [{"file": r["_file"], "seed": r.get("seed"), "diff_pct": d} for r, d in zip(have, deltas)],
            "diff_pct": stats,
            "verdict": verdict(stats, target),
            # the runs an interval inside the band needs at this SD: if the true difference is
            # zero, and if it is the mean measured (None: no number of runs would do)
            "runs_needed": {"at_zero": runs_needed(stats["sd"], target),
                            "at_mean": runs_needed(stats["sd"], target, stats["mean"])},
            "heldout_diff_pct": interval(held) if held else None,
        }
    # the reference against itself: runs that share a seed, and its final loss from seed to seed
    by_seed: dict = {}
    for r in runs:
        by_seed.setdefault(r.get("seed"), []).append(r["summary"]["arms"][reference]["final_loss"])
    repeats = {str(seed): losses for seed, losses in by_seed.items() if len(losses) > 1}
    spread = {seed: 100.0 * (max(v) - min(v)) / min(v) for seed, v in repeats.items()}
    per_seed = [v[0] for seed, v in by_seed.items() if seed is not None]  # the first run of each seed
    across = None
    if len(per_seed) > 1:
        mean = statistics.fmean(per_seed)
        across = {"seeds": len(per_seed), "mean_loss": mean, "sd_pct": 100.0 * statistics.stdev(per_seed) / mean}
    against_floor = None
    if floor is not None:
        if floor not in arms:
            raise ValueError(f"--floor {floor!r} is not an arm of these runs (arms: {sorted(arms)})")
        fsd, fn = arms[floor]["diff_pct"]["sd"], arms[floor]["diff_pct"]["n"]
        if not fsd:
            raise ValueError(f"--floor {floor!r} needs at least two runs with different Δ to have a spread "
                             f"(it has {fn})")
        against_floor = {"floor": floor, "floor_runs": fn, "floor_sd_pct": fsd, "arms": {}}
        for name, a in arms.items():
            sd, n = a["diff_pct"]["sd"], a["diff_pct"]["n"]
            if name == floor or sd is None:
                continue
            ratio = sd / fsd
            against_floor["arms"][name] = {"runs": n, "sd_pct": sd, "ratio": ratio, "F": ratio ** 2,
                                           "p_more": f_sf(ratio ** 2, n - 1, fn - 1)}
    return {"reference": reference, "target_pct": target, "runs": [r["_file"] for r in runs],
            "seeds": [r.get("seed") for r in runs], "arms": arms, "reference_spread_pct": spread,
            "reference_across_seeds": across, "spread_against_floor": against_floor,
            "over_steps": over_steps(runs, reference, window),
            "heldout_over_steps": heldout_over_steps(runs, reference, heldout_last),
            "from_logs": [r["_file"] for r in runs if r.get("from_log")]}


def _other_arms(runs: list[dict], reference: str) -> list[str]:
    """The arms of the runs other than the reference, in the order they first appear."""
    names = []
    for r in runs:
        names += [n for n in (r.get("arms") or {}) if n != reference and n not in names]
    return names


def over_steps(runs: list[dict], reference: str, window: int) -> dict:
    """Per arm with per-step losses in at least two runs: Δ % of the mean loss of each ``window``
    steps from the reference's over the same steps, in every run, and its interval over the runs.
    A run whose arm or reference did not finish every step (or a run from a log) is left out."""
    if window < 1:
        raise ValueError(f"--window must be at least 1 step, got {window}")
    out = {}
    for name in _other_arms(runs, reference):
        curves, files = [], []
        for r in runs:
            steps, arms = r.get("steps"), r.get("arms") or {}
            mine, ref = (arms.get(name) or {}).get("losses"), (arms.get(reference) or {}).get("losses")
            if not mine or not ref or not steps or len(mine) != steps or len(ref) != steps:
                continue
            curve = []
            for lo in range(0, steps, window):
                a = statistics.fmean(mine[lo:lo + window])
                b = statistics.fmean(ref[lo:lo + window])
                curve.append(100.0 * (a - b) / b)
            curves.append(curve)
            files.append(r["_file"])
        if len(curves) < 2 or len({len(c) for c in curves}) != 1:
            continue
        steps = runs[0]["steps"]
        windows = []
        for k in range(len(curves[0])):
            stats = interval([c[k] for c in curves])
            windows.append({"first": k * window + 1, "last": min(steps, (k + 1) * window), **stats})
        out[name] = {"runs": len(curves), "files": files, "window": window, "windows": windows, "curves": curves}
    return out


def heldout_over_steps(runs: list[dict], reference: str, last: int = 1) -> dict:
    """Per arm with held-out losses in at least two runs: Δ % of the held-out loss from the
    reference's at every evaluation step all those runs share, its interval over the runs, and
    that of each run's mean Δ over its ``last`` shared evaluations. A run from a log (no
    held-out curve) is left out."""
    if last < 1:
        raise ValueError(f"--heldout-last must be at least 1 evaluation, got {last}")
    out = {}
    for name in _other_arms(runs, reference):
        pairs = []
        for r in runs:
            arms = r.get("arms") or {}
            mine, ref = (arms.get(name) or {}).get("heldout_losses"), (arms.get(reference) or {}).get("heldout_losses")
            if mine and ref:
                pairs.append((r["_file"], dict(map(tuple, mine)), dict(map(tuple, ref))))
        if len(pairs) < 2:
            continue
        steps = sorted(set.intersection(*(set(m) & set(b) for _, m, b in pairs)))
        if not steps:
            continue
        curves = [[100.0 * (m[k] - b[k]) / b[k] for k in steps] for _, m, b in pairs]
        k = min(last, len(steps))
        out[name] = {"runs": len(pairs), "files": [f for f, _, _ in pairs], "steps": steps,
                     "evaluations": [{"step": st, **interval([c[i] for c in curves])} for i, st in enumerate(steps)],
                     "last": {"evaluations": k, "first_step": steps[-k], "last_step": steps[-1],
                              **interval([statistics.fmean(c[-k:]) for c in curves])}}
    return out


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:+.2f}%"


def markdown(result: dict) -> str:
    ref, target = result["reference"], result["target_pct"]
    lines = [
        f"# Final loss against {ref} over {len(result['runs'])} runs (seeds {', '.join(map(str, result['seeds']))})",
        "",
        f"Δ = the arm's final loss minus {ref}'s in the same run, in % of {ref}'s; interval: two-sided 95% of "
        f"the mean over the runs (Student's t); verdict against ±{target}%: within when the whole interval "
        "is inside, outside when it is wholly outside, otherwise undecided. Runs for the band: how many runs "
        f"of this SD put the interval inside ±{target}% if the true difference is zero / is the mean measured "
        "(none: no number of runs does).",
        "",
        "| arm | runs | Δ per run | mean Δ | SD | 95% interval | p (mean Δ = 0) | verdict | runs for the band "
        "| held-out: mean Δ [95%] |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, a in result["arms"].items():
        d = a["diff_pct"]
        per = ", ".join(_pct(x["diff_pct"]) for x in a["runs"])
        iv = "—" if d["lo"] is None else f"[{d['lo']:+.2f}%, {d['hi']:+.2f}%]"
        sd = "—" if d["sd"] is None else f"{d['sd']:.2f}%"
        h = a["heldout_diff_pct"]
        held = "—" if h is None else (_pct(h["mean"])
                                      + ("" if h["lo"] is None else f" [{h['lo']:+.2f}%, {h['hi']:+.2f}%]"))
        need = a["runs_needed"]
        runs_for = "—" if d["sd"] is None else " / ".join("none" if k is None else str(k)
                                                          for k in (need["at_zero"], need["at_mean"]))
        pz = "—" if d["p_zero"] is None else f"{d['p_zero']:.3f}"
        lines.append(f"| {a['label']} | {d['n']} | {per} | {_pct(d['mean'])} | {sd} | {iv} | {pz} | {a['verdict']} "
                     f"| {runs_for} | {held} |")
    if result.get("from_logs"):
        lines += ["", "Counted from the table their log printed (their convergence.json was not kept; Δ % to two "
                  "decimals): " + ", ".join(f"`{os.path.basename(f)}`" for f in result["from_logs"]) + "."]
    if result["reference_spread_pct"]:
        lines += ["", f"{ref} against itself (runs of one seed): " + "; ".join(
            f"seed {s}: {v:.2f}% between its runs" for s, v in result["reference_spread_pct"].items())]
    across = result.get("reference_across_seeds")
    if across:
        lines += ["", f"{ref}'s final loss from seed to seed ({across['seeds']} seeds, the first run of each): "
                  f"SD {across['sd_pct']:.2f}% of its mean {across['mean_loss']:.4f}."]
    over = result.get("over_steps") or {}
    if over:
        names = list(over)
        lines += ["", f"Over the run: Δ % of each {over[names[0]]['window']} steps' mean loss from {ref}'s "
                  "over the same steps, mean over the runs with their per-step losses [95% interval]:", "",
                  "| steps | " + " | ".join(f"{result['arms'][n]['label']} ({over[n]['runs']} runs)" for n in names)
                  + " |",
                  "|---|" + "---|" * len(names)]
        for k, w in enumerate(over[names[0]]["windows"]):
            cells = []
            for n in names:
                v = over[n]["windows"][k]
                cells.append(_pct(v["mean"]) + ("" if v["lo"] is None else f" [{v['lo']:+.2f}%, {v['hi']:+.2f}%]"))
            lines.append(f"| {w['first']}–{w['last']} | " + " | ".join(cells) + " |")
    held = result.get("heldout_over_steps") or {}
    if held:
        names = list(held)
        lines += ["", f"Held-out loss over the run: Δ % from {ref}'s at each evaluation, mean over the runs [95% "
                  "interval]; last row: each run's mean Δ over its last evaluations:", "",
                  "| after step | "
                  + " | ".join(f"{result['arms'][n]['label']} ({held[n]['runs']} runs)" for n in names)
                  + " |", "|---|" + "---|" * len(names)]

        def cell(v):
            return _pct(v["mean"]) + ("" if v["lo"] is None else f" [{v['lo']:+.2f}%, {v['hi']:+.2f}%]")

        steps = sorted({st for n in names for st in held[n]["steps"]})
        for st in steps:
            row = []
            for n in names:
                ev = next((e for e in held[n]["evaluations"] if e["step"] == st), None)
                row.append("—" if ev is None else cell(ev))
            lines.append(f"| {st} | " + " | ".join(row) + " |")
        spans = {n: f"{held[n]['last']['evaluations']} ({held[n]['last']['first_step']}–{held[n]['last']['last_step']})"
                 for n in names}
        if len(set(spans.values())) == 1:
            lines.append(f"| mean of the last {spans[names[0]]} | "
                         + " | ".join(cell(held[n]["last"]) for n in names) + " |")
        else:  # the arms share different evaluations
            lines.append("| mean of the last | "
                         + " | ".join(f"{spans[n]}: {cell(held[n]['last'])}" for n in names) + " |")
    fl = result.get("spread_against_floor")
    if fl:
        floor_label = result["arms"][fl["floor"]]["label"]
        lines += ["", f"Spread against the floor, {floor_label} ({fl['floor_runs']} runs, SD of Δ "
                  f"{fl['floor_sd_pct']:.2f}%: {ref}'s own run-to-run non-determinism). Ratio = the arm's SD of Δ over "
                  "the floor's; p = one-sided F-test that the arm's Δ moves more than the floor's:", "",
                  "| arm | runs | SD of Δ | ratio | F | p |", "|---|---|---|---|---|---|"]
        for name, a in fl["arms"].items():
            lines.append(f"| {result['arms'][name]['label']} | {a['runs']} | {a['sd_pct']:.2f}% | {a['ratio']:.1f}× "
                         f"| {a['F']:.1f} | {a['p_more']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    """``path`` (PNG): per arm with more than one run, each run's Δ % (dots), the mean and its 95%
    interval (bar), and the ±target band (shaded)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [(n, a) for n, a in result["arms"].items() if a["diff_pct"]["n"] > 1]
    if not arms:
        return
    target = result["target_pct"]
    fig, ax = plt.subplots(figsize=(7.5, 0.9 + 0.7 * len(arms)))
    ax.axvspan(-target, target, color="tab:green", alpha=0.12, label=f"±{target}% of {result['reference']}")
    ax.axvline(0.0, color="0.4", lw=0.8)
    for y, (_, a) in enumerate(arms):
        runs = [r["diff_pct"] for r in a["runs"]]
        ax.scatter(runs, [y] * len(runs), s=18, color="0.35", zorder=3)
        d = a["diff_pct"]
        ax.errorbar([d["mean"]], [y + 0.22], xerr=[[d["mean"] - d["lo"]], [d["hi"] - d["mean"]]], fmt="o",
                    color="tab:blue", capsize=4, zorder=4)
    ax.set_yticks(range(len(arms)), [f"{a['label']} ({a['diff_pct']['n']} runs)" for _, a in arms])
    ax.invert_yaxis()
    # the runs set the scale; an interval wider than them (two runs) runs off the axes
    edge = 1.25 * max([2 * target] + [abs(r["diff_pct"]) for _, a in arms for r in a["runs"]])
    ax.set_xlim(-edge, edge)
    ax.set_xlabel(f"final loss − {result['reference']}'s in the same run, %")
    ax.set_title("dots: runs; bar: the mean and its 95% interval", fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_over_steps(result: dict, path: str) -> None:
    """``path`` (PNG): per arm with at least three runs of per-step losses, each run's Δ % per
    window (thin), their mean (bold) and its 95% interval (shaded), and the ±target band; one
    y scale for every arm, so that their spreads compare at a glance."""
    arms = [(n, o) for n, o in (result.get("over_steps") or {}).items() if o["runs"] >= 3]
    if not arms:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    target = result["target_pct"]
    fig, axes = plt.subplots(len(arms), 1, figsize=(7.5, 0.6 + 2.6 * len(arms)), sharex=True, sharey=True,
                             squeeze=False)
    for ax, (name, o) in zip(axes[:, 0], arms):
        mid = [(w["first"] + w["last"]) / 2 for w in o["windows"]]
        for c in o["curves"]:
            ax.plot(mid, c, color="0.6", lw=0.7)
        ax.plot(mid, [w["mean"] for w in o["windows"]], color="tab:blue", lw=2, label="mean over the runs")
        ax.fill_between(mid, [w["lo"] for w in o["windows"]], [w["hi"] for w in o["windows"]], color="tab:blue",
                        alpha=0.2, label="95% interval of the mean")
        ax.axhspan(-target, target, color="tab:green", alpha=0.12, label=f"±{target}%")
        ax.axhline(0.0, color="0.4", lw=0.8)
        ax.set_title(f"{result['arms'][name]['label']} ({o['runs']} runs)", fontsize=9)
        ax.set_ylabel(f"Δ vs {result['reference']}, %")
    axes[0, 0].legend(loc="upper right", fontsize=7)
    axes[-1, 0].set_xlabel(f"step (mean loss of each {arms[0][1]['window']} steps)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="folders (or convergence.json files) of benchmarks/scripts/convergence.py "
                    "runs, or the log a run printed (a .log file: for a run whose convergence.json was not kept)")
    ap.add_argument("--target", type=float, default=0.5, help="percent (default 0.5)")
    ap.add_argument("--floor", default=None, help="an arm that replicates the reference (e.g. bf16-rep2): set every "
                    "other arm's spread of Δ against it")
    ap.add_argument("--window", type=int, default=200, help="steps per window of the Δ over the run (default 200)")
    ap.add_argument("--heldout-last", type=int, default=1, help="held-out evaluations per run averaged in the last row "
                    "of the held-out table (default 1: the final one)")
    ap.add_argument("--out", default=None, help="write seeds.md and seeds.json here")
    args = ap.parse_args(argv)
    if not args.target > 0:
        ap.error(f"--target must be a positive percent, got {args.target}")
    try:
        result = aggregate([load_run(p) for p in args.runs], args.target, args.floor, args.window, args.heldout_last)
    except ValueError as e:
        print(f"convergence_seeds: error: {e}", file=sys.stderr)
        return 2
    text = markdown(result)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "seeds.md"), "w") as f:
            f.write(text)
        with open(os.path.join(args.out, "seeds.json"), "w") as f:
            json.dump(result, f, indent=1)
        plot(result, os.path.join(args.out, "seeds.png"))
        plot_over_steps(result, os.path.join(args.out, "seeds_over_steps.png"))
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
