"""Triton kernels of delta payloads ([Note: delta payload] in :mod:`qzero.quant.reference`).

Same contract and the same bytes as :func:`qzero.quant.reference.pack_delta_payload` and
:func:`~qzero.quant.reference.unpack_delta_payloads` (:class:`DeltaKernels`):

* ``pack``: one pass; the fp32 target and the replica are each read once, the difference
  ``d = fp32(RN(target)) - fp32(replica)`` lives in registers only and is quantized as a
  weight is (:mod:`qzero.quant.triton_arith`); a group with a non-finite ``d`` gets scale NaN
  and values 0; exact elements send ``RN(target)``'s bits aside.
* ``unpack``: the all-ranks unpack of weight payloads
  (:func:`qzero.quant.triton_weights.unpack_ranks`) in its ``DELTA`` form, which adds the
  decoded differences into the replica and raises the refusal flag.
"""

from __future__ import annotations

import torch

from ..vocabulary import DELTA_FORMATS
from .formats import get_format
from .reference import FLT_MIN
from .triton_launch import FMT_CODES, PACK_OPTIONS, At, Launcher, tl, triton
from .triton_weights import check_chunk, check_io, payload_sections, tile_arguments, unpack_ranks

if triton is not None:
    from .triton_arith import _narrow, _quantized_int, _reciprocal, _run_tile, _scale_of, _tile, _widen, _zero_exact

    @triton.jit
    def _pack_delta_kernel(
        target_ptr,  # fp32: the master slice
        replica_ptr,  # int16 view of the bf16/fp16 replica slice
        values_ptr,  # uint8
        scales_ptr,  # fp32
        side_ptr,  # int16 view of the side channel
        idx_ptr,  # int64, sorted exact indices
        blk_ptr,  # int64, per program: first index of idx inside its tile; one extra at the end
        runs_ptr,  # int64, one row of the RunsTable (RUNS only)
        n,
        n_runs,
        run_steps,
        IS_BF16: tl.constexpr,
        SOFT: tl.constexpr,
        FMT: tl.constexpr,
        QMAX: tl.constexpr,
        FLOOR: tl.constexpr,
        GS: tl.constexpr,
        GS_PAD: tl.constexpr,
        G: tl.constexpr,
        HAS_EXACT: tl.constexpr,
        STEPS: tl.constexpr,
        RUNS: tl.constexpr,
    ):
        """One rank's delta payload ([Note: delta payload]): ``d = fp32(RN(target)) - fp32(replica)``
        in registers (one read of each), quantized as a weight is; a group with a non-finite
        ``d`` gets scale NaN and values 0; exact elements send ``RN(target)``'s bits aside.
        With group runs, a tile of exact groups stores its side elements only (as the weight pack).
        A whole tile of coded power-of-two groups (every program but the last, outside group
        runs' edges) is read and written without bounds masks, so its loads and stores are
        16-byte vectors; the bytes are the same either way."""
        pid, base, rem, g = _tile(n, G, GS, GS_PAD)
        vg = pid * G
        if RUNS:
            base, rem, vg = _run_tile(runs_ptr, n_runs, run_steps, pid, G, GS)
        coded = tl.where(vg >= 0, rem, 0)  # elements whose values are stored
        if GS == GS_PAD:
            if coded == G * GS:
                _pack_delta_tile(target_ptr, replica_ptr, values_ptr, scales_ptr, side_ptr, idx_ptr, blk_ptr, pid,
                                 base, vg, rem, coded, g, IS_BF16, SOFT, FMT, QMAX, FLOOR, GS, GS_PAD, G, HAS_EXACT,
                                 STEPS, True)
            else:
                _pack_delta_tile(target_ptr, replica_ptr, values_ptr, scales_ptr, side_ptr, idx_ptr, blk_ptr, pid,
                                 base, vg, rem, coded, g, IS_BF16, SOFT, FMT, QMAX, FLOOR, GS, GS_PAD, G, HAS_EXACT,
                                 STEPS, False)
        else:
            _pack_delta_tile(target_ptr, replica_ptr, values_ptr, scales_ptr, side_ptr, idx_ptr, blk_ptr, pid, base,
                             vg, rem, coded, g, IS_BF16, SOFT, FMT, QMAX, FLOOR, GS, GS_PAD, G, HAS_EXACT, STEPS,
                             False)

    @triton.jit
    def _pack_delta_tile(target_ptr, replica_ptr, values_ptr, scales_ptr, side_ptr, idx_ptr, blk_ptr, pid, base, vg,
                         rem, coded, g, IS_BF16: tl.constexpr, SOFT: tl.constexpr, FMT: tl.constexpr,
                         QMAX: tl.constexpr, FLOOR: tl.constexpr, GS: tl.constexpr, GS_PAD: tl.constexpr,
                         G: tl.constexpr, HAS_EXACT: tl.constexpr, STEPS: tl.constexpr, FULL: tl.constexpr):
        """One program's tile of :func:`_pack_delta_kernel`; ``FULL``: ``coded == G * GS`` and
        ``GS == GS_PAD`` (no bounds masks)."""
        j = tl.arange(0, GS_PAD)
        offs = g[:, None] * GS + j[None, :]
        if FULL:
            valid = offs >= 0
            t_bits = _narrow(tl.load(target_ptr + base + offs), IS_BF16, SOFT)
            r_bits = tl.load(replica_ptr + base + offs)
        else:
            valid = (j[None, :] < GS) & (offs < rem)
            t_bits = _narrow(tl.load(target_ptr + base + offs, mask=valid, other=0.0), IS_BF16, SOFT)
            r_bits = tl.load(replica_ptr + base + offs, mask=valid, other=0)
        d = _widen(t_bits, IS_BF16) - _widen(r_bits, IS_BF16)
        d = _zero_exact(d, t_bits, side_ptr, idx_ptr, blk_ptr, pid, base, offs, valid, HAS_EXACT, STEPS)
        finite = tl.abs(d) < float("inf")  # false for NaN too
        ok = tl.min(finite.to(tl.int32), axis=1) != 0  # per group
        scale = _scale_of(tl.max(tl.where(finite, tl.abs(d), 0.0), axis=1), QMAX, FLOOR)
        q = tl.where(ok[:, None], _quantized_int(tl.where(finite, d, 0.0), _reciprocal(scale)[:, None]), 0)
        scale = tl.where(ok, scale, float("nan"))
        if FMT == 2:
            qe, qo = tl.split(tl.reshape(q, [G, GS_PAD // 2, 2]))
            byte = ((qe & 0xF) | ((qo & 0xF) << 4)).to(tl.uint8)
            jb = tl.arange(0, GS_PAD // 2)
            pair = g[:, None] * (GS // 2) + jb[None, :]
            if FULL:
                tl.store(values_ptr + vg * (GS // 2) + pair, byte)
            else:
                tl.store(values_ptr + vg * (GS // 2) + pair, byte, mask=(jb[None, :] < GS // 2) & (2 * pair < coded))
        else:
            v = q.to(tl.int8).to(tl.uint8, bitcast=True)
            if FULL:
                tl.store(values_ptr + vg * GS + offs, v)
            else:
                tl.store(values_ptr + vg * GS + offs, v, mask=valid & (offs < coded))
        if FULL:
            tl.store(scales_ptr + vg + g, scale)
        else:
            tl.store(scales_ptr + vg + g, scale, mask=g * GS < coded)


def _check_delta_format(f) -> None:
    if f.name not in DELTA_FORMATS:
        raise ValueError(f"a delta payload is int4 or int8, got {f.name!r}")


class DeltaKernels:
    """The delta-payload kernels of a :class:`qzero.quant.triton.TritonKernels`, launched
    through its ``launcher`` (a :class:`~qzero.quant.triton_launch.Launcher`)."""

    launcher: Launcher

    def pack_delta_payload(self, target: torch.Tensor, replica: torch.Tensor, out: torch.Tensor, layout,
                           group_size: int, fmt: str, exact_index: torch.Tensor | None, runs=None) -> None:
        """Kernel twin of :func:`qzero.quant.reference.pack_delta_payload`: same arguments, same
        bytes, one pass (the fp32 target and the replica are each read once; the difference
        lives in registers only)."""
        f = get_format(fmt)
        _check_delta_format(f)
        check_io(replica, "replica")
        n = replica.numel()
        if target.dtype != torch.float32 or target.dim() != 1 or not target.is_contiguous() or target.numel() != n:
            raise ValueError(f"the target must be a contiguous 1-D fp32 tensor of the replica's {n} elements")
        count = 0 if exact_index is None else exact_index.numel()
        values, scales, side = payload_sections(out, layout, n, group_size, f, count, runs=runs)
        if n == 0:
            return
        has_exact = count > 0
        launcher = self.launcher
        shape = launcher.shape(n, group_size, has_exact)
        idx, blk = launcher.exact_tables(exact_index, shape, replica.device, runs)
        programs, (table, n_runs, steps) = tile_arguments(launcher, runs, shape, replica.device)
        launcher.launch(
            _pack_delta_kernel,
            (programs,),
            (target, At(replica, 0, 2 * n, torch.int16), values, scales, side if has_exact else scales,
             idx if has_exact else scales, blk if has_exact else scales, scales if table is None else table, n,
             n_runs, steps),
            dict(IS_BF16=replica.dtype == torch.bfloat16, SOFT=launcher.soft(replica.device), FMT=FMT_CODES[f.name],
                 QMAX=float(f.qmax), FLOOR=FLT_MIN, GS=group_size, GS_PAD=shape.gs_pad, G=shape.groups_per_prog,
                 HAS_EXACT=has_exact, STEPS=shape.search_steps, RUNS=table is not None),
            dict(num_warps=shape.num_warps, **PACK_OPTIONS),
        )

    def unpack_delta_payloads(self, buf: torch.Tensor, flat: torch.Tensor, partition_numel: int, offset: int,
                              numel: int, world: int, layout, group_size: int, fmt: str,
                              exact: tuple[torch.Tensor, torch.Tensor] | None, refused: torch.Tensor,
                              runs=None) -> None:
        """Kernel twin of :func:`qzero.quant.reference.unpack_delta_payloads`: every source rank's
        delta payload of one chunk added into ``flat`` in place (one launch, a program per tile
        and rank), then one scatter of every rank's exact elements."""
        f = get_format(fmt)
        _check_delta_format(f)
        bits = check_chunk(buf, flat, partition_numel, offset, numel, world, layout, runs)
        if refused.dtype != torch.int64 or refused.numel() < 1 or refused.device != flat.device:
            raise ValueError("the refusal flag must be an int64 tensor on the flat buffer's device "
                             "(reference.refusal_flag)")
        if numel == 0:
            return
        unpack_ranks(self.launcher, buf, bits, refused, partition_numel, offset, numel, world, layout, group_size, f,
                     exact, runs, flat.dtype, flat.device, delta=True)
