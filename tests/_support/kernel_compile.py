"""Compile qzero's Triton kernels for an NVIDIA GPU target, without a GPU.

Run as a script by ``test_kernel_compile.py`` (in a process of its own: the kernel tests
run Triton's interpreter, and a process that imported Triton in that mode cannot compile).
The interpreter runs a kernel as Python and misses errors that only compilation finds (a
bitcast between types of different widths in a branch a type never takes, for example);
this compiles every source type and format the launchers use, through ptxas, for sm_90.
Prints one JSON object: ``{variant: "ok" | error text}``.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import warnings

os.environ.pop("TRITON_INTERPRET", None)
warnings.filterwarnings("ignore")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from qzero.quant import gradients_triton as gt  # noqa: E402
from qzero.quant import triton_delta as qd  # noqa: E402
from qzero.quant import triton_launch as ql  # noqa: E402
from qzero.quant import triton_weights as qt  # noqa: E402
from qzero.quant.reference import FLT_MIN  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
FMTS = {"int8": (0, 127.0), "fp8": (1, 448.0), "int4": (2, 7.0)}
SRC = {"bf16": "*i16", "fp16": "*i16", "fp32": "*fp32"}


def build(fn, sig: dict, const: dict, **options) -> str:
    sig = dict(sig)
    for k in const:
        sig[k] = "constexpr"
    names = list(sig)
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
    try:
        triton.compile(src, target=TARGET, options={"num_warps": 4, **options})
        return "ok"
    except Exception as e:  # the message of a compilation error is the point of this script
        text = str(e).strip()
        return f"{type(e).__name__}: {text[-600:]}"


def main(quick: bool) -> dict:
    results = {}
    # Weight pack: every source type and format; exact elements (and group runs, which
    # come with them) only from 16-bit sources.
    for src, fmt, exact, runs in itertools.product(SRC, FMTS, (False, True), (False, True)):
        if (src == "fp32" and exact) or (runs and not exact):
            continue
        if quick and src == "fp16" and fmt != "fp8":
            continue
        code, qmax = FMTS[fmt]
        pairs = src != "fp32"
        sig = dict(src_ptr=SRC[src], values_ptr="*u8", scales_ptr="*fp32", side_ptr="*i16" if exact else "*fp32",
                   idx_ptr="*i64" if exact else "*fp32", blk_ptr="*i64" if exact else "*fp32",
                   runs_ptr="*i64" if runs else "*fp32", n="i64", n_runs="i32", run_steps="i32")
        const = dict(IS_BF16=src == "bf16", SOFT=False, PAIRS=pairs, FMT=code, QMAX=qmax, FLOOR=FLT_MIN, GS=64,
                     GS_PAD=64, G=16, HAS_EXACT=exact, STEPS=11, RUNS=runs)
        results[f"pack {src} {fmt} exact={exact} runs={runs}"] = build(qt._pack_kernel, sig, const, **ql.PACK_OPTIONS)
    # Weight unpack: 16-bit destinations, every format, with and without group runs.
    for dst, fmt, runs in itertools.product(("bf16", "fp16"), FMTS, (False, True)):
        if quick and dst == "fp16" and fmt != "fp8":
            continue
        code, _ = FMTS[fmt]
        const = dict(IS_BF16=dst == "bf16", SOFT=False, FMT=code, GS=64, GS_PAD=64, G=16, RUNS=runs)
        # every source rank's payload of a chunk in one launch (2-D grid; one payload: one rank); offsets of 32
        # and 64 bits
        for wide in (False, True):
            ints = "i64" if wide else "i32"
            sig = dict(buf_ptr="*u8", flat_ptr="*i16", refused_ptr="*u8", n="i32", offset=ints, partition=ints,
                       payload_bytes="i32", scales_offset="i32", runs_ptr="*i64" if runs else "*u8", row_len="i32",
                       n_runs="i32", run_steps="i32")
            results[f"unpack all ranks {dst} {fmt} {ints} runs={runs}"] = build(qt._unpack_ranks_kernel, sig,
                                                                                 dict(const, DELTA=False))
    # Delta payloads: pack from an fp32 target and a 16-bit replica, with and without exact
    # elements; the in-place unpack of every rank's payload (no fp contraction in either).
    for dst, fmt in itertools.product(("bf16", "fp16"), ("int4", "int8")):
        code, qmax = FMTS[fmt]
        for exact in (False, True):
            if quick and dst == "fp16" and exact:
                continue
            for runs in (False, True) if exact else (False,):
                sig = dict(target_ptr="*fp32", replica_ptr="*i16", values_ptr="*u8", scales_ptr="*fp32",
                           side_ptr="*i16" if exact else "*fp32", idx_ptr="*i64" if exact else "*fp32",
                           blk_ptr="*i64" if exact else "*fp32", runs_ptr="*i64" if runs else "*fp32", n="i64",
                           n_runs="i32", run_steps="i32")
                for gs in (64, 136):  # a power of two, and a group size that is not
                    const = dict(IS_BF16=dst == "bf16", SOFT=False, FMT=code, QMAX=qmax, FLOOR=FLT_MIN, GS=gs,
                                 GS_PAD=ql._next_pow2(gs), G=16 if gs == 64 else 8, HAS_EXACT=exact, STEPS=11,
                                 RUNS=runs)
                    results[f"delta pack {dst} {fmt} g{gs} exact={exact} runs={runs}"] = build(
                        qd._pack_delta_kernel, sig, const, **ql.PACK_OPTIONS)
        for wide, runs in itertools.product((False, True), (False, True)):
            ints = "i64" if wide else "i32"
            sig = dict(buf_ptr="*u8", flat_ptr="*i16", refused_ptr="*i64", n="i32", offset=ints, partition=ints,
                       payload_bytes="i32", scales_offset="i32", runs_ptr="*i64" if runs else "*u8", row_len="i32",
                       n_runs="i32", run_steps="i32")
            const = dict(IS_BF16=dst == "bf16", SOFT=False, FMT=code, GS=64, GS_PAD=64, G=16, RUNS=runs, DELTA=True)
            results[f"delta unpack all ranks {dst} {fmt} {ints} runs={runs}"] = build(
                qt._unpack_ranks_kernel, sig, const, **ql.PACK_OPTIONS)
    # the scatter of every rank's exact elements
    sig = dict(src_ptr="*i16", dst_ptr="*i16", src_idx_ptr="*i64", dst_idx_ptr="*i64", count="i32")
    results["exact scatter"] = build(qt._copy_indexed_kernel, sig, dict(BLOCK=qt.COPY_BLOCK))
    # Gradient pack and dequantize-sum: every source type (fp32 as int32 bits) and format; with
    # the Hadamard rotation (blocks of 32 and, at the group size, 64) and error feedback.
    variants = [(fmt, 0, False) for fmt in ("int8", "fp8", "int4")]
    variants += [("int4", 32, True), ("int4", 64, False), ("int8", 32, True), ("fp8", 16, False)]
    for (kind, name), (fmt, rot, ef) in itertools.product(enumerate(("bf16", "fp16", "fp32")), variants):
        if quick and name == "fp16" and fmt != "fp8":
            continue
        if name == "fp16" and (rot or ef):  # fp16 is widened as bf16 is (one code path): its plain variants suffice
            continue
        code, qmax = FMTS[fmt]
        bits = "*i32" if kind == 2 else "*i16"
        rotation = dict(ROT=rot, LOG_ROT=max(rot.bit_length() - 1, 0),
                        ROT_SCALE=gt.ref.rotation_scale(rot) if rot else 1.0)
        sig = dict(src_ptr=bits, values_ptr="*u8", scales_ptr="*fp32", side_ptr=bits, idx_ptr="*i64",
                   blk_ptr="*i64", res_ptr="*i16" if ef else "*fp32", n="i64")
        const = dict(KIND=kind, SOFT=False, FMT=code, QMAX=qmax, FLOOR=FLT_MIN, GS=64, GS_PAD=64, G=16,
                     HAS_EXACT=True, STEPS=11, **rotation, EF=ef)
        tag = f"{name} {fmt}" + (f" rotation {rot}" if rot else "") + (" error feedback" if ef else "")
        results[f"gradient pack {tag}"] = build(gt._grad_pack_kernel, sig, const, **ql.PACK_OPTIONS)
        tag = f"{name} {fmt}" + (f" rotation {rot}" if rot else "")  # no error-feedback variant of its own
        if f"gradient dequantize-sum {tag}" in results:
            continue
        sig = dict(payloads_ptr="*u8", own_ptr=bits, out_ptr="*fp32", idx_ptr="*i64", blk_ptr="*i64", n="i64",
                   nbytes="i64", scales_offset="i64", exact_offset="i64", rank="i32", world="i32")
        const = dict(KIND=kind, SOFT=False, FMT=code, GS=64, GS_PAD=64, G=16, HAS_EXACT=True, STEPS=11, **rotation)
        results[f"gradient dequantize-sum {tag}"] = build(gt._dequantize_sum_kernel, sig, const, **ql.PACK_OPTIONS)
    return results


if __name__ == "__main__":
    print(json.dumps(main(quick="--quick" in sys.argv)))
