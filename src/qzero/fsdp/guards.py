"""What keeps :func:`qzero.fsdp.quantize_weight_gathers` honest inside training frameworks.

The quantized gather lives in the parameters themselves (each is a
:class:`~qzero.fsdp.tensor.QuantizedGatherTensor`, or a DTensor whose local shard is one).
A framework that replaces a parameter with a plain tensor, or loses track of which
parameter is which, would otherwise change what trains without a word:

* ``load_state_dict(assign=True)`` puts the loaded tensors in place of the parameters
  (Accelerate's FSDP2 ``cpu_ram_efficient_loading`` does this with plain DTensors). A
  load pre-hook on every module holding a wrapped parameter wraps each loaded tensor in
  the parameter's own format and record first, so the quantized gather survives it.
* Anything else that replaces a wrapped parameter with a plain one ([Note: stripped]) is
  refused at the next forward, on every rank that sees it: :class:`StrippedCheck`.
* Code that tells parameters apart by address (Accelerate's FSDP2 ``prepare`` re-points
  the optimizer by ``data_ptr()``) sees the wrapped tensor's address. Should two wrapped
  parameters still end up as one entry, the optimizer holds one of them several times and
  never updates the others: :func:`watch_optimizers` refuses that at the optimizer's step.

[Note: stripped] A parameter is *stripped* when the slot ``module._parameters[name]``
that :func:`~qzero.fsdp.quantize_weight_gathers` filled with a wrapper holds a tensor
whose local shard is no wrapper of that parameter's :class:`~qzero.fsdp.tensor.GatherRecord`.
FSDP2 then gathers it plainly while nothing but this check would tell.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .tensor import QuantizedGatherTensor


def local_tensor(value):
    """The local shard of a DTensor, else ``value`` itself."""
    from torch.distributed.tensor import DTensor

    return value._local_tensor if isinstance(value, DTensor) else value


def wrapped_in(value) -> QuantizedGatherTensor | None:
    """The :class:`QuantizedGatherTensor` ``value`` is or holds as its local shard, else None."""
    local = local_tensor(value)
    return local if isinstance(local, QuantizedGatherTensor) else None


# ---------------------------------------------------------------------- load_state_dict(assign=True)


def rewrap_assigned(module: nn.Module, state_dict: dict, prefix: str, local_metadata, *_) -> None:
    """Load pre-hook: under ``assign=True``, wrap each tensor about to replace one of
    ``module``'s wrapped parameters like the parameter it replaces (same storage)."""
    if not local_metadata.get("assign_to_params_buffers", False):
        return  # a copying load writes into the wrapped tensor in place
    from torch.distributed.tensor import DTensor

    for pname, param in module._parameters.items():
        current = wrapped_in(param) if param is not None else None
        key = prefix + pname
        value = state_dict.get(key)
        if current is None or value is None or wrapped_in(value) is not None:
            continue
        local = local_tensor(value)
        if not isinstance(local, torch.Tensor) or local.dtype != current.dtype:
            continue  # not a tensor the wrapper can stand for: the forward's check refuses it
        inner = QuantizedGatherTensor(local, current._format, current._record)
        if isinstance(value, DTensor):
            state_dict[key] = DTensor.from_local(inner, value.device_mesh, value.placements, shape=value.shape,
                                                 stride=value.stride(), run_check=False)
        else:
            state_dict[key] = inner


# ---------------------------------------------------------------------- stripped parameters


class StrippedCheck:
    """Forward pre-hook of the converted model: refuses a stripped parameter ([Note: stripped]).

    ``slots`` are ``(module, name, record)`` of every slot the conversion filled (a tied
    parameter has one per module holding it).
    """

    def __init__(self, model: nn.Module, slots):
        self.model = model
        self.slots = tuple(slots)
        self._sharded: dict | None = None  # (id(module), name) -> FSDP2's FSDPParam, once sharded

    def __getstate__(self) -> dict:  # a pickled or copied model looks FSDP2's parameters up afresh
        return {**self.__dict__, "_sharded": None}

    def current(self, record):
        """The parameter now in the (first) slot filled for ``record``."""
        return next(m._parameters.get(n) for m, n, r in self.slots if r is record)

    def stripped(self) -> list[str]:
        """Names (as at the conversion) of the stripped parameters, each once."""
        out = []
        for module, pname, record in self.slots:
            if not self._holds(module, pname, record) and record.name not in out:
                out.append(record.name)
        return out

    def _holds(self, module: nn.Module, pname: str, record) -> bool:
        param = module._parameters.get(pname)
        held = wrapped_in(param) if param is not None else None
        if held is not None and held._record is record:
            return True
        # Between FSDP2's all-gather and its reshard the slot holds the unsharded parameter,
        # a plain tensor: then what counts is FSDP2's sharded parameter behind it.
        if self._sharded is None or (id(module), pname) not in self._sharded:
            self._sharded = _fsdp_params(self.model)
        fsdp_param = self._sharded.get((id(module), pname))
        held = wrapped_in(fsdp_param.sharded_param) if fsdp_param is not None else None
        return held is not None and held._record is record

    def __call__(self, model: nn.Module, args) -> None:
        lost = self.stripped()
        if lost:
            raise RuntimeError(
                f"qzero.fsdp: {len(lost)} parameter(s) converted by quantize_weight_gathers are no longer wrapped for "
                f"the quantized gather ({', '.join(lost[:4])}{', ...' if len(lost) > 4 else ''}): something replaced "
                "them with plain tensors, so FSDP2 would gather them plainly. Call quantize_weight_gathers after the "
                "step that replaces parameters (on the fp32 model, before fully_shard), or load without replacing them"
            )
        self._check_sharding()

    def _check_sharding(self) -> None:
        """Refuse FSDP2 settings the per-parameter quantized gather cannot carry, naming them,
        instead of FSDP2's shape or dtype error inside its all-gather (the same settings on
        every rank, so every rank raises)."""
        if self._sharded is None:
            self._sharded = _fsdp_params(self.model)
        for fsdp_param in self._sharded.values():
            held = wrapped_in(fsdp_param.sharded_param)
            if held is None or held._record is None:
                continue
            name = held._record.name
            post = getattr(fsdp_param, "post_forward_mesh_info", None)  # True: the mesh itself; False: None
            main = getattr(fsdp_param, "mesh_info", None)
            if post is not None and main is not None and post.shard_mesh_size != main.shard_mesh_size:
                raise ValueError(
                    f"qzero.fsdp: parameter {name!r} is resharded after forward to a smaller mesh (an integer "
                    "reshard_after_forward); quantize_weight_gathers supports reshard_after_forward=True or False "
                    "only: use one of those, or quantize_group_gathers after fully_shard")


def _fsdp_params(model: nn.Module | None) -> dict:
    """``(id(module), name) -> FSDPParam`` for every slot FSDP2 manages in ``model``."""
    out: dict = {}
    if model is None:
        return out
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch < 2.6
        return out
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [group] if group is not None else []
        for group in groups:
            for fsdp_param in getattr(group, "fsdp_params", ()):
                info = getattr(fsdp_param, "_module_info", None)
                if info is None:
                    continue
                out[(id(info.module), info.param_name)] = fsdp_param
                for shared, name in zip(getattr(info, "shared_modules", ()), getattr(info, "shared_param_names", ())):
                    out[(id(shared), name)] = fsdp_param
    return out


# ---------------------------------------------------------------------- optimizers


_WATCH: dict[str, object] = {}
_SEEN: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple]" = weakref.WeakKeyDictionary()


def watch_optimizers() -> None:
    """Install (once per process) the optimizer step pre-hook :func:`check_optimizer`."""
    if "handle" not in _WATCH:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _WATCH["handle"] = register_optimizer_step_pre_hook(check_optimizer)


def check_optimizer(optimizer: torch.optim.Optimizer, args=(), kwargs=None) -> None:
    """Refuse an optimizer that holds one wrapped parameter more than once (the trace of
    parameters told apart by a shared address: the others would never be updated).
    Re-checked only when a parameter group's list of parameters is replaced."""
    groups = optimizer.param_groups
    key = tuple((id(g["params"]), len(g["params"])) for g in groups)
    if _SEEN.get(optimizer) == key:
        return
    seen: dict[int, int] = {}
    for g in groups:
        for p in g["params"]:
            if wrapped_in(p) is not None:
                seen[id(p)] = seen.get(id(p), 0) + 1
    twice = {i: n for i, n in seen.items() if n > 1}
    if twice:
        record = next(wrapped_in(p)._record for g in groups for p in g["params"] if id(p) in twice)
        name = record.name if record is not None else "?"
        raise RuntimeError(
            f"qzero.fsdp: the optimizer holds {len(twice)} quantized-gather parameter(s) more than once "
            f"(e.g. {name!r}, {max(twice.values())} times), so the parameters they stand in for are never updated. "
            "Something re-pointed the optimizer to the sharded parameters by a key two parameters shared; "
            "build the optimizer from the sharded model's parameters after fully_shard"
        )
    _SEEN[optimizer] = key


#: It only reads, so qzero's sliced update (qzero.optim.update) may run it once per slice.
check_optimizer.qzero_read_only = True
