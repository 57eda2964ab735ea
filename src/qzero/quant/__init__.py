"""Group-wise quantization: formats, the torch reference (the spec), and kernel dispatch.

:func:`kernels_for` picks the kernel set ([Note: kernel set] in :mod:`qzero.quant.kernel_set`):
the fused Triton kernels for CUDA tensors when they are available and the torch reference
everywhere else; both produce the same bytes.
"""

from __future__ import annotations

import torch

from ..vocabulary import KERNELS
from .formats import FORMATS, SCALE_BYTES, QuantFormat, check_group_size, get_format
from .kernel_set import REFERENCE_KERNELS, GatherKernels, GradientKernels
from .reference import dequantize, quantize

__all__ = [
    "FORMATS",
    "GatherKernels",
    "GradientKernels",
    "REFERENCE_KERNELS",
    "SCALE_BYTES",
    "QuantFormat",
    "check_group_size",
    "dequantize",
    "get_format",
    "gradient_kernels_for",
    "kernels_for",
    "KERNELS",
    "quantize",
]




def _triton_kernels():
    """The default Triton kernel set, or None where Triton cannot run."""
    try:
        from .triton import AVAILABLE, DEFAULT_KERNELS
    except ImportError:
        return None
    return DEFAULT_KERNELS if AVAILABLE else None


def kernels_for(device: torch.device, choice="auto"):
    """The kernel set ([Note: kernel set] in :mod:`qzero.quant.kernel_set`) that serves tensors
    on ``device``: its :class:`~qzero.quant.kernel_set.GatherKernels` methods pack and unpack the
    gather's payloads, its :class:`~qzero.quant.kernel_set.GradientKernels` methods the gradient
    reduction's.

    ``auto``: the fused Triton kernels for CUDA tensors where Triton is installed, the
    torch reference everywhere else; ``reference``: the torch reference; ``triton``: the
    Triton kernels, refused where they cannot run. A kernel set (an object satisfying both
    protocols, e.g. a :class:`qzero.quant.triton.TritonKernels` of another tuning) is used as it
    is. All produce the same bytes.
    """
    if not isinstance(choice, str) and isinstance(choice, GatherKernels) and isinstance(choice, GradientKernels):
        return choice
    if not isinstance(choice, str) or choice not in KERNELS:
        raise ValueError(f"quantization kernels must be one of {KERNELS} or a kernel set, got {choice!r}")
    if choice == "reference":
        return REFERENCE_KERNELS
    triton = _triton_kernels()
    if choice == "triton":
        if triton is None:
            raise ValueError("quantization kernels 'triton' were asked for, but Triton is not installed "
                             "or cannot run here")
        return triton
    return triton if device.type == "cuda" and triton is not None else REFERENCE_KERNELS


#: The gradient reduction picks its kernels as the gather does (one kernel set serves both).
gradient_kernels_for = kernels_for
