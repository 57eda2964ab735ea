"""qzero's quantized weight gather for PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``).

One call before ``fully_shard``::

    from qzero.fsdp import quantize_weight_gathers

    model = quantize_weight_gathers(model)          # fp32 model, before fully_shard
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)

Every parameter with more than ``small_param_numel`` elements is then all-gathered
INT8 (or ``zero_quantized_weights_format``) with one fp32 scale per
``zero_quantized_weights_group_size`` consecutive elements of the rank's flattened fp32 shard,
and dequantized to the policy's ``param_dtype`` for
compute (:class:`qzero.fsdp.tensor.QuantizedGatherTensor`). Small parameters and those
the quantized gather cannot carry keep FSDP2's own gather, exact;
:func:`gather_report` says which is which. The fp32 masters, the optimizer, gradients
and state dicts are untouched: ``state_dict()`` returns the plain fp32 tensors, so a
checkpoint saved with the quantized gather loads without it and the other way round.

The alternative with less host time per gather, one call after ``fully_shard``::

    report = quantize_group_gathers(model)          # after fully_shard, on the root

quantizes each ``fully_shard`` module's whole all-gather buffer (the ``param_dtype``
copies) through qzero's gather engine instead (:mod:`qzero.fsdp.group`), and::

    report = quantize_group_reduces(model)          # after fully_shard, on the root

reduce-scatters each module's gradients quantized, with the arithmetic of the
ZeroOptimizer's quantized gradient reduction (:mod:`qzero.fsdp.reduce`).

The installers' settings are :class:`qzero.ZeroConfig`'s fields, by name and default (its short
names ``fmt`` and ``group_size`` are taken for the weight format and group size).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from ..config import ZeroConfig
from ..wire.comm import local_outcome
from ..layout.flat_layout import is_small_param
from ._comms import (GATHER_REPORT_ATTR, DeferredAgreement, agree_install, distributed, installer_config, log_report,
                     mesh_group, settings_of, stored_report)
from .guards import StrippedCheck, rewrap_assigned, watch_optimizers
from .tensor import GatherFormat, GatherRecord, GatherState, QuantizedGatherTensor, carries

__all__ = [
    "GatherReport",
    "GroupGatherReport",
    "GroupReduceReport",
    "QuantizedGatherTensor",
    "gather_report",
    "group_gather_report",
    "group_reduce_report",
    "quantize_group_gathers",
    "quantize_group_reduces",
    "quantize_weight_gathers",
]

_STRIPPED = "stripped: replaced by a plain tensor after quantize_weight_gathers, so FSDP2 gathers it plainly"

from .group import GroupGatherReport, group_gather_report, quantize_group_gathers  # noqa: E402
from .reduce import GroupReduceReport, group_reduce_report, quantize_group_reduces  # noqa: E402


class GatherReport(NamedTuple):
    """Which parameters (by name) FSDP2 gathered quantized at their last all-gather, which
    plainly, and why ([Note: gather record] in :mod:`qzero.fsdp.tensor`). A parameter not
    gathered yet is counted as its current wrapper and shape will send it, and named in
    ``not_gathered``."""

    quantized: tuple[str, ...]
    plain: tuple[tuple[str, str], ...]  # (name, reason)
    world_size: int | None  # the shard group size the report assumed (None: not known yet)
    not_gathered: tuple[str, ...] = ()  # quantized ones whose first gather has not run yet

    def summary(self) -> str:
        q, p = len(self.quantized), len(self.plain)
        text = f"qzero.fsdp: {q} parameter(s) gathered quantized, {p} plainly"
        if self.not_gathered:
            pending = len(self.not_gathered)
            text += f" ({pending} of the quantized not gathered yet)" if pending < q else " (none gathered yet)"
        else:
            text += " at their last gather"
        uneven = [name for name, why in self.plain if why.startswith("uneven")]
        if uneven:
            text += f"; not evenly sharded over {self.world_size} rank(s), hence plain: {', '.join(uneven)}"
        stripped = [name for name, why in self.plain if why.startswith("stripped")]
        if stripped:
            text += f"; stripped of the quantized gather: {', '.join(stripped)}"
        return text


class _Conversion(NamedTuple):
    """What :func:`quantize_weight_gathers` did to a model: one record per wrapped
    parameter, the parameters it left plain and why, and the forward's check."""

    records: tuple[GatherRecord, ...]
    plain: tuple[tuple[str, str], ...]
    world_size: int | None
    check: StrippedCheck


def quantize_weight_gathers(
    model: nn.Module,
    *,
    zero_quantized_weights_format: str | None = ZeroConfig.zero_quantized_weights_format,
    zero_quantized_weights_group_size: int | None = ZeroConfig.zero_quantized_weights_group_size,
    small_param_numel: int = ZeroConfig.small_param_numel,
    mesh=None,
    **short,
) -> nn.Module:
    """Make FSDP2 all-gather ``model``'s large parameters quantized; return ``model``.

    The settings are :class:`qzero.ZeroConfig`'s, with its defaults and checks:
    ``zero_quantized_weights_format`` (``int8``; ``fp8``, ``int4``),
    ``zero_quantized_weights_group_size`` (64) and ``small_param_numel`` (parameters with at
    most that many elements travel exactly); ZeroConfig's short names ``fmt`` and
    ``group_size`` are taken too. Another keyword raises ``TypeError`` naming the one to use.

    Call on the fp32 (master) model before ``fully_shard``. ``mesh`` is the device mesh
    that ``fully_shard`` will be given (default: all ranks of the default process group,
    as ``fully_shard`` itself defaults); it is used only to predict which parameters
    shard evenly (see :func:`gather_report`). Raises ``ValueError``/``TypeError`` naming
    the problem, with the model unchanged, when the model is already sharded or already
    converted, a parameter is not fp32, or an argument is bad.

    Collective when a process group exists: the ranks agree on the three settings and which
    parameters are quantized (over the default group, or
    ``mesh``'s shard dimension when the mesh does not span every rank), and every rank
    raises, naming the differing setting or the rank that failed, with the model
    unchanged. Called before ``init_process_group``, the same agreement runs over the
    default group at the model's first forward (or first quantized gather).
    """
    def plan():
        config = installer_config(quantize_weight_gathers, model, short, dict(
            zero_quantized_weights_format=zero_quantized_weights_format,
            zero_quantized_weights_group_size=zero_quantized_weights_group_size,
            small_param_numel=small_param_numel), switch="zero_quantized_weights")
        _check_model(model)
        world = _shard_world(mesh)
        return config, world, {name: (tuple(param.shape), _plain_reason(param, config.small_param_numel, world))
                               for name, param in model.named_parameters()}

    planned, error = local_outcome(plan)
    config = planned[0] if planned else None
    settings = dict(settings=config and settings_of(config, "zero_quantized_weights_format",
                                                    "zero_quantized_weights_group_size", "small_param_numel"),
                    layout_name="which parameters are quantized",
                    layout={name: f"{shape}: {why or 'quantized'}" for name, (shape, why) in planned[2].items()}
                    if planned else None)
    deferred = None
    if distributed():  # [Note: agreement]: every rank raises, naming the setting, before anything changes
        group, _ = local_outcome(lambda: mesh_group(mesh))
        agree_install("quantize_weight_gathers", group, error, **settings)
    elif error is not None:
        raise error
    else:  # agreed when there are ranks to agree with: at the first forward or gather
        deferred = DeferredAgreement(model, "quantize_weight_gathers", **settings)
    _, world, reasons = planned

    spec = GatherFormat(config.zero_quantized_weights_group_size, config.zero_quantized_weights_format, deferred)
    records, plain, wrapped = [], [], {}
    for name, param in model.named_parameters():
        _, why = reasons[name]
        if why:
            plain.append((name, why))
            continue
        records.append(GatherRecord(name))
        wrapped[id(param)] = nn.Parameter(QuantizedGatherTensor(param.data, spec, records[-1]),
                                          requires_grad=param.requires_grad)
    hooked, slots = set(), []
    for module in model.modules():  # every module holding a parameter, shared ones included
        for pname, param in list(module._parameters.items()):
            if param is not None and id(param) in wrapped:
                module._parameters[pname] = new = wrapped[id(param)]
                slots.append((module, pname, new.record))
                if id(module) not in hooked:
                    module._register_state_dict_hook(_unwrap_state_dict)
                    module._register_load_state_dict_pre_hook(rewrap_assigned, with_module=True)
                    hooked.add(id(module))
    check = StrippedCheck(model, slots)
    model.register_forward_pre_hook(check)
    watch_optimizers()
    setattr(model, GATHER_REPORT_ATTR, _Conversion(tuple(records), tuple(plain), world, check))
    log_report(gather_report(model))
    return model


def gather_report(model: nn.Module) -> GatherReport:
    """What FSDP2 gathers quantized in ``model`` (converted by :func:`quantize_weight_gathers`):
    read from the parameters as they are now and from their last all-gather, so a parameter
    a framework replaced by a plain tensor counts as plain ("stripped")."""
    conversion: _Conversion = stored_report(model, GATHER_REPORT_ATTR, "quantize_weight_gathers")
    stripped = set(conversion.check.stripped())
    quantized, plain, pending = [], list(conversion.plain), []
    for record in conversion.records:
        if record.name in stripped:
            plain.append((record.name, _STRIPPED))
        elif record.state is GatherState.PLAIN:
            plain.append((record.name, _uneven_now(conversion.check.current(record), conversion.world_size)))
        else:
            quantized.append(record.name)
            if record.state is GatherState.NOT_GATHERED:
                pending.append(record.name)
    return GatherReport(tuple(quantized), tuple(plain), conversion.world_size, tuple(pending))


def _uneven_now(param, world: int | None) -> str:
    """Why a wrapped parameter's last gather was plain: its shard was not an even one."""
    rows = param.shape[0] if param.dim() else 0
    mesh = getattr(param, "device_mesh", None)
    world = mesh.size(-1) if mesh is not None else world
    return f"uneven: {rows} rows do not shard evenly over {world} ranks"


# ---------------------------------------------------------------------- checks


def _check_model(model: nn.Module) -> None:
    from torch.distributed.tensor import DTensor

    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch < 2.6
        FSDPModule = ()
    for name, module in model.named_modules():
        if FSDPModule and isinstance(module, FSDPModule):
            where = f"submodule {name!r}" if name else "the model"
            raise ValueError(
                f"quantize_weight_gathers must be called before fully_shard, but {where} is already sharded; "
                "nothing was changed"
            )
    for name, param in model.named_parameters():
        if isinstance(param, QuantizedGatherTensor):
            raise ValueError(
                f"quantize_weight_gathers was already applied to this model (parameter {name!r}); nothing was changed"
            )
        if isinstance(param, DTensor):
            continue  # tensor-parallel parameters keep FSDP2's gather (see _plain_reason)
        if param.dtype != torch.float32:
            raise TypeError(
                f"quantize_weight_gathers needs an fp32 (master) model, but parameter {name!r} is {param.dtype}; "
                "build the model in fp32 and give FSDP2 a MixedPrecisionPolicy(param_dtype=...) for compute; "
                "nothing was changed"
            )


def _shard_world(mesh) -> int | None:
    if mesh is not None:
        return mesh.size(-1) if mesh.ndim > 1 else mesh.size()
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return None


def _plain_reason(param: nn.Parameter, small_param_numel: int, world: int | None) -> str | None:
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        return "a DTensor (tensor parallel): FSDP2 gathers it"
    if is_small_param(param.numel(), small_param_numel):
        return f"small ({param.numel()} <= {small_param_numel} elements): exact"
    if param.dim() == 0:
        return "a scalar"
    if world is not None and not carries(tuple(param.shape), world):
        return f"uneven: {param.shape[0]} rows do not shard evenly over {world} ranks"
    return None


# ---------------------------------------------------------------------- state dicts


def _unwrap_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """Put the plain fp32 tensors (same storage) where ``module``'s wrapped parameters are."""
    from torch.distributed.tensor import DTensor

    for pname, param in module._parameters.items():
        key = prefix + pname
        value = state_dict.get(key)
        if value is None or isinstance(value, nn.Parameter):  # keep_vars=True: the caller wants the parameter
            continue
        if isinstance(value, DTensor) and isinstance(value._local_tensor, QuantizedGatherTensor):
            state_dict[key] = DTensor.from_local(
                value._local_tensor.unwrapped,
                value.device_mesh,
                value.placements,
                shape=value.shape,
                stride=value.stride(),
                run_check=False,
            )
        elif isinstance(value, QuantizedGatherTensor):
            state_dict[key] = value.unwrapped
