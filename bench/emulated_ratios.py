"""Speed-ups between arms of emulated-link matrices, with intervals that include run-to-run spread.

``bench/emulated_matrix.py`` writes one ``matrix.json`` per (cell, link); each arm's runs (one a
round) keep their step times. A comparison ``A/B`` here is how many times faster ``B`` is than
``A`` (median step of ``A`` over median step of ``B``, > 1: ``B`` is faster), with the two-level
bootstrap interval of :func:`qzero.app.qualify.stats.bootstrap_ci_arms` (runs resampled, then
steps within runs: with two rounds it shows the spread between them, with one it is only the
step-to-step noise). Every figure is of an emulated link.

    python3 bench/emulated_ratios.py OUT [OUT ...] --pair fsdp2/int8_ahead --pair int8_ahead_qgrad/int8_ahead_qgrad4 \\
        [--out ratios.md]

prints (and writes) one row per pair, cell and link where both arms ran. The runs of one arm on
one cell and link (the link's full name, its time scale and contention included) are pooled
over every folder given, so separate invocations of the same setting count as more rounds.

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
sys.path.insert(0, os.path.join(HERE, "..", "src"))

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
    lines = ["| cell | link | A | B | A ms (per run) | B ms (per run) | A/B | 95% interval |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        runs = lambda xs: " / ".join(f"{x:.1f}" for x in xs)  # noqa: E731
        lines.append(f"| {r['cell']} | {r['link']} | {r['base']} | {r['cand']} | {r['base_ms']:.1f} ({runs(r['base_runs_ms'])}) | "
                     f"{r['cand_ms']:.1f} ({runs(r['cand_runs_ms'])}) | {r['ratio']:.3f}× | "
                     f"{r['ci95'][0]:.3f}–{r['ci95'][1]:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", help="emulated_matrix.py --out folders")
    ap.add_argument("--pair", action="append", required=True, metavar="A/B",
                    help="A/B: how many times faster arm B is than arm A (repeatable)")
    ap.add_argument("--fastest", action="store_true",
                    help="compare each arm's fastest run, not all its runs pooled (see above)")
    ap.add_argument("--out", help="also write the table (markdown) here")
    args = ap.parse_args(argv)
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
    for cell, link, m in found:
        into = pooled.setdefault((cell, link), {})
        for arm, runs in arm_runs(m).items():
            into.setdefault(arm, []).extend(runs)
    rows = []
    for (cell, link), runs in pooled.items():
        for a, b in pairs:
            r = compare(runs, a, b, args.fastest)
            if r is not None:
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
