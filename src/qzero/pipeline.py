"""Chunk pipelining of the quantized gather on CUDA.

The unpipelined loop in :func:`qzero.comm.run_gather` runs pack, collective and
unpack of each chunk back to back. Here the three stages run on three dedicated
streams, ordered only by CUDA events, so that while chunk ``k`` is in flight,
chunk ``k+1`` is quantized and chunk ``k-1`` dequantized::

    pack stream    P0  P1  P2  P3 ...        Pk waits for Uk-2 (it reuses that buffer)
    comm stream        G0  G1  G2 ...        Gk waits for Pk
    unpack stream          U0  U1  U2 ...    Uk waits for Gk

Nothing in the loop waits on the host. The caller's stream is joined at both ends:
the side streams start after the work already queued on it (the optimizer's writes
to ``flat``), and it waits for the last unpack before anything after the gather.

Hazards, chunk by chunk: ``Uk`` writes the chunk-``k`` slices of every partition
and ``Pk+1`` reads the chunk-``k+1`` slice of our own partition, which are disjoint.
The receive buffers alternate between two, so ``Gk`` and ``Pk`` may only touch
buffer ``k % 2`` once ``Uk-2`` is done reading it.

Memory. Pipelining needs two receive buffers alive at once (the chunk being
unpacked and the chunk in flight). The bucket rule bounds one gathered chunk to
``bucket_numel`` elements; a plain bf16/fp16 gather's receive buffer is therefore
``bucket_numel * elem_size`` bytes, and that is the budget for both quantized
buffers together. A full-size INT8 or FP8 payload (group 64) is
``1 + 4/64 = 1.0625`` bytes per element, so two of them (2.125 B/element) do *not*
fit in one bf16 bucket (2 B/element); INT4 (2 x 0.5625 = 1.125 B) does. When two
buffers of the caller's plan would exceed the budget, the pipeline re-cuts the
same gather into smaller chunks (a smaller bucket, still whole groups) until they
fit. Chunks start on group boundaries of every partition whatever their size, and
quantization is per group, so the result is bit-identical to the caller's plan;
only the number of collectives changes (and, by at most 48 bytes of section
alignment per extra chunk, the bytes sent). If even one-group chunks do not fit
(payloads dominated by exact ranges), the caller's unpipelined loop runs instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from . import comm
from .layout import GatherPlan, plan_gather
from .quant import kernels_for

STAGES = ("pack", "gather", "unpack")

#: Test hook: GPU clock cycles to spin on a stage's stream before each of its steps.
#: Delaying one stage exposes any missing wait between streams.
DELAY_CYCLES = {stage: 0 for stage in STAGES}

_STREAMS: dict[torch.device, dict[str, torch.cuda.Stream]] = {}


def enabled() -> bool:
    """``QZERO_PIPELINE=0`` turns the pipeline off (for A/B checks)."""
    return os.environ.get("QZERO_PIPELINE", "1") != "0"


def recv_budget_bytes(plan: GatherPlan) -> int:
    """Bytes a plain gather of the same bucket would hold for receiving."""
    return plan.bucket_numel * plan.elem_size


def pipeline_plan(plan: GatherPlan) -> GatherPlan | None:
    """The plan the pipeline runs: ``plan`` itself if two of its receive buffers fit the
    budget, otherwise the same gather cut into smaller chunks; ``None`` if nothing fits."""
    key = "pipeline_plan"
    if key not in plan._cache:
        plan._cache[key] = _fitting_plan(plan)
    return plan._cache[key]


def _fitting_plan(plan: GatherPlan) -> GatherPlan | None:
    budget = recv_budget_bytes(plan)
    unit = plan.world_size * plan.group_size
    work, bucket = plan, plan.bucket_numel
    while 2 * work.max_recv_bytes > budget:
        if bucket <= unit:
            return None
        shrunk = int(bucket * budget / (2 * work.max_recv_bytes)) // unit * unit
        bucket = max(unit, min(shrunk, bucket - unit))
        work = plan_gather(
            plan.numel,
            plan.world_size,
            elem_size=plan.elem_size,
            bucket_numel=bucket,
            fmt=plan.fmt,
            group_size=plan.group_size,
            exact_ranges=plan.exact_ranges,
        )
    return work


def _streams(device: torch.device) -> dict[str, torch.cuda.Stream]:
    if device not in _STREAMS:
        _STREAMS[device] = {stage: torch.cuda.Stream(device) for stage in STAGES}
    return _STREAMS[device]


def _delay(stage: str) -> None:
    if DELAY_CYCLES[stage]:
        torch.cuda._sleep(DELAY_CYCLES[stage])


@dataclass
class Enqueued:
    """A pipelined gather that has been queued but not waited for."""

    plan: GatherPlan
    """The chunks it runs (the caller's plan, or the same gather re-cut to fit the budget)."""
    unpacked: list
    """Per chunk, the event after which its slices of every partition are in ``flat``."""
    buffers: list
    """The receive buffers: keep them alive until the caller's stream has waited on the
    last event (the caching allocator would otherwise hand them out again)."""


def run_pipelined(flat: torch.Tensor, plan: GatherPlan, group, world: int, rank: int, prepare=None) -> bool:
    """Run the quantized ``plan`` on CUDA ``flat`` with overlapped stages.

    Returns False, having done nothing, when pipelining is off or no chunking fits
    the memory budget; the caller then runs its unpipelined loop.
    """
    queued = enqueue(flat, plan, group, world, rank, prepare)
    if queued is None:
        return False
    # The unpack stream runs in order and each unpack waited for its gather and pack,
    # so the last unpack's event covers every stage of every chunk.
    torch.cuda.current_stream(flat.device).wait_event(queued.unpacked[-1])
    return True


def enqueue(flat: torch.Tensor, plan: GatherPlan, group, world: int, rank: int, prepare=None) -> Enqueued | None:
    """Queue every stage of every chunk on the side streams and return without making the
    caller's stream wait (``None``, having done nothing, where :func:`run_pipelined` would
    return False).

    ``prepare(stop)`` (optional) runs on the caller's stream before chunk ``k`` is packed,
    with ``stop`` the chunk's end in the partition (the sliced optimizer update); the pack
    stream then waits for the caller's stream again, so pack ``k`` sees it, while the
    chunks before it are already on the wire."""
    if not enabled() or not plan.quantized or flat.device.type != "cuda":
        return None
    work = pipeline_plan(plan)
    if work is None or not work.chunks:
        return None
    device = flat.device
    kernels = kernels_for(device)
    p = work.partition_numel
    n = len(work.chunks)
    # Index tensors are built (host to device) before the loop, never inside it.
    index = [[comm.exact_index(work, c, r, device) for r in range(world)] for c in work.chunks]
    recv = [torch.empty(work.max_recv_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
    streams = _streams(device)
    caller = torch.cuda.current_stream(device)
    for s in streams.values():
        s.wait_stream(caller)
    packed, gathered, unpacked = [None] * n, [None] * n, [None] * n

    def buffers(k: int):
        chunk = work.chunks[k]
        pb = chunk.payload_bytes
        buf = recv[k % 2][: world * pb]
        return chunk, pb, buf, buf[rank * pb : (rank + 1) * pb]

    def pack(k: int) -> None:
        chunk, _, _, mine = buffers(k)
        s = streams["pack"]
        if prepare is not None:
            prepare(chunk.offset + chunk.numel)  # on the caller's stream
            s.wait_stream(caller)
        with torch.cuda.stream(s):
            if k >= 2:
                s.wait_event(unpacked[k - 2])
            _delay("pack")
            src = flat[rank * p + chunk.offset : rank * p + chunk.offset + chunk.numel]
            kernels.pack_payload(src, mine, chunk.payload, work.group_size, work.fmt, index[k][rank])
            packed[k] = s.record_event()

    def gather(k: int) -> None:
        _, _, buf, mine = buffers(k)
        s = streams["gather"]
        with torch.cuda.stream(s):
            s.wait_event(packed[k])
            _delay("gather")
            if world > 1:
                comm.all_gather_into(buf, mine, group=group)
            gathered[k] = s.record_event()

    def unpack(k: int) -> None:
        chunk, pb, buf, _ = buffers(k)
        s = streams["unpack"]
        with torch.cuda.stream(s):
            s.wait_event(gathered[k])
            _delay("unpack")
            for r in range(world):
                dst = flat[r * p + chunk.offset : r * p + chunk.offset + chunk.numel]
                payload = buf[r * pb : (r + 1) * pb]
                kernels.unpack_payload(payload, dst, chunk.payload, work.group_size, work.fmt, index[k][r])
            unpacked[k] = s.record_event()

    pack(0)
    for k in range(n):
        gather(k)
        if k + 1 < n:
            pack(k + 1)
        unpack(k)
    return Enqueued(work, unpacked, recv)
