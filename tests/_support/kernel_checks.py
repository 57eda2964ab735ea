"""A launcher for kernel tests: every launch checked, every kernel launched recorded.

Needs Triton (import it after ``pytest.importorskip("triton")``).
"""

from __future__ import annotations

from qzero.quant.triton import TritonKernels
from qzero.quant.triton_launch import DEFAULT_TUNING, KernelTuning, Launcher


class CheckingLauncher(Launcher):
    """Checks that each launch can take the compiled kernel's own launch (its runtime
    arguments first, then its constexprs in the kernel's order) and records the kernels."""

    def __init__(self, tuning: KernelTuning = DEFAULT_TUNING):
        super().__init__(tuning)
        self.seen: set = set()

    def launch(self, kernel, grid, args, consts, options) -> None:
        names = list(kernel.arg_names)
        assert names == [*names[: len(args)], *consts], (kernel, list(consts))
        self.seen.add(kernel)
        super().launch(kernel, grid, args, consts, options)


def checking_kernels(tuning: KernelTuning = DEFAULT_TUNING) -> TritonKernels:
    """A Triton kernel set that launches through a :class:`CheckingLauncher` (``.launcher.seen``)."""
    return TritonKernels(CheckingLauncher(tuning))
