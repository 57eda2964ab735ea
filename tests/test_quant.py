"""The reference quantizer against an independent numpy model, and its error bounds."""

import numpy as np
import pytest
import torch

from _support import fp64_model
from qzero.quant import check_group_size, dequantize, get_format, quantize
from qzero.quant.reference import FLT_MIN

DTYPES = [torch.bfloat16, torch.float16]


def numpy_int8_roundtrip(x: torch.Tensor, group_size: int, exact: np.ndarray | None = None):
    """Independent model of the spec: numpy float32 arithmetic, one group at a time."""
    v = x.float().numpy().astype(np.float32).copy()
    if exact is not None:
        v[exact] = 0
    n = v.size
    out = np.empty(n, np.float32)
    scales = []
    for g0 in range(0, n, group_size):
        g = v[g0 : g0 + group_size]
        scale = max(np.float32(np.abs(g).max()) / np.float32(127), np.float32(FLT_MIN))
        scale = np.float32(scale)
        inv = np.float32(1) / scale  # the group's reciprocal, then one multiplication per element
        q = np.clip(np.rint(g * inv), -127, 127).astype(np.int8)  # via int8: no -0.0
        out[g0 : g0 + group_size] = (q.astype(np.float32) * scale).astype(np.float32)
        scales.append(scale)
    return torch.from_numpy(out).to(x.dtype), np.array(scales, np.float32)


def roundtrip(x, group_size=64, fmt="int8", exact_index=None):
    values, scales = quantize(x, group_size, fmt, exact_index)
    return dequantize(values, scales, x.numel(), group_size, fmt, x.dtype), scales


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [8, 64, 136])
def test_int8_matches_independent_model(dtype, group_size):
    g = torch.Generator().manual_seed(1000 + group_size)
    n = 37 * group_size + 5  # a short last group
    x = (torch.randn(n, generator=g) * torch.logspace(-3, 2, n)).to(dtype)
    got, scales = roundtrip(x, group_size)
    want, want_scales = numpy_int8_roundtrip(x, group_size)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert np.array_equal(scales.numpy(), want_scales)


def test_round_half_to_even():
    # absmax 127 -> scale exactly 1.0, so y = x and ties are visible.
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5] + [0.0] * 56, dtype=torch.float16)
    values, scales = quantize(x, 64)
    assert scales.tolist() == [1.0]
    assert values.view(torch.int8)[:8].tolist() == [127, 0, 2, 2, 0, -2, -2, 4]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4"])
def test_error_bound(dtype, fmt):
    """Each element is within half a step of its group (fp8: half an e4m3 ulp), plus output rounding."""
    g = torch.Generator().manual_seed(7)
    big = 5e3 if dtype == torch.float16 else 1e30
    small = 1e-3 if dtype == torch.float16 else 1e-30
    parts = [torch.randn(64 * 50, generator=g) * s for s in (1.0, big, small, 1e-2)]
    x = torch.cat(parts).to(dtype)
    got, scales = roundtrip(x, 64, fmt)
    xf, gf = x.float(), got.float()
    s = scales.repeat_interleave(64)[: x.numel()]
    if fmt == "fp8":
        # e4m3 has 3 mantissa bits: relative half-ulp 2**-4 of |y|, and 2**-10 absolute below its normals.
        step = torch.maximum((xf / s).abs() * 2.0**-4, torch.full_like(s, 2.0**-10)) * s
    else:
        step = 0.5 * s
    out_ulp = xf.abs() * torch.finfo(dtype).eps + torch.finfo(dtype).smallest_normal
    assert torch.all((gf - xf).abs() <= step * (1 + 1e-6) + out_ulp)
    assert torch.all(torch.isfinite(gf))


def test_all_zero_group_has_harmless_scale():
    x = torch.zeros(128, dtype=torch.bfloat16)
    x[64:] = torch.randn(64).bfloat16()
    got, scales = roundtrip(x)
    assert scales[0].item() == FLT_MIN and scales[1].item() > 0
    assert torch.all(got[:64] == 0)


def test_exact_elements_do_not_widen_scales():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(256, generator=g).bfloat16()
    exact = torch.tensor([5, 70, 71, 200])
    x[exact] = torch.tensor([1e6, -1e6, 3e5, 1e4]).bfloat16()
    values, scales = quantize(x, 64, "int8", exact)
    masked = x.clone()
    masked[exact] = 0
    _, clean_scales = quantize(masked, 64, "int8")
    assert torch.equal(scales, clean_scales)
    assert torch.all(values.view(torch.int8)[exact] == 0)


def test_int4_packs_two_per_byte():
    x = torch.randn(64 * 3 + 8).bfloat16()
    values, scales = quantize(x, 64, "int4")
    assert values.numel() == (x.numel() + 1) // 2
    # independent unpack: low nibble is the even element
    inv = (torch.ones_like(scales) / scales).repeat_interleave(64)[: x.numel()]
    q = torch.round(x.float() * inv).clamp(-7, 7).to(torch.int64)
    lo = values.to(torch.int64) & 0xF
    assert torch.equal(lo, q[0::2] & 0xF)


def test_group_size_rules():
    assert check_group_size(64) == 64
    for bad in (0, -8, 12, 7.0, True, "64"):
        with pytest.raises(ValueError, match="group_size"):
            check_group_size(bad)
    with pytest.raises(ValueError, match="'int3'"):
        get_format("int3")


# --------------------------------------------------------------------------- the definition, pinned

def _fresh_rng():
    """A new seed every run (reported on failure, to replay it)."""
    seed = int(np.random.SeedSequence().entropy) % 2**63
    return seed, np.random.default_rng(seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("group_size", [64, 136])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantize_is_multiply_by_correctly_rounded_reciprocal(fmt, group_size, dtype):
    """Fresh random groups at many magnitudes (absmax near FLT_MIN included), exact elements
    masked, against the float64 model with every fp32 rounding written out:
    inv = f32(1 / scale), y = f32(x * inv), round half to even, clamp. Byte for byte."""
    seed, rng = _fresh_rng()
    n_groups = (1 << 21) // group_size
    x = fp64_model.random_groups(rng, n_groups, group_size, dtype, tail=group_size // 2 + 3)
    exact = fp64_model.random_exact(rng, x.numel())
    values, scales = quantize(x, group_size, fmt, exact)
    codes, want_scales = fp64_model.quantize_fp64(x, group_size, fmt, exact.numpy())
    assert np.array_equal(scales.numpy().view(np.uint32), want_scales.view(np.uint32)), f"seed {seed}"
    want = fp64_model.value_bytes(codes, fmt)
    bad = np.flatnonzero(values.numpy() != want)
    assert bad.size == 0, f"seed {seed}: {bad.size} bytes differ, first at {bad[:8].tolist()}"
    # The data tells the definition apart from a correctly rounded x / scale.
    divided, _ = fp64_model.quantize_fp64(x, group_size, fmt, exact.numpy(), divide=True)
    assert np.count_nonzero(divided != codes) > 0, f"seed {seed}: no input where x * inv and x / scale differ"


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_error_bound_of_multiply_by_reciprocal(fmt, dtype):
    """Dequantized in fp32: |x - deq| <= scale/2 + |x| * 2**-21, so <= scale/2 * (1 + 2**-12).

    y = x * inv is within |x/scale| * 2**-23 of x / scale (two fp32 roundings), so rounding
    it is off by at most 1/2 + that; times scale, plus the fp32 rounding of value * scale."""
    seed, rng = _fresh_rng()
    n = 64 * 4096
    x = fp64_model.random_groups(rng, 4096, 64, dtype)
    values, scales = quantize(x, 64, fmt)
    deq = dequantize(values, scales, n, 64, fmt, torch.float32).numpy().astype(np.float64)
    xf = x.float().numpy().astype(np.float64)
    s = np.repeat(scales.numpy().astype(np.float64), 64)
    err = np.abs(deq - xf)
    assert np.all(err <= 0.5 * s + np.abs(xf) * 2.0**-21), f"seed {seed}"
    assert np.all(err <= 0.5 * s * (1 + 2.0**-12)), f"seed {seed}"
