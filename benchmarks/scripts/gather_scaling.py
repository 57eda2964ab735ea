"""Gather time against world size, set against the bandwidth model.

Reads ``benchmarks/scripts/gather_bench.py`` results of one link regime at several world sizes (its
multi-GPU JSON files) and compares every arm's median time with the model

    time(world) = bytes per parameter x numel x (world - 1) / world / bus bandwidth

(what each rank must receive in a ring all-gather). The bus bandwidth is calibrated once,
from the plain bf16 gather at the smallest world size given, and then held fixed: the
model predicts every other arm and world size from it. Bytes per parameter: bf16 2,
INT8 and FP8 1 + 4/group, INT4 1/2 + 4/group (fp32 scales; exact ranges and section
alignment are ignored, a few bytes per chunk). "payload only" arms count the same bytes
as their format. A measured/model ratio above 1 is time the bandwidth model does not
explain (kernels left exposed, per-collective latency, a link slower at that size).

    python benchmarks/scripts/gather_scaling.py RESULT.json [RESULT.json ...] --out DIR

Writes ``DIR/gather_scaling.{json,md,png}`` and prints the Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

SCALE_BYTES = 4


def bytes_per_param(arm: str, group_size: int) -> float | None:
    """Bytes one parameter costs on the wire in ``arm`` (None for arms the model does not cover)."""
    fmt = arm.split()[0]
    if fmt == "bf16":
        return 2.0
    if fmt in ("int8", "fp8"):
        return 1.0 + SCALE_BYTES / group_size
    if fmt == "int4":
        return 0.5 + SCALE_BYTES / group_size
    return None


def load(paths: list[str]) -> list[dict]:
    runs = []
    for path in paths:
        with open(path) as f:
            r = json.load(f)
        if r.get("mode") != "multi":
            raise ValueError(f"{path}: not a multi-GPU gather_bench result (mode {r.get('mode')!r})")
        r["_path"] = path
        runs.append(r)
    regimes = {r["regime"] for r in runs}
    if len(regimes) != 1:
        raise ValueError(f"results from several link regimes: {sorted(regimes)}; give one regime at a time")
    worlds = [r["world_size"] for r in runs]
    if len(set(worlds)) != len(worlds):
        raise ValueError(f"two results for one world size: {sorted(worlds)}")
    return sorted(runs, key=lambda r: r["world_size"])


def analyse(runs: list[dict]) -> dict:
    """Calibrate on bf16 at the smallest world size; model every arm at every world size."""
    base = runs[0]
    rows = []
    calib = None
    for size in base["sizes"]:
        if "bf16" in size["arms"]:
            n, w = size["numel"], base["world_size"]
            t = size["arms"]["bf16"]["median_ms"] / 1e3
            calib = {"world_size": w, "numel": n, "busbw_GBps": 2.0 * n * (w - 1) / w / t / 1e9}
            break
    if calib is None:
        raise ValueError("the smallest world size has no bf16 arm to calibrate the link bandwidth on")
    busbw = calib["busbw_GBps"] * 1e9
    for r in runs:
        w, group = r["world_size"], r["group_size"]
        for size in r["sizes"]:
            n = size["numel"]
            for arm, m in size["arms"].items():
                bpp = bytes_per_param(arm, group)
                if bpp is None:
                    continue
                model_ms = 1e3 * bpp * n * (w - 1) / w / busbw if w > 1 else 0.0
                rows.append({
                    "world_size": w, "numel": n, "arm": arm, "bytes_per_param": bpp,
                    "measured_ms": m["median_ms"], "model_ms": model_ms,
                    "measured_over_model": m["median_ms"] / model_ms if model_ms else None,
                    "busbw_GBps": bpp * n * (w - 1) / w / (m["median_ms"] / 1e3) / 1e9 if w > 1 else None,
                })
    return {
        "regime": base["regime"],
        "device": base.get("device"),
        "calibration": calib,
        "rows": rows,
        "sources": [os.path.basename(r["_path"]) for r in runs],
        "versions": {k: base.get(k) for k in ("torch", "triton", "cuda")},
    }


def to_markdown(a: dict) -> str:
    c = a["calibration"]
    lines = [
        f"# Gather time against world size: {a['regime']}",
        "",
        f"{a['device']}; sources {', '.join(a['sources'])}. Model: bytes/parameter x numel x (world-1)/world / "
        f"bus bandwidth, calibrated on the bf16 gather at world {c['world_size']}: {c['busbw_GBps']:.1f} GB/s.",
        "",
        "| world | params | arm | bytes/param | measured ms | model ms | measured / model | bus GB/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in a["rows"]:
        ratio = f"{r['measured_over_model']:.2f}" if r["measured_over_model"] else "—"
        bus = f"{r['busbw_GBps']:.1f}" if r["busbw_GBps"] else "—"
        lines.append(
            f"| {r['world_size']} | {r['numel'] / 2**30:.3g} Gi | {r['arm']} | {r['bytes_per_param']:.4g} | "
            f"{r['measured_ms']:.2f} | {r['model_ms']:.2f} | {ratio} | {bus} |"
        )
    return "\n".join(lines) + "\n"


def plot(a: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    arms = sorted({r["arm"] for r in a["rows"] if "payload" not in r["arm"] and "via" not in r["arm"]})
    for i, arm in enumerate(arms):
        pts = sorted((r["world_size"], r["measured_ms"], r["model_ms"]) for r in a["rows"] if r["arm"] == arm)
        color = f"C{i}"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=f"{arm} measured")
        ax.plot([p[0] for p in pts], [p[2] for p in pts], "--", color=color, alpha=0.6, label=f"{arm} model")
    ax.set_xlabel("world size")
    ax.set_ylabel("gather time, ms")
    ax.set_title(a["regime"], fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="gather_bench.py multi-GPU JSON files of one regime")
    ap.add_argument("--out", default="gather-scaling")
    args = ap.parse_args(argv)
    try:
        a = analyse(load(args.results))
    except (ValueError, KeyError, OSError) as e:
        print(f"gather_scaling: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gather_scaling.json"), "w") as f:
        json.dump(a, f, indent=1)
    md = to_markdown(a)
    with open(os.path.join(args.out, "gather_scaling.md"), "w") as f:
        f.write(md)
    plot(a, os.path.join(args.out, "gather_scaling.png"))
    print(md, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
