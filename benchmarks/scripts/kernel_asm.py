"""Compile the fused pack/unpack kernels for an NVIDIA target without a GPU and print their
instruction mix (PTX and SASS), as the device sees them at run time.

Runs on any machine with Triton's bundled ptxas/nvdisasm (``TRITON_INTERPRET`` must be
unset): pointers and ``n`` are declared 16-divisible, as Triton specializes them at launch
for chunk slices (multiples of the group size). Usage::

    python benchmarks/scripts/kernel_asm.py [--arch 90] [--group-size 64] [--out DIR] [--pack-fp-fusion on]

The pack is compiled with the options it is launched with (``qzero.quant.triton_launch.PACK_OPTIONS``,
fp contraction off); ``--pack-fp-fusion on`` compiles it with contraction on instead, to see
what the launch option prevents. Besides the static counts it prints the *fast path* per
element: the kernel body without the division slow-path subroutine and without the call
blocks that only run when ``FCHK`` fails, divided by the elements each thread handles.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from qzero.quant import triton_launch as ql  # noqa: E402
from qzero.quant import triton_weights as qt  # noqa: E402
from qzero.quant.formats import get_format  # noqa: E402
from qzero.quant.reference import FLT_MIN  # noqa: E402


def compile_kernel(fn, sig, const, arch, warps, **options):
    pointers = [i for i, t in enumerate(sig.values()) if t.startswith("*")] + [list(sig).index("n")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in pointers}
    src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, **options})


_INSN = re.compile(r"/\*[0-9a-f]{4}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)")


def fast_path(sass):
    """Opcodes of the kernel body that run when no division takes its slow path: the body
    up to the first subroutine, less each ``@P BRA L`` block that reaches a ``CALL`` before L."""
    parts = sass.split(".type", 2)  # [header, the kernel, subroutines...]
    lines = parts[1].splitlines() if len(parts) > 1 else sass.splitlines()
    ops, skip_to, pending = [], None, []
    for line in lines:
        label = re.match(r"^(\.L_x_\d+):", line.strip())
        if label and skip_to == label.group(1):
            # the skipped block: drop it only if it is a slow-path call site
            if not any(op.startswith("CALL") for op in pending):
                ops.extend(pending)
            skip_to, pending = None, []
            continue
        m = _INSN.search(line)
        if not m:
            continue
        op = m.group(2)
        if skip_to is not None:
            pending.append(op)
            continue
        ops.append(op)
        target = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m.group(1) and op == "BRA" and target:
            skip_to = target.group(1)
    return ops + pending


def mix(kernel, out_dir, name, per_thread):
    ptx = kernel.asm["ptx"]
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    cubin = os.path.join(out_dir, f"{name}.cubin")
    with open(cubin, "wb") as f:
        f.write(kernel.asm["cubin"])
    sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
    for ext, text in (("ptx", ptx), ("sass", sass)):
        with open(os.path.join(out_dir, f"{name}.{ext}"), "w") as f:
            f.write(text)
    memory = collections.Counter(re.findall(r"\b((?:ld|st)\.global[.a-z0-9]*)", ptx))
    ops = collections.Counter(i.split(".")[0]
                              for i in re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass))
    print(f"{name}: shared {kernel.metadata.shared} B; global accesses {dict(memory)}; "
          f"div.rn {ptx.count('div.rn.f32')}; SASS {sum(ops.values())} static: {ops.most_common(12)}")
    ptx_ops = collections.Counter(re.findall(r"^\s+((?:mul|fma|add)(?:\.rn)?(?:\.ftz)?\.f32)\s", ptx, re.M))
    fused_round = len(re.findall(r"fma\.rn(?:\.ftz)?\.f32[^;]*0f4B400000", ptx))
    fast = collections.Counter(op.split(".")[0] for op in fast_path(sass))
    each = {k: round(fast[k] / per_thread, 2) for k in ("FMUL", "FFMA", "FADD", "FMNMX", "MUFU", "FCHK", "F2I", "BRA")
            if fast[k]}
    print(f"    PTX fp32 {dict(ptx_ops)}; fma into the rounding add (0f4B400000): {fused_round}; "
          f"fast path {sum(fast.values())} SASS = {sum(fast.values()) / per_thread:.1f} per element "
          f"({per_thread} per thread): {each}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--group-size", type=int, default=64, help="ZeroConfig.zero_quantized_weights_group_size")
    ap.add_argument("--out", default="/tmp/qzero_asm")
    ap.add_argument("--pack-fp-fusion", choices=["launch", "on"], default="launch",
                    help="launch: the pack's own launch options (PACK_OPTIONS); on: fp contraction forced on")
    a = ap.parse_args()
    pack_options = dict(ql.PACK_OPTIONS)
    if a.pack_fp_fusion == "on":
        pack_options["enable_fp_fusion"] = True
    os.makedirs(a.out, exist_ok=True)
    block, warps = ql.DEFAULT_TUNING.shape(False)
    gs_pad = ql._next_pow2(a.group_size)
    common = {"IS_BF16": True, "SOFT": False, "GS": a.group_size, "GS_PAD": gs_pad, "G": max(1, block // gs_pad)}
    pack_sig = {"src_ptr": "*i16", "values_ptr": "*u8", "scales_ptr": "*fp32", "side_ptr": "*i16", "idx_ptr": "*i64",
                "blk_ptr": "*i64", "runs_ptr": "*fp32", "n": "i64", "n_runs": "i32", "run_steps": "i32"}
    unpack_sig = {"buf_ptr": "*u8", "flat_ptr": "*i16", "refused_ptr": "*u8", "n": "i64", "offset": "i64",
                  "partition": "i64", "payload_bytes": "i64", "scales_offset": "i64", "runs_ptr": "*u8",
                  "row_len": "i32", "n_runs": "i32", "run_steps": "i32"}
    for fmt, code in ql.FMT_CODES.items():
        f = get_format(fmt)
        pack_const = {**common, "PAIRS": True, "FMT": code, "QMAX": float(f.qmax), "FLOOR": FLT_MIN,
                      "HAS_EXACT": False, "STEPS": 12, "RUNS": False}
        sig = {**pack_sig, **{k: "constexpr" for k in pack_const}}
        per_thread = block // (warps * 32)
        mix(compile_kernel(qt._pack_kernel, sig, pack_const, a.arch, warps, **pack_options), a.out, f"pack_{fmt}",
            per_thread)
        unpack_const = {**common, "FMT": code, "RUNS": False, "DELTA": False}
        sig = {**unpack_sig, **{k: "constexpr" for k in unpack_const}}
        mix(compile_kernel(qt._unpack_ranks_kernel, sig, unpack_const, a.arch, warps), a.out, f"unpack_{fmt}",
            per_thread)


if __name__ == "__main__":
    main()
