"""Triton kernels of the quantized gradient reduction: the same bytes and fp32 sums as
:mod:`qzero.quant.gradients` (the specification).

Both reuse the weight kernels' arithmetic (:mod:`qzero.quant.triton`: the tile split, the
exact-element walk, the scale and its reciprocal, the int8 rounding and the e4m3
encoding), so there is one quantizer, not two:

* ``pack``: one pass over a bf16/fp16/fp32 piece; exact elements are zeroed and their raw
  bits copied into the side channel; a group with a NaN or an infinity gets the scale NaN
  and zero values.
* ``dequantize-sum``: one pass that adds, per element and in rank order, this rank's own
  piece (unquantized) and every other rank's ``value * scale``, in fp32 from zero, and
  writes the fp32 sum. Exact elements are then overwritten with their exact sum (a
  scatter over the few of them, as the weight unpack does).

Both are compiled without fp contraction, so ``acc + q * scale`` rounds twice, as in torch.
"""

from __future__ import annotations

import torch

from . import gradients as ref
from .formats import get_format
from .reference import FLT_MIN
from .triton import _FMT_CODES, AVAILABLE, PACK_OPTIONS, TUNING, _exact_tables, _launch, _launch_shape, _soft, triton

if triton is not None:
    import triton.language as tl

    from .triton import (
        _e4m3_bits,
        _e4m3_value,
        _quantized_int,
        _reciprocal,
        _scale_of,
        _tile,
        _times_reciprocal,
        _widen,
        _zero_exact,
    )

    @triton.jit
    def _to_f32(bits, KIND: tl.constexpr):
        """fp32 value of raw bits: KIND 0 bf16 (int16), 1 fp16 (int16), 2 fp32 (int32)."""
        if KIND == 2:
            x = bits.to(tl.float32, bitcast=True)
        else:
            x = _widen(bits, KIND == 0)
        return x  # one return: see _widen

    @triton.jit
    def _grad_pack_kernel(
        src_ptr,  # int16 (bf16/fp16) or int32 (fp32) view of the piece
        values_ptr,  # uint8
        scales_ptr,  # fp32
        side_ptr,  # side channel, same element type as src_ptr
        idx_ptr,  # int64, sorted exact indices
        blk_ptr,  # int64, per program: first index of idx inside its tile; one extra at the end
        n,
        KIND: tl.constexpr,
        SOFT: tl.constexpr,
        FMT: tl.constexpr,
        QMAX: tl.constexpr,
        FLOOR: tl.constexpr,
        GS: tl.constexpr,
        GS_PAD: tl.constexpr,
        G: tl.constexpr,
        HAS_EXACT: tl.constexpr,
        STEPS: tl.constexpr,
    ):
        pid, base, rem, g = _tile(n, G, GS, GS_PAD)
        j = tl.arange(0, GS_PAD)
        offs = g[:, None] * GS + j[None, :]
        valid = (j[None, :] < GS) & (offs < rem)
        bits = tl.load(src_ptr + base + offs, mask=valid, other=0)
        x = _zero_exact(_to_f32(bits, KIND), bits, side_ptr, idx_ptr, blk_ptr, pid, base, offs, valid, HAS_EXACT, STEPS)
        # NaN or +-Inf: Triton's max does not promise to propagate NaN, so look for it.
        nonfinite = tl.max(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32), axis=1) > 0
        absmax = tl.max(tl.abs(x), axis=1)
        scale = _scale_of(absmax, QMAX, FLOOR)
        inv = _reciprocal(scale)[:, None]
        if FMT == 1:
            v = _e4m3_bits(_times_reciprocal(x, inv, QMAX), SOFT)
        else:
            v = _quantized_int(x, inv).to(tl.int8).to(tl.uint8, bitcast=True)
        v = tl.where(nonfinite[:, None], 0, v).to(tl.uint8)
        scale = tl.where(nonfinite, float("nan"), scale)
        tl.store(values_ptr + base + offs, v, mask=valid)
        tl.store(scales_ptr + pid * G + g, scale, mask=g * GS < rem)

    @triton.jit
    def _dequantize_sum_kernel(
        payloads_ptr,  # uint8: the other ranks' payloads, back to back in rank order
        own_ptr,  # int16 (bf16/fp16) or int32 (fp32) view of this rank's piece
        out_ptr,  # fp32
        n,
        nbytes,  # bytes of one payload
        scales_offset,  # byte offset of the scales in a payload
        rank,
        world,
        KIND: tl.constexpr,
        SOFT: tl.constexpr,
        FMT: tl.constexpr,
        GS: tl.constexpr,
        GS_PAD: tl.constexpr,
        G: tl.constexpr,
    ):
        pid, base, rem, g = _tile(n, G, GS, GS_PAD)
        j = tl.arange(0, GS_PAD)
        offs = g[:, None] * GS + j[None, :]
        valid = (j[None, :] < GS) & (offs < rem)
        gmask = g * GS < rem
        acc = tl.zeros((G, GS_PAD), tl.float32)
        for s in range(world):
            if s == rank:
                c = _to_f32(tl.load(own_ptr + base + offs, mask=valid, other=0), KIND)
            else:
                p = payloads_ptr + (s - (s > rank).to(tl.int32)).to(tl.int64) * nbytes
                scales = (p + scales_offset).to(tl.pointer_type(tl.float32), bitcast=True)
                scale = tl.load(scales + pid * G + g, mask=gmask, other=1.0)
                v = tl.load(p + base + offs, mask=valid, other=0)
                if FMT == 1:
                    q = _e4m3_value(v, SOFT)
                else:
                    q = v.to(tl.int8, bitcast=True).to(tl.float32)
                c = q * scale[:, None]
            acc = acc + c
        tl.store(out_ptr + base + offs, acc, mask=valid)


_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def pack_gradient(
    src: torch.Tensor,
    out: torch.Tensor,
    layout,
    group_size: int,
    fmt: str,
    exact_index: torch.Tensor | None,
) -> None:
    """Kernel twin of :func:`qzero.quant.gradients.pack_gradient`: same arguments, same bytes."""
    ref._check_source(src)
    f = get_format(fmt)
    if f.bits != 8:
        raise ValueError(f"gradient payloads are 8-bit formats, got {fmt!r}")
    n = src.numel()
    values, scales, side = ref.sections(out, layout, n, group_size, fmt, src.dtype)
    if n == 0:
        return
    has_exact = exact_index is not None and exact_index.numel() > 0
    shape = _launch_shape(n, group_size, has_exact)
    idx, blk = _exact_tables(exact_index, shape, src.device)
    _launch(
        _grad_pack_kernel,
        (shape.programs,),
        (_bits(src), values, scales, _bits(side) if has_exact else scales, idx if has_exact else scales,
         blk if has_exact else scales, n),
        dict(KIND=_KINDS[src.dtype], SOFT=_soft(src.device), FMT=_FMT_CODES[f.name], QMAX=float(f.qmax),
             FLOOR=FLT_MIN, GS=group_size, GS_PAD=shape.gs_pad, G=shape.groups_per_prog, HAS_EXACT=has_exact,
             STEPS=shape.search_steps),
        dict(num_warps=shape.num_warps, **PACK_OPTIONS),
    )


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
    """Kernel twin of :func:`qzero.quant.gradients.dequantize_sum`: same arguments, same sums."""
    ref._check_source(own)
    f = get_format(fmt)
    n = own.numel()
    if out.dtype != torch.float32 or out.numel() != n or not out.is_contiguous():
        raise ValueError("out must be a contiguous fp32 tensor the size of the piece")
    if payloads.numel() < (world - 1) * layout.nbytes:
        raise ValueError(f"{payloads.numel()} payload bytes, {world - 1} payloads of {layout.nbytes} expected")
    if n == 0:
        return
    shape = _launch_shape(n, group_size, False)
    _launch(
        _dequantize_sum_kernel,
        (shape.programs,),
        (payloads, _bits(own), out, n, layout.nbytes, layout.scales_offset, rank, world),
        dict(KIND=_KINDS[own.dtype], SOFT=_soft(own.device), FMT=_FMT_CODES[f.name], GS=group_size,
             GS_PAD=shape.gs_pad, G=shape.groups_per_prog),
        dict(num_warps=shape.num_warps, **PACK_OPTIONS),
    )
    ref.put_exact(payloads, own, out, layout, rank, world, exact_index)


__all__ = ["AVAILABLE", "TUNING", "dequantize_sum", "pack_gradient"]
