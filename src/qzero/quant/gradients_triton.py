"""Triton kernels of the quantized gradient reduction: the same bytes, fp32 sums and
residuals as :mod:`qzero.quant.gradients` (the specification).

Both reuse the weight kernels' arithmetic (:mod:`qzero.quant.triton_arith`: the tile split, the
exact-element walk, the scale and its reciprocal, the int8/int4 rounding and the e4m3
encoding), so there is one quantizer, not two (:class:`GradientKernels`, launched as the
weight kernels are: :mod:`qzero.quant.triton_launch`):

* ``pack``: one pass over a bf16/fp16/fp32 piece (and, with error feedback, its bf16
  residual): the residual is added, exact elements are zeroed and their raw bits copied into
  the side channel, the tile is rotated in registers (the Walsh-Hadamard butterflies as
  reshapes, splits and joins of the register tile: no matrix, no extra memory pass), each
  group quantized; a group with a NaN or an infinity gets the scale NaN and zero values.
  With error feedback the same pass decodes what it wrote, rotates it back and stores the
  new residual.
* ``dequantize-sum``: one pass that adds, per element and in rank order, this rank's own
  piece (unquantized; with a rotation, exact elements zeroed and rotated) and every other
  rank's ``value * scale``, in fp32 from zero, rotates the sum back (with a rotation) and
  writes it; exact elements get, in the same pass, the rank-ordered fp32 sum of this rank's
  own value and the other ranks' side-channel values (no separate scatter: one launch per
  piece and no torch operations around it).

Both are compiled without fp contraction, so ``acc + q * scale`` rounds twice, as in torch.
"""

from __future__ import annotations

import torch

from . import gradients as ref
from .formats import get_format
from .reference import FLT_MIN
from .triton_launch import FMT_CODES, PACK_OPTIONS, Launcher, tl, triton

if triton is not None:
    from .triton_arith import (
        _e4m3_bits,
        _e4m3_value,
        _exact_runs,
        _narrow,
        _quantized_int,
        _reciprocal,
        _scale_of,
        _tile,
        _times_reciprocal,
        _widen,
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
    def _wht(x, M: tl.constexpr, H: tl.constexpr, LOG_H: tl.constexpr):
        """Unnormalized Walsh-Hadamard transform of every row of ``x`` ([M, H], fp32): per stage,
        ``a = row[:H/2]``, ``b = row[H/2:]``, the row becomes ``a + b`` at the even and ``a - b``
        at the odd positions ([Note: gradient rotation] in :mod:`qzero.quant.gradients`)."""
        for _ in tl.static_range(LOG_H):
            a, b = tl.split(tl.permute(tl.reshape(x, [M, 2, H // 2]), [0, 2, 1]))
            x = tl.reshape(tl.join(a + b, a - b), [M, H])
        return x

    @triton.jit
    def _rotate(x, full, G: tl.constexpr, GS_PAD: tl.constexpr, H: tl.constexpr, LOG_H: tl.constexpr,
                C: tl.constexpr):
        """The normalized rotation of a ``[G, GS_PAD]`` tile whose groups hold whole blocks of
        ``H``; where ``full`` is false (a piece's trailing partial block) ``x`` stays as it is."""
        M: tl.constexpr = G * (GS_PAD // H)
        y = tl.reshape(_wht(tl.reshape(x, [M, H]), M, H, LOG_H), [G, GS_PAD]) * C
        return tl.where(full, y, x)

    @triton.jit
    def _whole_blocks(g, j, rem, GS: tl.constexpr, H: tl.constexpr):
        """Which tile elements lie in a rotation block that ends inside the piece."""
        return g[:, None] * GS + (j[None, :] // H + 1) * H <= rem

    @triton.jit
    def _exact_in_tile(idx_ptr, blk_ptr, pid, base, offs, STEPS: tl.constexpr):
        """``(is_exact, position in the side channel, first side-channel index of the tile)``."""
        is_exact = offs < 0
        pos = tl.zeros(offs.shape, tl.int32)
        lo = tl.load(blk_ptr + pid)
        hi = tl.load(blk_ptr + pid + 1)
        if hi > lo:
            is_exact, pos = _exact_runs(idx_ptr, lo, hi, base, offs, STEPS)
        return is_exact, pos, lo

    @triton.jit
    def _grad_pack_kernel(
        src_ptr,  # int16 (bf16/fp16) or int32 (fp32) view of the piece
        values_ptr,  # uint8
        scales_ptr,  # fp32
        side_ptr,  # side channel, same element type as src_ptr
        idx_ptr,  # int64, sorted exact indices
        blk_ptr,  # int64, per program: first index of idx inside its tile; one extra at the end
        res_ptr,  # int16 view of the bf16 residual (error feedback), read and written
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
        ROT: tl.constexpr,  # rotation block, 0 for none
        LOG_ROT: tl.constexpr,
        ROT_SCALE: tl.constexpr,
        EF: tl.constexpr,
    ):
        pid, base, rem, g = _tile(n, G, GS, GS_PAD)
        j = tl.arange(0, GS_PAD)
        offs = g[:, None] * GS + j[None, :]
        valid = (j[None, :] < GS) & (offs < rem)
        bits = tl.load(src_ptr + base + offs, mask=valid, other=0)
        x = _to_f32(bits, KIND)
        if EF:
            x = x + _widen(tl.load(res_ptr + base + offs, mask=valid, other=0), True)
        is_exact = offs < 0
        if HAS_EXACT:
            is_exact, pos, lo = _exact_in_tile(idx_ptr, blk_ptr, pid, base, offs, STEPS)
            tl.store(side_ptr + lo + pos, bits, mask=is_exact & valid)
        x = tl.where(is_exact, 0.0, x)
        if ROT > 0:
            full = _whole_blocks(g, j, rem, GS, ROT)
            y = _rotate(x, full, G, GS_PAD, ROT, LOG_ROT, ROT_SCALE)
        else:
            y = x
        # NaN or +-Inf: Triton's max does not promise to propagate NaN, so look for it.
        nonfinite = tl.max(((y != y) | (tl.abs(y) == float("inf"))).to(tl.int32), axis=1) > 0
        y = tl.where(nonfinite[:, None], 0.0, y)  # zero values; the scale is made NaN below
        scale = _scale_of(tl.max(tl.abs(y), axis=1), QMAX, FLOOR)
        inv = _reciprocal(scale)[:, None]
        if FMT == 1:
            v = _e4m3_bits(_times_reciprocal(y, inv, QMAX), SOFT)
            tl.store(values_ptr + base + offs, v, mask=valid)
            sent = _e4m3_value(v, SOFT) * scale[:, None]
        else:
            q = _quantized_int(y, inv)
            if FMT == 2:  # two values a byte, the even element in the low nibble
                qe, qo = tl.split(tl.reshape(q, [G, GS_PAD // 2, 2]))
                jb = tl.arange(0, GS_PAD // 2)
                boffs = g[:, None] * (GS // 2) + jb[None, :]
                byte = ((qe & 0xF) | ((qo & 0xF) << 4)).to(tl.uint8)
                tl.store(values_ptr + base // 2 + boffs, byte, mask=(jb[None, :] < GS // 2) & (2 * boffs < rem))
            else:
                tl.store(values_ptr + base + offs, q.to(tl.int8).to(tl.uint8, bitcast=True), mask=valid)
            sent = q.to(tl.float32) * scale[:, None]
        tl.store(scales_ptr + pid * G + g, tl.where(nonfinite, float("nan"), scale), mask=g * GS < rem)
        if EF:
            if ROT > 0:
                sent = _rotate(sent, full, G, GS_PAD, ROT, LOG_ROT, ROT_SCALE)
            err = tl.where(nonfinite[:, None] | is_exact, 0.0, x - sent)
            tl.store(res_ptr + base + offs, _narrow(err, True, SOFT), mask=valid)

    @triton.jit
    def _side_value(p, exact_offset, at, mask, KIND: tl.constexpr):
        """fp32 values of the side-channel elements ``at`` of the payload at ``p`` (bytes)."""
        if KIND == 2:
            side = (p + exact_offset).to(tl.pointer_type(tl.int32), bitcast=True)
        else:
            side = (p + exact_offset).to(tl.pointer_type(tl.int16), bitcast=True)
        return _to_f32(tl.load(side + at, mask=mask, other=0), KIND)

    @triton.jit
    def _dequantize_sum_kernel(
        payloads_ptr,  # uint8: the other ranks' payloads, back to back in rank order
        own_ptr,  # int16 (bf16/fp16) or int32 (fp32) view of this rank's piece
        out_ptr,  # fp32
        idx_ptr,  # int64, sorted exact indices of the piece
        blk_ptr,  # int64, per program: first index of idx inside its tile; one extra at the end
        n,
        nbytes,  # bytes of one payload
        scales_offset,  # byte offset of the scales in a payload
        exact_offset,  # byte offset of the side channel in a payload
        rank,
        world,
        KIND: tl.constexpr,
        SOFT: tl.constexpr,
        FMT: tl.constexpr,
        GS: tl.constexpr,
        GS_PAD: tl.constexpr,
        G: tl.constexpr,
        HAS_EXACT: tl.constexpr,
        STEPS: tl.constexpr,
        ROT: tl.constexpr,
        LOG_ROT: tl.constexpr,
        ROT_SCALE: tl.constexpr,
    ):
        pid, base, rem, g = _tile(n, G, GS, GS_PAD)
        j = tl.arange(0, GS_PAD)
        offs = g[:, None] * GS + j[None, :]
        valid = (j[None, :] < GS) & (offs < rem)
        gmask = g * GS < rem
        is_exact = offs < 0
        at = tl.zeros(offs.shape, tl.int32)
        if HAS_EXACT:
            is_exact, pos, lo = _exact_in_tile(idx_ptr, blk_ptr, pid, base, offs, STEPS)
            at = lo.to(tl.int32) + pos  # the element's place in every side channel
        if ROT > 0:
            full = _whole_blocks(g, j, rem, GS, ROT)
        acc = tl.zeros((G, GS_PAD), tl.float32)
        ex = tl.zeros((G, GS_PAD), tl.float32)  # exact elements: their exact sum, from zero
        side_mask = is_exact & valid
        for s in range(world):
            if s == rank:
                c = _to_f32(tl.load(own_ptr + base + offs, mask=valid, other=0), KIND)
                if HAS_EXACT:
                    ex = ex + tl.where(is_exact, c, 0.0)
                if ROT > 0:
                    c = _rotate(tl.where(is_exact, 0.0, c), full, G, GS_PAD, ROT, LOG_ROT, ROT_SCALE)
            else:
                p = payloads_ptr + (s - (s > rank).to(tl.int32)).to(tl.int64) * nbytes
                if HAS_EXACT:
                    ex = ex + _side_value(p, exact_offset, at, side_mask, KIND)
                scales = (p + scales_offset).to(tl.pointer_type(tl.float32), bitcast=True)
                scale = tl.load(scales + pid * G + g, mask=gmask, other=1.0)
                if FMT == 2:
                    jb = tl.arange(0, GS_PAD // 2)
                    boffs = g[:, None] * (GS // 2) + jb[None, :]
                    bmask = (jb[None, :] < GS // 2) & (2 * boffs < rem)
                    b = tl.load(p + base // 2 + boffs, mask=bmask, other=0).to(tl.int32)
                    lo_q = (b << 28) >> 28  # arithmetic shifts sign-extend each nibble
                    hi_q = (b << 24) >> 28
                    q = tl.reshape(tl.join(lo_q, hi_q), [G, GS_PAD]).to(tl.float32)
                else:
                    v = tl.load(p + base + offs, mask=valid, other=0)
                    if FMT == 1:
                        q = _e4m3_value(v, SOFT)
                    else:
                        q = v.to(tl.int8, bitcast=True).to(tl.float32)
                c = q * scale[:, None]
            acc = acc + c
        if ROT > 0:
            acc = _rotate(acc, full, G, GS_PAD, ROT, LOG_ROT, ROT_SCALE)
        if HAS_EXACT:
            acc = tl.where(is_exact, ex, acc)
        tl.store(out_ptr + base + offs, acc, mask=valid)


_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _rotation_consts(rotation: int) -> dict:
    if rotation:
        ref.check_rotation_block(rotation)
    return dict(ROT=rotation, LOG_ROT=max(rotation.bit_length() - 1, 0),
                ROT_SCALE=ref.rotation_scale(rotation) if rotation else 1.0)


def _check_rotation(rotation: int, group_size: int) -> None:
    if rotation and group_size % rotation:
        raise ValueError(f"rotation block {rotation} does not divide the group size {group_size}")


class GradientKernels:
    """The gradient kernels of a :class:`qzero.quant.triton.TritonKernels`, launched through
    its ``launcher`` (a :class:`~qzero.quant.triton_launch.Launcher`)."""

    launcher: Launcher

    def pack_gradient(self, src: torch.Tensor, out: torch.Tensor, layout, group_size: int, fmt: str,
                      exact_index: torch.Tensor | None, rotation: int = 0,
                      residual: torch.Tensor | None = None) -> None:
        """Kernel twin of :func:`qzero.quant.gradients.pack_gradient`: same arguments, same bytes
        (and the same residual)."""
        ref._check_source(src)
        f = get_format(fmt)
        _check_rotation(rotation, group_size)
        n = src.numel()
        values, scales, side = ref.sections(out, layout, n, group_size, fmt, src.dtype)
        if n == 0:
            return
        if residual is not None:
            ref._check_residual(residual, n)
        has_exact = exact_index is not None and exact_index.numel() > 0
        shape = self.launcher.shape(n, group_size, has_exact)
        idx, blk = self.launcher.exact_tables(exact_index, shape, src.device)
        self.launcher.launch(
            _grad_pack_kernel,
            (shape.programs,),
            (_bits(src), values, scales, _bits(side) if has_exact else scales, idx if has_exact else scales,
             blk if has_exact else scales, _bits(residual) if residual is not None else scales, n),
            dict(KIND=_KINDS[src.dtype], SOFT=self.launcher.soft(src.device), FMT=FMT_CODES[f.name],
                 QMAX=float(f.qmax), FLOOR=FLT_MIN, GS=group_size, GS_PAD=shape.gs_pad, G=shape.groups_per_prog,
                 HAS_EXACT=has_exact, STEPS=shape.search_steps, **_rotation_consts(rotation), EF=residual is not None),
            dict(num_warps=shape.num_warps, **PACK_OPTIONS),
        )

    def dequantize_sum(self, payloads: torch.Tensor, own: torch.Tensor, out: torch.Tensor, layout, rank: int,
                       world: int, group_size: int, fmt: str, exact_index: torch.Tensor | None,
                       rotation: int = 0) -> None:
        """Kernel twin of :func:`qzero.quant.gradients.dequantize_sum`: same arguments, same sums."""
        ref._check_source(own)
        f = get_format(fmt)
        _check_rotation(rotation, group_size)
        n = own.numel()
        if out.dtype != torch.float32 or out.numel() != n or not out.is_contiguous():
            raise ValueError("out must be a contiguous fp32 tensor the size of the piece")
        if payloads.numel() < (world - 1) * layout.nbytes:
            raise ValueError(f"{payloads.numel()} payload bytes, {world - 1} payloads of {layout.nbytes} expected")
        if n == 0:
            return
        has_exact = exact_index is not None and exact_index.numel() > 0
        shape = self.launcher.shape(n, group_size, has_exact)
        idx, blk = self.launcher.exact_tables(exact_index, shape, own.device)
        self.launcher.launch(
            _dequantize_sum_kernel,
            (shape.programs,),
            (payloads, _bits(own), out, idx if has_exact else out, blk if has_exact else out, n, layout.nbytes,
             layout.scales_offset, layout.exact_offset, rank, world),
            dict(KIND=_KINDS[own.dtype], SOFT=self.launcher.soft(own.device), FMT=FMT_CODES[f.name], GS=group_size,
                 GS_PAD=shape.gs_pad, G=shape.groups_per_prog, HAS_EXACT=has_exact, STEPS=shape.search_steps,
                 **_rotation_consts(rotation)),
            dict(num_warps=shape.num_warps, **PACK_OPTIONS),
        )
