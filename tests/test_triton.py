"""The fused Triton kernels against the torch reference, byte for byte.

Without CUDA the kernels run under Triton's CPU interpreter (small sizes); with
CUDA they are compiled and checked at large sizes, and the chunk pipeline is
checked against the unpipelined loop with delays injected into each stage.
The whole module is skipped when Triton is not installed.
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

import numpy as np
import pytest
import torch

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
if not CUDA:
    # Must be set before Triton is first imported: it reads the variable once.
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")

from _support import fp64_model  # noqa: E402
from qzero.wire.comm import all_gather, quantized_all_gather, run_gather  # noqa: E402
from qzero.layout import PayloadKind, plan_gather  # noqa: E402
from _support.simulate import kernel_inputs  # noqa: E402
from qzero.quant import REFERENCE_KERNELS, reference  # noqa: E402
from qzero.quant import triton_launch, triton_weights  # noqa: E402
from qzero.quant.triton import DEFAULT_KERNELS, TritonKernels  # noqa: E402
from qzero.quant.triton_launch import At, KernelTuning, Launcher  # noqa: E402

kernels = DEFAULT_KERNELS

FORMATS = ["int8", "fp8", "int4"]
DTYPES = [torch.bfloat16, torch.float16]

cpu_only = pytest.mark.skipif(CUDA, reason="interpreter tests run where there is no CUDA device")
gpu_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def tuned(**fields) -> TritonKernels:
    """A kernel set of its own tuning (and its own launch caches)."""
    return TritonKernels(Launcher(KernelTuning(**fields)))


@pytest.fixture(params=[64, 4096], ids=["tile64", "tile4096"])
def tile(request) -> TritonKernels:
    """Kernels with small tiles put many programs (and program boundaries) into small inputs."""
    return tuned(block_elems=request.param, exact_block_elems=request.param)


# --------------------------------------------------------------------------- helpers


def weights(n: int, dtype: torch.dtype, gen: torch.Generator, device="cpu") -> torch.Tensor:
    """Random values over many magnitudes, with an all-zero group and exact ties mixed in."""
    lim = 4.0 if dtype == torch.float16 else 30.0
    mags = torch.pow(10.0, torch.empty(n).uniform_(-lim, lim / 2, generator=gen))
    x = torch.randn(n, generator=gen) * mags
    if n >= 24:
        x[8:16] = 0.0
        x[16:24] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5])
    return x.to(dtype).to(device)


def random_exact(n: int, gen: torch.Generator, device="cpu") -> torch.Tensor:
    """Sorted unique indices: both ends, a run over a group boundary, random singles."""
    picks = {0, n - 1} | set(range(n // 3, min(n, n // 3 + 70)))
    picks |= set(torch.randint(0, n, (max(1, n // 50),), generator=gen).tolist())
    return torch.tensor(sorted(picks), dtype=torch.int64, device=device)


class Payload(NamedTuple):
    """What a one-chunk plan says of a slice of ``n`` elements: its payload layout, its group
    runs (None: every group coded) and its side elements (the exact ones, and the rest of
    its exact groups), as the gather passes them to the kernels."""

    layout: object
    runs: object
    side: torch.Tensor | None
    nbytes: int


def layout_for(n: int, fmt: str, group_size: int, exact: torch.Tensor | None) -> Payload:
    ranges = [] if exact is None else [(int(i), int(i) + 1) for i in exact.cpu()]
    plan = plan_gather(n, 1, zero_quantized_weights_format=fmt, zero_quantized_weights_group_size=group_size,
                       exact_ranges=ranges,
                       allgather_bucket_size=-(-n // group_size) * group_size)
    k = kernel_inputs(plan, plan.chunks[0], "cpu" if exact is None else exact.device)
    return Payload(k.layouts[0], k.runs[0], k.sides[0], k.payload_bytes)


def poison(nbytes: int, gen: torch.Generator, device="cpu") -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).to(device)


def check_pack(x, fmt, group_size, exact, gen, kernels=DEFAULT_KERNELS):
    """Kernel and reference write the same bytes over two different poisons, so the
    kernel writes exactly the bytes the reference writes and nothing else."""
    p = layout_for(x.numel(), fmt, group_size, exact)
    for _ in range(2):
        want = poison(p.nbytes + 64, gen, x.device)
        got = want.clone()
        reference.pack_payload(x, want, p.layout, group_size, fmt, p.side, p.runs)
        kernels.pack_payload(x, got, p.layout, group_size, fmt, p.side, p.runs)
        bad = (got != want).nonzero().flatten()
        assert bad.numel() == 0, f"{bad.numel()} bytes differ, first at {bad[:8].tolist()} ({p.layout})"
    return want, p


def check_unpack(payload, p, n, dtype, fmt, group_size, gen, kernels=DEFAULT_KERNELS):
    """Destination is a slice of a poisoned buffer: every element written, guards untouched."""
    guard = 5
    base = poison((n + 2 * guard) * 2, gen, payload.device).view(dtype)
    want = base.clone()
    got = base.clone()
    reference.unpack_payload(payload, want[guard : guard + n], p.layout, group_size, fmt, p.side, p.runs)
    kernels.unpack_payload(payload, got[guard : guard + n], p.layout, group_size, fmt, p.side, p.runs)
    w, g = want.view(torch.int16), got.view(torch.int16)
    bad = (w != g).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} elements differ, first at {bad[:8].tolist()}"


# --------------------------------------------------------------------------- CPU (interpreter)


@cpu_only
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("group_size", [8, 64, 136])
@pytest.mark.parametrize("fmt", FORMATS)
def test_roundtrip_matches_reference(fmt, group_size, dtype, tile):
    gen = torch.Generator().manual_seed(hash((fmt, group_size, str(dtype), tile.tuning.block_elems)) % 2**31)
    n = 11 * group_size + 5  # a short last group
    x = weights(n, dtype, gen)
    exact = random_exact(n, gen)
    payload, layout = check_pack(x, fmt, group_size, exact, gen, tile)
    check_unpack(payload, layout, n, dtype, fmt, group_size, gen, tile)
    # and without any exact elements
    payload, layout = check_pack(x, fmt, group_size, None, gen, tile)
    check_unpack(payload, layout, n, dtype, fmt, group_size, gen, tile)


@cpu_only
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", [1, 7, 8, 9, 63, 65, 130])
def test_odd_tails(fmt, n, tile):
    gen = torch.Generator().manual_seed(n)
    x = weights(n, torch.bfloat16, gen)
    exact = torch.tensor([n - 1]) if n > 1 else None
    payload, layout = check_pack(x, fmt, 64, exact, gen, tile)
    check_unpack(payload, layout, n, torch.bfloat16, fmt, 64, gen, tile)


@cpu_only
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "ranges",
    [[(0, 1)], [(0, 64)], [(63, 65)], [(0, 200)], [(190, 200)], [(0, 20), (60, 70), (127, 129), (199, 200)]],
    ids=["first", "first-group", "across-groups", "all", "last", "several"],
)
def test_exact_ranges_at_edges(fmt, ranges, tile):
    gen = torch.Generator().manual_seed(len(ranges))
    n = 200
    x = weights(n, torch.float16, gen)
    x[ranges[0][0]] = 6e4  # a huge exact value must not widen its group's scale
    exact = torch.cat([torch.arange(a, b) for a, b in ranges])
    payload, layout = check_pack(x, fmt, 64, exact, gen, tile)
    check_unpack(payload, layout, n, torch.float16, fmt, 64, gen, tile)


@cpu_only
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_every_code_dequantizes_like_the_reference(fmt):
    """All 256 byte values (fp8: but its two NaN codes) through the unpack kernel."""
    gen = torch.Generator().manual_seed(11)
    codes = torch.arange(256, dtype=torch.uint8)
    if fmt == "fp8":
        codes = codes[(codes & 0x7F) != 0x7F]
    n = codes.numel()
    layout = layout_for(n, fmt, 8, None)
    payload = poison(layout.nbytes, gen)
    payload[:n] = codes
    groups = -(-n // 8)
    scales = torch.pow(2.0, torch.randint(-140, 100, (groups,), generator=gen).float()).clamp_min(2.0**-126)
    payload[layout.layout.scales_offset : layout.layout.scales_offset + 4 * groups].view(torch.float32).copy_(scales)
    for dtype in DTYPES:
        check_unpack(payload, layout, n, dtype, fmt, 8, gen)


@cpu_only
@pytest.mark.parametrize("n", [200, 201])
def test_int4_unaligned_source(n):
    """A source 2 bytes off a 4-byte boundary takes the two-load path of the INT4 pack."""
    gen = torch.Generator().manual_seed(n)
    x = weights(n + 1, torch.bfloat16, gen)[1:]
    assert x.data_ptr() % 4 == 2
    exact = torch.tensor([0, 5, 6, 7, n - 1])
    payload, layout = check_pack(x, "int4", 64, exact, gen)
    check_unpack(payload, layout, n, torch.bfloat16, "int4", 64, gen)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", [7, 64 * 9 + 5])
def test_fp32_source_matches_reference(fmt, n, tile):
    """An fp32 source (an FSDP2 master shard) is quantized as it is, like the reference does:
    the values carry more bits than bf16, so a kernel that rounded them first would differ."""
    gen = torch.Generator().manual_seed(n)
    x = weights(n, torch.float32, gen) * (1 + torch.rand(n, generator=gen) * 2**-10)
    assert not torch.equal(x, x.bfloat16().float())
    x = x.to("cuda" if CUDA else "cpu")  # compiled kernels launch on the GPU
    payload, layout = check_pack(x, fmt, 64, None, gen, tile)
    check_unpack(payload, layout, n, torch.bfloat16, fmt, 64, gen, tile)
    with pytest.raises(ValueError, match="fp32 source cannot have exact"):
        tile.pack_payload(x, payload.clone(), layout_for(n, fmt, 64, torch.tensor([0])).layout, 64, fmt,
                             torch.tensor([0], device=x.device))


@cpu_only
def test_subnormal_bf16_inputs():
    """bf16 shares fp32's exponent range: subnormal inputs must not be flushed to zero."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(256, generator=gen) * 1e-39).bfloat16()
    for fmt in FORMATS:
        payload, layout = check_pack(x, fmt, 64, None, gen)
        check_unpack(payload, layout, 256, torch.bfloat16, fmt, 64, gen)


@cpu_only
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_pack_multiplies_by_the_reciprocal(fmt, dtype, tile):
    """Groups where ``x * inv`` and a correctly rounded ``x / scale`` store different values,
    mined from fresh random data, plus random groups (bf16: absmax near FLT_MIN among them)
    with exact elements: the kernel writes the reference's bytes, which are the float64 model's."""
    seed = int(np.random.SeedSequence().entropy) % 2**63
    rng = np.random.default_rng(seed)
    gs = 64
    pool = fp64_model.random_groups(rng, 1 << 14, gs, dtype)
    codes, _ = fp64_model.quantize_fp64(pool, gs, fmt)
    divided, _ = fp64_model.quantize_fp64(pool, gs, fmt, divide=True)
    differ = (codes != divided).reshape(-1, gs).any(axis=1)
    hits, others = np.flatnonzero(differ)[:24], np.flatnonzero(~differ)[:8]
    assert hits.size, f"seed {seed}: no group where the definitions differ"
    x = pool.view(-1, gs)[torch.from_numpy(np.concatenate([hits, others]))].flatten()
    n = x.numel()
    # exact elements only in the last (non-mined) groups, so the mined ones keep their values
    exact = torch.from_numpy(np.unique(rng.integers(n - others.size * gs, n, 40)))
    want, layout = check_pack(x, fmt, gs, exact, torch.Generator().manual_seed(seed), tile)
    codes, scales = fp64_model.quantize_fp64(x, gs, fmt, exact.numpy())
    model = fp64_model.value_bytes(codes, fmt)
    assert layout.runs is None, f"seed {seed}: the mined groups must all be coded"
    values = want[layout.layout.values_offset : layout.layout.values_offset + model.size].numpy()
    assert np.array_equal(values, model), f"seed {seed}: reference differs from the float64 model"
    got_scales = want[layout.layout.scales_offset : layout.layout.scales_offset + 4 * scales.size].view(
        torch.float32).numpy()
    assert np.array_equal(got_scales.view(np.uint32), scales.view(np.uint32)), f"seed {seed}"
    divided, _ = fp64_model.quantize_fp64(x, gs, fmt, exact.numpy(), divide=True)
    assert np.count_nonzero(divided != codes), f"seed {seed}"


def _nvidia_tools() -> bool:
    import triton

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return all(os.path.exists(os.path.join(bin_dir, t)) for t in ("ptxas", "nvdisasm"))


@pytest.mark.skipif(not _nvidia_tools(), reason="Triton's bundled ptxas/nvdisasm are not installed")
def test_pack_compiles_to_a_plain_multiply(tmp_path):
    """The pack as compiled for sm_90 (offline, no GPU; benchmarks/scripts/kernel_asm.py): no division per
    element any more, and the multiply is not fused into the rounding add (``+ 1.5 * 2**23``,
    ``0f4B400000``), which would round once where the reference rounds twice."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(root, "src"), env.get("PYTHONPATH", "")])
    subprocess.run([sys.executable, os.path.join(root, "benchmarks", "scripts", "kernel_asm.py"),
                    "--out", str(tmp_path)],
                   env=env, check=True, capture_output=True, timeout=600)
    per_thread = kernels.tuning.block_elems // (kernels.tuning.num_warps * 32)
    for fmt in FORMATS:
        ptx = (tmp_path / f"pack_{fmt}.ptx").read_text()
        assert ptx.count("div.rn.f32") < per_thread, fmt  # was one per element (17 for int8)
        assert re.search(r"\bmul\.rn\.f32", ptx), fmt  # contraction off: the multiply is explicit
        assert not re.search(r"\bfma\.rn(\.ftz)?\.f32[^;]*0f4B400000", ptx), fmt
        assert not re.search(r"\bmul(\.rn)?\.ftz\.f32", ptx), fmt  # subnormal inputs are not flushed


@cpu_only
def test_soft_casts_are_on_under_the_interpreter():
    assert triton_launch.AVAILABLE and triton_launch.INTERPRET
    assert kernels.launcher.soft(torch.device("cpu")) and not kernels.tuning.soft_casts
    assert Launcher(interpret=True).soft(torch.device("cuda", 0))  # whatever the device


def test_kernel_tuning_is_checked_and_frozen():
    import dataclasses

    with pytest.raises(ValueError, match="block_elems must be a positive power of two, got 1000"):
        KernelTuning(block_elems=1000)
    with pytest.raises(ValueError, match="exact_num_warps"):
        KernelTuning(exact_num_warps=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        kernels.tuning.block_elems = 64  # no module-wide switch to flip: a new kernel set instead
    with pytest.raises(TypeError, match="KernelTuning"):
        Launcher(dict(block_elems=64))


@cpu_only
def test_gather_through_kernels():
    """The gather with the Triton kernel set passed in (as a kernel set, through its context:
    small tiles, many programs) equals the reference path."""
    from qzero.wire.engine import CommContext

    gen = torch.Generator().manual_seed(3)
    flat = weights(3 * 64 * 8 + 64, torch.bfloat16, gen)
    exact = [(0, 10), (500, 700), (1500, 1600)]
    plan = plan_gather(flat.numel(), 1, zero_quantized_weights_format="int8", zero_quantized_weights_group_size=64,
                       exact_ranges=exact, allgather_bucket_size=512)
    want = flat.clone()
    quantized_all_gather(want, exact_ranges=exact, allgather_bucket_size=512)  # the reference kernels, on the CPU
    got = flat.clone()
    context = CommContext("cpu", kernels=tuned(block_elems=64, exact_block_elems=64))
    assert context.kernels.tuning.block_elems == 64
    run_gather(got, plan, context=context)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_kernel_argument_checks():
    layout = layout_for(64, "int8", 64, None).layout
    out = torch.zeros(layout.nbytes, dtype=torch.uint8)
    with pytest.raises(TypeError, match="bf16 or fp16"):
        kernels.pack_payload(torch.zeros(64, dtype=torch.float64), out, layout, 64, "int8", None)
    with pytest.raises(ValueError, match="bytes"):
        kernels.pack_payload(torch.zeros(64, dtype=torch.bfloat16), out[:8], layout, 64, "int8", None)
    with pytest.raises(ValueError, match="unknown quantization format"):
        kernels.pack_payload(torch.zeros(64, dtype=torch.bfloat16), out, layout, 64, "int3", None)


# --------------------------------------------------------------------------- GPU


# (group size, soft casts, dtype): soft casts are the interpreter's arithmetic, checked here
# against the hardware; a few combinations keep the number of compiled variants small.
GPU_CASES = [
    (64, False, torch.bfloat16),
    (64, False, torch.float16),
    (136, False, torch.bfloat16),
    (8192, False, torch.float16),
    (64, True, torch.bfloat16),
]


@gpu_only
@pytest.mark.parametrize(
    "group_size,soft,dtype",
    GPU_CASES,
    ids=[f"g{g}-{str(d)[6:]}{'-soft' if s else ''}" for g, s, d in GPU_CASES],
)
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_large_matches_reference(fmt, group_size, soft, dtype):
    kernels = tuned(soft_casts=soft)
    gen = torch.Generator().manual_seed(hash((fmt, group_size, str(dtype), soft)) % 2**31)
    n = (1 << 22) + 3 * group_size + 5
    x = weights(n, dtype, gen, "cuda")
    x[100:356] = (torch.randn(256, generator=gen) * 1e-39).to(dtype).cuda()  # subnormal fp32 values
    exact = random_exact(n, gen, "cuda")
    payload, layout = check_pack(x, fmt, group_size, exact, gen, kernels)
    check_unpack(payload, layout, n, dtype, fmt, group_size, gen, kernels)
    payload, layout = check_pack(x, fmt, group_size, None, gen, kernels)
    check_unpack(payload, layout, n, dtype, fmt, group_size, gen, kernels)


@gpu_only
@pytest.mark.parametrize("stage", [None, "pack", "gather", "unpack"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_pipeline_matches_unpipelined(fmt, stage):
    """Delaying one stage's stream exposes any missing wait: the result must not move."""
    from qzero.wire.engine import CommContext, fitting_plan, recv_budget_bytes

    gen = torch.Generator().manual_seed(17)
    numel = 1 << 22
    flat = weights(numel, torch.bfloat16, gen, "cuda")
    exact = [(0, 1000), (70_000, 140_000), (numel - 300, numel)]
    plan = plan_gather(numel, 1, zero_quantized_weights_format=fmt, zero_quantized_weights_group_size=64,
                       exact_ranges=exact, allgather_bucket_size=1 << 19)
    want = flat.clone()
    run_gather(want, plan, context=CommContext(flat.device, schedule="inline"))
    streams = CommContext(flat.device, schedule="streams", delays={} if stage is None else {stage: 2_000_000})
    assert fitting_plan(plan, 2) is not None
    for _ in range(2):
        got = flat.clone()
        run_gather(got, plan, context=streams)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    work = fitting_plan(plan, 2)
    assert 2 * work.max_recv_bytes <= recv_budget_bytes(plan)


@gpu_only
def test_gpu_plain_gather_untouched():
    flat = torch.randn(1 << 20, device="cuda").bfloat16()
    want = flat.clone()
    all_gather(flat, allgather_bucket_size=1 << 16)
    assert torch.equal(flat.view(torch.int16), want.view(torch.int16))



@gpu_only
def test_gpu_soft_e4m3_matches_hardware():
    """All 254 non-NaN e4m3 codes decoded by the soft path and by the hardware, bf16 and fp16 out."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].cuda()
    n = codes.numel()
    layout = layout_for(n, "fp8", 8, None).layout
    payload = torch.zeros(layout.nbytes, dtype=torch.uint8, device="cuda")
    payload[:n] = codes
    payload[layout.scales_offset : layout.scales_offset + 4 * (-(-n // 8))].view(torch.float32).fill_(1.0)
    for dtype in DTYPES:
        outs = []
        for soft in (False, True):
            dst = torch.empty(n, dtype=dtype, device="cuda")
            tuned(soft_casts=soft).unpack_payload(payload, dst, layout, 8, "fp8", None)
            outs.append(dst.view(torch.int16).cpu())
        bad = (outs[0] != outs[1]).nonzero().flatten()
        assert bad.numel() == 0, (f"{dtype}: codes {codes.cpu()[bad[:8]].tolist()} hw {outs[0][bad[:8]].tolist()} "
                                  f"soft {outs[1][bad[:8]].tolist()}")


def test_exact_tables_are_reused_and_follow_in_place_changes():
    """The per-program tables of an exact index are built once per index, and rebuilt when
    the index changes in place (a stale table would mask the wrong elements)."""
    launcher = Launcher()
    shape = launcher.shape(4096, 64, True)
    idx = torch.tensor([3, 4, 5, 2000, 2001], dtype=torch.int64)
    a = launcher.exact_tables(idx, shape, idx.device)
    b = launcher.exact_tables(idx, shape, idx.device)
    assert a[1] is b[1], "tables rebuilt for an unchanged index"
    assert a[0] is idx  # already int64 on the device: used as it is
    idx.copy_(torch.tensor([3, 4, 5, 6, 7]))  # all in the first program now
    c = launcher.exact_tables(idx, shape, idx.device)
    starts = torch.arange(shape.programs + 1, dtype=torch.int64) * shape.span
    assert torch.equal(c[1], torch.searchsorted(idx, starts))
    assert c[1] is not a[1]


def test_by_identity_keeps_a_value_while_its_object_lives():
    """The launcher's table caches: found by the object itself (not an equal one), replaced
    when set again, gone when the object is freed, never found by a later object at its address."""
    import gc

    cache = triton_launch.ByIdentity()
    a, b = torch.zeros(3), torch.zeros(3)
    cache[a] = "first"
    assert cache.get(a) == "first" and cache.get(b) is None and len(cache) == 1
    cache[a] = "again"
    assert cache.get(a) == "again" and len(cache) == 1
    cache[b] = "b"
    del a
    gc.collect()
    assert len(cache) == 1 and cache.get(b) == "b"
    for _ in range(100):  # fresh objects, some at freed addresses: none finds another's value
        c = torch.zeros(3)
        assert cache.get(c) is None
        cache[c] = "c"
        assert cache.get(c) == "c"
        del c
    gc.collect()
    assert len(cache) == 1


def test_runs_table_refuses_a_run_the_alignment_hint_would_misdescribe():
    """The kernels tell the compiler that every group run starts at a multiple of RUN_ALIGN
    elements (16-byte vectors); a table whose run does not is refused, never launched with a
    false hint. Every planned run passes (groups are multiples of 8)."""
    launcher = Launcher(KernelTuning(block_elems=64, exact_block_elems=64))
    plan = plan_gather(2 * 336, 2, zero_quantized_weights_format="int4", zero_quantized_weights_group_size=8,
                       exact_ranges=[(0, 3), (40, 100)], allgather_bucket_size=672)
    chunk = plan.chunks[0]
    runs = plan.group_runs(chunk)
    shape = launcher.shape(chunk.numel, 8, True)
    assert all(lo % triton_launch.RUN_ALIGN == 0 for row in runs.rows for lo, _, _ in row)
    launcher.runs_table(runs, shape, torch.device("cpu"))
    from qzero.layout.gather_plan import GroupRuns

    bad = GroupRuns(runs.numel, runs.group_size,
                    tuple(tuple((lo + 4 if lo else lo, hi, first) for lo, hi, first in row) for row in runs.rows),
                    runs.layouts, runs.payload_bytes)
    with pytest.raises(ValueError, match="not a multiple of 8"):
        launcher.runs_table(bad, shape, torch.device("cpu"))


def test_launch_tables_live_as_long_as_their_index():
    """The tables are keyed by the index and the group runs themselves, weakly: an entry goes
    when its index or runs go (nothing of it keeps them alive), and a new tensor at a recycled
    address never finds another one's table (the old tables were keyed by ``id()``)."""
    import gc
    import weakref

    launcher = Launcher(KernelTuning(block_elems=64, exact_block_elems=64))
    plan = plan_gather(2 * 300, 2, zero_quantized_weights_format="int8", zero_quantized_weights_group_size=8,
                       exact_ranges=[(0, 3), (40, 100)], allgather_bucket_size=600)
    chunk = plan.chunks[0]
    runs = plan.group_runs(chunk)
    assert runs is not None
    shape = launcher.shape(chunk.numel, 8, True)
    idx = torch.arange(40, 100, dtype=torch.int32)  # converted: the entry holds the int64 copy, not the key
    launcher.exact_tables(idx, shape, idx.device)
    launcher.runs_table(runs, shape, idx.device)
    assert len(launcher._exact) == 1 and len(launcher._runs) == 1
    gone_idx, gone_runs = weakref.ref(idx), weakref.ref(runs)
    del idx, runs, plan, chunk
    gc.collect()
    assert gone_idx() is None and gone_runs() is None
    assert len(launcher._exact) == 0 and len(launcher._runs) == 0
    for _ in range(50):  # fresh tensors, some at recycled addresses: each gets its own tables
        other = torch.tensor([7, 8, 9], dtype=torch.int64)
        got = launcher.exact_tables(other, shape, other.device)[1]
        starts = torch.arange(shape.programs + 1, dtype=torch.int64) * shape.span
        assert torch.equal(got, torch.searchsorted(other, starts))
        del other


@cpu_only
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_all_ranks_unpack_is_the_per_rank_unpack(fmt, dtype, tile):
    """One launch over every source rank's payload (and one scatter of all their exact
    elements), Triton and reference, writes the bits the per-rank unpack writes, with world
    3, a short last chunk, exact elements on every rank, and poisoned flat buffers."""
    check_all_ranks_unpack(fmt, dtype, "cpu", 64 * 7 + 40, tile)


@gpu_only
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_all_ranks_unpack_and_fast_launch(fmt):
    """The same on the GPU, at a size with many programs per rank; every launch after the
    first of a specialization goes through the compiled kernel (the cache fills)."""
    kernels = TritonKernels()  # a fresh launcher: nothing compiled yet
    check_all_ranks_unpack(fmt, torch.bfloat16, "cuda", (1 << 18) + 40, kernels)
    check_all_ranks_unpack(fmt, torch.bfloat16, "cuda", (1 << 18) + 40, kernels)  # now all through compiled kernels
    for k in (triton_weights._unpack_ranks_kernel, triton_weights._copy_indexed_kernel):
        assert kernels.launcher.compiled(k), k


def check_all_ranks_unpack(fmt, dtype, device, per_rank, kernels):
    from qzero.wire.chunks import exact_index, exact_scatter, slot

    world, gs = 3, 64
    numel = world * per_rank  # a short group at the end of every partition
    exact = [(0, 10), (60, 200), (470, 520), (700, 701), (numel - 30, numel)]
    plan = plan_gather(numel, world, zero_quantized_weights_format=fmt, zero_quantized_weights_group_size=gs,
                       exact_ranges=exact,
                       allgather_bucket_size=world * (per_rank // 3 // gs * gs))
    assert len(plan.chunks) >= 3
    # rank 0's first chunk has exact groups (its own group runs), the last ones do not
    assert plan.chunks[0].kind is PayloadKind.PER_RANK and plan.chunks[-2].kind is PayloadKind.SHARED
    gen = torch.Generator().manual_seed(11)
    truth = weights(numel, dtype, gen, device)
    p = plan.partition_numel
    dev = torch.device(device)
    for chunk in plan.chunks:
        buf = torch.zeros(world * chunk.payload_bytes, dtype=torch.uint8, device=device)
        for r in range(world):
            src = truth[r * p + chunk.offset : r * p + chunk.offset + chunk.numel]
            reference.pack_payload(src, slot(plan, chunk, r, buf), plan.payload_of(chunk, r), gs, fmt,
                                   exact_index(plan, chunk, r, dev), plan.group_runs(chunk, r))
        poisoned = poison(numel * 2, gen, device).view(dtype)
        want = poisoned.clone()
        for r in range(world):
            dst = want[r * p + chunk.offset : r * p + chunk.offset + chunk.numel]
            reference.unpack_payload(slot(plan, chunk, r, buf), dst, plan.payload_of(chunk, r), gs, fmt,
                                     exact_index(plan, chunk, r, dev), plan.group_runs(chunk, r))
        pair = exact_scatter(plan, chunk, dev)
        assert pair[0].numel() == sum(exact_index(plan, chunk, r, dev).numel() for r in range(world))
        for impl in (REFERENCE_KERNELS, kernels):
            got = poisoned.clone()
            impl.unpack_payloads(buf, got, p, chunk.offset, chunk.numel, world, chunk.payload, gs, fmt, pair,
                                 plan.group_runs(chunk))
            bad = (got.view(torch.int16) != want.view(torch.int16)).nonzero().flatten()
            assert bad.numel() == 0, f"{impl.name} chunk {chunk.index}: {bad.numel()} differ, first {bad[:8].tolist()}"


class _FakeCompiled:
    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, stream=None: self.calls.append((grid, args, stream))


class _FakeKernel:
    """Stands for a JITFunction: its launch returns a compiled kernel that records launches."""

    arg_names = ["x_ptr", "n", "A", "B"]

    def __init__(self):
        self.jit_calls = []
        self.compiled = _FakeCompiled()

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.jit_calls.append((grid, args, kwargs))
            return self.compiled

        return run


FAKE_DRIVER = (lambda: 0, lambda device: 777)  # (current device, its current stream)


def test_fast_launch_reuses_the_compiled_kernel_only_for_the_same_specialization():
    """The second launch with the same constexprs, options, pointer types and alignments
    goes to the compiled kernel (addresses, constexprs positionally, the current stream);
    a new alignment, integer class, constexpr or option goes through Triton's launch."""
    launcher = Launcher(interpret=False, driver=FAKE_DRIVER)
    k = _FakeKernel()
    x = torch.zeros(64, dtype=torch.int16)
    base = x.data_ptr()
    aligned = 0 if base % 16 == 0 else (16 - base % 16) // 2  # element offset of a 16-byte address
    at = At(x, 2 * aligned, 32, torch.int16)

    def launch(ptr, n, a=1, b=2.0, warps=4, via=launcher):
        via.launch(k, (3,), (ptr, n), dict(A=a, B=b), dict(num_warps=warps))

    launch(at, 32)
    assert len(k.jit_calls) == 1 and isinstance(k.jit_calls[0][1][0], torch.Tensor)
    assert k.jit_calls[0][0] == (3, 1, 1) and k.jit_calls[0][2] == dict(A=1, B=2.0, num_warps=4)
    launch(at, 48)  # another multiple of 16: same specialization
    assert len(k.jit_calls) == 1
    assert k.compiled.calls == [((3, 1, 1), (at.address(), 48, 1, 2.0), 777)]
    for args in [
        dict(ptr=At(x, 2 * aligned + 2, 32, torch.int16), n=32),  # address no longer 16-byte aligned
        dict(ptr=At(x, 2 * aligned, 32, torch.uint8), n=32),  # another pointer type
        dict(ptr=at, n=33),  # not a multiple of 16
        dict(ptr=at, n=1),  # the value 1
        dict(ptr=at, n=2**31 + 16),  # 64-bit
        dict(ptr=at, n=32, a=2),  # another constexpr
        dict(ptr=at, n=32, warps=8),  # another option
    ]:
        before = len(k.jit_calls)
        launch(**args)
        assert len(k.jit_calls) == before + 1, args
        launch(**args)
        assert len(k.jit_calls) == before + 1, args  # now cached too
    for other in (Launcher(interpret=True, driver=FAKE_DRIVER),  # the interpreter: always Triton's own launch
                  Launcher(KernelTuning(fast_launch=False), interpret=False, driver=FAKE_DRIVER)):
        before = len(k.jit_calls)
        launch(at, 32, via=other)
        launch(at, 32, via=other)
        assert len(k.jit_calls) == before + 2 and not other.compiled(k)


def test_fast_launch_is_not_used_when_constexprs_are_out_of_order():
    launcher = Launcher(interpret=False, driver=FAKE_DRIVER)
    k = _FakeKernel()
    x = torch.zeros(64, dtype=torch.int16)
    for _ in range(2):
        launcher.launch(k, (1,), (x, 32), dict(B=2.0, A=1), {})
    assert len(k.jit_calls) == 2 and not k.compiled.calls


@cpu_only
def test_launchers_pass_constexprs_in_kernel_order():
    """Every weight launcher can use the compiled kernel's launch: its runtime arguments come
    first and its constexprs follow in the kernel's order."""
    from _support.kernel_checks import checking_kernels
    from qzero.wire.chunks import exact_scatter

    kernels = checking_kernels()
    gen = torch.Generator().manual_seed(5)
    plan = plan_gather(2 * 256, 2, zero_quantized_weights_format="int8", zero_quantized_weights_group_size=64,
                       exact_ranges=[(3, 9), (300, 310)], allgather_bucket_size=512)
    chunk = plan.chunks[0]
    flat = weights(512, torch.bfloat16, gen)
    buf = torch.zeros(2 * chunk.payload_bytes, dtype=torch.uint8)
    idx = torch.tensor([3, 4, 5, 6, 7, 8])
    kernels.pack_payload(flat[:256], buf[: chunk.payload_bytes], chunk.payload, 64, "int8", idx)
    kernels.pack_payload(flat[256:], buf[chunk.payload_bytes :], chunk.payload, 64, "int8", torch.arange(44, 54))
    kernels.unpack_payload(buf[: chunk.payload_bytes], flat[:256].clone(), chunk.payload, 64, "int8", idx)
    kernels.unpack_payloads(buf, flat.clone(), 256, 0, 256, 2, chunk.payload, 64, "int8",
                            exact_scatter(plan, chunk, flat.device))
    tw = triton_weights
    assert kernels.launcher.seen == {tw._pack_kernel, tw._unpack_ranks_kernel, tw._copy_indexed_kernel}
