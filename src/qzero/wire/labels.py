"""The profiler labels of qzero: the names its ``torch.profiler.record_function`` ranges carry.

[Note: profiler labels]
A trace of a training run (``torch.profiler.profile()``, Kineto, Nsight through NVTX) shows
qzero's time under these names, defined here once. Each is a host-side range around the work
it names; on CUDA the kernels it launches appear under it. When no profiler is recording
(``torch.profiler.profile``, ``torch.autograd.profiler.emit_nvtx``...), :func:`label` opens no
range at all: one check, well under a microsecond, instead of a ``record_function`` call.

========================  ================================================================
``qzero::step``           one optimizer step (``ZeroOptimizer.step``): update and gather
``qzero::update``         one slice of the sliced update, or the whole update of the inner
                          optimizer (``qzero.optim.update``)
``qzero::gather``         starting a weight gather (``start_gather``), or waiting for all of
                          it (``finish_gather``)
``qzero::gather.pack``    one chunk's pack: this rank's payload into its slot
``qzero::gather.all_gather``  one chunk's collective (its launch, and the wait for it)
``qzero::gather.unpack``  one chunk's unpack: every rank's payload into the flat buffer
``qzero::reduce_gradients``  the gradient exchange of one bucket or window, plain or quantized
========================  ================================================================

Under the ``streams`` schedule a chunk's ranges are where the host enqueues its work on the
side streams, not where the device runs it (the kernels inside are on the streams' rows).
"""

from __future__ import annotations

import contextlib

import torch
from torch.profiler import record_function

STEP = "qzero::step"
UPDATE = "qzero::update"
GATHER = "qzero::gather"
PACK = "qzero::gather.pack"
ALL_GATHER = "qzero::gather.all_gather"
UNPACK = "qzero::gather.unpack"
REDUCE_GRADIENTS = "qzero::reduce_gradients"

#: Every label, in the order a step meets them.
LABELS = (STEP, UPDATE, GATHER, PACK, ALL_GATHER, UNPACK, REDUCE_GRADIENTS)


_NO_RANGE = contextlib.nullcontext()


def label(name: str):
    """The profiler range ``name`` (one of :data:`LABELS`), as a context manager; nothing while
    no profiler records."""
    if not torch._C._autograd._profiler_enabled():
        return _NO_RANGE
    return record_function(name)
