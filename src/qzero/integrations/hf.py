"""qzero's quantized post-step weight gather inside the Hugging Face ``Trainer`` (DeepSpeed ZeRO-1/2).

The Trainer builds its DeepSpeed engine itself (through Accelerate), so qzero's
``initialize`` cannot be swapped in; instead this callback enables the quantized gather
on the engine's optimizer when training begins, before the first step::

    from qzero.integrations.hf import QZeroCallback

    ds_config = {..., "zero_optimization": {"stage": 2, "zero_quantized_weights": True}}
    trainer = Trainer(model, TrainingArguments(..., deepspeed=ds_config), ...,
                      callbacks=[QZeroCallback(group_size=64)])

DeepSpeed accepts ``zero_quantized_weights`` (and ignores it below stage 3) but rejects
unknown keys, so qzero's other settings are the callback's arguments
(``overlap_param_gather=True`` for gather-ahead, with ``"timers": {"throughput":
{"synchronized": false}}`` in the DeepSpeed config: otherwise DeepSpeed synchronizes the device
at every forward and step, the gather cannot overlap the forward, and the callback warns). CPU optimizer offload
(``offload_optimizer: {"device": "cpu"}``) works as with ``initialize``. By default the
callback follows ``zero_quantized_weights`` in the Trainer's DeepSpeed config; at ZeRO
stage 3 it leaves DeepSpeed's own quantized weights alone.

After every optimizer step the callback checks that the step's weight gather ran through
qzero (a step DeepSpeed skipped for an fp16 overflow gathers nothing): a gather that went
elsewhere raises instead of training on with the plain gather unnoticed.
``callback.report()`` says what the last gather carried quantized.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any

from transformers import TrainerCallback

from ..config import ZeroConfig, keyword_settings
from ..vocabulary import RENAMED_GATHER_KEYWORDS
from . import deepspeed as qds
from .deepspeed_ahead import synchronized_timer_in

__all__ = ["QZeroCallback"]

_log = logging.getLogger("qzero.hf")

TRAINER_TIMER_WARNING = (
    "QZeroCallback(overlap_param_gather=True): DeepSpeed's throughput timer synchronizes the device at every "
    "forward's start and step's end unless the DeepSpeed config has \"timers\": {\"throughput\": "
    "{\"synchronized\": false}}; with it synchronizing, the weight gather finishes before the next forward "
    "starts and gather-ahead hides none of it")


class QZeroCallback(TrainerCallback):
    """Enables :func:`qzero.integrations.deepspeed.enable` on the Trainer's DeepSpeed engine.

    ``enabled``: None follows ``zero_optimization.zero_quantized_weights`` of the Trainer's
    DeepSpeed config; True/False force it (True without DeepSpeed ZeRO-1/2 is an error).
    After training begins, ``gather`` is the engine's
    :class:`~qzero.integrations.deepspeed.QuantizedGather` (None when not enabled). The other
    keywords are :func:`~qzero.integrations.deepspeed.enable`'s (ZeroConfig's field names).
    """

    def __init__(
        self,
        *,
        enabled: bool | None = None,
        zero_quantized_weights_group_size: int | None = ZeroConfig.zero_quantized_weights_group_size,
        zero_quantized_weights_format: str | None = ZeroConfig.zero_quantized_weights_format,
        small_param_numel: int = ZeroConfig.small_param_numel,
        allgather_bucket_size: int | None = None,
        overlap_param_gather: bool = False,
        gather_lookahead: int = ZeroConfig.gather_lookahead,
        **short,
    ):
        if enabled is not None and not isinstance(enabled, bool):
            raise ValueError(f"enabled must be None, True or False, got {enabled!r}")
        # validated now, so a bad value fails when the Trainer is built, not mid-launch
        self.settings = qds.QuantizedWeightsSettings(**keyword_settings(QZeroCallback.__init__, dict(
            zero_quantized_weights_group_size=zero_quantized_weights_group_size,
            zero_quantized_weights_format=zero_quantized_weights_format, small_param_numel=small_param_numel,
            allgather_bucket_size=allgather_bucket_size, overlap_param_gather=overlap_param_gather,
            gather_lookahead=gather_lookahead), short, RENAMED_GATHER_KEYWORDS))
        self.enabled = enabled
        self.gather: qds.QuantizedGather | None = None
        self._optimizer = None  # DeepSpeed's optimizer, for its overflow flag
        self._calls = 0  # gathers counted at the end of the previous step

    def on_train_begin(self, args, state, control, optimizer=None, model=None, **kwargs):
        if not self._wanted(args):
            return
        if optimizer is None or getattr(args, "hf_deepspeed_config", None) is None:
            raise ValueError(
                "QZeroCallback(enabled=True) needs the Trainer to run DeepSpeed ZeRO stage 1 or 2 "
                "(TrainingArguments(deepspeed=...))"
            )
        if self.settings.overlap_param_gather and synchronized_timer_in(args.hf_deepspeed_config.config) is not False:
            # [Note: DeepSpeed's throughput timer] in deepspeed_ahead.py: the engine the Trainer
            # built synchronizes at every forward and step, which gather-ahead cannot undo from here
            warnings.warn(TRAINER_TIMER_WARNING, stacklevel=2)
        # the Trainer passes Accelerate's wrapper; enable() finds DeepSpeed's optimizer inside it;
        # model: the module DeepSpeed trains (gather-ahead hooks its modules)
        self.gather = qds.enable(optimizer, **dataclasses.asdict(self.settings), model=model)
        self._optimizer = qds.find_zero_optimizer(optimizer)
        self._calls = self.gather.calls

    def on_step_end(self, args, state, control, **kwargs):
        if self.gather is None:
            return
        calls, before = self.gather.calls, self._calls
        self._calls = calls
        if calls == before and not getattr(self._optimizer, "overflow", False):
            raise RuntimeError(
                f"qzero: optimizer step {state.global_step} ran without qzero's weight gather (still {calls} "
                "gather(s)): DeepSpeed's post-step gather no longer goes through qzero's adapter, so the weights "
                "travelled plainly; was qzero.integrations.deepspeed.disable() called, or DeepSpeed's "
                "all_gather_dp_groups replaced after the callback enabled it?"
            )

    def on_train_end(self, args, state, control, **kwargs):
        if self.gather is not None:
            _log.info(self.gather.report().summary())

    def report(self) -> qds.DeepSpeedGatherReport | None:
        """What the last gather carried (None when the callback did not enable the adapter)."""
        return None if self.gather is None else self.gather.report()

    def _wanted(self, args) -> bool:
        zero = _zero_section(args)
        if self.enabled is not None:
            return self.enabled
        if zero.get("stage", 0) not in (1, 2):
            return False  # no ZeRO-1/2 here; at stage 3 the key is DeepSpeed's own
        return zero.get(qds.ENABLE_KEY, False) is True


def _zero_section(args) -> dict[str, Any]:
    """``zero_optimization`` of the Trainer's DeepSpeed config (with "auto" values filled), or {}."""
    hf_config = getattr(args, "hf_deepspeed_config", None)
    config = getattr(hf_config, "config", None)
    if not isinstance(config, dict):
        return {}
    zero = config.get("zero_optimization")
    return zero if isinstance(zero, dict) else {}
