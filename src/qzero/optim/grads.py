"""Gradient strategies: how each rank ends up with the averaged fp32 gradient of its partition.

A *reducer* says what a gradient bucket is and which collective moves it:

* :class:`ScatterReducer` (interleaved flat order, and quantized gradients in the contiguous
  order where owners would be an incast): a bucket is the same window of every partition,
  staged as ``[world, width]`` and reduce-scattered, so every rank sends and receives at once
  and both directions of the link carry data. With ``solo_reduce``, a
  parameter that starts a partition and spans several windows (the embedding) is reduced
  to its owner on its own instead (see :attr:`qzero.ZeroConfig.solo_reduce` for the cost).
* :class:`OwnerReducer` (contiguous flat order): a bucket is a contiguous flat range,
  reduced to the rank(s) whose partitions it overlaps, one ``reduce`` per owner. In this
  order a window of every partition spans far-apart parts of the model, so windows would
  fill only at the end of backward; flat ranges fill in backward order.

Either way each owner adds its part (in fp32, divided by the world size) into its
gradient shard. With :attr:`qzero.ZeroConfig.zero_quantized_gradients` the same buckets
(and solo parameters) travel instead as quantized pieces in one all-to-all each
(:mod:`qzero.wire.quantized_reduce`), at the same points of the step.

[Note: windows in the contiguous order] A quantized flat range of the contiguous order goes to
its one or two owners from every rank at once: on more than two ranks an incast on the
owners' links, and over two-level collectives no exchange that spreads over the nodes. So there
(on more than two ranks, or two-level) quantized gradients are reduced in windows as in the
interleaved order: window ``k`` is local ``[k w, (k+1) w)`` of every partition, and every rank
sends and receives the same. The cost is time and memory: partition 0 holds the model's first
layers, whose gradients come last in backward, so every window completes only at the end of
backward (in its last ``1/world``, as partition 0's gradients arrive). The reduction then runs
after backward (almost nothing of it overlaps backward; the plan counts none), and in
stage 2 the windows' staging holds up to the whole gradient in the reduce dtype until then
(what stage 1's gradient buffer holds). The interleaved order overlaps it, where its padding is
small (``flat_order='auto'`` picks by padding; :func:`qzero.optim.flat.order_warning` says
which cost a run pays). On two ranks the owner is the other rank: flat ranges stay, and overlap.

[Note: landing shard] In stage 2 a plain reduction in a 16-bit reduce dtype does not add
each bucket's sum into the fp32 gradient shard as it arrives. The sums land, in the reduce
dtype, in a *landing shard* of the partition's size (a reduce-scatter writes straight into
it), which exists from the backward's first reduction to its end; there every element
(landed exactly once per backward) is added into the fp32 shard, divided by the world size,
with the same fp32 operations as a direct add, in bounded chunks. The backward, where a
step's memory peaks, then holds half the bytes for the gradient shard (bf16 instead of
fp32); the fp32 shard is made after it, when the activations are gone. Quantized reductions
(their sums are fp32 already), an fp32 reduce dtype and stage 1 add directly.

The two stages differ only in *when*:

* :class:`Stage1Grads` keeps a full gradient buffer (parameters' ``.grad`` are views
  into it) and reduces it once, at ``step()``, after all micro-batches.
* :class:`Stage2Grads` reduces each bucket once backward has produced all its gradients
  (overlapping backward), in an order every rank shares ([Note: one launch order]), then
  frees the parameter gradients: only the gradient shard (during backward its landing shard,
  see the note; from the end of a backward until ``zero_grad`` the fp32 shard) and at most a
  few staged buckets exist. With gradient accumulation this reduces (and, quantized,
  quantizes) every micro-batch: stage 2 keeps no full gradient to reduce once at the
  end. Quantization errors of the micro-batches then add up in the fp32 shard (each
  element is still quantized once per reduction, never re-quantized); stage 1 quantizes
  once per optimizer step.

Either way at most :attr:`qzero.ZeroConfig.reduce_buckets_in_flight` collectives stay
pending: a launch that leaves one more finishes the oldest (reductions finish
in launch order; the new one is issued first), and the compute stream waits for it there.

Every reducer counts what it sent since the last :meth:`take_stats` (:class:`ReduceStats`).

[Note: counted hooks] A stage-2 bucket is sent once every parameter in it has its gradient,
and a parameter's gradient hook (``register_post_accumulate_grad_hook``) can fire more than
once in one backward: a parameter shared by two blocks under reentrant activation
checkpointing (each block's backward is a backward of its own), and the like. So a bucket
does not wait for one firing per parameter but for the number of firings the first backward
delivered, the most of any rank (learned with the launch order, in the same all-gather).
Firings beyond that still join the sum while their bucket is unsent. The first backward
does not know the counts: when its graph holds a reentrant checkpoint (a
``CheckpointFunctionBackward`` node) it launches nothing before its end (its staged buckets
then hold the whole gradient in the reduce dtype for that one backward, as stage 1 does);
otherwise it launches as the counts of one allow. A firing that comes after its bucket was
sent (a later backward that uses a parameter more often than the first did) cannot join the
sum: it is recorded, and the next ``step()`` refuses on every rank (the model guard's
exchange carries the refusal), naming the parameter, before any update.

[Note: gradients outside opt.backward] The hooks act only inside ``opt.backward``. A
gradient from a plain ``loss.backward()`` is left in ``.grad`` as torch made it (stage 2)
or added to the gradient buffer (stage 1), and the parameter is recorded: ``step()`` and the
next ``backward()`` refuse, naming it, until ``zero_grad()`` drops it. Before, stage 2
reduced such a gradient into buckets that nothing finished, and the next step sent stale
or partial buckets.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..wire.comm import all_gather_into, peer_failure
from ..wire.labels import REDUCE_GRADIENTS, label
from ..buckets import bucket_pieces, owners, plan_reduce_buckets, plan_scatter_buckets, scatter_pieces, solo_slots
from .flat import FlatGroup
from ..wire.quantized_reduce import GradientQuantization, QuantizedExchange
from ..wire.two_level import TwoLevelReduce
from ..quant import gradient_kernels_for

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: Elements of the landing shard added into the fp32 shard at a time (a 16 MiB fp32 temporary).
FOLD_CHUNK = 1 << 22


def reduce_dtype_of(name: str | None, param_dtype: torch.dtype) -> torch.dtype:
    return param_dtype if name is None else _DTYPES[name]


class ReduceStats(NamedTuple):
    """Gradient traffic of one flat group since the previous optimizer step, as counted on
    this rank (``ZeroOptimizer.last_reduce``)."""

    bytes_sent: int
    """Bytes this rank sent: quantized payloads, or the reduce dtype's elements."""
    plain_bytes: int
    """What the plain reduction sends for the same buckets: the elements other ranks own, in
    the reduce dtype (a ring reduce-scatter moves the same volume per rank)."""
    collectives: int
    """Collectives issued (buckets and solo parameters, over all micro-batches)."""
    quantized: bool
    bytes_across_nodes: int = 0
    """Of :attr:`bytes_sent`, what crosses the network between nodes (a ring collective's share
    counted as NCCL's node-contiguous ring moves it: one edge of ``L`` per node crosses)."""


def make_reducer(
    group: FlatGroup, reduce_bucket_size: int, solo: bool = False, quant: GradientQuantization | None = None,
    dtype: torch.dtype | None = None, error_feedback=None, *, reduce_buckets_in_flight: int, two_level=None,
):
    """The reducer that fits the group's flat order (``solo``: :attr:`ZeroConfig.solo_reduce`;
    ``quant``: quantized pieces in the reduce dtype ``dtype`` instead of plain collectives;
    ``error_feedback``: this rank's :class:`qzero.optim.error_feedback.ErrorFeedback` of the group;
    ``reduce_buckets_in_flight``: the most collectives its user keeps pending; ``two_level``: the
    :class:`qzero.wire.two_level.TwoLevelGroups` of two-level collectives, or None)."""
    if group.layout.order == "interleaved":
        return ScatterReducer(group, reduce_bucket_size, solo, quant, dtype, error_feedback,
                              reduce_buckets_in_flight=reduce_buckets_in_flight, two_level=two_level)
    if quant is not None and (two_level is not None or group.world_size > 2):
        # [Note: windows in the contiguous order]; solo_reduce is the interleaved order's
        return ScatterReducer(group, reduce_bucket_size, False, quant, dtype, error_feedback,
                              reduce_buckets_in_flight=reduce_buckets_in_flight, two_level=two_level)
    return OwnerReducer(group, reduce_bucket_size, quant, dtype, error_feedback,
                        reduce_buckets_in_flight=reduce_buckets_in_flight, two_level=two_level)


class _Reducer:
    def __init__(self, group: FlatGroup, quant: GradientQuantization | None, dtype: torch.dtype | None,
                 error_feedback=None, *, reduce_buckets_in_flight: int, two_level=None):
        self.group = group
        self.pg = group.process_group
        self.world = group.world_size
        self.p = group.layout.partition_numel
        # the global rank that owns each partition (with two-level collectives, rail-major)
        owner = group.topology.rank_of
        self._ranks = (
            [dist.get_global_rank(self.pg, owner(q)) for q in range(self.world)]
            if self.pg is not None and self.world > 1
            else [owner(q) for q in range(self.world)]
        )
        self.two_level = None
        # One rank has nothing to send: the plain path is already exact there.
        if two_level is not None and self.world > 1:
            inner = node = None
            if quant is not None:
                t = two_level.topology
                kernels = gradient_kernels_for(group.device, group.context.kernels_choice)
                exact = [(s.start, s.stop) for s in group.layout.slots if s.exact]
                node_quant = quant.node_stage()
                if node_quant is not None:  # the rail then quantizes the node's fp32 sums
                    node = QuantizedExchange.over(node_quant, dtype, two_level.node_group, t.ranks_per_node,
                                                  two_level.local, group.device, kernels, exact)
                inner = QuantizedExchange.over(quant, dtype if node is None else torch.float32, two_level.rail_group,
                                               t.nodes, two_level.node, group.device, kernels, exact)
                inner.error_feedback = error_feedback
            self.two_level = TwoLevelReduce(two_level, self.p, inner, node)
            self.quant = None
        else:
            self.quant = (QuantizedExchange(group, quant, dtype, error_feedback,
                                            reduce_buckets_in_flight=reduce_buckets_in_flight)
                          if quant is not None and self.world > 1 else None)
        self._quantized = quant is not None and self.world > 1
        self._sent = self._plain = self._collectives = 0
        self._inter = 0
        self._padding = None  # this rank's padding ranges in its shard, once asked for
        #: Plain sums land in the landing shard (see [Note: landing shard]); set by Stage2Grads.
        self.use_landing = False
        self.landing_dtype = dtype if dtype is not None else group.dtype
        self._landing_shard: torch.Tensor | None = None

    def take_stats(self) -> ReduceStats:
        """What was sent since the previous call, and start counting afresh."""
        stats = ReduceStats(self._sent, self._plain, self._collectives, self._quantized, self._inter)
        self._sent = self._plain = self._collectives = self._inter = 0
        return stats

    @property
    def quantized(self) -> bool:
        """Whether the sums arrive quantized (fp32), not in the reduce dtype."""
        return self._quantized

    def _count(self, sent: int, plain: int, inter: int = 0) -> None:
        self._sent += sent
        self._plain += plain
        self._inter += inter
        self._collectives += 1

    def _ring_inter(self, sent: int) -> int:
        """A flat ring collective's bytes that cross nodes, per rank on average."""
        t = self.group.topology
        return sent // t.ranks_per_node if t.nodes > 1 else 0

    def _plain_count(self, pieces, elem_size: int) -> None:
        """Count a plain collective over ``(rank, numel)`` pieces."""
        mine = self.group.rank
        n = sum(numel for r, numel in pieces if r != mine) * elem_size
        self._count(n, n, self._ring_inter(n))

    def _launch_quantized(self, buf: torch.Tensor, key, parts):
        pending, sent = self.quant.launch(buf, key, parts)
        pieces = self.quant.pieces(key, parts)
        t, me = self.group.topology, self.group.topology.node_of(self.group.pg_rank)
        inter = sum(p.layout.nbytes for p in pieces if p.dest != self.group.rank and t.node_of(t.rank_of(p.dest)) != me)
        self._count(sent, self.quant.plain_bytes(pieces), inter)
        return pending

    def _launch_two_level(self, buf: torch.Tensor, bucket):
        tl = self.two_level
        b = tl.launch(buf, bucket.index, bucket.width, bucket.lo)
        rail = tl.rail_bytes(b)
        plain = (self.world - 1) * bucket.width * buf.element_size()
        self._count(tl.node_bytes(b) + rail, plain, rail)
        return b

    def _finish_two_level(self, b, bucket) -> None:
        out = self.two_level.finish(b)
        lo = self.group.rank * self.p + bucket.lo
        self._add_to_shard(out, lo, lo + bucket.width)

    def _finish_quantized(self, pending, key) -> None:
        res = self.quant.finish(pending, key)
        if res is not None:
            out, lo = res
            self._add_to_shard(out, lo, lo + out.numel())

    def pieces_of(self, bucket, slot) -> list[tuple[int, int, int]]:
        """``(a, b, offset)``: the slot's elements ``[a, b)`` (relative to the slot) go to the
        bucket's staging buffer at ``offset``."""
        return [(a - slot.start, b - slot.start, off) for a, b, off in self._places(bucket, slot.start, slot.stop)]

    def _add_to_shard(self, part: torch.Tensor, lo: int, hi: int) -> None:
        """Add the summed gradient of flat ``[lo, hi)`` to this rank's shard, where they overlap
        (with ``use_landing``: put it in the landing shard, added by :meth:`fold_landing`)."""
        g = self.group
        a, b = max(lo, g.lo), min(hi, g.hi)
        if a >= b:
            return
        if self.use_landing:  # parts are in the 16-bit reduce dtype there
            dst = self.landing()[a - g.lo : b - g.lo]
            if dst.data_ptr() != part[a - lo :].data_ptr():  # a reduce-scatter wrote it in place
                dst.copy_(part[a - lo : b - lo])
            return
        g.grad_shard()[a - g.lo : b - g.lo].add_(part[a - lo : b - lo].to(torch.float32), alpha=1.0 / self.world)

    def clear_padding(self) -> None:
        """Zero the gradient shard's padding after quantized sums ([Note: padding stays zero])."""
        if not self._quantized or self.group.grad is None:
            return
        if self._padding is None:
            g = self.group
            self._padding = g.layout.padding_ranges(g.lo, g.hi)
        for a, b in self._padding:
            self.group.grad[a:b].zero_()

    # [Note: padding stays zero] The flat buffer's padding has no parameter, so its gradient is
    # zero, and so are its masters and replica. A rotated quantized sum (Hadamard blocks span
    # padding and parameters alike) spreads quantization error into padding; left there it would
    # move padding masters, which checkpoints do not save (a resumed run would differ) and which
    # share quantization groups of the weight gather with real parameters. The reducers zero it.

    def landing(self) -> torch.Tensor:
        """The landing shard of this backward (zeros when made: a part nobody sends counts as zero)."""
        if self._landing_shard is None:
            g = self.group
            self._landing_shard = torch.zeros(g.hi - g.lo, dtype=self.landing_dtype, device=g.device)
        return self._landing_shard

    def drop_landing(self) -> None:
        """Forget the landing shard of an interrupted backward."""
        self._landing_shard = None

    def fold_landing(self) -> None:
        """Add the landing shard into the fp32 gradient shard (divided by the world size, in
        chunks of :data:`FOLD_CHUNK` elements) and drop it."""
        land = self._landing_shard
        if land is None:
            return
        self._landing_shard = None
        shard = self.group.grad_shard()
        for i in range(0, land.numel(), FOLD_CHUNK):
            j = min(i + FOLD_CHUNK, land.numel())
            shard[i:j].add_(land[i:j].to(torch.float32), alpha=1.0 / self.world)


class OwnerReducer(_Reducer):
    """Buckets are contiguous flat ranges; each reaches its owners by ``reduce``."""

    solo: tuple[int, ...] = ()

    def __init__(self, group: FlatGroup, reduce_bucket_size: int, quant=None, dtype=None, error_feedback=None, *,
                 reduce_buckets_in_flight: int, two_level=None):
        # two-level: the plain reduces go to each partition's owner (NCCL's reduce is node-aware);
        # quantized gradients reduce in windows there (make_reducer gives them a ScatterReducer)
        super().__init__(group, quant, dtype, error_feedback, reduce_buckets_in_flight=reduce_buckets_in_flight)
        self.buckets = plan_reduce_buckets(group.layout, reduce_bucket_size)

    def _parts(self, bucket) -> list[tuple[int, int, int, int]]:
        return [(r, a - bucket.start, b - a, a) for r, a, b in owners(bucket.start, bucket.stop, self.p)]

    def staging_numel(self, bucket) -> int:
        return bucket.numel

    def _places(self, bucket, start: int, stop: int):
        return bucket_pieces(bucket, start, stop)

    def from_flat(self, flat: torch.Tensor, bucket, dtype: torch.dtype) -> torch.Tensor:
        return flat[bucket.start : bucket.stop].to(dtype)

    def launch(self, buf: torch.Tensor, bucket) -> list:
        if self.quant is not None:
            return self._launch_quantized(buf, bucket.index, self._parts(bucket))
        works = []
        self._plain_count([(r, b - a) for r, a, b in owners(bucket.start, bucket.stop, self.p)], buf.element_size())
        if self.world > 1:
            with peer_failure("the gradient reduction"):
                for r, a, b in owners(bucket.start, bucket.stop, self.p):
                    dst = self._ranks[r]
                    works.append(dist.reduce(buf[a - bucket.start : b - bucket.start], dst=dst, group=self.pg,
                                             async_op=True))
        return works

    def finish(self, works: list, buf: torch.Tensor, bucket) -> None:
        if self.quant is not None:
            return self._finish_quantized(works, bucket.index)
        with peer_failure("the gradient reduction"):
            for w in works:
                w.wait()
        self._add_to_shard(buf, bucket.start, bucket.stop)


class ScatterReducer(_Reducer):
    """Buckets are windows of every partition; each is one ``reduce_scatter``. Parameters
    that start a partition and span several windows (:func:`qzero.buckets.solo_slots`) are,
    with ``solo``, reduced to their owner on their own, straight from their gradient."""

    def __init__(self, group: FlatGroup, reduce_bucket_size: int, solo: bool = False, quant=None, dtype=None,
                 error_feedback=None, *, reduce_buckets_in_flight: int, two_level=None):
        super().__init__(group, quant, dtype, error_feedback, reduce_buckets_in_flight=reduce_buckets_in_flight,
                         two_level=two_level)
        if self.two_level is not None and solo:
            raise ValueError("solo_reduce is not supported with two-level collectives")
        self.solo = solo_slots(group.layout, reduce_bucket_size) if solo else ()
        self.buckets = plan_scatter_buckets(group.layout, reduce_bucket_size, exclude=self.solo)
        # where solo parameters fall inside windows copied from a full gradient (stage 1)
        slots = group.layout.slots
        self._solo_in = {
            b.index: [piece for i in self.solo for piece in scatter_pieces(b, slots[i].start, slots[i].stop, self.p)]
            for b in self.buckets
        }

    def launch_solo(self, buf: torch.Tensor, slot) -> list:
        """Start reducing one parameter's whole gradient ``buf`` to the rank that owns it."""
        if self.quant is not None:
            return self._launch_quantized(buf, ("solo", slot.index), self._solo_parts(slot))
        self._plain_count([(slot.start // self.p, slot.numel)], buf.element_size())
        if self.world == 1:
            return []
        with peer_failure("the gradient reduction"):
            dst = self._ranks[slot.start // self.p]
            return [dist.reduce(buf, dst=dst, group=self.pg, async_op=True)]

    def _solo_parts(self, slot) -> list[tuple[int, int, int, int]]:
        return [(r, a - slot.start, b - a, a) for r, a, b in owners(slot.start, slot.stop, self.p)]

    def finish_solo(self, works: list, buf: torch.Tensor, slot) -> None:
        if self.quant is not None:
            return self._finish_quantized(works, ("solo", slot.index))
        with peer_failure("the gradient reduction"):
            for w in works:
                w.wait()
        self._add_to_shard(buf, slot.start, slot.stop)

    def staging_numel(self, bucket) -> int:
        return self.world * bucket.width

    def _places(self, bucket, start: int, stop: int):
        return scatter_pieces(bucket, start, stop, self.p)

    def from_flat(self, flat: torch.Tensor, bucket, dtype: torch.dtype) -> torch.Tensor:
        rows = flat.view(self.world, self.p)[:, bucket.lo : bucket.hi]
        buf = rows.to(dtype).reshape(-1)  # always a copy: the rows are strided
        for a, b, off in self._solo_in[bucket.index]:  # solo parameters travel on their own
            buf[off : off + b - a].zero_()
        return buf

    def launch(self, buf: torch.Tensor, bucket) -> tuple:
        if self.two_level is not None:
            return self._launch_two_level(buf, bucket)
        if self.quant is not None:
            w = bucket.width
            parts = [(r, r * w, w, r * self.p + bucket.lo) for r in range(self.world)]
            return self._launch_quantized(buf, bucket.index, parts)
        self._plain_count([(r, bucket.width) for r in range(self.world)], buf.element_size())
        if self.world == 1:
            return None, buf
        if self.use_landing:  # straight into this rank's landing shard
            out = self.landing()[bucket.lo : bucket.lo + bucket.width]
        else:
            out = torch.empty(bucket.width, dtype=buf.dtype, device=buf.device)
        with peer_failure("the gradient reduction"):
            work = dist.reduce_scatter_tensor(out, buf, group=self.pg, async_op=True)
        return work, out

    def finish(self, works: tuple, buf: torch.Tensor, bucket) -> None:
        if self.two_level is not None:
            return self._finish_two_level(works, bucket)
        if self.quant is not None:
            return self._finish_quantized(works, bucket.index)
        work, out = works
        if work is not None:
            with peer_failure("the gradient reduction"):
                work.wait()
        lo = self.group.rank * self.p + bucket.lo
        self._add_to_shard(out, lo, lo + bucket.width)


class Stage1Grads:
    """Full gradient buffer; one bucketed reduction per step, at most
    ``reduce_buckets_in_flight`` collectives pending."""

    def __init__(
        self, group: FlatGroup, reduce_dtype: str | None, reduce_bucket_size: int, solo: bool = False,
        quant: GradientQuantization | None = None, error_feedback=None, *, reduce_buckets_in_flight: int,
        two_level=None,
    ):
        self.group = group
        self.dtype = reduce_dtype_of(reduce_dtype, group.dtype)
        self.reduce_buckets_in_flight = reduce_buckets_in_flight
        self.reducer = make_reducer(group, reduce_bucket_size, solo, quant, self.dtype, error_feedback,
                                    reduce_buckets_in_flight=reduce_buckets_in_flight, two_level=two_level)
        self.flat_grad = torch.zeros(group.layout.numel, dtype=group.dtype, device=group.device)
        self._attach()
        #: The first parameter whose gradient arrived outside ``opt.backward`` since the last
        #: ``zero()`` ([Note: gradients outside opt.backward]); None: none did.
        self.stray: str | None = None
        self._armed = False
        self._handles = [p.register_post_accumulate_grad_hook(self._make_stray_hook(name))
                         for name, p in zip(group.names, group.params)]

    def _make_stray_hook(self, name: str):
        def hook(param: torch.Tensor) -> None:
            if not self._armed and self.stray is None:
                self.stray = name

        return hook

    learning = False  # nothing to learn from a first backward ([Note: counted hooks] is stage 2's)

    def begin(self, may_repeat: bool = False) -> None:
        """``opt.backward`` starts a backward: gradients that arrive now are the optimizer's."""
        self._armed = True

    def problem(self) -> str | None:
        """What makes the gradients unusable for a step, said as a refusal; None: nothing."""
        return stray_problem(self.stray)

    def abandon(self) -> None:
        """The backward raised: nothing is pending in stage 1 (``zero()`` clears the buffer)."""
        self._armed = False

    def _attach(self) -> None:
        for slot, p in zip(self.group.layout.slots, self.group.params):
            p.grad = self.flat_grad[slot.start : slot.stop].view(slot.shape)

    def after_backward(self) -> None:
        self._armed = False
        # Parameters whose .grad someone replaced or dropped are pointed back at the buffer.
        for slot, p in zip(self.group.layout.slots, self.group.params):
            if p.grad is None or p.grad.data_ptr() != self.flat_grad[slot.start :].data_ptr():
                if p.grad is not None:
                    self.flat_grad[slot.start : slot.stop].add_(p.grad.reshape(-1))
                p.grad = self.flat_grad[slot.start : slot.stop].view(slot.shape)

    def _units(self):
        """``(launch, finish, unit, buffer)`` per collective, in a fixed order; buffers are made
        one at a time as the loop asks for them."""
        r = self.reducer
        for i in r.solo:
            slot = self.group.layout.slots[i]
            yield r.launch_solo, r.finish_solo, slot, self.flat_grad[slot.start : slot.stop].to(self.dtype)
        for b in r.buckets:
            yield r.launch, r.finish, b, r.from_flat(self.flat_grad, b, self.dtype)

    def before_step(self) -> None:
        pending: deque = deque()
        for launch, finish, unit, buf in self._units():
            with label(REDUCE_GRADIENTS):
                pending.append((finish, launch(buf, unit), buf, unit))
            if len(pending) > self.reduce_buckets_in_flight:
                done, works, b, u = pending.popleft()
                with label(REDUCE_GRADIENTS):
                    done(works, b, u)
        while pending:
            done, works, b, u = pending.popleft()
            with label(REDUCE_GRADIENTS):
                done(works, b, u)
        self.reducer.clear_padding()

    def take_stats(self) -> ReduceStats:
        return self.reducer.take_stats()

    def zero(self, set_to_none: bool = True) -> None:
        self.flat_grad.zero_()
        self.group.zero_grad(set_to_none)
        self._attach()
        self.stray = None
        self.reducer.take_stats()  # what a refused step sent is not the next step's traffic

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        for p in self.group.params:
            p.grad = None


class Stage2Grads:
    """Bucketed reduction during backward, at most ``reduce_buckets_in_flight`` collectives
    pending; only the fp32 gradient shard persists."""

    def __init__(
        self, group: FlatGroup, reduce_dtype: str | None, reduce_bucket_size: int, overlap: bool, solo: bool = False,
        quant: GradientQuantization | None = None, error_feedback=None, *, reduce_buckets_in_flight: int,
        two_level=None,
    ):
        self.group = group
        self.dtype = reduce_dtype_of(reduce_dtype, group.dtype)
        self.reduce_buckets_in_flight = reduce_buckets_in_flight
        self.reducer = make_reducer(group, reduce_bucket_size, solo, quant, self.dtype, error_feedback,
                                    reduce_buckets_in_flight=reduce_buckets_in_flight, two_level=two_level)
        # [Note: landing shard]: plain 16-bit sums wait in the reduce dtype until backward ends
        self.reducer.use_landing = not self.reducer.quantized and self.dtype.itemsize < 4
        self.overlap = overlap
        self.buckets = self.reducer.buckets
        self._solo = set(self.reducer.solo)
        # slot index -> [(bucket, [(a, b, offset), ...])]: where its gradient is staged
        self._targets: dict[int, list] = {}
        slots = group.layout.slots
        for bucket in self.buckets:
            for i in bucket.slots:
                self._targets.setdefault(i, []).append((bucket, self.reducer.pieces_of(bucket, slots[i])))
        # [Note: one launch order] Collectives pair up across ranks by the order they are
        # issued in, so buckets and solo parameters are launched in one order that every
        # rank shares; a unit that completes early waits for the units before it. Were they
        # launched as they complete, a parameter left without a gradient on some ranks only
        # (a skipped branch, an MoE expert no token chose) would reorder one rank's
        # collectives: wrong sums, or a size mismatch. The first backward uses an order made
        # from the plan alone (reverse layout order: a bucket completes when its
        # first-laid-out parameter arrives). At its end, the order in which rank 0's buckets
        # completed is broadcast and kept: from then on the buckets launch as early as they
        # did on rank 0. Solo parameters (``solo_reduce``) come last: a bucket's window can
        # cover a solo parameter's place in its owner's partition (as zeros), and with the
        # landing shard the bucket's result is written there, so the solo's must land after.
        units = [(-min(b.slots), b.index, b) for b in self.buckets if b.slots]
        units += [(1, b.index, b) for b in self.buckets if not b.slots]  # padding only
        self._order = [u for *_, u in sorted(units, key=lambda t: t[:2])] + sorted(self.reducer.solo)
        #: Gradient hook firings per parameter in one backward ([Note: counted hooks]): None until
        #: the first backward has finished; then the most any rank saw, at least 1.
        self._counts: list[int] | None = None
        #: The first parameter whose gradient arrived outside ``opt.backward`` since the last
        #: ``zero()`` ([Note: gradients outside opt.backward]), and the first late arrival.
        self.stray: str | None = None
        self.late: str | None = None
        self._armed = False
        self._hold = False  # launch nothing before the backward's end (a first backward that may repeat hooks)
        self._reset()
        self._handles = [
            p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(group.params)
        ]

    @property
    def learning(self) -> bool:
        """Whether no backward has finished yet (the hook counts are not known)."""
        return self._counts is None

    def _need(self, slot_index: int) -> int:
        """Hook firings after which a parameter's gradient is complete in this backward."""
        return 1 if self._counts is None else self._counts[slot_index]

    def _reset(self) -> None:
        self._missing = {b.index: sum(self._need(i) for i in b.slots) for b in self.buckets}
        self._fired = [0] * len(self.group.params)
        self._last: dict[int, int] = {}  # bucket index -> hook firing (counted from 0) of its last gradient
        self._firings = 0
        self._staging: dict[int, torch.Tensor] = {}
        self._solo_held: dict[int, torch.Tensor] = {}
        self._sent: set = set()  # bucket indices and ("solo", slot index) launched in this backward
        self._pending: deque = deque()  # (finish, works, buffer, bucket or slot)
        self._next = 0  # the first unit of self._order not launched yet

    def begin(self, may_repeat: bool = False) -> None:
        """``opt.backward`` starts a backward: gradients that arrive now are reduced.
        ``may_repeat``: its graph may fire a hook more than once (reentrant checkpointing);
        the first backward then launches nothing before its end ([Note: counted hooks])."""
        self._armed = True
        self._hold = may_repeat and self._counts is None

    def problem(self) -> str | None:
        """What makes the gradients unusable for a step, said as a refusal; None: nothing."""
        return stray_problem(self.stray) or self.late

    def _make_hook(self, slot_index: int):
        def hook(param: torch.Tensor) -> None:
            self._on_grad(slot_index, param)

        return hook

    def _staging_for(self, bucket) -> torch.Tensor:
        buf = self._staging.get(bucket.index)
        if buf is None:  # zeros: padding and parameters without a gradient count as zero
            buf = torch.zeros(self.reducer.staging_numel(bucket), dtype=self.dtype, device=self.group.device)
            self._staging[bucket.index] = buf
        return buf

    def _on_grad(self, slot_index: int, param: torch.Tensor) -> None:
        if not self._armed:  # a plain loss.backward(): leave .grad as torch made it, and remember
            if self.stray is None:
                self.stray = self.group.names[slot_index]
            return
        grad = param.grad.detach().reshape(-1)
        self._fired[slot_index] += 1
        counted = self._fired[slot_index] <= self._need(slot_index)  # a firing a bucket waits for
        if slot_index in self._solo:
            if ("solo", slot_index) in self._sent:
                self._late_arrival(slot_index)
            else:
                held = self._solo_held.get(slot_index)
                part = grad.to(self.dtype)
                self._solo_held[slot_index] = part if held is None else held + part
        for bucket, pieces in self._targets.get(slot_index, ()):
            if bucket.index in self._sent:
                self._late_arrival(slot_index)
                continue
            buf = self._staging_for(bucket)
            for a, b, off in pieces:
                buf[off : off + b - a].add_(grad[a:b])
            if counted:
                self._missing[bucket.index] -= 1
            self._last[bucket.index] = self._firings
        self._firings += 1
        param.grad = None
        if self.overlap and not self._hold:  # overlap_comm off: nothing is reduced before backward ends
            self._launch_due(everything=False)

    def _late_arrival(self, slot_index: int) -> None:
        """A gradient arrived for a unit already sent: its part cannot join the sum any more."""
        if self.late is None:
            name = self.group.names[slot_index]
            seen = self._fired[slot_index]
            self.late = (
                f"qzero: the gradient of parameter {name!r} arrived {seen} times in one backward, the last "
                f"time after its gradient bucket had been reduced (the first backward delivered it "
                f"{self._need(slot_index)} time(s), and buckets are sent once that many have arrived), so a part "
                f"of it would be lost; the step was refused and the weights are unchanged. A parameter used in "
                f"several reentrant activation-checkpointed blocks (torch.utils.checkpoint(..., "
                f"use_reentrant=True)) whose uses change from one backward to the next does this: use "
                f"use_reentrant=False, or stage=1, and call opt.zero_grad() to discard this step's gradients")

    def _launch_due(self, everything: bool) -> None:
        """Launch the next units of the fixed order ([Note: one launch order]) while they are
        complete (``everything``: all of them, at the backward's end; what backward did not
        deliver counts as zeros)."""
        while self._next < len(self._order):
            unit = self._order[self._next]
            if isinstance(unit, int):  # a solo parameter
                if self._fired[unit] < self._need(unit) and not everything:
                    return
                held = self._solo_held.pop(unit, None)
                if held is None:
                    held = torch.zeros(self.group.layout.slots[unit].numel, dtype=self.dtype, device=self.group.device)
                self._sent.add(("solo", unit))
                self._launch_solo(unit, held)
            else:
                if self._missing[unit.index] > 0 and not everything:
                    return
                self._sent.add(unit.index)
                self._launch(unit)
            self._next += 1

    def _launch(self, bucket) -> None:
        buf = self._staging_for(bucket)  # zeros if backward delivered nothing to it
        del self._staging[bucket.index]
        with label(REDUCE_GRADIENTS):
            self._pending.append((self.reducer.finish, self.reducer.launch(buf, bucket), buf, bucket))
        self._bound_in_flight()

    def _launch_solo(self, slot_index: int, buf: torch.Tensor) -> None:
        slot = self.group.layout.slots[slot_index]
        with label(REDUCE_GRADIENTS):
            self._pending.append((self.reducer.finish_solo, self.reducer.launch_solo(buf, slot), buf, slot))
        self._bound_in_flight()

    def _bound_in_flight(self) -> None:
        while len(self._pending) > self.reduce_buckets_in_flight:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        finish, works, buf, unit = self._pending.popleft()
        with label(REDUCE_GRADIENTS):
            finish(works, buf, unit)

    def after_backward(self) -> None:
        """Reduce what backward left (buckets and solo parameters without a gradient count
        as zeros), in a fixed order so every rank issues the same collectives, then wait."""
        self._armed = False
        self._launch_due(everything=True)
        while self._pending:
            self._finish_oldest()
        self.reducer.fold_landing()
        self.reducer.clear_padding()
        if self._counts is None:
            self._learn()
        self._reset()

    def abandon(self) -> None:
        """The backward raised: wait for what was launched (every rank that runs the same
        backward launched it too; a failure of a collective here is dropped, the backward's
        own error is the one raised), and drop what it staged. The gradient shard may hold
        part of this backward: ``zero()`` clears it."""
        self._armed = False
        while self._pending:
            try:
                self._finish_oldest()
            except Exception:  # noqa: BLE001 - the error that interrupted the backward is raised instead
                pass
        self.reducer.drop_landing()
        self._reset()

    def _learn(self) -> None:
        """Keep rank 0's completion order of the first backward ([Note: one launch order]) and the
        most hook firings any rank saw per parameter ([Note: counted hooks]): one all-gather."""
        by_index = {b.index: b for b in self.buckets}
        done = sorted((self._last[b.index], b.index) for b in self.buckets
                      if b.slots and all(self._fired[i] for i in b.slots))
        completed = {i for _, i in done}
        order = [i for _, i in done] + [u.index for u in self._order
                                        if not isinstance(u, int) and u.index not in completed]
        row = torch.tensor(order + self._fired, dtype=torch.int64, device=self.group.device)
        if self.group.world_size > 1:
            table = torch.empty(self.group.world_size * row.numel(), dtype=torch.int64, device=row.device)
            with peer_failure("the gradient reduction"):
                all_gather_into(table, row, group=self.group.process_group)
            rows = table.view(self.group.world_size, -1)
            row = torch.cat([rows[0, : len(order)], rows[:, len(order) :].amax(dim=0)])
        values = row.tolist()
        self._order = [by_index[i] for i in values[: len(order)]] + sorted(self.reducer.solo)
        self._counts = [max(1, c) for c in values[len(order) :]]

    def before_step(self) -> None:
        pass

    def take_stats(self) -> ReduceStats:
        return self.reducer.take_stats()

    def zero(self, set_to_none: bool = True) -> None:
        self.group.zero_grad(set_to_none)
        for p in self.group.params:  # what a plain loss.backward() left
            p.grad = None
        self.stray = self.late = None
        self.reducer.take_stats()  # what a refused step sent is not the next step's traffic

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def stray_problem(name: str | None) -> str | None:
    """The refusal for a gradient that arrived outside ``opt.backward`` ([Note: gradients
    outside opt.backward]); None without one."""
    if name is None:
        return None
    return (f"qzero: the gradient of parameter {name!r} came from a plain loss.backward() (outside "
            "opt.backward(loss)): the optimizer neither reduced nor scaled it, and it would be mixed into this "
            "step's gradients. Call opt.zero_grad() to discard it, and run backward as opt.backward(loss)")


def may_repeat_hooks(loss: torch.Tensor) -> bool:
    """Whether ``loss``'s autograd graph holds a reentrant activation checkpoint
    (``torch.utils.checkpoint``'s, DeepSpeed's or Megatron's ``CheckpointFunction``), whose
    backward runs a backward of its own: a parameter it shares with another block gets its
    gradient hook fired once per block ([Note: counted hooks])."""
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "Checkpoint" in type(node).__name__:
            return True
        todo.extend(n for n, _ in node.next_functions)
    return False
