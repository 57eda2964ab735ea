"""Gather-ahead inside DeepSpeed ZeRO-1/2: what waits for a gather still running.

With ``zero_optimization.overlap_param_gather: true`` the adapter's post-step gather
(:class:`qzero.integrations.deepspeed.QuantizedGather`) is started at the end of
DeepSpeed's optimizer step and not waited for; the next forward's modules each wait for
the chunks holding their own parameters (:class:`qzero.wire.overlap.GatherAhead`, given every
parameter's range in DeepSpeed's flat groups). Everything else that reads or writes the
weights finishes the whole gather first:

* the optimizer: ``step()`` (it writes the partitions), any backward (DeepSpeed calls the
  optimizer's ``backward_prologue`` for ``engine.backward`` and for a direct
  ``loss.backward()`` alike), ``load_state_dict`` and ``state_dict``;
* the model: a forward in eval mode (the first pre-hook of the model), ``state_dict()``
  (checkpoints, ``save_pretrained``, export) and ``load_state_dict()``;
* the engine, when the adapter was given one: ``eval()``/``train(False)``,
  ``save_checkpoint``, ``load_checkpoint``, and reading ``engine.module`` from outside
  DeepSpeed's own code (DeepSpeed reads it inside every forward, which must not wait).

Only a gather started inside the optimizer's ``step()`` runs ahead; any other (the one
after a checkpoint load) is waited for at once. The bits are those of the synchronous
gather: the same chunks, packed and unpacked by the same functions.

[Note: DeepSpeed's throughput timer] By default DeepSpeed's engine synchronizes the device at
the start of every forward (when it has no training dataloader of its own, as with a loop of
your own or the HF Trainer) and at the end of every step, to time them
(``"timers": {"throughput": {"synchronized": true}}``). Either synchronization holds the host
until the gather has finished, so it ends before the next forward starts and hides nothing.
Given the engine, gather-ahead therefore switches that timer's synchronization off (its
throughput figures are then host-timed) and :meth:`AheadWiring.remove` switches it back; a
config that sets ``synchronized: true`` itself keeps it, with a warning.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch

from ..wire.overlap import GatherAhead
from .deepspeed_layout import flat_groups

#: Optimizer methods that finish a running gather before they run.
OPTIMIZER_WAITS = ("step", "backward_prologue", "load_state_dict", "state_dict")


def param_ranges(opt) -> list[tuple[torch.nn.Parameter, int, int, int]]:
    """``(param, group, start, stop)`` for every parameter of DeepSpeed's flat groups: its
    recorded offset, checked against where the parameter's storage really is."""
    ranges = []
    layout = flat_groups(opt)
    for i, flat in enumerate(layout.flats):
        base, size = flat.data_ptr(), flat.element_size()
        for p, n, offset in zip(layout.params[i], layout.numels[i], layout.offsets[i]):
            if n == 0:
                continue
            if p.data_ptr() != base + offset * size or p.numel() != n:
                raise RuntimeError(
                    f"DeepSpeed parameter group {i}: a parameter of shape {tuple(p.shape)} is not the view of "
                    f"elements [{offset}, {offset + n}) of its flat group; gather-ahead cannot tell which chunks "
                    "it needs (set overlap_param_gather=false)"
                )
            ranges.append((p, i, offset, offset + n))
    return ranges


def model_ranges(opt, model: torch.nn.Module):
    """:func:`param_ranges`, checked to be parameters of ``model`` (raises ``ValueError``)."""
    ranges = param_ranges(opt)
    trained = {id(p) for p in model.parameters()}
    stray = sum(1 for p, *_ in ranges if id(p) not in trained)
    if stray:
        raise ValueError(
            f"{stray} of the {len(ranges)} parameters DeepSpeed's optimizer updates are not parameters of the "
            f"model given ({type(model).__name__}): gather-ahead needs the module the engine trains"
        )
    return ranges


class AheadWiring:
    """The hooks and wrappers that make reads of the weights wait; :meth:`remove` undoes them."""

    def __init__(self, gather, opt, model: torch.nn.Module, engine: torch.nn.Module | None):
        self.gather = gather
        self.ahead = GatherAhead.from_ranges(model, model_ranges(opt, model), len(flat_groups(opt).flats))
        self.stepping = False
        wait = self.wait
        self._hooks = [
            model.register_forward_pre_hook(self._eval_forward, prepend=True),
            model.register_state_dict_pre_hook(lambda *_: wait()),
            model.register_load_state_dict_pre_hook(lambda *_: wait()),
        ]
        self._opt = opt
        for name in OPTIMIZER_WAITS:
            setattr(opt, name, self._waiting(getattr(opt, name), stepping=name == "step"))
        self._engine = engine
        self._timer_config = None  # the throughput timer's own config, while ours stands in for it
        if engine is not None:
            engine.__class__ = _engine_class(type(engine))
            self._timer_config = unsynchronize_throughput_timer(engine)

    def wait(self) -> None:
        self.ahead.wait_all()

    def _eval_forward(self, module, args) -> None:
        if not module.training:
            self.wait()

    def _waiting(self, method, stepping: bool):
        def wrapper(*args, **kwargs):
            self.wait()
            if not stepping:
                return method(*args, **kwargs)
            self.stepping = True
            try:
                return method(*args, **kwargs)
            finally:
                self.stepping = False

        wrapper.qzero_wrapped = method
        return wrapper

    def remove(self) -> None:
        """Finish the gather, then take every hook and wrapper off."""
        self.ahead.remove()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for name in OPTIMIZER_WAITS:
            if getattr(self._opt.__dict__.get(name), "qzero_wrapped", None) is not None:
                del self._opt.__dict__[name]
        engine, self._engine = self._engine, None
        if engine is not None and type(engine) in _ENGINE_CLASSES.values():
            engine.__class__ = type(engine).__bases__[0]
        if engine is not None and self._timer_config is not None:
            engine.tput_timer.config, self._timer_config = self._timer_config, None


def synchronized_timer_in(config: Any) -> bool | None:
    """``timers.throughput.synchronized`` as a DeepSpeed config dict sets it (None: not set)."""
    timers = config.get("timers") if isinstance(config, dict) else None
    throughput = timers.get("throughput") if isinstance(timers, dict) else None
    return throughput.get("synchronized") if isinstance(throughput, dict) else None


SYNCHRONIZED_TIMER_WARNING = (
    "qzero gather-ahead: DeepSpeed's throughput timer synchronizes the device at every forward's start and "
    "step's end (timers.throughput.synchronized=true in the config), so the weight gather finishes before the "
    "next forward starts and none of it is hidden; remove that setting or set it false")


def unsynchronize_throughput_timer(engine) -> Any:
    """Switch off the device synchronization of ``engine``'s throughput timer ([Note: DeepSpeed's
    throughput timer]); returns the timer's config to restore, or None when nothing changed (no
    such timer, already unsynchronized, or the engine's config asks for it: then it warns)."""
    timer = getattr(engine, "tput_timer", None)
    config = getattr(timer, "config", None)
    if config is None or not getattr(config, "synchronized", False) or not hasattr(config, "model_copy"):
        return None
    if synchronized_timer_in(getattr(getattr(engine, "_config", None), "_param_dict", None)) is True:
        warnings.warn(SYNCHRONIZED_TIMER_WARNING, stacklevel=4)
        return None
    timer.config = config.model_copy(update={"synchronized": False})
    return config


def _wait_on(engine) -> None:
    gather = engine.__dict__.get("qzero_gather")
    wiring = getattr(gather, "wiring", None)
    if wiring is not None:
        wiring.wait()


def _module_of(engine):
    """``engine.module``: from outside DeepSpeed's own code, after the running gather finished."""
    caller = sys._getframe(1).f_globals.get("__name__", "")
    if caller != "deepspeed" and not caller.startswith("deepspeed."):
        _wait_on(engine)
    return engine._modules["module"]


_ENGINE_CLASSES: dict[type, type] = {}


def _engine_class(base: type) -> type:
    """``base`` (a DeepSpeed engine class) whose weight-reading entry points wait first."""
    if base in _ENGINE_CLASSES.values():
        return base
    if base not in _ENGINE_CLASSES:

        def eval(self):
            _wait_on(self)
            return base.eval(self)

        def train(self, mode: bool = True):
            if not mode:
                _wait_on(self)
            return base.train(self, mode)

        def save_checkpoint(self, *args: Any, **kwargs: Any):
            _wait_on(self)
            return base.save_checkpoint(self, *args, **kwargs)

        def load_checkpoint(self, *args: Any, **kwargs: Any):
            _wait_on(self)
            return base.load_checkpoint(self, *args, **kwargs)

        namespace = dict(module=property(_module_of), eval=eval, train=train, save_checkpoint=save_checkpoint,
                         load_checkpoint=load_checkpoint, __module__=base.__module__)
        _ENGINE_CLASSES[base] = type(base.__name__, (base,), namespace)
    return _ENGINE_CLASSES[base]
