"""Speed-ups between arms of emulated-link matrices, with intervals that include run-to-run spread.

``benchmarks/scripts/emulated_matrix.py`` writes one ``matrix.json`` per (cell, link); each arm's runs (one a
round) keep their step times. A comparison ``A/B`` here is how many times faster ``B`` is than
``A`` (median step of ``A`` over median step of ``B``, > 1: ``B`` is faster), with the two-level
bootstrap interval of :func:`qzero.app.qualify.stats.bootstrap_ci_arms` (runs resampled, then
steps within runs: with two rounds it shows the spread between them, with one it is only the
step-to-step noise). Every figure is of an emulated link.

    python3 benchmarks/scripts/emulated_ratios.py OUT [OUT ...] --pair fsdp2/int8_ahead \\
        --pair int8_ahead_qgrad/int8_ahead_qgrad4 [--out ratios.md]

prints (and writes) one row per pair, cell and link where both arms ran. The runs of one arm on
one cell and link (the link's full name, its time scale and contention included) are pooled
over every folder given, so separate invocations of the same setting count as more rounds.

``--host-excess EMULATED.json NCCL.json`` (two ``benchmarks/scripts/collective_host_cost.py`` results of the same
host: the emulated world on a link like the matrices', and NCCL) bounds what the emulated call's
extra host time can do to a ratio. Each arm's excess per step is its calls per step on the link
(each run's ``link_per_step``) times how many microseconds more an emulated call of that kind
costs the host than NCCL's (broadcasts, reduces and barriers at the all-reduce's excess). Where
a phase is host-bound the whole excess is in the step, where the GPU bounds it none is, so on
NCCL each arm's step lies between its median less its excess and its median: the ratio's bounds
are the lowest and highest ``A/B`` over those ends, and the table adds them with each arm's
excess.

``--fastest`` compares each arm's fastest run (lowest median) instead, its interval resampling
that run's steps. Use it where slow runs are the host's, not the arm's: a host that falls
behind the GPU for a while (the step timeline's host lead near 0, the GPU's power draw down,
its clocks unchanged) only ever adds time, so the fastest run is the arm's own speed and a
pooled median mixes in how busy the host was.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "src"))

from qzero.app.qualify.stats import bootstrap_ci_arms, speedup  # noqa: E402


def arm_runs(matrix: dict) -> dict[str, list[list[float]]]:
    """Each arm's step times (ms) per run of one ``matrix.json``; arms without a run are left out."""
    out = {}
    for a in matrix.get("analysis", {}).get("arms", []):
        runs = [[1e3 * t for t in r] for r in a.get("step_times_by_run") or [] if r]
        if runs:
            out[a["arm"]] = runs
    return out


def fastest_run(runs: list[list[float]]) -> list[list[float]]:
    """The run with the lowest median step (the first of equals), alone."""
    return [min(runs, key=statistics.median)]


def compare(runs: dict[str, list[list[float]]], base: str, cand: str, fastest: bool = False) -> dict | None:
    """``base``'s median step over ``cand``'s, its interval, and both medians and run medians (ms);
    with ``fastest``, of each arm's fastest run (:func:`fastest_run`)."""
    if base not in runs or cand not in runs:
        return None
    b, c = runs[base], runs[cand]
    if fastest:
        b, c = fastest_run(b), fastest_run(c)
    pool = lambda rs: [t for r in rs for t in r]  # noqa: E731
    return {
        "base": base, "cand": cand, "ratio": speedup(pool(b), pool(c)), "ci95": bootstrap_ci_arms(b, c),
        "base_ms": statistics.median(pool(b)), "cand_ms": statistics.median(pool(c)),
        "base_runs_ms": [statistics.median(r) for r in b], "cand_runs_ms": [statistics.median(r) for r in c],
    }


#: The link's names of the collectives (``emulated_link.wire_bytes``) and the
#: ``collective_host_cost.py`` name whose host cost stands for each.
HOST_COST_OF = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor",
                "all_to_all": "all_to_all_single", "all_reduce": "all_reduce", "broadcast": "all_reduce",
                "reduce": "all_reduce", "barrier": "all_reduce"}


def host_excess_us(emulated: dict, nccl: dict) -> dict[str, float]:
    """Per link op: microseconds of host time an emulated call costs more than NCCL's, from two
    ``collective_host_cost.py`` results (``mode`` ``emulated`` and ``nccl``)."""
    if emulated.get("mode") != "emulated" or nccl.get("mode") != "nccl":
        raise ValueError("--host-excess takes an emulated and then an NCCL result of "
                         "benchmarks/scripts/collective_host_cost.py, "
                         f"got modes {emulated.get('mode')!r} and {nccl.get('mode')!r}")
    e, n = emulated["host_us_per_call"], nccl["host_us_per_call"]
    return {op: e[name] - n[name] for op, name in HOST_COST_OF.items() if name in e and name in n}


def arm_excess_ms(matrix: dict, excess_us: dict[str, float]) -> dict[str, float]:
    """Per arm of one ``matrix.json``: the emulated calls' excess host time per step (ms; the
    median over its runs of calls per step times each op's excess). An op without a known
    excess raises: the bound would be silently low."""
    out = {}
    for arm, runs in (matrix.get("runs") or {}).items():
        per_run = []
        for run in runs:
            ops = run.get("link_per_step") or {}
            missing = sorted(set(ops) - set(excess_us))
            if missing:
                raise ValueError(f"arm {arm}: no host cost for the link's {', '.join(missing)} calls")
            per_run.append(sum(v["calls"] * excess_us[op] for op, v in ops.items()) / 1e3)
        if per_run:
            out[arm] = statistics.median(per_run)
    return out


def excess_bounds(base_ms: float, cand_ms: float, base_excess: float, cand_excess: float) -> tuple[float, float]:
    """The lowest and highest ``base / cand`` when each step may lose anything from none to all of
    its excess (see the module note)."""
    ends = [b / c for b in (base_ms, base_ms - base_excess) for c in (cand_ms, cand_ms - cand_excess)]
    return min(ends), max(ends)


def matrices(folders: list[str]) -> list[tuple[str, str, dict]]:
    """``(cell, link, matrix)`` for every ``FOLDER/CELL/LINK/matrix.json``."""
    found = []
    for folder in folders:
        for path in sorted(glob.glob(os.path.join(folder, "*", "*", "matrix.json"))):
            link_dir = os.path.dirname(path)
            with open(path) as f:
                m = json.load(f)
            found.append((os.path.basename(os.path.dirname(link_dir)), m.get("emulated_link", {}).get("name")
                          or os.path.basename(link_dir), m))
    return found


def table(rows: list[dict]) -> str:
    excess = any("excess_bounds" in r for r in rows)
    head = "| cell | link | A | B | A ms (per run) | B ms (per run) | A/B | 95% interval |"
    if excess:
        head += " host excess ms/step: A, B | A/B with the excess in or out |"
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        runs = lambda xs: " / ".join(f"{x:.1f}" for x in xs)  # noqa: E731
        line = (f"| {r['cell']} | {r['link']} | {r['base']} | {r['cand']} | "
                f"{r['base_ms']:.1f} ({runs(r['base_runs_ms'])}) | "
                f"{r['cand_ms']:.1f} ({runs(r['cand_runs_ms'])}) | {r['ratio']:.3f}× | "
                f"{r['ci95'][0]:.3f}–{r['ci95'][1]:.3f} |")
        if excess:
            lo, hi = r.get("excess_bounds", (None, None))
            line += (" — | — |" if lo is None else
                     f" {r['base_excess_ms']:.1f}, {r['cand_excess_ms']:.1f} | {lo:.3f}–{hi:.3f}× |")
        lines.append(line)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", help="emulated_matrix.py --out folders")
    ap.add_argument("--pair", action="append", required=True, metavar="A/B",
                    help="A/B: how many times faster arm B is than arm A (repeatable)")
    ap.add_argument("--fastest", action="store_true",
                    help="compare each arm's fastest run, not all its runs pooled (see above)")
    ap.add_argument("--host-excess", nargs=2, metavar=("EMULATED_JSON", "NCCL_JSON"),
                    help="bound the ratios by the emulated calls' extra host time (see above)")
    ap.add_argument("--out", help="also write the table (markdown) here")
    args = ap.parse_args(argv)
    excess_us = None
    if args.host_excess:
        try:
            loaded = []
            for path in args.host_excess:
                with open(path) as f:
                    loaded.append(json.load(f))
            excess_us = host_excess_us(*loaded)
        except (OSError, ValueError, KeyError) as e:
            ap.error(f"--host-excess: {e}")
    pairs = []
    for p in args.pair:
        a, sep, b = p.partition("/")
        if not sep or not a or not b:
            ap.error(f"--pair takes A/B (two arm names), got {p!r}")
        pairs.append((a, b))
    found = matrices(args.folders)
    if not found:
        ap.error(f"no CELL/LINK/matrix.json under {args.folders}")
    pooled: dict[tuple[str, str], dict[str, list[list[float]]]] = {}
    excess: dict[tuple[str, str], dict[str, list[float]]] = {}
    for cell, link, m in found:
        into = pooled.setdefault((cell, link), {})
        for arm, runs in arm_runs(m).items():
            into.setdefault(arm, []).extend(runs)
        if excess_us is not None:
            try:
                for arm, ms in arm_excess_ms(m, excess_us).items():
                    excess.setdefault((cell, link), {}).setdefault(arm, []).append(ms)
            except ValueError as e:
                ap.error(f"{cell} on {link}: {e}")
    rows = []
    for (cell, link), runs in pooled.items():
        for a, b in pairs:
            r = compare(runs, a, b, args.fastest)
            if r is None:
                continue
            ex = excess.get((cell, link), {})
            if a in ex and b in ex:
                r["base_excess_ms"], r["cand_excess_ms"] = statistics.median(ex[a]), statistics.median(ex[b])
                r["excess_bounds"] = excess_bounds(r["base_ms"], r["cand_ms"], r["base_excess_ms"], r["cand_excess_ms"])
            rows.append({"cell": cell, "link": link, **r})
    if not rows:
        ap.error("none of the pairs has both arms in any matrix")
    text = ("Speed-ups on an emulated link (A/B > 1: B is faster"
            + ("; each arm's fastest run" if args.fastest else "; every run pooled") + ")\n\n" + table(rows))
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
