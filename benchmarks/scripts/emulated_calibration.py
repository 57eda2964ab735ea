"""The emulated link (``benchmarks/scripts/emulated_link.py``) against the committed two-GPU results.

[Note: calibration]
* **exposed communication** of an arm: its median step minus the 1-GPU step (``world_size=1``,
  no communication at all) on the same host. The two-GPU host of the committed results has a
  1-GPU step only for Qwen3-4B (``step_time/dp2_pcie_4b_bucket50m/``, arm ``gpu1``); for
  another model the real 1-GPU step is taken as the emulation host's times the **time
  scale**.
* **time scale** ``S``: the real 1-GPU step over the emulation host's (both Qwen3-4B at the
  seed's 26M/50M buckets). The hosts differ in compute speed; a transfer of the emulated link
  takes ``1/S`` of its modelled time (``LinkModel.time_scale``), so that the link's time
  against this host's compute is what it was against the real host's, and an emulated
  exposure times ``S`` compares with a real one.
* **tolerance**: a row matches when ``|emulated - real| <= max(10 ms, 10% of real)``.
* **contention fit**: ``ctas`` (resident CTAs while a transfer is on the link) is chosen among
  the values measured (``fit``) to minimise the sum over the fit arms of the squared error
  in units of the tolerance.

    python3 benchmarks/scripts/emulated_calibration.py scale FLOOR_DIR            # prints S
    python3 benchmarks/scripts/emulated_calibration.py fit GRID_DIR --scale S     # prints the fitted ctas
    python3 benchmarks/scripts/emulated_calibration.py table DIR... --scale S --ctas K --out OUT
    python3 benchmarks/scripts/emulated_calibration.py contention --out OUT       # one GPU: what a resident CTA costs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
RESULTS = os.path.join(HERE, "results", "step_time")


@dataclass(frozen=True)
class RealSet:
    """One committed two-GPU matrix: where, what, and which of its arms are today's code
    (``arms``: its arm name -> the emulated arm's name)."""

    folder: str
    file: str
    preset: str
    ag: float
    rs: float
    regime: str
    arms: dict
    note: str = ""


_SAME = lambda *names: {n: n for n in names}  # noqa: E731

#: The committed matrices whose arms are today's code (the solo-reduce and earlier-default
#: runs only through their arms with today's defaults).
REAL = (
    RealSet("dp2_pcie_4b_bucket50m", "matrix.json", "qwen3-4b", 5e7, 2.6e7, "pcie",
            _SAME("gpu1", "plain", "int8", "int8_ahead", "plain_ahead", "fsdp2", "deepspeed"),
            "2 rounds; before the launch work and the landing shard"),
    RealSet("dp2_pcie_4b_bucket50m_qzero_fsdp2_deepspeed", "matrix.json", "qwen3-4b", 5e7, 2.6e7, "pcie",
            _SAME("int8_ahead", "fsdp2", "deepspeed", "ds_int8_ahead"), "1 round"),
    RealSet("dp2_pcie_4b_deepspeed_adapter_ahead", "matrix.json", "qwen3-4b", 5e7, 2.6e7, "pcie",
            _SAME("deepspeed", "ds_int8_ahead"), "1 round, before the launch work"),
    RealSet("dp2_pcie_4b_fsdp2_reshard", "matrix.json", "qwen3-4b", 5e7, 2.6e7, "pcie",
            _SAME("fsdp2_rs", "fsdp2_rs_int8"), "1 round, before the launch work"),
    RealSet("dp2_ethernet_grads_4b", "matrix.json", "qwen3-4b", 5e7, 5e7, "ethernet",
            _SAME("fsdp2", "int8_ahead_qgrad"), "1 round"),
    RealSet("dp2_pcie", "matrix.json", "qwen3-1.7b", 5e8, 5e7, "pcie",
            _SAME("plain", "int8_ahead", "deepspeed", "fsdp2"), "2 rounds"),
    RealSet("dp2_ethernet", "matrix.json", "qwen3-1.7b", 5e8, 5e7, "ethernet",
            _SAME("plain", "int8", "int8_ahead", "fsdp2"), "2 rounds (plain 1 run)"),
    RealSet("dp2_ethernet_solo_reduce_ab", "matrix.json", "qwen3-1.7b", 5e8, 5e7, "ethernet",
            {"plain_nosolo": "plain", "int8_ahead_nosolo": "int8_ahead"}, "2 rounds"),
    RealSet("dp2_nvlink", "matrix.json", "qwen3-1.7b", 5e8, 5e7, "nvlink",
            _SAME("plain", "int8_ahead"), "2 rounds (plain 1 run)"),
    RealSet("dp2_nvlink_1.7b_bucket50m", "matrix.json", "qwen3-1.7b", 5e7, 5e7, "nvlink",
            _SAME("plain", "int8", "int8_ahead"), "1 round"),
    RealSet("dp2_ethernet_1.7b_bucket50m_grads_fsdp2", "matrix.json", "qwen3-1.7b", 5e7, 5e7, "ethernet",
            _SAME("fsdp2", "plain", "int8_ahead", "int8_ahead_qgrad", "fsdp2_rs", "fsdp2_rs_int8"), "1 round"),
    RealSet("dp2_ethernet_1.7b_fsdp2_reshard", "matrix.json", "qwen3-1.7b", 5e7, 5e7, "ethernet",
            _SAME("fsdp2_rs", "fsdp2_rs_int8"), "1 round"),
    RealSet("dp2_ethernet_grads_1.7b", "matrix_fsdp2_then_qzero.json", "qwen3-1.7b", 5e7, 5e7, "ethernet",
            _SAME("fsdp2", "int8_ahead_qgrad"), "1 round"),
    RealSet("dp2_ethernet_grads_1.7b", "matrix_qzero_then_fsdp2.json", "qwen3-1.7b", 5e7, 5e7, "ethernet",
            _SAME("fsdp2", "int8_ahead_qgrad"), "1 round, qzero first"),
    RealSet("dp2_pcie_1.7b_fsdp2_fused_fp32_pack", "matrix.json", "qwen3-1.7b", 5e7, 5e7, "pcie",
            _SAME("fsdp2", "fsdp2_int8", "fsdp2_rs", "fsdp2_rs_int8"), "1 round, before the launch work"),
    RealSet("dp2_pcie_grads_1.7b", "matrix.json", "qwen3-1.7b", 5e7, 5e7, "pcie",
            _SAME("int8_ahead", "int8_ahead_qgrad"), "1 round"),
)

#: The emulated arms the real ones correspond to, in ``qzero bench steps`` (``qzero.app.benchmarks.steps``)'s arm syntax
#: (today's defaults: ``quantized=true`` alone is gather-ahead, hence ``overlap=false`` for ``int8``).
ARMS = {
    "gpu1": "world_size=1",
    "plain": "",
    "int8": "quantized=true,overlap=false",
    "int8_ahead": "quantized=true,overlap=true",
    # gather-ahead enqueuing 4 chunks past the one a forward waits for (the default enqueues all in step())
    "int8_ahead_lazy": "quantized=true,overlap=true,gather_lookahead=4",
    "plain_ahead": "overlap=true",
    "int8_ahead_qgrad": "quantized=true,overlap=true,zero_quantized_gradients=true",
    "fsdp2": "backend=fsdp2",
    "fsdp2_int8": "backend=fsdp2,quantized=true",
    "fsdp2_rs": "backend=fsdp2,reshard_after_forward=true",
    "fsdp2_rs_int8": "backend=fsdp2,reshard_after_forward=true,quantized=true",
    "fsdp2_rs_gint8": "backend=fsdp2,reshard_after_forward=true,quantized=true,fsdp_quantize=group",
    # the same with each fully_shard module's gradient reduce-scatter quantized (quantize_group_reduces)
    "fsdp2_rs_gint8_qgrad": "backend=fsdp2,reshard_after_forward=true,quantized=true,fsdp_quantize=group,"
                            "zero_quantized_gradients=true",
    "deepspeed": "backend=deepspeed",
    "ds_int8_ahead": "backend=deepspeed,quantized=true,overlap=true",
    # the same with DeepSpeed's ZeRO-2 gradient reduction replaced by the quantized exchange
    "ds_int8_ahead_qgrad": "backend=deepspeed,quantized=true,overlap=true,zero_quantized_gradients=true",
    # the same two enqueuing 4 chunks past the one a forward waits for: the optimizer step (which DeepSpeed
    # ends after a host synchronization) enqueues 4, the forward's hooks the rest
    "ds_int8_ahead_lazy": "backend=deepspeed,quantized=true,overlap=true,gather_lookahead=4",
    "ds_int8_ahead_qgrad_lazy": "backend=deepspeed,quantized=true,overlap=true,zero_quantized_gradients=true,"
                                "gather_lookahead=4",
    # the 4-bit payloads (no real two-GPU result yet: emulated only). The delta arms name their group:
    # groups of 256 in these (what their recorded results ran; the default is 64 since), 64 in delta64_*
    "delta_ahead": "quantized=true,overlap=true,zero_quantized_weights_delta=true,"
                   "zero_quantized_weights_group_size=256",
    "delta_ahead_qgrad": "quantized=true,overlap=true,zero_quantized_weights_delta=true,"
                         "zero_quantized_weights_group_size=256,zero_quantized_gradients=true",
    "delta64_ahead": "quantized=true,overlap=true,zero_quantized_weights_delta=true,"
                     "zero_quantized_weights_group_size=64",
    "delta64_ahead_qgrad": "quantized=true,overlap=true,zero_quantized_weights_delta=true,"
                           "zero_quantized_weights_group_size=64,zero_quantized_gradients=true",
    "delta64_ahead_qgrad4_g256": "quantized=true,overlap=true,zero_quantized_weights_delta=true,"
                                 "zero_quantized_weights_group_size=64,zero_quantized_gradients=true,"
                                 "zero_quantized_gradients_format=int4,zero_quantized_gradients_group_size=256",
    # INT4 gradients name their group size: groups of 64 here (the default is 256 since these arms were first run)
    "int8_ahead_qgrad4": "quantized=true,overlap=true,zero_quantized_gradients=true,"
                         "zero_quantized_gradients_format=int4,zero_quantized_gradients_group_size=64",
    "delta_ahead_qgrad4": "quantized=true,overlap=true,zero_quantized_weights_delta=true,"
                          "zero_quantized_weights_group_size=256,zero_quantized_gradients=true,"
                          "zero_quantized_gradients_format=int4,zero_quantized_gradients_group_size=64",
    # INT4 gradients in larger groups: fewer scale bits (4 + 32/G bits an element)
    "int8_ahead_qgrad4_g128": "quantized=true,overlap=true,zero_quantized_gradients=true,"
                              "zero_quantized_gradients_format=int4,zero_quantized_gradients_group_size=128",
    "int8_ahead_qgrad4_g256": "quantized=true,overlap=true,zero_quantized_gradients=true,"
                              "zero_quantized_gradients_format=int4,zero_quantized_gradients_group_size=256",
    "delta_ahead_qgrad4_g256": "quantized=true,overlap=true,zero_quantized_weights_delta=true,"
                               "zero_quantized_weights_group_size=256,zero_quantized_gradients=true,"
                               "zero_quantized_gradients_format=int4,zero_quantized_gradients_group_size=256",
    # more gradient buckets left in flight before the backward waits for the oldest (default 2)
    "int8_ahead_if4": "quantized=true,overlap=true,reduce_buckets_in_flight=4",
    "int8_ahead_if8": "quantized=true,overlap=true,reduce_buckets_in_flight=8",
    "int8_ahead_qgrad_if8": "quantized=true,overlap=true,zero_quantized_gradients=true,reduce_buckets_in_flight=8",
    "int8_ahead_qgrad4_if8": "quantized=true,overlap=true,zero_quantized_gradients=true,"
                             "zero_quantized_gradients_format=int4,zero_quantized_gradients_group_size=64,"
                             "reduce_buckets_in_flight=8",
    "int8_ahead_qgrad4_g256_if8": "quantized=true,overlap=true,zero_quantized_gradients=true,"
                                  "zero_quantized_gradients_format=int4,zero_quantized_gradients_group_size=256,"
                                  "reduce_buckets_in_flight=8",
}
#: Arms the contention is fitted on (the seed's 4B PCIe-class matrix, both timing kinds).
FIT_ARMS = ("plain", "int8", "int8_ahead", "plain_ahead", "fsdp2")
REAL_FLOOR = ("dp2_pcie_4b_bucket50m", "gpu1")


def arm_spec(name: str) -> str:
    return f"{name}:{ARMS[name]}"


def tolerance(real_ms: float) -> float:
    return max(10.0, 0.1 * abs(real_ms))


def real_rows(root: str = RESULTS) -> list[dict]:
    """Every arm of :data:`REAL` that is today's code: its median and wall step."""
    rows = []
    for rs in REAL:
        m = json.load(open(os.path.join(root, rs.folder, rs.file)))
        by = {a["arm"]: a for a in m["analysis"]["arms"]}
        for real_name, arm in rs.arms.items():
            a = by.get(real_name)
            if not a or a.get("median_step_s") is None:
                continue
            rows.append({"folder": rs.folder + ("" if rs.file == "matrix.json" else "/" + rs.file), "preset": rs.preset,
                         "ag": rs.ag, "rs": rs.rs, "regime": rs.regime, "arm": arm, "real_arm": real_name,
                         "real_ms": 1e3 * a["median_step_s"],
                         "real_wall_ms": 1e3 * a["wall_step_s"] if a.get("wall_step_s") else None,
                         "runs": a.get("runs_ok"), "note": rs.note})
    return rows


def regime_of(link: str) -> tuple[str, dict]:
    """``pcie:ctas=8,time_scale=1.2`` -> ``("pcie", {"ctas": 8.0, "time_scale": 1.2})``."""
    name, _, rest = link.partition(":")
    params = {}
    for pair in filter(None, rest.split(",")):
        k, _, v = pair.partition("=")
        params[k.strip()] = float(v)
    return name, params


def emulated_rows(dirs: list[str]) -> list[dict]:
    rows = []
    for d in dirs:
        path = os.path.join(d, "summary.json")
        if os.path.isfile(path):
            for r in json.load(open(path))["rows"]:
                regime, params = regime_of(r["link"])
                rows.append({**r, "regime": regime, "ctas": int(params.get("ctas", 0)),
                             "time_scale": params.get("time_scale", 1.0), "source": d})
    return rows


def _find(emu: list[dict], preset, ag, rs, regime, arm, ctas=None):
    """The emulated measurement of one arm: the median of its runs' medians over every folder
    given (runs on several machines pool here), or None."""
    hits = [e for e in emu if e["preset"] == preset and e["allgather_bucket"] == ag and e["reduce_bucket"] == rs
            and e["arm"] == arm and e["regime"] == regime and e["runs"] and e["median_ms"] is not None
            and e.get("finite") is not False and (ctas is None or e["ctas"] == ctas)]
    if not hits:
        return None
    pooled = dict(hits[-1], median_ms=statistics.median(e["median_ms"] for e in hits), pooled=len(hits),
                  medians=[round(e["median_ms"], 1) for e in hits])
    return pooled


def emulated_floor(emu: list[dict], preset: str) -> float | None:
    """This host's 1-GPU step for ``preset`` (any buckets: a world of one gathers nothing)."""
    hits = [e["median_ms"] for e in emu if e["preset"] == preset and e["arm"] == "gpu1" and e["runs"]
            and e["median_ms"] is not None and e.get("finite") is not False]
    return statistics.median(hits) if hits else None


def time_scale(emu: list[dict], real: list[dict]) -> float:
    """S = the real 1-GPU step / this host's, for Qwen3-4B."""
    folder, arm = REAL_FLOOR
    r = next(x for x in real if x["folder"] == folder and x["arm"] == arm)
    e = emulated_floor(emu, r["preset"])
    if e is None:
        raise SystemExit("no emulated 1-GPU step (arm gpu1) of qwen3-4b to scale by")
    return r["real_ms"] / e


def table(emu: list[dict], real: list[dict], scale: float, ctas: int | None) -> list[dict]:
    """Emulated against real exposed communication, per real row (pure: testable)."""
    floor_real = {x["preset"]: x["real_ms"] for x in real if (x["folder"], x["arm"]) == REAL_FLOOR}
    out = []
    for r in real:
        if r["arm"] == "gpu1":
            continue
        e_floor = emulated_floor(emu, r["preset"])
        f_real = floor_real.get(r["preset"], e_floor * scale if e_floor is not None else None)
        e = _find(emu, r["preset"], r["ag"], r["rs"], r["regime"], r["arm"], ctas)
        row = {**r, "real_floor_ms": f_real, "real_floor_from": "measured" if r["preset"] in floor_real else
               "emulated x S", "real_exposed_ms": r["real_ms"] - f_real if f_real is not None else None,
               "emulated_ms": e["median_ms"] if e else None, "emulated_runs": e["medians"] if e else None,
               "emulated_floor_ms": e_floor,
               "emulated_exposed_ms": (e["median_ms"] - e_floor) * scale if e and e_floor is not None else None,
               "link": e["link"] if e else None, "link_busy_ms_modelled": e["link_busy_ms_modelled"] if e else None,
               "link_busy_ms_measured": e["link_busy_ms_measured"] if e else None}
        if row["real_exposed_ms"] is not None and row["emulated_exposed_ms"] is not None:
            d = row["emulated_exposed_ms"] - row["real_exposed_ms"]
            row["diff_ms"], row["within"] = d, abs(d) <= tolerance(row["real_exposed_ms"])
        else:
            row["diff_ms"], row["within"] = None, None
        out.append(row)
    return out


def fit(emu: list[dict], real: list[dict], scale: float, arms=FIT_ARMS) -> dict:
    """The measured ``ctas`` that best matches the fit arms' real exposures (4B, PCIe-class,
    26M/50M): per candidate, the sum of squared errors in units of the tolerance."""
    candidates = sorted({e["ctas"] for e in emu if e["regime"] == "pcie" and e["preset"] == "qwen3-4b"})
    scores = {}
    for k in candidates:
        rows = [r for r in table(emu, real, scale, k) if r["folder"] == REAL_FLOOR[0] and r["arm"] in arms
                and r["diff_ms"] is not None]
        if len(rows) >= 2:
            scores[k] = {"score": sum((r["diff_ms"] / tolerance(r["real_exposed_ms"])) ** 2 for r in rows),
                         "diffs": {r["arm"]: round(r["diff_ms"], 1) for r in rows}}
    if not scores:
        raise SystemExit("no complete ctas candidate among the emulated runs")
    best = min(scores, key=lambda k: scores[k]["score"])
    return {"ctas": best, "scores": scores, "arms": list(arms), "time_scale": scale}


def markdown(rows: list[dict], scale: float, ctas) -> str:
    f = lambda v: "—" if v is None else f"{v:.1f}"  # noqa: E731
    lines = [f"Exposed communication = median step − the 1-GPU step; emulated exposure × S (S = {scale:.4f}); "
             f"resident CTAs {ctas}; within = |emulated − real| ≤ max(10 ms, 10%).", "",
             "| real result (`step_time/`) | model | buckets ag/rs | link | arm | real step | real 1-GPU step | "
             "real exposed | emulated step | emulated exposed × S | diff | within |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fl = f(r["real_floor_ms"]) + ("" if r["real_floor_from"] == "measured" else " (est.)")
        w = "—" if r["within"] is None else ("yes" if r["within"] else "**no**")
        lines.append(f"| {r['folder']} | {r['preset']} | {r['ag']:g}/{r['rs']:g} | {r['regime']} | {r['arm']} | "
                     f"{f(r['real_ms'])} | {fl} | {f(r['real_exposed_ms'])} | {f(r['emulated_ms'])} | "
                     f"{f(r['emulated_exposed_ms'])} | {f(r['diff_ms'])} | {w} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- what a resident CTA costs


def contention(out: str | None, reps: int = 20) -> list[dict]:
    """On one GPU: a bf16 matrix product and a large copy, alone and beside a long hold of
    ``ctas`` resident CTAs (16 warps each; 0 = one one-warp CTA), with and without paced HBM
    traffic. Median of ``reps`` timed repeats, ms."""
    import torch

    from emulated_link import LinkModel, Wire
    import link_kernels

    dev = torch.device("cuda", 0)
    link = link_kernels.DeviceLink(dev)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    x = torch.randn(1 << 28, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    work = {"matmul 8192^3 bf16": lambda: torch.mm(a, b), "copy 512 MiB": lambda: y.copy_(x)}

    def timed(fn):
        ts = []
        for _ in range(reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1))
        return statistics.median(ts)

    for fn in work.values():
        timed(fn)
    rows = []
    for ctas, traffic in ((None, 0.0), (0, 0.0), (2, 0.0), (4, 0.0), (8, 0.0), (16, 0.0), (32, 0.0), (8, 2.0)):
        row = {"ctas": ctas, "traffic": traffic}
        for name, fn in work.items():
            if ctas is not None:
                model = LinkModel("probe", 25e9, 0.0, ctas=ctas, traffic=traffic)
                wire = int(25e9 * 0.25)  # a quarter-second hold at 25 GB/s
                with torch.cuda.stream(link.stream):
                    link.hold(0, 0.25, 0, model, Wire(wire, wire, 1))
                torch.cuda._sleep(1_000_000)  # let the hold's CTAs start first
            row[name] = timed(fn)
            torch.cuda.synchronize()
        rows.append(row)
    base = rows[0]
    for r in rows:
        for name in work:
            r[name + " slowdown"] = r[name] / base[name] - 1
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
    for r in rows:
        print(f"ctas {str(r['ctas']):>4} traffic {r['traffic']:.0f}: " + ", ".join(
            f"{n} {r[n]:.3f} ms ({100 * r[n + ' slowdown']:+.1f}%)" for n in work), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("scale")
    s.add_argument("dirs", nargs="+")
    f = sub.add_parser("fit")
    f.add_argument("dirs", nargs="+")
    f.add_argument("--scale", type=float, required=True)
    f.add_argument("--out")
    t = sub.add_parser("table")
    t.add_argument("dirs", nargs="+")
    t.add_argument("--scale", type=float, required=True)
    t.add_argument("--ctas", type=int, default=None)
    t.add_argument("--out")
    c = sub.add_parser("contention")
    c.add_argument("--out")
    a = ap.parse_args(argv)
    if a.cmd == "contention":
        contention(a.out)
        return 0
    emu, real = emulated_rows(a.dirs), real_rows()
    if a.cmd == "scale":
        print(f"{time_scale(emu, real):.4f}")
        return 0
    if a.cmd == "fit":
        res = fit(emu, real, a.scale)
        if a.out:
            with open(a.out, "w") as fh:
                json.dump(res, fh, indent=1)
        print(json.dumps(res["scores"]), file=sys.stderr)
        print(res["ctas"])
        return 0
    rows = table(emu, real, a.scale, a.ctas)
    text = markdown(rows, a.scale, a.ctas)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "calibration.json"), "w") as fh:
            json.dump({"time_scale": a.scale, "ctas": a.ctas, "rows": rows}, fh, indent=1)
        with open(os.path.join(a.out, "calibration.md"), "w") as fh:
            fh.write(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
