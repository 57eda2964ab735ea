"""FSDP2's weight all-gather, quantized one parameter group at a time.

FSDP2 gathers the parameters of one ``fully_shard`` module (one FSDP parameter group)
with a single collective: every rank copies its padded shard of each parameter, cast to
the policy's ``param_dtype``, back to back into its slot of one output buffer (this
rank's *all-gather input*, ``output[rank * n : (rank + 1) * n]``), then calls the
group's all-gather communication object as ``comm(output_tensor=..., input_tensor=...,
group=..., async_op=...)`` on its all-gather stream and records an event there that
the compute stream waits for before it copies the parameters out.
``FSDPModule.set_custom_all_gather`` replaces that object.

:class:`GroupQuantizedAllGather` is such an object. Instead of gathering the buffer as
it is, it runs qzero's gather engine over it (:func:`qzero.wire.engine.start_gather`, the
``inline`` schedule, on the stream FSDP2 called it on, so the quantizing and
dequantizing kernels run off the compute stream): each rank's input is quantized in
groups of ``zero_quantized_weights_group_size`` consecutive elements (counted from the start of the rank's
input, so a group may straddle two parameters' shards), the parameters with at most
``small_param_numel`` elements travel exactly in the payload's side channel, and
every rank dequantizes every payload, its own included, into ``output_tensor``. Every
rank then holds the same bits, and FSDP2 copies the parameters out as usual.

Compared with the per-parameter extension (:func:`qzero.fsdp.quantize_weight_gathers`),
which quantizes each fp32 master shard on its own: here the host pays one engine call
per group instead of two hooks per parameter, and what is quantized is the
``param_dtype`` copy FSDP2 made of the master (bf16, say), as qzero's own
ZeroOptimizer does; the per-parameter path quantizes the fp32 master itself. The
padding FSDP2 adds to unevenly sharded parameters is zeros and quantizes to zeros.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from ..wire.agreement import canonical
from ..wire.comm import local_outcome
from ..wire.engine import CommContext, finish_gather, start_gather
from ..layout.flat_layout import is_small_param
from ..layout.gather_plan import merge_adjacent
from ..layout.gather_planner import plan_gather
from ..config import ZeroConfig
from ..quant import kernels_for
from ..vocabulary import refuse_renamed
from .nodes import exchange_group_hosts, shard_topology, warn_once
from ._comms import (GATHER_REPORT_ATTR, WEIGHT_RENAMED, agree_install, groups_to_convert, install_group,
                     installer_config, keep_report, settings_of, stored_report)

__all__ = ["GroupGather", "GroupGatherReport", "GroupQuantizedAllGather", "quantize_group_gathers"]

GROUP_REPORT_ATTR = "_qzero_group_gather_report"
#: Compute dtypes the Triton kernels read and write; others take the torch reference kernels.
_KERNEL_DTYPES = (torch.bfloat16, torch.float16)


class GroupGather(NamedTuple):
    """One FSDP parameter group: its module, what travels how, and the bytes one rank sends
    in one all-gather of it (``plain_bytes``: what FSDP2's own all-gather sends)."""

    module: str  # the module's name in the model ("" for the root)
    params: int
    exact_params: int  # parameters carried exactly (small ones) inside the quantized gather
    bytes_sent: int
    plain_bytes: int
    plain_reason: str | None  # why the group keeps FSDP2's own all-gather; None: quantized


class GroupGatherReport(NamedTuple):
    """What :func:`quantize_group_gathers` installed, one entry per FSDP parameter group."""

    groups: tuple[GroupGather, ...]

    @property
    def quantized(self) -> tuple[str, ...]:
        return tuple(g.module for g in self.groups if g.plain_reason is None)

    @property
    def plain(self) -> tuple[tuple[str, str], ...]:
        return tuple((g.module, g.plain_reason) for g in self.groups if g.plain_reason is not None)

    @property
    def exact_params(self) -> int:
        return sum(g.exact_params for g in self.groups if g.plain_reason is None)

    @property
    def bytes_sent(self) -> int:
        """Bytes one rank sends when every group is gathered once."""
        return sum(g.bytes_sent for g in self.groups)

    @property
    def plain_bytes(self) -> int:
        return sum(g.plain_bytes for g in self.groups)

    def summary(self) -> str:
        q = self.quantized
        text = (f"qzero.fsdp: {len(q)} parameter group(s) gathered quantized ({self.exact_params} small parameter(s) "
                f"exact inside them), {len(self.plain)} plainly; {self.bytes_sent} bytes a rank per gather of every "
                f"group, plain {self.plain_bytes}")
        if self.plain:
            text += "; plain: " + ", ".join(f"{m or '<root>'} ({why})" for m, why in self.plain)
        return text


def quantize_group_gathers(
    model: nn.Module,
    *,
    zero_quantized_weights_format: str | None = ZeroConfig.zero_quantized_weights_format,
    zero_quantized_weights_group_size: int | None = ZeroConfig.zero_quantized_weights_group_size,
    small_param_numel: int = ZeroConfig.small_param_numel,
    quant_kernels: str = ZeroConfig.quant_kernels,
    ranks_per_node: int = ZeroConfig.ranks_per_node,
    hierarchical_collectives: bool | str = ZeroConfig.hierarchical_collectives,
    **short,
) -> GroupGatherReport:
    """Make every FSDP2 parameter group of ``model`` all-gather quantized; return a report.

    The settings are :class:`qzero.ZeroConfig`'s, with its defaults and checks (its short
    names ``fmt`` and ``group_size`` are taken too; another keyword raises ``TypeError``
    naming the one to use).

    Call after ``fully_shard`` (on the root, once). Each ``fully_shard`` module in
    ``model`` gets a :class:`GroupQuantizedAllGather` through ``set_custom_all_gather``,
    except a group whose parameters would be gathered in mixed dtypes or a non-floating
    dtype, which keeps FSDP2's own all-gather (the report says which and why). The fp32
    masters, the optimizer, gradients and state dicts are untouched. ``quant_kernels``: as
    :class:`qzero.wire.engine.CommContext` takes them (``auto``, ``triton``, ``reference``);
    compute dtypes other than bf16/fp16 always use the reference kernels.

    Several nodes: ``ranks_per_node`` and ``hierarchical_collectives`` are ZeroConfig's, checked
    against each module's shard group as :func:`qzero.fsdp.quantize_group_reduces` checks them
    (a declaration the hosts contradict is refused on every rank). The gather itself is one
    all-gather of the payloads over the shard group, which crosses each node boundary once
    per payload in NCCL whatever the settings ([Note: FSDP2 on several nodes] in
    :mod:`qzero.fsdp.nodes`).

    Raises ``ValueError``/``TypeError`` naming the problem, with nothing installed, for a
    bad argument, a model with no ``fully_shard`` module, a model already converted by
    this function or by :func:`qzero.fsdp.quantize_weight_gathers`, a group that already
    has a custom all-gather, or a torch whose FSDP2 has no ``set_custom_all_gather``.
    """
    group = install_group(model)
    hosts = exchange_group_hosts(group)  # first, on every rank: nothing local can fail before it

    def plan():
        config = installer_config(quantize_group_gathers, model, short, dict(
            zero_quantized_weights_format=zero_quantized_weights_format,
            zero_quantized_weights_group_size=zero_quantized_weights_group_size,
            small_param_numel=small_param_numel, quant_kernels=quant_kernels, ranks_per_node=ranks_per_node,
            hierarchical_collectives=hierarchical_collectives), switch="zero_quantized_weights")
        fmt, group_size = config.zero_quantized_weights_format, config.zero_quantized_weights_group_size
        _check_not_per_parameter(model)
        warned = set()

        def checked(pg):  # the declared topology must fit the hosts; the gather is the same either way
            warn_once(warned, shard_topology(pg, hosts, config)[1])
            return pg
        return config, [  # (name, module, param group, GroupGather) for every FSDP parameter group
            (name, module, pg, _describe(name, checked(pg), group_size, fmt, config.small_param_numel))
            for name, module, pg in groups_to_convert(
                model, function="quantize_group_gathers", setter="set_custom_all_gather", attr="_all_gather_comm",
                what="all-gather", ours=GroupQuantizedAllGather,
                # FSDP2's own all-gathers, which only differ in where the buffer is allocated
                own_names=("DefaultAllGather", "ProcessGroupAllocAllGather"), kernels=config.quant_kernels,
                kernels_for=kernels_for, instead="qzero.fsdp.quantize_weight_gathers (before fully_shard)")
        ]

    planned, error = local_outcome(plan)
    config, plans = planned if planned else (None, None)
    agree_install("quantize_group_gathers", group, error, settings=config and dict(settings_of(
                      config, "zero_quantized_weights_format", "zero_quantized_weights_group_size", "small_param_numel",
                      "ranks_per_node"), hierarchical_collectives=str(config.hierarchical_collectives).lower()),
                  layout_name="parameter groups",
                  layout={info.module or "<root>": canonical(tuple(info)) for *_, info in plans} if plans else None)
    for name, module, pg, info in plans:
        if info.plain_reason is None:
            module.set_custom_all_gather(GroupQuantizedAllGather(
                pg.fsdp_params, **settings_of(config, "zero_quantized_weights_group_size",
                                              "zero_quantized_weights_format", "small_param_numel", "quant_kernels"),
                name=name))
    return keep_report(model, GROUP_REPORT_ATTR, GroupGatherReport(tuple(info for *_, info in plans)))


try:  # torch releases with set_custom_all_gather define the interface it takes
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as _AllGather
except ImportError:  # pragma: no cover - older torch: quantize_group_gathers refuses to run
    _AllGather = object


@refuse_renamed(**WEIGHT_RENAMED)
class GroupQuantizedAllGather(_AllGather):
    """FSDP2's all-gather of one parameter group, through qzero's gather engine (see the
    module's docstring). Installed by :func:`quantize_group_gathers`. Its settings are named
    as :class:`qzero.ZeroConfig`'s fields (the keywords of earlier releases, ``group_size``,
    ``fmt`` and ``kernels``, are refused, naming the new ones)."""

    def __init__(self, fsdp_params, *, zero_quantized_weights_group_size: int, zero_quantized_weights_format: str,
                 small_param_numel: int, quant_kernels: str, name: str):
        from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

        self._sharded = ShardedState.SHARDED
        self.fsdp_params = list(fsdp_params)
        self.zero_quantized_weights_group_size = zero_quantized_weights_group_size
        self.zero_quantized_weights_format = zero_quantized_weights_format
        self.small_param_numel, self.quant_kernels, self.name = small_param_numel, quant_kernels, name
        self._plans: dict = {}
        self._contexts: dict = {}
        #: How many calls ran the quantized gather, and how many FSDP2's plain one (the
        #: gather of a post-forward reshard, or inputs FSDP2 sent as raw bytes).
        self.calls = {"quantized": 0, "plain": 0}

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        world, rank = group.size(), group.rank()
        n = input_tensor.numel()
        if not self._quantizable(output_tensor, n, world):
            self.calls["plain"] += 1
            from ..wire.chunks import all_gather_into

            return all_gather_into(output_tensor, input_tensor, group=group, async_op=async_op)
        mine = output_tensor.narrow(0, rank * n, n)
        if input_tensor.data_ptr() != mine.data_ptr():  # FSDP2 gathers in place; copy if a version does not
            mine.copy_(input_tensor)
        plan = self._plan(n, world, output_tensor.element_size())
        # On the stream FSDP2 called us on (its all-gather stream in forward and backward):
        # FSDP2 records its event there after we return, and the compute stream waits for it.
        finish_gather(start_gather(output_tensor, plan, group, self._context(output_tensor)))
        self.calls["quantized"] += 1
        return None  # nothing left in flight: FSDP2 then relies on its event alone

    def _quantizable(self, output: torch.Tensor, n: int, world: int) -> bool:
        if not output.is_floating_point() or n == 0:
            return False  # mixed dtypes: FSDP2 sends the inputs as raw bytes
        # After a reshard to a smaller post-forward mesh the inputs are other slices.
        return all(p.sharded_state == self._sharded for p in self.fsdp_params)

    def _plan(self, n: int, world: int, elem_size: int):
        key = (n, world, elem_size)
        plan = self._plans.get(key)
        if plan is None:
            sizes = [p.padded_sharded_param_size.numel() for p in self.fsdp_params]
            if sum(sizes) != n:
                raise RuntimeError(
                    f"qzero.fsdp: FSDP module {self.name or '<root>'!r} all-gathers {n} elements a rank, but its "
                    f"parameters' padded shards add up to {sum(sizes)}: this torch's FSDP2 lays the all-gather "
                    "input out differently; use qzero.fsdp.quantize_weight_gathers instead"
                )
            small = [is_small_param(p._orig_size.numel(), self.small_param_numel) for p in self.fsdp_params]
            plan = group_plan(sizes, small, world, elem_size, self.zero_quantized_weights_group_size,
                              self.zero_quantized_weights_format)
            self._plans[key] = plan
        return plan

    def _context(self, output: torch.Tensor) -> CommContext:
        key = (output.device, output.dtype)
        ctx = self._contexts.get(key)
        if ctx is None:
            kernels = self.quant_kernels
            if output.dtype not in _KERNEL_DTYPES:
                if kernels == "triton":
                    raise ValueError(f"quant_kernels='triton' take bf16/fp16 weights; FSDP module "
                                     f"{self.name or '<root>'!r} gathers {output.dtype}")
                kernels = "reference"
            ctx = self._contexts[key] = CommContext(output.device, schedule="inline", kernels=kernels)
        return ctx


def group_plan(sizes, small, world: int, elem_size: int, group_size: int, fmt: str):
    """The :class:`~qzero.layout.GatherPlan` of one FSDP parameter group's all-gather buffer:
    ``world`` partitions (one rank's all-gather input each) of the parameters' padded shards
    (``sizes`` elements, in order) back to back; the shards of ``small`` parameters are exact
    ranges; one chunk (one collective) over the whole buffer."""
    n = sum(sizes)
    exact, offset = [], 0
    for size, is_small in zip(sizes, small):
        if is_small and size:
            exact.append((offset, offset + size))
        offset += size
    ranges = merge_adjacent([(r * n + a, r * n + b) for r in range(world) for a, b in exact])
    return plan_gather(world * n, world, elem_size=elem_size, allgather_bucket_size=max(world * n, world * group_size),
                       zero_quantized_weights_format=fmt, zero_quantized_weights_group_size=group_size,
                       exact_ranges=ranges)


# ---------------------------------------------------------------------- checks and the report


def _check_not_per_parameter(model: nn.Module) -> None:
    from torch.distributed.tensor import DTensor

    from .tensor import QuantizedGatherTensor

    if getattr(model, GATHER_REPORT_ATTR, None) is not None:
        raise ValueError("this model already gathers per parameter (qzero.fsdp.quantize_weight_gathers); the two "
                         "cannot be combined; nothing was changed")
    for name, p in model.named_parameters():
        local = p._local_tensor if isinstance(p, DTensor) else p
        if isinstance(local, QuantizedGatherTensor):
            raise ValueError(f"parameter {name!r} is gathered per parameter (qzero.fsdp.quantize_weight_gathers); "
                             "the two cannot be combined; nothing was changed")


def _describe(name, pg, group_size, fmt, small_param_numel) -> GroupGather:
    params = list(pg.fsdp_params)
    world = pg.mesh_info.shard_mesh_size if hasattr(pg.mesh_info, "shard_mesh_size") else 1
    dtypes = {pg.mp_policy.param_dtype or p.sharded_param.dtype for p in params}
    sizes = [p.padded_sharded_param_size.numel() for p in params]
    elem = max(torch.empty(0, dtype=d).element_size() for d in dtypes) if dtypes else 2
    plain = sum(sizes) * elem
    reason = None
    if world <= 1:
        reason = "one rank: FSDP2 gathers nothing"
    elif len(dtypes) > 1:
        kinds = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        reason = f"mixed dtypes ({kinds}): FSDP2 gathers them as raw bytes"
    elif not next(iter(dtypes)).is_floating_point:
        reason = f"not floating point ({next(iter(dtypes))})"
    elif not sum(sizes):
        reason = "empty"
    small = [is_small_param(p._orig_size.numel(), small_param_numel) for p in params]
    if reason is not None:
        return GroupGather(name, len(params), 0, plain, plain, reason)
    plan = group_plan(sizes, small, world, elem, group_size, fmt)
    return GroupGather(name, len(params), sum(small), plan.bytes_per_rank, plain, None)


def group_gather_report(model: nn.Module) -> GroupGatherReport:
    """The :class:`GroupGatherReport` that :func:`quantize_group_gathers` made for ``model``."""
    return stored_report(model, GROUP_REPORT_ATTR, "quantize_group_gathers")
