"""The form of a checkpoint: its tensors as a DCP state dict (:func:`sharded_state_dict`), what
the masters do not hold (:func:`module_state`), and the replica of delta gathers
([Note: the replica in a checkpoint]). The package's docstring (:mod:`qzero.optim.checkpoint`)
says what a checkpoint holds and which module does what."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ...wire.agreement import digest
from . import residuals
from .index import show
from .logical import logical_pieces, logical_shards

if TYPE_CHECKING:
    from .protocol import Checkpointable, CheckpointGroup

#: A save writes into ``path + TMP_SUFFIX`` and moves the checkpoint it replaces to
#: ``path + OLD_SUFFIX`` until the new one is in place (:mod:`qzero.optim.checkpoint.save`).
TMP_SUFFIX = ".saving"
OLD_SUFFIX = ".replaced"


def module_state(opt: Checkpointable) -> dict[str, torch.Tensor]:
    """What the masters do not hold: frozen parameters and buffers (replicated)."""
    out = {f"model.{n}": p.data for n, p in opt.model.named_parameters() if not p.requires_grad}
    out.update({f"model.{n}": b for n, b in opt.model.named_buffers()})
    return out


def sharded_state_dict(opt: Checkpointable) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint, keyed for DCP: sharded masters and optimizer state,
    replicated frozen parameters and buffers."""
    sd = dict(module_state(opt))
    for i, g in enumerate(opt.groups):
        sd[f"group{i}.master"] = logical_shards(g.master, g, opt)
        for key, value in opt.optimizer.state.get(g.master, {}).items():
            sd[f"group{i}.state.{key}"] = logical_shards(value, g, opt) if value.shape == g.master.shape else value
        if g.delta is not None:  # [Note: the replica in a checkpoint]
            sd[replica_key(i)] = logical_shards(g.own, g, opt)
    sd.update(residuals.state_entries(opt))
    return sd


# --------------------------------------------------------------------------- delta gathers: the replica

# [Note: the replica in a checkpoint]
# With delta gathers the weights every rank holds (the replica) are not bf16(master): they
# are where the closed loop has brought them ([Note: delta loop] in qzero/optim/delta.py). A
# checkpoint therefore also holds, per flat group, the replica (``group{i}.replica``: the
# logical buffer in the flat dtype, each rank writing its partition, like the masters) and
# the loop's state with the layout it ran on (``groups[i].delta`` in qzero.json). A load into
# the same layout (world size, flat order, group size and format: ``layout_key``) puts the
# replica back (each rank its partition, then the plain gather of the partitions) and the
# loop's state with it, so the run continues bit for bit; any other load (another world
# size, a checkpoint without a replica) ends with an exact resync instead.
#
# The loop keeps every replica element within one quantization step of the last update of the
# rounded master, t = RN(master). That step is not saved, but how far the loop had left the
# replica is: per rank, the largest |fp32(replica) - fp32(t)| over its partition
# (``groups[i].delta.deviation``, one number per saving rank, measured at save). A load that
# would restore the replica measures it again on what it read; a rank whose replica is farther
# from t than at save (a replica saved with other masters, masters edited after the save, a
# damaged replica) makes every rank warn and resync exactly instead (the ranks exchange one
# flag and the distance per group). A genuine copy reads the same bits, so the same distance:
# it is always restored. What this does not catch: a replica changed by no more than the
# deviation recorded beside it (the loop would carry such a change into its next difference
# anyway), and checkpoints saved before the deviation was recorded (restored unchecked).


def replica_key(i: int) -> str:
    return f"group{i}.replica"


def layout_key(group: CheckpointGroup) -> list:
    """What the replica's bits depend on besides the values: where every parameter sits and how
    the partitions are cut into groups (JSON values)."""
    plan = group.gather_plan
    return [group.world_size, group.layout.numel, group.layout.order, plan.group_size, plan.fmt,
            digest(repr([(s.start, s.numel) for s in group.layout.slots]))]


def check_loop_state(d: dict, where: str, world: int) -> None:
    """``groups[i].delta`` of a checkpoint whose replica a load restores, saved by ``world`` ranks."""
    from ..delta import LoopState

    if d.get("state") not in [s.value for s in LoopState] or type(d.get("deltas")) is not int or d["deltas"] < 0:
        raise ValueError(f"{where} is {show(d)}; expected a loop state ({[s.value for s in LoopState]}) "
                         "and a count >= 0")
    dev = d.get("deviation")
    if dev is not None and (type(dev) is not list or len(dev) != world or not all(
            x is None or (type(x) in (int, float) and 0 <= x < float("inf")) for x in dev)):
        raise ValueError(f"{where}.deviation is {show(dev)}; expected one non-negative number (or null) per saving "
                         f"rank ({world})")


def replica_deviation(group: CheckpointGroup, chunk: int = 1 << 22) -> torch.Tensor:
    """The largest ``|fp32(replica) - fp32(RN(master))|`` over this rank's parameter elements (an
    fp32 scalar on the group's device, no host sync; NaN when one is not finite)."""
    own, master = group.own, group.master
    out = torch.zeros((), dtype=torch.float32, device=master.device)
    for a, n, _ in logical_pieces(group):
        for s in range(a, a + n, chunk):
            e = min(s + chunk, a + n)
            diff = (own[s:e].float() - master[s:e].to(group.dtype).float()).abs()
            out = torch.maximum(out, diff.max())  # maximum propagates NaN
    return out


def saved_deviations(opt: Checkpointable) -> list[list[float | None] | None]:
    """Per group, every rank's :func:`replica_deviation` (None where it is not finite), for
    ``qzero.json``; None for a group without delta gathers. Collective (one all-gather) at world
    size > 1 when a group has delta gathers."""
    from ...wire.comm import all_gather_into, peer_failure

    with_delta = [g for g in opt.groups if g.delta is not None]
    if not with_delta:
        return [None] * len(opt.groups)
    mine = torch.stack([replica_deviation(g) for g in with_delta]).to(torch.float64)
    table = mine.reshape(1, -1)
    if opt.world_size > 1:
        table = torch.empty(opt.world_size * mine.numel(), dtype=mine.dtype, device=mine.device)
        with peer_failure("save_checkpoint: the exchange of the replicas' deviations"):
            all_gather_into(table, mine, group=opt.process_group)
        table = table.view(opt.world_size, -1)
    rows = table.cpu().tolist()
    per_group = iter(zip(*rows))
    return [[x if math.isfinite(x) else None for x in next(per_group)] if g.delta is not None else None
            for g in opt.groups]


def restores_replica(group: CheckpointGroup, saved: dict) -> bool:
    """Whether a load puts the saved replica back (the same on every rank: the metadata and the
    layout are agreed on)."""
    delta = saved.get("delta")
    return group.delta is not None and isinstance(delta, dict) and delta.get("layout") == layout_key(group)
