"""Gradient payloads, torch reference: this code *is* the specification of the quantized
gradient reduction's arithmetic; the Triton kernels (:mod:`qzero.quant.gradients_triton`)
must produce the same bytes, the same fp32 sums and the same residuals.

A *piece* is the part of a gradient bucket one rank owns. Every other rank sends its copy
of the piece as one payload, laid out by a :class:`qzero.layout.PayloadLayout` (values,
fp32 scales, side channel; the same layout the weight gather uses):

* **pack** (:func:`pack_gradient`): the source (bf16, fp16 or fp32) is widened to fp32;
  with error feedback this rank's residual of the piece is added (one fp32 addition);
  exact elements are set to zero; with a rotation (``rotation = H > 0``) the piece is
  rotated (:func:`hadamard`); then exactly the weight quantizer of
  :mod:`qzero.quant.reference` (``scale = max(absmax / qmax, FLT_MIN)``; ``y = x * (1 /
  scale)``; int8 and int4 round half to even, int4 two values a byte, fp8 e4m3), plus one
  rule of its own: a group holding a NaN or an infinity gets the scale NaN and all-zero
  values. Its elements then dequantize to NaN, so a non-finite gradient is never hidden
  (the owner's shard shows NaN wherever a sender had NaN or Inf in that group), and a
  finite group never produces one. Exact elements (small parameters) travel verbatim in
  the side channel, in the source dtype.
* **residual** (error feedback, :data:`RESIDUAL_DTYPE`): what this pack failed to send,
  ``x - rotate(value * scale)`` in fp32 (``x`` the fp32 gradient plus the previous residual,
  exact elements zeroed, before the rotation; without a rotation, ``x - value * scale``),
  rounded once to bf16; zero at exact elements and in non-finite groups. It is added to the
  same elements' next pack.
* **dequantize and sum** (:func:`dequantize_sum`): the owner adds, in fp32 and in rank
  order ``0, 1, ..., world - 1`` starting from zero, each rank's contribution: its own
  piece unquantized (widened to fp32; with a rotation, its exact elements set to zero and
  the piece rotated), the others' ``value * scale`` (one fp32 rounding). With a rotation
  the sum is then rotated once more (the rotation is its own inverse: the sum of rotated
  pieces, rotated, is the sum of the pieces). Exact elements are finally set to the exact
  rank-ordered fp32 sum of every rank's side-channel values (its own from its piece).

[Note: gradient rotation] ``hadamard(x, H)`` transforms every whole block of ``H``
consecutive elements of a piece (blocks counted from the piece's first element) by the
normalized Walsh-Hadamard matrix ``W_H / sqrt(H)`` (Sylvester order, symmetric and
orthonormal, so its own inverse); a trailing block of fewer than ``H`` elements is left as
it is. ``H`` is a power of two that divides the group size, so a group holds whole blocks
and a block never spans two groups or two owners. The arithmetic, in fp32: ``log2(H)``
butterfly stages, each taking ``a = v[:H/2]``, ``b = v[H/2:]`` of the block ``v`` and
writing ``a + b`` to the even and ``a - b`` to the odd positions (after ``log2(H)``
stages the order is the natural one), then one multiplication of every element by
``fp32(1 / sqrt(H))`` (:func:`rotation_scale`; a power of two when ``log2(H)`` is even).
Spreading each block's energy evenly over its elements makes a group's absmax, and so its
quantization step, close to its RMS instead of its largest outlier: what lets 4-bit
gradients work.
"""

from __future__ import annotations

import functools
import math

import torch

from .formats import SCALE_BYTES, get_format
from .reference import dequantize, num_groups, quantize

#: Source dtypes a gradient piece may have (the reduce dtype).
GRADIENT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Error-feedback residuals are stored in bf16 (fp32's range, half its bytes).
RESIDUAL_DTYPE = torch.bfloat16


@functools.lru_cache(maxsize=None)
def rotation_scale(block: int) -> float:
    """``fp32(1 / sqrt(block))`` as a Python float (exactly representable in fp32)."""
    return float(torch.tensor(1.0 / math.sqrt(block), dtype=torch.float32))


def check_rotation_block(block: object) -> int:
    """Rotation blocks are powers of two, at least 2."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 2 or block & (block - 1):
        raise ValueError(f"the rotation block must be a power of two >= 2, got {block!r}")
    return block


def hadamard(x: torch.Tensor, block: int) -> torch.Tensor:
    """The normalized Walsh-Hadamard transform of every whole ``block`` of fp32 ``x`` (1-D),
    a trailing partial block left as it is: see [Note: gradient rotation]. Its own inverse."""
    n = x.numel()
    whole = n // block * block
    half = block // 2
    v = x[:whole].reshape(-1, block)
    for _ in range(block.bit_length() - 1):
        v = torch.stack((v[:, :half] + v[:, half:], v[:, :half] - v[:, half:]), dim=2).reshape(-1, block)
    v = v * torch.tensor(rotation_scale(block), dtype=torch.float32, device=x.device)
    return torch.cat((v.reshape(-1), x[whole:]))


def _check_source(src: torch.Tensor) -> None:
    if src.dtype not in GRADIENT_DTYPES:
        raise TypeError(f"gradient pieces are bf16, fp16 or fp32, got {src.dtype}")
    if src.dim() != 1 or not src.is_contiguous():
        raise ValueError("a gradient piece must be a contiguous 1-D tensor")


def sections(payload: torch.Tensor, layout, numel: int, group_size: int, fmt: str, dtype: torch.dtype):
    """``(values, scales, side)`` views of one payload (no copies); ``side`` holds
    ``layout.exact_numel`` elements of ``dtype``."""
    f = get_format(fmt)
    values = payload[layout.values_offset : layout.values_offset + f.value_bytes(numel)]
    scales = payload[layout.scales_offset : layout.scales_offset + num_groups(numel, group_size) * SCALE_BYTES]
    side = payload[layout.exact_offset : layout.exact_offset + layout.exact_numel * dtype.itemsize]
    return values, scales.view(torch.float32), side.view(dtype)


def pack_gradient(
    src: torch.Tensor,
    out: torch.Tensor,
    layout,
    group_size: int,
    fmt: str,
    exact_index: torch.Tensor | None,
    rotation: int = 0,
    residual: torch.Tensor | None = None,
) -> None:
    """Write the payload of gradient piece ``src`` into the byte buffer ``out`` (``src`` is not
    modified). ``rotation``: the block of the Hadamard rotation, 0 for none. ``residual``
    (error feedback; bf16, the piece's size): added to the piece before it is quantized, and
    overwritten with what this payload fails to carry."""
    _check_source(src)
    n = src.numel()
    values_out, scales_out, side = sections(out, layout, n, group_size, fmt, src.dtype)
    if n == 0:
        return
    has_exact = exact_index is not None and exact_index.numel() > 0
    x32 = src.to(torch.float32)
    if residual is not None:
        _check_residual(residual, n)
        x32 = x32 + residual.to(torch.float32)
    if has_exact:
        x32 = x32.index_fill(0, exact_index, 0.0)
    y = hadamard(x32, rotation) if rotation else x32
    groups = num_groups(n, group_size)
    padded = torch.nn.functional.pad(y, (0, groups * group_size - n)).view(groups, group_size)
    bad = ~torch.isfinite(padded).all(dim=1)
    bad_elem = bad.repeat_interleave(group_size)[:n]
    # a refused group becomes zeros: zero values; its scale is made NaN below (unconditionally:
    # testing whether any group is refused would wait for the device on every pack)
    y = y.masked_fill(bad_elem, 0.0)
    values, scales = quantize(y, group_size, fmt)
    scales = torch.where(bad, torch.full_like(scales, float("nan")), scales)
    values_out.copy_(values)
    scales_out.copy_(scales)
    if has_exact:
        side[: exact_index.numel()].copy_(src[exact_index])
    if residual is not None:
        sent = dequantize(values, scales, n, group_size, fmt, torch.float32)
        err = x32 - (hadamard(sent, rotation) if rotation else sent)
        err = err.masked_fill(bad_elem, 0.0)
        if has_exact:
            err = err.index_fill(0, exact_index, 0.0)
        residual.copy_(err)


def _check_residual(residual: torch.Tensor, n: int) -> None:
    if residual.dtype != RESIDUAL_DTYPE or residual.numel() != n or not residual.is_contiguous():
        raise ValueError(f"a residual must be a contiguous {RESIDUAL_DTYPE} tensor of the piece's {n} elements, "
                         f"got {residual.dtype} x {residual.numel()}")


def dequantize_piece(payload: torch.Tensor, layout, numel: int, group_size: int, fmt: str) -> torch.Tensor:
    """fp32 ``value * scale`` of one payload (exact elements come back as zeros, or NaN in a
    non-finite group)."""
    values, scales, _ = sections(payload, layout, numel, group_size, fmt, torch.uint8)
    return dequantize(values, scales, numel, group_size, fmt, torch.float32)


def exact_sum(payloads: torch.Tensor, own: torch.Tensor, layout, rank: int, world: int,
              exact_index: torch.Tensor) -> torch.Tensor:
    """fp32 sum, in rank order from zero, of every rank's exact elements (own: from ``own``)."""
    k = exact_index.numel()
    total = torch.zeros(k, dtype=torch.float32, device=own.device)
    for s in range(world):
        if s == rank:
            total += own[exact_index].to(torch.float32)
        else:
            p = payloads[_slot(s, rank) * layout.nbytes :][: layout.nbytes]
            side = p[layout.exact_offset : layout.exact_offset + k * own.element_size()].view(own.dtype)
            total += side.to(torch.float32)
    return total


def dequantize_sum(
    payloads: torch.Tensor,
    own: torch.Tensor,
    out: torch.Tensor,
    layout,
    rank: int,
    world: int,
    group_size: int,
    fmt: str,
    exact_index: torch.Tensor | None,
    rotation: int = 0,
) -> None:
    """``out`` (fp32, like ``own``) = the rank-ordered fp32 sum of every rank's contribution
    (with a rotation: of the rotated contributions, rotated back once).

    ``payloads`` holds the other ranks' payloads back to back in rank order (``world - 1``
    of ``layout.nbytes`` bytes each); ``own`` is this rank's piece, unquantized.
    """
    _check_source(own)
    n = own.numel()
    out.zero_()
    for s in range(world):
        if s == rank:
            mine = own.to(torch.float32)
            if rotation:
                if exact_index is not None and exact_index.numel():
                    mine = mine.index_fill(0, exact_index, 0.0)
                mine = hadamard(mine, rotation)
            out += mine
        else:
            p = payloads[_slot(s, rank) * layout.nbytes :][: layout.nbytes]
            out += dequantize_piece(p, layout, n, group_size, fmt)
    if rotation and n:
        out.copy_(hadamard(out, rotation))
    put_exact(payloads, own, out, layout, rank, world, exact_index)


def put_exact(payloads, own, out, layout, rank, world, exact_index) -> None:
    """Overwrite the exact elements of ``out`` with their exact rank-ordered sum (what the
    sum of contributions with side-channel values in place gives, element by element)."""
    if exact_index is not None and exact_index.numel():
        out.index_copy_(0, exact_index, exact_sum(payloads, own, layout, rank, world, exact_index))


def _slot(sender: int, rank: int) -> int:
    """Where ``sender``'s payload sits among the ``world - 1`` received (this rank sends itself nothing)."""
    return sender - (sender > rank)
