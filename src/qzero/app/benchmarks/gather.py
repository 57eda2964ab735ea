"""Microbenchmark of the quantized weight gather and its kernels.

One GPU (``qzero bench gather``, or ``python -m qzero.app.benchmarks.gather``): for each format and flat size, the
pack (quantize) and unpack (dequantize) kernel times and bandwidth (bytes read +
written) against the device copy bandwidth measured in the same run, the eager
torch reference for comparison, and the world-size-1 gather end to end
(``quantized_all_gather``, pipelined and not, against ``all_gather``).

Several GPUs (``torchrun --nproc_per_node=2 -m qzero.app.benchmarks.gather``): the gather
itself, plain bf16 against each quantized format, arms interleaved round by round,
medians of CUDA-event times, plus the payload-only collective. Set the link regime
with NCCL's environment (``benchmarks/scripts/regimes.sh`` has the table) and name it with ``--regime``;
keep ``NCCL_NVLS_ENABLE=0``. ``benchmarks/scripts/run_regimes.sh`` runs it in every regime.

Results go to ``--out`` as JSON and Markdown; the Markdown table is printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

from qzero.app.qualify.env import link_regime
from qzero.wire.comm import all_gather, quantized_all_gather, run_gather
from qzero.wire.engine import CommContext
from qzero.layout.gather_planner import plan_gather
from qzero.quant import REFERENCE_KERNELS, get_format
from qzero.quant.triton import AVAILABLE, DEFAULT_KERNELS, DEFAULT_TUNING, KernelTuning, Launcher, TritonKernels
from qzero.vocabulary import DELTA_FORMATS, PRECISIONS

GiB = 1 << 30
MiB = 1 << 20


def parse_args(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(prog="qzero bench gather", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="2048Mi,256Mi", help="flat sizes in parameters, e.g. 2048Mi,256Mi")
    ap.add_argument("--formats", default="int8,fp8,int4")
    ap.add_argument("--zero-quantized-weights-group-size", dest="group_size", type=int, default=64,
                    help="ZeroConfig.zero_quantized_weights_group_size (default 64)")
    ap.add_argument("--allgather-bucket-size", dest="bucket", type=int, default=500_000_000,
                    help="ZeroConfig.allgather_bucket_size: elements one chunk gathers across all ranks")
    for old, new in (("--group-size", "--zero-quantized-weights-group-size"), ("--bucket", "--allgather-bucket-size")):
        ap.add_argument(old, nargs="?", help=argparse.SUPPRESS, action=_renamed(new))
    ap.add_argument("--dtype", default="bf16", choices=PRECISIONS)
    ap.add_argument("--regime", default=None, help="label of the link regime (default: from NCCL env)")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds (multi-GPU)")
    ap.add_argument("--tune", default="1024x4,2048x4,2048x8", help="block_elems x num_warps to sweep")
    ap.add_argument("--no-reference", action="store_true", help="skip the eager torch reference timings")
    ap.add_argument("--delta", action="store_true",
                    help="also time the delta-payload kernels (zero_quantized_weights_delta) of the int4/int8 formats: "
                         "pack from fp32 masters and the replica, and the all-ranks unpack of a DP2 chunk")
    ap.add_argument("--out", default="results")
    ap.add_argument("--tag", default=None, help="file name stem (default: derived from mode and date)")
    ap.add_argument("--render", default=None, metavar="JSON", help="only rewrite the Markdown of a saved result")
    return ap.parse_args(argv)


def _renamed(new: str) -> type:
    """The action of a flag of an earlier release: an error naming ``new``, the ZeroConfig field's flag."""

    class Renamed(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            parser.error(f"{option_string} is now {new} (the flag of a ZeroConfig setting is its field name)")

    return Renamed


def parse_size(text: str) -> int:
    text = text.strip()
    for suffix, mult in (("Gi", GiB), ("Mi", MiB), ("Ki", 1024)):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * mult)
    return int(text)


def size_label(n: int) -> str:
    return f"{n / GiB:g} Gi" if n >= GiB else f"{n / MiB:g} Mi"


# --------------------------------------------------------------------------- timing


def median_ms(fn, warmup: int = 3, reps: int = 20) -> float:
    """Median of CUDA-event times of ``fn`` (device time, launch included)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def reps_for(n: int) -> int:
    return 10 if n >= GiB else 30


def random_flat(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(n, device="cuda", generator=g, dtype=torch.float32) * 0.02).to(dtype)


def exact_ranges_for(n: int) -> list[tuple[int, int]]:
    """Roughly a transformer's small parameters: a 4 Ki-element norm every 2 Mi elements."""
    step, width = 2 * MiB, 4096
    return [(a, a + width) for a in range(step // 2, n - width, step)]


def versions() -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    return {
        "device": torch.cuda.get_device_name(0),
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M"),
    }


# --------------------------------------------------------------------------- one GPU


def copy_bandwidth(n: int, dtype: torch.dtype) -> dict:
    src = random_flat(n, dtype, 1)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), reps=reps_for(n))
    nbytes = 2 * src.numel() * src.element_size()
    return {"ms": ms, "bytes": nbytes, "GBps": nbytes / ms / 1e6}


def kernel_case(n: int, fmt: str, gs: int, dtype: torch.dtype, exact: bool, impl) -> dict:
    """Times of one pack and one unpack of a single-chunk payload of ``n`` elements."""
    ranges = exact_ranges_for(n) if exact else []
    plan = plan_gather(n, 1, elem_size=2, allgather_bucket_size=n, zero_quantized_weights_format=fmt,
                       zero_quantized_weights_group_size=gs, exact_ranges=ranges)
    chunk = plan.chunks[0]
    from qzero.wire.chunks import exact_index

    idx = exact_index(plan, chunk, 0, torch.device("cuda"))
    layout, runs = plan.payload_of(chunk, 0), plan.group_runs(chunk, 0)
    src = random_flat(n, dtype, 2)
    payload = torch.empty(chunk.payload_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    reps = 3 if impl is REFERENCE_KERNELS else reps_for(n)
    t_pack = median_ms(lambda: impl.pack_payload(src, payload, layout, gs, fmt, idx, runs), reps=reps, warmup=2)
    t_unpack = median_ms(lambda: impl.unpack_payload(payload, dst, layout, gs, fmt, idx, runs), reps=reps, warmup=2)
    f = get_format(fmt)
    coded = n if runs is None else runs.coded_numel()
    moved = f.value_bytes(coded) + 4 * -(-coded // gs) + len(idx if idx is not None else []) * 2
    elem = src.element_size()
    pack_bytes = n * elem + moved  # read the slice, write the payload
    unpack_bytes = moved + n * elem  # read the payload, write the slice
    return {
        "pack_ms": t_pack,
        "unpack_ms": t_unpack,
        "pack_GBps": pack_bytes / t_pack / 1e6,
        "unpack_GBps": unpack_bytes / t_unpack / 1e6,
        "payload_bytes": chunk.payload_bytes,
        "exact_elems": 0 if idx is None else idx.numel(),
    }


def delta_kernel_case(n: int, fmt: str, gs: int, dtype: torch.dtype, exact: bool, impl, world: int = 2) -> dict:
    """Times of one delta pack (this rank's ``n`` elements: its fp32 masters against its
    replica slice) and of the all-ranks delta unpack of a ``world``-rank chunk (every rank's
    payload added into the replica in place), as one chunk of a DP-``world`` gather."""
    from qzero.quant.reference import refusal_flag
    from qzero.wire.chunks import exact_index, exact_scatter

    ranges = exact_ranges_for(world * n) if exact else []
    plan = plan_gather(world * n, world, elem_size=2, allgather_bucket_size=world * n,
                       zero_quantized_weights_format=fmt, zero_quantized_weights_group_size=gs, exact_ranges=ranges,
                       zero_quantized_weights_delta=True)
    chunk, dev = plan.chunks[0], torch.device("cuda")
    idx = exact_index(plan, chunk, 0, dev)
    scatter = exact_scatter(plan, chunk, dev)
    layout, runs, all_runs = plan.payload_of(chunk, 0), plan.group_runs(chunk, 0), plan.group_runs(chunk)
    replica = random_flat(world * n, dtype, 5)
    target = replica[:n].float() + torch.randn(n, device="cuda") * 1e-4
    pb = chunk.payload_bytes
    buf = torch.empty(world * pb, dtype=torch.uint8, device="cuda")
    reps = 3 if impl is REFERENCE_KERNELS else reps_for(n)
    t_pack = median_ms(lambda: impl.pack_delta_payload(target, replica[:n], buf[:pb], layout, gs, fmt, idx, runs),
                       reps=reps, warmup=2)
    for r in range(1, world):  # every rank's payload: rank 0's (the unpack reads them all the same way)
        buf[r * pb : (r + 1) * pb].copy_(buf[:pb])
    refused = refusal_flag(dev)
    t_unpack = median_ms(lambda: impl.unpack_delta_payloads(buf, replica, n, 0, n, world, chunk.payload, gs, fmt,
                                                            scatter, refused, all_runs), reps=reps, warmup=2)
    f = get_format(fmt)
    coded = n if runs is None else runs.coded_numel()
    moved = f.value_bytes(coded) + 4 * -(-coded // gs) + (0 if idx is None else idx.numel()) * 2
    es = replica.element_size()
    pack_bytes = n * (4 + es) + moved  # read the masters and the replica, write the payload
    unpack_bytes = world * (moved + 2 * n * es)  # read every payload, read and write the replica
    return {
        "world": world,
        "pack_ms": t_pack,
        "unpack_ms": t_unpack,
        "pack_GBps": pack_bytes / t_pack / 1e6,
        "unpack_GBps": unpack_bytes / t_unpack / 1e6,
        "payload_bytes": pb,
        "exact_elems": 0 if idx is None else idx.numel(),
    }


def check_kernels(n: int, fmt: str, gs: int, dtype: torch.dtype) -> bool:
    """Kernel bytes and elements equal the reference's on fresh random input with exact ranges."""
    ranges = exact_ranges_for(n)
    plan = plan_gather(n, 1, elem_size=2, allgather_bucket_size=n, zero_quantized_weights_format=fmt,
                       zero_quantized_weights_group_size=gs, exact_ranges=ranges)
    chunk = plan.chunks[0]
    from qzero.wire.chunks import exact_index

    idx = exact_index(plan, chunk, 0, torch.device("cuda"))
    layout, runs = plan.payload_of(chunk, 0), plan.group_runs(chunk, 0)
    src = random_flat(n, dtype, 3) * torch.logspace(-3, 3, n, device="cuda").to(dtype)
    a = torch.randint(0, 256, (chunk.payload_bytes,), dtype=torch.uint8, device="cuda")
    b = a.clone()
    REFERENCE_KERNELS.pack_payload(src, a, layout, gs, fmt, idx, runs)
    DEFAULT_KERNELS.pack_payload(src, b, layout, gs, fmt, idx, runs)
    da, db = torch.full_like(src, 7.0), torch.full_like(src, -3.0)
    REFERENCE_KERNELS.unpack_payload(a, da, layout, gs, fmt, idx, runs)
    DEFAULT_KERNELS.unpack_payload(a, db, layout, gs, fmt, idx, runs)
    return bool(torch.equal(a, b) and torch.equal(da.view(torch.int16), db.view(torch.int16)))


def tune(n: int, fmt: str, gs: int, dtype: torch.dtype,
         shapes: list[tuple[int, int]]) -> tuple[list[dict], KernelTuning]:
    """Sweep launch shapes for payloads without and with exact elements: the rows, and the
    :class:`~qzero.quant.triton_launch.KernelTuning` with the fastest (pack + unpack) of each."""
    rows, best = [], DEFAULT_TUNING
    for exact in (False, True):
        for block, warps in shapes:
            fields = dict(exact_block_elems=block, exact_num_warps=warps) if exact else dict(block_elems=block,
                                                                                               num_warps=warps)
            r = kernel_case(n, fmt, gs, dtype, exact, tuned(dataclasses.replace(best, **fields)))
            rows.append({"exact": exact, "block_elems": block, "num_warps": warps, **r})
        top = min((r for r in rows if r["exact"] == exact), key=lambda r: r["pack_ms"] + r["unpack_ms"])
        best = dataclasses.replace(best, **(
            dict(exact_block_elems=top["block_elems"], exact_num_warps=top["num_warps"])
            if exact else dict(block_elems=top["block_elems"], num_warps=top["num_warps"])))
    return rows, best


def tuned(tuning: KernelTuning) -> TritonKernels:
    """A Triton kernel set of ``tuning`` (its own launch caches)."""
    return TritonKernels(Launcher(tuning))


def gather_plan(n: int, world: int, fmt: str | None, gs: int, bucket: int):
    """The static plan an optimizer keeps (bf16 elements; exact ranges only when quantized)."""
    if fmt is None:
        return plan_gather(n, world, elem_size=2, allgather_bucket_size=bucket, zero_quantized_weights_format=None)
    return plan_gather(n, world, elem_size=2, allgather_bucket_size=bucket, zero_quantized_weights_format=fmt,
                       zero_quantized_weights_group_size=gs, exact_ranges=exact_ranges_for(n))


def gather_case(n: int, fmt: str | None, gs: int, dtype: torch.dtype, bucket: int, pipelined: bool = True,
                kernels=DEFAULT_KERNELS) -> dict:
    """World-size-1 gather through ``run_gather`` with a prebuilt plan (the optimizer's path),
    and the public ``quantized_all_gather``/``all_gather`` (which validate arguments each call,
    with the default kernels)."""
    flat = random_flat(n, dtype, 4)
    plan = gather_plan(n, 1, fmt, gs, bucket)
    context = CommContext(flat.device, schedule="streams" if pipelined else "inline", kernels=kernels)
    if fmt is None:
        api = lambda: all_gather(flat, allgather_bucket_size=bucket)  # noqa: E731
    else:
        ranges = exact_ranges_for(n)
        api = lambda: quantized_all_gather(  # noqa: E731
            flat, zero_quantized_weights_group_size=gs, exact_ranges=ranges, allgather_bucket_size=bucket,
            zero_quantized_weights_format=fmt)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ms = median_ms(lambda: run_gather(flat, plan, context=context), reps=reps_for(n))
    extra = torch.cuda.max_memory_allocated() - base
    api_ms = median_ms(api, reps=reps_for(n))
    stats = run_gather(flat, plan, context=context)
    return {"ms": ms, "api_ms": api_ms, "chunks": stats.num_chunks, "bytes_per_rank": stats.bytes_sent,
            "peak_extra_bytes": extra}


def single_gpu(args) -> dict:
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    gs = args.group_size
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    formats = args.formats.split(",")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.tune.split(",") if s]
    out = {"mode": "single", "regime": "single GPU, no link", "group_size": gs, "dtype": args.dtype, **versions()}
    small = min(sizes)

    out["correct"] = {fmt: check_kernels(1 << 24, fmt, gs, dtype) for fmt in formats}
    print("kernels == reference:", out["correct"], flush=True)


    out["tuning"] = {}
    best = {}
    for fmt in formats:
        best[fmt] = DEFAULT_TUNING
        if shapes:
            out["tuning"][fmt], best[fmt] = tune(small, fmt, gs, dtype, shapes)
        print(f"tuning {fmt}: {best[fmt]}", flush=True)

    out["sizes"] = []
    for n in sizes:
        entry = {"numel": n, "copy": copy_bandwidth(n, dtype), "formats": {}}
        copy_bw = entry["copy"]["GBps"]
        print(f"[{size_label(n)}] copy {entry['copy']['ms']:.3f} ms, {copy_bw:.0f} GB/s", flush=True)
        entry["plain_gather"] = gather_case(n, None, gs, dtype, args.bucket)
        for fmt in formats:
            kernels = tuned(best[fmt])
            r = {"launch": dataclasses.asdict(best[fmt])}
            r["kernel"] = kernel_case(n, fmt, gs, dtype, False, kernels)
            r["kernel_exact"] = kernel_case(n, fmt, gs, dtype, True, kernels)
            if not args.no_reference:
                r["reference"] = kernel_case(n, fmt, gs, dtype, False, REFERENCE_KERNELS)
            if args.delta and fmt in DELTA_FORMATS:
                r["delta_kernel"] = delta_kernel_case(n, fmt, gs, dtype, False, kernels)
                r["delta_kernel_exact"] = delta_kernel_case(n, fmt, gs, dtype, True, kernels)
                for key in ("delta_kernel", "delta_kernel_exact"):
                    r[key]["pack_frac_copy"] = r[key]["pack_GBps"] / copy_bw
                    r[key]["unpack_frac_copy"] = r[key]["unpack_GBps"] / copy_bw
                d = r["delta_kernel"]
                print(f"[{size_label(n)}] {fmt} delta: pack {d['pack_ms']:.3f} ms ({d['pack_frac_copy']:.0%} of copy), "
                      f"unpack of {d['world']} ranks {d['unpack_ms']:.3f} ms ({d['unpack_frac_copy']:.0%})", flush=True)
            r["gather_pipelined"] = gather_case(n, fmt, gs, dtype, args.bucket, True, kernels)
            r["gather_serial"] = gather_case(n, fmt, gs, dtype, args.bucket, False, kernels)
            for key in ("kernel", "kernel_exact"):
                r[key]["pack_frac_copy"] = r[key]["pack_GBps"] / copy_bw
                r[key]["unpack_frac_copy"] = r[key]["unpack_GBps"] / copy_bw
            entry["formats"][fmt] = r
            k = r["kernel"]
            print(
                f"[{size_label(n)}] {fmt}: pack {k['pack_ms']:.3f} ms ({k['pack_frac_copy']:.0%} of copy), "
                f"unpack {k['unpack_ms']:.3f} ms ({k['unpack_frac_copy']:.0%}), "
                f"gather {r['gather_pipelined']['ms']:.2f} ms (serial {r['gather_serial']['ms']:.2f})",
                flush=True,
            )
        out["sizes"].append(entry)
    return out


def single_markdown(res: dict) -> str:
    lines = [
        f"# Gather kernels: {res['device']}, {res['regime']}",
        "",
        f"{res['date_utc']} UTC; torch {res['torch']}, Triton {res['triton']}, CUDA {res['cuda']}; "
        f"{res['dtype']} flat buffer, group size {res['group_size']}. Medians of CUDA-event times. "
        "Bandwidth counts bytes read + written; 'of copy' compares it with a device-to-device copy "
        "measured in the same run. 'exact' adds a 4 Ki-element exact range every 2 Mi elements. "
        "Gathers are world size 1 (no collective): quantize + dequantize through the chunk loop, "
        "run with a prebuilt plan as the optimizer does (`run_gather`); the public API also validates its "
        "arguments on every call.",
        "",
        f"Kernels equal to the torch reference (bytes and elements): {res['correct']}",
        "",
        "| size | format | pack ms | pack GB/s | of copy | unpack ms | unpack GB/s | of copy "
        "| pack/unpack ms, exact | eager reference pack/unpack ms | gather ms (pipelined / serial) | plain gather ms "
        "| gather ms via public API (quantized / plain) | gather peak extra GB (quantized / plain) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in res["sizes"]:
        for fmt, r in e["formats"].items():
            k, x = r["kernel"], r["kernel_exact"]
            ref = r.get("reference")
            ref_txt = f"{ref['pack_ms']:.2f} / {ref['unpack_ms']:.2f}" if ref else "-"
            lines.append(
                f"| {size_label(e['numel'])} | {fmt} | {k['pack_ms']:.3f} | {k['pack_GBps']:.0f} | "
                f"{k['pack_frac_copy']:.0%} | {k['unpack_ms']:.3f} | {k['unpack_GBps']:.0f} | "
                f"{k['unpack_frac_copy']:.0%} | "
                f"{x['pack_ms']:.3f} / {x['unpack_ms']:.3f} | {ref_txt} | "
                f"{r['gather_pipelined']['ms']:.2f} / {r['gather_serial']['ms']:.2f} | {e['plain_gather']['ms']:.2f} | "
                f"{r['gather_pipelined'].get('api_ms', float('nan')):.2f} / "
                f"{e['plain_gather'].get('api_ms', float('nan')):.2f} | "
                f"{r['gather_pipelined']['peak_extra_bytes'] / 1e9:.2f} / "
                f"{e['plain_gather']['peak_extra_bytes'] / 1e9:.2f} |"
            )
    delta_rows = [(e, fmt, r) for e in res["sizes"] for fmt, r in e["formats"].items() if "delta_kernel" in r]
    if delta_rows:
        lines += [
            "",
            "Delta payloads (`zero_quantized_weights_delta`): the pack reads this rank's fp32 masters and its replica "
            "slice (bf16/fp16) and writes the payload; the unpack reads every rank's payload of a DP2 chunk and adds "
            "it into the replica in place (reads and writes it). 'size' is one rank's slice.",
            "",
            "| size | format | pack ms | pack GB/s | of copy | unpack ms | unpack GB/s | of copy "
            "| pack/unpack ms, exact |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for e, fmt, r in delta_rows:
            k, x = r["delta_kernel"], r["delta_kernel_exact"]
            lines.append(
                f"| {size_label(e['numel'])} | {fmt} | {k['pack_ms']:.3f} | {k['pack_GBps']:.0f} | "
                f"{k['pack_frac_copy']:.0%} | {k['unpack_ms']:.3f} | {k['unpack_GBps']:.0f} | "
                f"{k['unpack_frac_copy']:.0%} | {x['pack_ms']:.3f} / {x['unpack_ms']:.3f} |"
            )
    if res.get("tuning"):
        lines += [
            "",
            f"Launch-shape sweep at {size_label(min(e['numel'] for e in res['sizes']))}:",
            "",
            "| format | exact ranges | block | warps | pack ms | pack GB/s | unpack ms | unpack GB/s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for fmt, rows in res["tuning"].items():
            for r in rows:
                lines.append(
                    f"| {fmt} | {'yes' if r.get('exact') else 'no'} | {r['block_elems']} | "
                    f"{r['num_warps']} | {r['pack_ms']:.3f} | "
                    f"{r['pack_GBps']:.0f} | {r['unpack_ms']:.3f} | {r['unpack_GBps']:.0f} |"
                )
    lines.append("")
    lines.append("Device copy: " + ", ".join(
        f"{size_label(e['numel'])}: {e['copy']['ms']:.3f} ms, {e['copy']['GBps']:.0f} GB/s" for e in res["sizes"]
    ))
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- several GPUs


def regime_label(args) -> str:
    return args.regime or link_regime("cuda")


def timed(fn) -> float:
    dist.barrier()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    t = torch.tensor([start.elapsed_time(stop)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a gather is done when the slowest rank is
    return t.item()


def multi_header(world: int, regime: str, group_size: int, dtype: str, bucket: int, env: dict,
                 tuning: KernelTuning = DEFAULT_TUNING) -> dict:
    """A multi-GPU result before its sizes: the run's settings, the kernels' ``tuning`` and
    ``env`` (:func:`versions`)."""
    return {
        "mode": "multi",
        "world_size": world,
        "regime": regime,
        "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
        "group_size": group_size,
        "dtype": dtype,
        "allgather_bucket_size": bucket,
        "launch": dataclasses.asdict(tuning),
        **env,
        "sizes": [],
    }


def size_entry(numel: int, element_size: int, times: dict[str, list[float]]) -> dict:
    """One flat size of a multi-GPU result: each arm's times (ms, one per round), median,
    algorithm bandwidth (the flat buffer's bytes per second) and speed-ups against the
    ``bf16`` arm and, where measured, the ``bf16 one NCCL call`` arm."""
    med = {name: statistics.median(t) for name, t in times.items()}
    total_bytes = numel * element_size
    arms = {}
    for name, ms in med.items():
        arms[name] = {"median_ms": ms, "times_ms": list(times[name]), "algbw_GBps": total_bytes / ms / 1e6,
                      "speedup_vs_bf16": med["bf16"] / ms}
        if "bf16 one NCCL call" in med:
            arms[name]["speedup_vs_one_call"] = med["bf16 one NCCL call"] / ms
    return {"numel": numel, "arms": arms}


def multi_gpu(args) -> dict:
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    formats = args.formats.split(",")
    out = multi_header(dist.get_world_size(), regime_label(args), args.group_size, args.dtype, args.bucket,
                       versions())
    for n in (parse_size(s) for s in args.sizes.split(",")):
        out["sizes"].append(multi_gpu_size(args, n, dtype, formats))
    return out


def multi_gpu_size(args, n: int, dtype: torch.dtype, formats: list) -> dict:
    """One size of :func:`multi_gpu`: every arm interleaved over ``args.rounds`` rounds (its
    buffers are freed on return, before the next size allocates)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    gs = args.group_size
    flat = random_flat(n, dtype, 5 + rank)
    ranges = exact_ranges_for(n)
    plain = gather_plan(n, world, None, gs, args.bucket)
    p = n // world
    own = flat[rank * p : (rank + 1) * p]
    # the yardstick: one NCCL call over the whole buffer (no bucket bound), then ours
    arms = {"bf16 one NCCL call": lambda: dist.all_gather_into_tensor(flat, own),
            "bf16": lambda plain=plain: run_gather(flat, plain),
            "bf16 via all_gather": lambda: all_gather(flat, allgather_bucket_size=args.bucket)}
    for fmt in formats:
        plan = gather_plan(n, world, fmt, gs, args.bucket)
        arms[fmt] = lambda plan=plan: run_gather(flat, plan)
        pay = torch.empty(plan.bytes_per_rank, dtype=torch.uint8, device="cuda")
        recv = torch.empty(world * pay.numel(), dtype=torch.uint8, device="cuda")
        arms[f"{fmt} payload only"] = lambda pay=pay, recv=recv: dist.all_gather_into_tensor(recv, pay)
    fmt0 = formats[0]
    arms[f"{fmt0} via quantized_all_gather"] = lambda: quantized_all_gather(
        flat, zero_quantized_weights_group_size=gs, exact_ranges=ranges, allgather_bucket_size=args.bucket,
        zero_quantized_weights_format=fmt0,
    )
    for fn in arms.values():  # warm-up: compile, plans, NCCL channels
        fn()
        fn()
    times = {name: [] for name in arms}
    for _ in range(args.rounds):
        for name, fn in arms.items():
            times[name].append(timed(fn))
    entry = size_entry(n, flat.element_size(), times)
    if rank == 0:
        print(f"[{size_label(n)}] " + ", ".join(f"{k} {a['median_ms']:.2f} ms" for k, a in entry["arms"].items()),
              flush=True)
    return entry


def _bucket_of(res: dict) -> int:
    """A result's ``allgather_bucket_size`` (results written before it had that name: ``bucket_numel``)."""
    return res["allgather_bucket_size"] if "allgather_bucket_size" in res else res["bucket_numel"]


def multi_markdown(res: dict) -> str:
    lines = [
        f"# Gather, {res['world_size']} x {res['device']}: {res['regime']}",
        "",
        f"{res['date_utc']} UTC; torch {res['torch']}, Triton {res['triton']}, CUDA {res['cuda']}; "
        f"{res['dtype']} flat, group size {res['group_size']}, bucket {_bucket_of(res):,} elements; "
        "arms interleaved round by round, median over rounds of the slowest rank's CUDA-event time. "
        "Gathers run with prebuilt plans as the optimizer does (`run_gather`); 'payload only' is the bare "
        "all-gather of the same bytes; 'via quantized_all_gather' adds the public API's per-call checks. "
        "Algorithm bandwidth = bf16 bytes of the whole flat buffer / time.",
        "",
    ]
    one_call = any("speedup_vs_one_call" in a for e in res["sizes"] for a in e["arms"].values())
    lines += [
        "| size | arm | median ms | algbw GB/s | speedup vs bf16 |" + (" vs one NCCL call |" if one_call else ""),
        "|---|---|---|---|---|" + ("---|" if one_call else ""),
    ]
    for e in res["sizes"]:
        for name, a in e["arms"].items():
            lines.append(
                f"| {size_label(e['numel'])} | {name} | {a['median_ms']:.2f} | {a['algbw_GBps']:.0f} | "
                f"{a['speedup_vs_bf16']:.2f}x |" + (f" {a['speedup_vs_one_call']:.2f}x |" if one_call else "")
            )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        with open(args.render) as fh:
            res = json.load(fh)
        md = multi_markdown(res) if res["mode"] == "multi" else single_markdown(res)
        with open(os.path.splitext(args.render)[0] + ".md", "w") as fh:
            fh.write(md)
        print(md)
        return 0
    if not torch.cuda.is_available() or not AVAILABLE:
        print("needs a CUDA device and Triton", file=sys.stderr)
        return 2
    world = int(os.environ.get("WORLD_SIZE", "1"))
    t0 = time.time()
    if world > 1:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        res = multi_gpu(args)
        md = multi_markdown(res)
        is_writer = dist.get_rank() == 0
    else:
        res = single_gpu(args)
        md = single_markdown(res)
        is_writer = True
    res["wall_s"] = time.time() - t0
    if is_writer:
        os.makedirs(args.out, exist_ok=True)
        stem = args.tag or f"gather_{res['mode']}_{res['date_utc'][:10]}"
        with open(os.path.join(args.out, stem + ".json"), "w") as fh:
            json.dump(res, fh, indent=1)
        with open(os.path.join(args.out, stem + ".md"), "w") as fh:
            fh.write(md)
        print(md)
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
