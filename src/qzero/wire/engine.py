"""The gather engine: the one place that runs a :class:`~qzero.layout.GatherPlan`.

[Note: the gather engine]

``start_gather(flat, plan, group, context, prepare=...)`` returns a :class:`GatherHandle`.
``handle.wait_until(k)`` makes the work queued on the current stream from then on see
chunks ``0..k`` in ``flat``; ``handle.wait()`` does it for every chunk. The synchronous
gather is ``start_gather(...).wait()``; gather-ahead keeps the handle and lets each
module's forward pre-hook wait for its own chunks (:mod:`qzero.wire.overlap`); the DeepSpeed
adapter uses either form on DeepSpeed's flat buffers. Chunks finish strictly in order, and the bits do not
depend on the schedule: every schedule packs and unpacks the same groups with the same
functions (:mod:`qzero.wire.chunks`).

Two schedules, chosen by :class:`CommContext` (``ZeroConfig.gather_schedule``):

``streams`` (CUDA; the default there)
    Pack and unpack run on two side streams of the context, the collective on the process
    group's own stream (NCCL's), ordered only by CUDA events, so chunk ``k`` is on the
    wire while ``k+1`` is packed and ``k-1`` unpacked, and no collective waits behind the
    compute stream's kernels::

        pack stream    P0  P1  P2 ...     Pk waits for the prepare of its chunk and for Uk-2
        collective         G0  G1 ...     Gk is issued from the pack stream: it waits for Pk
        unpack stream          U0 ...     Uk waits for Gk (the collective's work.wait())

    Per chunk the host launches the pack, the collective, one unpack over every source
    rank's payload and one scatter of their exact elements (:mod:`qzero.wire.chunks`), switches
    the current stream twice and records one event (after the unpack); the Triton kernels
    are launched through their compiled form (:meth:`qzero.quant.triton_launch.Launcher.launch`).

    The host *enqueues* chunks lazily: the first ``LOOKAHEAD`` at the start, and each
    ``wait_until(k)`` enqueues through ``k + LOOKAHEAD`` before it waits. Launching a
    chunk costs the host a few kernel and collective launches; enqueuing all of them at the
    end of ``step()`` held the next forward back by that much (184 ms of host time in
    ``step()`` for a Qwen3-4B at a 50M-element bucket, at about 1 ms per chunk with the
    update sliced per chunk), while inside the forward the host mostly runs ahead of the
    device.

``inline`` (every device; the only one off CUDA)
    Pack and unpack run on the current stream; collectives are launched asynchronously
    and waited for in order, with up to ``depth`` chunks in flight (2 under gather-ahead:
    each ``wait_until`` also launches the next chunks).

The same on every rank: collectives are matched across ranks by the order they are issued
in, and a user may issue their own (a loss all-reduce, say) while a gather runs ahead. So
how many chunks have been launched or enqueued at any point is decided by the sequence of
calls alone (``start_gather``, ``wait_until(k)``, ``wait``), never by timing: an earlier
version enqueued "while the device is still busy with the update", and the ranks then
disagreed on the order of the next collectives and hung.

A plain gather with nothing to overlap (no ``prepare``, not ahead: ``qzero.all_gather``, the
exact re-gather) is one in-place collective over the whole buffer: each partition already
sits where every rank receives it, so there is no receive buffer and no copy at all.

Memory: whatever the schedule, the receive buffers alive at once together hold at most
``plan.bucket_numel * elem_size`` bytes (what a plain gather of one bucket receives).
When two buffers of ``plan``'s chunks do not fit, the handle runs the same gather cut
into smaller chunks (:func:`fitting_plan`): chunks start on group boundaries whatever
their size, so the bits are the same.

Prepare: ``prepare(stop) -> bool`` (optional) is called, in chunk order, before this
rank's slice of a chunk ending at local offset ``stop`` is packed; it returns whether it
queued any work (the optimizer updates and copies its master shard there). Under
``streams`` it runs for every chunk at the start, on the caller's stream, and each pack
waits only for the event after the prepare that covered its chunk.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import torch
import torch.distributed as dist

from . import chunks
from .chunks import DeltaInputs, exact_index, exact_scatter, pack_chunk, peer_failure, unpack_chunk
from ..vocabulary import GATHER_SCHEDULES
from ..layout import GatherPlan, plan_gather
from ..quant import kernels_for

STAGES = ("pack", "gather", "unpack")
#: Chunks the ``inline`` schedule keeps in flight under gather-ahead.
DEPTH = 2
#: Chunks the ``streams`` schedule enqueues beyond the one being waited for.
LOOKAHEAD = 4


class GatherStats(NamedTuple):
    """What one gather moved. Byte counts are per rank (what each rank contributes), for the
    ``numel`` elements of its partition; ``payload`` is what travelled (:attr:`GatherPlan.payload`:
    ``plain``, a format, or ``<format> delta``)."""

    num_chunks: int
    bytes_sent: int
    plain_bytes: int
    max_recv_numel: int
    max_recv_bytes: int
    numel: int = 0
    payload: str = ""

    @property
    def ratio(self) -> float:
        """Bytes sent relative to a plain gather of the same buffer."""
        return self.bytes_sent / self.plain_bytes if self.plain_bytes else 1.0

    @property
    def bytes_per_param(self) -> float:
        """Bytes on the wire per parameter element (per rank and partition element: the same
        ratio for the whole gather), side channels, alignment and padding included."""
        return self.bytes_sent / self.numel if self.numel else 0.0

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in zip(self._fields, self))
        return f"GatherStats({fields}, bytes_per_param={self.bytes_per_param:.4f})"


def stats_of(plan: GatherPlan) -> GatherStats:
    return GatherStats(
        num_chunks=len(plan.chunks),
        bytes_sent=plan.bytes_per_rank,
        plain_bytes=plan.plain_bytes_per_rank,
        max_recv_numel=plan.max_recv_numel,
        max_recv_bytes=plan.max_recv_bytes,
        numel=plan.partition_numel,
        payload=plan.payload,
    )


class CommContext:
    """The streams and the quantization kernels of one device's gathers.

    Created once by whoever owns the gathers (a :class:`~qzero.ZeroOptimizer`, the
    DeepSpeed adapter) and passed to :func:`start_gather`; CUDA streams come from torch's
    stream pool, so a short-lived context (one per public gather call) costs nothing.

    ``schedule``: ``auto`` (``streams`` on CUDA, ``inline`` elsewhere), ``streams`` or
    ``inline`` (see the note above). ``kernels``: ``auto`` (the fused Triton kernels on
    CUDA where Triton is installed, the torch reference elsewhere), ``triton`` or
    ``reference``, or a kernel set used as it is (a :class:`qzero.quant.triton.TritonKernels`
    of another tuning, say: [Note: kernel set] in :mod:`qzero.quant.kernel_set`); all produce
    the same bytes.
    """

    def __init__(self, device: torch.device | str, *, schedule: str = "auto", kernels="auto"):
        device = torch.device(device)
        if schedule not in GATHER_SCHEDULES:
            raise ValueError(f"gather schedule must be one of {GATHER_SCHEDULES}, got {schedule!r}")
        if schedule == "streams" and device.type != "cuda":
            raise ValueError(f"gather schedule 'streams' needs CUDA tensors, got device {device}")
        self.device = device
        self.kernels = kernels_for(device, kernels)
        self.kernels_choice = kernels  # the gradient reduction picks its kernels the same way
        self.schedule = schedule if schedule != "auto" else ("streams" if device.type == "cuda" else "inline")
        # High priority, as FSDP2's all-gather streams: when the forward's kernels and the
        # gather's compete for the SMs, the gather's go first (the forward waits for them).
        self.streams = ({s: torch.cuda.Stream(device, priority=-1) for s in ("pack", "unpack")}
                        if self.schedule == "streams" else {})
        #: A :class:`qzero.wire.copy_engine.CopyEngineComm` (``ZeroConfig.copy_engine_collectives``), set
        #: by the owner: the gathers then run on its group, their receive buffers from its memory.
        self.copy_engine = None
        #: GPU clock cycles to spin before each step of a stage (the collective's: on the pack
        #: stream, before it is issued). A test hook: delaying one stage exposes any missing
        #: wait between streams.
        self.delay_cycles = dict.fromkeys(STAGES, 0)

    def recv_buffers(self, flat: torch.Tensor, count: int, nbytes: int) -> list[torch.Tensor]:
        """``count`` receive buffers of ``nbytes`` for a gather of ``flat``."""
        if self.copy_engine is not None:
            return self.copy_engine.buffers(("gather", flat.data_ptr()), count, nbytes)
        return [torch.empty(nbytes, dtype=torch.uint8, device=flat.device) for _ in range(count)]

    def _delay(self, stage: str) -> None:
        if self.delay_cycles[stage]:
            torch.cuda._sleep(self.delay_cycles[stage])


def world_and_rank(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def recv_budget_bytes(plan: GatherPlan) -> int:
    """Bytes a plain gather of one bucket receives: the bound on all receive buffers together."""
    return plan.bucket_numel * plan.elem_size


def fitting_plan(plan: GatherPlan, buffers: int) -> GatherPlan | None:
    """``plan`` if ``buffers`` of its receive buffers fit :func:`recv_budget_bytes`, else the
    same gather cut into smaller chunks that fit; ``None`` if not even one-group chunks do
    (payloads dominated by exact ranges). Cached on the plan."""
    key = ("fitting_plan", buffers)
    if key not in plan._cache:
        budget = recv_budget_bytes(plan)
        unit = plan.world_size * plan.group_size
        work, bucket = plan, plan.bucket_numel
        while work is not None and buffers * work.max_recv_bytes > budget:
            if bucket <= unit:
                work = None
                break
            shrunk = int(bucket * budget / (buffers * work.max_recv_bytes)) // unit * unit
            bucket = max(unit, min(shrunk, bucket - unit))
            work = plan_gather(
                plan.numel, plan.world_size, elem_size=plan.elem_size, bucket_numel=bucket, fmt=plan.fmt,
                group_size=plan.group_size, exact_ranges=plan.exact_ranges, delta=plan.delta,
            )
        plan._cache[key] = work
    return plan._cache[key]


def whole_buffer_plan(plan: GatherPlan) -> GatherPlan:
    """The plain ``plan`` as one chunk (cached on the plan)."""
    key = "whole_buffer_plan"
    if key not in plan._cache:
        plan._cache[key] = plan if len(plan.chunks) <= 1 else plan_gather(
            plan.numel, plan.world_size, elem_size=plan.elem_size, bucket_numel=max(plan.numel, plan.world_size),
            fmt=None,
        )
    return plan._cache[key]


class GatherHandle:
    """A gather in progress. ``plan`` is the plan it runs (chunk indices refer to it)."""

    plan: GatherPlan
    finished: int  # chunks [0, finished) are in the flat buffer for the current stream

    @property
    def done(self) -> bool:
        return self.finished == len(self.plan.chunks)

    @property
    def stats(self) -> GatherStats:
        return stats_of(self.plan)

    def wait_until(self, chunk_index: int) -> None:
        raise NotImplementedError

    def wait(self) -> None:
        self.wait_until(len(self.plan.chunks) - 1)


def start_gather(
    flat: torch.Tensor,
    plan: GatherPlan,
    group: dist.ProcessGroup | None,
    context: CommContext,
    *,
    prepare=None,
    ahead: bool = False,
    delta: DeltaInputs | None = None,
) -> GatherHandle:
    """Start gathering ``flat`` by ``plan`` (validated when it was built; no checks here).

    ``ahead``: the caller will wait chunk by chunk (gather-ahead): the ``inline``
    schedule then keeps ``DEPTH`` chunks in flight instead of one. ``delta``: what a delta
    plan's payloads are made from besides ``flat`` (the replica): the target and the
    refusal flag (:class:`qzero.wire.chunks.DeltaInputs`); required by a delta plan, and only by one."""
    if plan.delta != (delta is not None):
        raise ValueError("a delta plan is run with its DeltaInputs (the target and the refusal flag), and only a delta plan")
    if context.copy_engine is not None:
        group = context.copy_engine.group  # the same ranks, in the same order
    world, rank = world_and_rank(group)
    with peer_failure("the weight gather"):
        if not plan.quantized and not ahead and prepare is None:
            # A plain gather that nothing overlaps: one in-place collective over the whole buffer
            # (rank r's partition is already where every rank receives it), no receive buffer.
            return _Inline(flat, whole_buffer_plan(plan), group, world, rank, context, None, 1)
        if context.schedule == "streams" and len(plan.chunks) > 1:
            work = fitting_plan(plan, 2)
            if work is not None:
                return _Streamed(flat, work, group, world, rank, context, prepare, delta)
        return _Inline(flat, plan, group, world, rank, context, prepare, DEPTH if ahead else 1, delta)


class _Inline(GatherHandle):
    """Pack and unpack on the current stream, asynchronous collectives, ``depth`` in flight."""

    @property
    def stats(self) -> GatherStats:
        s = stats_of(self.plan)
        return s._replace(max_recv_numel=0, max_recv_bytes=0) if self._direct else s

    def __init__(self, flat, plan, group, world, rank, context, prepare, depth, delta=None):
        work = fitting_plan(plan, depth) if depth > 1 else plan
        if work is None:
            work, depth = plan, 1
        self.flat, self.plan, self.group, self.delta = flat, work, group, delta
        self.world, self.rank = world, rank
        self.kernels = context.kernels
        self.prepare = prepare
        self.finished = self._launched = 0
        self._in_flight: deque = deque()
        # The plain gather of a single chunk lands straight in the flat buffer, with no buffer.
        self._direct = not work.quantized and len(work.chunks) == 1
        n = 0 if self._direct else min(depth, len(work.chunks))
        self._buffers = context.recv_buffers(flat, n, work.max_recv_bytes)
        self._pump()

    def _pump(self) -> None:
        n = len(self.plan.chunks)
        while self._launched < n and (self._direct or len(self._in_flight) < len(self._buffers)):
            chunk = self.plan.chunks[self._launched]
            if self.prepare is not None:
                self.prepare(chunk.offset + chunk.numel)
            if self._direct:
                p = self.plan.partition_numel
                buf, mine = self.flat, self.flat[self.rank * p : (self.rank + 1) * p]
            else:
                buf = self._buffers[self._launched % len(self._buffers)][: self.world * chunk.payload_bytes]
                mine = pack_chunk(self.flat, self.plan, chunk, self.rank, buf, self.kernels, self.delta)
            work = chunks.all_gather_into(buf, mine, group=self.group, async_op=True) if self.world > 1 else None
            self._in_flight.append((chunk, buf, work))
            self._launched += 1

    def wait_until(self, chunk_index: int) -> None:
        with peer_failure("the weight gather"):
            while self.finished <= min(chunk_index, len(self.plan.chunks) - 1):
                chunk, buf, work = self._in_flight.popleft()
                if work is not None:
                    work.wait()
                if not self._direct:
                    unpack_chunk(self.flat, self.plan, chunk, self.rank, buf, self.kernels, self.delta)
                self.finished += 1
                self._pump()
        if self.done:
            self._buffers = []


class _Streamed(GatherHandle):
    """The ``streams`` schedule (see the note above)."""

    def __init__(self, flat, plan, group, world, rank, context, prepare, delta=None):
        self.flat, self.plan, self.group, self.delta = flat, plan, group, delta
        self.world, self.rank = world, rank
        self.context = context
        device = flat.device
        n = len(plan.chunks)
        # Index tensors reach the device here (cached on the plan), never inside the loop.
        for c in plan.chunks:
            exact_index(plan, c, rank, device)
            exact_scatter(plan, c, device)
        # Two receive buffers, alternating. They were allocated on the caller's stream: they
        # stay referenced until the caller's stream has waited for the last unpack.
        self._recv = context.recv_buffers(flat, 2, plan.max_recv_bytes)
        caller = torch.cuda.current_stream(device)
        # What the caller queued so far (writes to flat), then each chunk's prepare.
        event = caller.record_event()
        self._ready = []
        for c in plan.chunks:
            if prepare is not None and prepare(c.offset + c.numel):
                event = caller.record_event()
            self._ready.append(event)
        self._unpacked = [None] * n
        self._waited = None  # the last of self._ready the pack stream waits for
        self._enqueued = self.finished = 0
        # Never more, never fewer, depending on timing: see "the same on every rank" above.
        self._enqueue_through(min(LOOKAHEAD, n) - 1)

    def _buffer(self, k: int) -> torch.Tensor:
        return self._recv[k % 2][: self.world * self.plan.chunks[k].payload_bytes]

    def _enqueue_through(self, last: int) -> None:
        """Enqueue chunks up to ``last``: per chunk, the pack and the collective from the pack
        stream, the unpack on the unpack stream, one event (the unpack's) between them and the
        rest. The collective is asynchronous: the unpack stream waits for it (``work.wait()``
        makes the current stream wait, on NCCL, not the host), and the collective waits for
        what the pack stream queued before it (the pack), as every collective waits for the
        stream it is issued from."""
        ctx, plan = self.context, self.plan
        pack, unpack = ctx.streams["pack"], ctx.streams["unpack"]
        caller, device = torch.cuda.current_stream(self.flat.device), torch.cuda.current_device()
        try:
            while self._enqueued <= last:
                k, self._enqueued = self._enqueued, self._enqueued + 1
                chunk, buf = plan.chunks[k], self._buffer(k)
                torch.cuda.set_stream(pack)
                if self._ready[k] is not self._waited:  # the stream runs in order: waiting once covers the rest
                    self._waited = self._ready[k]
                    pack.wait_event(self._waited)
                if k >= 2:
                    pack.wait_event(self._unpacked[k - 2])  # it reuses that chunk's buffer
                ctx._delay("pack")
                mine = pack_chunk(self.flat, plan, chunk, self.rank, buf, ctx.kernels, self.delta)
                work = packed = None
                ctx._delay("gather")
                if self.world > 1:
                    work = chunks.all_gather_into(buf, mine, group=self.group, async_op=True)
                else:
                    packed = pack.record_event()
                torch.cuda.set_stream(unpack)
                if work is not None:
                    with peer_failure("the weight gather"):
                        work.wait()
                else:
                    unpack.wait_event(packed)
                ctx._delay("unpack")
                unpack_chunk(self.flat, plan, chunk, self.rank, buf, ctx.kernels, self.delta)
                self._unpacked[k] = unpack.record_event()
        finally:
            torch.cuda.set_stream(caller)
            if torch.cuda.current_device() != device:
                torch.cuda.set_device(device)

    def wait_until(self, chunk_index: int) -> None:
        n = len(self.plan.chunks)
        k = min(chunk_index, n - 1)
        last = min(k + LOOKAHEAD, n - 1)
        if self._enqueued <= last:
            with peer_failure("the weight gather"):
                self._enqueue_through(last)
        if k >= self.finished:
            # The unpack stream runs in order: one event covers chunks [0, k].
            torch.cuda.current_stream(self.flat.device).wait_event(self._unpacked[k])
            self.finished = k + 1
            if self.finished == n:
                self._recv = []  # the caller's stream has waited for the last unpack
