"""The quantization arithmetic emulated in float64 with every fp32 rounding written out.

An independent model of :mod:`qzero.quant.reference`, sharing none of its code: numpy
float64, with an explicit rounding to fp32 after each step of the specification. float64
holds every product of two fp32 values exactly, and a quotient rounded to float64 then to
fp32 is the correctly rounded fp32 quotient (53 >= 2 * 24 + 2 bits), so each ``f32(...)``
below is exactly the correctly rounded fp32 operation.

Per group: ``scale = max(f32(absmax / qmax), FLT_MIN)``, ``inv = f32(1 / scale)``,
``y = f32(x * inv)``, then int8/int4: round half to even, clamp; fp8: clamp, round to e4m3.
``divide=True`` gives the former definition ``y = f32(x / scale)`` instead, so a test can
check that its data tells the two apart.
"""

from __future__ import annotations

import numpy as np
import torch

FLT_MIN = 2.0**-126
QMAX = {"int8": 127.0, "int4": 7.0, "fp8": 448.0}


def f32(a) -> np.ndarray:
    """Round float64 values to the nearest fp32 (ties to even), returned as float64."""
    return np.asarray(a, np.float64).astype(np.float32).astype(np.float64)


def quantize_fp64(x: torch.Tensor, group_size: int, fmt: str = "int8", exact: np.ndarray | None = None,
                  divide: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``(codes, scales)``: the quantized value of every element as float64 (an integer, or an
    e4m3 value) and the fp32 scales. ``exact`` (bool mask or indices) are zeroed first."""
    qmax = QMAX[fmt]
    v = x.float().numpy().astype(np.float64)  # bf16/fp16 -> float64 is exact
    if exact is not None:
        v[exact] = 0.0
    n = v.size
    groups = -(-n // group_size)
    g = np.zeros(groups * group_size)
    g[:n] = v
    g = g.reshape(groups, group_size)
    scale = np.maximum(f32(np.abs(g).max(axis=1) / qmax), FLT_MIN)
    if divide:
        y = f32(g / scale[:, None])
    else:
        inv = f32(1.0 / scale)
        y = f32(g * inv[:, None])
    y = np.clip(y, -qmax, qmax)
    if fmt == "fp8":
        # e4m3, round to nearest even: torch's cast defines it (exact from fp32 values).
        q = torch.from_numpy(y.astype(np.float32)).to(torch.float8_e4m3fn).to(torch.float64).numpy()
    else:
        q = np.rint(y)  # half to even; already within [-qmax, qmax]
    return q.reshape(-1)[:n], scale.astype(np.float32)


def value_bytes(codes: np.ndarray, fmt: str) -> np.ndarray:
    """The payload's value bytes for ``codes`` from :func:`quantize_fp64`."""
    if fmt == "fp8":
        return torch.from_numpy(codes.astype(np.float32)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    q = codes.astype(np.int64)
    if fmt == "int8":
        return (q & 0xFF).astype(np.uint8)
    if q.size % 2:
        q = np.append(q, 0)
    return ((q[0::2] & 0xF) | ((q[1::2] & 0xF) << 4)).astype(np.uint8)


def random_groups(rng: np.random.Generator, groups: int, group_size: int, dtype: torch.dtype,
                  tail: int = 0) -> torch.Tensor:
    """``groups`` whole groups (plus a short ``tail``), each at its own magnitude over the
    dtype's range; for bf16 a quarter of them have absmax near FLT_MIN (below ``qmax * FLT_MIN``,
    where the scale is floored, and just above), subnormals included; some groups are all zero."""
    n = groups * group_size + tail
    per_group = -(-n // group_size)
    if dtype == torch.bfloat16:
        exps = rng.uniform(-36, 36, per_group)
        tiny = rng.random(per_group) < 0.25
        exps[tiny] = rng.uniform(-40.5, -34.5, int(tiny.sum()))
    else:  # fp16: normals from 6e-5, subnormals down to 6e-8, max 65504
        exps = rng.uniform(-7.5, 3.8, per_group)
    mags = np.repeat(10.0**exps, group_size)[:n]
    x = rng.standard_normal(n) * mags
    if dtype == torch.float16:
        x = np.clip(x, -65504.0, 65504.0)
    zero = np.repeat(rng.random(per_group) < 0.02, group_size)[:n]
    x[zero] = 0.0
    return torch.from_numpy(x).to(torch.float32).to(dtype)


def random_exact(rng: np.random.Generator, n: int) -> torch.Tensor:
    """Sorted unique exact indices: ~1% singles and one run across a group boundary."""
    picks = set(rng.integers(0, n, max(1, n // 100)).tolist())
    start = int(rng.integers(0, max(1, n - 100)))
    picks |= set(range(start, min(n, start + 100)))
    return torch.tensor(sorted(picks), dtype=torch.int64)


def delta_step_fp64(target: torch.Tensor, replica: torch.Tensor, group_size: int, fmt: str,
                    exact: np.ndarray | None = None) -> tuple[torch.Tensor, np.ndarray]:
    """One step of the delta loop ([Note: delta payload]) for one payload, in float64 with
    every fp32 rounding written out: ``(new replica, scales)``. ``t = RN(target)`` in the
    replica's dtype (torch's cast defines it); ``d = f32(t - r)``; codes and scales of ``d``
    as :func:`quantize_fp64` (exact elements zeroed); ``r' = RN(f32(r + f32(q * scale)))``;
    a group holding a non-finite ``d`` keeps its elements (scale NaN); exact elements become ``t``."""
    dtype = replica.dtype
    t = target.to(dtype)
    t64, r64 = t.double().numpy(), replica.double().numpy()
    with np.errstate(invalid="ignore", over="ignore"):
        d = f32(t64 - r64)
    if exact is not None:
        d[exact] = 0.0
    n = d.size
    groups = -(-n // group_size)
    padded = np.zeros(groups * group_size)
    padded[:n] = d
    finite = np.isfinite(padded).reshape(groups, group_size).all(axis=1)
    padded[~np.repeat(finite, group_size)] = 0.0
    codes, scales = quantize_fp64(torch.from_numpy(padded[:n]), group_size, fmt)
    codes = codes + 0.0  # stored as integers: a code is never -0 (so -0 + 0 * scale is +0)
    scales = np.where(finite, scales.astype(np.float64), np.nan).astype(np.float32)
    step = f32(codes * np.repeat(scales.astype(np.float64), group_size)[:n])
    new = torch.from_numpy(f32(r64 + step).astype(np.float32)).to(dtype)
    keep = torch.from_numpy(~np.repeat(finite, group_size)[:n])
    new = torch.where(keep, replica, new)
    if exact is not None:
        new[torch.as_tensor(exact)] = t[torch.as_tensor(exact)]
    return new, scales
