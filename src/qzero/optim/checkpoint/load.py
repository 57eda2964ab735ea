"""Loading a checkpoint into a Checkpointable, all of it on every rank or nothing on any
([Note: all or nothing]): the checks of :mod:`qzero.optim.checkpoint.checks`, the ranks'
agreement, DCP's read through :class:`qzero.optim.checkpoint.reader.IndexedReader`, the checks
of what was read, then the optimizer's state replaced and the weights gathered."""

from __future__ import annotations

import json
import os
import warnings
from typing import TYPE_CHECKING

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ...wire.agreement import digest
from ...wire.comm import peer_failure
from . import residuals
from .checks import (
    check_compatible,
    check_index_matches,
    check_state,
    kept_state,
    read_checked_index,
    resolve_checkpoint,
    resumed_hyperparameters,
)
from .form import module_state, replica_deviation, replica_key, restores_replica
from .index import show
from .logical import logical_pieces, logical_shards
from .meta import STATE_DTYPES, read_metadata
from .reader import IndexedReader

if TYPE_CHECKING:
    from .protocol import Checkpointable


# [Note: all or nothing]
# A load either puts the whole checkpoint in place on every rank or leaves every rank as it
# was. Before any tensor is read, each rank checks everything it can locally (qzero.json,
# the index, the files it names, the state against what the inner optimizer keeps) and
# allocates what it reads into; the ranks agree on the outcome and on the metadata (one
# all-gather). The new optimizer state is read into fresh tensors; the masters, frozen
# parameters and buffers are read in place, after a host copy of them is taken. Each tensor
# is checked as it is read (a dense CPU tensor of the dtype the index gives, castable into
# its target); DCP gathers every rank's reading outcome and raises on all ranks if one
# failed. Then each rank checks that the masters and the state are finite and digests the
# replicated tensors (frozen parameters, buffers, scalar state such as Adam's step), and
# the ranks compare those (one all-gather): copies that differ in a single byte are
# refused. On any refusal after reading began, the host copies are put back. Only then is
# anything the optimizer holds replaced (state, hyperparameters, loss scale) and the
# weights gathered.


def load_checkpoint(opt: Checkpointable, path: str) -> None:
    """See [Note: all or nothing]."""
    from ...wire.comm import agree_or_raise

    error, fields, meta, index, load = None, None, None, None, None
    try:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"load_checkpoint: path must be a str or an os.PathLike, got {type(path).__name__}")
        path = os.fspath(path)
    except TypeError as e:
        error = e
    else:
        try:
            path = resolve_checkpoint(path)
            meta = read_metadata(path)
            check_compatible(opt, meta, path)
            kept = kept_state(opt, meta, path)
            check_state(opt, meta, kept, path)
            index, raw_index = read_checked_index(path)
            check_index_matches(opt, meta, index, path)
            fields = {"checkpoint metadata": digest(json.dumps(meta, sort_keys=True)),
                      "checkpoint index": digest(raw_index)}
            load = _PendingLoad(opt, meta, kept)
        except ValueError as e:
            error, fields, load = _bounded(e), None, None
        except Exception as e:  # noqa: BLE001 - a checkpoint's content gets a ValueError, whatever it breaks
            error, fields, load = ValueError(f"{path!r}: the checkpoint could not be checked "
                                             f"({type(e).__name__}: {show(str(e))})"), None, None
    agree_or_raise(opt.process_group, opt.world_size, opt.groups[0].master.device, error, fields, "load_checkpoint")
    try:
        with peer_failure(f"load_checkpoint({path!r}): reading the tensors"):
            try:
                dcp.load(load.targets(), storage_reader=IndexedReader(path, index), process_group=opt.process_group)
            except CheckpointException as e:
                raise ValueError(_read_failure(e, path)) from e
        load.agree_after_read(path)
    except BaseException:
        load.undo()
        raise
    load.commit()


def _bounded(e: ValueError, limit: int = 1000) -> ValueError:
    msg = str(e)
    return e if len(msg) <= limit else ValueError(msg[: limit - 3] + "...")


class _PendingLoad:
    """What one load reads into, and how it is put in place or undone ([Note: all or nothing])."""

    def __init__(self, opt: Checkpointable, meta: dict, kept: list[dict[str, dict]]):
        """Allocate (local only: no collective, it runs before the ranks agree)."""
        self.opt, self.meta = opt, meta
        self.states: list[dict[str, torch.Tensor]] = []
        for i, (g, saved) in enumerate(zip(opt.groups, meta["groups"])):
            state = {}
            for key, spec in saved["state"].items():
                if spec["sharded"]:
                    shape, device = g.master.shape, g.master.device
                else:
                    shape, device = spec["shape"], kept[i][key]["device"]
                state[key] = torch.zeros(shape, dtype=STATE_DTYPES[spec["dtype"]], device=device)
            self.states.append(state)
        self.residuals = residuals.ResidualLoad(opt, meta)
        # delta gathers: the groups whose replica the checkpoint restores ([Note: the replica in a
        # checkpoint] in form.py)
        self.replicas = [restores_replica(g, saved) for g, saved in zip(opt.groups, meta["groups"])]
        # what is read in place, copied aside (to the host) to be put back on a refusal
        self._in_place = ([g.master for g in opt.groups] + list(module_state(opt).values())
                          + [g.own for g, r in zip(opt.groups, self.replicas) if r] + self.residuals.in_place)
        self._saved = [t.detach().to("cpu", copy=True) for t in self._in_place]

    def targets(self) -> dict:
        """The state dict DCP reads into (collective at world size > 1: it builds ShardedTensors)."""
        opt = self.opt
        out: dict = dict(module_state(opt))
        for i, (g, state) in enumerate(zip(opt.groups, self.states)):
            out[f"group{i}.master"] = logical_shards(g.master, g, opt)
            specs = self.meta["groups"][i]["state"]
            for key, t in state.items():
                out[f"group{i}.state.{key}"] = logical_shards(t, g, opt) if specs[key]["sharded"] else t
            if self.replicas[i]:
                out[replica_key(i)] = logical_shards(g.own, g, opt)
        out.update(self.residuals.targets())
        return out

    def undo(self) -> None:
        with torch.no_grad():
            for t, saved in zip(self._in_place, self._saved):
                t.copy_(saved)

    def agree_after_read(self, path: str) -> None:
        """Finite masters, state and error-feedback residuals; the same replicated tensors on
        every rank (one exchange, [Note: agreement] in qzero/wire/agreement.py: a differing
        tensor is named by its details)."""
        from ...wire.comm import agree_or_raise

        replicated = dict(module_state(self.opt))
        for i, state in enumerate(self.states):
            for key, spec in self.meta["groups"][i]["state"].items():
                if not spec["sharded"]:
                    replicated[f"group{i}.state.{key}"] = state[key]
        error, fields, details = None, None, None
        try:
            self._check_finite(path)
            distances = self._replica_distances()
            digests = {name: f"bytes digest {_tensor_digest(t):016x}" for name, t in sorted(replicated.items())}
            name = "a replicated tensor (frozen parameter, buffer or scalar optimizer state)"
            fields, details = {name: digest(json.dumps(digests))}, {name: digests}
        except ValueError as e:
            error = e
        except Exception as e:  # noqa: BLE001 - the other ranks must hear of it
            error = ValueError(f"{path!r}: checking the tensors read failed ({type(e).__name__}: {show(str(e))})")
        agree_or_raise(self.opt.process_group, self.opt.world_size, self.opt.groups[0].master.device, error, fields,
                       f"load_checkpoint({path!r}), after reading", details)
        self._settle_replicas(distances, path)

    def _replica_distances(self) -> dict[int, tuple[float, float | None]]:
        """Per group whose replica is to be restored with a recorded deviation: this rank's
        deviation as read, and as saved ([Note: the replica in a checkpoint] in form.py)."""
        out = {}
        for i, (g, saved, restore) in enumerate(zip(self.opt.groups, self.meta["groups"], self.replicas)):
            if restore and saved["delta"].get("deviation") is not None:
                out[i] = (float(replica_deviation(g)), saved["delta"]["deviation"][g.rank])
        return out

    def _settle_replicas(self, distances: dict[int, tuple[float, float | None]], path: str) -> None:
        """Every rank learns which ranks read a replica farther from its rounded masters than at
        save (one all-gather; the same groups on every rank: the metadata is agreed); those groups'
        replicas are not restored but resynced exactly, and every rank warns."""
        from ...wire.comm import all_gather_into, peer_failure

        if not distances:
            return
        groups = sorted(distances)
        mine = torch.tensor([x for i in groups for x in (distances[i][0], _too_far(*distances[i]))],
                            dtype=torch.float64, device=self.opt.groups[0].master.device)
        table = mine.reshape(1, -1)
        if self.opt.world_size > 1:
            table = torch.empty(self.opt.world_size * mine.numel(), dtype=mine.dtype, device=mine.device)
            with peer_failure(f"load_checkpoint({path!r}): the exchange of the replicas' deviations"):
                all_gather_into(table, mine, group=self.opt.process_group)
        rows = table.view(self.opt.world_size, -1).cpu().tolist()
        for k, i in enumerate(groups):
            far = [r for r, row in enumerate(rows) if row[2 * k + 1]]
            if not far:
                continue
            self.replicas[i] = False
            saved = self.meta["groups"][i]["delta"]["deviation"]
            said = ", ".join(f"rank {r}: {rows[r][2 * k]:.3g} against {saved[r]}" for r in far[:4])
            warnings.warn(
                f"qzero: load_checkpoint({path!r}): the saved delta-gather replica of group {i} is farther from its "
                f"rounded masters than the delta loop had left it at save ({said}): it was saved with other "
                f"masters, or one of them changed since. It is not restored: the weights are gathered exactly "
                f"from the masters instead (an exact resync), so this resume is not bit-exact", stacklevel=5)

    def _check_finite(self, path: str) -> None:
        for i, (g, state) in enumerate(zip(self.opt.groups, self.states)):
            spec = self.meta["groups"][i]["state"]
            for what, t, sharded in [("the fp32 master", g.master, True)] + [
                (f"optimizer state {k!r}", v, spec[k]["sharded"]) for k, v in state.items() if v.is_floating_point()
            ] + ([("the replica", g.own, True)] if self.replicas[i] else []):
                pieces = [(a, n) for a, n, _ in logical_pieces(g)] if sharded else [(0, t.numel())]
                flat = t.reshape(-1)
                bad = _first_non_finite(flat, pieces)
                if bad is None:
                    continue
                if not sharded:
                    raise ValueError(f"{path!r}: {what} of group {i} holds a non-finite value; loading refused")
                slot = next(s for s in g.layout.slots if s.start <= g.lo + bad < s.stop)
                raise ValueError(f"{path!r}: {what} of {g.names[slot.index]!r} (group {i}) holds non-finite values "
                                 f"(first at element {g.lo + bad - slot.start}); loading refused")
        self.residuals.check_finite(path)

    def commit(self) -> None:
        """Put the read state in place (nothing here can refuse) and gather the weights."""
        opt = self.opt
        self._saved = []
        for g, state, saved, pg in zip(opt.groups, self.states, self.meta["groups"], opt.optimizer.param_groups):
            for a, b in g.layout.padding_ranges(g.lo, g.hi):  # padding holds zeros (it was never trained)
                g.master[a:b].zero_()
            opt.optimizer.state[g.master] = state
            for k, v in resumed_hyperparameters(pg, saved["hyperparameters"]).items():
                pg[k] = v
        opt.scaler.load_state_dict(self.meta["loss_scaler"])
        self.residuals.commit()
        for grads in opt.grads:
            grads.zero()
        # The configured gather, as after a step: resuming at the same world size is bit-exact.
        # Delta gathers: the saved replica, or an exact resync ([Note: the replica in a checkpoint]
        # in form.py).
        with torch.no_grad():
            for g, saved, restore in zip(opt.groups, self.meta["groups"], self.replicas):
                if restore:
                    g.restore_replica(saved["delta"])
                    continue
                if g.delta is not None:
                    g.delta.resync_due()
                g.gather()


def _first_non_finite(flat: torch.Tensor, pieces, chunk: int = 1 << 22) -> int | None:
    """The first non-finite element of ``flat`` inside ``pieces`` (``(start, length)``), a
    chunk at a time (no full-size temporary) with one host sync when all are finite."""
    finite = torch.ones((), dtype=torch.bool, device=flat.device)
    for a, n in pieces:
        for s in range(a, a + n, chunk):
            finite &= torch.isfinite(flat[s : min(s + chunk, a + n)]).all()
    if bool(finite):
        return None
    for a, n in pieces:
        for s in range(a, a + n, chunk):
            bad = (~torch.isfinite(flat[s : min(s + chunk, a + n)])).nonzero()
            if bad.numel():
                return s + int(bad[0, 0])
    return None


def _tensor_digest(t: torch.Tensor) -> int:
    """A digest of a tensor's bytes (a host copy of one tensor at a time)."""
    return digest(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())


def _read_failure(e: CheckpointException, path: str) -> str:
    """What went wrong while reading, as the rank that found it said (every rank gets every
    rank's exception from DCP)."""
    errors = []
    for rank, failure in sorted(getattr(e, "failures", {}).items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, ValueError):
            errors.append((rank, str(exc)))
    if errors:
        rank, msg = errors[0]
        return msg if len(e.failures) == 1 else f"{msg} (found by rank {rank})"
    return f"{path!r}: reading the tensors failed: {show(_first_line(e))}"


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__


def _too_far(now: float, saved: float | None) -> bool:
    """Whether a replica read is farther from its rounded masters than at save (an unknown or
    non-finite distance counts as too far)."""
    return saved is None or not now <= saved
