"""The Triton kernel set: weight, delta and gradient kernels behind one object.

:class:`TritonKernels` satisfies :class:`qzero.quant.kernel_set.GatherKernels` and
:class:`~qzero.quant.kernel_set.GradientKernels` ([Note: kernel set]) and writes the bytes of
the torch reference. Each instance launches through its own
:class:`~qzero.quant.triton_launch.Launcher`, which holds its
:class:`~qzero.quant.triton_launch.KernelTuning` and its caches; :data:`DEFAULT_KERNELS`
(the :data:`~qzero.quant.triton_launch.DEFAULT_TUNING`) is the one
:func:`qzero.quant.kernels_for` returns, and another tuning is another instance::

    kernels = TritonKernels(Launcher(KernelTuning(block_elems=1024)))
    ctx = CommContext(device, kernels=kernels)

Where the pieces live: :mod:`~qzero.quant.triton_launch` (tuning, launch shapes, the
launcher and its caches), :mod:`~qzero.quant.triton_arith` (the shared ``@triton.jit``
arithmetic), :mod:`~qzero.quant.triton_weights` (weight payloads),
:mod:`~qzero.quant.triton_delta` (delta payloads), :mod:`~qzero.quant.gradients_triton`
(gradient payloads).

``AVAILABLE`` is False when Triton is missing, or when there is neither a CUDA device nor the
CPU interpreter (``TRITON_INTERPRET=1``) to run on.
"""

from __future__ import annotations

from .gradients_triton import GradientKernels
from .triton_delta import DeltaKernels
from .triton_launch import AVAILABLE, DEFAULT_TUNING, INTERPRET, KernelTuning, Launcher
from .triton_weights import WeightKernels

__all__ = ["AVAILABLE", "DEFAULT_KERNELS", "DEFAULT_TUNING", "INTERPRET", "KernelTuning", "Launcher", "TritonKernels"]


class TritonKernels(WeightKernels, DeltaKernels, GradientKernels):
    """The fused Triton kernels, launched through ``launcher`` (a new
    :class:`~qzero.quant.triton_launch.Launcher` with the default tuning when None)."""

    name = "triton"

    def __init__(self, launcher: Launcher | None = None):
        if launcher is not None and not isinstance(launcher, Launcher):
            raise TypeError(f"launcher must be a qzero.quant.triton_launch.Launcher, got {type(launcher).__name__}")
        self.launcher = Launcher() if launcher is None else launcher

    @property
    def tuning(self) -> KernelTuning:
        return self.launcher.tuning

    def __repr__(self) -> str:
        return f"TritonKernels({self.tuning})"


#: The kernel set :func:`qzero.quant.kernels_for` picks for Triton (the default tuning).
DEFAULT_KERNELS = TritonKernels()
