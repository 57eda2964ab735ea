"""The closed loop of delta weight gathers: when a gather is an exact resync, and refusals.

[Note: delta loop]

With ``ZeroConfig.zero_quantized_weights_delta`` the weight gather sends, per flat group,
the quantized difference between the new weights and the replica every rank holds
([Note: delta payload] in :mod:`qzero.quant.reference`). A :class:`DeltaLoop` (one per
flat group, owned by its :class:`~qzero.optim.flat.FlatGroup`) decides, the same way on
every rank because it depends only on the sequence of calls, whether the next gather is a
delta or an **exact resync** (the plain gather: every replica becomes the bf16/fp16
rounding of the masters):

* ``RESYNC_DUE`` after construction, and after a load that could not restore the replica
  (a checkpoint saved at another world size, or without one): the next gather is exact.
* ``TRACKING`` after an exact gather (a resync, ``gather_exact_weights()``, or a load that
  restored the replica bit for bit): gathers are deltas, except that with
  ``zero_quantized_weights_delta_resync_steps = K > 0`` every K-th gather is exact again
  (K - 1 deltas between two exact gathers).

Refusals: a group whose difference is not finite is left as it was on every rank (every
rank unpacks the same bytes, so they all decide alike) and the unpack raises a flag on the
device (the flat index of the first such group); the optimizer reads it at a host
synchronisation it makes anyway, before the next update (in ``step()``: with the finite check
of the gradients and masters, or right after the loss scaler's overflow exchange; with neither,
at its own synchronisation before the update), and in ``wait_for_weights()``, and raises on
every rank, naming the parameter.
"""

from __future__ import annotations

import enum

import torch

from ..wire.chunks import DeltaInputs
from ..quant.reference import NOT_REFUSED, refusal_flag


class LoopState(enum.Enum):
    RESYNC_DUE = "resync due"
    TRACKING = "tracking"


class DeltaLoop:
    """Resync schedule and refusal flag of one flat group's delta gathers."""

    def __init__(self, resync_steps: int, device: torch.device):
        self.resync_steps = resync_steps
        self.state = LoopState.RESYNC_DUE
        #: Delta gathers since the last exact one.
        self.deltas = 0
        self.refused = refusal_flag(device)

    def next_is_exact(self) -> bool:
        k = self.resync_steps
        return self.state is LoopState.RESYNC_DUE or (k > 0 and self.deltas >= k - 1)

    def inputs(self, target: torch.Tensor) -> DeltaInputs:
        return DeltaInputs(target, self.refused)

    def gathered(self, exact: bool) -> None:
        """A gather was started: an exact one (the replica is the rounded masters) or a delta."""
        if exact:
            self.state, self.deltas = LoopState.TRACKING, 0
        else:
            self.deltas += 1

    def resync_due(self) -> None:
        """The replica is no longer known to follow the masters: the next gather is exact."""
        self.state, self.deltas = LoopState.RESYNC_DUE, 0

    def state_dict(self) -> dict:
        return {"state": self.state.value, "deltas": self.deltas}

    def load_state_dict(self, d: dict) -> None:
        self.state, self.deltas = LoopState(d["state"]), int(d["deltas"])

    def take_refusal(self) -> int | None:
        """The flat index of the first group an unpack refused since the last call, or None
        (a host synchronisation); the flag is reset."""
        at = int(self.refused.item())
        if at == NOT_REFUSED:
            return None
        self.refused.fill_(NOT_REFUSED)
        return at


def refusal_error(culprits: list[str], what: str) -> FloatingPointError:
    """The error every rank raises (they all unpacked the same bytes) after a refusal."""
    return FloatingPointError(
        f"qzero: {what}: a delta weight gather met non-finite differences in {', '.join(culprits)} (the bf16/fp16 "
        "rounding of a master, or its difference from the replica, overflowed, or a master is NaN/Inf); those "
        "groups were left as they were on every rank, so no replica received them. Lower the learning rate, clip "
        "gradients (gradient_clipping) or use fp16 loss scaling, and resume from a checkpoint."
    )
