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


KERNELS = ("auto", "triton", "reference")


def _triton_module(name: str):
    """The Triton kernel module ``name`` of this package, or None where Triton cannot run."""
    import importlib

    try:
        mod = importlib.import_module(f"{__name__}.{name}")
    except ImportError:
        return None
    return mod if mod.AVAILABLE else None


def _choose(device: torch.device, choice: str, reference_module, triton_name: str):
    if choice not in KERNELS:
        raise ValueError(f"quantization kernels must be one of {KERNELS}, got {choice!r}")
    if choice == "reference":
        return reference_module
    mod = _triton_module(triton_name)
    if choice == "triton":
        if mod is None:
            raise ValueError("quantization kernels 'triton' were asked for, but Triton is not installed or cannot run here")
        return mod
    return mod if device.type == "cuda" and mod is not None else reference_module


def kernels_for(device: torch.device, choice: str = "auto"):
    """The module whose ``pack_payload``/``unpack_payload`` serve tensors on ``device``.

    ``auto``: the fused Triton kernels for CUDA tensors where Triton is installed, the
    torch reference everywhere else; ``reference``: the torch reference; ``triton``: the
    Triton kernels, refused where they cannot run. All produce the same bytes.
    """
    return _choose(device, choice, reference, "triton")


def gradient_kernels_for(device: torch.device, choice: str = "auto"):
    """The module whose ``pack_gradient``/``dequantize_sum`` serve gradient pieces on ``device``,
    chosen as :func:`kernels_for` chooses (the torch reference: :mod:`qzero.quant.gradients`)."""
    from . import gradients

    return _choose(device, choice, gradients, "gradients_triton")
