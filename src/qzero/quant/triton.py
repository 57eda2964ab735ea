"""Fused Triton kernels for one rank's chunk payload.

Same contract and the same bytes as :func:`qzero.quant.reference.pack_payload` and
:func:`qzero.quant.reference.unpack_payload`, one pass over the data each:

* ``pack``: read the bf16/fp16 slice once; zero its exact elements (copying their
  raw bits into the side channel); per group take the absmax, the scale
  ``max(absmax / qmax, FLT_MIN)`` and its reciprocal ``inv = 1 / scale`` (both
  divisions correctly rounded, like torch's tensor division; Triton's ``/`` is not),
  then per element ``y = x * inv``; round and store values and scales. The pack is
  compiled without fp contraction (:data:`PACK_OPTIONS`), so ``x * inv`` stays a
  multiplication of its own, as in the reference, and is never fused into an fma with
  the rounding's add.
* ``unpack``: read values and scales, write ``q * scale`` (fp32, one rounding)
  straight into the bf16/fp16 destination; exact elements are then put back from
  the side channel by a scatter on the same stream (see :func:`unpack_payload`).
  The gather unpacks every source rank's payload of a chunk in one launch (a 2-D grid:
  tiles x ranks, :func:`unpack_payloads`) and puts all their exact elements back with
  one more (indices precomputed once per plan): two launches per chunk, whatever the
  world size.

Launches: Triton's own launch costs tens of microseconds of host time per call; after
the first launch of a specialization, :func:`_launch` calls the compiled kernel directly.

Work split: each program owns ``G`` whole groups, laid out as a ``[G, GS_PAD]``
tile (``GS_PAD`` is the group size rounded up to a power of two; the extra columns
are masked off), so a group's absmax is a row reduction inside one program.

Group runs (a ``PER_RANK`` chunk, see ``[Note: exact groups]`` in :mod:`qzero.layout`):
the payload holds the coded groups only. The slice is then cut into tiles that never
cross a run (:func:`_runs_table`: one row of ``(first program, lo, hi, first coded
group)`` per run), and each program finds its run by a binary search over the few runs
(:func:`_run_tile`). A tile of coded groups reads and writes its values and scales at its
first coded group; a tile of exact groups still copies its side elements, and writes no
values and no scales (its unpack does nothing: the exact-element scatter writes all of
it). Without runs every tile is coded and tile ``i`` is groups ``[i G, (i + 1) G)``, as
before; the arithmetic per tile is the same either way, so the bytes are the reference's.

In the pack, exact elements are found without any per-element mask buffer.
``exact_index`` is sorted and unique, so one ``searchsorted`` gives, for every
program, the slice of ``exact_index`` that falls in its tile (memory: one int64 per
program, bounded by the chunk). Only programs whose slice is non-empty do more
work: they walk that slice run by run (a run is typically one small parameter),
which also yields each exact element's position in the side channel.

``AVAILABLE`` is False when Triton is missing, or when there is neither a CUDA
device nor the CPU interpreter (``TRITON_INTERPRET=1``) to run on.
"""

from __future__ import annotations

import functools
import os
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .formats import SCALE_BYTES, get_format
from .reference import FLT_MIN, NOT_REFUSED, num_groups

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
AVAILABLE = triton is not None and (INTERPRET or torch.cuda.is_available())

_FMT_CODES = {"int8": 0, "fp8": 1, "int4": 2}
_IO_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass
class Tuning:
    """Launch shapes: elements per program (a power of two) and warps per program, for
    payloads without and with exact elements (the exact path needs more registers)."""

    block_elems: int = 2048
    num_warps: int = 4
    exact_block_elems: int = 2048
    exact_num_warps: int = 8

    def shape(self, has_exact: bool) -> tuple[int, int]:
        if has_exact:
            return self.exact_block_elems, self.exact_num_warps
        return self.block_elems, self.num_warps


#: Module-wide launch shape; the benchmark sweeps it, users normally leave it alone.
TUNING = Tuning()

#: Compile options of the pack kernel. No fp contraction (LLVM's and ptxas's ``--fmad``):
#: ``x * inv`` followed by the round-half-even add would otherwise be fused into one fma,
#: which rounds once where the reference rounds twice and stores different values.
PACK_OPTIONS = {"enable_fp_fusion": False}

#: Convert fp32 -> bf16 and fp32 <-> e4m3 with integer and fp32-add arithmetic instead
#: of the hardware conversions. Same results; needed under the CPU interpreter, whose
#: own bf16/fp8 conversions truncate, and on GPUs older than sm_89 (no fp8 support).
SOFT_CASTS = INTERPRET


@functools.lru_cache(maxsize=None)
def _old_gpu(index: int) -> bool:
    return torch.cuda.get_device_capability(index) < (8, 9)


def _soft(device: torch.device) -> bool:
    if SOFT_CASTS or device.type != "cuda":
        return True
    return _old_gpu(device.index if device.index is not None else torch.cuda.current_device())


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class _Launch:
    gs_pad: int
    groups_per_prog: int
    programs: int
    search_steps: int
    span: int  # elements of the slice that one program's groups cover
    num_warps: int


def _launch_shape(numel: int, group_size: int, has_exact: bool) -> _Launch:
    block, warps = TUNING.shape(has_exact)
    return _shape_of(numel, group_size, block, warps)


@functools.lru_cache(maxsize=4096)
def _shape_of(numel: int, group_size: int, block: int, warps: int) -> _Launch:
    gs_pad = _next_pow2(group_size)
    per_prog = max(1, block // gs_pad)
    programs = -(-num_groups(numel, group_size) // per_prog)
    # At most per_prog * group_size exact elements fall in one program's groups;
    # the binary search must be able to step over all of them.
    span = per_prog * group_size
    return _Launch(gs_pad, per_prog, programs, span.bit_length(), span, warps)


if triton is not None:
    _NOT_REFUSED = tl.constexpr(NOT_REFUSED)

    @triton.jit
    def _widen(bits, IS_BF16: tl.constexpr):
        """fp32 value of bf16/fp16 bit patterns (int16); fp32 values pass through.

        One ``if``/``elif``/``else`` with a single return: the compiler keeps only the
        branch the (compile-time) type selects, but code after an early ``return`` inside
        such an ``if`` is still compiled for every type (and a 32-to-16-bit bitcast there
        is an error)."""
        if bits.dtype == tl.float32:
            x = bits
        elif IS_BF16:
            x = (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            x = bits.to(tl.float16, bitcast=True).to(tl.float32)
        return x

    @triton.jit
    def _narrow(v, IS_BF16: tl.constexpr, SOFT: tl.constexpr):
        """bf16/fp16 bit patterns (int16) of fp32 ``v``, rounded to nearest even."""
        if IS_BF16:
            if SOFT:
                b = v.to(tl.uint32, bitcast=True)
                b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
                return b.to(tl.uint16).to(tl.int16, bitcast=True)
            return v.to(tl.bfloat16).to(tl.int16, bitcast=True)
        return v.to(tl.float16).to(tl.int16, bitcast=True)

    @triton.jit
    def _e4m3_bits(y, SOFT: tl.constexpr):
        """e4m3fn bit pattern (uint8) of ``y`` in [-448, 448], rounded to nearest even."""
        if SOFT:
            a = tl.abs(y)
            # Round a to a multiple of its e4m3 quantum 2**(E-3), E = max(exponent, -6),
            # by adding and removing 2**(E+20): the sum's ulp is exactly that quantum.
            e = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) - 127, -6)
            c = ((e + 147) << 23).to(tl.float32, bitcast=True)
            r = (a + c) - c
            rb = r.to(tl.int32, bitcast=True)
            normal = (((rb >> 23) - 120) << 3) | ((rb >> 20) & 7)
            subnormal = (r * 512.0).to(tl.int32)  # multiples of 2**-9; 8 encodes 2**-6 itself
            code = tl.where(r >= 0.015625, normal, subnormal)
            sign = (y.to(tl.int32, bitcast=True) >> 24) & 0x80
            return (code | sign).to(tl.uint8)
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)

    @triton.jit
    def _e4m3_value(v, SOFT: tl.constexpr):
        """fp32 value of e4m3fn bit patterns (uint8); the NaN code is never produced by a pack."""
        if SOFT:
            c = v.to(tl.int32) & 0xFF
            e = (c >> 3) & 0xF
            m = c & 7
            normal = ((e + 120) << 23) | (m << 20)
            subnormal = (m.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)  # m * 2**-9
            magnitude = tl.where(e == 0, subnormal, normal)
            return (magnitude | ((c & 0x80) << 24)).to(tl.float32, bitcast=True)
        return v.to(tl.float8e4nv, bitcast=True).to(tl.float32)

    @triton.jit
    def _exact_runs(idx_ptr, lo, hi, base, offs, STEPS: tl.constexpr):
        """Which tile elements are exact, and their side-channel positions (relative to ``lo``).

        ``idx[lo:hi]`` are the sorted exact indices inside this tile. They are walked
        run by run (a run: consecutive indices, e.g. one small parameter), so the cost
        is a few scalar loads per run plus two compares per element, not a search per
        element.
        """
        is_exact = offs < 0
        pos = tl.zeros(offs.shape, tl.int32)
        t = lo
        while t < hi:
            a = tl.load(idx_ptr + t)
            last = tl.load(idx_ptr + hi - 1)
            if last - a == hi - 1 - t:  # the rest of the tile's indices form one run
                length = hi - t
            else:
                # Longest prefix with idx[t + L - 1] == a + L - 1 (true for a prefix of L).
                length = hi - hi + 1
                for k in tl.static_range(STEPS):
                    cand = length + (1 << (STEPS - 1 - k))
                    ok = cand <= hi - t
                    v = tl.load(idx_ptr + t + cand - 1, mask=ok, other=-1)
                    length = tl.where(ok & (v - a == cand - 1), cand, length)
            start = (a - base).to(tl.int32)
            in_run = (offs >= start) & (offs < start + length.to(tl.int32))
            is_exact = is_exact | in_run
            pos = tl.where(in_run, (t - lo).to(tl.int32) + offs - start, pos)
            t += length
        return is_exact, pos

    @triton.jit
    def _load_masked(src_ptr, side_ptr, idx_ptr, blk_ptr, pid, base, offs, valid,
                     IS_BF16: tl.constexpr, HAS_EXACT: tl.constexpr, STEPS: tl.constexpr):
        """fp32 values of the tile, exact elements zeroed and their raw bits sent aside."""
        bits = tl.load(src_ptr + base + offs, mask=valid, other=0)
        return _mask_exact(bits, side_ptr, idx_ptr, blk_ptr, pid, base, offs, valid, IS_BF16, HAS_EXACT, STEPS)

    @triton.jit
    def _mask_exact(bits, side_ptr, idx_ptr, blk_ptr, pid, base, offs, valid,
                    IS_BF16: tl.constexpr, HAS_EXACT: tl.constexpr, STEPS: tl.constexpr):
        return _zero_exact(_widen(bits, IS_BF16), bits, side_ptr, idx_ptr, blk_ptr, pid, base, offs, valid,
                           HAS_EXACT, STEPS)

    @triton.jit
    def _zero_exact(x, bits, side_ptr, idx_ptr, blk_ptr, pid, base, offs, valid,
                    HAS_EXACT: tl.constexpr, STEPS: tl.constexpr):
        """``x`` with the tile's exact elements zeroed; ``bits`` of those elements into the side channel."""
        if HAS_EXACT:
            lo = tl.load(blk_ptr + pid)
            hi = tl.load(blk_ptr + pid + 1)
            if hi > lo:
                is_exact, pos = _exact_runs(idx_ptr, lo, hi, base, offs, STEPS)
                tl.store(side_ptr + lo + pos, bits, mask=is_exact & valid)
                x = tl.where(is_exact, 0.0, x)
        return x

    @triton.jit
    def _scale_of(absmax, QMAX: tl.constexpr, FLOOR: tl.constexpr):
        return tl.maximum(tl.math.div_rn(absmax, tl.full(absmax.shape, QMAX, tl.float32)), FLOOR)

    @triton.jit
    def _reciprocal(scale):
        """``1 / scale`` correctly rounded, once per group (like torch's tensor division)."""
        return tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)

    @triton.jit
    def _times_reciprocal(x, inv, QMAX: tl.constexpr):
        """``x * inv`` (one correctly rounded fp32 multiplication), clamped to [-QMAX, QMAX].

        This is the format's definition (see :mod:`qzero.quant.reference`), not an
        approximation of ``x / scale`` to be corrected: there is no correction step, and
        the result may differ from a correctly rounded ``x / scale`` in its last bit.
        Bit-identity with the reference needs the multiplication to round on its own, so
        the pack is compiled without fp contraction (:data:`PACK_OPTIONS`).

        ``|x * inv|`` can exceed QMAX by ulps, hence the clamp. Clamping before rounding to
        the stored value gives the same result as after (rounding is monotone, QMAX
        representable) and keeps |y| small for the round-half-even trick.
        """
        return tl.minimum(tl.maximum(x * inv, -QMAX), QMAX)

    @triton.jit
    def _quantized_int(x, inv):
        """INT8/INT4 value of ``x`` as int32: ``x * inv`` rounded half to even.

        No clamp, unlike the reference, and the same bits: ``|x| <= absmax`` and
        ``scale = max(RN(absmax / qmax), FLT_MIN)``, ``inv = RN(1 / scale)``, so
        ``|x * inv| <= qmax * (1 + 2**-24)**3 / (1 - 2**-24) < qmax + 0.5`` (or, with the
        floor, ``< qmax``): the rounding lands in [-qmax, qmax] and the clamp never acts.
        The integer is read straight from the bits of ``y + 1.5 * 2**23`` (for |y| < 2**22
        its mantissa holds ``2**22 + round(y)``), with no float-to-int conversion.
        """
        return (x * inv + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000

    @triton.jit
    def _tile(n, G: tl.constexpr, GS: tl.constexpr, GS_PAD: tl.constexpr):
        """This program's groups: 64-bit start, then 32-bit offsets relative to it."""
        pid = tl.program_id(0).to(tl.int64)
        base = pid * (G * GS)
        rem = tl.minimum(n - base, G * GS).to(tl.int32)  # elements of the slice left here
        g = tl.arange(0, G)
        return pid, base, rem, g

    @triton.jit
    def _run_tile(row_ptr, n_runs, steps, pid, G: tl.constexpr, GS: tl.constexpr):
        """With group runs: this program's tile ``(base, rem, vg)``: its first element in the
        slice, its elements, and the payload index of its first coded group (-1: exact
        groups). ``row_ptr`` is one row of :func:`_runs_table`; the run is the last whose
        first program is at most ``pid`` (binary lifting over ``steps`` bits)."""
        k = pid * 0
        for s in range(steps):
            cand = k + (1 << (steps - 1 - s))
            ok = cand < n_runs
            start = tl.load(row_ptr + 1 + 4 * cand, mask=ok, other=0)
            k = tl.where(ok & (start <= pid), cand, k)
        run = row_ptr + 1 + 4 * k
        t = pid - tl.load(run)
        base = tl.load(run + 1) + t * (G * GS)
        rem = tl.minimum(tl.maximum(tl.load(run + 2) - base, 0), G * GS).to(tl.int32)
        first = tl.load(run + 3)
        vg = tl.where(first >= 0, first + t * G, -1)
        return base, rem, vg


    @triton.jit
    def _pack_kernel(
        src_ptr,  # int16 view of the bf16/fp16 slice, or the fp32 slice itself
        values_ptr,  # uint8
        scales_ptr,  # fp32
        side_ptr,  # int16 view of the side channel
        idx_ptr,  # int64, sorted exact indices
        blk_ptr,  # int64, per program: first index of idx inside its tile; one extra at the end
        runs_ptr,  # int64, one row of _runs_table (RUNS only)
        n,
        n_runs,
        run_steps,
        IS_BF16: tl.constexpr,
        SOFT: tl.constexpr,
        PAIRS: tl.constexpr,
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
        pid, base, rem, g = _tile(n, G, GS, GS_PAD)
        vg = pid * G  # the payload index of the tile's first group
        if RUNS:
            base, rem, vg = _run_tile(runs_ptr, n_runs, run_steps, pid, G, GS)
        # Elements whose values are stored: a tile of exact groups copies its side elements and
        # stores nothing else.
        coded = tl.where(vg >= 0, rem, 0)
        if FMT == 2:
            if GS == GS_PAD:
                if coded == G * GS:
                    _pack_int4_full(src_ptr, values_ptr, scales_ptr, side_ptr, idx_ptr, blk_ptr, pid, base, vg, g,
                                    IS_BF16, QMAX, FLOOR, GS, G, HAS_EXACT, STEPS)
                else:
                    _pack_int4_masked(src_ptr, values_ptr, scales_ptr, side_ptr, idx_ptr, blk_ptr, pid, base, vg, rem,
                                      coded, g, IS_BF16, PAIRS, QMAX, FLOOR, GS, GS_PAD, G, HAS_EXACT, STEPS)
            else:
                _pack_int4_masked(src_ptr, values_ptr, scales_ptr, side_ptr, idx_ptr, blk_ptr, pid, base, vg, rem,
                                  coded, g, IS_BF16, PAIRS, QMAX, FLOOR, GS, GS_PAD, G, HAS_EXACT, STEPS)
        else:
            j = tl.arange(0, GS_PAD)
            offs = g[:, None] * GS + j[None, :]
            valid = (j[None, :] < GS) & (offs < rem)
            x = _load_masked(src_ptr, side_ptr, idx_ptr, blk_ptr, pid, base, offs, valid, IS_BF16, HAS_EXACT, STEPS)
            absmax = tl.max(tl.abs(x), axis=1)
            scale = _scale_of(absmax, QMAX, FLOOR)
            inv = _reciprocal(scale)[:, None]
            if FMT == 1:
                v = _e4m3_bits(_times_reciprocal(x, inv, QMAX), SOFT)
            else:
                v = _quantized_int(x, inv).to(tl.int8).to(tl.uint8, bitcast=True)
            tl.store(values_ptr + vg * GS + offs, v, mask=valid & (offs < coded))
            tl.store(scales_ptr + vg + g, scale, mask=g * GS < coded)

    @triton.jit
    def _pack_int4_full(src_ptr, values_ptr, scales_ptr, side_ptr, idx_ptr, blk_ptr, pid, base, vg, g,
                        IS_BF16: tl.constexpr, QMAX: tl.constexpr, FLOOR: tl.constexpr, GS: tl.constexpr,
                        G: tl.constexpr, HAS_EXACT: tl.constexpr, STEPS: tl.constexpr):
        """INT4 pack of a whole tile (every program but the last, power-of-two groups): the tile
        is loaded and stored without bounds masks, as 16-byte vectors, and split into
        (even, odd) pairs in registers."""
        j = tl.arange(0, GS)
        offs = g[:, None] * GS + j[None, :]
        bits = tl.load(src_ptr + base + offs)
        x = _mask_exact(bits, side_ptr, idx_ptr, blk_ptr, pid, base, offs, offs >= 0, IS_BF16, HAS_EXACT, STEPS)
        scale = _scale_of(tl.max(tl.abs(x), axis=1), QMAX, FLOOR)
        q = _quantized_int(x, _reciprocal(scale)[:, None])
        qe, qo = tl.split(tl.reshape(q, [G, GS // 2, 2]))
        byte = ((qe & 0xF) | ((qo & 0xF) << 4)).to(tl.uint8)
        jb = tl.arange(0, GS // 2)
        tl.store(values_ptr + vg * (GS // 2) + g[:, None] * (GS // 2) + jb[None, :], byte)
        tl.store(scales_ptr + vg + g, scale)

    @triton.jit
    def _pack_int4_masked(src_ptr, values_ptr, scales_ptr, side_ptr, idx_ptr, blk_ptr, pid, base, vg, rem, coded, g,
                          IS_BF16: tl.constexpr, PAIRS: tl.constexpr, QMAX: tl.constexpr, FLOOR: tl.constexpr,
                          GS: tl.constexpr, GS_PAD: tl.constexpr, G: tl.constexpr, HAS_EXACT: tl.constexpr,
                          STEPS: tl.constexpr):
        # INT4: each thread handles whole (even, odd) pairs, so a byte's two nibbles
        # never cross threads. With a 4-byte aligned source (PAIRS) a pair is one
        # 32-bit load, even element in the low half; else two strided loads.
        jb = tl.arange(0, GS_PAD // 2)
        pair = g[:, None] * (GS // 2) + jb[None, :]  # byte (and pair) index in the tile
        even = 2 * pair
        valid_e = (jb[None, :] < GS // 2) & (even < rem)
        valid_o = valid_e & (even + 1 < rem)
        if PAIRS:
            words = (src_ptr + base).to(tl.pointer_type(tl.int32), bitcast=True)
            w = tl.load(words + pair, mask=valid_o, other=0)
            # A short tail leaves a lone even element: load it on its own.
            lone = tl.load(src_ptr + base + even, mask=valid_e & (even + 1 >= rem), other=0)
            bits_e = tl.where(valid_o, w.to(tl.int16), lone)
            bits_o = (w >> 16).to(tl.int16)
        else:
            bits_e = tl.load(src_ptr + base + even, mask=valid_e, other=0)
            bits_o = tl.load(src_ptr + base + even + 1, mask=valid_o, other=0)
        xe = _mask_exact(bits_e, side_ptr, idx_ptr, blk_ptr, pid, base, even, valid_e, IS_BF16, HAS_EXACT, STEPS)
        xo = _mask_exact(bits_o, side_ptr, idx_ptr, blk_ptr, pid, base, even + 1, valid_o, IS_BF16, HAS_EXACT, STEPS)
        absmax = tl.maximum(tl.max(tl.abs(xe), axis=1), tl.max(tl.abs(xo), axis=1))
        scale = _scale_of(absmax, QMAX, FLOOR)
        inv = _reciprocal(scale)[:, None]
        qe = _quantized_int(xe, inv)
        qo = _quantized_int(xo, inv)
        byte = ((qe & 0xF) | ((qo & 0xF) << 4)).to(tl.uint8)
        tl.store(values_ptr + vg * (GS // 2) + pair, byte, mask=valid_e & (even < coded))
        tl.store(scales_ptr + vg + g, scale, mask=g * GS < coded)

    @triton.jit
    def _unpack_tile(values_ptr, scales_ptr, dst_ptr, base, rem, vg, IS_BF16: tl.constexpr, SOFT: tl.constexpr,
                     FMT: tl.constexpr, GS: tl.constexpr, GS_PAD: tl.constexpr, G: tl.constexpr):
        """Dequantize one tile of one payload into ``dst``: ``rem`` elements from ``base``,
        coded groups from the payload's ``vg``-th (``rem == 0``: nothing)."""
        offs, valid, q, scale, g = _decode_tile(values_ptr, scales_ptr, rem, vg, SOFT, FMT, GS, GS_PAD, G)
        out = _narrow(q * scale[:, None], IS_BF16, SOFT)
        tl.store(dst_ptr + base + offs, out, mask=valid)

    @triton.jit
    def _tile_of(row_ptr, n, n_runs, run_steps, pid, G: tl.constexpr, GS: tl.constexpr, RUNS: tl.constexpr):
        """``(base, rem, vg)`` of program ``pid``'s tile for an unpack (``rem`` 0 for exact groups)."""
        base = pid * (G * GS)
        rem = tl.minimum(n - base, G * GS).to(tl.int32)
        vg = pid * G
        if RUNS:
            base, rem, vg = _run_tile(row_ptr, n_runs, run_steps, pid, G, GS)
            rem = tl.where(vg >= 0, rem, 0)
        return base, rem, vg

    @triton.jit
    def _decode_tile(values_ptr, scales_ptr, rem, vg, SOFT: tl.constexpr, FMT: tl.constexpr, GS: tl.constexpr,
                     GS_PAD: tl.constexpr, G: tl.constexpr):
        """One tile of one payload (``rem`` elements, coded groups from the ``vg``-th): the codes
        as fp32 (``[G, GS_PAD]``) and the scales (those of groups past the tile's end read as 1)."""
        g = tl.arange(0, G)
        j = tl.arange(0, GS_PAD)
        offs = g[:, None] * GS + j[None, :]
        valid = (j[None, :] < GS) & (offs < rem)
        scale = tl.load(scales_ptr + vg + g, mask=g * GS < rem, other=1.0)

        if FMT == 2:
            jb = tl.arange(0, GS_PAD // 2)
            boffs = g[:, None] * (GS // 2) + jb[None, :]
            bmask = (jb[None, :] < GS // 2) & (2 * boffs < rem)
            if GS == GS_PAD:
                if rem == G * GS:  # a whole tile: unmasked, so the bytes load as vectors
                    b = tl.load(values_ptr + vg * (GS // 2) + boffs).to(tl.int32)
                else:
                    b = tl.load(values_ptr + vg * (GS // 2) + boffs, mask=bmask, other=0).to(tl.int32)
            else:
                b = tl.load(values_ptr + vg * (GS // 2) + boffs, mask=bmask, other=0).to(tl.int32)
            lo_q = (b << 28) >> 28  # arithmetic shifts sign-extend each nibble
            hi_q = (b << 24) >> 28
            q = tl.reshape(tl.join(lo_q, hi_q), [G, GS_PAD]).to(tl.float32)
        elif FMT == 1:
            v = tl.load(values_ptr + vg * GS + offs, mask=valid, other=0)
            q = _e4m3_value(v, SOFT)
        else:
            v = tl.load(values_ptr + vg * GS + offs, mask=valid, other=0)
            q = v.to(tl.int8, bitcast=True).to(tl.float32)
        return offs, valid, q, scale, g

    @triton.jit
    def _pack_delta_kernel(
        target_ptr,  # fp32: the master slice
        replica_ptr,  # int16 view of the bf16/fp16 replica slice
        values_ptr,  # uint8
        scales_ptr,  # fp32
        side_ptr,  # int16 view of the side channel
        idx_ptr,  # int64, sorted exact indices
        blk_ptr,  # int64, per program: first index of idx inside its tile; one extra at the end
        runs_ptr,  # int64, one row of _runs_table (RUNS only)
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
        With group runs, a tile of exact groups stores its side elements only (as the weight pack)."""
        pid, base, rem, g = _tile(n, G, GS, GS_PAD)
        vg = pid * G
        if RUNS:
            base, rem, vg = _run_tile(runs_ptr, n_runs, run_steps, pid, G, GS)
        coded = tl.where(vg >= 0, rem, 0)  # elements whose values are stored
        j = tl.arange(0, GS_PAD)
        offs = g[:, None] * GS + j[None, :]
        valid = (j[None, :] < GS) & (offs < rem)
        t_bits = _narrow(tl.load(target_ptr + base + offs, mask=valid, other=0.0), IS_BF16, SOFT)
        r_bits = tl.load(replica_ptr + base + offs, mask=valid, other=0)
        d = _widen(t_bits, IS_BF16) - _widen(r_bits, IS_BF16)
        d = _zero_exact(d, t_bits, side_ptr, idx_ptr, blk_ptr, pid, base, offs, valid, HAS_EXACT, STEPS)
        finite = tl.abs(d) < float("inf")  # false for NaN too
        ok = tl.min(finite.to(tl.int32), axis=1) != 0  # per group
        scale = _scale_of(tl.max(tl.where(finite, tl.abs(d), 0.0), axis=1), QMAX, FLOOR)
        q = tl.where(ok[:, None], _quantized_int(tl.where(finite, d, 0.0), _reciprocal(scale)[:, None]), 0)
        if FMT == 2:
            qe, qo = tl.split(tl.reshape(q, [G, GS_PAD // 2, 2]))
            byte = ((qe & 0xF) | ((qo & 0xF) << 4)).to(tl.uint8)
            jb = tl.arange(0, GS_PAD // 2)
            pair = g[:, None] * (GS // 2) + jb[None, :]
            tl.store(values_ptr + vg * (GS // 2) + pair, byte, mask=(jb[None, :] < GS // 2) & (2 * pair < coded))
        else:
            tl.store(values_ptr + vg * GS + offs, q.to(tl.int8).to(tl.uint8, bitcast=True), mask=valid & (offs < coded))
        tl.store(scales_ptr + vg + g, tl.where(ok, scale, float("nan")), mask=g * GS < coded)

    @triton.jit
    def _unpack_delta_ranks_kernel(
        buf_ptr,  # uint8: the receive buffer, rank r's payload at r * payload_bytes
        flat_ptr,  # int16 view of the bf16/fp16 flat buffer (the replica, updated in place)
        refused_ptr,  # int64, one element: the smallest flat index of a group whose scale is not finite
        n,  # elements of every rank's slice of the chunk
        offset,  # where the chunk starts in every partition
        partition,  # elements of a partition
        payload_bytes,
        scales_offset,
        runs_ptr,  # int64, _runs_table: one row per rank (RUNS only)
        row_len,
        n_runs,
        run_steps,
        IS_BF16: tl.constexpr,
        SOFT: tl.constexpr,
        FMT: tl.constexpr,
        GS: tl.constexpr,
        GS_PAD: tl.constexpr,
        G: tl.constexpr,
        RUNS: tl.constexpr,
    ):
        """Every source rank's delta payload of one chunk added into the replica in place:
        ``r <- RN(fp32(r) + q * scale)`` (compiled without fp contraction, like the pack, so
        the product and the sum round on their own); groups whose scale is not finite keep
        their bits and lower the refusal flag to their flat index. With group runs, rank r's
        runs and scales offset are row r of the table (tiles of exact groups do nothing)."""
        pid = tl.program_id(0).to(tl.int64)
        r = tl.program_id(1).to(tl.int64)
        row_ptr = runs_ptr + r * row_len
        values_ptr = buf_ptr + r * payload_bytes
        if RUNS:
            scales_offset = tl.load(row_ptr)
        scales_ptr = (values_ptr + scales_offset).to(tl.pointer_type(tl.float32), bitcast=True)
        dst_ptr = flat_ptr + (r * partition + offset)
        base, rem, vg = _tile_of(row_ptr, n, n_runs, run_steps, pid, G, GS, RUNS)
        offs, valid, q, scale, g = _decode_tile(values_ptr, scales_ptr, rem, vg, SOFT, FMT, GS, GS_PAD, G)
        ok = tl.abs(scale) < float("inf")
        old = tl.load(dst_ptr + base + offs, mask=valid, other=0)
        new = _narrow(_widen(old, IS_BF16) + q * scale[:, None], IS_BF16, SOFT)
        tl.store(dst_ptr + base + offs, tl.where(ok[:, None], new, old), mask=valid)
        start = r * partition + offset + base + g * GS  # flat index of each group's first element
        first = tl.min(tl.where(ok, tl.full(start.shape, _NOT_REFUSED, tl.int64), start), axis=0)
        if first < _NOT_REFUSED:
            tl.atomic_min(refused_ptr, first)

    @triton.jit
    def _unpack_kernel(
        values_ptr,  # uint8
        scales_ptr,  # fp32
        dst_ptr,  # int16 view of the bf16/fp16 destination
        runs_ptr,  # int64, one row of _runs_table (RUNS only)
        n,
        n_runs,
        run_steps,
        IS_BF16: tl.constexpr,
        SOFT: tl.constexpr,
        FMT: tl.constexpr,
        GS: tl.constexpr,
        GS_PAD: tl.constexpr,
        G: tl.constexpr,
        RUNS: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        base, rem, vg = _tile_of(runs_ptr, n, n_runs, run_steps, pid, G, GS, RUNS)
        _unpack_tile(values_ptr, scales_ptr, dst_ptr, base, rem, vg, IS_BF16, SOFT, FMT, GS, GS_PAD, G)

    @triton.jit
    def _unpack_ranks_kernel(
        buf_ptr,  # uint8: the receive buffer, rank r's payload at r * payload_bytes
        flat_ptr,  # int16 view of the bf16/fp16 flat buffer
        n,  # elements of every rank's slice of the chunk
        offset,  # where the chunk starts in every partition
        partition,  # elements of a partition
        payload_bytes,
        scales_offset,
        runs_ptr,  # int64, _runs_table: one row per rank (RUNS only)
        row_len,
        n_runs,
        run_steps,
        IS_BF16: tl.constexpr,
        SOFT: tl.constexpr,
        FMT: tl.constexpr,
        GS: tl.constexpr,
        GS_PAD: tl.constexpr,
        G: tl.constexpr,
        RUNS: tl.constexpr,
    ):
        """Every source rank's payload of one chunk in one launch: program (i, r) dequantizes
        the i-th tile of rank r's payload into ``flat[r * partition + offset:]``. With group
        runs, rank r's runs and scales offset are row r of the table."""
        pid = tl.program_id(0).to(tl.int64)
        r = tl.program_id(1).to(tl.int64)
        row_ptr = runs_ptr + r * row_len
        values_ptr = buf_ptr + r * payload_bytes
        if RUNS:
            scales_offset = tl.load(row_ptr)
        scales_ptr = (values_ptr + scales_offset).to(tl.pointer_type(tl.float32), bitcast=True)
        dst_ptr = flat_ptr + (r * partition + offset)
        base, rem, vg = _tile_of(row_ptr, n, n_runs, run_steps, pid, G, GS, RUNS)
        _unpack_tile(values_ptr, scales_ptr, dst_ptr, base, rem, vg, IS_BF16, SOFT, FMT, GS, GS_PAD, G)

    @triton.jit
    def _copy_indexed_kernel(src_ptr, dst_ptr, src_idx_ptr, dst_idx_ptr, count, BLOCK: tl.constexpr):
        """``dst[dst_idx[i]] = src[src_idx[i]]`` for ``i < count`` (16-bit raw bits)."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < count
        s = tl.load(src_idx_ptr + i, mask=m, other=0)
        d = tl.load(dst_idx_ptr + i, mask=m, other=0)
        tl.store(dst_ptr + d, tl.load(src_ptr + s, mask=m, other=0), mask=m)


# --------------------------------------------------------------------------- launchers


class _At(NamedTuple):
    """A pointer argument ``byte_offset`` bytes into ``base``'s data, typed ``dtype``: a
    tensor view for Triton's own launch, a plain address for the compiled kernel's."""

    base: torch.Tensor  # contiguous, 1-D
    byte_offset: int
    nbytes: int
    dtype: torch.dtype

    def address(self) -> int:
        return self.base.data_ptr() + self.byte_offset

    def view(self) -> torch.Tensor:
        return self.base.view(torch.uint8)[self.byte_offset : self.byte_offset + self.nbytes].view(self.dtype)


#: Launch compiled kernels directly once Triton's own launch has compiled them for the
#: same arguments' specialization (see :func:`_launch`). Never under the interpreter. Not
#: a setting: the same bytes either way; ``bench/engine_host.py`` turns it off to time
#: Triton's own launch beside it.
FAST_LAUNCH = True

#: ``id(kernel) -> {specialization key: compiled kernel}`` (see :func:`_launch`; the kernels live as long as the module).
_COMPILED: dict = {}
#: Triton's driver calls for the current device and stream, looked up once.
_DRIVER: list = []


def _spec(arg) -> tuple:
    """What Triton specializes a compiled kernel on, for one runtime argument, refined:
    a pointer's element type and whether its address is a multiple of 16; an integer's
    width class, whether it is a multiple of 16 and whether it is 1."""
    if isinstance(arg, _At):
        return (arg.dtype, arg.address() % 16 == 0)
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if type(arg) is int:
        return (-(2**31) <= arg < 2**31, -(2**63) <= arg < 2**63, arg % 16 == 0, arg == 1)
    return (type(arg), arg)  # anything else: its value (never met by this module's launchers)


def _resolve(arg):
    if isinstance(arg, _At):
        return arg.view()
    return arg


def _address(arg):
    if isinstance(arg, _At):
        return arg.address()
    if isinstance(arg, torch.Tensor):
        return arg.data_ptr()
    return arg


def _launch(kernel, grid: tuple, args: tuple, consts: dict, options: dict) -> None:
    """``kernel[grid](*args, **consts, **options)``, cheaper from the second time on.

    Triton's launch (``JITFunction.run``) binds and specializes every argument, builds a
    cache key and looks the compiled kernel up on every call: tens of microseconds of
    host time. Here the compiled kernel that Triton's launch returned is kept under a key
    that refines Triton's own specialization (the constexpr values, the options, the
    current device, and per runtime argument :func:`_spec`), and later launches with
    the same key go straight to it (``compiled[grid](*args, stream=...)``, the launch
    ``JITFunction.run`` itself ends with), with pointers passed as addresses. Any
    launch whose key is new goes through Triton's launch, which compiles what it needs.
    Under the interpreter, or where this Triton's launch does not return a compiled
    kernel with that interface, every launch is Triton's own."""
    grid = tuple(grid) + (1,) * (3 - len(grid))
    if INTERPRET or not FAST_LAUNCH:
        kernel[grid](*map(_resolve, args), **consts, **options)
        return
    if not _DRIVER:
        drv = triton.runtime.driver.active
        _DRIVER.extend((drv.get_current_device, drv.get_current_stream))
    device = _DRIVER[0]()
    key = (device, tuple(consts.items()), tuple(options.items()), tuple(map(_spec, args)))
    cache = _COMPILED.setdefault(id(kernel), {})  # by identity: hashing a JITFunction takes a lock
    compiled = cache.get(key)
    if compiled is not None:
        compiled[grid](*map(_address, args), *consts.values(), stream=_DRIVER[1](device))
        return
    compiled = kernel[grid](*map(_resolve, args), **consts, **options)
    if hasattr(compiled, "result"):  # a compilation future (asynchronous compile mode)
        compiled = compiled.result()
    names = getattr(kernel, "arg_names", None)
    # The compiled kernel takes every argument positionally, constexprs included.
    if names is not None and list(names) == [*names[: len(args)], *consts] and callable(
            getattr(compiled, "__getitem__", None)):
        cache[key] = compiled


def _check(t: torch.Tensor, what: str) -> None:
    if t.dtype not in _IO_DTYPES:
        raise TypeError(f"the Triton kernels take bf16 or fp16 {what}, got {t.dtype}")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{what} must be a contiguous 1-D tensor")


def _payload_sections(buf: torch.Tensor, layout, n: int, group_size: int, fmt, exact_count: int,
                      elem_size: int = 2, runs=None):
    """Pointers to the values (uint8), scales (fp32) and side channel (int16) of the payload
    ``buf`` of a slice of ``n`` elements (``runs``: its coded groups only), after checking
    that ``buf`` and the layout's sections hold them (no views are made)."""
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError("a payload must be a contiguous 1-D uint8 tensor")
    if buf.numel() < layout.nbytes:
        raise ValueError(f"payload buffer has {buf.numel()} bytes, the layout needs {layout.nbytes}")
    if exact_count > layout.exact_numel:
        raise ValueError(f"{exact_count} exact elements do not fit a side channel of {layout.exact_numel}")
    coded, groups = (n, num_groups(n, group_size)) if runs is None else (runs.coded_numel(), runs.coded_groups())
    value_bytes, scale_bytes = fmt.value_bytes(coded), groups * SCALE_BYTES
    if (layout.values_offset + value_bytes > layout.scales_offset or layout.scales_offset + scale_bytes
            > layout.exact_offset or layout.exact_offset + exact_count * elem_size > layout.nbytes):
        raise ValueError(f"{coded} coded elements in {groups} groups and {exact_count} exact elements do not fit "
                         f"the payload layout {layout} (are the group runs missing?)")
    return (_At(buf, layout.values_offset, value_bytes, torch.uint8),
            _At(buf, layout.scales_offset, scale_bytes, torch.float32),
            _At(buf, layout.exact_offset, exact_count * elem_size, torch.int16))


#: ``id(exact_index) -> (weakref to it, launch shape, device, version, runs, idx, blk)``: the
#: per-program tables of an index the caller keeps (the gather plans cache theirs), built once
#: instead of two launches and an allocation per chunk.
_TABLES: dict = {}


def _tile_starts(row, span: int) -> list[int]:
    """Where each tile of one row of group runs starts (tiles of ``span`` elements that never
    cross a run), and the slice's end."""
    starts = [a for lo, hi, _ in row for a in range(lo, hi, span)]
    return starts + [row[-1][1]]


def _exact_tables(exact_index: torch.Tensor | None, shape: _Launch, device: torch.device, runs=None):
    """``(idx, blk)``: the index, and for every program where its tile starts in it (the
    tiles of :func:`_runs_table` when ``runs`` is given, one row)."""
    if exact_index is None or exact_index.numel() == 0:
        return None, None
    hit = _TABLES.get(id(exact_index))
    fresh = not exact_index.is_inference()
    if (fresh and hit is not None and hit[0]() is exact_index and hit[1:4] == (shape, device, exact_index._version)
            and hit[4] is runs):
        return hit[5], hit[6]
    idx = exact_index.to(device=device, dtype=torch.int64)
    if runs is None:
        starts = torch.arange(shape.programs + 1, device=device, dtype=torch.int64) * shape.span
    else:
        starts = torch.tensor(_tile_starts(runs.rows[0], shape.span), dtype=torch.int64).to(device)
    blk = torch.searchsorted(idx, starts)
    if fresh:
        if len(_TABLES) > 4096:  # entries of freed indices: drop them all, rebuild on demand
            _TABLES.clear()
        _TABLES[id(exact_index)] = (weakref.ref(exact_index), shape, device, exact_index._version, runs, idx, blk)
    return idx, blk


class _RunsTable(NamedTuple):
    """Group runs as the kernels read them: one row per payload, ``row_len`` int64 each:
    the payload's scales offset, then per run ``(first program, lo, hi, first coded group)``
    (rows padded to ``n_runs`` runs that no program finds); ``programs``: the most tiles a row has."""

    table: torch.Tensor
    row_len: int
    n_runs: int
    steps: int
    programs: int


def _runs_table(runs, shape: _Launch, device: torch.device) -> _RunsTable:
    """The :class:`_RunsTable` of ``runs`` (:class:`qzero.layout.GroupRuns`) for tiles of
    ``shape``; cached on ``runs``."""
    key = ("triton", shape, device)
    hit = runs._cache.get(key)
    if hit is None:
        n_runs = max(len(row) for row in runs.rows)
        flat, programs = [], 0
        for row, layout in zip(runs.rows, runs.layouts):
            flat.append(layout.scales_offset)
            p = 0
            for lo, hi, first in row:
                flat += [p, lo, hi, first]
                p += -(-(hi - lo) // shape.span)
            flat += [2**62, 0, 0, -1] * (n_runs - len(row))
            programs = max(programs, p)
        table = torch.tensor(flat, dtype=torch.int64).to(device)
        hit = runs._cache[key] = _RunsTable(table, 1 + 4 * n_runs, n_runs, (n_runs - 1).bit_length(), programs)
    return hit


def pack_payload(
    src: torch.Tensor,
    out: torch.Tensor,
    layout,
    group_size: int,
    fmt: str,
    exact_index: torch.Tensor | None,
    runs=None,
) -> None:
    """Kernel twin of :func:`qzero.quant.reference.pack_payload`: same arguments, same bytes.

    ``src`` may also be fp32 (quantized as it is, with no rounding to 16 bits first) when
    it has no exact elements: the kernel then reads the fp32 values directly (FSDP2's
    master shards travel this way)."""
    f = get_format(fmt)
    count = 0 if exact_index is None else exact_index.numel()
    wide = src.dtype == torch.float32
    if wide and count:
        raise ValueError("an fp32 source cannot have exact elements (the side channel holds 16-bit values)")
    if not wide:
        _check(src, "source")
    elif src.dim() != 1 or not src.is_contiguous():
        raise ValueError("source must be a contiguous 1-D tensor")
    n = src.numel()
    values, scales, side = _payload_sections(out, layout, n, group_size, f, count, runs=runs)
    if n == 0:
        return
    has_exact = count > 0
    shape = _launch_shape(n, group_size, has_exact)
    idx, blk = _exact_tables(exact_index, shape, src.device, runs)
    table = None if runs is None else _runs_table(runs, shape, src.device)
    src_bits = src if wide else _At(src, 0, 2 * n, torch.int16)
    _launch(
        _pack_kernel,
        (shape.programs if table is None else table.programs,),
        (src_bits, values, scales, side if has_exact else scales, idx if has_exact else scales,
         blk if has_exact else scales, scales if table is None else table.table, n,
         0 if table is None else table.n_runs, 0 if table is None else table.steps),
        dict(IS_BF16=src.dtype == torch.bfloat16, SOFT=_soft(src.device), PAIRS=not wide and src.data_ptr() % 4 == 0,
             FMT=_FMT_CODES[f.name], QMAX=float(f.qmax), FLOOR=FLT_MIN, GS=group_size, GS_PAD=shape.gs_pad,
             G=shape.groups_per_prog, HAS_EXACT=has_exact, STEPS=shape.search_steps, RUNS=table is not None),
        dict(num_warps=shape.num_warps, **PACK_OPTIONS),
    )


def unpack_payload(
    payload: torch.Tensor,
    dst: torch.Tensor,
    layout,
    group_size: int,
    fmt: str,
    exact_index: torch.Tensor | None,
    runs=None,
) -> None:
    """Kernel twin of :func:`qzero.quant.reference.unpack_payload`: same arguments, same result.

    Exact elements are written back by a scatter right after the dequantizing kernel,
    on the same stream. Doing it inside the kernel (as the pack does its masking) was
    measured slower: the lookup code costs every program registers, while the
    scatter touches only the exact elements (a fraction of a percent of a chunk).
    """
    f = get_format(fmt)
    _check(dst, "destination")
    n = dst.numel()
    count = 0 if exact_index is None else exact_index.numel()
    values, scales, side = _payload_sections(payload, layout, n, group_size, f, count, runs=runs)
    if n == 0:
        return
    shape = _launch_shape(n, group_size, False)
    table = None if runs is None else _runs_table(runs, shape, dst.device)
    _launch(
        _unpack_kernel,
        (shape.programs if table is None else table.programs,),
        (values, scales, _At(dst, 0, 2 * n, torch.int16), scales if table is None else table.table, n,
         0 if table is None else table.n_runs, 0 if table is None else table.steps),
        dict(IS_BF16=dst.dtype == torch.bfloat16, SOFT=_soft(dst.device), FMT=_FMT_CODES[f.name], GS=group_size,
             GS_PAD=shape.gs_pad, G=shape.groups_per_prog, RUNS=table is not None),
        dict(num_warps=shape.num_warps),
    )
    if count:
        dst.view(torch.int16).index_copy_(0, exact_index.to(device=dst.device, dtype=torch.int64), side.view())


#: Exact elements one program of the exact-element scatter copies.
COPY_BLOCK = 1024


def _check_chunk(buf, flat, partition_numel: int, offset: int, numel: int, world: int, layout, runs=None) -> _At:
    """Check a receive buffer, a flat buffer and group runs against one chunk; the flat buffer's 16-bit view."""
    _check(flat, "flat buffer")
    pb = layout.nbytes if runs is None else runs.payload_bytes
    if runs is not None and (len(runs.rows) != world or runs.numel != numel):
        raise ValueError(f"group runs of {len(runs.rows)} payloads of {runs.numel} elements given for {world} of {numel}")
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous() or buf.numel() < world * pb:
        raise ValueError(f"the receive buffer must be a contiguous uint8 tensor of at least {world} x {pb} bytes")
    if flat.numel() != world * partition_numel or not 0 <= offset <= offset + numel <= partition_numel:
        raise ValueError(f"chunk [{offset}, {offset + numel}) does not fit {world} partitions of "
                         f"{partition_numel} in a flat buffer of {flat.numel()}")
    return _At(flat, 0, 2 * flat.numel(), torch.int16)


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
    """Kernel twin of :func:`qzero.quant.reference.unpack_payloads`: every source rank's
    payload of one chunk in one launch (a program per tile and rank), then one scatter of
    every rank's exact elements. The same result as :func:`unpack_payload` per rank."""
    f = get_format(fmt)
    bits = _check_chunk(buf, flat, partition_numel, offset, numel, world, layout, runs)
    if numel == 0:
        return
    shape = _launch_shape(numel, group_size, False)
    programs, per_rank = _ranks_arguments(buf, layout, runs, shape, flat.device)
    _launch(
        _unpack_ranks_kernel,
        (programs, world),
        (buf, bits, numel, offset, partition_numel, *per_rank),
        dict(IS_BF16=flat.dtype == torch.bfloat16, SOFT=_soft(flat.device), FMT=_FMT_CODES[f.name], GS=group_size,
             GS_PAD=shape.gs_pad, G=shape.groups_per_prog, RUNS=runs is not None),
        dict(num_warps=shape.num_warps),
    )
    _scatter_exact(buf, bits, exact)


def _ranks_arguments(buf, layout, runs, shape: _Launch, device) -> tuple[int, tuple]:
    """The programs per rank of a launch over every rank's payload, and the arguments that
    say where each rank's payload sections are: one layout for all, or (with group runs)
    each rank's row of the :class:`_RunsTable`."""
    if runs is None:
        return shape.programs, (layout.nbytes, layout.scales_offset, buf, 0, 0, 0)
    t = _runs_table(runs, shape, device)
    return t.programs, (runs.payload_bytes, 0, t.table, t.row_len, t.n_runs, t.steps)


def _scatter_exact(buf: torch.Tensor, bits: _At, exact) -> None:
    """Every rank's exact elements from their side channels in ``buf`` into the flat buffer (one launch)."""
    if exact is not None and exact[0].numel():
        src_idx, dst_idx = exact
        count = src_idx.numel()
        _launch(
            _copy_indexed_kernel,
            (-(-count // COPY_BLOCK),),
            (_At(buf, 0, buf.numel() // 2 * 2, torch.int16), bits, src_idx, dst_idx, count),
            dict(BLOCK=COPY_BLOCK),
            dict(num_warps=4),
        )


def _check_delta_format(f) -> None:
    if f.name not in ("int4", "int8"):
        raise ValueError(f"a delta payload is int4 or int8, got {f.name!r}")


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
    """Kernel twin of :func:`qzero.quant.reference.pack_delta_payload`: same arguments, same
    bytes, one pass (the fp32 target and the replica are each read once; the difference
    lives in registers only)."""
    f = get_format(fmt)
    _check_delta_format(f)
    _check(replica, "replica")
    n = replica.numel()
    if target.dtype != torch.float32 or target.dim() != 1 or not target.is_contiguous() or target.numel() != n:
        raise ValueError(f"the target must be a contiguous 1-D fp32 tensor of the replica's {n} elements")
    count = 0 if exact_index is None else exact_index.numel()
    values, scales, side = _payload_sections(out, layout, n, group_size, f, count, runs=runs)
    if n == 0:
        return
    has_exact = count > 0
    shape = _launch_shape(n, group_size, has_exact)
    idx, blk = _exact_tables(exact_index, shape, replica.device, runs)
    table = None if runs is None else _runs_table(runs, shape, replica.device)
    _launch(
        _pack_delta_kernel,
        (shape.programs if table is None else table.programs,),
        (target, _At(replica, 0, 2 * n, torch.int16), values, scales, side if has_exact else scales,
         idx if has_exact else scales, blk if has_exact else scales, scales if table is None else table.table, n,
         0 if table is None else table.n_runs, 0 if table is None else table.steps),
        dict(IS_BF16=replica.dtype == torch.bfloat16, SOFT=_soft(replica.device), FMT=_FMT_CODES[f.name],
             QMAX=float(f.qmax), FLOOR=FLT_MIN, GS=group_size, GS_PAD=shape.gs_pad, G=shape.groups_per_prog,
             HAS_EXACT=has_exact, STEPS=shape.search_steps, RUNS=table is not None),
        dict(num_warps=shape.num_warps, **PACK_OPTIONS),
    )


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
    """Kernel twin of :func:`qzero.quant.reference.unpack_delta_payloads`: every source rank's
    delta payload of one chunk added into ``flat`` in place (one launch, a program per tile
    and rank), then one scatter of every rank's exact elements."""
    f = get_format(fmt)
    _check_delta_format(f)
    bits = _check_chunk(buf, flat, partition_numel, offset, numel, world, layout, runs)
    if refused.dtype != torch.int64 or refused.numel() < 1 or refused.device != flat.device:
        raise ValueError("the refusal flag must be an int64 tensor on the flat buffer's device (reference.refusal_flag)")
    if numel == 0:
        return
    shape = _launch_shape(numel, group_size, False)
    programs, per_rank = _ranks_arguments(buf, layout, runs, shape, flat.device)
    _launch(
        _unpack_delta_ranks_kernel,
        (programs, world),
        (buf, bits, refused, numel, offset, partition_numel, *per_rank),
        dict(IS_BF16=flat.dtype == torch.bfloat16, SOFT=_soft(flat.device), FMT=_FMT_CODES[f.name], GS=group_size,
             GS_PAD=shape.gs_pad, G=shape.groups_per_prog, RUNS=runs is not None),
        dict(num_warps=shape.num_warps, **PACK_OPTIONS),
    )
    _scatter_exact(buf, bits, exact)
