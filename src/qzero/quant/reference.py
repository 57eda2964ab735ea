"""The torch reference quantizer: this code *is* the specification.

Every GPU kernel must produce the same bytes as these functions on the same input.
The arithmetic, step by step, for one group of ``group_size`` consecutive elements:

1. Widen to fp32. Exact elements (small parameters) are set to 0 *before* the
   scale is computed, so they never widen their group's scale.
2. ``scale = max(absmax / qmax, FLT_MIN)`` with a correctly rounded fp32 division,
   then the group's reciprocal ``inv = 1 / scale``, also a correctly rounded fp32
   division, once per group. The floor keeps the scale a normal fp32 number (an
   all-zero group gets the harmless scale ``2**-126``) and the reciprocal finite
   (at most ``2**126``).
3. ``y = x * inv`` (one correctly rounded fp32 multiplication, nothing fused into it;
   this is the definition, not an approximation of ``x / scale``: the two differ in
   the last bit of ``y`` for some inputs, and that can change a stored value), then
   per format:
   int8: round half to even, clamp to [-127, 127];
   int4: the same with [-7, 7], two values per byte, element ``2i`` in the low nibble;
   fp8:  clamp to [-448, 448], cast to e4m3 (round to nearest even).
4. Dequantization is ``value * scale`` in fp32, then one rounding to the output dtype.

A partition's last group may be short; it is treated as if zero-padded.

Payloads (:func:`pack_payload`): the values and scales of a slice, then its exact
elements verbatim (the side channel). Where the plan says that some groups of the slice
are *exact groups* (group runs, see ``[Note: exact groups]`` in :mod:`qzero.layout`),
those groups send no values and no scales (all their elements are in the side channel):
the payload's values and scales are those of the coded groups only, in slice order,
which are exactly the codes that quantizing the whole slice gives them.
"""

from __future__ import annotations

import torch

from .formats import SCALE_BYTES, QuantFormat, get_format

FLT_MIN = torch.finfo(torch.float32).tiny  # 2**-126, the smallest normal fp32


def num_groups(numel: int, group_size: int) -> int:
    return -(-numel // group_size)


def group_scales(x32: torch.Tensor, group_size: int, fmt: QuantFormat) -> torch.Tensor:
    """fp32 scales of ``x32`` (fp32, 1-D, exact elements already zeroed)."""
    n = x32.numel()
    groups = num_groups(n, group_size)
    padded = torch.nn.functional.pad(x32, (0, groups * group_size - n))
    absmax = padded.view(groups, group_size).abs().amax(dim=1)
    # A tensor divisor, not a Python number: on CUDA, torch divides by a scalar as a
    # multiplication by its rounded reciprocal, which is not correctly rounded.
    return torch.clamp_min(absmax / torch.full_like(absmax, fmt.qmax), FLT_MIN)


def quantize(
    x: torch.Tensor,
    group_size: int = 64,
    fmt: str = "int8",
    exact_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 1-D tensor group-wise.

    Returns ``(values, scales)``: ``values`` is a uint8 byte tensor of
    ``fmt.value_bytes(x.numel())`` bytes (int8 and fp8 bit patterns, or packed
    int4), ``scales`` is fp32 with one entry per group. Elements listed in
    ``exact_index`` are quantized as zeros and do not affect any scale.
    """
    f = get_format(fmt)
    x32 = x.to(torch.float32).flatten()
    if exact_index is not None and exact_index.numel():
        x32 = x32.index_fill(0, exact_index, 0.0)
    n = x32.numel()
    scales = group_scales(x32, group_size, f)
    groups = scales.numel()
    y = torch.nn.functional.pad(x32, (0, groups * group_size - n)).view(groups, group_size)
    # A tensor divisor again (see group_scales), then a plain multiplication per element.
    inv = torch.ones_like(scales) / scales
    y = (y * inv[:, None]).flatten()[:n]
    # |y| may exceed qmax by a few ulps: clamp (for the integers, after rounding).
    if f.name == "fp8":
        values = y.clamp(-f.qmax, f.qmax).to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        q = torch.round(y).clamp_(-f.qmax, f.qmax).to(torch.int8)
        values = q.view(torch.uint8) if f.bits == 8 else _pack_int4(q)
    return values, scales


def dequantize(
    values: torch.Tensor,
    scales: torch.Tensor,
    numel: int,
    group_size: int = 64,
    fmt: str = "int8",
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Inverse of :func:`quantize` (exact elements come back as zeros)."""
    f = get_format(fmt)
    if f.name == "fp8":
        q = values[:numel].view(torch.float8_e4m3fn).to(torch.float32)
    elif f.bits == 8:
        q = values[:numel].view(torch.int8).to(torch.float32)
    else:
        q = _unpack_int4(values, numel).to(torch.float32)
    groups = scales.numel()
    q = torch.nn.functional.pad(q, (0, groups * group_size - numel)).view(groups, group_size)
    return (q * scales[:, None]).flatten()[:numel].to(dtype)


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    if q.numel() % 2:
        q = torch.nn.functional.pad(q, (0, 1))
    nib = q.to(torch.int16) & 0xF
    return (nib[0::2] | (nib[1::2] << 4)).to(torch.uint8)


def _unpack_int4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    b = packed[: (numel + 1) // 2].to(torch.int16)
    pair = torch.stack((b & 0xF, b >> 4), dim=1).flatten()[:numel]
    return torch.where(pair >= 8, pair - 16, pair).to(torch.int8)


# --------------------------------------------------------------------------- payload


def coded_parts(runs, row: int = 0) -> list[tuple[int, int]]:
    """``(lo, hi)`` of the coded runs of payload ``row`` of :class:`qzero.layout.GroupRuns`, in order."""
    return [(lo, hi) for lo, hi, first in runs.rows[row] if first >= 0]


def pack_payload(
    src: torch.Tensor,
    out: torch.Tensor,
    layout,
    group_size: int,
    fmt: str,
    exact_index: torch.Tensor | None,
    runs=None,
) -> None:
    """Write one rank's chunk payload into the byte buffer ``out``.

    ``layout`` is a :class:`qzero.layout.PayloadLayout`; ``src`` is the rank's
    slice of the chunk (bf16/fp16). Exact elements (``exact_index``, sorted: the slice's
    side elements) are copied aside verbatim into the side channel, in index order.
    ``runs`` (:class:`qzero.layout.GroupRuns`, one row) names the exact groups, whose values
    and scales are left out; None: every group is coded.
    """
    if runs is None:
        values, scales = quantize(src, group_size, fmt, exact_index)
    else:
        # The coded groups alone, side elements zeroed: whole groups but possibly the slice's
        # last, so they are quantized exactly as inside the whole slice.
        x32 = src.to(torch.float32)
        if exact_index is not None and exact_index.numel():
            x32 = x32.index_fill(0, exact_index, 0.0)
        parts = [x32[lo:hi] for lo, hi in coded_parts(runs)]
        values, scales = quantize(torch.cat(parts) if parts else x32[:0], group_size, fmt)
    out[layout.values_offset : layout.values_offset + values.numel()].copy_(values)
    out[layout.scales_offset : layout.scales_offset + scales.numel() * SCALE_BYTES].view(torch.float32).copy_(scales)
    if exact_index is not None and exact_index.numel():
        side = out[layout.exact_offset : layout.exact_offset + exact_index.numel() * src.element_size()]
        side.view(src.dtype).copy_(src[exact_index])


def unpack_payload(
    payload: torch.Tensor,
    dst: torch.Tensor,
    layout,
    group_size: int,
    fmt: str,
    exact_index: torch.Tensor | None,
    runs=None,
) -> None:
    """Dequantize one source rank's payload into ``dst`` and restore its exact elements
    (``runs`` as in :func:`pack_payload`)."""
    _dequantize_coded(payload, dst, layout, group_size, fmt, runs, 0)
    if exact_index is not None and exact_index.numel():
        side = payload[layout.exact_offset : layout.exact_offset + exact_index.numel() * dst.element_size()]
        dst.index_copy_(0, exact_index, side.view(dst.dtype))


def _dequantize_coded(payload, dst, layout, group_size: int, fmt: str, runs, row: int) -> None:
    """Write the dequantized coded groups of one payload into ``dst`` (its slice); with
    ``runs``, the exact groups' elements are left as they are (the side channel has them)."""
    n = dst.numel() if runs is None else runs.coded_numel(row)
    f = get_format(fmt)
    values = payload[layout.values_offset : layout.values_offset + f.value_bytes(n)]
    groups = num_groups(n, group_size)
    scales = payload[layout.scales_offset : layout.scales_offset + groups * SCALE_BYTES].view(torch.float32)
    out = dequantize(values, scales, n, group_size, fmt, dst.dtype)
    if runs is None:
        dst.copy_(out)
        return
    pos = 0
    for lo, hi in coded_parts(runs, row):
        dst[lo:hi].copy_(out[pos : pos + hi - lo])
        pos += hi - lo


def unpack_payloads(
    buf: torch.Tensor,
    flat: torch.Tensor,
    partition_numel: int,
    offset: int,
    numel: int,
    world: int,
    layout,
    group_size: int,
    fmt: str,
    exact: tuple[torch.Tensor, torch.Tensor] | None,
    runs=None,
) -> None:
    """Every source rank's payload of one chunk at once: rank ``r``'s, at byte
    ``r * layout.nbytes`` of ``buf``, into ``flat[r * partition_numel + offset :][:numel]``.

    The same result as :func:`unpack_payload` rank by rank (the same ``value * scale`` per
    element, rank by rank as rows of one tensor). ``exact`` is ``(src, dst)``: every rank's
    side elements as positions in ``buf`` and in ``flat``, in units of ``flat``'s element
    (:func:`raw_bits`). ``runs`` (:class:`qzero.layout.GroupRuns`, a row per rank): each
    rank's payload has its own layout and group runs, ``runs.payload_bytes`` apart
    (``layout`` is then unused); None: every rank's is ``layout``, every group coded."""
    n, w = numel, world
    if n == 0:
        return
    if runs is not None:
        pb = runs.payload_bytes
        for r in range(w):
            _dequantize_coded(buf[r * pb : (r + 1) * pb], flat[r * partition_numel + offset :][:n], runs.layouts[r],
                              group_size, fmt, runs, r)
        _scatter_exact(buf[: w * pb], flat, exact)
        return
    pb = layout.nbytes
    f = get_format(fmt)
    rows = buf[: w * pb].view(w, pb)
    groups = num_groups(n, group_size)
    scales = rows[:, layout.scales_offset : layout.scales_offset + groups * SCALE_BYTES].view(torch.float32)
    values = rows[:, layout.values_offset : layout.values_offset + f.value_bytes(n)]
    if f.name == "fp8":
        q = values.view(torch.float8_e4m3fn).to(torch.float32)
    elif f.bits == 8:
        q = values.view(torch.int8).to(torch.float32)
    else:
        b = values.to(torch.int16)
        pair = torch.stack((b & 0xF, b >> 4), dim=2).reshape(w, -1)[:, :n]
        q = torch.where(pair >= 8, pair - 16, pair).to(torch.float32)
    q = torch.nn.functional.pad(q, (0, groups * group_size - n)).view(w, groups, group_size)
    out = (q * scales[:, :, None]).reshape(w, groups * group_size)[:, :n].to(flat.dtype)
    flat.view(w, partition_numel)[:, offset : offset + n].copy_(out)
    _scatter_exact(buf[: w * pb], flat, exact)


def _scatter_exact(buf: torch.Tensor, flat: torch.Tensor, exact) -> None:
    if exact is not None and exact[0].numel():
        src, dst = exact
        bits = raw_bits(flat.dtype)
        flat.view(bits).index_copy_(0, dst, buf.view(bits)[src])


def raw_bits(dtype: torch.dtype) -> torch.dtype:
    """The integer type of ``dtype``'s width: exact elements are copied as raw bits."""
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[torch.empty(0, dtype=dtype).element_size()]
