"""Gather-ahead: let the post-step weight gather run under the next forward.

``step()`` starts a :class:`PendingGather` per flat group and returns (a quantized
gather on CUDA: a :class:`StreamedGather`, queued whole on side streams). The gather
moves chunk by chunk, at most ``DEPTH`` chunks in flight; chunks finish strictly in
order (wait for the collective, dequantize every source rank). Forward pre-hooks
make each module wait only until the chunks holding its own parameters have
finished, and each wait also launches the next chunks, so later chunks keep
flowing while earlier layers compute. Everything that reads weights otherwise
(backward, the next step, checkpoints, the exact re-gather, an explicit
``wait_for_weights()``) finishes the whole gather first.

The receive buffers of the ``DEPTH`` chunks in flight together stay within the
bucket: the overlapped plan uses ``bucket_numel // DEPTH`` per chunk.

The bits are those of the synchronous gather: the same chunks are packed and
unpacked by the same functions, only the moment of waiting differs.
"""

from __future__ import annotations

import os
import warnings
from collections import deque

import torch
import torch.distributed as dist

from .comm import all_gather_into, pack_chunk, peer_failure, stats_of, unpack_chunk
from .layout import GatherPlan
from .quant import kernels_for

DEPTH = 2
#: Modules may run this many places before their registration order without a warning
#: (a transformer layer runs its input norm, registered last, before its projections).
REORDER_TOLERANCE = 16


def last_chunk_needed(plan: GatherPlan, start: int, stop: int) -> int:
    """The highest chunk index holding any element of the flat range ``[start, stop)``
    (chunks finish in order, so waiting for it covers the range); -1 for an empty range."""
    p, c = plan.partition_numel, plan.chunk_numel
    last = -1
    for r in range(start // p, min(-(-stop // p), plan.world_size)):
        a, b = max(start, r * p) - r * p, min(stop, (r + 1) * p) - r * p
        if a < b:
            last = max(last, (b - 1) // c)
    return last


class PendingGather:
    """One flat buffer's gather, in progress."""

    def __init__(self, flat: torch.Tensor, plan: GatherPlan, group: dist.ProcessGroup | None, world: int, rank: int,
                 prepare=None):
        self.flat, self.plan, self.group = flat, plan, group
        self.prepare = prepare  # prepare(stop): this rank's partition is ready up to local offset stop
        self.world, self.rank = world, rank
        self.kernels = kernels_for(flat.device)
        self.stats = stats_of(plan)
        n = min(DEPTH, len(plan.chunks))
        self._buffers = [torch.empty(plan.max_recv_bytes, dtype=torch.uint8, device=flat.device) for _ in range(n)]
        self._in_flight: deque = deque()
        self._launched = 0
        self.finished = 0  # chunks [0, finished) are in the flat buffer
        with peer_failure("the weight gather (gather-ahead)"):
            self._pump()

    @property
    def done(self) -> bool:
        return self.finished == len(self.plan.chunks)

    def _pump(self) -> None:
        while len(self._in_flight) < len(self._buffers) and self._launched < len(self.plan.chunks):
            chunk = self.plan.chunks[self._launched]
            if self.prepare is not None:
                self.prepare(chunk.offset + chunk.numel)
            buf = self._buffers[self._launched % len(self._buffers)][: self.world * chunk.payload_bytes]
            mine = pack_chunk(self.flat, self.plan, chunk, self.rank, buf, self.kernels)
            work = all_gather_into(buf, mine, group=self.group, async_op=True) if self.world > 1 else None
            self._in_flight.append((chunk, buf, work))
            self._launched += 1

    def wait_until(self, chunk_index: int) -> None:
        """Finish chunks up to ``chunk_index`` (in order), keeping the pipeline full."""
        with peer_failure("the weight gather (gather-ahead)"):
            while self.finished <= min(chunk_index, len(self.plan.chunks) - 1):
                chunk, buf, work = self._in_flight.popleft()
                if work is not None:
                    work.wait()
                unpack_chunk(self.flat, self.plan, chunk, self.rank, buf, self.kernels)
                self.finished += 1
                self._pump()

    def wait_all(self) -> None:
        self.wait_until(len(self.plan.chunks) - 1)
        self._buffers = []


def streamed_enabled() -> bool:
    """Quantized gathers on CUDA run ahead on side streams (the default): the whole gather is
    enqueued at the end of ``step()`` on the chunk pipeline's streams, so no collective waits
    behind the forward's kernels, and the hooks only make the compute stream wait for their
    chunks' events. Against the hook-driven pump on 2 x H200 (BENCHMARKS.md): 269.7 vs
    282.4 ms per step in a back-to-back profile on a PCIe-class link (one process, not yet
    a side-by-side matrix with the corrected step timing). ``QZERO_AHEAD_STREAMS=0`` goes back to the
    hook-driven pump (what plain gathers, and every gather off CUDA, always use)."""
    return os.environ.get("QZERO_AHEAD_STREAMS", "1") != "0"


class StreamedGather:
    """A gather queued whole on the pipeline's side streams (see :func:`streamed_enabled`);
    the same interface as :class:`PendingGather`."""

    def __init__(self, flat: torch.Tensor, queued, stats):
        self.flat = flat
        self.plan = queued.plan
        self.stats = stats
        self._queued = queued
        self.finished = 0

    @property
    def done(self) -> bool:
        return self.finished == len(self.plan.chunks)

    def wait_until(self, chunk_index: int) -> None:
        """Make the current stream wait until chunks ``[0, chunk_index]`` are in the flat
        buffer (the unpack stream runs in order, so one event covers them all)."""
        k = min(chunk_index, len(self.plan.chunks) - 1)
        if k >= self.finished:
            torch.cuda.current_stream(self.flat.device).wait_event(self._queued.unpacked[k])
            self.finished = k + 1

    def wait_all(self) -> None:
        self.wait_until(len(self.plan.chunks) - 1)
        self._queued = None  # the receive buffers may be reused once the wait above is queued


class GatherAhead:
    """Forward pre-hooks that wait for exactly the chunks a module's parameters live in."""

    def __init__(self, model: torch.nn.Module, groups):
        self.groups = groups
        self.pending: list[PendingGather | None] = [None] * len(groups)
        self._warned = False
        self._furthest = -1  # the furthest module (registration order) this forward has reached
        self._active = False
        index = {}
        for gi, g in enumerate(groups):
            for slot, p in zip(g.layout.slots, g.params):
                index[p] = (gi, slot.start, slot.stop)
        self._needs: dict[torch.nn.Module, list[tuple[int, int, int]]] = {}
        self._position: dict[torch.nn.Module, int] = {}
        self._handles = []
        for module in model.modules():
            ranges = [index[p] for p in module.parameters(recurse=False) if p in index]
            if ranges:
                self._needs[module] = ranges
                self._position[module] = len(self._position)
                self._handles.append(module.register_forward_pre_hook(self._hook))

    def start(self, gi: int, pending: PendingGather) -> None:
        self.pending[gi] = pending
        self._furthest = -1
        self._active = True  # the next forward is the one that overlaps this gather

    def _hook(self, module: torch.nn.Module, args) -> None:
        position = self._position[module]
        if self._active and position < self._furthest - REORDER_TOLERANCE and not self._warned:
            warnings.warn(
                "qzero gather-ahead: the forward runs modules far out of their registration order; weights stay "
                "correct (each module waits for the chunks it needs), but less of the gather is hidden",
                stacklevel=3,
            )
            self._warned = True
        self._furthest = max(self._furthest, position)
        for gi, start, stop in self._needs[module]:
            pending = self.pending[gi]
            if pending is not None:
                pending.wait_until(last_chunk_needed(pending.plan, start, stop))
                if pending.done:
                    self.pending[gi] = None

    def wait_all(self) -> None:
        for gi, pending in enumerate(self.pending):
            if pending is not None:
                pending.wait_all()
                self.pending[gi] = None
        self._active = False

    @property
    def busy(self) -> bool:
        return any(p is not None for p in self.pending)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
