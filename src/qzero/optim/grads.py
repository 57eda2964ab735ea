"""Gradient strategies: how each rank ends up with the averaged fp32 gradient of its partition.

Both stages share one mechanism, :class:`OwnerReducer`: a gradient bucket (a
contiguous flat range) is reduced to the rank(s) whose partitions it overlaps,
one async ``reduce`` per owner, and each owner adds its part (in fp32, divided by
the world size) into its gradient shard. The stages differ only in *when*:

* :class:`Stage1Grads` keeps a full gradient buffer (parameters' ``.grad`` are views
  into it) and reduces it once, at ``step()``, after all micro-batches.
* :class:`Stage2Grads` reduces each bucket as soon as backward has produced all its
  gradients (overlapping backward), then frees the parameter gradients: only the
  fp32 gradient shard persists.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from ..comm import peer_failure
from ..layout import ReduceBucket, owners, plan_reduce_buckets
from .flat import FlatGroup

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: Stage 2 keeps at most this many reduced buckets waiting to be consumed.
MAX_IN_FLIGHT = 2


def reduce_dtype_of(name: str | None, param_dtype: torch.dtype) -> torch.dtype:
    return param_dtype if name is None else _DTYPES[name]


class OwnerReducer:
    """Reduce flat ranges of gradient to their owners; accumulate into the gradient shard."""

    def __init__(self, group: FlatGroup):
        self.group = group
        self.pg = group.process_group
        self.world = group.world_size
        self.p = group.layout.partition_numel
        self._ranks = (
            [dist.get_global_rank(self.pg, r) for r in range(self.world)]
            if self.pg is not None and self.world > 1
            else list(range(self.world))
        )

    def launch(self, buf: torch.Tensor, start: int, stop: int) -> list:
        """Start reducing ``buf`` (the gradient of ``[start, stop)``) to its owners."""
        works = []
        if self.world == 1:
            return works
        with peer_failure("the gradient reduction"):
            for r, a, b in owners(start, stop, self.p):
                works.append(
                    dist.reduce(buf[a - start : b - start], dst=self._ranks[r], group=self.pg, async_op=True)
                )
        return works

    def finish(self, works: list, buf: torch.Tensor, start: int, stop: int) -> None:
        """Wait for the reductions of ``buf`` and add this rank's part into the gradient shard."""
        with peer_failure("the gradient reduction"):
            for w in works:
                w.wait()
        g = self.group
        a, b = max(start, g.lo), min(stop, g.hi)
        if a < b:
            part = buf[a - start : b - start]
            g.grad[a - g.lo : b - g.lo].add_(part.to(torch.float32), alpha=1.0 / self.world)


class Stage1Grads:
    """Full gradient buffer; one bucketed reduction per step."""

    def __init__(self, group: FlatGroup, reduce_dtype: str | None, bucket_numel: int):
        self.group = group
        self.reducer = OwnerReducer(group)
        self.dtype = reduce_dtype_of(reduce_dtype, group.dtype)
        self.buckets = plan_reduce_buckets(group.layout, bucket_numel)
        self.flat_grad = torch.zeros(group.layout.numel, dtype=group.dtype, device=group.device)
        self._attach()

    def _attach(self) -> None:
        for slot, p in zip(self.group.layout.slots, self.group.params):
            p.grad = self.flat_grad[slot.start : slot.stop].view(slot.shape)

    def after_backward(self) -> None:
        # Parameters whose .grad someone replaced or dropped are pointed back at the buffer.
        for slot, p in zip(self.group.layout.slots, self.group.params):
            if p.grad is None or p.grad.data_ptr() != self.flat_grad[slot.start :].data_ptr():
                if p.grad is not None:
                    self.flat_grad[slot.start : slot.stop].add_(p.grad.reshape(-1))
                p.grad = self.flat_grad[slot.start : slot.stop].view(slot.shape)

    def before_step(self) -> None:
        pending: deque = deque()
        for bucket in self.buckets:
            buf = self.flat_grad[bucket.start : bucket.stop]
            if self.dtype != buf.dtype:
                buf = buf.to(self.dtype)
            pending.append((self.reducer.launch(buf, bucket.start, bucket.stop), buf, bucket))
            if len(pending) > MAX_IN_FLIGHT:
                works, b, bk = pending.popleft()
                self.reducer.finish(works, b, bk.start, bk.stop)
        while pending:
            works, b, bk = pending.popleft()
            self.reducer.finish(works, b, bk.start, bk.stop)

    def zero(self) -> None:
        self.flat_grad.zero_()
        self.group.grad.zero_()
        self._attach()

    def remove(self) -> None:
        for p in self.group.params:
            p.grad = None


class Stage2Grads:
    """Bucketed reduction during backward; only the fp32 gradient shard persists."""

    def __init__(self, group: FlatGroup, reduce_dtype: str | None, bucket_numel: int, overlap: bool):
        self.group = group
        self.reducer = OwnerReducer(group)
        self.dtype = reduce_dtype_of(reduce_dtype, group.dtype)
        self.overlap = overlap
        self.buckets: tuple[ReduceBucket, ...] = plan_reduce_buckets(group.layout, bucket_numel)
        self._buckets_of: dict[int, list[ReduceBucket]] = {}
        for b in self.buckets:
            for i in b.slots:
                self._buckets_of.setdefault(i, []).append(b)
        self._reset()
        self._handles = [
            p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(group.params)
        ]

    def _reset(self) -> None:
        self._missing = {b.index: len(b.slots) for b in self.buckets}
        self._staging: dict[int, torch.Tensor] = {}
        self._launched: set[int] = set()
        self._pending: deque = deque()

    def _make_hook(self, slot_index: int):
        def hook(param: torch.Tensor) -> None:
            self._on_grad(slot_index, param)

        return hook

    def _staging_for(self, bucket: ReduceBucket) -> torch.Tensor:
        buf = self._staging.get(bucket.index)
        if buf is None:
            buf = torch.zeros(bucket.numel, dtype=self.dtype, device=self.group.device)
            self._staging[bucket.index] = buf
        return buf

    def _on_grad(self, slot_index: int, param: torch.Tensor) -> None:
        slot = self.group.layout.slots[slot_index]
        grad = param.grad.detach().reshape(-1)
        for bucket in self._buckets_of.get(slot_index, ()):
            a, b = max(slot.start, bucket.start), min(slot.stop, bucket.stop)
            self._staging_for(bucket)[a - bucket.start : b - bucket.start].add_(grad[a - slot.start : b - slot.start])
            self._missing[bucket.index] -= 1
            if self._missing[bucket.index] == 0 and self.overlap:
                self._launch(bucket)
        param.grad = None

    def _launch(self, bucket: ReduceBucket) -> None:
        buf = self._staging_for(bucket)
        self._pending.append((self.reducer.launch(buf, bucket.start, bucket.stop), bucket))
        self._launched.add(bucket.index)
        while len(self._pending) > MAX_IN_FLIGHT:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        works, bucket = self._pending.popleft()
        buf = self._staging.pop(bucket.index)
        self.reducer.finish(works, buf, bucket.start, bucket.stop)

    def after_backward(self) -> None:
        """Reduce what backward left (buckets of unused parameters count as zeros), in a
        fixed order so every rank issues the same collectives, then wait for all."""
        for bucket in self.buckets:
            if bucket.index not in self._launched:
                self._launch(bucket)
        while self._pending:
            self._finish_oldest()
        self._reset()

    def before_step(self) -> None:
        pass

    def zero(self) -> None:
        self.group.grad.zero_()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
