"""FSDP2's gradient reduce-scatter, quantized one parameter group at a time.

After backward, FSDP2 copies the unsharded gradients of one ``fully_shard`` module (one
FSDP parameter group) into a reduce-scatter input of ``world * n`` elements in the reduce
dtype, rank ``r``'s part at ``r * n``: the concatenation, in the group's parameter order,
of the gradients' padded dim-0 shards that rank ``r`` owns. On its reduce-scatter stream
it then calls the group's reduce-scatter communication object as ``comm(output_tensor=
(n elements), input_tensor=..., group=..., op=...)`` and records an event there that the
stream which views the output as the sharded gradients waits for (the return value is not
used). ``op`` is ``AVG`` (fp32/bf16 reduce dtype), ``SUM`` (fp16: FSDP2 divides before and
after itself; or ``set_force_sum_reduction_for_comms``) or ``PREMUL_SUM(1 / factor)``
(``set_gradient_divide_factor``). ``FSDPModule.set_custom_reduce_scatter`` replaces that
object; a custom one excludes ``set_symm_mem`` and ``set_allocate_memory_from_process_group``.

:class:`GroupQuantizedReduceScatter` is such an object, with the arithmetic of qzero's
quantized gradient reduction (:mod:`qzero.wire.quantized_reduce`, the
:class:`~qzero.wire.quantized_reduce.QuantizedExchange` the ZeroOptimizer uses): rank
``r``'s part is one piece, the parts other ranks own are packed (symmetric groups of
``group_size`` counted from the start of each part, so no group spans two owners; one fp32
scale each; the shards of parameters with at most ``small_param_numel`` elements verbatim
in the side channel; with a rotation, each part rotated by blocks first), one
``all_to_all_single`` with uneven splits moves them, and each rank sums in fp32 and rank
order its own part unquantized and the others' dequantized payloads (with a rotation, the
rotated parts, rotated back once after the sum). The op is then applied to that fp32 sum
(``AVG``: times ``1 / world``, as the
ZeroOptimizer averages; ``PREMUL_SUM``: the input is multiplied by the factor before it
is packed, as the op defines) and the result is cast into the output. A group holding NaN
or Inf on any rank arrives as NaN, so a non-finite gradient stays visible.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from ..config import ZeroConfig
from ..wire.agreement import canonical
from ..wire.comm import local_outcome
from ..wire.labels import REDUCE_GRADIENTS, label
from ..layout.flat_layout import is_small_param
from ..layout.gather_plan import merge_adjacent
from ..quant import gradient_kernels_for
from ..quant.gradients import GRADIENT_DTYPES
from ..vocabulary import refuse_renamed
from .nodes import exchange_group_hosts, shard_topology, two_level_groups, warn_once
from ._comms import (GRADIENT_RENAMED, agree_install, groups_to_convert, install_group, installer_config, keep_report,
                     settings_of, stored_report)

__all__ = ["GroupReduce", "GroupReduceReport", "GroupQuantizedReduceScatter", "quantize_group_reduces"]

REDUCE_REPORT_ATTR = "_qzero_group_reduce_report"


class GroupReduce(NamedTuple):
    """One FSDP parameter group: the bytes one rank sends in one reduce-scatter of it
    (``plain_bytes``: what FSDP2's own reduce-scatter sends, the other ranks' parts in the
    reduce dtype)."""

    module: str  # the module's name in the model ("" for the root)
    params: int
    exact_params: int  # parameters whose gradients are reduced exactly (small ones)
    bytes_sent: int
    plain_bytes: int
    bytes_across_nodes: int = 0
    """Of ``bytes_sent``, what goes to ranks of other nodes (0 where the shard group is one
    node, or its nodes are not known: ``hierarchical_collectives=false`` without ``ranks_per_node``)."""


class GroupReduceReport(NamedTuple):
    """What :func:`quantize_group_reduces` installed, one entry per FSDP parameter group."""

    groups: tuple[GroupReduce, ...]

    @property
    def exact_params(self) -> int:
        return sum(g.exact_params for g in self.groups)

    @property
    def bytes_sent(self) -> int:
        """Bytes one rank sends when every group is reduced once (one backward)."""
        return sum(g.bytes_sent for g in self.groups)

    @property
    def plain_bytes(self) -> int:
        return sum(g.plain_bytes for g in self.groups)

    @property
    def bytes_across_nodes(self) -> int:
        """Of :attr:`bytes_sent`, what one rank sends to other nodes."""
        return sum(g.bytes_across_nodes for g in self.groups)

    def summary(self) -> str:
        across = self.bytes_across_nodes
        return (f"qzero.fsdp: {len(self.groups)} parameter group(s) reduce-scattered quantized ({self.exact_params} "
                f"small parameter(s) exact inside them); {self.bytes_sent} bytes a rank per backward, plain "
                f"{self.plain_bytes}" + (f"; {across} of them to other nodes" if across else ""))


def quantize_group_reduces(
    model: nn.Module,
    *,
    zero_quantized_gradients_format: str = ZeroConfig.zero_quantized_gradients_format,
    zero_quantized_gradients_group_size: int | None = ZeroConfig.zero_quantized_gradients_group_size,
    zero_quantized_gradients_rotation: str | None = ZeroConfig.zero_quantized_gradients_rotation,
    zero_quantized_gradients_rotation_block: int = ZeroConfig.zero_quantized_gradients_rotation_block,
    small_param_numel: int = ZeroConfig.small_param_numel,
    quant_kernels: str = ZeroConfig.quant_kernels,
    ranks_per_node: int = ZeroConfig.ranks_per_node,
    hierarchical_collectives: bool | str = ZeroConfig.hierarchical_collectives,
    **renamed,
) -> GroupReduceReport:
    """Make every FSDP2 parameter group of ``model`` reduce-scatter its gradients quantized;
    return a report.

    Call after ``fully_shard`` (on the root, once). Each ``fully_shard`` module gets a
    :class:`GroupQuantizedReduceScatter` through ``set_custom_reduce_scatter``. The weight
    all-gather is independent: this combines with :func:`qzero.fsdp.quantize_group_gathers`
    and :func:`qzero.fsdp.quantize_weight_gathers`. The settings are :class:`qzero.ZeroConfig`'s,
    with its defaults and checks: ``zero_quantized_gradients_format`` (``int8``, ``fp8`` or
    ``int4``), ``_group_size`` (None: 256 for ``int4``, 64 otherwise), ``_rotation``
    (``hadamard`` by blocks of ``_rotation_block``
    elements, or ``none``; None: ``hadamard`` for ``int4``, ``none`` otherwise),
    ``small_param_numel`` and ``quant_kernels`` (``auto``, ``triton`` or ``reference``). The
    short names ``fmt`` and ``group_size`` name the *weight* settings and are refused here,
    as is any other keyword, by a ``TypeError`` naming the one to use. Error feedback is the
    ZeroOptimizer's (optimizer state); this reduce-scatter keeps none.

    Several nodes: ``ranks_per_node`` (0: detected from the hosts) and ``hierarchical_collectives``
    are ZeroConfig's. Over a shard group of several nodes of several ranks the reduce-scatter
    runs in two stages (inside the node in the reduce dtype, then quantized across nodes among
    one rail, fp32 sums), so each node sends its quantized gradients across the network once
    instead of once per rank; ``hierarchical_collectives=false`` keeps the flat all-to-all
    ([Note: FSDP2 on several nodes] in :mod:`qzero.fsdp.nodes`). An HSDP mesh that shards
    inside the node (replicating across nodes) reduce-scatters inside the node only.

    Raises ``ValueError``/``TypeError`` naming the problem, with nothing installed, for a
    bad argument, a model with no ``fully_shard`` module, a model already converted by this
    function, a group that already has a custom reduce-scatter, or a torch whose FSDP2 has
    no ``set_custom_reduce_scatter``. At reduce time, an op other than SUM, AVG or
    PREMUL_SUM (HSDP's or a custom one) raises ``ValueError``.
    """
    group = install_group(model)
    hosts = exchange_group_hosts(group)  # first, on every rank: nothing local can fail before it

    def plan():
        config = installer_config(quantize_group_reduces, model, renamed, dict(
            zero_quantized_gradients_format=zero_quantized_gradients_format,
            zero_quantized_gradients_group_size=zero_quantized_gradients_group_size,
            zero_quantized_gradients_rotation=zero_quantized_gradients_rotation,
            zero_quantized_gradients_rotation_block=zero_quantized_gradients_rotation_block,
            small_param_numel=small_param_numel, quant_kernels=quant_kernels, ranks_per_node=ranks_per_node,
            hierarchical_collectives=hierarchical_collectives),
            switch="zero_quantized_gradients", renamed=GRADIENT_RENAMED)
        out, warned = [], set()
        for name, module, pg in groups_to_convert(
                model, function="quantize_group_reduces", setter="set_custom_reduce_scatter",
                attr="_reduce_scatter_comm", what="reduce-scatter", ours=GroupQuantizedReduceScatter,
                own_names=("DefaultReduceScatter", "ProcessGroupAllocReduceScatter"), kernels=config.quant_kernels,
                kernels_for=gradient_kernels_for):
            topology, warning = shard_topology(pg, hosts, config)
            warn_once(warned, warning)
            comm = GroupQuantizedReduceScatter(pg.fsdp_params, name=name, **settings_of(
                config, "zero_quantized_gradients_group_size", "zero_quantized_gradients_format", "small_param_numel",
                "quant_kernels", "zero_quantized_gradients_rotation", "zero_quantized_gradients_rotation_block"))
            out.append((module, comm, _describe(name, pg, comm, topology), (pg, topology)))
        return config, out

    planned, error = local_outcome(plan)
    config, plans = planned if planned else (None, None)
    # the rotation is agreed as its block (0: none): ranks that rotate differently disagree on it
    agree_install("quantize_group_reduces", group, error, settings=config and dict(
                      settings_of(config, "zero_quantized_gradients_format", "zero_quantized_gradients_group_size",
                                  "small_param_numel", "ranks_per_node"),
                      zero_quantized_gradients_rotation_block=_rotation_block(config),
                      hierarchical_collectives=str(config.hierarchical_collectives).lower()),
                  layout_name="parameter groups",
                  layout={info.module or "<root>": canonical(tuple(info)) for _, _, info, _ in plans}
                  if plans else None)
    groups = {}  # one node and one rail group per distinct shard group, created together on every rank
    for module, comm, _, (pg, topology) in plans:
        if topology.two_level:
            comm.use_two_level(two_level_groups(groups, pg, topology))
        module.set_custom_reduce_scatter(comm)
    return keep_report(model, REDUCE_REPORT_ATTR, GroupReduceReport(tuple(info for _, _, info, _ in plans)))


def _rotation_block(settings) -> int:
    """The rotation block of ``settings`` (a ZeroConfig, or a :class:`GroupQuantizedReduceScatter`:
    its gradient settings by ZeroConfig's names), 0 for none."""
    return (settings.zero_quantized_gradients_rotation_block
            if settings.zero_quantized_gradients_rotation != "none" else 0)


def group_reduce_report(model: nn.Module) -> GroupReduceReport:
    """The :class:`GroupReduceReport` that :func:`quantize_group_reduces` made for ``model``."""
    return stored_report(model, REDUCE_REPORT_ATTR, "quantize_group_reduces")


try:  # torch releases with set_custom_reduce_scatter define the interface it takes
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatter
except ImportError:  # pragma: no cover - older torch: quantize_group_reduces refuses to run
    _ReduceScatter = object


@refuse_renamed(**GRADIENT_RENAMED)
class GroupQuantizedReduceScatter(_ReduceScatter):
    """FSDP2's reduce-scatter of one parameter group's gradients, quantized (see the
    module's docstring). Installed by :func:`quantize_group_reduces`. Its settings are named
    as :class:`qzero.ZeroConfig`'s fields, the rotation resolved (``hadamard`` or ``none``);
    the keywords of earlier releases (``group_size``, ``fmt``, ``kernels``, ``rotation``) are
    refused, naming the new ones."""

    def __init__(self, fsdp_params, *, zero_quantized_gradients_group_size: int, zero_quantized_gradients_format: str,
                 small_param_numel: int, quant_kernels: str, name: str,
                 zero_quantized_gradients_rotation: str = "none",
                 zero_quantized_gradients_rotation_block: int = ZeroConfig.zero_quantized_gradients_rotation_block):
        self.fsdp_params = list(fsdp_params)
        self.zero_quantized_gradients_group_size = zero_quantized_gradients_group_size
        self.zero_quantized_gradients_format = zero_quantized_gradients_format
        self.zero_quantized_gradients_rotation = zero_quantized_gradients_rotation
        self.zero_quantized_gradients_rotation_block = zero_quantized_gradients_rotation_block
        self.small_param_numel, self.quant_kernels, self.name = small_param_numel, quant_kernels, name
        self._exchanges: dict = {}
        #: Two-level groups of the shard group (:meth:`use_two_level`), else None: the flat exchange.
        self.two_level = None
        self._two_level_reduces: dict = {}
        #: How many calls ran quantized, and how many FSDP2's plain reduce-scatter (a backward
        #: in which some parameters of the group had no gradient, or a reduce dtype the
        #: gradient kernels do not take).
        self.calls = {"quantized": 0, "plain": 0}
        #: Bytes this rank sent, and what the plain reduce-scatter would have sent, over all calls.
        self.bytes_sent = 0
        self.plain_bytes = 0

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        world, rank = group.size(), group.rank()
        n = output_tensor.numel()
        kind, factor = _op_kind(op, self.name)
        plain = n * (world - 1) * input_tensor.element_size()
        if world == 1 or not self._quantizable(input_tensor, n, world):
            self.calls["plain"] += 1
            self.bytes_sent += plain
            self.plain_bytes += plain
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        if kind == "premul":
            input_tensor.mul_(factor)  # the op's own definition: each rank's input times the factor, then summed
        # On the stream FSDP2 called us on (its reduce-scatter stream): FSDP2 records its
        # event there after we return, and the stream that reads the output waits for it.
        if self.two_level is not None:
            total, sent = self._reduce_two_level(input_tensor, n, world)
        else:
            exchange = self._exchange(n, world, rank, group, input_tensor)
            parts = [(r, r * n, n, r * n) for r in range(world)]
            with label(REDUCE_GRADIENTS):
                pending, sent = exchange.launch(input_tensor, n, parts)
                total, _ = exchange.finish(pending, n)
        if kind == "avg":
            total.mul_(1.0 / world)  # as the ZeroOptimizer averages its fp32 sums
        output_tensor.copy_(total)
        self.calls["quantized"] += 1
        self.bytes_sent += sent
        self.plain_bytes += plain
        return None  # nothing left in flight

    def use_two_level(self, groups) -> None:
        """Reduce in two stages from now on ([Note: FSDP2 on several nodes] in
        :mod:`qzero.fsdp.nodes`): ``groups`` is a :class:`qzero.wire.two_level.TwoLevelGroups`
        over the shard group FSDP2 calls this with."""
        self.two_level = groups

    def _reduce_two_level(self, input_tensor: torch.Tensor, n: int, world: int):
        """``(fp32 sum of this rank's part, bytes sent)``: the parts restaged rail-major (row
        ``j nodes + i`` is the part of rank ``i L + j``), reduce-scattered inside the node in the
        reduce dtype, then exchanged quantized over the rail."""
        groups = self.two_level
        t = groups.topology
        if world != t.world:
            raise RuntimeError(f"qzero.fsdp: FSDP module {self.name or '<root>'!r} reduce-scatters over {world} ranks, "
                               f"but its two-level groups are for {t.describe()}")
        key = (n, input_tensor.dtype, input_tensor.device)
        reduce = self._two_level_reduces.get(key)
        if reduce is None:
            from ..wire.quantized_reduce import GradientQuantization, QuantizedExchange
            from ..wire.two_level import TwoLevelReduce

            rail = QuantizedExchange.over(
                GradientQuantization(self.zero_quantized_gradients_group_size, self.zero_quantized_gradients_format,
                                     self.rotation_block), input_tensor.dtype, groups.rail_group, t.nodes, groups.node,
                input_tensor.device, gradient_kernels_for(input_tensor.device, self.quant_kernels),
                self.exact_ranges(n, world))  # every row's small shards sit where they sit in any other row
            reduce = self._two_level_reduces[key] = TwoLevelReduce(groups, n, rail)
        staged = input_tensor.view(t.nodes, t.ranks_per_node, n).transpose(0, 1).reshape(-1)
        with label(REDUCE_GRADIENTS):
            bucket = reduce.launch(staged, n, n, 0)
            total = reduce.finish(bucket)
        return total, reduce.node_bytes(bucket) + reduce.rail_bytes(bucket)

    @property
    def rotation_block(self) -> int:
        """The rotation's block, 0 for none (what the ranks agree on)."""
        return _rotation_block(self)

    def _quantizable(self, input_tensor: torch.Tensor, n: int, world: int) -> bool:
        if input_tensor.dtype not in GRADIENT_DTYPES or n == 0:
            return False
        # Parameters without a gradient in this backward are left out of the input.
        return sum(self._sizes()) == n

    def _sizes(self) -> list[int]:
        return [p.padded_sharded_param_size.numel() for p in self.fsdp_params]

    def exact_ranges(self, n: int, world: int) -> list[tuple[int, int]]:
        """The small parameters' shards in every rank's part, in input coordinates."""
        exact, offset = [], 0
        for p, size in zip(self.fsdp_params, self._sizes()):
            if size and is_small_param(p._orig_size.numel(), self.small_param_numel):
                exact.append((offset, offset + size))
            offset += size
        return merge_adjacent([(r * n + a, r * n + b) for r in range(world) for a, b in exact])

    def _exchange(self, n: int, world: int, rank: int, group, like: torch.Tensor):
        from ..wire.quantized_reduce import GradientQuantization, QuantizedExchange

        key = (n, world, rank, id(group), like.dtype, like.device)
        ex = self._exchanges.get(key)
        if ex is None:
            ex = QuantizedExchange.over(
                GradientQuantization(self.zero_quantized_gradients_group_size, self.zero_quantized_gradients_format,
                                     self.rotation_block), like.dtype, group, world, rank, like.device,
                gradient_kernels_for(like.device, self.quant_kernels), self.exact_ranges(n, world),
            )
            self._exchanges[key] = ex
        return ex


def _op_kind(op, name: str):
    """``("sum" | "avg" | "premul", factor)`` of a reduce op FSDP2 passes; ValueError for others."""
    from torch.distributed import ReduceOp

    kind = getattr(op, "op", op)  # a ReduceOp object (PREMUL_SUM) carries its type in .op
    if kind == ReduceOp.SUM:
        return "sum", None
    if kind == ReduceOp.AVG:
        return "avg", None
    if kind == ReduceOp.PREMUL_SUM:
        factor = op.factor
        if torch.is_tensor(factor) and factor.device.type == "cpu":
            factor = float(factor.reshape(-1)[0])
        return "premul", factor
    raise ValueError(f"the quantized reduce-scatter of FSDP module {name or '<root>'!r} was asked for "
                     f"reduce op {op!r}; it implements SUM, AVG and PREMUL_SUM only")


def _describe(name, pg, comm: GroupQuantizedReduceScatter, topology=None) -> GroupReduce:
    from ..wire.quantized_reduce import plan_pieces

    params = list(pg.fsdp_params)
    world = pg.mesh_info.shard_mesh_size if hasattr(pg.mesh_info, "shard_mesh_size") else 1
    policy = pg.mp_policy
    dtype = policy.reduce_dtype or policy.param_dtype or (params[0].sharded_param.dtype if params else torch.float32)
    elem = torch.empty(0, dtype=dtype).element_size()
    n = sum(comm._sizes())
    small = sum(1 for p in params if is_small_param(p._orig_size.numel(), comm.small_param_numel))
    plain = n * (world - 1) * elem
    if world <= 1 or not n:
        return GroupReduce(name, len(params), small, plain, plain)
    rank = pg.mesh_info.shard_mesh_rank if hasattr(pg.mesh_info, "shard_mesh_rank") else 0
    exact = comm.exact_ranges(n, world)
    q, fmt = comm.zero_quantized_gradients_group_size, comm.zero_quantized_gradients_format
    if topology is not None and topology.two_level:  # the node stage's share, then the rail's pieces
        nodes, L = topology.nodes, topology.ranks_per_node
        j, i = topology.local_of(rank), topology.node_of(rank)
        pieces = plan_pieces([(k, k * n, n, (j * nodes + k) * n) for k in range(nodes)], exact, q, fmt, elem)
        across = sum(p.layout.nbytes for p in pieces if p.dest != i)
        return GroupReduce(name, len(params), small, (L - 1) * nodes * n * elem + across, plain, across)
    pieces = plan_pieces([(r, r * n, n, r * n) for r in range(world)], exact, q, fmt, elem)
    sent = sum(p.layout.nbytes for p in pieces if p.dest != rank)
    node_of = topology.node_of if topology is not None and topology.world == world else (lambda r: 0)
    across = sum(p.layout.nbytes for p in pieces if node_of(p.dest) != node_of(rank))
    return GroupReduce(name, len(params), small, sent, plain, across)
