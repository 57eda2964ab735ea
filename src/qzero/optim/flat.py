"""FlatGroup: one parameter group's flat buffer, its partition, master shard and gathers.

The parameters become views into one padded bf16/fp16 flat buffer (see
:mod:`qzero.layout`); this rank keeps the fp32 master shard of its partition and, from a
backward's first reduction until ``zero_grad()``, an fp32 gradient shard of the same
size. After a step the master shard is copied into the partition and the flat buffer is
gathered (plainly or quantized); the copy runs chunk by chunk as the gather asks for it
(:meth:`FlatGroup.prepare`), together with the sliced optimizer update when there is one.
"""

from __future__ import annotations

import warnings

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..wire.comm import GatherStats, peer_failure
from ..config import ZeroConfig
from ..wire.engine import CommContext, GatherHandle, finish_gather, start_gather
from ..layout.flat_layout import FlatLayout, interleaved_starts, plan_flat_layout
from ..layout.gather_plan import GatherPlan
from ..layout.gather_planner import plan_gather
from ..layout.topology import Topology
from .delta import DeltaLoop


#: Plain gradients of the contiguous order on more flat ranks than this are latency-bound chains: said.
CHAIN_WARN_WORLD = 8


# [Note: quantized gradients and the flat order]
# A quantized gradient exchange is an all-to-all of each bucket's pieces to their owners. In the
# interleaved order every bucket holds a window of every partition, so each rank sends and
# receives the same, and windows complete during backward. The interleaved order keeps each
# parameter inside one partition, so a parameter larger than a partition's share (a large
# embedding on many ranks: Qwen3-4B's pads the buffer by 55% at 16 ranks and 5x at 64) pads
# every partition to it; ``auto`` then takes the contiguous order, flat or two-level collectives
# alike. There a flat range belongs to one or two partitions, and sent to its owners it would be
# an incast on more than two ranks; so quantized gradients are reduced in windows there too
# ([Note: windows in the contiguous order] in grads.py): no incast, but a window of every
# partition completes only at the end of backward, so the reduction waits for it (it barely
# overlaps backward, and stage 2 stages up to the whole gradient until then). That cost is warned
# of on every rank with what the interleaved order would pad, never paid silently.
def order_warning(config: ZeroConfig, topology: Topology, layout: FlatLayout) -> str | None:
    """What the gradient reduction costs in ``layout``'s order where that is more than its bytes
    ([Note: quantized gradients and the flat order]): quantized windows that wait for the end of
    backward, or plain chains to the owners where the world is two-level or large; None where
    it is not."""
    if layout.order != "contiguous" or topology.world <= 2:
        return None  # two ranks: flat ranges to the other rank, no incast, and they overlap backward
    if not config.zero_quantized_gradients and not topology.two_level and topology.world <= CHAIN_WARN_WORLD:
        return None
    sizes = [s.numel for s in layout.slots]  # in model order
    padding = (interleaved_starts(sizes, layout.world_size, layout.alignment)[1] - layout.used_numel) / max(
        layout.used_numel, 1)
    if not config.zero_quantized_gradients:
        return (f"the flat order is contiguous on {topology.world} ranks: plain gradients reach their owners by one "
                f"chain reduce per owner and bucket over all {topology.world} ranks"
                f"{', not in two levels,' if topology.two_level else ''} and each chain pays a step of latency per "
                "rank, so the reduction is latency-bound at large worlds (qzero plan shows the cost); "
                "zero_quantized_gradients=true reduces them in windows"
                f"{' in two levels' if topology.two_level else ''}, and flat_order='interleaved' by reduce-scatters, "
                f"at the cost of padding this model's parameters by {padding:.0%}")
    return (f"the flat order is contiguous on {topology.world} ranks with zero_quantized_gradients=true: the "
            "quantized gradients are reduced in windows of every partition, which complete only at the end of "
            "backward, so the reduction waits for the end of backward (it barely overlaps backward) and stage 2 "
            "stages up to the whole gradient until then; flat_order='interleaved' overlaps it with backward, at "
            f"the cost of padding this model's parameters by {padding:.0%} (every gather, reduction and state grows "
            "by that much)")


class FlatGroup:
    """The flat buffer of one optimizer parameter group on one rank."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        names: list[str],
        config: ZeroConfig,
        world_size: int,
        rank: int,
        process_group: dist.ProcessGroup | None,
        context: CommContext,
        topology: Topology | None = None,
    ):
        self.params = params
        self.context = context
        self.names = names
        #: Nodes and ranks per node of the group, and whether the collectives are two-level.
        self.topology = Topology.flat(world_size) if topology is None else topology
        #: This rank in ``process_group``.
        self.pg_rank = rank
        #: The partition this rank owns: its rank, or with two-level collectives its rail-major
        #: number ([Note: rail-major partitions] in qzero/layout/topology.py). What the layout,
        #: the reducers and the residuals call a rank is this.
        self.rank = self.topology.partition_of(rank)
        self.world_size = world_size
        self.process_group = process_group
        first = params[0]
        self.dtype, self.device = first.dtype, first.device
        quantized = config.zero_quantized_weights
        delta = quantized and config.zero_quantized_weights_delta
        # The bucket bounds every receive buffer alive at once; where a schedule keeps two
        # chunks in flight, the engine runs the plan cut to fit (qzero.wire.engine.fitting_plan).
        bucket = config.allgather_bucket_size
        self.layout: FlatLayout = plan_flat_layout(
            [tuple(p.shape) for p in params],
            world_size,
            elem_size=first.element_size(),
            zero_quantized_weights_group_size=config.zero_quantized_weights_group_size,
            small_param_numel=config.small_param_numel,
            allgather_bucket_size=bucket,
            zero_quantized_weights_format=config.zero_quantized_weights_format if quantized else None,
            flat_order=config.flat_order,
            zero_quantized_weights_delta=delta,
        )
        warning = order_warning(config, self.topology, self.layout)
        if warning:
            warnings.warn(f"qzero: {warning}", stacklevel=3)
        self.gather_plan: GatherPlan = self.layout.gather
        self.exact_plan: GatherPlan = (
            plan_gather(
                self.layout.numel,
                world_size,
                elem_size=first.element_size(),
                allgather_bucket_size=bucket,
                zero_quantized_weights_format=None,
            )
            if quantized
            else self.gather_plan
        )
        #: Delta gathers: when the next gather is an exact resync ([Note: delta loop]); None otherwise.
        self.delta: DeltaLoop | None = (
            DeltaLoop(config.zero_quantized_weights_delta_resync_steps, self.device) if delta else None
        )
        self.lo, self.hi = self.layout.partition(self.rank)
        # The fp32 master shard exists from the start (the inner optimizer is built on it before
        # anything is modified) and gets its values in sync_from(). The fp32 gradient shard
        # exists from a backward's first reduction (stage 2 with a 16-bit plain reduction:
        # from the end of the backward, see [Note: landing shard] in grads.py) until
        # zero_grad() (grad_shard()): not during the forward, where a step's memory peaks.
        self.master = torch.zeros(self.hi - self.lo, dtype=torch.float32, device=self.device)
        self.grad: torch.Tensor | None = None
        self.flat: torch.Tensor | None = None
        self._update: Callable[[int, int], None] | None = None
        self._prepared = 0
        self._slice = 0  # length of the last update slice
        self._copy = True  # prepare() copies the master shard into the partition (not for a delta gather)

    def flatten(self) -> None:
        """Copy the parameters into one flat buffer and make them views into it."""
        self.flat = torch.zeros(self.layout.numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for slot, p in zip(self.layout.slots, self.params):
                view = self.flat[slot.start : slot.stop]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view(slot.shape)

    def sync_from(self, src_rank: int) -> None:
        """Make every replica start from ``src_rank``'s weights (as DDP does), then fill the
        fp32 master shard from this rank's partition."""
        if self.world_size > 1:
            with peer_failure("ZeroOptimizer: the broadcast of the initial weights"):
                dist.broadcast(self.flat, src=src_rank, group=self.process_group)
        self.master.copy_(self.flat[self.lo : self.hi])

    def grad_shard(self) -> torch.Tensor:
        """The fp32 gradient shard (also the master's ``.grad``), made zero if there is none."""
        if self.grad is None:
            self.grad = torch.zeros_like(self.master)
            self.master.grad = self.grad
        return self.grad

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradient shard (``set_to_none``), or zero it in place."""
        if set_to_none:
            self.grad = self.master.grad = None
        elif self.grad is not None:
            self.grad.zero_()

    @property
    def own(self) -> torch.Tensor:
        """This rank's partition of the flat buffer."""
        return self.flat[self.lo : self.hi]

    def gather(self, update: Callable[[int, int], None] | None = None) -> GatherStats:
        """Copy the master shard into the partition and gather every partition.

        ``update(start, stop)``, if given, steps the master shard's ``[start, stop)`` first;
        the gather asks for it chunk by chunk (:meth:`prepare`), so the first chunks leave
        before the whole update has run (sliced update)."""
        return finish_gather(self.start_gather(update))

    def start_gather(self, update: Callable[[int, int], None] | None = None, ahead: bool = False) -> GatherHandle:
        """Copy the master shard into the partition and start the gather without waiting
        (``update`` as in :meth:`gather`; what the gather has not asked for yet is updated
        by :meth:`prepare` of the whole shard, which the caller runs next).

        With delta gathers the partition keeps the replica: the payloads are made from the
        master shard and the replica (no copy), unless this gather is an exact resync
        ([Note: delta loop])."""
        self._update, self._prepared, self._slice = update, 0, 0
        plan, inputs = self.gather_plan, None
        if self.delta is not None:
            exact = self.delta.next_is_exact()
            self.delta.gathered(exact)
            if exact:
                plan = self.exact_plan
            else:
                inputs = self.delta.inputs(self.master)
        self._copy = inputs is None
        return start_gather(self.flat, plan, self.process_group, self.context, prepare=self.prepare,
                            ahead=ahead, delta=inputs, partition=self.rank)

    def prepare(self, stop: int) -> bool:
        """Make the partition's local ``[0, stop)`` hold the updated master shard: update
        (if a sliced update is running) and copy what has not been yet, in order. Returns
        whether it queued any work.

        Slices at least double in length, whatever the chunks asked for: each update slice is
        one call of the inner optimizer, whose host cost (hundreds of microseconds) would
        otherwise be paid once per chunk, and chunks are small where the bucket is. So a
        step makes about ``log2(shard / first chunk)`` calls, and the first chunk still
        leaves after an update of its own size."""
        n = self.hi - self.lo
        stop = min(stop, n)
        start = self._prepared
        if stop <= start:
            return False
        stop = min(n, max(stop, start + 2 * self._slice))
        self._slice = stop - start
        if self._update is not None:
            self._update(start, stop)
        if self._copy:
            self.own[start:stop].copy_(self.master[start:stop])
        self._prepared = stop
        if stop == n:
            self._update = None  # this step's update is complete
        return True

    def restore_replica(self, loop_state: dict) -> None:
        """After a checkpoint load put this rank's partition of the saved replica in place: zero
        its padding, gather the partitions as they are (plainly) and take up the saved loop."""
        for a, b in self.layout.padding_ranges(self.lo, self.hi):
            self.own[a:b].zero_()
        finish_gather(start_gather(self.flat, self.exact_plan, self.process_group, self.context,
                                   partition=self.rank))
        self.delta.load_state_dict(loop_state)

    def gather_exact(self) -> GatherStats:
        """Gather the exact bf16/fp16 of every rank's masters (no quantization): with delta
        gathers, an exact resync."""
        self.own.copy_(self.master)
        stats = finish_gather(start_gather(self.flat, self.exact_plan, self.process_group, self.context,
                                   partition=self.rank))
        if self.delta is not None:
            self.delta.gathered(exact=True)
        return stats
