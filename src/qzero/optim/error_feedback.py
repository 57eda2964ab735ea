"""Error feedback of the quantized gradient reduction
(:attr:`qzero.ZeroConfig.zero_quantized_gradients_error_feedback`): every rank's residuals,
and what the loss scale does to them.

[Note: residual] A rank quantizes, in every reduction, each element of the other ranks'
partitions it sends (its own partition is summed unquantized). Its *residual* of element
``i`` is what its last payload of ``i`` failed to carry: the gradient plus the previous
residual, minus what the payload decodes to (the arithmetic is the pack's, in
:mod:`qzero.quant.gradients`). The next pack of ``i`` adds it, so over steps the
quantization error is carried forward instead of lost: the sum of everything the owners
received equals the sum of the gradients minus the residuals still held (up to the bf16
rounding of the residuals). One residual buffer per flat group and rank, bf16, of
``(world - 1) x partition`` elements: the flat buffer without this rank's own partition
(partition ``q`` at ``(q - (q > rank)) x partition``). That is ``2 (world - 1) / world`` bytes
per parameter. Residuals are in the units of the gradients as they are reduced: with fp16
loss scaling they are rescaled when the scale grows and dropped on a skipped step (whose
gradients are dropped too).

Its checkpoint form is :mod:`qzero.optim.checkpoint.residuals`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..quant.gradients import RESIDUAL_DTYPE

if TYPE_CHECKING:
    from .flat import FlatGroup


class ErrorFeedback:
    """This rank's residuals of one flat group (see [Note: residual])."""

    def __init__(self, group: FlatGroup):
        self.layout = group.layout
        self.rank, self.world = group.rank, group.world_size  # rank: the partition it owns
        t = group.topology
        #: Partitions in one block of ranks that send to each other: with two-level collectives a
        #: rank quantizes only its rail's partitions (``nodes`` consecutive ones), else all.
        self.block = t.nodes if t.two_level else self.world
        self.two_level = (t.nodes, t.ranks_per_node) if t.two_level else None
        self.partition = group.layout.partition_numel
        self.residual = torch.zeros((self.world - 1) * self.partition, dtype=RESIDUAL_DTYPE, device=group.device)

    def offset(self, q: int) -> int:
        """Where partition ``q`` (not this rank's) starts in the residual buffer."""
        return (q - (q > self.rank)) * self.partition

    def piece(self, flat_lo: int, numel: int) -> torch.Tensor:
        """The residuals of flat ``[flat_lo, flat_lo + numel)``, a piece another rank owns (a view)."""
        q = flat_lo // self.partition
        if q == self.rank or numel <= 0 or (flat_lo + numel - 1) // self.partition != q:
            raise ValueError(f"flat [{flat_lo}, {flat_lo + numel}) is not inside one other rank's partition")
        at = self.offset(q) + flat_lo - q * self.partition
        return self.residual[at : at + numel]

    def partition_view(self, q: int) -> torch.Tensor:
        return self.residual[self.offset(q) : self.offset(q) + self.partition]

    def reset(self) -> None:
        self.residual.zero_()

    def after_scale_update(self, old_scale: float, new_scale: float, skipped: bool) -> None:
        """Keep the residuals in the units of the next gradients (fp16 loss scaling)."""
        if skipped:
            self.reset()  # the step's gradients were dropped; what they left behind goes with them
        elif new_scale != old_scale:
            self.residual.mul_(new_scale / old_scale)  # powers of two: exact
