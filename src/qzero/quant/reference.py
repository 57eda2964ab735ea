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
are *exact groups* (group runs, see ``[Note: exact groups]`` in :mod:`qzero.layout.gather_plan`),
those groups send no values and no scales (all their elements are in the side channel):
the payload's values and scales are those of the coded groups only, in slice order,
which are exactly the codes that quantizing the whole slice gives them. The same holds
for delta payloads (below): the exact groups' elements carry ``t``'s bits.

[Note: delta payload]

With ``zero_quantized_weights_delta`` a payload carries the *difference* between the new
weights and the replica that every rank already holds, and every rank adds it to that
replica. For one rank's slice of a chunk, from its fp32 master slice ``m`` and the
replica slice ``r`` (bf16/fp16: the bits every rank holds for it):

1. The target is ``t = RN(m)``, ``m`` rounded to the replica's dtype (nearest even): the
   value a plain gather would send. The difference is ``d = fp32(t) - fp32(r)``, one
   correctly rounded fp32 subtraction.
2. ``d`` is quantized exactly as a weight is (steps 1-3 above, ``x = d``; int8 or int4),
   exact elements zeroed before the scales; the side channel carries ``t``'s bits.
   A group holding a non-finite ``d`` gets the scale NaN and all values 0.
3. Every rank, the owner included, applies it in place:
   ``r <- RN(fp32(r) + value * scale)``, the product and the sum each rounded to fp32
   (nothing fused), then one rounding to the replica's dtype. A group whose scale is not
   finite is left as it was, and reported (the refusal flag, an int64, becomes the smallest
   flat index of such a group's first element; :data:`NOT_REFUSED` while there is none);
   exact elements then take ``t``'s bits.

The next step's difference is taken against the replica so updated, so one step's
quantization error is carried into the next (a closed loop): after every step each
element of the replica is within one quantization step (its group's scale) of ``t``
(the sum is within half a step of ``t``, and rounding it moves it no further from ``t``
than ``t`` is).
"""

from __future__ import annotations

import torch

from .formats import DEFAULT_FORMAT, DEFAULT_GROUP_SIZE, SCALE_BYTES, QuantFormat, get_format

FLT_MIN = torch.finfo(torch.float32).tiny  # 2**-126, the smallest normal fp32
#: The refusal flag of delta payloads while no group has been refused ([Note: delta payload]).
NOT_REFUSED = 2**63 - 1


def refusal_flag(device) -> torch.Tensor:
    """A fresh refusal flag for :func:`unpack_delta_payloads` (int64, one element)."""
    return torch.full((1,), NOT_REFUSED, dtype=torch.int64, device=device)


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
    group_size: int = DEFAULT_GROUP_SIZE,
    fmt: str = DEFAULT_FORMAT,
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
    return _quantize32(x32, group_size, f)


def _quantize32(x32: torch.Tensor, group_size: int, f: QuantFormat, finite: torch.Tensor | None = None):
    """Steps 2-3 on fp32 ``x32`` (exact elements already zeroed). ``finite`` (delta payloads):
    per group, whether all its values are finite; the other groups get scale NaN, values 0."""
    n = x32.numel()
    scales = group_scales(x32, group_size, f)
    groups = scales.numel()
    y = torch.nn.functional.pad(x32, (0, groups * group_size - n)).view(groups, group_size)
    # A tensor divisor again (see group_scales), then a plain multiplication per element.
    inv = torch.ones_like(scales) / scales
    y = y * inv[:, None]
    if finite is not None:
        scales = torch.where(finite, scales, torch.full_like(scales, float("nan")))
        y = torch.where(finite[:, None], y, torch.zeros_like(y))
    y = y.flatten()[:n]
    # |y| may exceed qmax by a few ulps: clamp (for the integers, after rounding).
    if f.name == "fp8":
        values = y.clamp(-f.qmax, f.qmax).to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        q = torch.round(y).clamp_(-f.qmax, f.qmax).to(torch.int8)
        values = q.view(torch.uint8) if f.bits == 8 else _pack_int4(q)
    return values, scales


def delta_difference(target: torch.Tensor, replica: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d, t)``: the fp32 difference ``fp32(RN(target)) - fp32(replica)`` and the rounded
    target ``t`` in the replica's dtype (step 1 of [Note: delta payload])."""
    t = target.to(replica.dtype)
    return t.to(torch.float32) - replica.to(torch.float32), t


def quantize_delta(
    target: torch.Tensor,
    replica: torch.Tensor,
    group_size: int = 256,
    fmt: str = "int4",
    exact_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize the difference between fp32 ``target`` and the 16-bit ``replica`` (1-D, same
    length) group-wise: ``(values, scales, t)`` as :func:`quantize` returns them, and the
    rounded target ``t`` (whose exact elements the side channel carries)."""
    f = get_format(fmt)
    d, t = delta_difference(target.flatten(), replica.flatten())
    if exact_index is not None and exact_index.numel():
        d = d.index_fill(0, exact_index, 0.0)
    return (*_quantize_difference(d, group_size, f), t)


def _quantize_difference(d: torch.Tensor, group_size: int, f: QuantFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 2 of [Note: delta payload] on fp32 ``d`` (exact elements already zeroed)."""
    groups = num_groups(d.numel(), group_size)
    finite = torch.nn.functional.pad(torch.isfinite(d), (0, groups * group_size - d.numel()), value=True)
    return _quantize32(d, group_size, f, finite.view(groups, group_size).all(dim=1))


def apply_delta(
    replica: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, group_size: int = 256, fmt: str = "int4"
) -> bool:
    """Step 3 of [Note: delta payload] on one 1-D ``replica`` (16-bit, in place), exact
    elements aside. Returns whether every group's scale was finite (the others are left as they were)."""
    n = replica.numel()
    q = _codes(values.view(1, -1), n, get_format(fmt))
    return not bool(_add_codes(replica.view(1, n), q, scales.view(1, -1), group_size).any())


def _codes(values: torch.Tensor, n: int, f: QuantFormat) -> torch.Tensor:
    """fp32 values of the stored codes of ``values`` (one payload per row), ``n`` per row."""
    if f.name == "fp8":
        return values.view(torch.float8_e4m3fn).to(torch.float32)[:, :n]
    if f.bits == 8:
        return values.view(torch.int8).to(torch.float32)[:, :n]
    b = values.to(torch.int16)
    pair = torch.stack((b & 0xF, b >> 4), dim=2).reshape(values.shape[0], -1)[:, :n]
    return torch.where(pair >= 8, pair - 16, pair).to(torch.float32)


def _add_codes(dst: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """``dst <- RN(fp32(dst) + q * scale)`` row by row (``dst``: [rows, n], a view written in
    place); groups with a non-finite scale are left unchanged. Returns which groups those were
    (``[rows, groups]``, bool, on the device: no host synchronisation)."""
    rows, n = dst.shape
    groups = scales.shape[1]
    q = torch.nn.functional.pad(q, (0, groups * group_size - n)).view(rows, groups, group_size)
    step = (q * scales[:, :, None]).reshape(rows, groups * group_size)[:, :n]
    new = (dst.to(torch.float32) + step).to(dst.dtype)
    refused = ~torch.isfinite(scales)
    keep = refused[:, :, None].expand(rows, groups, group_size).reshape(rows, -1)[:, :n]
    dst.copy_(torch.where(keep, dst, new))
    return refused


def dequantize(
    values: torch.Tensor,
    scales: torch.Tensor,
    numel: int,
    group_size: int = DEFAULT_GROUP_SIZE,
    fmt: str = DEFAULT_FORMAT,
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


def _coded(x: torch.Tensor, runs, row: int = 0) -> torch.Tensor:
    """The elements of ``x`` (one slice) in its coded groups, back to back (all of ``x`` without runs)."""
    if runs is None:
        return x
    parts = [x[lo:hi] for lo, hi in coded_parts(runs, row)]
    return torch.cat(parts) if parts else x[:0]


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
    x32 = src.to(torch.float32).flatten()
    if exact_index is not None and exact_index.numel():
        x32 = x32.index_fill(0, exact_index, 0.0)
    # The coded groups alone: whole groups but possibly the slice's last, so they are
    # quantized exactly as inside the whole slice.
    values, scales = _quantize32(_coded(x32, runs), group_size, get_format(fmt))
    _write_payload(out, layout, values, scales, src, exact_index)


def _write_payload(out, layout, values, scales, exact_source: torch.Tensor, exact_index) -> None:
    """Values, scales and (from ``exact_source``) the side channel into the payload ``out``."""
    out[layout.values_offset : layout.values_offset + values.numel()].copy_(values)
    out[layout.scales_offset : layout.scales_offset + scales.numel() * SCALE_BYTES].view(torch.float32).copy_(scales)
    if exact_index is not None and exact_index.numel():
        side = out[layout.exact_offset : layout.exact_offset + exact_index.numel() * exact_source.element_size()]
        side.view(exact_source.dtype).copy_(exact_source[exact_index])


def pack_delta_payload(
    target: torch.Tensor,
    replica: torch.Tensor,
    out: torch.Tensor,
    layout,
    group_size: int,
    fmt: str,
    exact_index: torch.Tensor | None,
    runs=None,
) -> None:
    """Write one rank's delta payload of a chunk into ``out`` ([Note: delta payload]): the
    difference between its fp32 master slice ``target`` and its replica slice ``replica``
    (bf16/fp16, the bits every rank holds), quantized (``runs``: its coded groups only, as in
    :func:`pack_payload`); the side channel holds the rounded target of the exact elements.
    Temporaries are the chunk's size."""
    if runs is None:
        values, scales, t = quantize_delta(target, replica, group_size, fmt, exact_index)
    else:
        d, t = delta_difference(target.flatten(), replica.flatten())
        if exact_index is not None and exact_index.numel():
            d = d.index_fill(0, exact_index, 0.0)
        values, scales = _quantize_difference(_coded(d, runs), group_size, get_format(fmt))
    _write_payload(out, layout, values, scales, t, exact_index)


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
    (``runs`` as in :func:`pack_payload`: the exact groups' elements all come from the side channel)."""
    n = dst.numel() if runs is None else runs.coded_numel()
    f = get_format(fmt)
    values = payload[layout.values_offset : layout.values_offset + f.value_bytes(n)]
    groups = num_groups(n, group_size)
    scales = payload[layout.scales_offset : layout.scales_offset + groups * SCALE_BYTES].view(torch.float32)
    _put_coded(dst, dequantize(values, scales, n, group_size, fmt, dst.dtype), runs)
    if exact_index is not None and exact_index.numel():
        side = payload[layout.exact_offset : layout.exact_offset + exact_index.numel() * dst.element_size()]
        dst.index_copy_(0, exact_index, side.view(dst.dtype))


def _put_coded(dst: torch.Tensor, coded: torch.Tensor, runs, row: int = 0) -> None:
    """Write the values of the coded groups (back to back) into their places in ``dst`` (one
    slice); without runs ``coded`` is the whole slice."""
    if runs is None:
        dst.copy_(coded)
        return
    pos = 0
    for lo, hi in coded_parts(runs, row):
        dst[lo:hi].copy_(coded[pos : pos + hi - lo])
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
            unpack_payload(buf[r * pb : (r + 1) * pb], flat[r * partition_numel + offset :][:n], runs.layouts[r],
                           group_size, fmt, None, runs.row(r))
        _scatter_exact(buf[: w * pb], flat, exact)
        return
    values, scales = _sections(buf, layout, n, w, group_size, fmt)
    q = _codes(values, n, get_format(fmt))
    groups = scales.shape[1]
    q = torch.nn.functional.pad(q, (0, groups * group_size - n)).view(w, groups, group_size)
    out = (q * scales[:, :, None]).reshape(w, groups * group_size)[:, :n].to(flat.dtype)
    flat.view(w, partition_numel)[:, offset : offset + n].copy_(out)
    _scatter_exact(buf[: w * layout.nbytes], flat, exact)


def unpack_delta_payloads(
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
    refused: torch.Tensor,
    runs=None,
) -> None:
    """Every source rank's delta payload of one chunk, added into the replica ``flat`` in
    place (step 3 of [Note: delta payload]), then every rank's exact elements put back, as
    :func:`unpack_payloads` does (``runs`` as there). ``refused`` (:func:`refusal_flag`) takes
    the smallest flat index of a group whose scale is not finite (such groups are left
    unchanged); it is never read here, so there is no host synchronisation."""
    n, w = numel, world
    if n == 0:
        return
    if runs is not None:
        pb = runs.payload_bytes
        for r in range(w):
            lay, row = runs.layouts[r], runs.row(r)
            c = row.coded_numel()
            if c == 0:
                continue
            replica = flat[r * partition_numel + offset :][:n]
            f = get_format(fmt)
            values = buf[r * pb + lay.values_offset :][: f.value_bytes(c)].view(1, -1)
            scales = buf[r * pb + lay.scales_offset :][: num_groups(c, group_size) * SCALE_BYTES].view(torch.float32)
            coded = _coded(replica, row).view(1, c)
            bad = _add_codes(coded, _codes(values, c, f), scales.view(1, -1), group_size)[0]
            _put_coded(replica, coded[0], row)
            starts = torch.tensor([r * partition_numel + offset + lo + k * group_size for lo, hi in coded_parts(row)
                                   for k in range(-(-(hi - lo) // group_size))], dtype=torch.int64, device=flat.device)
            first = torch.where(bad, starts, torch.full_like(starts, NOT_REFUSED)).amin().view(1)
            torch.minimum(refused.view(-1)[:1], first, out=refused.view(-1)[:1])
        _scatter_exact(buf[: w * pb], flat, exact)
        return
    values, scales = _sections(buf, layout, n, w, group_size, fmt)
    q = _codes(values, n, get_format(fmt))
    bad = _add_codes(flat.view(w, partition_numel)[:, offset : offset + n], q, scales, group_size)
    starts = (torch.arange(w, device=flat.device)[:, None] * partition_numel + offset
              + torch.arange(bad.shape[1], device=flat.device)[None, :] * group_size)
    first = torch.where(bad, starts, torch.full_like(starts, NOT_REFUSED)).amin().view(1)
    torch.minimum(refused.view(-1)[:1], first, out=refused.view(-1)[:1])
    _scatter_exact(buf[: w * layout.nbytes], flat, exact)


def _sections(buf: torch.Tensor, layout, n: int, w: int, group_size: int, fmt: str):
    """``(values, scales)`` of every rank's payload in ``buf``, one row per rank."""
    rows = buf[: w * layout.nbytes].view(w, layout.nbytes)
    groups = num_groups(n, group_size)
    scales = rows[:, layout.scales_offset : layout.scales_offset + groups * SCALE_BYTES].view(torch.float32)
    return rows[:, layout.values_offset : layout.values_offset + get_format(fmt).value_bytes(n)], scales


def _scatter_exact(buf: torch.Tensor, flat: torch.Tensor, exact) -> None:
    """Every rank's exact elements from their side channels in ``buf`` into ``flat``, as raw bits."""
    if exact is not None and exact[0].numel():
        src, dst = exact
        bits = raw_bits(flat.dtype)
        flat.view(bits).index_copy_(0, dst, buf.view(bits)[src])


def raw_bits(dtype: torch.dtype) -> torch.dtype:
    """The integer type of ``dtype``'s width: exact elements are copied as raw bits."""
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[torch.empty(0, dtype=dtype).element_size()]
