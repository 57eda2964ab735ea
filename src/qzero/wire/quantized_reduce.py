"""The quantized gradient exchange: one all-to-all per bucket instead of a reduce-scatter
or reduces (:attr:`qzero.ZeroConfig.zero_quantized_gradients`).

A bucket (or a solo parameter) is cut into *pieces*, one per rank that owns part of it: for a
window (the interleaved order; the contiguous order on more than two ranks or two-level) row
``r`` of the ``[world, width]`` staging buffer goes to rank ``r``; for a flat range (the
contiguous order on two ranks) the range is cut at partition edges. Every rank packs each
piece another rank owns into one payload (:mod:`qzero.quant.gradients`: codes, fp32 scales,
small parameters verbatim in a side channel; groups restart at every piece, so none spans two
owners) and one ``all_to_all_single`` with uneven splits moves them all: a rank sends nothing to
itself and nothing to ranks that own no part of the bucket. The owner then sums, in fp32 and in
rank order, its own piece unquantized and the others' dequantized payloads, and the
reducer averages that into its gradient shard.

With a rotation (:attr:`qzero.ZeroConfig.zero_quantized_gradients_rotation`) every piece
is rotated as it is packed and the owner rotates its sum back once; with error feedback
(:attr:`qzero.ZeroConfig.zero_quantized_gradients_error_feedback`) each pack adds this
rank's residual of the piece (:class:`qzero.optim.error_feedback.ErrorFeedback`) and writes
the new one, in the same pass ([Note: gradient rotation] and the residual in
:mod:`qzero.quant.gradients`).

Transient memory per bucket in flight (see :attr:`qzero.ZeroConfig.reduce_buckets_in_flight`):
the packed payloads (about half the staged bucket for 8-bit codes from bf16, a quarter for
int4), the received ones (``world - 1`` payloads of this rank's piece) and an fp32 sum of this
rank's piece.

Traffic: a rank sends ``bits / 8 + 4 / group_size`` bytes per element (plus exact elements
in the reduce dtype) for the pieces other ranks own, where the plain reduction sends the
reduce dtype's size. A flat range inside one partition is sent straight to its owner by every
rank: at two ranks that is what a reduce moves; at larger worlds the owner's link would carry
``world - 1`` payloads (an incast), which is why the contiguous order reduces windows there
([Note: windows in the contiguous order] in :mod:`qzero.optim.grads`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from .comm import peer_failure
from ..layout.gather_plan import PayloadLayout, clip_ranges, merge_adjacent
from ..layout.gather_planner import aligned_layout
from ..quant import gradient_kernels_for
from ..quant.formats import get_format
from ..vocabulary import INTRA_NODE_GROUP_SIZE


class Piece(NamedTuple):
    """The part of a bucket rank ``dest`` owns: staging ``[offset, offset + numel)`` holds
    flat ``[flat_lo, flat_lo + numel)``, or, where ``flat_lo`` is a tuple of row starts, equal
    rows that lie apart in flat space (row ``k`` at ``flat_lo[k]``); exact ranges are relative
    to the piece."""

    dest: int
    offset: int
    numel: int
    flat_lo: int
    layout: PayloadLayout
    exact: tuple[tuple[int, int], ...]


def plan_pieces(parts, exact_ranges, group_size: int, fmt: str, elem_size: int) -> tuple[Piece, ...]:
    """Pieces of one bucket from ``(dest, offset, numel, flat_lo)`` parts (pure)."""
    f = get_format(fmt)
    out = []
    for dest, offset, numel, flat_lo in parts:
        if numel <= 0:
            continue
        exact = _exact_of(exact_ranges, flat_lo, numel)
        count = sum(b - a for a, b in exact)
        layout = aligned_layout(f.value_bytes(numel), -(-numel // group_size), count, elem_size)
        out.append(Piece(dest, offset, numel, flat_lo, layout, exact))
    return tuple(sorted(out, key=lambda p: p.dest))


def _exact_of(exact_ranges, flat_lo, numel: int) -> tuple[tuple[int, int], ...]:
    """The exact ranges of a piece, relative to it (``flat_lo``: an int, or a tuple of row starts)."""
    if not isinstance(flat_lo, tuple):
        return tuple(clip_ranges(exact_ranges, flat_lo, flat_lo + numel))
    width = numel // len(flat_lo)
    return tuple((a + k * width, b + k * width) for k, row in enumerate(flat_lo)
                 for a, b in clip_ranges(exact_ranges, row, row + width))


class GradientQuantization(NamedTuple):
    """What the reducers need from the config: the group size, the format, the rotation
    block (0: no rotation) and the node stage's format under two-level collectives
    (:attr:`qzero.ZeroConfig.zero_quantized_gradients_intra_node`)."""

    group_size: int
    fmt: str
    rotation: int = 0
    intra_node: str = "none"

    @classmethod
    def from_config(cls, config) -> GradientQuantization | None:
        if not config.zero_quantized_gradients:
            return None
        rotation = (config.zero_quantized_gradients_rotation_block
                    if config.zero_quantized_gradients_rotation == "hadamard" else 0)
        return cls(config.zero_quantized_gradients_group_size, config.zero_quantized_gradients_format, rotation,
                   config.zero_quantized_gradients_intra_node)

    def node_stage(self) -> GradientQuantization | None:
        """The quantization of the two-level node stage, or None where it is plain: ``int8``,
        groups of at most :data:`INTRA_NODE_GROUP_SIZE`, no rotation."""
        if self.intra_node == "none":
            return None
        return GradientQuantization(min(self.group_size, INTRA_NODE_GROUP_SIZE), self.intra_node)


class _Pending(NamedTuple):
    work: object
    send: torch.Tensor
    recv: torch.Tensor
    buf: torch.Tensor
    mine: Piece | None


class QuantizedExchange:
    """Packs, moves and sums the pieces of one flat group's buckets."""

    def __init__(self, group, quant: GradientQuantization, dtype: torch.dtype, error_feedback=None, *,
                 reduce_buckets_in_flight: int):
        self._setup(
            quant, dtype, group.process_group, group.world_size, group.rank, group.device,
            gradient_kernels_for(group.device, group.context.kernels_choice),
            merge_adjacent(sorted((s.start, s.stop) for s in group.layout.slots if s.exact)),
        )
        #: :class:`qzero.optim.error_feedback.ErrorFeedback` of this rank, or None.
        self.error_feedback = error_feedback
        # ZeroConfig.copy_engine_collectives: the all-to-all on the zero-CTA group, its payloads
        # in symmetric memory ([Note: copy-engine collectives] in qzero/wire/copy_engine.py).
        self.copy_engine = group.context.copy_engine
        if self.copy_engine is not None:
            self.pg = self.copy_engine.group
        #: Payload buffer sets reused in turn under copy-engine collectives: one more than the
        #: exchanges its reducer keeps pending (``reduce_buckets_in_flight``).
        self.ring = reduce_buckets_in_flight + 1

    @classmethod
    def over(cls, quant: GradientQuantization, dtype: torch.dtype, process_group, world: int, rank: int,
             device: torch.device, kernels, exact_ranges) -> QuantizedExchange:
        """An exchange over any flat buffer: ``exact_ranges`` (sorted, flat coordinates) are
        carried exactly; ``kernels`` is a :func:`qzero.quant.gradient_kernels_for` module."""
        self = cls.__new__(cls)
        self._setup(quant, dtype, process_group, world, rank, device, kernels, merge_adjacent(sorted(exact_ranges)))
        return self

    def _setup(self, quant, dtype, process_group, world, rank, device, kernels, exact) -> None:
        self.group_size, self.fmt, self.rotation = quant[:3]
        self.error_feedback = None
        self.dtype = dtype
        self.pg = process_group
        self.world, self.rank = world, rank
        self.device = device
        self.kernels = kernels
        self._exact = exact
        self._plans: dict = {}
        self._index: dict = {}
        self.copy_engine = None
        self.ring = None  # only with a copy engine (set by __init__)
        self._launches = 0

    def pieces(self, key, parts) -> tuple[Piece, ...]:
        plan = self._plans.get(key)
        if plan is None:
            plan = plan_pieces(parts, self._exact, self.group_size, self.fmt, self.dtype.itemsize)
            self._plans[key] = plan
        return plan

    def _exact_index(self, key, piece: Piece) -> torch.Tensor | None:
        """Sorted exact indices of a piece (built once, kept: the kernels cache tables by them)."""
        if not piece.exact:
            return None
        k = (key, piece.dest)
        idx = self._index.get(k)
        if idx is None:
            idx = torch.cat([torch.arange(a, b, dtype=torch.int64) for a, b in piece.exact]).to(self.device)
            self._index[k] = idx
        return idx

    def plain_bytes(self, pieces) -> int:
        """What the plain reduction sends for the pieces other ranks own."""
        return sum(p.numel for p in pieces if p.dest != self.rank) * self.dtype.itemsize

    def launch(self, buf: torch.Tensor, key, parts) -> tuple[_Pending, int]:
        """Pack the pieces other ranks own and start the all-to-all; returns the pending
        exchange and the bytes this rank sends."""
        pieces = self.pieces(key, parts)
        send_sizes, recv_sizes = [0] * self.world, [0] * self.world
        mine = None
        for p in pieces:
            if p.dest == self.rank:
                mine = p
                for s in range(self.world):
                    if s != self.rank:
                        recv_sizes[s] = p.layout.nbytes
            else:
                send_sizes[p.dest] = p.layout.nbytes
        send, recv = self._payload_buffers(pieces, sum(send_sizes), sum(recv_sizes))
        at = 0
        for p in pieces:
            if p.dest != self.rank:
                payload = send[at : at + p.layout.nbytes]
                ef = self.error_feedback
                self.kernels.pack_gradient(
                    buf[p.offset : p.offset + p.numel], payload, p.layout, self.group_size, self.fmt,
                    self._exact_index(key, p), self.rotation, None if ef is None else ef.piece(p.flat_lo, p.numel),
                )
                at += p.layout.nbytes
        with peer_failure("the quantized gradient reduction"):
            work = dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=self.pg, async_op=True)
        return _Pending(work, send, recv, buf, mine), send.numel()

    def _payload_buffers(self, pieces, send_bytes: int, recv_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The send and receive buffers of one launch: fresh ones, or with copy-engine
        collectives views into one of ``ring`` reused symmetric slabs (launch ``n`` reuses launch
        ``n - ring``'s, finished by then: the reducers finish in launch order and keep at most
        ``ring - 1`` pending), sized by the largest payload of any rank so that every rank
        grows them alike."""
        if self.copy_engine is None:
            return (torch.empty(send_bytes, dtype=torch.uint8, device=self.device),
                    torch.empty(recv_bytes, dtype=torch.uint8, device=self.device))
        sends = [sum(p.layout.nbytes for p in pieces if p.dest != r) for r in range(self.world)]
        most_recv = max((p.layout.nbytes * (self.world - 1) for p in pieces), default=0)
        ring, self._launches = self._launches % self.ring, self._launches + 1
        send = self.copy_engine.buffers((self, ring, "send"), 1, max(sends, default=0))[0][:send_bytes]
        recv = self.copy_engine.buffers((self, ring, "recv"), 1, most_recv)[0][:recv_bytes]
        return send, recv

    def finish(self, pending: _Pending, key) -> tuple[torch.Tensor, int] | None:
        """Wait, then ``(fp32 sum of this rank's piece, its flat start)``, or None when this
        rank owns no part of the bucket."""
        with peer_failure("the quantized gradient reduction"):
            pending.work.wait()
        p = pending.mine
        if p is None:
            return None
        own = pending.buf[p.offset : p.offset + p.numel]
        out = torch.empty(p.numel, dtype=torch.float32, device=self.device)
        self.kernels.dequantize_sum(
            pending.recv, own, out, p.layout, self.rank, self.world, self.group_size, self.fmt,
            self._exact_index(key, p), self.rotation,
        )
        return out, p.flat_lo
