"""The DeepSpeed adapter's settings: qzero's keys in a DeepSpeed config, parsed and checked.

``prepare_config`` takes a DeepSpeed config dictionary, validates qzero's keys through
:class:`qzero.ZeroConfig` (one vocabulary with the core), takes them out of a copy (DeepSpeed's
config model refuses keys it does not know) and refuses what the adapter cannot do, by name.
Used by :mod:`qzero.integrations.deepspeed`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from ..config import DEFAULT_GROUP_SIZE, ZeroConfig, _as_int, refuse_renamed_keys
from .deepspeed_grads import GradientReductionSettings

# The core's defaults (qzero.ZeroConfig): one set of quantization settings for both.
DEFAULT_SMALL_PARAM_NUMEL = ZeroConfig.small_param_numel

# qzero's keys are ZeroConfig's field names ([Note: vocabulary] in qzero/vocabulary.py)
ENABLE_KEY = "zero_quantized_weights"
GROUP_SIZE_KEY = "zero_quantized_weights_group_size"
FORMAT_KEY = "zero_quantized_weights_format"
SMALL_PARAM_KEY = "small_param_numel"
OVERLAP_KEY = "overlap_param_gather"
LOOKAHEAD_KEY = "gather_lookahead"
#: qzero's own ``zero_optimization`` keys: DeepSpeed's config model rejects unknown keys,
#: so they are taken out of (a copy of) the config before DeepSpeed sees it.
QZERO_KEYS = (GROUP_SIZE_KEY, FORMAT_KEY, SMALL_PARAM_KEY, OVERLAP_KEY, LOOKAHEAD_KEY)
#: DeepSpeed's ZeRO++ gradient key (DeepSpeed implements it at stage 3 only) and qzero's
#: refinements of it (:attr:`qzero.ZeroConfig.zero_quantized_gradients`), which DeepSpeed does not know.
GRAD_ENABLE_KEY = "zero_quantized_gradients"
GRAD_KEYS = ("zero_quantized_gradients_group_size", "zero_quantized_gradients_format",
             "zero_quantized_gradients_rotation", "zero_quantized_gradients_rotation_block",
             "zero_quantized_gradients_error_feedback", "zero_quantized_gradients_intra_node")
#: :attr:`qzero.ZeroConfig.zero_quantized_weights_delta` and its resync interval: recognised and
#: validated here, and a delta gather refused (see :func:`_check_delta_keys`).
DELTA_KEYS = ("zero_quantized_weights_delta", "zero_quantized_weights_delta_resync_steps")
#: :attr:`qzero.ZeroConfig.ranks_per_node` and :attr:`qzero.ZeroConfig.hierarchical_collectives`:
#: validated here and taken out of DeepSpeed's copy; checked against the hosts once the engine
#: exists (:func:`qzero.integrations.deepspeed_grads.check_topology`).
TOPOLOGY_KEYS = ("ranks_per_node", "hierarchical_collectives")




# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class QuantizedWeightsSettings:
    """How the post-step weight gather is quantized and scheduled: :class:`qzero.ZeroConfig`'s
    fields of the same names, validated by it on construction (``None`` group size and format
    resolved as it resolves them)."""

    zero_quantized_weights_group_size: int | None = ZeroConfig.zero_quantized_weights_group_size
    zero_quantized_weights_format: str | None = ZeroConfig.zero_quantized_weights_format
    small_param_numel: int = ZeroConfig.small_param_numel
    allgather_bucket_size: int | None = None
    """Elements one chunk gathers across all ranks; None (here): DeepSpeed's own
    ``allgather_bucket_size``, the key of the same name in its config."""
    overlap_param_gather: bool = False
    """Gather-ahead: start the gather at the end of the optimizer step and let each module of
    the next forward wait for its own chunks (:mod:`qzero.integrations.deepspeed_ahead`).
    Off by default here: DeepSpeed users opt in with ``zero_optimization.overlap_param_gather``."""
    gather_lookahead: int = ZeroConfig.gather_lookahead
    """:attr:`qzero.ZeroConfig.gather_lookahead`: 0, every chunk enqueued by the optimizer step;
    N, N chunks past the one a forward waits for."""

    def __post_init__(self) -> None:
        if self.allgather_bucket_size is not None:
            bucket = _as_int("allgather_bucket_size", self.allgather_bucket_size)
            if bucket <= 0:
                raise ValueError(f"allgather_bucket_size must be positive, got {self.allgather_bucket_size!r}")
            object.__setattr__(self, "allgather_bucket_size", bucket)
        core = self.zero_config()
        for name in ("zero_quantized_weights_group_size", "zero_quantized_weights_format", "small_param_numel"):
            object.__setattr__(self, name, getattr(core, name))

    def zero_config(self) -> ZeroConfig:
        """These settings as the core's :class:`qzero.ZeroConfig` (which validates them)."""
        group = self.zero_quantized_weights_group_size
        return ZeroConfig(
            zero_quantized_weights=True,
            zero_quantized_weights_group_size=group,
            zero_quantized_weights_format=self.zero_quantized_weights_format,
            small_param_numel=self.small_param_numel,
            overlap_param_gather=self.overlap_param_gather,
            gather_lookahead=self.gather_lookahead,
            allgather_bucket_size=max(self.allgather_bucket_size or 0, group if isinstance(group, int) else 0,
                                      DEFAULT_GROUP_SIZE),
        )

    def is_default(self) -> bool:
        return self == QuantizedWeightsSettings()


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class PreparedConfig:
    """A user's DeepSpeed config split into what DeepSpeed sees and what qzero does."""

    ds_config: dict
    stage: int
    quantize: bool
    """True: patch the engine's post-step gather after DeepSpeed built it."""
    settings: QuantizedWeightsSettings
    gradients: GradientReductionSettings | None = None
    """Set: replace the optimizer's ZeRO-2 gradient reduction after DeepSpeed built it
    (:mod:`qzero.integrations.deepspeed_grads`)."""
    topology: tuple[int, bool | str] = (ZeroConfig.ranks_per_node, ZeroConfig.hierarchical_collectives)
    """``(ranks_per_node, hierarchical_collectives)``, validated by :class:`qzero.ZeroConfig`."""


def prepare_config(config: dict) -> PreparedConfig:
    """Read qzero's keys from a DeepSpeed config dict and reject what it cannot do.

    Works on a deep copy; ``config`` is never modified. Raises ``ValueError`` naming the
    offending key and value.
    """
    if not isinstance(config, dict):
        raise TypeError(f"expected a DeepSpeed config dict, got {type(config).__name__}")
    ds_config = copy.deepcopy(config)
    zero = ds_config.get("zero_optimization")
    if not isinstance(zero, dict):  # absent, or the deprecated boolean form: nothing for qzero
        return PreparedConfig(ds_config, int(bool(zero)), False, QuantizedWeightsSettings())
    refuse_renamed_keys(zero)
    settings = _settings_from(zero)
    topology = _topology_keys(zero, _stage_of(zero))
    gradients = _check_gradient_keys(zero, _stage_of(zero), settings)
    _check_delta_keys(zero)
    enabled = zero.get(ENABLE_KEY, False)
    if not isinstance(enabled, bool):
        raise ValueError(f"zero_optimization.{ENABLE_KEY} must be true or false, got {enabled!r}")
    stage = _stage_of(zero)
    if stage == 3:
        if not settings.is_default():
            raise ValueError(
                f"ZeRO stage 3 with {_describe_non_default(settings)} is not supported: at stage 3 "
                f"DeepSpeed's own {ENABLE_KEY} applies, with its fixed group size; remove the qzero keys "
                f"{list(QZERO_KEYS)}"
            )
        return PreparedConfig(ds_config, stage, False, settings, topology=topology)  # DeepSpeed's own quantized weights
    if not enabled:
        if settings.overlap_param_gather:
            raise ValueError(
                f"zero_optimization.{OVERLAP_KEY}=true needs {ENABLE_KEY}=true: gather-ahead runs on qzero's "
                "quantized gather (DeepSpeed's own gather is synchronous)"
            )
        return PreparedConfig(ds_config, stage, False, settings, gradients, topology)
    if stage not in (1, 2):
        raise ValueError(
            f"zero_optimization.{ENABLE_KEY}=true needs ZeRO stage 1 or 2, got stage {stage}: "
            "without ZeRO partitions there is no post-step weight gather to quantize"
        )
    # DeepSpeed ignores this key below stage 3; qzero implements it there.
    del zero[ENABLE_KEY]
    _reject_unsupported_config(ds_config, zero)
    return PreparedConfig(ds_config, stage, True, settings, gradients, topology)


def _topology_keys(zero: dict, stage: int) -> tuple[int, bool | str]:
    """Validate ``ranks_per_node`` and ``hierarchical_collectives`` (as :class:`qzero.ZeroConfig`
    does) and pop them from ``zero`` (a copy): DeepSpeed's config model does not know them."""
    given = {key: zero.pop(key) for key in TOPOLOGY_KEYS if key in zero}
    try:
        config = ZeroConfig(**given)
    except ValueError as e:
        raise ValueError(f"zero_optimization: {e}") from None
    if stage == 3 and given:
        raise ValueError(f"ZeRO stage 3 with {sorted(given)}: qzero changes nothing at stage 3 (DeepSpeed's own "
                         "ZeRO++ settings apply there); remove these qzero keys")
    return config.ranks_per_node, config.hierarchical_collectives


def _settings_from(zero: dict) -> QuantizedWeightsSettings:
    """Pop qzero's keys from ``zero`` (a copy) and validate them."""
    values = {key: zero.pop(key) for key in QZERO_KEYS if key in zero}
    try:
        return QuantizedWeightsSettings(**values)  # the keys are the fields' names
    except ValueError as e:
        raise ValueError(f"zero_optimization: {e} (keys given: {values})") from None


def _check_gradient_keys(zero: dict, stage: int,
                         settings: QuantizedWeightsSettings) -> GradientReductionSettings | None:
    """Validate the quantized-gradient keys (as :class:`qzero.ZeroConfig` does) and pop qzero's
    own ones from ``zero`` (a copy). At stage 2, ``zero_quantized_gradients=true`` is qzero's
    quantized gradient reduction (:mod:`qzero.integrations.deepspeed_grads`; the key is popped
    too: DeepSpeed would build its stage-3 all-to-all groups for it); what it cannot do is
    refused by name. At stage 3 DeepSpeed's own key applies."""
    given = {key: zero.pop(key) for key in GRAD_KEYS if key in zero}
    enabled = zero.get(GRAD_ENABLE_KEY, False)
    try:
        config = ZeroConfig(**{GRAD_ENABLE_KEY: enabled}, **given, small_param_numel=settings.small_param_numel)
    except ValueError as e:
        raise ValueError(f"zero_optimization: {e}") from None
    if stage == 3:
        if given:
            raise ValueError(
                f"ZeRO stage 3 with {sorted(given)}: at stage 3 DeepSpeed's own {GRAD_ENABLE_KEY} applies, with "
                "its fixed settings; remove these qzero keys"
            )
        return None
    if not enabled:
        return None
    if stage != 2:
        raise ValueError(
            f"zero_optimization.{GRAD_ENABLE_KEY}=true at stage {stage}: the DeepSpeed adapter quantizes "
            "DeepSpeed's partitioned gradient reduction, which is ZeRO stage 2 (at stage 1 DeepSpeed all-reduces "
            "the gradients after backward); use stage 2, or qzero.ZeroOptimizer (ZeroConfig.from_dict takes this "
            "zero_optimization dict), or remove the key"
        )
    if config.zero_quantized_gradients_error_feedback:
        raise ValueError(
            "zero_optimization.zero_quantized_gradients_error_feedback=true: the DeepSpeed adapter keeps no "
            "gradient residuals; use qzero.ZeroOptimizer for error feedback, or remove the key"
        )
    if config.zero_quantized_gradients_intra_node != "none":
        raise ValueError(
            f"zero_optimization.zero_quantized_gradients_intra_node={config.zero_quantized_gradients_intra_node!r}: "
            "the DeepSpeed adapter reduces each bucket in one stage (it has no node stage); use "
            "qzero.ZeroOptimizer for a quantized node stage, or remove the key"
        )
    for key, want, why in (("reduce_scatter", True, "reduces by all-reduce, not by partition"),
                           ("contiguous_gradients", True, "reduces through its non-contiguous fallback")):
        if zero.get(key, want) is not want:
            raise ValueError(
                f"zero_optimization.{key}={zero[key]!r} with {GRAD_ENABLE_KEY}=true: DeepSpeed then {why}, "
                f"which qzero's quantized gradient reduction does not replace; set {key} to true or remove "
                f"{GRAD_ENABLE_KEY}"
            )
    del zero[GRAD_ENABLE_KEY]
    return GradientReductionSettings.from_config(config)


def _check_delta_keys(zero: dict) -> None:
    """Validate the delta keys (as :class:`qzero.ZeroConfig` does) and pop them from ``zero`` (a
    copy). A delta gather is refused by name rather than ignored: DeepSpeed writes each rank's
    bf16/fp16 master into its partition of the flat group before it calls the gather, so the
    replica that a difference is taken against is gone by then."""
    given = {key: zero.pop(key) for key in DELTA_KEYS if key in zero}
    try:
        ZeroConfig(zero_quantized_weights=True, **given)
    except ValueError as e:
        raise ValueError(f"zero_optimization: {e}") from None
    if given.get(DELTA_KEYS[0]):
        raise ValueError(
            f"zero_optimization.{DELTA_KEYS[0]}=true: the DeepSpeed adapter does not send delta gathers (DeepSpeed "
            "overwrites each rank's replica of its partition with the new weights before the gather); use "
            "qzero.ZeroOptimizer (ZeroConfig.from_dict takes this zero_optimization dict) or remove the key"
        )


def _stage_of(zero: dict) -> int:
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    return int(stage)


def _describe_non_default(settings: QuantizedWeightsSettings) -> str:
    default = QuantizedWeightsSettings()
    parts = []
    if settings.zero_quantized_weights_group_size != default.zero_quantized_weights_group_size:
        parts.append(f"{GROUP_SIZE_KEY}={settings.zero_quantized_weights_group_size}")
    if settings.zero_quantized_weights_format != default.zero_quantized_weights_format:
        parts.append(f"{FORMAT_KEY}={settings.zero_quantized_weights_format!r}")
    if settings.small_param_numel != default.small_param_numel:
        parts.append(f"{SMALL_PARAM_KEY}={settings.small_param_numel}")
    if settings.overlap_param_gather != default.overlap_param_gather:
        parts.append(f"{OVERLAP_KEY}={settings.overlap_param_gather}")
    if settings.gather_lookahead != default.gather_lookahead:
        parts.append(f"{LOOKAHEAD_KEY}={settings.gather_lookahead}")
    return ", ".join(parts)


def _reject_unsupported_config(ds_config: dict, zero: dict) -> None:
    """Config-level refusals, before DeepSpeed builds anything."""
    if zero.get("zenflow") is not None:
        raise ValueError(
            "zero_optimization.zenflow is set: ZenFlow is not supported with qzero's quantized weights "
            "(its optimizer updates and gathers weights its own way)"
        )
    offload = zero.get("offload_optimizer")
    device = offload.get("device") if isinstance(offload, dict) else offload
    if device not in (None, "none", "cpu"):
        raise ValueError(
            f"zero_optimization.offload_optimizer.device={device!r} is not supported with qzero's quantized "
            "weights: DeepSpeed's ZeRO-1/2 has no NVMe optimizer offload of its own (it would run CPU offload "
            "under that name); use device 'cpu'"
        )
    if not _half_precision_requested(ds_config):
        raise ValueError(
            "neither bf16.enabled nor fp16.enabled is true: the flat groups would be fp32, which has nothing "
            f"to gain from quantization and would lose precision; enable bf16 or fp16, or set {ENABLE_KEY}=false"
        )


def _half_precision_requested(ds_config: dict) -> bool:
    """True when bf16/fp16 is on, or left to be decided later ("auto")."""
    for key in ("bf16", "bfloat16", "fp16"):
        section = ds_config.get(key)
        if isinstance(section, dict) and section.get("enabled", False) in (True, "auto"):
            return True
    return False
