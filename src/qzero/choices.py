"""The values qzero's settings take, each enumeration defined once.

Everything that names one of these values (``ZeroConfig``'s checks, the format table, the
kernel dispatch, the ``qzero`` command's choices, the bench scripts) imports it from here. A
module of its own, free of torch, so that ``qzero --help`` can list the choices without
importing it.
"""

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
#: The training backends qzero runs and compares: its own optimizer, DeepSpeed with qzero's
#: adapter, and PyTorch FSDP2 with ``qzero.fsdp`` (what ``qzero train`` and ``qzero qualify`` run).
BACKENDS = ("qzero", "deepspeed", "fsdp2")
