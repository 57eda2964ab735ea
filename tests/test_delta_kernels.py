"""Delta payloads: the torch reference against an independent float64 model, and the Triton
kernels against the reference, byte for byte ([Note: delta payload] in qzero/quant/reference.py).

Without CUDA the kernels run under Triton's CPU interpreter (small sizes); with CUDA they are
compiled and checked at large sizes (``gpu_only``).
"""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
import torch

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is first imported

from _support import fp64_model  # noqa: E402
from _support.simulate import kernel_inputs, side_mask  # noqa: E402
from qzero.layout import plan_gather  # noqa: E402
from qzero.quant import REFERENCE_KERNELS, reference  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16]
cpu_only = pytest.mark.skipif(CUDA, reason="interpreter tests run where there is no CUDA device")
gpu_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def kernels(**tuning):
    """A Triton kernel set (``tuning``: the fields of a KernelTuning of its own)."""
    pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")
    from qzero.quant.triton import DEFAULT_KERNELS, TritonKernels
    from qzero.quant.triton_launch import KernelTuning, Launcher

    return TritonKernels(Launcher(KernelTuning(**tuning))) if tuning else DEFAULT_KERNELS


def step_pair(n: int, dtype: torch.dtype, rng: np.random.Generator, device="cpu"):
    """A replica over many magnitudes and a target near it (a training step's update), with
    groups that did not move, ties, and a few elements far from their replica."""
    r = fp64_model.random_groups(rng, n // 64, 64, dtype, tail=n % 64).to(torch.float32)
    r = r.clamp(-6e4, 6e4) if dtype == torch.float16 else r
    upd = torch.from_numpy(rng.standard_normal(n)).float() * (r.abs() * 10.0 ** rng.uniform(-4, -1) + 1e-30)
    m = r + upd
    if n >= 200:
        m[64:128] = r[64:128]  # an unchanged group: every difference 0
        m[130:140] = r[130:140] * 3.0  # a few far off
    return m.to(device), r.to(dtype).to(device)


def payload_layout(n: int, fmt: str, gs: int, exact: torch.Tensor | None):
    ranges = [] if exact is None else [(int(i), int(i) + 1) for i in exact.cpu()]
    plan = plan_gather(n, 1, zero_quantized_weights_format=fmt, zero_quantized_weights_group_size=gs,
                       exact_ranges=ranges, allgather_bucket_size=-(-n // gs) * gs, zero_quantized_weights_delta=True)
    return plan


def pack(kind, m, r, fmt, gs, exact, gen):
    """One payload of the whole of ``m``, with the layout, side elements and group runs the
    plan gives it (the exact groups' elements are side elements too: [Note: exact groups])."""
    plan = payload_layout(m.numel(), fmt, gs, exact)
    k = kernel_inputs(plan, plan.chunks[0], m.device)
    out = torch.randint(0, 256, (k.payload_bytes + 32,), dtype=torch.uint8, generator=gen).to(m.device)
    kind.pack_delta_payload(m, r, out, k.layouts[0], gs, fmt, k.sides[0], k.runs[0])
    return out, plan


def apply(kind, payload, r, plan, fmt, gs):
    n = r.numel()
    flat = r.clone()
    refused = reference.refusal_flag(r.device)
    k = kernel_inputs(plan, plan.chunks[0], r.device)
    kind.unpack_delta_payloads(payload, flat, n, 0, n, 1, k.layouts[0], gs, fmt, k.scatter, refused, k.all_runs)
    return flat, int(refused.item())


def side_elements(n: int, fmt: str, gs: int, exact: torch.Tensor, elem_size: int = 2) -> np.ndarray:
    """The elements that arrive as ``t``'s bits: the exact ones, and the groups cheaper sent
    verbatim than coded (the rule of [Note: exact groups], restated in ``simulate.side_mask``)."""
    ranges = [(int(i), int(i) + 1) for i in exact]
    return np.flatnonzero(side_mask(n, 1, gs, ranges, fmt, elem_size))


# --------------------------------------------------------------------------- the reference is the spec


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("gs", [8, 64, 136])
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_reference_step_matches_fp64_model(fmt, gs, dtype):
    """pack + in-place unpack of the reference give exactly the float64 model's new replica,
    and every element is within one quantization step (its group's scale) of RN(target)."""
    rng = np.random.default_rng(seed(fmt, gs, dtype))
    gen = torch.Generator().manual_seed(1)
    n = 23 * gs + 5
    m, r = step_pair(n, dtype, rng)
    exact = fp64_model.random_exact(rng, n)
    payload, plan = pack(reference, m, r, fmt, gs, exact, gen)
    got, refused = apply(reference, payload, r, plan, fmt, gs)
    want, scales = fp64_model.delta_step_fp64(m, r, gs, fmt, side_elements(n, fmt, gs, exact))
    assert refused == reference.NOT_REFUSED
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    t = m.to(dtype)
    err = (got.double() - t.double()).abs().numpy()
    bound = np.repeat(scales.astype(np.float64), gs)[:n]
    assert (err <= bound).all(), f"worst {np.max(err / bound)} steps"
    assert torch.equal(got[exact].view(torch.int16), t[exact].view(torch.int16))


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_closed_loop_does_not_drift(fmt):
    """Many steps of a drifting target: the error against RN(target) stays within one step of
    each step's scale, and does not grow (no accumulation)."""
    torch.manual_seed(0)
    n, gs = 4096, 64
    m = torch.randn(n) * 0.02
    r = m.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    errs = []
    for step in range(60):
        m = m + torch.randn(n) * 3e-4 * (1 + (step % 7))  # updates of changing size, like a schedule
        payload, plan = pack(reference, m, r, fmt, gs, None, gen)
        scales = payload[plan.chunks[0].payload.scales_offset:][: 4 * (n // gs)].view(torch.float32)
        r, _ = apply(reference, payload, r, plan, fmt, gs)
        err = (r.float() - m.to(torch.bfloat16).float()).abs()
        assert (err <= scales.repeat_interleave(gs)).all()
        errs.append(float(err.norm()))
    assert max(errs[-20:]) < 3 * max(errs[:20]) + 1e-9, errs


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_non_finite_differences_are_refused(dtype):
    """A NaN master, an Inf master and (fp16) a finite master beyond the dtype's range make
    their groups' scales NaN: the unpack leaves those groups as they were and lowers the flag
    to the first one's index; every other group is applied."""
    gs, n = 16, 16 * 6
    gen = torch.Generator().manual_seed(3)
    m = torch.randn(n, generator=gen) * 0.1
    r = (m + 0.01).to(dtype)
    m[19] = float("nan")
    m[20] = float("inf")
    m[70] = float("-inf")
    if dtype == torch.float16:
        m[40] = 7e4  # rounds to fp16 inf
    payload, plan = pack(reference, m, r, "int4", gs, None, gen)
    got, refused = apply(reference, payload, r, plan, "int4", gs)
    assert refused == 16  # the first refused group starts at element 16
    bad = [1, 4] + ([2] if dtype == torch.float16 else [])
    for g in range(n // gs):
        sl = slice(g * gs, (g + 1) * gs)
        if g in bad:
            assert torch.equal(got[sl].view(torch.int16), r[sl].view(torch.int16)), g
        else:
            assert not torch.equal(got[sl], r[sl]), g
    assert torch.isfinite(got).all()


# --------------------------------------------------------------------------- Triton against the reference


def check_kernels_match(tk, m, r, fmt, gs, exact, gen, world=1):
    """Pack: the kernel writes the reference's bytes over two poisons. Unpack: every rank's
    payload at once, in place, the same bits and the same flag as the reference."""
    n = m.numel() // world
    ranges = [] if exact is None else [(int(i), int(i) + 1) for i in exact.cpu()]
    plan = plan_gather(world * n, world, zero_quantized_weights_format=fmt, zero_quantized_weights_group_size=gs,
                       exact_ranges=ranges,
                       allgather_bucket_size=world * (-(-n // gs) * gs), zero_quantized_weights_delta=True)
    chunk = plan.chunks[0]
    k = kernel_inputs(plan, chunk, m.device)
    pb = k.payload_bytes
    bufs = []
    poison = torch.randint(0, 256, (world * pb,), dtype=torch.uint8, generator=gen).to(m.device)
    for kind in (REFERENCE_KERNELS, tk):
        buf = poison.clone()
        for rank in range(world):
            kind.pack_delta_payload(m[rank * n : (rank + 1) * n], r[rank * n : (rank + 1) * n],
                                    buf[rank * pb : (rank + 1) * pb], k.layouts[rank], gs, fmt, k.sides[rank],
                                    k.runs[rank])
        bufs.append(buf)
    bad = (bufs[0] != bufs[1]).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} payload bytes differ, first at {bad[:8].tolist()}"
    outs = []
    for kind in (REFERENCE_KERNELS, tk):
        flat = r.clone()
        refused = reference.refusal_flag(m.device)
        kind.unpack_delta_payloads(bufs[0], flat, n, 0, n, world, k.layouts[0], gs, fmt, k.scatter, refused,
                                   k.all_runs)
        outs.append((flat, int(refused.item())))
    (a, fa), (b, fb) = outs
    bad = (a.view(torch.int16) != b.view(torch.int16)).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} replica elements differ, first at {bad[:8].tolist()}"
    assert fa == fb
    return fa


@cpu_only
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("gs", [8, 64, 136])
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_kernels_match_reference(fmt, gs, dtype):
    tk = kernels()
    rng = np.random.default_rng(seed(fmt, gs, dtype, "k"))
    gen = torch.Generator().manual_seed(4)
    n = 11 * gs + 5  # a short last group
    m, r = step_pair(n, dtype, rng)
    check_kernels_match(tk, m, r, fmt, gs, fp64_model.random_exact(rng, n), gen)
    check_kernels_match(tk, m, r, fmt, gs, None, gen)


@cpu_only
@pytest.mark.parametrize("with_exact", [True, False], ids=["exact", "no_exact"])
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_kernels_world_3_small_tiles_and_refusals(fmt, with_exact):
    """World 3 in one launch, tiles smaller than the slice (program boundaries: five whole
    tiles, read and written without bounds masks, and a short last one per rank), exact runs
    across them (group runs) or none, and non-finite differences in whole tiles refused alike."""
    tk = kernels(block_elems=64, exact_block_elems=64)
    rng = np.random.default_rng(5)
    gen = torch.Generator().manual_seed(5)
    n = 3 * (64 * 5 + 24)
    m, r = step_pair(n, torch.bfloat16, rng)
    exact = torch.tensor(sorted({0, 5, 6, 7, 60, 61, 62, 63, 64, 65, n // 3, n // 3 + 1, n - 1}), dtype=torch.int64)
    exact = exact if with_exact else None
    assert check_kernels_match(tk, m, r, fmt, 8, exact, gen, world=3) == reference.NOT_REFUSED
    m[n - 50] = float("inf")
    assert check_kernels_match(tk, m, r, fmt, 8, exact, gen, world=3) == (n - 50) // 8 * 8
    m[203] = float("nan")
    assert check_kernels_match(tk, m, r, fmt, 8, exact, gen, world=3) == 200  # the smallest index wins


@cpu_only
def test_delta_launchers_pass_constexprs_in_kernel_order():
    """The delta launchers can use the compiled kernel's launch (runtime arguments first, then
    the constexprs in the kernel's order), as every launcher of the module."""
    kernels()  # Triton, or skip
    from _support.kernel_checks import checking_kernels
    from qzero.quant import triton_delta, triton_weights

    tk = checking_kernels()
    rng = np.random.default_rng(6)
    m, r = step_pair(2 * 256, torch.bfloat16, rng)
    check_kernels_match(tk, m, r, "int4", 64, torch.tensor([3, 4, 300]), torch.Generator().manual_seed(6), world=2)
    assert {triton_delta._pack_delta_kernel, triton_weights._unpack_ranks_kernel,
            triton_weights._copy_indexed_kernel} <= tk.launcher.seen


def test_kernels_refuse_bad_arguments():
    tk = kernels()
    plan = payload_layout(64, "int4", 8, None)
    layout = plan.chunks[0].payload
    out = torch.zeros(layout.nbytes, dtype=torch.uint8)
    r = torch.zeros(64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="int4 or int8"):
        tk.pack_delta_payload(torch.zeros(64), r, out, layout, 8, "fp8", None)
    with pytest.raises(ValueError, match="fp32"):
        tk.pack_delta_payload(torch.zeros(64, dtype=torch.float64), r, out, layout, 8, "int4", None)
    with pytest.raises(ValueError, match="refusal flag"):
        tk.unpack_delta_payloads(out, r, 64, 0, 64, 1, layout, 8, "int4", None, torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="delta payload"):
        plan_gather(64, 1, zero_quantized_weights_format="fp8", zero_quantized_weights_group_size=8,
                    zero_quantized_weights_delta=True)


@gpu_only
@pytest.mark.parametrize("soft", [False, True], ids=["hw", "soft"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("gs", [64, 256, 2048, 136])
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_gpu_kernels_match_reference(fmt, gs, dtype, soft):
    """Compiled on the GPU, at sizes with many programs per rank, world 3, exact elements and
    subnormal values: the same bytes and the same replica as the reference on the GPU."""
    tk = kernels(soft_casts=soft)
    rng = np.random.default_rng(seed(fmt, gs, dtype, soft))
    gen = torch.Generator().manual_seed(7)
    per_rank = (1 << 20) + 3 * gs + 5
    m, r = step_pair(3 * per_rank, dtype, rng, "cuda")
    if dtype == torch.bfloat16:
        m[1000:1256] = torch.randn(256, device="cuda") * 1e-39  # subnormal targets
    exact = fp64_model.random_exact(rng, 3 * per_rank).cuda()
    assert check_kernels_match(tk, m, r, fmt, gs, exact, gen, world=3) == reference.NOT_REFUSED


_PTX_SCRIPT = r"""
import os, sys, json
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from qzero.quant import triton_delta as qd, triton_launch as ql, triton_weights as qt
from qzero.quant.reference import FLT_MIN

def ptx(fn, sig, const):
    names = list(sig) + list(const)
    full = {**sig, **{k: "constexpr" for k in const}}
    src = ASTSource(fn=fn, signature=full, constexprs={(names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, **ql.PACK_OPTIONS}).asm["ptx"]

pack = ptx(qd._pack_delta_kernel,
           dict(target_ptr="*fp32", replica_ptr="*i16", values_ptr="*u8", scales_ptr="*fp32", side_ptr="*fp32",
                idx_ptr="*fp32", blk_ptr="*fp32", runs_ptr="*fp32", n="i64", n_runs="i32", run_steps="i32"),
           dict(IS_BF16=True, SOFT=False, FMT=2, QMAX=7.0, FLOOR=FLT_MIN, GS=64, GS_PAD=64, G=16, HAS_EXACT=False,
                STEPS=11, RUNS=False))
unpack = ptx(qt._unpack_ranks_kernel,
             dict(buf_ptr="*u8", flat_ptr="*i16", refused_ptr="*i64", n="i32", offset="i32", partition="i32",
                  payload_bytes="i32", scales_offset="i32", runs_ptr="*u8", row_len="i32", n_runs="i32",
                  run_steps="i32"),
             dict(IS_BF16=True, SOFT=False, FMT=2, GS=64, GS_PAD=64, G=16, RUNS=False, DELTA=True))
print(json.dumps({"pack": pack, "unpack": unpack}))
"""


def _nvidia_tools() -> bool:
    try:
        import triton
    except ImportError:
        return False
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return os.path.exists(os.path.join(bin_dir, "ptxas"))


@pytest.mark.skipif(not _nvidia_tools(), reason="Triton's bundled ptxas is not installed")
def test_delta_kernels_compile_without_fused_multiply_add():
    """As compiled for sm_90 (offline, no GPU): the unpack's ``q * scale`` and ``+ r`` stay two
    roundings (no fma), the pack's rounding add is not fused into the multiply, and nothing
    flushes subnormals; both as the reference computes them."""
    import json
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(root, "src"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _PTX_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ptx = json.loads(done.stdout.strip().splitlines()[-1])
    for name, text in ptx.items():
        assert not re.search(r"\bfma\.", text), name
        assert not re.search(r"\.ftz\.f32", text), name
        assert re.search(r"\bmul\.rn\.f32", text) and re.search(r"\b(add|sub)\.rn\.f32", text), name


@gpu_only
@pytest.mark.parametrize("stage", [None, "pack", "gather", "unpack"])
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_gpu_delta_pipeline_matches_unpipelined(fmt, stage):
    """Delta gathers through the engine on the GPU: the ``streams`` schedule (each side stream
    late in turn) gives the bits of the ``inline`` one, replica and refusal flag alike."""
    from qzero.wire.chunks import DeltaInputs
    from qzero.wire.engine import CommContext, start_gather

    rng = np.random.default_rng(17)
    numel = 1 << 22
    m, r = step_pair(numel, torch.bfloat16, rng, "cuda")
    exact = [(0, 1000), (70_000, 140_000), (numel - 300, numel)]
    plan = plan_gather(numel, 1, zero_quantized_weights_format=fmt, zero_quantized_weights_group_size=256,
                       exact_ranges=exact, allgather_bucket_size=1 << 19, zero_quantized_weights_delta=True)

    def gather(context):
        flat, refused = r.clone(), reference.refusal_flag("cuda")
        start_gather(flat, plan, None, context, delta=DeltaInputs(m, refused)).wait()
        torch.cuda.synchronize()
        return flat, int(refused.item())

    want = gather(CommContext("cuda", schedule="inline"))
    streams = CommContext("cuda", schedule="streams", delays={} if stage is None else {stage: 2_000_000})
    for _ in range(2):
        got = gather(streams)
        assert torch.equal(got[0].view(torch.int16), want[0].view(torch.int16))
        assert got[1] == want[1] == reference.NOT_REFUSED
