"""The logical buffer of a flat group: its parameters back to back in model order, without the
padding, the same at every world size and for either flat order. Masters, sharded optimizer
state, the replica and the residuals' rows are saved in its coordinates."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

if TYPE_CHECKING:
    from ...layout.flat_layout import FlatLayout
    from .protocol import Checkpointable, CheckpointGroup


def logical_pieces(group: CheckpointGroup) -> list[tuple[int, int, int]]:
    """``(local offset, length, logical offset)`` of the parameter elements in this rank's
    partition. The logical buffer is the parameters back to back in model order, which is
    the same at every world size and for either flat order; adjacent pieces are merged."""
    return logical_pieces_between(group.layout, group.lo, group.hi)


def logical_pieces_between(layout: FlatLayout, lo: int, hi: int) -> list[tuple[int, int, int]]:
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


def logical_shards(t: torch.Tensor, group: CheckpointGroup, opt: Checkpointable):
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
