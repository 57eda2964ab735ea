"""Sliced update: step the inner optimizer over the master shard chunk by chunk.

The gather of chunk ``k`` can start as soon as chunk ``k`` of the master shard is
updated; without slicing it waits for the whole update. With slicing, ``step()``
updates chunk 0, starts its gather, updates chunk 1 while chunk 0 is on the wire, and
so on, and under gather-ahead the first chunks the next forward needs arrive sooner.

How: for each slice, the inner optimizer is shown one parameter, a view of the slice
of the master shard, with the matching views of its gradient and of every state
tensor shaped like the master, and stepped. Every slice starts from the same step
count; the master's own count is advanced once, at the end. The result is the bits of
one whole step only for optimizers whose update is elementwise given the step count,
so slicing is limited to :data:`SLICEABLE` (torch's Adam and AdamW, every
implementation: single tensor, foreach, fused) with no step hooks, and it starts from
the second step (the first creates the state).

Their update is also bounded: with finite gradients and finite masters, one Adam step
moves a weight by about ``lr`` at most, so a finite gradient check before the update
covers what the check of the masters after it would catch (see
:meth:`qzero.ZeroOptimizer.step`).

``ZeroConfig.sliced_update=False`` turns slicing off (for A/B checks).
"""

from __future__ import annotations

import torch
from torch.optim import optimizer as optim_module

from ..wire.labels import UPDATE, label

SLICEABLE = (torch.optim.Adam, torch.optim.AdamW)


def sliceable(optimizer: torch.optim.Optimizer, masters: list[torch.Tensor]) -> bool:
    """Whether :class:`SlicedUpdate` reproduces ``optimizer.step()`` bit for bit right now."""
    if type(optimizer) not in SLICEABLE:
        return False
    hooks = (
        optimizer._optimizer_step_pre_hooks,
        optimizer._optimizer_step_post_hooks,
        getattr(optim_module, "_global_optimizer_pre_hooks", {}),
        getattr(optim_module, "_global_optimizer_post_hooks", {}),
    )
    if any(not getattr(h, "qzero_read_only", False) for hs in hooks for h in hs.values()):
        return False  # a hook would run once per slice: only checks that change nothing may
    if any(g.get("differentiable") for g in optimizer.param_groups):
        return False
    groups = optimizer.param_groups
    if len(groups) != len(masters) or any(len(g["params"]) != 1 or g["params"][0] is not m
                                          for g, m in zip(groups, masters)):
        return False  # someone added parameters or groups to the inner optimizer
    return all(optimizer.state.get(m) and "step" in optimizer.state[m] for m in masters)


class SlicedUpdate:
    """One optimizer step, applied slice by slice (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, masters: list[torch.Tensor]):
        self.optimizer = optimizer
        self.masters = masters
        self._advanced: list[torch.Tensor | None] = [None] * len(masters)

    def update(self, gi: int, start: int, stop: int) -> None:
        """Step ``masters[gi][start:stop]`` (local offsets into the master shard)."""
        if start >= stop:
            return
        master = self.masters[gi]
        state = self.optimizer.state[master]
        view = master[start:stop]
        view.grad = master.grad[start:stop]
        sliced = {k: (v[start:stop] if torch.is_tensor(v) and v.shape == master.shape else v) for k, v in state.items()}
        sliced["step"] = state["step"].clone()  # every slice steps from the same count
        groups = self.optimizer.param_groups
        saved = [g["params"] for g in groups]
        try:
            for i, g in enumerate(groups):
                g["params"] = [view] if i == gi else []
            self.optimizer.state[view] = sliced
            with label(UPDATE):
                self.optimizer.step()
        finally:
            for g, params in zip(groups, saved):
                g["params"] = params
            self.optimizer.state.pop(view, None)
        self._advanced[gi] = sliced["step"]

    def finish(self) -> None:
        """Advance each master's step count once (every slice has been stepped)."""
        for master, advanced in zip(self.masters, self._advanced):
            if advanced is not None:
                self.optimizer.state[master]["step"].copy_(advanced)
        self._advanced = [None] * len(self.masters)
