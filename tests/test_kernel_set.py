"""The kernel set ([Note: kernel set] in qzero/quant/kernel_set.py): both implementations satisfy
its protocols, and ``kernels_for`` picks one or takes one as it is."""

from __future__ import annotations

import pytest
import torch

from qzero.quant import REFERENCE_KERNELS, GatherKernels, GradientKernels, kernels_for


def test_reference_kernels_satisfy_both_protocols():
    assert isinstance(REFERENCE_KERNELS, GatherKernels) and isinstance(REFERENCE_KERNELS, GradientKernels)
    assert kernels_for(torch.device("cpu")) is REFERENCE_KERNELS
    assert kernels_for(torch.device("cpu"), "reference") is REFERENCE_KERNELS


def test_triton_kernels_satisfy_both_protocols():
    pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")
    from qzero.quant.triton import AVAILABLE, DEFAULT_KERNELS, TritonKernels
    from qzero.quant.triton_launch import KernelTuning, Launcher

    other = TritonKernels(Launcher(KernelTuning(block_elems=256)))
    for k in (DEFAULT_KERNELS, other):
        assert isinstance(k, GatherKernels) and isinstance(k, GradientKernels)
    assert other.tuning.block_elems == 256 and DEFAULT_KERNELS.tuning == KernelTuning()
    assert kernels_for(torch.device("cpu"), other) is other  # a kernel set is used as it is
    if AVAILABLE:
        assert kernels_for(torch.device("cpu"), "triton") is DEFAULT_KERNELS
    with pytest.raises(TypeError, match="Launcher"):
        TritonKernels(KernelTuning())


class _GatherOnly:
    """Has the gather's methods but not the gradient reduction's: not a kernel set."""

    pack_payload = unpack_payload = unpack_payloads = pack_delta_payload = unpack_delta_payloads = staticmethod(print)


def test_kernels_for_refuses_what_is_not_a_kernel_set():
    assert isinstance(_GatherOnly(), GatherKernels) and not isinstance(_GatherOnly(), GradientKernels)
    for bad in ("cuda", _GatherOnly(), None):
        with pytest.raises(ValueError, match="quantization kernels must be one of"):
            kernels_for(torch.device("cpu"), bad)
