"""qzero's quantized post-step weight gather inside DeepSpeed ZeRO-1/2.

A DeepSpeed ZeRO-1/2 user adds two keys to ``zero_optimization`` and swaps one import::

    from qzero.integrations.deepspeed import initialize   # instead of deepspeed.initialize

    "zero_optimization": {"stage": 2, "zero_quantized_weights": true,
                          "zero_quantized_weights_group_size": 64, ...}

How it works. After its optimizer step, DeepSpeed's ``DeepSpeedZeroOptimizer`` copies
each rank's updated fp32 master partition into its bf16/fp16 flat group
(``bit16_groups_flat[i]``) and then all-gathers the flat groups through the function
``all_gather_dp_groups`` of its module ``deepspeed.runtime.zero.stage_1_and_2``. That
module-level name is replaced (once, and only when some optimizer enables quantization)
by a dispatcher: a call made on behalf of an optimizer registered here runs qzero's
bounded, quantized gather in place on the same flat groups; every other call goes to
DeepSpeed's own function unchanged.

DeepSpeed's layout is honoured rather than assumed: the plan of every flat group is
built from the parameters' recorded offsets in it (which already reflect round-robin
reordering and alignment padding), partitions are checked to be the equal, contiguous
slices qzero's gather expects (parameters may straddle them), and every group is
gathered over its own data-parallel process group (``real_dp_process_group``: MoE
expert groups have their own). Small parameters (norms, biases) travel exactly.

At ZeRO stage 1 with bf16 weights and fp32 gradient accumulation DeepSpeed builds its
``BF16_Optimizer`` instead, which gathers its flat groups the same way through the
``all_gather_dp_groups`` of its own module; that name is replaced too, and its calls are
dispatched alike (:mod:`.deepspeed_layout` reads both optimizers' flat groups).

With ``zero_quantized_weights`` off, nothing is patched and DeepSpeed runs as it would
without qzero, bit for bit.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
import weakref
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..wire.agreement import digest
from ..wire.comm import QUANTIZABLE_DTYPES, GatherStats, agree_or_raise, local_outcome, plan_fields
from ..wire.engine import CommContext, finish_gather, start_gather
from ..layout.gather_plan import GatherPlan, merge_adjacent
from ..layout.gather_planner import plan_gather
from ..config import ZeroConfig, keyword_settings
from ..vocabulary import RENAMED_GATHER_KEYWORDS
from .deepspeed_layout import KNOWN_OPTIMIZERS, FlatGroups, flat_groups, known_class
from .deepspeed_config import (  # noqa: F401  (re-exported: the adapter's settings and keys)
    ENABLE_KEY,
    GROUP_SIZE_KEY,
    QZERO_KEYS,
    SMALL_PARAM_KEY,
    QuantizedWeightsSettings,
    prepare_config,
)

#: DeepSpeed releases this adapter was tested with (it reads optimizer internals).
SUPPORTED_DEEPSPEED = ">=0.19,<0.20"

__all__ = [
    "SUPPORTED_DEEPSPEED",
    "DeepSpeedGatherReport",
    "QuantizedGather",
    "QuantizedWeightsSettings",
    "disable",
    "enable",
    "initialize",
    "prepare_config",
]
# --------------------------------------------------------------------------- DeepSpeed checks


def check_deepspeed_version(version: str | None = None) -> str:
    """Raise unless the installed DeepSpeed (or ``version``) is in :data:`SUPPORTED_DEEPSPEED`."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    if version is None:
        import deepspeed

        version = deepspeed.__version__
    release = Version(version).base_version  # "0.19.8+abc" and "0.19.9.dev0" count as 0.19.x
    if release not in SpecifierSet(SUPPORTED_DEEPSPEED):
        raise RuntimeError(
            f"DeepSpeed {version} is outside the range qzero's adapter was tested with ({SUPPORTED_DEEPSPEED}); "
            "it patches optimizer internals that change between releases. Install qzero[deepspeed]."
        )
    return version


def find_zero_optimizer(target: Any):
    """The DeepSpeed optimizer behind ``target``: an engine, the optimizer itself, or a
    wrapper holding it in ``.optimizer`` (as Accelerate does). Checked to be one qzero knows."""
    from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer

    obj = target
    for _ in range(8):
        if isinstance(obj, DeepSpeedOptimizer) or not hasattr(obj, "optimizer"):
            break
        obj = obj.optimizer
    _check_optimizer_class(obj)
    return obj


def _check_optimizer_class(opt: Any) -> None:
    if known_class(opt) is not None:
        if getattr(opt, "zenflow", False):
            raise ValueError("ZenFlow is not supported with qzero's quantized weights")
        return
    name = type(opt).__name__
    if "zenflow" in name.lower():
        raise ValueError(f"optimizer {name}: ZenFlow is not supported with qzero's quantized weights")
    if "stage3" in name.lower():
        raise ValueError(
            f"optimizer {name} is ZeRO stage 3: qzero does not patch it (DeepSpeed's own "
            f"{ENABLE_KEY} applies at stage 3)"
        )
    known = " and ".join(cls for _, cls in KNOWN_OPTIMIZERS)
    raise ValueError(
        f"optimizer class {type(opt).__module__}.{name} is not supported: qzero replaces the post-step "
        f"weight gather of DeepSpeed's {known} (ZeRO stage 1 or 2 with bf16/fp16) only"
    )


def _check_optimizer_state(layout: FlatGroups) -> None:
    # CPU optimizer offload needs nothing of its own: DeepSpeed's CPU update copies each rank's
    # bf16/fp16 partition back into the device's flat group (on the current stream) before it
    # calls the gather, exactly where the update without offload writes it.
    for i, flat in enumerate(layout.flats):
        if flat.dtype not in QUANTIZABLE_DTYPES:
            raise ValueError(
                f"parameter group {i} has a {flat.dtype} flat buffer: qzero quantizes bf16/fp16 flat groups only "
                "(an fp32 gather has nothing to gain and would lose precision); enable bf16 or fp16"
            )


# --------------------------------------------------------------------------- layout of one flat group


def exact_ranges_of(offsets, numels, small_param_numel: int) -> list[tuple[int, int]]:
    """Flat ranges of the parameters with at most ``small_param_numel`` elements,
    sorted, with touching ranges merged."""
    return merge_adjacent(sorted((int(o), int(o) + int(n)) for o, n in zip(offsets, numels)
                                 if 0 < int(n) <= small_param_numel))


def _check_partitions(flat: torch.Tensor, partitions, world: int, index: int) -> None:
    """DeepSpeed's partitions must be the ``world`` equal contiguous slices of ``flat``, in rank order."""
    where = f"DeepSpeed parameter group {index}"
    if not flat.is_contiguous() or flat.dim() != 1:
        raise RuntimeError(f"{where}: the flat group is not a 1-D contiguous tensor")
    if flat.numel() % world:
        raise RuntimeError(f"{where}: flat numel {flat.numel()} is not divisible by its data-parallel size {world}")
    if len(partitions) != world:
        raise RuntimeError(f"{where}: {len(partitions)} partitions for a data-parallel size of {world}")
    p = flat.numel() // world
    base = flat.data_ptr()
    for r, part in enumerate(partitions):
        if part.numel() != p or part.data_ptr() != base + r * p * flat.element_size():
            raise RuntimeError(
                f"{where}: partition {r} is not elements [{r * p}, {(r + 1) * p}) of the flat group; "
                "this DeepSpeed layout is not one qzero knows"
            )


def _check_param_spans(offsets, numels, flat_numel: int, index: int) -> None:
    stop = 0
    for o, n in sorted(zip(offsets, numels)):
        if o < stop or o + n > flat_numel:
            raise RuntimeError(
                f"DeepSpeed parameter group {index}: parameter at [{o}, {o + n}) overlaps another "
                f"or runs past the flat group of {flat_numel} elements"
            )
        stop = o + n


class GroupGather(NamedTuple):
    """The static plan of one flat group and the process group it is gathered over."""

    index: int
    process_group: Any
    plan: GatherPlan


def _plan_group(layout: FlatGroups, index: int,
                settings: QuantizedWeightsSettings) -> tuple[GroupGather, dict[str, int]]:
    flat = layout.flats[index]
    group = layout.process_groups[index]
    world = dist.get_world_size(group)
    _check_partitions(flat, layout.partitions[index], world, index)
    offsets, numels = layout.offsets[index], layout.numels[index]
    _check_param_spans(offsets, numels, flat.numel(), index)
    exact = exact_ranges_of(offsets, numels, settings.small_param_numel)
    bucket = settings.allgather_bucket_size
    plan = plan_gather(
        flat.numel(),
        world,
        elem_size=flat.element_size(),
        allgather_bucket_size=bucket if bucket is not None else layout.allgather_bucket_size,
        zero_quantized_weights_format=settings.zero_quantized_weights_format,
        zero_quantized_weights_group_size=settings.zero_quantized_weights_group_size,
        exact_ranges=exact,
    )
    return GroupGather(index, group, plan), _fields(plan, flat.dtype, settings)


def _fields(plan: GatherPlan, dtype: torch.dtype, settings: QuantizedWeightsSettings) -> dict[str, int]:
    """What every rank of a group must agree on, as integers: the plan's, the threshold, gather-ahead."""
    return {**plan_fields(plan, dtype), "small_param_numel": settings.small_param_numel,
            "overlap_param_gather": int(settings.overlap_param_gather), "gather_lookahead": settings.gather_lookahead}


# --------------------------------------------------------------------------- the replacement gather


class DeepSpeedGatherReport(NamedTuple):
    """What the adapter's last gather moved (counted as it ran, never from the settings):
    elements of the flat groups it quantized and sent exactly, and per-rank bytes."""

    calls: int
    quantized_elements: int
    exact_elements: int
    bytes_sent: int
    plain_bytes: int

    def summary(self) -> str:
        if not self.calls:
            return "qzero DeepSpeed adapter: no gather has run through qzero yet"
        ratio = self.bytes_sent / self.plain_bytes if self.plain_bytes else 1.0
        return (f"qzero DeepSpeed adapter: {self.calls} gather(s); the last sent {self.quantized_elements} elements "
                f"quantized and {self.exact_elements} exactly, {self.bytes_sent} bytes per rank ({ratio:.2f} of plain)")


class QuantizedGather:
    """Replaces one DeepSpeed ZeRO-1/2 optimizer's post-step gather; records what it moved.

    ``calls`` counts gathers run; ``last_stats`` has one :class:`~qzero.GatherStats` per
    gathered flat group (per-rank bytes of the last gather); ``bytes_sent`` and
    ``plain_bytes`` are per-rank totals over all calls; :meth:`report` says what the last
    gather carried quantized. Under gather-ahead, ``wiring`` holds
    the hooks that make reads of the weights wait (:mod:`.deepspeed_ahead`);
    :meth:`wait_for_weights` finishes a running gather by hand.
    """

    def __init__(self, optimizer, settings: QuantizedWeightsSettings, error: Exception | None = None):
        """``error``: this rank's failure before planning, raised on every rank of the first
        flat group's process group (the agreement) instead of planning."""
        self.settings = settings
        self.wiring = None
        layout = flat_groups(optimizer)
        self.groups_flat = layout.flats  # the very list DeepSpeed passes to its gather
        self.groups: list[GroupGather | None] = []
        self.calls = 0
        self.bytes_sent = 0
        self.plain_bytes = 0
        self.last_stats: tuple[GatherStats, ...] = ()
        self._last_elements = (0, 0)  # (quantized, exact) elements of the last gather
        for index in range(len(self.groups_flat)):
            self.groups.append(self._plan_agreed(layout, index, error))
        if error is not None:
            raise error  # no flat group has peers to tell
        # The streams and kernels of the gathers (DeepSpeed's flat groups share one device).
        self.context = (CommContext(self.groups_flat[0].device, lookahead=settings.gather_lookahead)
                        if self.groups_flat else None)
        _warn_if_no_saving(self.plans)

    def _plan_agreed(self, layout: FlatGroups, index: int, error: Exception | None = None) -> GroupGather | None:
        """Plan group ``index`` and make every rank of its process group agree on the plan."""
        group = layout.process_groups[index]
        world = dist.get_world_size(group)
        if world == 1:
            return None  # nothing to gather, as in DeepSpeed
        planned = fields = None
        if error is None:
            result, error = local_outcome(lambda: _plan_group(layout, index, self.settings))
            planned, fields = result if result is not None else (None, None)
        agree_or_raise(group, world, self.groups_flat[index].device, error, fields, "qzero DeepSpeed adapter")
        return planned

    @property
    def plans(self) -> tuple[GatherPlan | None, ...]:
        return tuple(g.plan if g is not None else None for g in self.groups)

    def owns(self, groups_flat) -> bool:
        return groups_flat is self.groups_flat

    def report(self) -> DeepSpeedGatherReport:
        """What the last gather carried (see :class:`DeepSpeedGatherReport`)."""
        return DeepSpeedGatherReport(self.calls, *self._last_elements, sum(s.bytes_sent for s in self.last_stats),
                            sum(s.plain_bytes for s in self.last_stats))

    def wait_for_weights(self) -> None:
        """Finish a gather still running under gather-ahead (a no-op otherwise)."""
        if self.wiring is not None:
            self.wiring.wait()

    def __call__(self, groups_flat, dp_process_group) -> None:
        self.wait_for_weights()
        # Only the gather at the end of the optimizer step runs ahead (not the one after a load).
        ahead = self.wiring is not None and self.wiring.stepping
        stats, quantized, exact = [], 0, 0
        for g, flat, group in zip(self.groups, groups_flat, dp_process_group):
            if g is None:
                continue
            self._check_call(g, flat, group)
            small = sum(b - a for a, b in g.plan.exact_ranges)
            exact += small
            quantized += g.plan.numel - small
            handle = start_gather(flat, g.plan, g.process_group, self.context, ahead=ahead)
            if ahead:
                self.wiring.ahead.start(g.index, handle)
                stats.append(handle.stats)
            else:
                stats.append(finish_gather(handle))
        self.calls += 1
        self.bytes_sent += sum(s.bytes_sent for s in stats)
        self.plain_bytes += sum(s.plain_bytes for s in stats)
        self.last_stats = tuple(stats)
        self._last_elements = (quantized, exact)

    @staticmethod
    def _check_call(g: GroupGather, flat: torch.Tensor, group) -> None:
        if group is not g.process_group:
            raise RuntimeError(
                f"DeepSpeed parameter group {g.index}: its data-parallel process group changed after qzero "
                "planned the gather; call qzero.integrations.deepspeed.enable() again"
            )
        if flat.numel() != g.plan.numel or flat.element_size() != g.plan.elem_size or not flat.is_contiguous():
            raise RuntimeError(
                f"DeepSpeed parameter group {g.index}: the flat group changed shape or dtype after qzero "
                "planned the gather; call qzero.integrations.deepspeed.enable() again"
            )


def _warn_if_no_saving(plans) -> None:
    """A buffer made mostly of small (exact) parameters sends more than the plain gather."""
    sent = sum(p.bytes_per_rank for p in plans if p is not None)
    plain = sum(p.plain_bytes_per_rank for p in plans if p is not None)
    if plain and sent >= plain:
        warnings.warn(
            f"qzero's quantized gather would send {sent} bytes per rank per step, not less than the plain "
            f"gather's {plain}: most parameters are at or below the small-parameter threshold and travel "
            f"exactly; lower {SMALL_PARAM_KEY} or leave {ENABLE_KEY} off",
            stacklevel=3,
        )


# --------------------------------------------------------------------------- dispatch


# id(groups_flat list) -> its QuantizedGather. The optimizer holds the gather
# (``optimizer.qzero_gather``), so an entry disappears with its optimizer.
_REGISTRY: weakref.WeakValueDictionary[int, QuantizedGather] = weakref.WeakValueDictionary()
_ORIGINAL: dict[str, Any] = {}


def _gather_modules():
    """The DeepSpeed modules whose ``all_gather_dp_groups`` the known optimizers call."""
    import importlib

    return [importlib.import_module(module) for module, _ in KNOWN_OPTIMIZERS]


def _dispatching_for(module_name: str):
    """The stand-in for ``all_gather_dp_groups`` inside DeepSpeed's module ``module_name``."""

    def _dispatching_gather(groups_flat, partitioned_param_groups, dp_process_group, *args, **kwargs):
        gather = _REGISTRY.get(id(groups_flat))
        if gather is not None and gather.owns(groups_flat):
            return gather(groups_flat, dp_process_group)
        return _ORIGINAL[module_name](groups_flat, partitioned_param_groups, dp_process_group, *args, **kwargs)

    _dispatching_gather.qzero_dispatcher = True
    return _dispatching_gather


def _install() -> None:
    for module in _gather_modules():
        if not getattr(module.all_gather_dp_groups, "qzero_dispatcher", False):
            _ORIGINAL[module.__name__] = module.all_gather_dp_groups
            module.all_gather_dp_groups = _dispatching_for(module.__name__)


def _uninstall_if_unused() -> None:
    if _REGISTRY:
        return
    for module in _gather_modules():
        if getattr(module.all_gather_dp_groups, "qzero_dispatcher", False):
            module.all_gather_dp_groups = _ORIGINAL.pop(module.__name__)


def is_patched() -> bool:
    """Whether DeepSpeed's ZeRO-1/2 gathers currently go through qzero's dispatcher."""
    return all(getattr(m.all_gather_dp_groups, "qzero_dispatcher", False) for m in _gather_modules())


# --------------------------------------------------------------------------- public API


def enable(
    target: Any,
    *,
    zero_quantized_weights_group_size: int | None = ZeroConfig.zero_quantized_weights_group_size,
    zero_quantized_weights_format: str | None = ZeroConfig.zero_quantized_weights_format,
    small_param_numel: int = ZeroConfig.small_param_numel,
    allgather_bucket_size: int | None = None,
    overlap_param_gather: bool = False,
    gather_lookahead: int = 0,
    model: torch.nn.Module | None = None,
    **short,
) -> QuantizedGather:
    """Quantize the post-step weight gather of an existing DeepSpeed ZeRO-1/2 engine.

    The settings are :class:`qzero.ZeroConfig`'s, by name, default and check (its short names
    ``fmt`` and ``group_size`` are taken too; another keyword raises ``TypeError`` naming the
    one to use, e.g. ``allgather_bucket_size=`` of earlier releases), except two defaults:
    ``allgather_bucket_size`` None is DeepSpeed's own (the key of that name in its config), and
    ``overlap_param_gather`` is off unless asked for.

    ``target`` is the engine, its optimizer, or a wrapper holding it in ``.optimizer``.
    Collective: call it on every rank. Calling it again replaces the settings. The
    returned :class:`QuantizedGather` (also ``engine.qzero_gather`` and
    ``optimizer.qzero_gather``) records what each gather moved.

    ``overlap_param_gather``: gather-ahead (see :mod:`qzero.integrations.deepspeed_ahead`).
    It hooks the model's modules: the model is ``target.module`` when ``target`` is the
    engine, else ``model`` (the module the engine trains) must be given.
    """
    # Without DeepSpeed's optimizer there are no process groups to agree over: that error is local.
    opt = find_zero_optimizer(target)

    def prepare():  # every other check is agreed on ([Note: agreement]): one rank's error raises on all
        settings = QuantizedWeightsSettings(**keyword_settings(enable, dict(
            zero_quantized_weights_group_size=zero_quantized_weights_group_size,
            zero_quantized_weights_format=zero_quantized_weights_format, small_param_numel=small_param_numel,
            allgather_bucket_size=allgather_bucket_size, overlap_param_gather=overlap_param_gather,
            gather_lookahead=gather_lookahead), short,
            RENAMED_GATHER_KEYWORDS))
        check_deepspeed_version()
        _check_optimizer_state(flat_groups(opt))
        engine = target if isinstance(target, torch.nn.Module) and isinstance(target._modules.get("module"),
                                                                              torch.nn.Module) else None
        trained = engine._modules["module"] if model is None and engine is not None else model
        if settings.overlap_param_gather and not isinstance(trained, torch.nn.Module):
            raise ValueError(
                "overlap_param_gather=True needs the model the engine trains, to hook its modules: pass the engine "
                f"as target or model=..., got model={trained!r}"
            )
        if settings.overlap_param_gather:  # refuse a model that is not the engine's before anything changes
            from .deepspeed_ahead import model_ranges

            model_ranges(opt, trained)
        return settings, engine, trained

    prepared, error = local_outcome(prepare)
    settings, engine, model = prepared if prepared is not None else (None, None, model)
    gather = QuantizedGather(opt, settings, error)
    _unregister(opt)
    if settings.overlap_param_gather:
        from .deepspeed_ahead import AheadWiring

        gather.wiring = AheadWiring(gather, opt, model, engine)
    opt.qzero_gather = gather
    _REGISTRY[id(gather.groups_flat)] = gather
    _install()
    if isinstance(target, torch.nn.Module):
        target.qzero_gather = gather
    return gather


def disable(target: Any) -> None:
    """Give the optimizer behind ``target`` DeepSpeed's own gather back."""
    opt = find_zero_optimizer(target)
    _unregister(opt)
    if isinstance(target, torch.nn.Module) and hasattr(target, "qzero_gather"):
        del target.qzero_gather
    _uninstall_if_unused()


def _unregister(opt) -> None:
    old = getattr(opt, "qzero_gather", None)
    if old is not None:
        if old.wiring is not None:  # finish its gather and take its hooks off
            old.wiring.remove()
            old.wiring = None
        if _REGISTRY.get(id(old.groups_flat)) is old:
            del _REGISTRY[id(old.groups_flat)]
        del opt.qzero_gather


def initialize(*args, **kwargs):
    """``deepspeed.initialize`` with qzero's quantized post-step weight gather.

    Same arguments and return value (``engine, optimizer, dataloader, lr_scheduler``).
    The config (``config=``, ``config_params=`` or ``args.deepspeed_config``; a dict or a
    path) is read for ``zero_optimization.zero_quantized_weights`` and qzero's keys
    ``zero_quantized_weights_group_size`` / ``_format`` and ``small_param_numel`` (ZeroConfig's
    field names), which are removed from a copy before DeepSpeed validates it, as is
    ``overlap_param_gather`` (gather-ahead; off unless true). At ZeRO stage 1 or 2 with
    quantization on, the engine's post-step gather is replaced; at stage 2 with
    ``zero_quantized_gradients`` (and its qzero keys), the optimizer's gradient reduction is
    replaced too (:mod:`.deepspeed_grads`); otherwise nothing is.
    """
    import deepspeed

    call = _by_name(args, kwargs)
    config, source = _find_config(call)
    if config is None:  # DeepSpeed will complain about the missing config itself
        return deepspeed.initialize(**call)

    def prepare():
        prepared = prepare_config(_load_config(config))
        if prepared.quantize:
            check_deepspeed_version()
        return prepared

    # [Note: agreement]: a config one rank rejects, or quantization on some ranks only, raises on
    # every rank, before deepspeed.initialize (whose collectives the others would wait in) where
    # a process group exists already, else right after it.
    prepared, error = local_outcome(prepare)
    agreed = dist.is_available() and dist.is_initialized()
    if agreed:
        _agree_on_config(prepared, error)
    elif error is not None:
        raise error
    _put_config(call, source, prepared.ds_config)
    result = deepspeed.initialize(**call)
    if not agreed:
        _agree_on_config(prepared, None)
    if prepared.quantize:
        engine = result[0]
        s = prepared.settings
        enable(engine, **dataclasses.asdict(s))
    if prepared.gradients is not None:
        _install_gradient_reduction(result[0], prepared.gradients, prepared.topology)
    return result


def _install_gradient_reduction(engine, settings, topology=(0, "auto")) -> None:
    """Replace the engine's ZeRO-2 gradient reduction (:mod:`.deepspeed_grads`); an optimizer
    one rank cannot take, or a data-parallel group across several nodes of several ranks
    (``topology``: ``(ranks_per_node, hierarchical_collectives)``), raises on every rank, with
    nothing installed."""
    from ..wire.comm import agreement_device
    from ..wire.two_level import exchange_hosts
    from . import deepspeed_grads

    opt = engine.optimizer
    world = dist.get_world_size()
    # every rank's host, over the world, before anything local can fail: no rank waits for another
    hosts = exchange_hosts(None, world, agreement_device(None, None))

    def check():
        deepspeed_grads.check_optimizer(opt)
        deepspeed_grads.check_topology(opt, hosts, *topology)

    _, error = local_outcome(check)
    agree_or_raise(None, dist.get_world_size(), None, error, {"zero_quantized_gradients": 1},
                   "qzero.integrations.deepspeed.initialize")
    deepspeed_grads.install(opt, settings)


#: ``deepspeed.initialize``'s parameters in order (DeepSpeed 0.19). Arguments are bound to
#: these names, not to ``inspect.signature(deepspeed.initialize)``: whatever wrapped that
#: function (a profiler, a test harness) may show ``(*args, **kwargs)`` instead.
INITIALIZE_PARAMETERS = ("args", "model", "optimizer", "model_parameters", "training_data", "lr_scheduler",
                         "distributed_port", "mpu", "dist_init_required", "collate_fn", "config", "mesh_param",
                         "config_params")


def _by_name(args: tuple, kwargs: dict) -> dict:
    """``initialize``'s arguments as keywords of :data:`INITIALIZE_PARAMETERS` (others kept
    as given, for DeepSpeed to judge). Raises ``TypeError`` as a call would."""
    if len(args) > len(INITIALIZE_PARAMETERS):
        raise TypeError(f"initialize() takes at most {len(INITIALIZE_PARAMETERS)} positional arguments "
                        f"({len(args)} given)")
    call = dict(zip(INITIALIZE_PARAMETERS, args))
    twice = sorted(set(call) & set(kwargs))
    if twice:
        raise TypeError(f"initialize() got multiple values for argument {twice[0]!r}")
    call.update(kwargs)
    return call


def _agree_on_config(prepared, error: Exception | None) -> None:
    fields = None
    if error is None:
        from .deepspeed_grads import agreement_fields

        rpn, hierarchical = prepared.topology
        fields = {ENABLE_KEY: int(prepared.quantize), **agreement_fields(prepared.gradients), "ranks_per_node": rpn,
                  "hierarchical_collectives": digest(str(hierarchical).lower())}
    agree_or_raise(None, dist.get_world_size(), None, error, fields, "qzero.integrations.deepspeed.initialize")


def _find_config(call: dict) -> tuple[Any, str | None]:
    """The config the user passed, and where: ``config``, ``config_params`` or ``args``."""
    if call.get("config") is not None:
        return call["config"], "config"
    if call.get("config_params") is not None:
        return call["config_params"], "config_params"
    args = call.get("args")
    for attr in ("deepspeed_config", "deepscale_config"):
        if getattr(args, attr, None) is not None:
            return getattr(args, attr), attr
    return None, None


def _load_config(config: Any) -> dict:
    if isinstance(config, dict):
        return config
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    return load_ds_config(config)


def _put_config(call: dict, source: str, ds_config: dict) -> None:
    """Hand DeepSpeed the prepared copy in ``config=`` (never touching the user's objects)."""
    if source in ("deepspeed_config", "deepscale_config"):
        args = copy.copy(call["args"])
        setattr(args, source, None)
        call["args"] = args
    call.pop("config_params", None)
    call["config"] = ds_config
