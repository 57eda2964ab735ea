"""Gradient payloads, torch reference: this code *is* the specification of the quantized
gradient reduction's arithmetic; the Triton kernels (:mod:`qzero.quant.gradients_triton`)
must produce the same bytes and the same fp32 sums.

A *piece* is the part of a gradient bucket one rank owns. Every other rank sends its copy
of the piece as one payload, laid out by a :class:`qzero.layout.PayloadLayout` (values,
fp32 scales, side channel; the same layout the weight gather uses):

* **pack** (:func:`pack_gradient`): exactly the weight quantizer of
  :mod:`qzero.quant.reference` (exact elements zeroed before the scales; ``scale =
  max(absmax / qmax, FLT_MIN)``; ``y = x * (1 / scale)``; int8 round half to even, fp8
  e4m3), with the source in any of bf16, fp16 or fp32, plus one rule of its own: a group
  holding a NaN or an infinity gets the scale NaN and all-zero values. Its elements then
  dequantize to NaN, so a non-finite gradient is never hidden (the owner's shard shows NaN
  wherever a sender had NaN or Inf in that group), and a finite group never produces one.
  Exact elements (small parameters) travel verbatim in the side channel, in the source
  dtype.
* **dequantize and sum** (:func:`dequantize_sum`): the owner adds, in fp32 and in rank
  order ``0, 1, ..., world - 1`` starting from zero, each rank's contribution: its own
  piece unquantized (widened to fp32), the others' ``value * scale`` (one fp32 rounding)
  with their exact elements taken from the side channel (widened to fp32).
"""

from __future__ import annotations

import torch

from .formats import SCALE_BYTES, get_format
from .reference import dequantize, num_groups, quantize

#: Source dtypes a gradient piece may have (the reduce dtype).
GRADIENT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


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
) -> None:
    """Write the payload of gradient piece ``src`` into the byte buffer ``out`` (``src`` is not modified)."""
    _check_source(src)
    n = src.numel()
    values_out, scales_out, side = sections(out, layout, n, group_size, fmt, src.dtype)
    if n == 0:
        return
    values, scales = quantize(src, group_size, fmt, exact_index)
    x32 = src.to(torch.float32)
    if exact_index is not None and exact_index.numel():
        x32 = x32.index_fill(0, exact_index, 0.0)
    groups = scales.numel()
    padded = torch.nn.functional.pad(x32, (0, groups * group_size - n)).view(groups, group_size)
    bad = ~torch.isfinite(padded).all(dim=1)
    if bool(bad.any()):
        scales = torch.where(bad, torch.full_like(scales, float("nan")), scales)
        per_elem = bad.repeat_interleave(group_size)[:n]
        values = values.masked_fill(per_elem, 0)  # 8-bit formats: one value per element
    values_out.copy_(values)
    scales_out.copy_(scales)
    if exact_index is not None and exact_index.numel():
        side[: exact_index.numel()].copy_(src[exact_index])


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
) -> None:
    """``out`` (fp32, like ``own``) = the rank-ordered fp32 sum of every rank's contribution.

    ``payloads`` holds the other ranks' payloads back to back in rank order (``world - 1``
    of ``layout.nbytes`` bytes each); ``own`` is this rank's piece, unquantized.
    """
    _check_source(own)
    n = own.numel()
    out.zero_()
    for s in range(world):
        if s == rank:
            out += own.to(torch.float32)
        else:
            p = payloads[_slot(s, rank) * layout.nbytes :][: layout.nbytes]
            out += dequantize_piece(p, layout, n, group_size, fmt)
    put_exact(payloads, own, out, layout, rank, world, exact_index)


def put_exact(payloads, own, out, layout, rank, world, exact_index) -> None:
    """Overwrite the exact elements of ``out`` with their exact rank-ordered sum (what the
    sum of contributions with side-channel values in place gives, element by element)."""
    if exact_index is not None and exact_index.numel():
        out.index_copy_(0, exact_index, exact_sum(payloads, own, layout, rank, world, exact_index))


def _slot(sender: int, rank: int) -> int:
    """Where ``sender``'s payload sits among the ``world - 1`` received (this rank sends itself nothing)."""
    return sender - (sender > rank)
