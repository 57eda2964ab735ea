"""Reshardable checkpoints of a ZeroOptimizer through torch.distributed.checkpoint: what a
checkpoint holds, and its form as a DCP state dict.

What is saved, per parameter group, is world-size independent: the *logical* flat
buffer (the parameters back to back, without the tail padding) of the fp32 masters
and of every optimizer state tensor shaped like them, each rank writing the piece
its partition holds (a ShardedTensor). Scalar state (Adam's ``step``) is saved
replicated. A small JSON file beside it (``qzero.json``) records the parameter
names and shapes, the state's keys and the hyperparameters; it is checked before
anything is read, so a checkpoint of another model is refused by name.

A checkpoint directory is untrusted input. ``qzero.json`` is JSON, read bounded and checked
field by field (:mod:`qzero.optim.checkpoint_meta`), then against this optimizer: the optimizer
state it declares must be what the inner optimizer keeps ([Note: the state an optimizer
keeps]). DCP's index (``.metadata``, a pickle) is read once by
:mod:`qzero.optim.checkpoint_index`, which calls nothing while unpickling and rebuilds the
index from plain values; the tensors are read with ``torch.load(weights_only=True)`` from
the files and byte ranges that index names (:mod:`qzero.optim.checkpoint_reader`). A load puts
all of it in place on every rank, or nothing on any rank ([Note: all or nothing]); whatever the
checkpoint holds, a refusal is a ``ValueError`` that names the file and the field.

The files, one role each:

* this module: the logical buffer (:func:`logical_pieces`), the DCP state dict of a checkpoint
  (:func:`sharded_state_dict`), the replica of delta gathers
  ([Note: the replica in a checkpoint]);
* :mod:`qzero.optim.checkpoint_save`: writing one, aside then renamed into place, every rank
  hearing of rank 0's failure;
* :mod:`qzero.optim.checkpoint_checks`: the refusals made before anything is read (another
  model, grouping or optimizer, [Note: the state an optimizer keeps], the index against both);
* :mod:`qzero.optim.checkpoint_load`: the load ([Note: all or nothing]);
* :mod:`qzero.optim.checkpoint_meta`, :mod:`qzero.optim.checkpoint_index`,
  :mod:`qzero.optim.checkpoint_reader`: ``qzero.json``, DCP's index and the tensor files,
  each read as untrusted input.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

from ..wire.agreement import digest
from . import error_feedback
from .checkpoint_index import show

if TYPE_CHECKING:
    from .flat import FlatGroup
    from .zero import ZeroOptimizer

#: A save writes into ``path + TMP_SUFFIX`` and moves the checkpoint it replaces to
#: ``path + OLD_SUFFIX`` until the new one is in place (:mod:`qzero.optim.checkpoint_save`).
TMP_SUFFIX = ".saving"
OLD_SUFFIX = ".replaced"


def logical_pieces(group: FlatGroup) -> list[tuple[int, int, int]]:
    """``(local offset, length, logical offset)`` of the parameter elements in this rank's
    partition. The logical buffer is the parameters back to back in model order, which is
    the same at every world size and for either flat order; adjacent pieces are merged."""
    return logical_pieces_between(group.layout, group.lo, group.hi)


def logical_pieces_between(layout, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """:func:`logical_pieces` of flat ``[lo, hi)`` (local offsets relative to ``lo``)."""
    logical = 0
    pieces: list[tuple[int, int, int]] = []
    for s in layout.slots:
        a, b = max(s.start, lo), min(s.stop, hi)
        if a < b:
            local, length, at = a - lo, b - a, logical + a - s.start
            if pieces and pieces[-1][0] + pieces[-1][1] == local and pieces[-1][2] + pieces[-1][1] == at:
                pieces[-1] = (pieces[-1][0], pieces[-1][1] + length, pieces[-1][2])
            else:
                pieces.append((local, length, at))
        logical += s.numel
    return pieces


def logical_shards(t: torch.Tensor, group: FlatGroup, opt: ZeroOptimizer):
    """Wrap this rank's pieces of a partition-shaped tensor as shards of the logical buffer."""
    n = group.layout.used_numel
    pieces = logical_pieces(group)
    if not dist.is_initialized():  # one process, no group: the whole logical buffer, as a plain tensor
        assert pieces in ([], [(0, n, 0)]), "a single rank holds the parameters back to back"
        return t[:n]
    global_rank = dist.get_rank()
    shards = [
        Shard(t[local : local + length], ShardMetadata([at], [length], f"rank:{global_rank}/{t.device}"))
        for local, length, at in pieces
    ]
    return init_from_local_shards(shards, n, process_group=opt.process_group)


def module_state(opt: ZeroOptimizer) -> dict[str, torch.Tensor]:
    """What the masters do not hold: frozen parameters and buffers (replicated)."""
    out = {f"model.{n}": p.data for n, p in opt.model.named_parameters() if not p.requires_grad}
    out.update({f"model.{n}": b for n, b in opt.model.named_buffers()})
    return out


def sharded_state_dict(opt: ZeroOptimizer) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint, keyed for DCP: sharded masters and optimizer state,
    replicated frozen parameters and buffers."""
    sd = dict(module_state(opt))
    for i, g in enumerate(opt.groups):
        sd[f"group{i}.master"] = logical_shards(g.master, g, opt)
        for key, value in opt.optimizer.state.get(g.master, {}).items():
            sd[f"group{i}.state.{key}"] = logical_shards(value, g, opt) if value.shape == g.master.shape else value
        if g.delta is not None:  # [Note: the replica in a checkpoint]
            sd[replica_key(i)] = logical_shards(g.own, g, opt)
    sd.update(error_feedback.state_entries(opt))
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


def layout_key(group: FlatGroup) -> list:
    """What the replica's bits depend on besides the values: where every parameter sits and how
    the partitions are cut into groups (JSON values)."""
    plan = group.gather_plan
    return [group.world_size, group.layout.numel, group.layout.order, plan.group_size, plan.fmt,
            digest(repr([(s.start, s.numel) for s in group.layout.slots]))]


def check_loop_state(d: dict, where: str, world: int) -> None:
    """``groups[i].delta`` of a checkpoint whose replica a load restores, saved by ``world`` ranks."""
    from .delta import LoopState

    if d.get("state") not in [s.value for s in LoopState] or type(d.get("deltas")) is not int or d["deltas"] < 0:
        raise ValueError(f"{where} is {show(d)}; expected a loop state ({[s.value for s in LoopState]}) and a count >= 0")
    dev = d.get("deviation")
    if dev is not None and (type(dev) is not list or len(dev) != world or not all(
            x is None or (type(x) in (int, float) and 0 <= x < float("inf")) for x in dev)):
        raise ValueError(f"{where}.deviation is {show(dev)}; expected one non-negative number (or null) per saving "
                         f"rank ({world})")


def replica_deviation(group: FlatGroup, chunk: int = 1 << 22) -> torch.Tensor:
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


def saved_deviations(opt: ZeroOptimizer) -> list[list[float | None] | None]:
    """Per group, every rank's :func:`replica_deviation` (None where it is not finite), for
    ``qzero.json``; None for a group without delta gathers. Collective (one all-gather) at world
    size > 1 when a group has delta gathers."""
    from ..wire.comm import all_gather_into, peer_failure

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


def restores_replica(group: FlatGroup, saved: dict) -> bool:
    """Whether a load puts the saved replica back (the same on every rank: the metadata and the
    layout are agreed on)."""
    delta = saved.get("delta")
    return group.delta is not None and isinstance(delta, dict) and delta.get("layout") == layout_key(group)
