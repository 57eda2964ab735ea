"""ZeroConfig: the settings of a qzero optimizer, validated, with DeepSpeed's key names.

``ZeroConfig.from_dict`` accepts a DeepSpeed ``zero_optimization`` dictionary: the
keys qzero implements map onto fields of the same name, a few DeepSpeed keys that
describe what qzero always does are accepted (and checked), anything else is
rejected by name.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import inspect
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from .layout.flat_layout import DEFAULT_SMALL_PARAM_NUMEL
from .layout.gather_planner import DEFAULT_BUCKET_NUMEL
from .quant.formats import DEFAULT_FORMAT, DEFAULT_GROUP_SIZE, check_group_size, get_format
from .quant.gradients import check_rotation_block
from .vocabulary import (DELTA_FORMATS, FLAT_ORDERS, GATHER_SCHEDULES, GRADIENT_FORMATS, GRADIENT_ROTATIONS,
                         HIERARCHICAL_CHOICES, INTRA_NODE_FORMATS, KERNELS,
                         REDUCE_DTYPES, ZERO_ALIASES)

#: ``zero_quantized_gradients_rotation_block``'s default (chosen by measurement:
#: ``benchmarks/reports/loss-quantized-gradients.md``).
DEFAULT_ROTATION_BLOCK = 32
#: The largest count any setting takes (elements of a bucket, steps, ...): far beyond any real
#: run, and small enough that sizes computed from it stay inside int64 arithmetic.
MAX_COUNT = 2**48
#: 2**64 is already far beyond any useful fp16 loss scale, and comfortably inside fp32.
MAX_SCALE_POWER = 64
#: The weight payload's defaults (``zero_quantized_weights_format``/``_group_size`` left as None):
#: ``DEFAULT_FORMAT``, ``DEFAULT_GROUP_SIZE`` of :mod:`qzero.quant.formats`.
#: The delta payload's defaults (see ``zero_quantized_weights_delta``; its formats are
#: ``qzero.vocabulary.DELTA_FORMATS``): measured, bytes against error, in ``docs/delta-gathers.md``.
DELTA_FORMAT = "int4"
DELTA_GROUP_SIZE = 64
#: ``zero_quantized_gradients_group_size``'s default per format (left as None): groups of 256
#: for ``int4`` (4.125 bits an element; chosen by measurement, see ``docs/quantized_gradients.md``),
#: ``DEFAULT_GROUP_SIZE`` for the 8-bit formats.
GRADIENT_GROUP_SIZES = {"int4": 256}

# DeepSpeed keys with no setting of their own here: qzero always behaves as the value given.
_DEEPSPEED_FIXED = {
    "allgather_partitions": True,  # the post-step gather always runs on partitions
    "contiguous_gradients": None,  # gradients always land in contiguous buffers; either value accepted
    "round_robin_gradients": False,  # parameters keep their model order
    "reduce_scatter": True,  # gradients always go to their owners only
    "elastic_checkpoint": None,  # checkpoints always reshard; either value accepted
    "load_from_fp32_weights": True,  # loading always rebuilds weights from fp32 masters
}
#: DeepSpeed ``zero_optimization`` keys qzero knows and does not support, and why: refused with
#: the reason, never called unknown nor answered with the closest-spelled key of qzero's.
_ZERO3 = ("a ZeRO-3 setting (parameters partitioned, gathered for every forward); qzero is ZeRO stage 1/2, "
          "whose weights stay whole on every rank")
_OFFLOAD = ("optimizer offload to the host (ZeRO-Offload); qzero keeps the fp32 masters and optimizer state "
            "sharded on the device, where its quantized gather sends from")
_DEEPSPEED_INTERNAL = "a setting of DeepSpeed's own ZeRO implementation, which qzero's does not have"
DEEPSPEED_UNSUPPORTED = {
    **dict.fromkeys(("offload_param", "cpu_offload_param", "sub_group_size", "prefetch_bucket_size",
                     "param_persistence_threshold", "model_persistence_threshold", "max_live_parameters",
                     "max_reuse_distance", "gather_16bit_weights_on_model_save", "module_granularity_threshold",
                     "use_all_reduce_for_fetch_params", "allgather_sequential", "zero_hpz_partition_size",
                     "zero_quantized_nontrainable_weights", "memory_efficient_linear", "pipeline_loading_checkpoint",
                     "override_module_apply", "log_trace_cache_warnings", "leaf_module", "mics_shard_size",
                     "mics_hierarchical_params_gather"), _ZERO3),
    **dict.fromkeys(("offload_optimizer", "cpu_offload", "cpu_offload_use_pin_memory", "zenflow"), _OFFLOAD),
    **dict.fromkeys(("use_multi_rank_bucket_allreduce", "legacy_stage1", "compute_grad_norm", "parameter_alignment",
                     "enable_sanity_checks", "ignore_unused_parameters", "save_muon_momentum_buffer_in_memory"),
                    _DEEPSPEED_INTERNAL),
}


def unsupported_reason(key: str) -> str | None:
    """Why qzero does not support DeepSpeed's ``zero_optimization`` key ``key``; None if it is not one of those."""
    return DEEPSPEED_UNSUPPORTED.get(key) or (_ZERO3 if key.startswith("stage3_") else None)


#: ``zero_optimization`` keys of earlier releases and the ZeroConfig fields that replaced them:
#: refused by name ([Note: vocabulary] in :mod:`qzero.vocabulary`), never silently ignored.
RENAMED_KEYS = {
    "zero_quantized_weights_small_param_numel": "small_param_numel",
}


def refuse_renamed_keys(zero: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the new key if ``zero`` (a ``zero_optimization`` dict) uses a
    key of :data:`RENAMED_KEYS`."""
    for key in zero:
        if key in RENAMED_KEYS:
            new = RENAMED_KEYS[key]
            raise ValueError(f"zero_optimization.{key} is now {new} (qzero's keys are ZeroConfig's field names); "
                             f"did you mean {new}?")


def _as_int(name: str, value: Any) -> int:
    """Integers, and integral floats as DeepSpeed configs write them (``5e8``)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


@dataclass(frozen=True)
class ZeroConfig:
    """Settings of :class:`qzero.ZeroOptimizer`. Validated on construction."""

    stage: int = 2
    """ZeRO stage: 1 (gradients reduced once per step, full gradient buffer) or 2
    (gradients reduce-scattered in buckets during backward; each rank keeps only its
    fp32 gradient partition)."""

    zero_quantized_weights: bool = False
    """Quantize the post-step weight all-gather. Off: the plain gather, bit-exact."""

    zero_quantized_weights_group_size: int | None = None
    """Elements that share one fp32 scale; a positive multiple of 8. ``None`` (the default):
    64, also with ``zero_quantized_weights_delta`` (``docs/delta-gathers.md`` has the
    measurement behind it); resolved on construction."""

    zero_quantized_weights_format: str | None = None
    """Payload format: ``int8`` (the reference), ``fp8`` (e4m3) or ``int4``; with
    ``zero_quantized_weights_delta``, ``int4`` or ``int8``. ``None`` (the default): ``int8``,
    or ``int4`` with ``zero_quantized_weights_delta``; resolved on construction."""

    zero_quantized_weights_delta: bool = False
    """With ``zero_quantized_weights``: send each step the quantized *difference* between the
    new weights (the bf16/fp16 rounding of the fp32 masters) and the replica every rank
    already holds, and let every rank add it to that replica (a closed loop: the next
    difference is taken against the replica actually held, so quantization errors do not
    accumulate; each replica element stays within one quantization step of the rounded
    master). INT4 differences with 64-element groups cost 0.5625 bytes per parameter, about
    half of INT8 weights, at a much smaller error. Small parameters travel exactly. Exact
    resyncs (the plain gather: every replica becomes the rounded masters): the first gather
    after construction, the gather that ends a ``load_checkpoint`` that cannot restore the
    replica (another world size), every ``zero_quantized_weights_delta_resync_steps``-th
    gather, and ``gather_exact_weights()``. Checkpoints save the replica, so a resume at the
    same world size is bit-exact. Not with the DeepSpeed adapter. ``docs/delta-gathers.md``."""

    zero_quantized_weights_delta_resync_steps: int = 1000
    """With ``zero_quantized_weights_delta``: every this many gathers, one is an exact resync
    (the plain gather, 2 bytes per parameter); 0 never resyncs by itself. The closed loop does
    not drift (``docs/delta-gathers.md``): this is a safety net, priced at 0.3% more bytes."""

    small_param_numel: int = DEFAULT_SMALL_PARAM_NUMEL
    """Parameters with at most this many elements (norms, biases) travel exactly."""

    allgather_bucket_size: int = DEFAULT_BUCKET_NUMEL
    """Elements one chunk of the weight gather moves across *all* ranks."""

    reduce_bucket_size: int = DEFAULT_BUCKET_NUMEL
    """Elements of gradient reduced per collective."""

    overlap_comm: bool = True
    """Stage 2: reduce gradient buckets while backward is still running."""

    reduce_buckets_in_flight: int = 2
    """Bucket reductions that may stay pending in the backward (stage 2) or the step's
    reduction (stage 1): a launch that leaves one more finishes the oldest (the compute stream
    waits there for its collective, then its sum is consumed). Each costs one staging
    buffer of ``reduce_bucket_size`` elements in the reduce dtype (with
    ``zero_quantized_gradients``, also one set of payload buffers); more lets a slow link fall
    further behind a bursty backward before the compute stream waits for it. The bits are the
    same for any value. The default 2 is the bound qzero has always had."""

    reduce_dtype: str | None = None
    """Dtype of the gradient reduction: ``bf16``, ``fp16`` or ``fp32``; None means the
    model's own dtype (what FSDP2 and DeepSpeed users expect)."""

    gradient_clipping: float = 0.0
    """Clip the global gradient norm to this value; 0 disables clipping."""

    loss_scale: float = 0.0
    """fp16 only: a static loss scale, or 0 for dynamic loss scaling."""

    initial_scale_power: int = 16
    """fp16 dynamic scaling starts at ``2**initial_scale_power``."""

    loss_scale_window: int = 1000
    """fp16 dynamic scaling doubles the scale after this many steps without overflow."""

    hysteresis: int = 2
    """fp16 dynamic scaling halves the scale only after this many overflows in a row."""

    min_loss_scale: float = 1.0
    """fp16 dynamic scaling never goes below this; must be > 0."""

    check_finite: bool = True
    """Refuse NaN/Inf before anything is gathered, raising on every rank and naming the
    parameter: non-finite weights never reach the other replicas. With Adam/AdamW (whose
    update is bounded, and which update sliced from the second step) the gradients are
    checked before the update (the global norm: one scalar sync; the update is skipped);
    with other optimizers, the fp32 masters after it (one read of the shard and one
    1-element all-reduce)."""

    overlap_param_gather: bool | None = None
    """Return from ``step()`` before the weight gather finishes and let each module
    wait for its own chunks in its forward (gather-ahead). ``None`` (the default): on
    when the gather is quantized (``zero_quantized_weights``), off for the plain gather;
    resolved to true or false on construction. Code that reads the weights outside a
    module's forward calls ``opt.wait_for_weights()`` first (``model.state_dict()`` and
    everything of the optimizer's own waits by itself)."""

    flat_order: str = "auto"
    """How parameters are placed in the flat buffer: ``contiguous`` (back to back in model
    order, each rank a contiguous stretch of the model), ``interleaved`` (each partition in
    model order, so gather chunks arrive in the order a forward needs them: gather-ahead can
    then hide behind the whole forward instead of its first 1/world, and gradients are
    reduce-scattered window by window, using both directions of the link), or ``auto``
    (interleaved unless that pads more than 3% of the parameters, e.g. when one parameter is
    larger than its fair share of a partition; contiguous then), with flat and two-level
    collectives alike. With ``zero_quantized_gradients`` on more than two ranks the contiguous
    order reduces the gradients in windows of every partition, as the interleaved order does (no
    exchange concentrates on an owner), but those windows complete only at the end of backward:
    the reduction does not overlap backward, and stage 2 stages up to the whole gradient until
    then. That is warned of on every rank, with the padding the interleaved order would take."""

    solo_reduce: bool = False
    """Interleaved order: reduce a parameter that starts a partition and spans several
    reduce windows (the embedding, typically) on its own, to its owner, instead of in the
    windows it shares with the first layers of the other partitions. Its gradient comes
    last in backward, so in windows those layers' gradients stay staged (``world x`` its
    size) until the end of backward, when activations are mostly freed. Alone, it needs no
    staging, but the windows then carry zeros in its place and it crosses the link in one
    direction only: its size again on the link. Off by default: where the link is the
    bottleneck that extra crossing costs whole-step time, and at DP2 the staging does not reach
    the peak. Turn it on where memory binds at the end of backward (the staging grows with the
    world size: ``benchmarks/scripts/plan_report.py`` prints it for a model and world; figures in
    ``BENCHMARKS.md``, *Memory*). Such parameters are reduced
    after every bucket of the backward (the windows' zeros must land before them)."""

    gather_schedule: str = "auto"
    """How the weight gather's chunks are scheduled (the results are the same bits):
    ``streams`` (CUDA only) packs and unpacks on two side streams ordered by events, the
    collective issued from the pack stream, so no collective waits behind the compute
    stream's kernels; ``inline`` packs
    and unpacks on the current stream and launches the collectives asynchronously (the
    only schedule off CUDA); ``auto`` is ``streams`` on CUDA and ``inline`` elsewhere.
    See ``[Note: the gather engine]`` in :mod:`qzero.wire.engine`."""

    gather_lookahead: int = 0
    """Gather-ahead under the ``streams`` schedule: how many chunks beyond the one a forward
    waits for are enqueued by that wait. ``0`` (the default): ``step()`` enqueues every chunk
    when the gather starts, so the next forward carries none of the gather's host work (its
    pre-hooks only make the compute stream wait for events). ``N > 0``: ``step()`` enqueues
    ``N`` chunks and each wait enqueues through ``N`` past the chunk it waits for. Memory is the
    same either way (two receive buffers, reused in stream order). Why 0: launching a chunk costs the host a
    few kernel and collective launches, more inside a forward than in ``step()``; where the
    forward is host-bound (a small model, a fast link) that time lands on the step when it is
    spent inside the forward, while ``step()`` spends it as the device runs the update; where
    the link is the bottleneck the two are the same step (``benchmarks/reports/step-breakdown-4b.md``).
    Set ``N`` where the model runs
    collectives of its own on the data-parallel group inside the forward (SyncBatchNorm, say):
    those queue behind every chunk already enqueued on that group. The inline schedule (off
    CUDA) keeps two chunks in flight either way."""

    sliced_update: bool = True
    """Adam/AdamW, from the second step: update the master shard in slices as the gather
    asks for them (slices double in size, so a step makes a handful of optimizer calls),
    so the first chunks leave before the whole update has run. The bits are those of one
    whole update. Off: one update, then the gather."""

    quant_kernels: str = "auto"
    """Quantization kernels: ``auto`` (the fused Triton kernels on CUDA where Triton is
    installed, the torch reference elsewhere), ``triton`` or ``reference``. Both produce
    the same bytes; ``reference`` is for checking that."""

    zero_quantized_gradients: bool = False
    """Quantize the gradient reduction (DeepSpeed ZeRO++'s key name, here at stages 1 and 2).
    Each rank sends the slices of a gradient bucket that other ranks own as symmetric groups
    (``zero_quantized_gradients_format`` codes and one fp32 scale per group, groups never
    spanning two owners); the owner dequantizes, sums in fp32 in rank order with its own slice
    unquantized, and averages into its fp32 gradient shard. One all-to-all per bucket, with
    the same buckets and backward overlap as the plain reduction. Parameters of at most
    ``small_param_numel`` elements are reduced exactly (sent in ``reduce_dtype`` on the side),
    and a group holding NaN/Inf arrives as NaN, so overflow skipping and ``check_finite``
    still see it. Stage 1 quantizes once per optimizer step; stage 2 once per backward (per
    micro-batch with gradient accumulation: it keeps no full gradient to reduce later).
    Memory: the sums are fp32, so in stage 2 the fp32 gradient shard exists from the
    backward's first reduction; the plain 16-bit reduction keeps them in a landing shard of
    half the bytes until the backward ends ([Note: landing shard] in ``qzero/optim/grads.py``).
    Off: the plain reduction, bit for bit."""

    zero_quantized_gradients_group_size: int | None = None
    """Gradient elements that share one fp32 scale; a positive multiple of 8. ``None`` (the
    default): 256 for ``int4`` (4.125 bits an element), 64 for ``int8`` and ``fp8``; resolved
    on construction."""

    zero_quantized_gradients_format: str = DEFAULT_FORMAT
    """Gradient payload format: ``int8`` (round half to even), ``fp8`` (e4m3) or ``int4`` (round
    half to even, two values a byte, in groups of 256 by default; meant to be used with the
    Hadamard rotation, its default)."""

    zero_quantized_gradients_rotation: str | None = None
    """Rotate every gradient piece before it is quantized: ``hadamard`` (a normalized
    Walsh-Hadamard transform over blocks of ``zero_quantized_gradients_rotation_block``
    elements, undone by the owner once, after its fp32 sum; it spreads an outlier's magnitude
    over its block, so a group's quantization step follows its RMS rather than its largest
    element: [Note: gradient rotation] in ``qzero/quant/gradients.py``) or ``none``. ``None``
    (the default): ``hadamard`` for ``int4``, ``none`` for the 8-bit formats; resolved on
    construction."""

    zero_quantized_gradients_rotation_block: int = DEFAULT_ROTATION_BLOCK
    """Elements of one rotation block: a power of two that divides
    ``zero_quantized_gradients_group_size`` (so a group holds whole blocks). The default 32
    was measured: ``benchmarks/reports/loss-quantized-gradients.md``."""

    zero_quantized_gradients_error_feedback: bool = False
    """Error feedback: each rank keeps what its quantized payloads failed to carry (its
    *residual*: the gradient plus the previous residual, minus what the payload decodes to)
    and adds it to the same elements' next gradient, so the quantization error is carried
    forward instead of lost. The residual is bf16, for every element this rank sends
    (those of the other ranks' partitions): ``2 x (world - 1) / world`` bytes per parameter
    on every rank (1 byte at DP2, 1.75 at DP8). It is optimizer state: saved in checkpoints,
    resharded (to another world size, the residuals of one element are summed and carried by
    one rank), resumed bit-exactly at the same world size. With fp16 loss scaling it is
    rescaled with the loss scale and dropped on a skipped step. Needs
    ``zero_quantized_gradients``."""

    zero_quantized_gradients_intra_node: str = "none"
    """The node stage of the two-level quantized gradient reduction (``hierarchical_collectives``):
    ``none`` (the default) reduce-scatters the bucket inside the node in the reduce dtype, bit for bit
    as without this setting; ``int8`` exchanges it quantized too (int8 codes, one fp32 scale per
    group of ``min(zero_quantized_gradients_group_size, 64)`` elements, no rotation, small parameters
    exact), each rank summing its block in fp32 before the rail stage quantizes that sum: about half
    the node stage's bytes, for one more quantization error (and, per bucket in flight, the node's
    int8 payloads and an fp32 block of ``1/L`` of the bucket). For nodes whose GPUs talk over PCIe;
    NVLink nodes gain little. Needs ``zero_quantized_gradients``, two-level collectives (refused on
    every rank where the collectives are flat) and no error feedback. ``docs/multi-node.md``."""

    copy_engine_collectives: bool = False
    """Run qzero's weight all-gather and quantized gradient all-to-all on the GPU's copy
    engines, with no SMs taken from the forward and backward (NCCL >= 2.28: a second process
    group over the same ranks with the zero-CTA policy, the collectives' buffers in NCCL
    symmetric memory). Needs CUDA, an NCCL process group and a PyTorch with NCCL's CTA policy
    option and symmetric memory; the optimizer refuses it at construction, naming what is
    missing. The bits are the same; the gather's receive buffers (at most one bucket) and the
    all-to-all's payload buffers stay allocated between steps. A plain gradient reduce-scatter
    needs arithmetic and keeps its SMs. See ``docs/copy-engine.md``."""

    ranks_per_node: int = 0
    """Ranks of the data-parallel group on one node (``L``). ``0`` (the default): detected, from
    every rank's host name, cross-checked against ``LOCAL_WORLD_SIZE`` where torchrun sets it.
    Ranks ``i L .. i L + L - 1`` form node ``i`` (torchrun's placement). A value that does not
    divide the world size, differs between ranks, or contradicts the detected hosts is refused on
    every rank; a detected placement that is not node-contiguous (uneven nodes, cyclic placement)
    falls back to the flat collectives with one warning on every rank. On one host, setting it
    declares pseudo-nodes (how the tests build a cluster of gloo ranks). ``docs/multi-node.md``."""

    hierarchical_collectives: str = "auto"
    """Two-level collectives on clusters of several multi-GPU nodes: gradients are
    reduce-scattered inside the node first (in the reduce dtype), then exchanged across nodes
    among the ranks of one *rail* (the ranks with the same local index) on ``1/L`` of the data;
    the weight gather's payload crosses the network once per node (gathered over the rail, then
    inside the node). Each node then sends about ``(n - 1) / n`` of the model's quantized bytes a
    step instead of ``L (n - 1) / n`` of them. Partitions are numbered rail-major (rank
    ``i L + j`` owns partition ``j n + i``) so that each rank's shard is what the two stages leave
    it. ``auto`` (the default): two-level when there is more than one node and more than one rank
    per node; ``true``: two-level wherever the topology has both (refused where it cannot run);
    ``false``: the flat collectives over the whole group, bit for bit as before.
    ``docs/multi-node.md``."""

    def __post_init__(self) -> None:
        if self.overlap_param_gather is None:
            object.__setattr__(self, "overlap_param_gather", self.zero_quantized_weights is True)
        delta = self.zero_quantized_weights_delta is True
        if self.zero_quantized_weights_format is None:
            object.__setattr__(self, "zero_quantized_weights_format", DELTA_FORMAT if delta else DEFAULT_FORMAT)
        if self.zero_quantized_weights_group_size is None:
            object.__setattr__(self, "zero_quantized_weights_group_size",
                               DELTA_GROUP_SIZE if delta else DEFAULT_GROUP_SIZE)
        if self.zero_quantized_gradients_group_size is None:
            object.__setattr__(self, "zero_quantized_gradients_group_size",
                               GRADIENT_GROUP_SIZES.get(self.zero_quantized_gradients_format, DEFAULT_GROUP_SIZE))
        if self.zero_quantized_gradients_rotation is None:
            object.__setattr__(self, "zero_quantized_gradients_rotation",
                               "hadamard" if self.zero_quantized_gradients_format == "int4" else "none")
        if self.stage not in (1, 2) or isinstance(self.stage, bool):
            raise ValueError(f"stage must be 1 or 2, got {self.stage!r} (ZeRO-3 is not what qzero does)")
        for name in ("zero_quantized_weights", "overlap_comm", "overlap_param_gather", "check_finite",
                     "solo_reduce", "sliced_update", "zero_quantized_gradients",
                     "zero_quantized_gradients_error_feedback", "zero_quantized_weights_delta",
                     "copy_engine_collectives"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        check_group_size(self.zero_quantized_weights_group_size, "zero_quantized_weights_group_size")
        try:
            get_format(self.zero_quantized_weights_format)
        except ValueError as e:
            raise ValueError(f"zero_quantized_weights_format: {e}") from None
        self._check_delta()
        self._refuse_moot_weight_settings()  # after the checks of their values: a bad value is named as such
        lookahead = self.gather_lookahead
        if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
            raise ValueError(f"gather_lookahead must be an int >= 0 (0: every chunk enqueued by step()), "
                             f"got {lookahead!r}")
        in_flight = self.reduce_buckets_in_flight
        if isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 1:
            raise ValueError(f"reduce_buckets_in_flight must be a positive int (bucket reductions in flight), "
                             f"got {in_flight!r}")
        if self.gather_schedule not in GATHER_SCHEDULES:
            raise ValueError(f"gather_schedule must be one of {GATHER_SCHEDULES}, got {self.gather_schedule!r}")
        if self.quant_kernels not in KERNELS:
            raise ValueError(f"quant_kernels must be one of {KERNELS}, got {self.quant_kernels!r}")
        check_group_size(self.zero_quantized_gradients_group_size, "zero_quantized_gradients_group_size")
        if self.zero_quantized_gradients_format not in GRADIENT_FORMATS:
            raise ValueError(
                f"zero_quantized_gradients_format must be one of {list(GRADIENT_FORMATS)}, got "
                f"{self.zero_quantized_gradients_format!r}"
            )
        self._check_gradient_rotation()
        self._check_topology()
        self._check_intra_node()
        if self.zero_quantized_gradients_error_feedback and not self.zero_quantized_gradients:
            raise ValueError(
                "zero_quantized_gradients_error_feedback=true needs zero_quantized_gradients=true: error feedback "
                "carries the quantization error of the gradient reduction, and the plain reduction has none"
            )
        if self.flat_order not in FLAT_ORDERS:
            raise ValueError(f"flat_order must be one of {FLAT_ORDERS}, got {self.flat_order!r}")
        for name in ("allgather_bucket_size", "reduce_bucket_size", "small_param_numel", "initial_scale_power",
                     "loss_scale_window", "hysteresis"):
            object.__setattr__(self, name, _as_int(name, getattr(self, name)))
        for name in ("allgather_bucket_size", "reduce_bucket_size", "loss_scale_window", "hysteresis"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        for f in fields(self):  # every count: bounded before anything is sized by it
            value = getattr(self, f.name)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_COUNT:
                shown = f"{value:,}" if value < 10**18 else f"{float(value):.3g}"
                raise ValueError(f"{f.name} must be at most 2**48 ({MAX_COUNT:,}), got {shown}")
        if self.small_param_numel < 0:
            raise ValueError(f"small_param_numel must be >= 0, got {self.small_param_numel!r}")
        if self.allgather_bucket_size < self.zero_quantized_weights_group_size:
            raise ValueError(
                f"allgather_bucket_size {self.allgather_bucket_size} is smaller than one group "
                f"({self.zero_quantized_weights_group_size} elements)"
            )
        if self.reduce_dtype is not None and self.reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"reduce_dtype must be one of {REDUCE_DTYPES} or None, got {self.reduce_dtype!r}")
        for name in ("gradient_clipping", "loss_scale", "min_loss_scale"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.min_loss_scale == 0:  # the dynamic scale halves down to it, and gradients are divided by the scale
            raise ValueError("min_loss_scale must be > 0 (the dynamic loss scale halves down to it and gradients are "
                             f"divided by the scale), got {self.min_loss_scale!r}")
        if not 0 <= self.initial_scale_power <= MAX_SCALE_POWER:
            raise ValueError(
                f"initial_scale_power must be in [0, {MAX_SCALE_POWER}] (the scale must fit fp16 gradients' fp32 "
                f"arithmetic), got {self.initial_scale_power!r}"
            )

    def _check_topology(self) -> None:
        rpn = self.ranks_per_node
        if isinstance(rpn, bool) or not isinstance(rpn, int) or rpn < 0:
            raise ValueError(f"ranks_per_node must be an int >= 0 (0: detect from the hosts), got {rpn!r}")
        h = self.hierarchical_collectives
        if isinstance(h, str) and h.lower() in HIERARCHICAL_CHOICES[1:]:  # "true", "false"
            h = h.lower() == "true"
            object.__setattr__(self, "hierarchical_collectives", h)
        if not isinstance(h, bool) and h != "auto":
            raise ValueError(f"hierarchical_collectives must be 'auto', true or false, got {h!r}")
        if h is True and self.solo_reduce:
            raise ValueError(
                "solo_reduce=true with hierarchical_collectives=true: a solo parameter is reduced to one owner, "
                "which two-level collectives cannot spread over the nodes; set solo_reduce=false")
        if h is True and self.copy_engine_collectives:
            raise ValueError(
                "copy_engine_collectives=true with hierarchical_collectives=true is not supported: the zero-CTA "
                "group spans the whole world; set hierarchical_collectives=false or copy_engine_collectives=false")

    def _check_intra_node(self) -> None:
        value = self.zero_quantized_gradients_intra_node
        if value not in INTRA_NODE_FORMATS:
            raise ValueError(f"zero_quantized_gradients_intra_node must be one of {list(INTRA_NODE_FORMATS)}, "
                             f"got {value!r}")
        if value == "none":
            return
        if not self.zero_quantized_gradients:
            raise ValueError(f"zero_quantized_gradients_intra_node={value!r} needs zero_quantized_gradients=true: "
                             "it quantizes the node stage of the quantized gradient reduction")
        if self.hierarchical_collectives is False:
            raise ValueError(f"zero_quantized_gradients_intra_node={value!r} with hierarchical_collectives=false: "
                             "flat collectives have no node stage; set zero_quantized_gradients_intra_node='none'")
        if self.zero_quantized_gradients_error_feedback:
            raise ValueError(f"zero_quantized_gradients_intra_node={value!r} with "
                             "zero_quantized_gradients_error_feedback=true is not supported (the node stage keeps "
                             "no residuals); set zero_quantized_gradients_error_feedback=false")

    def _refuse_moot_weight_settings(self) -> None:
        """A payload setting of the quantized weight gather given where that gather is off changes
        nothing: refused (a value equal to the default it would resolve to is accepted, so that a
        resolved config, ``to_dict()`` and back, still builds)."""
        if self.zero_quantized_weights is not False:
            return
        delta = self.zero_quantized_weights_delta is True
        defaults = {"zero_quantized_weights_format": DELTA_FORMAT if delta else DEFAULT_FORMAT,
                    "zero_quantized_weights_group_size": DELTA_GROUP_SIZE if delta else DEFAULT_GROUP_SIZE}
        for name, default in defaults.items():
            value = getattr(self, name)
            if value is not None and value != default:
                raise ValueError(f"{name}={value!r} is a setting of the quantized weight gather, which "
                                 "zero_quantized_weights=false leaves off (it would change nothing): set "
                                 "zero_quantized_weights=true, or drop it")

    def _check_gradient_rotation(self) -> None:
        rotation, block = self.zero_quantized_gradients_rotation, self.zero_quantized_gradients_rotation_block
        if rotation not in GRADIENT_ROTATIONS:
            raise ValueError(f"zero_quantized_gradients_rotation must be one of {list(GRADIENT_ROTATIONS)} or None, "
                             f"got {rotation!r}")
        try:
            check_rotation_block(block)
        except ValueError:
            raise ValueError(f"zero_quantized_gradients_rotation_block must be a power of two >= 2, "
                             f"got {block!r}") from None
        group = self.zero_quantized_gradients_group_size
        if rotation == "hadamard" and group % block:
            raise ValueError(
                f"zero_quantized_gradients_rotation_block {block} "
                + ("is larger than" if block > group else "does not divide")
                + f" zero_quantized_gradients_group_size {group}: a group must hold whole rotation blocks"
            )

    def _check_delta(self) -> None:
        name = "zero_quantized_weights_delta_resync_steps"
        k = _as_int(name, getattr(self, name))
        if k < 0:
            raise ValueError(f"{name} must be >= 0 (0: never), got {k!r}")
        object.__setattr__(self, name, k)
        if not self.zero_quantized_weights_delta:
            return
        if not self.zero_quantized_weights:
            raise ValueError(
                "zero_quantized_weights_delta=true needs zero_quantized_weights=true: the differences travel in the "
                "quantized weight gather"
            )
        if self.zero_quantized_weights_format not in DELTA_FORMATS:
            raise ValueError(
                f"zero_quantized_weights_delta=true with zero_quantized_weights_format="
                f"{self.zero_quantized_weights_format!r}: a delta payload carries signed differences as symmetric "
                f"integers with one uniform step per group, one of {list(DELTA_FORMATS)} (the closed loop's bound, "
                "each replica element within one step of its target, rests on that step)"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ZeroConfig:
        """Build from a DeepSpeed ``zero_optimization`` dictionary (unknown keys are refused)."""
        if not isinstance(d, dict):
            raise TypeError(f"expected a dict of zero_optimization settings, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        refuse_renamed_keys(d)
        kwargs = {}
        for key, value in d.items():
            if key in known:
                kwargs[key] = value
            elif key in _DEEPSPEED_FIXED:
                want = _DEEPSPEED_FIXED[key]
                if want is not None and value != want:
                    raise ValueError(f"zero_optimization.{key}={value!r} is not supported: "
                                     f"qzero always behaves as {want!r}")
            elif unsupported_reason(key):
                raise ValueError(f"zero_optimization.{key} is not supported: {unsupported_reason(key)}")
            else:
                close = difflib.get_close_matches(key, [*known, *_DEEPSPEED_FIXED], n=1)
                raise ValueError(f"unknown zero_optimization key {key!r}"
                                 + (f"; did you mean {close[0]}?" if close else "")
                                 + f"; known keys: {sorted(known | set(_DEEPSPEED_FIXED))}")
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def digest(self) -> int:
        """A stable 63-bit fingerprint, compared across ranks at construction."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "little") >> 1


# --------------------------------------------------------------------------- keyword arguments


@functools.lru_cache(maxsize=None)
def _defaults_of(function: Callable) -> dict[str, Any]:
    return {p.name: p.default for p in inspect.signature(function).parameters.values()}


def keyword_settings(function: Callable, given: dict[str, Any], extra: Mapping[str, Any],
                     renamed: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings of a call to ``function``, whose keyword arguments are named as ZeroConfig's
    fields: ``given`` (those arguments, by name) with ``extra`` (the call's other keywords)
    folded in. An extra keyword that is a short name of one of ``given``'s fields
    (:data:`qzero.vocabulary.ZERO_ALIASES`: ``fmt``, ``group_size``, ...) is that field; any other
    is refused with a ``TypeError`` naming the keyword to use (``renamed`` and :data:`RENAMED_KEYS`:
    a former keyword -> its field; else the closest of ``given``'s names)."""
    name = getattr(function, "__qualname__", function.__name__).removesuffix(".__init__")
    defaults = _defaults_of(function)
    out = dict(given)
    for key, value in extra.items():
        full = ZERO_ALIASES.get(key)
        if full in out:
            if out[full] is not defaults.get(full) and out[full] != defaults.get(full):
                raise TypeError(f"{name}() got both {key}= and {full}=: {key} is ZeroConfig's short name of {full}")
            out[full] = value
            continue
        names = [*given, *(short for short, full in ZERO_ALIASES.items() if full in given)]
        hint = {**RENAMED_KEYS, **(renamed or {})}.get(key)
        if hint not in given:
            hint = next(iter(difflib.get_close_matches(key, names, n=1)), None)
        raise TypeError(f"{name}() got an unexpected keyword argument {key!r}"
                        + (f"; did you mean {hint}=? (settings are named as ZeroConfig's fields)" if hint else ""))
    return out

