"""Chunk primitives of the weight gather: pack one rank's slice, gather, unpack every slice.

These are the only functions that touch payload bytes; :mod:`qzero.wire.engine` schedules
them and nothing else does. The vocabulary (partition, chunk, payload, exact range) is
defined in ``docs/design.md``; what a payload holds (coded and exact groups, side
elements, the payload kinds) in ``[Note: exact groups]`` in :mod:`qzero.layout.gather_plan`.

What running a plan derives from it (device index tensors, group runs with the kernels'
tables, plans cut to fit) is kept in a :class:`GatherCache` owned by whoever runs the plan (a
:class:`~qzero.wire.engine.CommContext`); a :class:`~qzero.layout.GatherPlan` itself is a pure
value. The collective is :func:`all_gather_into` unless the context was given another one.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..layout.gather_plan import ChunkPlan, GatherPlan, GroupRuns, PayloadKind, PayloadLayout
from .labels import PACK, UNPACK, label


#: torch.distributed's flat-output all-gather, ``(output, input, group=, async_op=)``: every
#: rank's ``input`` into ``output``, rank by rank (torch 2.13 renamed it ``all_gather_single``;
#: older releases only have the old name). The default collective of a
#: :class:`~qzero.wire.engine.CommContext`, which takes another as its argument.
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class GatherCache:
    """What running plans derives from them, per plan, owned by the object that runs them.

    Entries are keyed by the plan's identity and keep the plan alive, so an entry never outlives
    its owner nor answers for another plan: device index tensors (:func:`exact_index`,
    :func:`exact_scatter`, copied to the device once, never inside a running gather), the
    :class:`~qzero.layout.GroupRuns` of ``PER_RANK`` chunks (whose own cache holds the Triton
    kernels' device tables), and plans derived from a plan (cut to fit, or whole). An owner runs a
    handful of plans (its groups' gather and exact plans, and the ones derived from them), so it
    holds a handful of entries."""

    def __init__(self):
        self._plans: dict[int, tuple[GatherPlan, dict]] = {}

    def get(self, plan: GatherPlan, key, make):
        """The entry ``key`` of ``plan``, made by ``make()`` the first time."""
        hit = self._plans.get(id(plan))
        if hit is None or hit[0] is not plan:
            hit = self._plans[id(plan)] = (plan, {})
        entries = hit[1]
        if key not in entries:
            entries[key] = make()
        return entries[key]

    def exact_index(self, plan: GatherPlan, chunk: ChunkPlan, rank: int, device: torch.device):
        return self.get(plan, ("exact_index", chunk.index, rank, device),
                        lambda: exact_index(plan, chunk, rank, device))

    def exact_scatter(self, plan: GatherPlan, chunk: ChunkPlan, device: torch.device):
        return self.get(plan, ("exact_scatter", chunk.index, device), lambda: exact_scatter(plan, chunk, device))

    def group_runs(self, plan: GatherPlan, chunk: ChunkPlan, rank: int | None = None) -> GroupRuns | None:
        return self.get(plan, ("group_runs", chunk.index, rank), lambda: plan.group_runs(chunk, rank))

    def __len__(self) -> int:
        return len(self._plans)


class PeerFailure(RuntimeError):
    """A collective failed: a peer rank died, or did not answer within the process group's timeout."""


# [Note: peer failure]
# ``peer_failure`` relabels what a collective raised as a PeerFailure, and nothing else: an
# error of the inner optimizer's update, of a pack kernel or of an allocation that happens
# inside the same ``with`` block is the caller's own and keeps its type and message. A
# backend error is a ``torch.distributed.DistError`` (NCCL, store and network errors and
# their timeouts), or a RuntimeError raised by torch.distributed's own code (a collective's
# launch) or by a call of the ``with`` block itself into C++ (``Work.wait()``: gloo reports a
# dead peer or a timeout as a plain RuntimeError there). An error raised deeper, in Python
# code outside torch.distributed, is local. The blocks that use it hold collective launches
# and waits (and the work between chunks, whose errors are local by this rule).


def _raised_by_backend(e: BaseException) -> bool:
    if isinstance(e, dist.DistError):
        return True
    if not isinstance(e, RuntimeError):
        return False
    frames = []
    tb = e.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    below = frames[2:]  # frames[0] is peer_failure's, frames[1] the with block's
    return not below or below[-1].f_globals.get("__name__", "").startswith("torch.distributed")


@contextlib.contextmanager
def peer_failure(what: str):
    """Turn a backend error inside a collective into one clear :class:`PeerFailure`
    (only a backend error: [Note: peer failure])."""
    try:
        yield
    except PeerFailure:
        raise
    except RuntimeError as e:
        if not _raised_by_backend(e):
            raise
        raise PeerFailure(
            f"qzero: {what} failed: a peer rank died or did not answer within the process group's timeout "
            f"(set it with init_process_group(timeout=...)). Backend said: {str(e).splitlines()[0] if str(e) else e!r}"
        ) from e


def slot(plan: GatherPlan, chunk: ChunkPlan, rank: int, buf: torch.Tensor) -> torch.Tensor:
    """``rank``'s payload of ``chunk`` inside the receive buffer ``buf``."""
    pb = chunk.payload_bytes
    return buf[rank * pb : (rank + 1) * pb]


class DeltaInputs(NamedTuple):
    """What a delta payload is made from besides the flat buffer, which holds the replica
    ([Note: delta payload] in :mod:`qzero.quant.reference`)."""

    target: torch.Tensor
    """fp32, this rank's partition by local offset (the master shard): what the replica should become."""
    refused: torch.Tensor
    """The refusal flag (:func:`qzero.quant.reference.refusal_flag`, on the flat buffer's device):
    an unpack that met a group whose difference was not finite (and left it as it was) lowers
    it to that group's flat index. Read by the owner of the loop."""


def pack_chunk(flat: torch.Tensor, plan: GatherPlan, chunk: ChunkPlan, rank: int, buf: torch.Tensor, kernels,
               delta: DeltaInputs | None = None, cache: GatherCache | None = None):
    """Write this rank's payload of ``chunk`` into its slot of the receive buffer ``buf``; return the slot.
    ``cache``: where the chunk's index tensors and group runs are kept (None: made for this call)."""
    with label(PACK):
        return _pack_chunk(flat, plan, chunk, rank, buf, kernels, delta, GatherCache() if cache is None else cache)


def _pack_chunk(flat, plan, chunk, rank, buf, kernels, delta, cache: GatherCache):
    p = plan.partition_numel
    mine = slot(plan, chunk, rank, buf)
    src = flat[rank * p + chunk.offset : rank * p + chunk.offset + chunk.numel]
    if chunk.kind is PayloadKind.PLAIN:
        # the slice as it is (a delta plan: the rounded target, what its exact elements carry)
        out = mine[: chunk.numel * plan.elem_size].view(flat.dtype)
        out.copy_(src if not plan.delta else delta.target[chunk.offset : chunk.offset + chunk.numel])
        return mine
    layout, runs = plan.payload_of(chunk, rank), cache.group_runs(plan, chunk, rank)
    index = cache.exact_index(plan, chunk, rank, flat.device)
    if plan.delta:
        target = delta.target[chunk.offset : chunk.offset + chunk.numel]
        kernels.pack_delta_payload(target, src, mine, layout, plan.group_size, plan.fmt, index, runs)
    else:
        kernels.pack_payload(src, mine, layout, plan.group_size, plan.fmt, index, runs)
    return mine


def unpack_chunk(flat: torch.Tensor, plan: GatherPlan, chunk: ChunkPlan, rank: int, buf: torch.Tensor, kernels,
                 delta: DeltaInputs | None = None, cache: GatherCache | None = None) -> None:
    """Write every source rank's payload of ``chunk`` into the flat buffer (this rank's own
    included when quantized, so that all replicas hold the same bits): one dequantizing
    pass over all ranks' payloads (a delta payload's is added into the replica in place),
    then one scatter of all their exact elements. ``cache`` as in :func:`pack_chunk`."""
    with label(UNPACK):
        _unpack_chunk(flat, plan, chunk, buf, kernels, delta, GatherCache() if cache is None else cache)


def _unpack_chunk(flat, plan, chunk, buf, kernels, delta, cache: GatherCache) -> None:
    p, w = plan.partition_numel, plan.world_size
    if chunk.kind is PayloadKind.PLAIN:
        # one strided copy for every rank's slice (this rank's own slot holds its own bits)
        src = buf[: w * chunk.payload_bytes].view(flat.dtype).view(w, -1)[:, : chunk.numel]
        flat.view(w, p)[:, chunk.offset : chunk.offset + chunk.numel].copy_(src)
        return
    exact, runs = cache.exact_scatter(plan, chunk, flat.device), cache.group_runs(plan, chunk)
    if plan.delta:
        kernels.unpack_delta_payloads(buf, flat, p, chunk.offset, chunk.numel, w, chunk.payload, plan.group_size,
                                      plan.fmt, exact, delta.refused, runs)
    else:
        kernels.unpack_payloads(buf, flat, p, chunk.offset, chunk.numel, w, chunk.payload, plan.group_size, plan.fmt,
                                exact, runs)


def exact_index(plan: GatherPlan, chunk: ChunkPlan, rank: int, device: torch.device) -> torch.Tensor | None:
    """Indices (relative to ``rank``'s slice of ``chunk``) of its side elements (its exact
    elements and the rest of its exact groups), on ``device`` (a :class:`GatherCache` keeps
    them, so that a running gather never copies them there). None where there are none, and
    for a ``PLAIN`` chunk (sent as it is)."""
    if not plan.exact_ranges or chunk.kind is PayloadKind.PLAIN:
        return None
    ranges = plan.side_ranges(chunk, rank)
    if ranges:
        return torch.cat([torch.arange(a, b, dtype=torch.int64) for a, b in ranges]).to(device)
    return torch.empty(0, dtype=torch.int64, device=device)


def exact_scatter(plan: GatherPlan, chunk: ChunkPlan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(src, dst)``: every rank's side elements of ``chunk``, as positions in the receive
    buffer (its side channels, rank by rank) and in the flat buffer, in units of one
    element (``plan.elem_size`` bytes); kept like :func:`exact_index`."""
    if not plan.exact_ranges or chunk.kind is PayloadKind.PLAIN:
        return None
    es, pb, p = plan.elem_size, chunk.payload_bytes, plan.partition_numel
    src, dst = [], []
    for r in range(plan.world_size):
        side = (r * pb + plan.payload_of(chunk, r).exact_offset) // es
        local = [torch.arange(a, b, dtype=torch.int64) for a, b in plan.side_ranges(chunk, r)]
        if local:
            local = torch.cat(local)
            src.append(side + torch.arange(local.numel(), dtype=torch.int64))
            dst.append(r * p + chunk.offset + local)
    empty = torch.empty(0, dtype=torch.int64)
    return (torch.cat(src) if src else empty).to(device), (torch.cat(dst) if dst else empty).to(device)


def pack_shard(src: torch.Tensor, out: torch.Tensor, layout: PayloadLayout, group_size: int, fmt: str, kernels) -> None:
    """The payload of a whole shard with no side channel (``[values | scales]``, ``layout``) into
    ``out``: FSDP2's per-parameter all-gather input (:mod:`qzero.fsdp.tensor`), the same groups
    and bytes as a chunk's coded groups."""
    with label(PACK):
        kernels.pack_payload(src, out, layout, group_size, fmt, None)


def unpack_shards(payloads: torch.Tensor, dst: torch.Tensor, numel: int, world: int, layout: PayloadLayout,
                  group_size: int, fmt: str, kernels) -> None:
    """Every rank's :func:`pack_shard` payload (``payloads``: ``world`` of them back to back) into
    its rows of ``dst`` (rank ``r``'s at ``dst[r * numel:][:numel]``), in one pass."""
    with label(UNPACK):
        kernels.unpack_payloads(payloads.reshape(-1), dst, numel, 0, numel, world, layout, group_size, fmt, None)
