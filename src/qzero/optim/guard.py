"""What may not change behind the optimizer's back, checked at every ``backward()`` and ``step()``.

[Note: the model belongs to the optimizer]

After ``ZeroOptimizer(model, ...)`` every trainable parameter is a view into a flat buffer,
its fp32 master lives (sharded) in the optimizer, and every step overwrites the weights with
the gathered masters. A change made to the model or to the inner optimizer directly would
then be lost, or train wrong, without a word:

* an in-place write to a weight (``model.load_state_dict``, ``nn.init``, a ``no_grad`` edit):
  the next step gathers the old masters over it (with delta gathers, one rank's edit would
  even leave the replicas apart);
* ``model.to(dtype)`` / ``.half()`` / ``.float()`` or any ``p.data = ...``: the parameter is
  no longer a view of the flat buffer, so it is never updated again;
* a parameter replaced (``module.weight = nn.Parameter(...)``), or one made trainable after
  construction: never updated;
* ``requires_grad_(False)`` on a parameter the optimizer holds: momentum and weight decay
  still move it;
* parameters or groups added to the inner optimizer: stepped with gradients no rank reduced.

:class:`ModelGuard` records, at construction and after ``load_checkpoint``, each held parameter's
identity, storage, dtype, ``requires_grad`` and version counter (qzero's own writes go
through the flat buffer and leave the counter alone), and :meth:`ModelGuard.check` raises
naming the first parameter that changed and what to do instead.

The local check reads metadata only. The ranks then agree on its outcome: a change made on
some ranks only (``if rank == 0: model.load_state_dict(...)``) must not let the other ranks
run on into the step's collectives and wait there for a rank that raised. Every rank sends
one integer (changed or not) in an all-gather on a side stream, so the host waits for that
exchange only, not for the model's queued kernels; when a rank changed something, its
message is exchanged too, and every rank raises, the others naming the rank and its change.
The exchange runs at ``step()`` and at the first ``backward()`` of each step, where a loop
changes a model (loading, editing, evaluating between steps). At the later micro-batches of
an accumulating step the check stays local: an exchange there would wait behind the previous
micro-batch's gradient reductions, which are meant to overlap this one's backward, so a
change made on some ranks only between two micro-batches raises on those ranks only.
"""

from __future__ import annotations

import contextlib

import torch

from ..wire.comm import all_gather_into, exchange_texts, peer_failure

#: What to do instead, said by every error of this module.
_INSTEAD = ("load weights before constructing the ZeroOptimizer, or through opt.load_checkpoint(); "
            "change dtype, device or which parameters train before constructing it")


class ModelChangedError(RuntimeError):
    """The model or the inner optimizer was changed behind the ZeroOptimizer's back."""


class ModelGuard:
    def __init__(self, model: torch.nn.Module, groups, inner: torch.optim.Optimizer, process_group=None,
                 world: int = 1, device: torch.device | None = None):
        self.model, self.inner = model, inner
        self.held = [(name, p) for g in groups for name, p in zip(g.names, g.params)]
        self.masters = [g.master for g in groups]
        self.group, self.world = process_group, world
        self.device = device if device is not None else torch.device("cpu")
        self._side: torch.cuda.Stream | None = None  # the agreement's stream (CUDA), made at first use
        self.snapshot()

    def snapshot(self) -> None:
        """Record the state the optimizer left the parameters in (after its own writes)."""
        self.state = [(p._version, p.data_ptr(), p.dtype, p.requires_grad) for _, p in self.held]
        self.ids = {id(p) for _, p in self.held}

    def check(self, step: int, agree: bool = True, refusal: Exception | None = None) -> None:
        """Raise :class:`ModelChangedError` on every rank if any rank's model or inner optimizer
        changed (this rank's own error where it changed; else one naming the ranks that did).
        ``refusal``: another reason of this rank's to refuse the step (the optimizer's own
        state), agreed on by the same exchange and raised before a change of the model.
        ``agree=False``: on this rank only, without the exchange."""
        error = refusal if refusal is not None else self.find(step)
        if self.world < 2 or not agree:
            if error is not None:
                raise error
            return
        what = f"the model guard's exchange before optimizer step {step + 1}"
        flags = self._gather_flags(0 if error is None else 2 if refusal is not None else 1, what)
        changed = [r for r, f in enumerate(flags) if f]
        if not changed:
            return
        said = exchange_texts(str(error) if error is not None else "", self.group, self.world, self.device, what)
        if error is not None:
            raise error
        first = changed[0]
        if flags[first] == 2:
            raise RuntimeError(
                f"qzero: rank(s) {changed} refused optimizer step {step + 1} (this rank did not, but every rank "
                f"must do the same); rank {first} reports: {said[first]}")
        raise ModelChangedError(
            f"qzero: rank(s) {changed} changed the model or the inner optimizer behind the ZeroOptimizer's back "
            f"before optimizer step {step + 1} (this rank did not, so the replicas would part); rank {first} "
            f"reports: {said[first]}")

    def _gather_flags(self, flag: int, what: str) -> list[int]:
        """Every rank's flag, through one all-gather of one integer each. On CUDA it runs on a
        side stream: the host waits for the exchange, not for the kernels already queued. A peer
        that dies meanwhile raises :class:`qzero.wire.comm.PeerFailure` naming ``what``."""
        on_cuda = self.device.type == "cuda"
        if on_cuda and self._side is None:
            self._side = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._side) if on_cuda else contextlib.nullcontext():
            mine = torch.tensor([flag], dtype=torch.int64, device=self.device)
            table = torch.empty(self.world, dtype=torch.int64, device=self.device)
            with peer_failure(what):
                all_gather_into(table, mine, group=self.group)
                return table.tolist()

    def find(self, step: int) -> ModelChangedError | None:
        """This rank's first change since the snapshot, as an error (None: none)."""
        try:
            self._find(step)
        except ModelChangedError as e:
            return e
        return None

    def _find(self, step: int) -> None:
        where = f"before optimizer step {step + 1}"
        for (name, p), (version, ptr, dtype, requires_grad) in zip(self.held, self.state):
            if p.dtype != dtype or p.data_ptr() != ptr:
                raise ModelChangedError(
                    f"qzero: parameter {name!r} no longer lives in the optimizer's flat buffer {where} (now "
                    f"{p.dtype}, was {dtype}): model.to(...), .half(), .float() or p.data = ... after the "
                    f"ZeroOptimizer was built would leave it untrained; {_INSTEAD}")
            if p._version != version:
                raise ModelChangedError(
                    f"qzero: parameter {name!r} was written outside the optimizer {where} (model.load_state_dict, "
                    f"nn.init, or an in-place edit): the next step would gather the optimizer's fp32 masters "
                    f"over it; {_INSTEAD}")
            if p.requires_grad != requires_grad:
                raise ModelChangedError(
                    f"qzero: parameter {name!r} changed requires_grad to {p.requires_grad} {where}: the optimizer "
                    f"would still move it (momentum, weight decay); {_INSTEAD}")
        seen = set()
        for name, p in self.model.named_parameters():
            seen.add(id(p))
            if p.requires_grad and id(p) not in self.ids:
                raise ModelChangedError(
                    f"qzero: trainable parameter {name!r} is not one the optimizer holds {where} (replaced by "
                    f"module.<name> = nn.Parameter(...), or made trainable after construction): it would never "
                    f"be updated; {_INSTEAD}")
        gone = [name for name, p in self.held if id(p) not in seen]
        if gone:
            raise ModelChangedError(
                f"qzero: parameter {gone[0]!r} is no longer in the model {where} (replaced or removed): the "
                f"optimizer would keep training a tensor the model does not use; {_INSTEAD}")
        groups = self.inner.param_groups
        if len(groups) != len(self.masters) or any(
                len(g["params"]) != 1 or g["params"][0] is not m for g, m in zip(groups, self.masters)):
            raise ModelChangedError(
                f"qzero: the inner optimizer's parameter groups were changed {where} (add_param_group or an "
                f"edit of param_groups[i]['params']): parameters outside the optimizer's flat groups get no "
                f"reduced gradients, so the replicas would drift apart; build the ZeroOptimizer with "
                f"param_groups=[...] instead (hyperparameters such as the learning rate may change freely)")
