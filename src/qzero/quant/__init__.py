"""Group-wise quantization: formats, the torch reference (the spec), and kernel dispatch.

``pack_payload`` / ``unpack_payload`` pick the fused Triton kernels for CUDA
tensors when they are available and the torch reference everywhere else; both
produce the same bytes.
"""

from __future__ import annotations

import torch

from . import reference
from .formats import FORMATS, SCALE_BYTES, QuantFormat, check_group_size, get_format
from .reference import dequantize, quantize

__all__ = [
    "FORMATS",
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
    try:
        from . import triton as triton_kernels
    except ImportError:
        return None
    return triton_kernels if triton_kernels.AVAILABLE else None


KERNELS = ("auto", "triton", "reference")


def kernels_for(device: torch.device, choice: str = "auto"):
    """The module whose ``pack_payload``/``unpack_payload`` serve tensors on ``device``.

    ``auto``: the fused Triton kernels for CUDA tensors where Triton is installed, the
    torch reference everywhere else; ``reference``: the torch reference; ``triton``: the
    Triton kernels, refused where they cannot run. All produce the same bytes.
    """
    if choice not in KERNELS:
        raise ValueError(f"quantization kernels must be one of {KERNELS}, got {choice!r}")
    if choice == "reference":
        return reference
    mod = _triton_kernels()
    if choice == "triton":
        if mod is None:
            raise ValueError("quantization kernels 'triton' were asked for, but Triton is not installed or cannot run here")
        return mod
    if device.type == "cuda" and mod is not None:
        return mod
    return reference


def _gradient_triton_kernels():
    try:
        from . import gradients_triton
    except ImportError:
        return None
    return gradients_triton if gradients_triton.AVAILABLE else None


def gradient_kernels_for(device: torch.device, choice: str = "auto"):
    """The module whose ``pack_gradient``/``dequantize_sum`` serve gradient pieces on ``device``,
    chosen as :func:`kernels_for` chooses: the Triton kernels on CUDA, else the torch reference
    (:mod:`qzero.quant.gradients`)."""
    from . import gradients

    if choice not in KERNELS:
        raise ValueError(f"quantization kernels must be one of {KERNELS}, got {choice!r}")
    if choice == "reference":
        return gradients
    mod = _gradient_triton_kernels()
    if choice == "triton":
        if mod is None:
            raise ValueError("quantization kernels 'triton' were asked for, but Triton is not installed or cannot run here")
        return mod
    if device.type == "cuda" and mod is not None:
        return mod
    return gradients
