"""The kernel set: what the gather and the gradient exchange call to quantize, declared once.

[Note: kernel set]

Every payload that crosses the link is written and read by a *kernel set*: an object with
the methods of :class:`GatherKernels` (weight and delta payloads of the weight gather) and
:class:`GradientKernels` (the quantized gradient reduction). Two implementations exist, and
they write the same bytes:

* :data:`REFERENCE_KERNELS`: the torch reference (:mod:`qzero.quant.reference`,
  :mod:`qzero.quant.gradients`), which *is* the specification; any device.
* :class:`qzero.quant.triton.TritonKernels`: fused Triton kernels (CUDA, or Triton's CPU
  interpreter), one instance per :class:`~qzero.quant.triton_launch.KernelTuning`, owning its
  launch caches.

:func:`qzero.quant.kernels_for` picks one (``ZeroConfig.quant_kernels``: ``auto``, ``triton``
or ``reference``), or takes a kernel set given as it is. Another implementation (a new
backend, an instrumented copy) satisfies both protocols and is passed the same way; the
callers never look at anything else. Arguments are those of the reference functions, whose
docstrings define them.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from . import gradients, reference


@runtime_checkable
class GatherKernels(Protocol):
    """The kernels of the weight gather: one rank's payload of a chunk packed, one or every
    source rank's payload unpacked, and the same for delta payloads (the replica updated in
    place). Each method is specified by the :mod:`qzero.quant.reference` function of its name."""

    def pack_payload(self, src: torch.Tensor, out: torch.Tensor, layout, group_size: int, fmt: str,
                     exact_index: torch.Tensor | None, runs=None) -> None: ...

    def unpack_payload(self, payload: torch.Tensor, dst: torch.Tensor, layout, group_size: int, fmt: str,
                       exact_index: torch.Tensor | None, runs=None) -> None: ...

    def unpack_payloads(self, buf: torch.Tensor, flat: torch.Tensor, partition_numel: int, offset: int, numel: int,
                        world: int, layout, group_size: int, fmt: str, exact, runs=None) -> None: ...

    def pack_delta_payload(self, target: torch.Tensor, replica: torch.Tensor, out: torch.Tensor, layout,
                           group_size: int, fmt: str, exact_index: torch.Tensor | None, runs=None) -> None: ...

    def unpack_delta_payloads(self, buf: torch.Tensor, flat: torch.Tensor, partition_numel: int, offset: int,
                              numel: int, world: int, layout, group_size: int, fmt: str, exact,
                              refused: torch.Tensor, runs=None) -> None: ...


@runtime_checkable
class GradientKernels(Protocol):
    """The kernels of the quantized gradient reduction: a gradient piece packed (with its
    rotation and error-feedback residual), and an owner's sum of every rank's piece. Each
    method is specified by the :mod:`qzero.quant.gradients` function of its name."""

    def pack_gradient(self, src: torch.Tensor, out: torch.Tensor, layout, group_size: int, fmt: str,
                      exact_index: torch.Tensor | None, rotation: int = 0,
                      residual: torch.Tensor | None = None) -> None: ...

    def dequantize_sum(self, payloads: torch.Tensor, own: torch.Tensor, out: torch.Tensor, layout, rank: int,
                       world: int, group_size: int, fmt: str, exact_index: torch.Tensor | None,
                       rotation: int = 0) -> None: ...


class ReferenceKernels:
    """The torch reference as a kernel set: the specification's own functions."""

    name = "reference"
    pack_payload = staticmethod(reference.pack_payload)
    unpack_payload = staticmethod(reference.unpack_payload)
    unpack_payloads = staticmethod(reference.unpack_payloads)
    pack_delta_payload = staticmethod(reference.pack_delta_payload)
    unpack_delta_payloads = staticmethod(reference.unpack_delta_payloads)
    pack_gradient = staticmethod(gradients.pack_gradient)
    dequantize_sum = staticmethod(gradients.dequantize_sum)

    def __repr__(self) -> str:
        return "ReferenceKernels()"


#: The torch reference's kernel set (it holds no state: one instance serves everyone).
REFERENCE_KERNELS = ReferenceKernels()
