"""The plan against the emulated cluster: for every arm of emulated cluster matrices
(``benchmarks/scripts/emulated_matrix.py --nodes ...``), ``qzero plan``'s projection of the same
arm, buckets and cluster with the measured one-GPU step as its compute, beside the emulator's
median and wall step, the bits per parameter per step per node the emulator counted against the
plan's, and peak memory against FSDP2's.

An arm is mapped to the plan's by its settings: ``backend=fsdp2`` is ``FSDP2``; qzero's by
weight payload (none, INT8, INT4 delta), gradient payload (none, INT8, INT4), two-level or flat
(``hierarchical_collectives``) and the node stage (``zero_quantized_gradients_intra_node``).
Every figure on both sides is of an emulated or modelled cluster, not a measured one.

    python3 benchmarks/scripts/cluster_calibration.py OUT/c8x8 OUT/c64x8 --out OUT/calibration
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics

#: how far the plan may be from the emulator and still agree
TOLERANCE = 0.15


def plan_arm_name(settings: dict) -> str | None:
    """The plan's arm for an emulated arm's settings (``dataclasses.asdict(TrainSettings)``);
    None for the one-GPU floor or an arm the plan has no row for."""
    if settings.get("world_size") == 1:
        return None
    backend = settings.get("backend", "qzero")
    z = settings["zero"]
    if backend == "fsdp2":
        return None if z.get("zero_quantized_weights") else "FSDP2"
    if backend == "deepspeed":
        return None if z.get("zero_quantized_weights") else "DeepSpeed ZeRO-2"
    weights = z.get("zero_quantized_weights")
    delta = z.get("zero_quantized_weights_delta")
    grads = z.get("zero_quantized_gradients")
    fmt = z.get("zero_quantized_gradients_format") or "int8"
    two_level = z.get("hierarchical_collectives") is not False
    intra = z.get("zero_quantized_gradients_intra_node", "none") not in (None, "none")
    if not weights:
        label = None if grads else "plain"
    elif delta:
        label = "INT4 delta + INT4 grads" if grads and fmt == "int4" else None
    else:
        label = "INT8 + INT8 grads" if grads and fmt == "int8" else (None if grads else "INT8")
    if label is None:
        return None
    if intra:
        return f"qzero {label} (two-level, INT8 inside)" if two_level else None
    return f"qzero {label}" + (" (two-level)" if two_level else "")


def _shapes(preset: str, config_path: str | None = None):
    """``(shapes, layers)`` of the model as ``qzero plan`` counts it."""
    import types

    from qzero.app.plan_command import _model

    shapes, layers, _, _ = _model(types.SimpleNamespace(preset=None if config_path else preset,
                                                        model_config=config_path, seq_len=4096))
    return shapes, layers


def matrices(dirs: list[str]) -> list[dict]:
    """Every emulated cluster matrix under ``dirs`` (``OUT/<cell>/<cluster>/matrix.json``)."""
    found = []
    for d in dirs:
        for root, _, files in os.walk(d):
            if "matrix.json" in files:
                m = json.load(open(os.path.join(root, "matrix.json")))
                if m.get("emulated_cluster"):
                    found.append(m)
    return found


def _median_ms(runs: list[dict]) -> float | None:
    ok = [r for r in runs if not r.get("failed")]
    ts = [t for r in ok for t in r["step_times"]]
    return 1e3 * statistics.median(ts) if ts else None


def rows_of(dirs: list[str], floor_ms: float | None = None) -> list[dict]:
    from qzero.plan import Cluster, default_arms, predict
    from qzero.plan.workload import workload_from_shapes

    found = matrices(dirs)
    if floor_ms is None:  # the one-GPU arm of any matrix given
        floors = [_median_ms(runs) for m in found for name, runs in m["runs"].items()
                  if next(a for a in m["arms"] if a["name"] == name)["settings"]["world_size"] == 1]
        floors = [f for f in floors if f is not None]
        if not floors:
            raise SystemExit("cluster_calibration: no one-GPU arm in the matrices given: pass --floor-ms")
        floor_ms = statistics.median(floors)
    arms = {a.name: a for a in default_arms()}
    shapes_of, rows = {}, []
    for m in found:
        c = m["emulated_cluster"]
        cluster = Cluster(**c)
        s0 = m["settings"]
        model = (s0["preset"], s0.get("model_config"))
        if model not in shapes_of:
            shapes_of[model] = _shapes(*model)
        shapes, layers = shapes_of[model]
        fsdp2_peak = None
        for a in m["arms"]:
            runs = [r for r in m["runs"].get(a["name"], []) if not r.get("failed")]
            if a["settings"].get("backend") == "fsdp2" and runs and runs[0].get("peak_allocated_bytes"):
                fsdp2_peak = max(r["peak_allocated_bytes"] for r in runs)
        for a in m["arms"]:
            s, runs = a["settings"], [r for r in m["runs"].get(a["name"], []) if not r.get("failed")]
            name = plan_arm_name(s)
            if name is None or not runs:
                continue
            z = s["zero"]
            w = workload_from_shapes(shapes, cluster.world, units=layers, flat_order=z.get("flat_order", "auto"),
                                     small_param_numel=z["small_param_numel"],
                                     allgather_bucket=int(z["allgather_bucket_size"]),
                                     reduce_bucket=int(z["reduce_bucket_size"]))
            p = predict(arms[name], w, cluster, floor_ms / 1e3)
            med = _median_ms(runs)
            walls = [1e3 * r["wall_seconds"] / r["wall_steps"] for r in runs if r.get("wall_seconds")]
            nic = statistics.median(sum(v.get("nic_sent", 0) for v in r["link_per_step"].values()) for r in runs)
            peak = max((r.get("peak_allocated_bytes") or 0) for r in runs) or None
            rows.append({
                "cluster": f"{cluster.nodes}x{cluster.gpus_per_node}", "nic": cluster.nic,
                "intra_gbps": cluster.intra_rate / 1e9, "inter_gbps": cluster.inter_rate / 1e9,
                "arm": a["name"], "plan_arm": name, "allgather_bucket": w.allgather_bucket,
                "reduce_bucket": w.reduce_bucket, "emulated_ms": med,
                "wall_ms": statistics.median(walls) if walls else None, "plan_ms": p.step_ms,
                "plan_over_emulated": p.step_ms / med if med else None,
                "within": bool(med and abs(p.step_ms / med - 1) <= TOLERANCE),
                "emulated_bits_per_param_per_node": 8 * nic / cluster.nodes / w.params,
                "plan_bits_per_param_per_node": p.bits_per_param_per_node,
                "floor_ms": floor_ms, "efficiency": floor_ms / med if med else None,
                "peak_gib": peak / 2**30 if peak else None,
                "peak_vs_fsdp2": peak / fsdp2_peak - 1 if peak and fsdp2_peak else None,
            })
    return rows


def markdown(rows: list[dict]) -> str:
    f = lambda v, fmt="{:.1f}": "—" if v is None else fmt.format(v)  # noqa: E731
    out = ["| cluster | fabric | arm (plan's name) | emulated ms | wall ms/step | plan ms | plan / emulated | "
           "within 15% | bits/param/node emulated / plan | efficiency | peak GiB (vs FSDP2) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fabric = f"{r['intra_gbps']:g} inside, {r['inter_gbps']:g} {r['nic']}"
        out.append(f"| {r['cluster']} | {fabric} | {r['plan_arm']} | {f(r['emulated_ms'])} | {f(r['wall_ms'])} | "
                   f"{f(r['plan_ms'])} | {f(r['plan_over_emulated'], '{:.3f}')} | {'yes' if r['within'] else 'no'} | "
                   f"{r['emulated_bits_per_param_per_node']:.2f} / {r['plan_bits_per_param_per_node']:.2f} | "
                   f"{f(r['efficiency'], '{:.1%}')} | {f(r['peak_gib'], '{:.2f}')} "
                   f"({f(r['peak_vs_fsdp2'] and 100 * r['peak_vs_fsdp2'], '{:+.1f}%')}) |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", help="emulated cluster matrices' output folders")
    ap.add_argument("--floor-ms", type=float, default=None,
                    help="the one-GPU step (default: the matrices' world_size=1 arm)")
    ap.add_argument("--out", default=None, help="write OUT.md and OUT.csv")
    args = ap.parse_args(argv)
    rows = rows_of(args.dirs, args.floor_ms)
    text = markdown(rows)
    print(text, end="")
    if args.out:
        with open(args.out + ".md", "w") as fh:
            fh.write(text)
        with open(args.out + ".csv", "w", newline="") as fh:
            wr = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else ["arm"])
            wr.writeheader()
            wr.writerows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
