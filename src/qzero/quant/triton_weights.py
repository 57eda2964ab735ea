"""Triton kernels of weight payloads: one rank's chunk payload packed and unpacked in one pass.

Same contract and the same bytes as :func:`qzero.quant.reference.pack_payload`,
:func:`~qzero.quant.reference.unpack_payload` and :func:`~qzero.quant.reference.unpack_payloads`
(:class:`WeightKernels`; the arithmetic they share with the delta and gradient kernels is
:mod:`qzero.quant.triton_arith`, how they are launched :mod:`qzero.quant.triton_launch`):

* ``pack``: read the bf16/fp16 slice once; zero its exact elements (copying their raw bits
  into the side channel); per group take the absmax, the scale ``max(absmax / qmax,
  FLT_MIN)`` and its reciprocal ``inv = 1 / scale``, then per element ``y = x * inv``; round
  and store values and scales. The pack is compiled without fp contraction
  (:data:`~qzero.quant.triton_launch.PACK_OPTIONS`), so ``x * inv`` stays a multiplication
  of its own, as in the reference, and is never fused into an fma with the rounding's add.
* ``unpack``: read values and scales, write ``q * scale`` (fp32, one rounding) straight into
  the bf16/fp16 destination; exact elements are then put back from the side channel by a
  scatter on the same stream. The gather unpacks every source rank's payload of a chunk in
  one launch (a 2-D grid: tiles x ranks, :meth:`WeightKernels.unpack_payloads`; the same
  kernel unpacks a single payload, and adds delta payloads into the replica,
  :mod:`qzero.quant.triton_delta`) and puts all their exact elements back with one more
  (indices precomputed once per plan): two launches per chunk, whatever the world size.

Group runs (a ``PER_RANK`` chunk): the payload holds the coded groups only. A tile of coded
groups reads and writes its values and scales at its first coded group; a tile of exact
groups still copies its side elements, and writes no values and no scales (its unpack does
nothing: the exact-element scatter writes all of it). The arithmetic per tile is the same
either way, so the bytes are the reference's.
"""

from __future__ import annotations

import torch

from .formats import SCALE_BYTES, get_format
from .reference import FLT_MIN, NOT_REFUSED, num_groups
from .triton_launch import FMT_CODES, PACK_OPTIONS, At, Launcher, LaunchShape, tl, triton

_IO_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}

if triton is not None:
    from .triton_arith import (
        _decode_tile,
        _e4m3_bits,
        _load_masked,
        _mask_exact,
        _narrow,
        _quantized_int,
        _reciprocal,
        _run_tile,
        _scale_of,
        _tile,
        _tile_of,
        _times_reciprocal,
        _widen,
    )

    _NOT_REFUSED = tl.constexpr(NOT_REFUSED)

    @triton.jit
    def _pack_kernel(
        src_ptr,  # int16 view of the bf16/fp16 slice, or the fp32 slice itself
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
                     FMT: tl.constexpr, GS: tl.constexpr, GS_PAD: tl.constexpr, G: tl.constexpr, FULL: tl.constexpr):
        """Dequantize one tile of one payload into ``dst``: ``rem`` elements from ``base``,
        coded groups from the payload's ``vg``-th (``rem == 0``: nothing); ``FULL``: ``rem == G * GS``
        and ``GS == GS_PAD``, so ``dst`` is written without bounds masks (16-byte vectors)."""
        offs, valid, q, scale, g = _decode_tile(values_ptr, scales_ptr, rem, vg, SOFT, FMT, GS, GS_PAD, G)
        out = _narrow(q * scale[:, None], IS_BF16, SOFT)
        if FULL:
            tl.store(dst_ptr + base + offs, out)
        else:
            tl.store(dst_ptr + base + offs, out, mask=valid)


    @triton.jit
    def _unpack_ranks_kernel(
        buf_ptr,  # uint8: the receive buffer, rank r's payload at r * payload_bytes
        flat_ptr,  # int16 view of the bf16/fp16 flat buffer (DELTA: the replica, updated in place)
        refused_ptr,  # DELTA: int64, one element: the smallest flat index of a group whose scale is not finite
        n,  # elements of every rank's slice of the chunk
        offset,  # where the chunk starts in every partition
        partition,  # elements of a partition
        payload_bytes,
        scales_offset,
        runs_ptr,  # int64, RunsTable: one row per rank (RUNS only)
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
        DELTA: tl.constexpr,
    ):
        """Every source rank's payload of one chunk in one launch: program (i, r) decodes the
        i-th tile of rank r's payload into ``flat[r * partition + offset:]``. Weights are
        written; with ``DELTA`` ([Note: delta payload]) differences are added into the replica
        in place, ``r <- RN(fp32(r) + q * scale)`` (launched without fp contraction, like the
        pack, so the product and the sum round on their own), and groups whose scale is not
        finite keep their bits and lower the refusal flag to their flat index. With group runs,
        rank r's runs and scales offset are row r of the table (tiles of exact groups do nothing)."""
        pid = tl.program_id(0).to(tl.int64)
        r = tl.program_id(1).to(tl.int64)
        row_ptr = runs_ptr + r * row_len
        values_ptr = buf_ptr + r * payload_bytes
        if RUNS:
            scales_offset = tl.load(row_ptr)
        scales_ptr = (values_ptr + scales_offset).to(tl.pointer_type(tl.float32), bitcast=True)
        dst_ptr = flat_ptr + (r * partition + offset)
        base, rem, vg = _tile_of(row_ptr, n, n_runs, run_steps, pid, G, GS, RUNS)
        if DELTA:
            if GS == GS_PAD:
                if rem == G * GS:
                    _add_delta_tile(values_ptr, scales_ptr, dst_ptr, refused_ptr, r * partition + offset, base, rem,
                                    vg, IS_BF16, SOFT, FMT, GS, GS_PAD, G, True)
                else:
                    _add_delta_tile(values_ptr, scales_ptr, dst_ptr, refused_ptr, r * partition + offset, base, rem,
                                    vg, IS_BF16, SOFT, FMT, GS, GS_PAD, G, False)
            else:
                _add_delta_tile(values_ptr, scales_ptr, dst_ptr, refused_ptr, r * partition + offset, base, rem, vg,
                                IS_BF16, SOFT, FMT, GS, GS_PAD, G, False)
        elif GS == GS_PAD:
            if rem == G * GS:
                _unpack_tile(values_ptr, scales_ptr, dst_ptr, base, rem, vg, IS_BF16, SOFT, FMT, GS, GS_PAD, G, True)
            else:
                _unpack_tile(values_ptr, scales_ptr, dst_ptr, base, rem, vg, IS_BF16, SOFT, FMT, GS, GS_PAD, G, False)
        else:
            _unpack_tile(values_ptr, scales_ptr, dst_ptr, base, rem, vg, IS_BF16, SOFT, FMT, GS, GS_PAD, G, False)

    @triton.jit
    def _add_delta_tile(values_ptr, scales_ptr, dst_ptr, refused_ptr, first_flat, base, rem, vg,
                        IS_BF16: tl.constexpr, SOFT: tl.constexpr, FMT: tl.constexpr, GS: tl.constexpr,
                        GS_PAD: tl.constexpr, G: tl.constexpr, FULL: tl.constexpr):
        """One tile of a delta payload added into the replica ``dst`` (``first_flat``: the flat
        index of ``dst[0]``); ``FULL``: ``rem == G * GS`` and ``GS == GS_PAD``, so the replica is
        read and written without bounds masks (16-byte vectors)."""
        offs, valid, q, scale, g = _decode_tile(values_ptr, scales_ptr, rem, vg, SOFT, FMT, GS, GS_PAD, G)
        ok = tl.abs(scale) < float("inf")
        if FULL:
            old = tl.load(dst_ptr + base + offs)
        else:
            old = tl.load(dst_ptr + base + offs, mask=valid, other=0)
        new = tl.where(ok[:, None], _narrow(_widen(old, IS_BF16) + q * scale[:, None], IS_BF16, SOFT), old)
        if FULL:
            tl.store(dst_ptr + base + offs, new)
        else:
            tl.store(dst_ptr + base + offs, new, mask=valid)
        start = first_flat + base + g * GS  # flat index of each group's first element
        first = tl.min(tl.where(ok, tl.full(start.shape, _NOT_REFUSED, tl.int64), start), axis=0)
        if first < _NOT_REFUSED:
            tl.atomic_min(refused_ptr, first)

    @triton.jit
    def _copy_indexed_kernel(src_ptr, dst_ptr, src_idx_ptr, dst_idx_ptr, count, BLOCK: tl.constexpr):
        """``dst[dst_idx[i]] = src[src_idx[i]]`` for ``i < count`` (16-bit raw bits)."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < count
        s = tl.load(src_idx_ptr + i, mask=m, other=0)
        d = tl.load(dst_idx_ptr + i, mask=m, other=0)
        tl.store(dst_ptr + d, tl.load(src_ptr + s, mask=m, other=0), mask=m)


# --------------------------------------------------------------------------- launchers

#: Exact elements one program of the exact-element scatter copies.
COPY_BLOCK = 1024


def check_io(t: torch.Tensor, what: str) -> None:
    """A 16-bit tensor the kernels read or write: bf16/fp16, contiguous, 1-D."""
    if t.dtype not in _IO_DTYPES:
        raise TypeError(f"the Triton kernels take bf16 or fp16 {what}, got {t.dtype}")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{what} must be a contiguous 1-D tensor")


def payload_sections(buf: torch.Tensor, layout, n: int, group_size: int, fmt, exact_count: int,
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
    return (At(buf, layout.values_offset, value_bytes, torch.uint8),
            At(buf, layout.scales_offset, scale_bytes, torch.float32),
            At(buf, layout.exact_offset, exact_count * elem_size, torch.int16))


def check_chunk(buf, flat, partition_numel: int, offset: int, numel: int, world: int, layout, runs=None) -> At:
    """Check a receive buffer, a flat buffer and group runs against one chunk; the flat buffer's 16-bit view."""
    check_io(flat, "flat buffer")
    pb = layout.nbytes if runs is None else runs.payload_bytes
    if runs is not None and (len(runs.rows) != world or runs.numel != numel):
        raise ValueError(f"group runs of {len(runs.rows)} payloads of {runs.numel} elements given for "
                         f"{world} of {numel}")
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous() or buf.numel() < world * pb:
        raise ValueError(f"the receive buffer must be a contiguous uint8 tensor of at least {world} x {pb} bytes")
    if flat.numel() != world * partition_numel or not 0 <= offset <= offset + numel <= partition_numel:
        raise ValueError(f"chunk [{offset}, {offset + numel}) does not fit {world} partitions of "
                         f"{partition_numel} in a flat buffer of {flat.numel()}")
    return At(flat, 0, 2 * flat.numel(), torch.int16)


def tile_arguments(launcher: Launcher, runs, shape: LaunchShape, device) -> tuple[int, tuple]:
    """The programs of a one-slice launch and its group-run arguments ``(table, n_runs,
    steps)`` (``table`` None without runs: the caller passes any pointer in its place)."""
    if runs is None:
        return shape.programs, (None, 0, 0)
    t = launcher.runs_table(runs, shape, device)
    return t.programs, (t.table, t.n_runs, t.steps)


def unpack_ranks(launcher: Launcher, buf, bits: At, refused, partition_numel: int, offset: int, numel: int,
                 world: int, layout, group_size: int, f, exact, runs, dtype: torch.dtype, device, delta: bool) -> None:
    """One launch of :func:`_unpack_ranks_kernel` over every rank's payload of a chunk (``delta``:
    added into the replica, ``refused`` the flag), then one scatter of every rank's exact elements."""
    shape = launcher.shape(numel, group_size, False)
    if runs is None:
        programs, per_rank = shape.programs, (layout.nbytes, layout.scales_offset, buf, 0, 0, 0)
    else:
        t = launcher.runs_table(runs, shape, device)
        programs, per_rank = t.programs, (runs.payload_bytes, 0, t.table, t.row_len, t.n_runs, t.steps)
    launcher.launch(
        _unpack_ranks_kernel,
        (programs, world),
        (buf, bits, buf if refused is None else refused, numel, offset, partition_numel, *per_rank),
        dict(IS_BF16=dtype == torch.bfloat16, SOFT=launcher.soft(device), FMT=FMT_CODES[f.name], GS=group_size,
             GS_PAD=shape.gs_pad, G=shape.groups_per_prog, RUNS=runs is not None, DELTA=delta),
        dict(num_warps=shape.num_warps, **(PACK_OPTIONS if delta else {})),
    )
    if exact is not None and exact[0].numel():
        src_idx, dst_idx = exact
        count = src_idx.numel()
        launcher.launch(
            _copy_indexed_kernel,
            (-(-count // COPY_BLOCK),),
            (At(buf, 0, buf.numel() // 2 * 2, torch.int16), bits, src_idx, dst_idx, count),
            dict(BLOCK=COPY_BLOCK),
            dict(num_warps=4),
        )


class WeightKernels:
    """The weight-payload kernels of a :class:`qzero.quant.triton.TritonKernels`, launched
    through its ``launcher`` (a :class:`~qzero.quant.triton_launch.Launcher`)."""

    launcher: Launcher

    def pack_payload(self, src: torch.Tensor, out: torch.Tensor, layout, group_size: int, fmt: str,
                     exact_index: torch.Tensor | None, runs=None) -> None:
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
            check_io(src, "source")
        elif src.dim() != 1 or not src.is_contiguous():
            raise ValueError("source must be a contiguous 1-D tensor")
        n = src.numel()
        values, scales, side = payload_sections(out, layout, n, group_size, f, count, runs=runs)
        if n == 0:
            return
        has_exact = count > 0
        launcher = self.launcher
        shape = launcher.shape(n, group_size, has_exact)
        idx, blk = launcher.exact_tables(exact_index, shape, src.device, runs)
        programs, (table, n_runs, steps) = tile_arguments(launcher, runs, shape, src.device)
        launcher.launch(
            _pack_kernel,
            (programs,),
            ((src if wide else At(src, 0, 2 * n, torch.int16)), values, scales, side if has_exact else scales,
             idx if has_exact else scales, blk if has_exact else scales, scales if table is None else table, n,
             n_runs, steps),
            dict(IS_BF16=src.dtype == torch.bfloat16, SOFT=launcher.soft(src.device),
                 PAIRS=not wide and src.data_ptr() % 4 == 0, FMT=FMT_CODES[f.name], QMAX=float(f.qmax),
                 FLOOR=FLT_MIN, GS=group_size, GS_PAD=shape.gs_pad, G=shape.groups_per_prog, HAS_EXACT=has_exact,
                 STEPS=shape.search_steps, RUNS=table is not None),
            dict(num_warps=shape.num_warps, **PACK_OPTIONS),
        )

    def unpack_payload(self, payload: torch.Tensor, dst: torch.Tensor, layout, group_size: int, fmt: str,
                       exact_index: torch.Tensor | None, runs=None) -> None:
        """Kernel twin of :func:`qzero.quant.reference.unpack_payload`: same arguments, same result.

        Exact elements are written back by a scatter right after the dequantizing kernel,
        on the same stream. Doing it inside the kernel (as the pack does its masking) was
        measured slower: the lookup code costs every program registers, while the
        scatter touches only the exact elements (a fraction of a percent of a chunk).
        """
        f = get_format(fmt)
        check_io(dst, "destination")
        n = dst.numel()
        count = 0 if exact_index is None else exact_index.numel()
        side = payload_sections(payload, layout, n, group_size, f, count, runs=runs)[2]
        if n == 0:
            return
        if any(lay.values_offset for lay in ((layout,) if runs is None else runs.layouts)):
            raise ValueError("the Triton unpack reads a payload's values from its first byte "
                             "(as the plans lay them out)")
        # the all-ranks unpack with one rank: ``dst`` is that rank's whole partition
        unpack_ranks(self.launcher, payload, At(dst, 0, 2 * n, torch.int16), None, n, 0, n, 1, layout, group_size, f,
                     None, runs, dst.dtype, dst.device, delta=False)
        if count:
            dst.view(torch.int16).index_copy_(0, exact_index.to(device=dst.device, dtype=torch.int64), side.view())

    def unpack_payloads(self, buf: torch.Tensor, flat: torch.Tensor, partition_numel: int, offset: int, numel: int,
                        world: int, layout, group_size: int, fmt: str,
                        exact: tuple[torch.Tensor, torch.Tensor] | None, runs=None) -> None:
        """Kernel twin of :func:`qzero.quant.reference.unpack_payloads`: every source rank's
        payload of one chunk in one launch (a program per tile and rank), then one scatter of
        every rank's exact elements. The same result as :meth:`unpack_payload` per rank."""
        f = get_format(fmt)
        bits = check_chunk(buf, flat, partition_numel, offset, numel, world, layout, runs)
        if numel == 0:
            return
        unpack_ranks(self.launcher, buf, bits, None, partition_numel, offset, numel, world, layout, group_size, f,
                     exact, runs, flat.dtype, flat.device, delta=False)
