"""Gather-ahead: let the post-step weight gather run under the next forward.

``step()`` starts the gather of every flat group on the gather engine
(:func:`qzero.wire.engine.start_gather`) and returns with the handles. Forward pre-hooks
make each module wait only until the chunks holding its own parameters have arrived
(``handle.wait_until``), which also launches or enqueues the next chunks, so later
chunks keep flowing while earlier layers compute. Everything that reads weights
otherwise (backward, the next step, checkpoints, the exact re-gather, an explicit
``wait_for_weights()``) finishes the whole gather first.

[Note: reads wait]
A weight must never be read before its chunks have arrived. The forward pre-hooks cover
a module's own forward; every other read of a parameter through a module goes through
that module's ``_parameters`` dict, which gather-ahead replaces by a
:class:`WaitingParameters`: looking a parameter up (``module.weight``, also from another
module's forward, e.g. a tied embedding read by a head) waits for the chunks of that
parameter, and walking the dict (``parameters()``, ``named_parameters()``,
``state_dict()``, ``load_state_dict()``, ``.to()``, ``copy.deepcopy``) waits for those of
the module's parameters first. So ``next(model.parameters())`` waits for the first
module's chunks only, and ``list(model.parameters())`` for all of them. The one read that
cannot wait is through a tensor reference taken before ``step()`` returned (a list of
parameters kept from earlier): call ``wait_for_weights()`` before reading those.

The bits are those of the synchronous gather: the engine runs the same chunks with the
same functions either way; only the moment of waiting differs.

[Note: gather-ahead states]
A :class:`GatherAhead` is in one :class:`AheadState` at a time:

* ``LEARNING``: no gather has started yet; every module has a hook, and the hooks note which
  modules' forwards run (the first gather's start uses that to leave only the hooks that wait
  for something).
* ``IDLE``: no gather is running and no forward overlaps one; hooks wait for nothing.
* ``GATHERING``: some flat group's gather is running (its handle is pending): the hooks and the
  parameter reads wait for their chunks. Entered by ``start(group, handle)``, from any state
  but ``REMOVED``; starting a group whose previous gather is still pending is an error (its
  chunks would be waited for out of order).
* ``GATHERED``: the hooks have waited for every chunk of every pending gather, but the forward
  that overlapped it is still running (the out-of-order warning still watches it).
* ``REMOVED``: ``remove()`` finished the gathers and took the hooks off; nothing starts again.

``wait_all()`` finishes whatever is pending and leads to ``IDLE`` (from ``LEARNING``: stays
there; from ``REMOVED``: stays there). Any other move raises :class:`IllegalTransition`.
"""

from __future__ import annotations

import enum
import warnings

import torch

from .engine import GatherHandle
from ..layout.gather_plan import GatherPlan
#: Modules may run this many places before their registration order without a warning
#: (a transformer layer runs its input norm, registered last, before its projections).
REORDER_TOLERANCE = 16


class AheadState(enum.Enum):
    """The states of gather-ahead ([Note: gather-ahead states])."""

    LEARNING = "learning"
    IDLE = "idle"
    GATHERING = "gathering"
    GATHERED = "gathered"
    REMOVED = "removed"


class IllegalTransition(RuntimeError):
    """Gather-ahead was asked for a move its state does not allow ([Note: gather-ahead states])."""


def last_chunk_needed(plan: GatherPlan, start: int, stop: int) -> int:
    """The highest chunk index holding any element of the flat range ``[start, stop)``
    (chunks finish in order, so waiting for it covers the range); -1 for an empty range."""
    p, c = plan.partition_numel, plan.chunk_numel
    last = -1
    for r in range(start // p, min(-(-stop // p), plan.world_size)):
        a, b = max(start, r * p) - r * p, min(stop, (r + 1) * p) - r * p
        if a < b:
            last = max(last, (b - 1) // c)
    return last


def _runs_no_forward(module: torch.nn.Module) -> bool:
    """Containers (``nn.Module()``, ``ParameterList``, ``ModuleList``) define no forward:
    whatever parameters they hold are read by an enclosing module's forward."""
    return type(module).forward is torch.nn.Module.forward


def _parameters_read_by(module: torch.nn.Module):
    """A module's own parameters and those of the containers below it (recursively), which
    only its forward can read."""
    yield from module.parameters(recurse=False)
    for child in module.children():
        if _runs_no_forward(child):
            yield from _parameters_read_by(child)


#: The states in which a forward overlaps a gather.
_OVERLAPPED = (AheadState.GATHERING, AheadState.GATHERED)


class WaitingParameters(dict):
    """A module's ``_parameters`` under gather-ahead: reads wait for their chunks ([Note: reads
    wait]). Writing, membership and iterating over names do not wait."""

    __slots__ = ("_ahead",)

    def __init__(self, params: dict, ahead: GatherAhead):
        super().__init__(params)
        self._ahead = ahead

    def __getitem__(self, name):
        p = dict.__getitem__(self, name)
        if self._ahead.busy and p is not None:
            self._ahead.wait_for(p)
        return p

    def get(self, name, default=None):
        return self[name] if name in self else default

    def _wait_all(self) -> None:
        if self._ahead.busy:
            for p in dict.values(self):
                if p is not None:
                    self._ahead.wait_for(p)

    def items(self):
        self._wait_all()
        return dict.items(self)

    def values(self):
        self._wait_all()
        return dict.values(self)

    def copy(self) -> dict:
        self._wait_all()
        return dict(dict.items(self))

    def __reduce_ex__(self, protocol):  # pickle, copy.deepcopy: a plain dict of gathered weights
        return (dict, (self.copy(),))


def _inert() -> GatherAhead:
    """A :class:`GatherAhead` of no module: what a copy of the model's hooks refers to."""
    inert = GatherAhead.__new__(GatherAhead)
    inert._setup(torch.nn.Module(), [], 0)
    return inert


class GatherAhead:
    """Forward pre-hooks that wait for exactly the chunks a module's parameters live in, and
    parameter dicts that make every other read of a weight wait too ([Note: reads wait])."""

    def __init__(self, model: torch.nn.Module, groups):
        """``groups``: flat groups with ``.layout.slots`` and ``.params`` (qzero's own)."""
        ranges = [(p, gi, slot.start, slot.stop)
                  for gi, g in enumerate(groups) for slot, p in zip(g.layout.slots, g.params)]
        self._setup(model, ranges, len(groups))

    @classmethod
    def from_ranges(cls, model: torch.nn.Module, ranges, num_groups: int) -> GatherAhead:
        """``ranges``: ``(param, group_index, start, stop)``, each parameter's elements
        ``[start, stop)`` of flat group ``group_index`` (any flat layout, e.g. DeepSpeed's)."""
        self = cls.__new__(cls)
        self._setup(model, ranges, num_groups)
        return self

    def _setup(self, model: torch.nn.Module, ranges, num_groups: int) -> None:
        #: Per flat group, its running gather (None: none runs).
        self.pending: list[GatherHandle | None] = [None] * num_groups
        self.state = AheadState.LEARNING
        self._warned = False
        self._furthest = -1  # the furthest module (registration order) this forward has reached
        index = {p: (gi, start, stop) for p, gi, start, stop in ranges}
        ranges_of_params = list(ranges)
        self._needs: dict[torch.nn.Module, list[tuple[int, int, int]]] = {}
        self._position: dict[torch.nn.Module, int] = {}
        self._parent: dict[torch.nn.Module, torch.nn.Module] = {}
        self._handles: dict[torch.nn.Module, object] = {}
        #: The model: its hook marks the start of a forward (the order check starts again there).
        self._root = model
        for module in model.modules():
            for child in module.children():
                self._parent.setdefault(child, module)
            if _runs_no_forward(module) and module is not model:
                continue  # its parameters are read by the nearest module that has a forward
            ranges = [index[p] for p in _parameters_read_by(module) if p in index]
            if ranges:
                self._needs[module] = ranges
            # Every module gets a hook until the first forward has shown which ones run (see
            # _learn); afterwards only those that wait for something keep theirs, and the
            # model (its hook marks where a forward starts).
            self._position[module] = len(self._position)
            self._handles[module] = module.register_forward_pre_hook(self._hook)
        #: Modules whose forward ran while LEARNING.
        self._ran: set[torch.nn.Module] = set()
        self._index_needs()
        # Per parameter, per flat group: [group, spans, plan, last chunk], as in _index_needs.
        self._param_waits: dict[torch.nn.Parameter, list[list]] = {}
        for p, gi, start, stop in ranges_of_params:
            self._param_waits.setdefault(p, []).append([gi, [(start, stop)], None, -1])
        self._dicts: list[torch.nn.Module] = []
        for module in model.modules():
            own = module.__dict__.get("_parameters")
            if own and any(p in self._param_waits for p in own.values() if p is not None):
                module.__dict__["_parameters"] = WaitingParameters(own, self)
                self._dicts.append(module)

    def _index_needs(self) -> None:
        """Per module, per flat group it reads from: its ranges, and the plan and last chunk
        they were last resolved against (a handle's plan rarely changes, so the hook finds
        the chunk to wait for without walking the ranges)."""
        self._waits: dict[torch.nn.Module, list[list]] = {}
        for module, ranges in self._needs.items():
            by_group: dict[int, list[tuple[int, int]]] = {}
            for gi, start, stop in ranges:
                by_group.setdefault(gi, []).append((start, stop))
            self._waits[module] = [[gi, spans, None, -1] for gi, spans in by_group.items()]

    @property
    def busy(self) -> bool:
        """Whether a gather is still running (reads wait for it)."""
        return self.state is AheadState.GATHERING

    def _move(self, to: AheadState, allowed: tuple[AheadState, ...], what: str) -> None:
        if self.state not in allowed:
            raise IllegalTransition(f"qzero gather-ahead: cannot {what} while {self.state.value} "
                                    f"(allowed from: {', '.join(s.value for s in allowed)})")
        self.state = to

    def start(self, gi: int, pending: GatherHandle) -> None:
        """Flat group ``gi``'s gather runs ahead on ``pending``: the next forward overlaps it."""
        if self.state is not AheadState.REMOVED and self.pending[gi] is not None:
            raise IllegalTransition(f"qzero gather-ahead: flat group {gi}'s previous gather is still running; "
                                    "wait for it (wait_all) before starting the next")
        learning = self.state is AheadState.LEARNING
        self._move(AheadState.GATHERING, (AheadState.LEARNING, AheadState.IDLE, AheadState.GATHERING,
                                          AheadState.GATHERED), "start a gather")
        if learning:
            self._learn()
        self.pending[gi] = pending
        self._furthest = -1

    def _learn(self) -> None:
        """A module whose forward did not run in the forwards before the first gather (say
        ``nn.MultiheadAttention``'s ``out_proj``, whose weight its parent reads directly) has
        its parameters read by an enclosing module: the closest one whose forward ran waits
        for them from now on. (No forward before the first step: nothing to learn from, each
        module keeps its own parameters.)"""
        ran, self._ran = self._ran, set()
        if ran:
            for module in [m for m in self._needs if m not in ran]:
                up = self._parent.get(module)
                while up is not None and up not in ran:
                    up = self._parent.get(up)
                if up is not None:
                    self._needs.setdefault(up, []).extend(self._needs.pop(module))
        for module in [m for m in self._handles if m not in self._needs and m is not self._root]:
            self._handles.pop(module).remove()
        self._index_needs()

    def __reduce__(self):
        """A copy of the model (``copy.deepcopy(model)``, say for an EMA of the weights, or
        ``torch.save(model)``) gets the gathered weights (:class:`WaitingParameters` copies
        as a plain dict) and hooks that wait for nothing: it is not trained by this optimizer."""
        return (_inert, ())

    # Waiting runs the gather engine (collectives, host-side bookkeeping): never traced by
    # torch.compile, which breaks its graph here and runs the wait as it is.
    @torch.compiler.disable
    def _hook(self, module: torch.nn.Module, args) -> None:
        position = self._position.get(module)
        if position is None:
            return  # a copy of the model's module (see __deepcopy__)
        if self.state is AheadState.LEARNING:
            self._ran.add(module)
        if module is self._root:
            self._furthest = -1  # a new forward (an evaluation's, say, before the next training forward)
        if self.state in _OVERLAPPED and position < self._furthest - REORDER_TOLERANCE and not self._warned:
            warnings.warn(
                "qzero gather-ahead: the forward runs modules far out of their registration order; weights stay "
                "correct (each module waits for the chunks it needs), but less of the gather is hidden",
                stacklevel=3,
            )
            self._warned = True
        self._furthest = max(self._furthest, position)
        self._wait(self._waits.get(module, ()))

    @torch.compiler.disable
    def wait_for(self, param: torch.nn.Parameter) -> None:
        """Wait until ``param``'s chunks have arrived (no-op for a parameter qzero does not gather)."""
        self._wait(self._param_waits.get(param, ()))

    def _wait(self, waits) -> None:
        for wait in waits:
            gi, spans, plan, last = wait
            pending = self.pending[gi]
            if pending is not None:
                if plan is not pending.plan:
                    plan = wait[2] = pending.plan
                    last = wait[3] = max(last_chunk_needed(plan, a, b) for a, b in spans)
                # Chunks finish in order: waiting for the last chunk of this group that holds
                # any of the ranges covers all of them.
                pending.wait_until(last)
                if pending.done:
                    self.pending[gi] = None
                    if all(p is None for p in self.pending):
                        self._move(AheadState.GATHERED, (AheadState.GATHERING,), "finish a gather")

    def wait_all(self) -> None:
        """Finish every running gather; the forward that overlapped them is over."""
        for gi, pending in enumerate(self.pending):
            if pending is not None:
                pending.wait()
                self.pending[gi] = None
        if self.state in _OVERLAPPED:
            self.state = AheadState.IDLE

    def remove(self) -> None:
        """Finish the gather, then take the hooks off the model."""
        self.wait_all()
        self.state = AheadState.REMOVED
        for h in self._handles.values():
            h.remove()
        self._handles = {}
        for module in self._dicts:
            if isinstance(module.__dict__.get("_parameters"), WaitingParameters):
                module.__dict__["_parameters"] = dict(dict.items(module._parameters))
        self._dicts = []
