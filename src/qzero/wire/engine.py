"""The gather engine: the one place that runs a :class:`~qzero.layout.GatherPlan`.

[Note: the gather engine]

``start_gather(flat, plan, group, context, prepare=...)`` returns a :class:`GatherHandle`.
``handle.wait_until(k)`` makes the work queued on the current stream from then on see
chunks ``0..k`` in ``flat``; ``handle.wait()`` does it for every chunk. The synchronous
gather is ``finish_gather(start_gather(...))``, which waits and returns the
:class:`GatherStats`: every caller runs that pair, nothing else; gather-ahead keeps the handle and lets each
module's forward pre-hook wait for its own chunks (:mod:`qzero.wire.overlap`); the DeepSpeed
adapter uses either form on DeepSpeed's flat buffers. Chunks finish strictly in order, and the bits do not
depend on the schedule: every schedule packs and unpacks the same groups with the same
functions (:mod:`qzero.wire.chunks`).

One chunk loop (:class:`_ChunkLoop`) runs every schedule: *launch* chunk ``k`` (its prepare,
its pack, its collective) and *land* it (wait for the collective, unpack). A schedule is only
its stream policy: on which streams those steps run, and when the caller's stream may read.
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

    The host enqueues every chunk when the gather starts (``CommContext.lookahead`` 0,
    ``ZeroConfig.gather_lookahead``'s default), or lazily with a lookahead ``L > 0``: the
    first ``L`` at the start, and each ``wait_until(k)`` enqueues through ``k + L`` before it
    waits. Launching a chunk costs the host a few kernel and collective launches, more inside a
    forward than in ``step()`` (``benchmarks/reports/step-breakdown-4b.md``). Inside a forward that is host-bound (a
    small model, a fast link) that time is the step's; in ``step()`` the device is still
    busy with the update. The lazy form is for models that run collectives of their own on the same
    group during the forward: those queue behind every chunk already enqueued.

``inline`` (every device; the only one off CUDA)
    Pack and unpack run on the current stream; collectives are launched asynchronously
    and waited for in order, with up to ``depth`` chunks in flight (2 under gather-ahead).
    Every chunk is launched when the gather starts: a chunk whose receive buffer is needed
    again lands there, so under gather-ahead the last ``depth`` chunks are left in flight.

The same on every rank: collectives are matched across ranks by the order they are issued
in, and a user may issue their own (a loss all-reduce, say) while a gather runs ahead. So
how many chunks have been launched or enqueued at any point is decided by the sequence of
calls alone (``start_gather``, ``wait_until(k)``, ``wait``), never by timing: an earlier
version enqueued "while the device is still busy with the update", and the ranks then
disagreed on the order of the next collectives and hung. Nor by reads on one rank only (rank
0 saving or evaluating right after ``step()``): only the ``streams`` schedule with a lookahead
``L > 0`` launches collectives from a wait, and there every rank must make the same reads
(``opt.wait_for_weights()`` on every rank first).

A plain gather with nothing to overlap (no ``prepare``, not ahead: ``qzero.all_gather``, the
exact re-gather) is one in-place collective over the whole buffer: each partition already
sits where every rank receives it, so there is no receive buffer and no copy at all.

Memory: whatever the schedule, the receive buffers alive at once together hold at most
``plan.allgather_bucket_size * elem_size`` bytes (what a plain gather of one bucket receives).
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

import abc
from collections import deque
from typing import NamedTuple

import torch
import torch.distributed as dist

from . import chunks
from .chunks import DeltaInputs, GatherCache, exact_index, exact_scatter, pack_chunk, peer_failure, unpack_chunk  # noqa: F401
from .labels import ALL_GATHER, GATHER, label
from ..vocabulary import GATHER_SCHEDULES
from ..layout.gather_plan import GatherPlan
from ..layout.gather_planner import plan_gather
from ..quant import kernels_for

STAGES = ("pack", "gather", "unpack")
#: Chunks the ``inline`` schedule keeps in flight under gather-ahead.
DEPTH = 2


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
    """The streams, the quantization kernels and the collective of one device's gathers, and
    what running their plans derives (:attr:`cache`).

    Created once by whoever owns the gathers (a :class:`~qzero.ZeroOptimizer`, the
    DeepSpeed adapter, an FSDP2 group's all-gather) and passed to :func:`start_gather`; CUDA
    streams come from torch's stream pool, so a short-lived context (one per public gather
    call) costs nothing, and its cache goes with it.

    ``schedule``: ``auto`` (``streams`` on CUDA, ``inline`` elsewhere), ``streams`` or
    ``inline`` (see the note above). ``kernels``: ``auto`` (the fused Triton kernels on
    CUDA where Triton is installed, the torch reference elsewhere), ``triton`` or
    ``reference``, or a kernel set used as it is (a :class:`qzero.quant.triton.TritonKernels`
    of another tuning, say: [Note: kernel set] in :mod:`qzero.quant.kernel_set`); all produce
    the same bytes. ``all_gather``: the collective
    (``(output, input, group=, async_op=) -> Work``; default :func:`qzero.wire.chunks.all_gather_into`),
    e.g. one that delays every launch and wait to shake out a missing wait. ``delays``: GPU
    clock cycles to spin before each step of a stage (``pack``, ``gather``: on the pack stream
    before the collective is issued, ``unpack``), on CUDA only: delaying one stage exposes any
    missing wait between streams. ``lookahead``: the ``streams`` schedule's chunks enqueued
    beyond the one waited for; 0 (default): every chunk when the gather starts (see the note
    above; ``ZeroConfig.gather_lookahead``).
    """

    def __init__(self, device: torch.device | str, *, schedule: str = "auto", kernels="auto",
                 all_gather=None, delays: dict[str, int] | None = None, lookahead: int = 0):
        device = torch.device(device)
        if schedule not in GATHER_SCHEDULES:
            raise ValueError(f"gather schedule must be one of {GATHER_SCHEDULES}, got {schedule!r}")
        if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
            raise ValueError(f"gather lookahead must be an int >= 0 (0: every chunk at the start), got {lookahead!r}")
        if schedule == "streams" and device.type != "cuda":
            raise ValueError(f"gather schedule 'streams' needs CUDA tensors, got device {device}")
        delays = dict(delays or {})
        unknown = sorted(set(delays) - set(STAGES))
        if unknown:
            raise ValueError(f"delays are per stage {STAGES}, got {unknown}")
        if any(delays.values()) and device.type != "cuda":
            raise ValueError(f"delays spin the GPU's clock: they need CUDA tensors, got device {device}")
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
        #: The collective every chunk runs.
        self.all_gather = chunks.all_gather_into if all_gather is None else all_gather
        #: Chunks the ``streams`` schedule enqueues beyond the one being waited for; 0: every
        #: chunk when the gather starts (``ZeroConfig.gather_lookahead``).
        self.lookahead = lookahead
        #: Cycles to spin before each stage (see above).
        self.delays = {stage: int(delays.get(stage, 0)) for stage in STAGES}
        #: What running plans derives, kept for as long as this context lives.
        self.cache = GatherCache()

    def recv_buffers(self, flat: torch.Tensor, count: int, nbytes: int) -> list[torch.Tensor]:
        """``count`` receive buffers of ``nbytes`` for a gather of ``flat``."""
        if self.copy_engine is not None:
            return self.copy_engine.buffers(("gather", flat.data_ptr()), count, nbytes)
        return [torch.empty(nbytes, dtype=torch.uint8, device=flat.device) for _ in range(count)]

    def _delay(self, stage: str) -> None:
        if self.delays[stage]:
            torch.cuda._sleep(self.delays[stage])


def world_and_rank(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def recv_budget_bytes(plan: GatherPlan) -> int:
    """Bytes a plain gather of one bucket receives: the bound on all receive buffers together."""
    return plan.allgather_bucket_size * plan.elem_size


def fitting_plan(plan: GatherPlan, buffers: int, cache: GatherCache | None = None) -> GatherPlan | None:
    """``plan`` if ``buffers`` of its receive buffers fit :func:`recv_budget_bytes`, else the
    same gather cut into smaller chunks that fit; ``None`` if not even one-group chunks do
    (payloads dominated by exact ranges). Kept in ``cache`` if given."""
    if cache is not None:
        return cache.get(plan, ("fitting_plan", buffers), lambda: fitting_plan(plan, buffers))
    budget = recv_budget_bytes(plan)
    unit = plan.world_size * plan.group_size
    work, bucket = plan, plan.allgather_bucket_size
    while work is not None and buffers * work.max_recv_bytes > budget:
        if bucket <= unit:
            return None
        shrunk = int(bucket * budget / (buffers * work.max_recv_bytes)) // unit * unit
        bucket = max(unit, min(shrunk, bucket - unit))
        work = plan_gather(
            plan.numel, plan.world_size, elem_size=plan.elem_size, allgather_bucket_size=bucket,
            zero_quantized_weights_format=plan.fmt, zero_quantized_weights_group_size=plan.group_size,
            exact_ranges=plan.exact_ranges, zero_quantized_weights_delta=plan.delta,
        )
    return work


def whole_buffer_plan(plan: GatherPlan, cache: GatherCache | None = None) -> GatherPlan:
    """The plain ``plan`` as one chunk (kept in ``cache`` if given)."""
    if cache is not None:
        return cache.get(plan, "whole_buffer_plan", lambda: whole_buffer_plan(plan))
    return plan if len(plan.chunks) <= 1 else plan_gather(
        plan.numel, plan.world_size, elem_size=plan.elem_size, allgather_bucket_size=max(plan.numel, plan.world_size),
        zero_quantized_weights_format=None,
    )


class GatherHandle(abc.ABC):
    """A gather in progress: what :func:`start_gather` returns on every path (the optimizer,
    gather-ahead, the DeepSpeed adapter, FSDP2's group all-gather). ``plan`` is the plan it
    runs (chunk indices refer to it); chunks ``[0, finished)`` are in the flat buffer for the
    current stream. A schedule implements :meth:`wait_until`; :func:`finish_gather` ends it."""

    plan: GatherPlan
    finished: int

    @property
    def done(self) -> bool:
        return self.finished == len(self.plan.chunks)

    @property
    def stats(self) -> GatherStats:
        return stats_of(self.plan)

    @abc.abstractmethod
    def wait_until(self, chunk_index: int) -> None:
        """Make the work queued on the current stream from now on see chunks ``0..chunk_index``."""

    def wait(self) -> None:
        """:meth:`wait_until` the last chunk."""
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
    partition: int | None = None,
) -> GatherHandle:
    """Start gathering ``flat`` by ``plan`` (validated when it was built; no checks here).

    ``ahead``: the caller will wait chunk by chunk (gather-ahead): the ``inline``
    schedule then keeps ``DEPTH`` chunks in flight instead of one. ``delta``: what a delta
    plan's payloads are made from besides ``flat`` (the replica): the target and the
    refusal flag (:class:`qzero.wire.chunks.DeltaInputs`); required by a delta plan, and only by one.
    ``partition``: the partition this rank owns, where it is not its rank in ``group`` (two-level
    collectives number partitions rail-major: [Note: rail-major partitions] in
    :mod:`qzero.layout.topology`; the context's collective then delivers them in partition order).
    End it with :func:`finish_gather` (or, chunk by chunk, ``handle.wait_until``)."""
    if plan.delta != (delta is not None):
        raise ValueError("a delta plan is run with its DeltaInputs (the target and the refusal flag), "
                         "and only a delta plan")
    if context.copy_engine is not None:
        group = context.copy_engine.group  # the same ranks, in the same order
    world, rank = world_and_rank(group)
    if partition is not None:
        rank = partition
    with label(GATHER), peer_failure("the weight gather"):
        if not plan.quantized and not ahead and prepare is None:
            # A plain gather that nothing overlaps: one in-place collective over the whole buffer
            # (rank r's partition is already where every rank receives it), no receive buffer.
            return _Inline(flat, whole_buffer_plan(plan, context.cache), group, world, rank, context, None, 1)
        if context.schedule == "streams" and len(plan.chunks) > 1:
            work = fitting_plan(plan, 2, context.cache)
            if work is not None:
                return _Streamed(flat, work, group, world, rank, context, prepare, delta)
        return _Inline(flat, plan, group, world, rank, context, prepare, DEPTH if ahead else 1, delta)


def finish_gather(handle: GatherHandle) -> GatherStats:
    """Wait for every chunk of ``handle`` and return what the gather moved: the second half of
    the synchronous gather ``finish_gather(start_gather(...))``."""
    with label(GATHER):
        handle.wait()
    return handle.stats


class _ChunkLoop(GatherHandle):
    """The one chunk loop of every schedule: :meth:`_launch` a chunk (pack, collective), then
    :meth:`_land` it (wait for the collective, unpack). A schedule is a subclass that says which
    receive buffer a chunk uses, on which streams the steps run (:meth:`_before_pack`,
    :meth:`_before_land`), and when the caller may read (:meth:`wait_until`)."""

    _direct = False  # the plain gather of one chunk straight into the flat buffer, no receive buffer

    def __init__(self, flat, plan, group, world, rank, context, delta):
        self.flat, self.plan, self.group, self.delta = flat, plan, group, delta
        self.world, self.rank, self.context = world, rank, context
        self.kernels = context.kernels
        self.finished = 0

    def _buffer(self, k: int) -> torch.Tensor:
        raise NotImplementedError

    def _before_pack(self, k: int) -> None:
        """Where and after what chunk ``k``'s pack runs (inline: the current stream, in order)."""

    def _before_land(self, k: int, work) -> None:
        """Where and after what chunk ``k``'s unpack runs (inline: the current stream, in order)."""

    def _launch(self, k: int):
        """Pack chunk ``k`` into its receive buffer and launch its collective (asynchronous)."""
        ctx, plan, chunk = self.context, self.plan, self.plan.chunks[k]
        self._before_pack(k)
        if self._direct:
            p = plan.partition_numel
            buf, mine = self.flat, self.flat[self.rank * p : (self.rank + 1) * p]
        else:
            buf = self._buffer(k)
            ctx._delay("pack")
            mine = pack_chunk(self.flat, plan, chunk, self.rank, buf, self.kernels, self.delta, ctx.cache)
        work = None
        ctx._delay("gather")
        if self.world > 1:
            with label(ALL_GATHER):
                work = ctx.all_gather(buf, mine, group=self.group, async_op=True)
        return k, buf, work

    def _land(self, k: int, buf: torch.Tensor, work) -> None:
        """Wait for chunk ``k``'s collective and unpack every rank's payload into the flat buffer."""
        self._before_land(k, work)
        if work is not None:
            with label(ALL_GATHER), peer_failure("the weight gather"):
                work.wait()
        if not self._direct:
            self.context._delay("unpack")
            unpack_chunk(self.flat, self.plan, self.plan.chunks[k], self.rank, buf, self.kernels, self.delta,
                         self.context.cache)


class _Inline(_ChunkLoop):
    """Pack and unpack on the current stream, asynchronous collectives, ``depth`` in flight."""

    @property
    def stats(self) -> GatherStats:
        s = stats_of(self.plan)
        return s._replace(max_recv_numel=0, max_recv_bytes=0) if self._direct else s

    def __init__(self, flat, plan, group, world, rank, context, prepare, depth, delta=None):
        work = fitting_plan(plan, depth, context.cache) if depth > 1 else plan
        if work is None:
            work, depth = plan, 1
        super().__init__(flat, work, group, world, rank, context, delta)
        self.prepare = prepare
        self._launched = 0
        self._in_flight: deque = deque()
        self._direct = not work.quantized and len(work.chunks) == 1
        n = 0 if self._direct else min(depth, len(work.chunks))
        self._buffers = context.recv_buffers(flat, n, work.max_recv_bytes)
        self._launch_all()

    def _buffer(self, k: int) -> torch.Tensor:
        return self._buffers[k % len(self._buffers)][: self.world * self.plan.chunks[k].payload_bytes]

    def _launch_all(self) -> None:
        # Every chunk's collective is launched here, in start_gather, never from a wait: a
        # read of the weights on one rank only (rank 0 saving or evaluating right after
        # step()) must not issue a collective the other ranks never issue. A chunk whose
        # buffer is needed again lands first, so at most ``depth`` stay in flight.
        n = len(self.plan.chunks)
        while self._launched < n:
            if not self._direct and len(self._in_flight) >= len(self._buffers):
                self._land(*self._in_flight.popleft())
                self.finished += 1
            chunk = self.plan.chunks[self._launched]
            if self.prepare is not None:
                self.prepare(chunk.offset + chunk.numel)
            self._in_flight.append(self._launch(self._launched))
            self._launched += 1

    def wait_until(self, chunk_index: int) -> None:
        with peer_failure("the weight gather"):
            while self.finished <= min(chunk_index, len(self.plan.chunks) - 1):
                self._land(*self._in_flight.popleft())
                self.finished += 1
        if self.done:
            self._buffers = []


class _Streamed(_ChunkLoop):
    """The ``streams`` schedule (see the note above)."""

    def __init__(self, flat, plan, group, world, rank, context, prepare, delta=None):
        super().__init__(flat, plan, group, world, rank, context, delta)
        device = flat.device
        n = len(plan.chunks)
        # Index tensors and group runs reach the device here (kept by the context), never inside the loop.
        for c in plan.chunks:
            context.cache.exact_index(plan, c, rank, device)
            context.cache.exact_scatter(plan, c, device)
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
        self._enqueued = 0
        # Never more, never fewer, depending on timing: see "the same on every rank" above.
        self._lookahead = context.lookahead or n
        self._enqueue_through(min(self._lookahead, n) - 1)

    def _buffer(self, k: int) -> torch.Tensor:
        return self._recv[k % 2][: self.world * self.plan.chunks[k].payload_bytes]

    def _before_pack(self, k: int) -> None:
        pack = self.context.streams["pack"]
        torch.cuda.set_stream(pack)
        if self._ready[k] is not self._waited:  # the stream runs in order: waiting once covers the rest
            self._waited = self._ready[k]
            pack.wait_event(self._waited)
        if k >= 2:
            pack.wait_event(self._unpacked[k - 2])  # it reuses that chunk's buffer

    def _before_land(self, k: int, work) -> None:
        # With no collective the unpack stream waits for the pack's event; with one, work.wait()
        # makes the (then current) unpack stream wait for it, on NCCL, not the host.
        packed = self.context.streams["pack"].record_event() if work is None else None
        unpack = self.context.streams["unpack"]
        torch.cuda.set_stream(unpack)
        if packed is not None:
            unpack.wait_event(packed)

    def _enqueue_through(self, last: int) -> None:
        """Enqueue chunks up to ``last``: per chunk, the pack and the collective from the pack
        stream, the unpack on the unpack stream, one event (the unpack's) between them and the
        rest. The collective waits for what the pack stream queued before it (the pack), as
        every collective waits for the stream it is issued from."""
        caller, device = torch.cuda.current_stream(self.flat.device), torch.cuda.current_device()
        try:
            while self._enqueued <= last:
                k, self._enqueued = self._enqueued, self._enqueued + 1
                self._land(*self._launch(k))
                self._unpacked[k] = self.context.streams["unpack"].record_event()
        finally:
            torch.cuda.set_stream(caller)
            if torch.cuda.current_device() != device:
                torch.cuda.set_device(device)

    def wait_until(self, chunk_index: int) -> None:
        n = len(self.plan.chunks)
        k = min(chunk_index, n - 1)
        last = min(k + self._lookahead, n - 1)
        if self._enqueued <= last:
            with peer_failure("the weight gather"):
                self._enqueue_through(last)
        if k >= self.finished:
            # The unpack stream runs in order: one event covers chunks [0, k].
            torch.cuda.current_stream(self.flat.device).wait_event(self._unpacked[k])
            self.finished = k + 1
            if self.finished == n:
                self._recv = []  # the caller's stream has waited for the last unpack
