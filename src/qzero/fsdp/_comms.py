"""What qzero.fsdp's installers share (:func:`~qzero.fsdp.quantize_weight_gathers`,
:func:`~qzero.fsdp.quantize_group_gathers`, :func:`~qzero.fsdp.quantize_group_reduces`): the
argument checks, the report each leaves on the model, and (for the two group installers)
finding every FSDP2 parameter group whose all-gather (or reduce-scatter) communication
object is still FSDP2's own.

Both install a communication object per parameter group through FSDP2's
``set_custom_all_gather`` / ``set_custom_reduce_scatter``; which group a module belongs to,
and which object it has now, are read from FSDP2's parameter groups (checked attribute by
attribute, so a torch that lays them out differently is refused with a clear error, never
half-converted).

Every installer agrees with its peers before it changes anything ([Note: agreement] in
qzero/wire/agreement.py): its local work (checks, the report) runs first, any failure is kept as
this rank's error, then :func:`agree_install` exchanges the settings (by their
:class:`qzero.ZeroConfig` names: the format, the group size, ``small_param_numel``, the
rotation) and a digest of what the report says travels how, over the process group of
:func:`install_group`, so a mismatch or a failure on one rank raises on every rank, naming
the setting, before any gather. (The kernels are not agreed: every kernel set writes the
reference quantizer's bytes.)

The installers' keyword arguments are :class:`qzero.ZeroConfig`'s fields, with its defaults,
and are validated by it (:func:`installer_config`).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from ..config import ZeroConfig, keyword_settings
from ..wire.agreement import canonical, digest
from ..wire.comm import agree_or_raise


_log = logging.getLogger("qzero.fsdp")


#: Keywords the installers took before they were named as ZeroConfig's fields, and those fields
#: (``fmt`` and ``group_size`` are ZeroConfig's short names of the weight settings: the weight
#: installers still take them; the gradient installer refuses them, naming its own).
RENAMED = {"kernels": "quant_kernels", "rotation": "zero_quantized_gradients_rotation",
           "rotation_block": "zero_quantized_gradients_rotation_block"}
GRADIENT_RENAMED = {**RENAMED, "fmt": "zero_quantized_gradients_format",
                    "group_size": "zero_quantized_gradients_group_size"}
#: The keywords of earlier releases of the weight gather's communication object
#: (:class:`qzero.fsdp.group.GroupQuantizedAllGather`), whose keywords are ZeroConfig's full
#: names only, and those names.
WEIGHT_RENAMED = {"kernels": "quant_kernels", "fmt": "zero_quantized_weights_format",
                  "group_size": "zero_quantized_weights_group_size"}
#: Where :func:`qzero.fsdp.quantize_weight_gathers` leaves its record on the model (the group
#: gather refuses a model that carries it).
GATHER_REPORT_ATTR = "_qzero_gather_report"


def installer_config(function, model, extra: dict, given: dict, *, switch: str,
                     renamed: dict = RENAMED) -> ZeroConfig:
    """The checks every installer makes before it looks at the model: its keyword arguments
    (``given``, named as ZeroConfig's fields, and ``extra``, its other keywords: see
    :func:`qzero.config.keyword_settings`) validated by :class:`qzero.ZeroConfig` with ``switch``
    on, and ``model`` a module. Returns that ZeroConfig (its ``None`` defaults resolved)."""
    settings = keyword_settings(function, given, extra, renamed)
    group = settings.get("zero_quantized_weights_group_size")
    # no bucket here (FSDP2 gathers whole parameters or groups): ZeroConfig's bucket >= group check cannot fail
    bucket = max(ZeroConfig.allgather_bucket_size, group if isinstance(group, int) else 0)
    config = ZeroConfig(**{switch: True}, allgather_bucket_size=bucket, **settings)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return config


def keep_report(model: nn.Module, attr: str, report):
    """Leave ``report`` on ``model`` (under ``attr``) and log its summary; return it."""
    setattr(model, attr, report)
    return log_report(report)


def log_report(report):
    """Log ``report``'s summary; return it."""
    _log.info(report.summary())
    return report


def stored_report(model: nn.Module, attr: str, function: str):
    """The report ``function`` left on ``model``; a clear error if it never ran on it."""
    report = getattr(model, attr, None)
    if report is None:
        raise ValueError(f"this model was not passed to qzero.fsdp.{function}")
    return report


def parameter_groups(module, name: str) -> list:
    """The FSDP parameter groups of one ``fully_shard`` module, their attributes checked."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch releases with one group per state
        if not hasattr(state, "_fsdp_param_group"):
            raise ValueError(f"this torch's FSDP2 state of module {name or '<root>'!r} has no parameter group "
                             "attribute qzero knows; use qzero.fsdp.quantize_weight_gathers instead")
        groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
    for pg in groups:
        for attr in ("fsdp_params", "_all_gather_comm", "mesh_info", "mp_policy"):
            if not hasattr(pg, attr):
                raise ValueError(f"this torch's FSDP2 parameter group has no {attr!r}; use "
                                 "qzero.fsdp.quantize_weight_gathers instead")
        for p in pg.fsdp_params:
            for attr in ("padded_sharded_param_size", "_orig_size", "sharded_state", "sharded_param"):
                if not hasattr(p, attr):
                    raise ValueError(f"this torch's FSDP2 parameter has no {attr!r}; use "
                                     "qzero.fsdp.quantize_weight_gathers instead")
    return list(groups)


def groups_to_convert(model: nn.Module, *, function: str, setter: str, attr: str, what: str, ours: type,
                      own_names: tuple[str, ...], kernels: str, kernels_for,
                      instead: str = "") -> list[tuple[str, nn.Module, object]]:
    """``(name, module, parameter group)`` of every FSDP2 parameter group of ``model``, each
    once, after checking that none can stop the conversion: FSDP2 has ``setter``, each
    group's ``attr`` object is one of FSDP2's own ``own_names`` (not ``ours``: the function
    ran already; not another custom object), each module has one group, ``kernels`` can run
    where the group lives, and the model is sharded at all. Raises with nothing changed
    (``instead``: what to use on a torch without ``setter``)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    if not hasattr(FSDPModule, setter):  # added in torch 2.9
        raise ValueError(f"torch {torch.__version__}'s FSDP2 has no {setter} (torch >= 2.9 has); {function} needs it"
                         + (f"; use {instead} instead" if instead else ""))
    own = tuple(getattr(_fsdp_collectives, n) for n in own_names if hasattr(_fsdp_collectives, n))
    out, seen, found = [], set(), False  # fully_shard([a, b]) gives several modules one group
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        found = True
        groups = parameter_groups(module, name)
        if len(groups) > 1:
            raise ValueError(f"FSDP module {name or '<root>'!r} has {len(groups)} parameter groups (a per-parameter "
                             f"mesh); {setter} supports one; nothing was changed")
        for pg in groups:
            if id(pg) in seen:
                continue
            seen.add(id(pg))
            if not hasattr(pg, attr):
                raise ValueError(f"this torch's FSDP2 parameter group has no {attr!r}; nothing was changed")
            if kernels != "auto":
                kernels_for(torch.device(getattr(pg, "device", "cpu")), kernels)  # 'triton' where it cannot run
            comm = getattr(pg, attr)
            if isinstance(comm, ours):
                raise ValueError(f"{function} was already applied to this model (module {name or '<root>'!r}); "
                                 "nothing was changed")
            if type(comm) not in own:
                raise ValueError(f"FSDP module {name or '<root>'!r} already has a custom {what} "
                                 f"({type(comm).__name__}); nothing was changed")
            out.append((name, module, pg))
    if not found:
        raise ValueError(f"{function} must be called after fully_shard, but no module of the model is sharded "
                         "(no FSDPModule found); nothing was changed")
    return out


# ---------------------------------------------------------------------- agreement


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def mesh_group(mesh):
    """The group to agree over for ``mesh``: the default group (None) when the mesh spans every
    rank, else its shard (last) dimension's group."""
    if mesh is None or mesh.size() == dist.get_world_size():
        return None
    return mesh.get_group(mesh.ndim - 1)


def install_group(model: nn.Module):
    """The group the group installers agree over: that of the first ``fully_shard`` module's
    parameter group, or the default group where there is none to be found."""
    try:
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():  # the root often holds no parameters of its own
            if isinstance(module, FSDPModule):
                for pg in parameter_groups(module, ""):
                    return mesh_group(pg.mesh_info.mesh)
    except Exception:  # noqa: BLE001 - an FSDP2 laid out otherwise: the installer's own error is agreed on
        pass
    return None


def settings_of(config: ZeroConfig, *names: str) -> dict:
    """``{name: value}`` of ``config``'s fields ``names``: what an installer's ranks agree on."""
    return {name: getattr(config, name) for name in names}


def agree_install(function: str, group, error: Exception | None, *, settings: dict | None,
                  layout_name: str = "", layout: dict[str, str] | None = None) -> None:
    """Raise on every rank of ``group`` unless every rank's installer succeeded locally with the
    same ``settings`` (``{ZeroConfig field: value}``, integers and strings) and the same
    ``layout`` (``{name: how it travels}``). A no-op without a process group (then ``error`` is
    raised here, as it is anyway)."""
    world = dist.get_world_size(group) if distributed() else 1
    fields = details = None
    if error is None:
        fields, details = {}, {}
        for key, value in settings.items():
            if isinstance(value, str):  # agreed as a digest, named by its text
                fields[key], details[key] = digest(canonical(value)), {"": canonical(value)}
            else:
                fields[key] = value
        if layout is not None:
            fields[layout_name] = digest(repr(sorted(layout.items())))
            details[layout_name] = layout
    agree_or_raise(group, world, None, error, fields, f"qzero.fsdp.{function}", details)


class DeferredAgreement:
    """An installer's agreement for when it ran before a process group existed: run once, over
    the default process group, at the first forward of a module of ``model`` or the first call
    of :meth:`ensure` (the first quantized gather), whichever comes first once a process group
    exists (before that, there is no one to disagree with). A forward pre-hook
    registered for every module runs before FSDP2's own (which FSDP2 puts first on the module),
    so the exchange precedes FSDP2's first all-gather on every rank. A failed agreement raises
    again on every later forward or gather, without communicating."""

    def __init__(self, model: nn.Module, function: str, **settings):
        import weakref

        self.function, self.settings = function, settings
        self.error: Exception | None = None
        self.done = False
        self._modules = weakref.WeakSet(model.modules())
        self._hook = torch.nn.modules.module.register_module_forward_pre_hook(self._before_forward)

    def _before_forward(self, module, args):
        if module in self._modules:
            self.ensure()
        elif not self._modules:  # the model is gone
            self._hook.remove()

    def ensure(self) -> None:
        if not self.done and distributed():
            self.done = True
            try:
                agree_install(self.function, None, None, **self.settings)
            except Exception as e:  # noqa: BLE001 - kept, to be raised again on every later use
                self.error = e
            if self.error is None:
                self._hook.remove()
        if self.error is not None:
            raise self.error
