"""qzero's quantized gradient reduction inside DeepSpeed ZeRO stage 2.

[Note: DeepSpeed's ZeRO-2 reduction] After backward fills an IPG bucket, DeepSpeed's
``DeepSpeedZeroOptimizer.average_tensor`` divides it by the data-parallel size and cuts it
into *slices*, each the part of one parameter's gradient that one rank's partition holds
(``(owner, bucket offset, numel)``; neighbours with one owner merged). It then hands the
slices, a sub-bucket of at most ``reduce_bucket_size`` elements at a time, to one of two
methods of the optimizer:

- ``allreduce_and_copy_with_multiple_ranks`` (``use_multi_rank_bucket_allreduce``, the
  default): flattens the sub-bucket, all-reduces it in the communication dtype (every rank
  sends ``2 (N - 1) / N`` of it and receives every slice), and each rank copies back the
  slices it owns;
- ``allreduce_and_copy`` with ``rank=dst`` (otherwise): one sub-bucket per owner,
  ``dist.reduce`` to it, the owner copies back.

Either way the owner adds a slice into DeepSpeed's fp32 gradient partition buffer when it
has one (``_add_to_grad_partition_buffer``) and copies it into the bucket (``buf.copy_``),
from where DeepSpeed moves it into its partition after the call.

:class:`DeepSpeedGradientReduction` replaces both methods *on one optimizer instance*
(instance attributes; the class and other optimizers are untouched) by qzero's quantized
exchange (:class:`qzero.wire.quantized_reduce.QuantizedExchange`, the FSDP2 reduce-scatter's
engine): the call's slices are staged into one buffer of the sub-bucket's size grouped by
owner in rank order, each owner's run is one piece, one ``all_to_all_single`` sends every
piece only to its owner (codes and fp32 scales; the slices of parameters with at most
``small_param_numel`` elements verbatim), and the owner sums its own piece unquantized and
the others' dequantized in fp32 in rank order, casts to the slice dtype and does what
DeepSpeed does with an owned slice. A sender's traffic per element it does not own is
``bits / 8 + 4 / group_size`` bytes instead of the reduce dtype's size (``2 (N - 1) / N``
of the sub-bucket for the all-reduce).

Left to DeepSpeed's own methods, exactly: a call with a slice more than one rank keeps
(Muon's split matrices), a full all-reduce (``rank=None``: DeepSpeed's non-contiguous
fallback), a process group of one rank and a dtype the gradient kernels do not take. Each
is counted in :attr:`DeepSpeedGradientReduction.calls`.

The call's slices are usually DeepSpeed's bucket itself: views that lie back to back, each
owner's one run (neighbours with one owner are merged). Then the exchange reads its pieces
from the bucket where they lie and the owner's averaged sum is cast into its run with one
copy; only slices that do not lie so are staged into a buffer by owner first.

[Note: the DeepSpeed adapter on several nodes]
The exchange is owner-contiguous: a sub-bucket belongs to one or two owners, and every rank
sends its slices to them directly. Across nodes of ``L`` ranks each node then sends ``L`` times
what a node-aware reduce-scatter sends (NCCL's ring crosses each node boundary once), and
all ranks send to one owner at a time (an incast). DeepSpeed decides the owners, so the
partitions cannot be renumbered rail-major for a two-level reduction as the ZeroOptimizer
does. :func:`check_topology` therefore refuses a data-parallel group of several nodes of
several ranks (every rank raises, from hosts exchanged over the world), naming what to use
instead: DeepSpeed's own reduction (``zero_quantized_gradients=false``, node-aware in NCCL),
:class:`qzero.ZeroOptimizer` (two-level), or ``hierarchical_collectives=false`` to run the flat
exchange knowingly. One rank per node, or one node, is not refused: the exchange then
sends no more across the network than a two-level one would. The incast is there on one node
too, at any world above two: every rank warns of it (:data:`INCAST_WARNING`).

Transient memory per call: the staging buffer where one is needed (the sub-bucket's size,
which DeepSpeed's own flatten allocates too), the packed payloads (about half of it for int8
codes from bf16) and the received ones (``N - 1`` payloads of this rank's piece), and an fp32
sum of this rank's piece.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..config import ZeroConfig
from ..layout.gather_plan import merge_adjacent
from ..layout.topology import topology_from_hosts
from ..quant import gradient_kernels_for
from ..quant.gradients import GRADIENT_DTYPES
from ..wire.agreement import digest
from ..wire.labels import REDUCE_GRADIENTS, label
from ..wire.quantized_reduce import GradientQuantization, QuantizedExchange

__all__ = ["DeepSpeedGradientReduction", "GradientReductionSettings", "check_topology", "install", "installed"]

#: The optimizer methods replaced (per instance) while the reduction is installed.
REPLACED = ("allreduce_and_copy_with_multiple_ranks", "allreduce_and_copy")
ATTR = "qzero_gradient_reduction"


class GradientReductionSettings(NamedTuple):
    """The gradient settings of the adapter, by :class:`qzero.ZeroConfig`'s field names
    (validated by it, the rotation resolved to its block, 0 for none)."""

    zero_quantized_gradients_format: str
    zero_quantized_gradients_group_size: int
    zero_quantized_gradients_rotation_block: int
    small_param_numel: int
    quant_kernels: str = ZeroConfig.quant_kernels

    @classmethod
    def from_config(cls, config: ZeroConfig) -> GradientReductionSettings:
        quant = GradientQuantization.from_config(config)
        return cls(quant.fmt, quant.group_size, quant.rotation, config.small_param_numel, config.quant_kernels)

    @property
    def quantization(self) -> GradientQuantization:
        return GradientQuantization(self.zero_quantized_gradients_group_size, self.zero_quantized_gradients_format,
                                    self.zero_quantized_gradients_rotation_block)


def agreement_fields(settings: GradientReductionSettings | None) -> dict[str, int]:
    """The gradient settings every rank must agree on, as integers, the same names whether
    the reduction is on or off (None: all 0)."""
    s = settings
    return {"zero_quantized_gradients": int(s is not None),
            "zero_quantized_gradients_format": digest(s.zero_quantized_gradients_format) if s else 0,
            "zero_quantized_gradients_group_size": s.zero_quantized_gradients_group_size if s else 0,
            "zero_quantized_gradients_rotation_block": s.zero_quantized_gradients_rotation_block if s else 0,
            "gradient small_param_numel": s.small_param_numel if s else 0}


def installed(optimizer) -> DeepSpeedGradientReduction | None:
    """The reduction installed on ``optimizer``, or None."""
    return getattr(optimizer, ATTR, None)


def install(optimizer, settings: GradientReductionSettings) -> DeepSpeedGradientReduction:
    """Replace ``optimizer``'s ZeRO-2 gradient reduction by the quantized exchange (see the
    module's docstring); returns the :class:`DeepSpeedGradientReduction` (also
    ``optimizer.qzero_gradient_reduction``). Raises ``ValueError`` for an optimizer whose
    reduction this does not implement, before anything is changed. Local: the topology is
    checked (on every rank) by :func:`qzero.integrations.deepspeed.initialize`, through
    :func:`check_topology`; a caller of this function on several nodes calls that first."""
    check_optimizer(optimizer)
    old = installed(optimizer)
    if old is not None:
        old.remove()
    reduction = DeepSpeedGradientReduction(optimizer, settings)
    for name in REPLACED:
        setattr(optimizer, name, getattr(reduction, name))
    setattr(optimizer, ATTR, reduction)
    return reduction


def check_optimizer(optimizer) -> None:
    """The optimizer must be DeepSpeed's ZeRO-2 ``DeepSpeedZeroOptimizer`` reducing by slices."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        raise ValueError(f"zero_quantized_gradients=true needs DeepSpeed's ZeRO stage 2 optimizer "
                         f"(DeepSpeedZeroOptimizer), got {type(optimizer).__name__}")
    checks = (("partition_gradients", True, "ZeRO stage 2"), ("reduce_scatter", True, "reduce_scatter=true"),
              ("contiguous_gradients", True, "contiguous_gradients=true"),
              ("sequence_parallel_size", 1, "no sequence parallelism"))
    for attr, want, what in checks:
        got = getattr(optimizer, attr, want)
        if got != want:
            raise ValueError(f"zero_quantized_gradients=true needs {what} (the optimizer has {attr}={got!r}): "
                             "DeepSpeed reduces the gradients another way there")


#: Warned of on every rank where the adapter's quantized gradients run over more than two ranks.
INCAST_WARNING = (
    "zero_quantized_gradients=true over a data-parallel group of {world} ranks: the DeepSpeed adapter's "
    "exchange is owner-contiguous (DeepSpeed gives each bucket one or two owners), so all ranks send their "
    "quantized pieces to those owners at once, an incast up to {world}-1 times slower on the owner's link than "
    "a spread exchange of the same bytes; on a slow link it can take longer than DeepSpeed's own all-reduce. "
    "Time both (zero_quantized_gradients=false), or use qzero.ZeroOptimizer, whose exchange is spread")


def check_topology(optimizer, hosts, ranks_per_node: int, hierarchical) -> None:
    """Refuse a data-parallel group of ``optimizer`` (each flat group's, MoE expert groups too)
    that spans several nodes of several ranks, unless ``hierarchical`` is false ([Note: the
    DeepSpeed adapter on several nodes]); warn of the incast where a group has more than two
    ranks. ``hosts``: every rank's host signature, by global rank
    (:func:`qzero.wire.two_level.exchange_hosts` over the world)."""
    groups = list(getattr(optimizer, "real_dp_process_group", None) or [optimizer.dp_process_group])
    seen = set()
    for group in groups:
        ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
        if ranks in seen or len(ranks) == 1:
            continue
        seen.add(ranks)
        if len(ranks) > 2 and len(seen) == 1:
            warnings.warn(INCAST_WARNING.format(world=len(ranks)), stacklevel=2)
        if hierarchical is False and ranks_per_node == 0:
            continue
        topology, _ = topology_from_hosts([hosts[r] for r in ranks], ranks_per_node, hierarchical)
        if topology.two_level:
            L = topology.ranks_per_node
            raise ValueError(
                f"zero_quantized_gradients=true over a data-parallel group of {topology.nodes} nodes x {L} ranks: the "
                f"DeepSpeed adapter's quantized exchange is flat (each node would send its gradients across the "
                f"network {L} times, all ranks to one owner at a time); set zero_quantized_gradients=false "
                "(DeepSpeed's own reduction, node-aware in NCCL), use qzero.ZeroOptimizer (two-level), or set "
                "hierarchical_collectives=false to run the flat exchange knowingly")


class DeepSpeedGradientReduction:
    """The quantized ZeRO-2 gradient reduction of one DeepSpeed optimizer (see the module's
    docstring). ``calls`` counts calls run quantized and by DeepSpeed's own method;
    ``bytes_sent`` and ``plain_bytes`` are this rank's bytes over all quantized calls and
    what DeepSpeed's all-reduce of the same sub-buckets sends (``2 (N - 1) / N`` of each)."""

    def __init__(self, optimizer, settings: GradientReductionSettings):
        self.optimizer = optimizer
        self.settings = settings
        # DeepSpeed's own methods, bound to this instance: the exact fallback.
        self.original = {name: getattr(type(optimizer), name).__get__(optimizer) for name in REPLACED}
        self.calls = {"quantized": 0, "plain": 0}
        self.bytes_sent = 0
        self.plain_bytes = 0
        # (process group, dtype, device, owners, sizes, exact ranges) -> _Route; the same for a
        # bucket every backward.
        self._routes: dict = {}

    def remove(self) -> None:
        """Give the optimizer DeepSpeed's own methods back."""
        opt = self.optimizer
        for name in REPLACED:
            if name in vars(opt):
                delattr(opt, name)
        if getattr(opt, ATTR, None) is self:
            delattr(opt, ATTR)

    # ------------------------------------------------------------------ DeepSpeed's two methods

    def allreduce_and_copy_with_multiple_ranks(self, small_bucket, communication_data_type, log=None, divide=True,
                                               process_group=None, bucket_ranks=None, output_bucket=None):
        opt = self.optimizer
        pg = opt.dp_process_group if process_group is None else process_group
        owners = [_single_owner(r) for r in bucket_ranks] if bucket_ranks is not None else [None]
        if None in owners or not self._quantizable(small_bucket, pg):
            self.calls["plain"] += 1
            return self.original["allreduce_and_copy_with_multiple_ranks"](
                small_bucket, communication_data_type, log=log, divide=divide, process_group=pg,
                bucket_ranks=bucket_ranks, output_bucket=output_bucket)
        # DeepSpeed runs this on its reduction stream already (average_tensor's stream context).
        self._reduce(small_bucket, owners, output_bucket, divide, pg, opt.reduction_stream)

    def allreduce_and_copy(self, small_bucket, communication_data_type, rank=None, log=None, divide=True,
                           process_group=None, output_bucket=None):
        opt = self.optimizer
        pg = opt.dp_process_group if process_group is None else process_group
        if rank is None or not self._quantizable(small_bucket, pg):
            self.calls["plain"] += 1
            return self.original["allreduce_and_copy"](
                small_bucket, communication_data_type, rank=rank, log=log, divide=divide, process_group=pg,
                output_bucket=output_bucket)
        from deepspeed.accelerator import get_accelerator

        accel = get_accelerator()
        if opt.overlap_comm:  # as DeepSpeed's allreduce_and_copy
            if not accel.resolves_data_dependency():
                accel.synchronize()
            opt._clear_previous_reduced_grads()
            stream = opt.reduction_stream
        else:
            stream = accel.current_stream()
        with accel.stream(stream):
            self._reduce(small_bucket, [rank] * len(small_bucket), output_bucket, divide, pg, stream)

    # ------------------------------------------------------------------ the exchange

    def _quantizable(self, small_bucket, pg) -> bool:
        if dist.get_world_size(group=pg) == 1 or not small_bucket:
            return False
        dtypes = {t.dtype for t in small_bucket}
        return len(dtypes) == 1 and dtypes.pop() in GRADIENT_DTYPES

    def _reduce(self, small_bucket, owners, output_bucket, divide, pg, stream) -> None:
        from deepspeed.accelerator import get_accelerator

        opt = self.optimizer
        like = small_bucket[0]
        route = self._route(pg, like, owners, [t.numel() for t in small_bucket], self._exact_of(small_bucket),
                            _back_to_back(small_bucket, owners))
        world = route.world
        if route.in_place:  # the bucket itself, each owner's run where it lies
            staged = like.as_strided((route.numel,), (1,))
        else:  # one copy kernel for all slices, by owner
            staged = torch.cat([small_bucket[i].reshape(-1) for i in route.order])
        with label(REDUCE_GRADIENTS):
            pending, sent = route.exchange.launch(staged, 0, route.parts)
            result = route.exchange.finish(pending, 0)
        overlap = opt.overlap_comm and not get_accelerator().resolves_data_dependency()
        if overlap:
            staged.record_stream(stream)
        self.calls["quantized"] += 1
        self.bytes_sent += sent
        self.plain_bytes += 2 * (world - 1) * route.numel * like.element_size() // world
        if result is None:
            return  # this rank owns no slice of the call
        total, start = result
        if divide and opt.gradient_average:  # as DeepSpeed's allreduce_bucket
            total.div_(world / float(opt.sequence_parallel_size))
        if output_bucket is None:
            output_bucket = [None] * len(small_bucket)
        if route.in_place and all(output_bucket[i] is None for i, _ in route.owned):
            # the owned slices are one run of the bucket: one copy casts the sum into all of them
            run = staged.narrow(0, start, total.numel())
            run.copy_(total)
            if overlap:
                run.record_stream(stream)
            return
        total = total.to(like.dtype)  # one cast for every owned slice
        for i, at in route.owned:
            buf = small_bucket[i]
            synced = total[at - start : at - start + buf.numel()].view(buf.shape)
            opt._add_to_grad_partition_buffer(output_bucket[i], synced)
            buf.copy_(synced)
            if overlap:
                buf.record_stream(stream)

    def _exact_of(self, small_bucket) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per slice: its ranges (slice coordinates) that belong to small parameters, found
        by address among the gradients of the parameters in DeepSpeed's IPG buckets (each
        slice is a view of one of them)."""
        opt = self.optimizer
        small = []
        for bucket in opt.ipg_buckets.values():
            for i, j, _ in bucket.params:
                param = opt.bit16_groups[i][j]
                if param.numel() <= self.settings.small_param_numel:
                    grad = opt.get_gradient_for_reduction(param)
                    if grad is not None:
                        small.append((grad.data_ptr(), grad.data_ptr() + grad.numel() * grad.element_size()))
        out = []
        for t in small_bucket:
            lo, size = t.data_ptr(), t.element_size()
            hi = lo + t.numel() * size
            out.append(tuple(((max(a, lo) - lo) // size, (min(b, hi) - lo) // size)
                             for a, b in small if a < hi and b > lo))
        return tuple(out)

    def _route(self, pg, like, owners, numels, exact_of, in_place: bool = False) -> _Route:
        """How a call's slices travel: a pure function of the process group, the dtype and
        device, per slice its owner, size and exact ranges, and whether the slices lie back to
        back by owner (:func:`_back_to_back`), so one is kept per distinct call (DeepSpeed's
        buckets repeat every backward)."""
        key = (pg, like.dtype, like.device, tuple(owners), tuple(numels), exact_of, in_place)
        route = self._routes.get(key)
        if route is None:
            route = self._routes[key] = self._plan_route(pg, like, owners, numels, exact_of, in_place)
        return route

    def _plan_route(self, pg, like, owners, numels, exact_of, in_place: bool = False) -> _Route:
        world, rank = dist.get_world_size(group=pg), dist.get_rank(group=pg)
        # in place: where the slices lie; else staged by owner, bucket order kept (stable sort)
        order = list(range(len(numels))) if in_place else sorted(range(len(numels)), key=lambda i: owners[i])
        at, placed, exact = 0, {}, []
        for i in order:
            placed[i] = at
            exact.extend((at + a, at + b) for a, b in exact_of[i])
            at += numels[i]
        parts = []
        for dest in sorted(set(owners)):
            members = [i for i in order if owners[i] == dest]
            lo = placed[members[0]]
            parts.append((dest, lo, sum(numels[i] for i in members), lo))
        s = self.settings
        exchange = QuantizedExchange.over(s.quantization, like.dtype, pg, world, rank, like.device,
                                          gradient_kernels_for(like.device, s.quant_kernels), merge_adjacent(exact))
        owned = tuple((i, placed[i]) for i in order if owners[i] == rank)
        return _Route(world, rank, tuple(order), at, tuple(parts), owned, exchange, in_place)


class _Route(NamedTuple):
    """One distinct call's plan (:meth:`DeepSpeedGradientReduction._route`): ``order`` the
    slices as staged (by owner; or as they lie, ``in_place``), ``numel`` their total, ``parts``
    the exchange's pieces ``(owner, offset, numel, offset)``, ``owned`` this rank's slices with
    their staged offsets, the exchange that carries them, and whether the slices are read and
    written where they lie in the bucket (:func:`_back_to_back`) rather than staged."""

    world: int
    rank: int
    order: tuple[int, ...]
    numel: int
    parts: tuple[tuple[int, int, int, int], ...]
    owned: tuple[tuple[int, int], ...]
    exchange: QuantizedExchange
    in_place: bool = False


def _back_to_back(small_bucket, owners) -> bool:
    """Whether the slices lie back to back in one tensor's storage in the order given
    (contiguous, each starting where the one before ends) and each owner's slices are one run:
    then the bucket itself is the exchange's staging buffer, each owner's piece where it lies."""
    first = small_bucket[0]
    storage, size = first.untyped_storage().data_ptr(), first.element_size()
    end = first.data_ptr()
    for t in small_bucket:
        if t.data_ptr() != end or not t.is_contiguous() or t.untyped_storage().data_ptr() != storage:
            return False
        end += t.numel() * size
    seen, prev = set(), None
    for i, owner in enumerate(owners):
        if i and owner == prev:
            continue
        if owner in seen:
            return False
        seen.add(owner)
        prev = owner
    return True


def _single_owner(bucket_rank):
    """The one rank that keeps a slice, or None when several do (Muon's split matrices)."""
    if isinstance(bucket_rank, frozenset):
        return next(iter(bucket_rank)) if len(bucket_rank) == 1 else None
    return bucket_rank
