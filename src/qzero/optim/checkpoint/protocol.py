"""What checkpoint code reads and writes of the optimizer it saves or loads, as protocols.

[Note: checkpoints know the optimizer by its protocol]
The checkpoint package sits below :class:`qzero.ZeroOptimizer`: ``optim/zero.py`` imports it, and
nothing in it imports ``zero.py`` (tests/test_layering.py finds any import circle in qzero). It
sees the optimizer as a :class:`Checkpointable`, its flat groups as :class:`CheckpointGroup`\\ s
and its error-feedback residuals as :class:`CheckpointResiduals`: each lists exactly the members
checkpoint code uses. tests/test_checkpoint_protocol.py saves and loads through stand-ins that
expose only these members, and checks that each member is used and that the optimizer's own
objects have it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from ...layout.flat_layout import FlatLayout
    from ...layout.gather_plan import GatherPlan
    from ..delta import DeltaLoop


@runtime_checkable
class CheckpointGroup(Protocol):
    """One flat parameter group (:class:`qzero.optim.flat.FlatGroup`) as a checkpoint sees it."""

    @property
    def layout(self) -> FlatLayout: ...

    @property
    def gather_plan(self) -> GatherPlan: ...

    @property
    def names(self) -> list[str]: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def lo(self) -> int:
        """Where this rank's partition of the flat buffer starts."""

    @property
    def hi(self) -> int:
        """Where it ends."""

    @property
    def master(self) -> torch.Tensor:
        """The fp32 master shard (the partition)."""

    @property
    def own(self) -> torch.Tensor:
        """The weights this rank holds of the partition (the replica)."""

    @property
    def delta(self) -> DeltaLoop | None:
        """The delta gathers' closed loop, or None."""

    def gather(self) -> object:
        """The configured gather of the masters into every replica."""

    def restore_replica(self, loop_state: dict) -> None:
        """Put a saved replica (read into ``own``) and the loop's state back."""


@runtime_checkable
class CheckpointResiduals(Protocol):
    """This rank's error-feedback residuals of one group (:class:`qzero.optim.error_feedback.ErrorFeedback`)."""

    @property
    def layout(self) -> FlatLayout: ...

    @property
    def rank(self) -> int: ...

    @property
    def world(self) -> int: ...

    @property
    def block(self) -> int:
        """Partitions in one block of ranks that send to each other."""

    @property
    def two_level(self) -> tuple[int, int] | None:
        """``(nodes, ranks per node)`` with two-level collectives, else None."""

    @property
    def partition(self) -> int:
        """Elements of one partition."""

    @property
    def residual(self) -> torch.Tensor: ...

    def partition_view(self, q: int) -> torch.Tensor:
        """The residuals of partition ``q`` (not this rank's), a view."""

    def reset(self) -> None:
        """Zero the residuals."""


@runtime_checkable
class LossScale(Protocol):
    """The loss scaler (:class:`qzero.optim.scaler.LossScaler`), saved and loaded as a dict."""

    def state_dict(self) -> dict:
        """The scale and its counters."""

    def load_state_dict(self, state: dict) -> None:
        """Put saved ones back."""


@runtime_checkable
class GradientBuffers(Protocol):
    """One group's gradient buffers (:mod:`qzero.optim.grads`), cleared by a load."""

    def zero(self) -> None:
        """Drop the gradients held."""


@runtime_checkable
class Checkpointable(Protocol):
    """The optimizer (:class:`qzero.ZeroOptimizer`) as a checkpoint sees it. Checkpoint code
    sets none of these (a load writes into the tensors and the inner optimizer they give)."""

    @property
    def model(self) -> torch.nn.Module: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    @property
    def process_group(self) -> dist.ProcessGroup | None: ...

    @property
    def world_size(self) -> int: ...

    @property
    def rank(self) -> int: ...

    @property
    def groups(self) -> Sequence[CheckpointGroup]: ...

    @property
    def error_feedback(self) -> Sequence[CheckpointResiduals | None]:
        """Per group, its residuals (None without error feedback)."""

    @property
    def scaler(self) -> LossScale: ...

    @property
    def grads(self) -> Sequence[GradientBuffers]: ...
