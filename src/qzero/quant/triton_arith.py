"""The Triton arithmetic every qzero kernel is built from (``@triton.jit`` helpers, no kernels).

The weight, delta and gradient kernels (:mod:`qzero.quant.triton_weights`,
:mod:`qzero.quant.triton_delta`, :mod:`qzero.quant.gradients_triton`) share one quantizer:

* conversions: bf16/fp16 bits to fp32 and back (round to nearest even), fp32 to and from
  e4m3 bit patterns; each with a soft variant (integer and fp32-add arithmetic) for the CPU
  interpreter and GPUs without the hardware conversions (``SOFT``);
* the group arithmetic of :mod:`qzero.quant.reference`: the scale ``max(absmax / qmax,
  FLT_MIN)`` and its reciprocal (both correctly rounded, like torch's tensor division;
  Triton's ``/`` is not), ``x * inv`` (one rounding), the integer rounding half to even;
* where a program's tile lies: without group runs tile ``i`` is groups ``[i G, (i + 1) G)``;
  with group runs (a ``PER_RANK`` chunk, see ``[Note: exact groups]`` in :mod:`qzero.layout.gather_plan`)
  the slice is cut into tiles that never cross a run (one row of ``(first program, lo, hi,
  first coded group)`` per run, :class:`qzero.quant.triton_launch.RunsTable`), and each
  program finds its run by a binary search over the few runs (:func:`_run_tile`);
* exact elements without any per-element mask buffer: ``exact_index`` is sorted and unique,
  so one ``searchsorted`` gives, for every program, the slice of ``exact_index`` that falls in
  its tile (one int64 per program); only programs whose slice is non-empty walk it, run by
  run (a run is typically one small parameter), which also yields each exact element's
  position in the side channel (:func:`_exact_runs`);
* the decoding of one tile of a payload (:func:`_decode_tile`).
"""

from __future__ import annotations

from .triton_launch import RUN_ALIGN as _RUN_ALIGN
from .triton_launch import tl, triton

if triton is not None:
    RUN_ALIGN = tl.constexpr(_RUN_ALIGN)

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
        # A run starts on a group boundary and group sizes are multiples of 8 (RunsTable checks
        # it). Telling the compiler lets the packs and the unpacks load and store 16-byte
        # vectors (benchmarks/reports/kernels-h200.md). The unpacks store their whole tiles
        # unmasked: with masked stores the hint made the weight unpack slower than without it.
        lo = tl.multiple_of(tl.load(run + 1), RUN_ALIGN)
        base = lo + t * (G * GS)
        rem = tl.minimum(tl.maximum(tl.load(run + 2) - base, 0), G * GS).to(tl.int32)
        first = tl.load(run + 3)
        vg = tl.where(first >= 0, first + t * G, -1)
        return base, rem, vg


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
