"""qzero's vocabulary of settings: ZeroConfig's short names, and the values settings take.

[Note: vocabulary]
A setting has one name everywhere: its :class:`qzero.ZeroConfig` field name (the DeepSpeed
``zero_optimization`` key, the FSDP2 installers' keyword argument, the ``qzero`` command's
flag with ``-`` for ``_``, the ``KEY=VALUE`` of an arm). :data:`ZERO_ALIASES` is the one table
of shorter names, accepted where settings are typed by hand (``KEY=VALUE`` arms, the gather
installers' keywords) and nowhere else; records and reports use ZeroConfig's own names.
Each enumeration of values is defined here once, and everything that names one of them
(ZeroConfig's checks, the format table, the kernel dispatch, the command's choices, the bench
scripts) imports it. A module of its own, free of torch, so that ``qzero --help`` lists them
without importing it.

A name of an earlier release is refused by name, never accepted silently nor answered with
Python's bare "unexpected keyword argument": the keyword arguments of the public gathers and
planners (:data:`RENAMED_GATHER_KEYWORDS`, through :func:`refuse_renamed`), the workload's
settings (:data:`RENAMED_SETTINGS`), ``zero_optimization`` keys
(:data:`qzero.config.RENAMED_KEYS`) and the command's flags (``qzero.app.cli.RENAMED_FLAGS``)
each raise an error naming the name that replaced it.
"""

import functools
import inspect

#: Short names of ZeroConfig fields.
ZERO_ALIASES = {
    "quantized": "zero_quantized_weights",
    "overlap": "overlap_param_gather",
    "fmt": "zero_quantized_weights_format",
    "group_size": "zero_quantized_weights_group_size",
    "allgather_bucket": "allgather_bucket_size",
    "reduce_bucket": "reduce_bucket_size",
}

#: Keyword arguments of the public gathers and planners in earlier releases (``qzero.all_gather``,
#: ``qzero.quantized_all_gather``, ``qzero.plan_gather``, ``qzero.plan_flat_layout``, the DeepSpeed
#: adapter), and the ZeroConfig fields that replaced them. Each function refuses those whose new
#: name it takes (:func:`refuse_renamed`): ``qzero.all_gather`` has no format, so ``fmt=`` is
#: Python's unknown keyword there.
RENAMED_GATHER_KEYWORDS = {
    "bucket_numel": "allgather_bucket_size",
    "fmt": "zero_quantized_weights_format",
    "group_size": "zero_quantized_weights_group_size",
    "delta": "zero_quantized_weights_delta",
    "order": "flat_order",
    "zero_quantized_weights_small_param_numel": "small_param_numel",
}
#: Settings of the ``qzero`` command's workload in earlier releases (``TrainSettings`` fields,
#: ``KEY=VALUE`` arms), and the names that replaced them ("engine" is qzero's gather engine,
#: ``qzero.wire.engine``; what trains is a backend, one of :data:`BACKENDS`).
RENAMED_SETTINGS = {"engine": "backend"}


def refuse_renamed(**renamed: str):
    """Decorate a function (or a class: its ``__init__``) so that a call with a keyword of
    ``renamed`` (``old="new"``) raises ``TypeError`` naming the keyword that replaced it, before
    the function runs. Only the entries whose new name is one of the function's parameters
    apply (one table serves several functions); the others' old names stay Python's unknown
    keywords. The signature is the function's own (``inspect.signature`` reads it); the table
    that applies is the wrapper's ``renamed_keywords``."""

    def decorate(target):
        function = target.__init__ if isinstance(target, type) else target
        name = getattr(target, "__qualname__", function.__name__)
        taken = inspect.signature(function).parameters
        renamed_here = {old: new for old, new in renamed.items() if new in taken}

        @functools.wraps(function)
        def call(*args, **kwargs):
            for old in kwargs:
                if old in renamed_here:
                    new = renamed_here[old]
                    raise TypeError(f"{name}() got an unexpected keyword argument {old!r}; did you mean "
                                    f"{new}=? ({old} of earlier releases is now {new})")
            return function(*args, **kwargs)

        call.renamed_keywords = renamed_here
        if isinstance(target, type):
            target.__init__ = call
            return target
        return call

    return decorate


#: Payload formats of the weight gather (``ZeroConfig.zero_quantized_weights_format``); the
#: format table :data:`qzero.quant.formats.FORMATS` describes each, in this order.
WEIGHT_FORMATS = ("int8", "fp8", "int4")
#: Formats of a delta payload (``zero_quantized_weights_delta``): symmetric integers with one
#: uniform step per group ([Note: delta payload] in :mod:`qzero.quant.reference`).
DELTA_FORMATS = ("int4", "int8")
#: Formats the gradient reduction can be quantized to (``zero_quantized_gradients_format``).
GRADIENT_FORMATS = ("int8", "fp8", "int4")
#: Rotations applied to gradient pieces before they are quantized (``zero_quantized_gradients_rotation``).
GRADIENT_ROTATIONS = ("hadamard", "none")
#: Formats of the node stage of a two-level quantized gradient reduction
#: (``zero_quantized_gradients_intra_node``): ``none`` reduces it plainly in the reduce dtype.
INTRA_NODE_FORMATS = ("none", "int8")
#: The largest group of the quantized node stage (int8's default gradient group).
INTRA_NODE_GROUP_SIZE = 64
#: Dtypes of the gradient reduction (``ZeroConfig.reduce_dtype``).
REDUCE_DTYPES = ("bf16", "fp16", "fp32")
#: Dtypes of a model's weights that the quantized gather and the training command take (the
#: flat buffer's; the Triton kernels read and write these).
PRECISIONS = ("bf16", "fp16")
#: Quantization kernels (``ZeroConfig.quant_kernels``).
KERNELS = ("auto", "triton", "reference")
#: Schedules of the weight gather's chunks (``ZeroConfig.gather_schedule``).
GATHER_SCHEDULES = ("auto", "streams", "inline")
#: Orders of parameters in the flat buffer (``ZeroConfig.flat_order``).
FLAT_ORDERS = ("auto", "contiguous", "interleaved")
#: ``ZeroConfig.hierarchical_collectives``: two-level collectives on several multi-rank nodes.
HIERARCHICAL_CHOICES = ("auto", "true", "false")
#: ``qzero plan --nic``: one NIC per node shared by its GPUs, or one per GPU (a rail).
NICS = ("shared", "rail")
#: The training backends qzero runs and compares: its own optimizer, DeepSpeed with qzero's
#: adapter, and PyTorch FSDP2 with ``qzero.fsdp`` (what ``qzero train`` and ``qzero qualify`` run).
BACKENDS = ("qzero", "deepspeed", "fsdp2")
#: The values of each ZeroConfig field that takes one of a few names (besides None where its type
#: allows it): the ``qzero`` command's choices and ``docs/settings.md`` read them from here.
SETTING_VALUES = {
    "zero_quantized_weights_format": WEIGHT_FORMATS,
    "reduce_dtype": REDUCE_DTYPES,
    "flat_order": FLAT_ORDERS,
    "gather_schedule": GATHER_SCHEDULES,
    "quant_kernels": KERNELS,
    "zero_quantized_gradients_format": GRADIENT_FORMATS,
    "zero_quantized_gradients_rotation": GRADIENT_ROTATIONS,
    "zero_quantized_gradients_intra_node": INTRA_NODE_FORMATS,
    "hierarchical_collectives": HIERARCHICAL_CHOICES,
}
