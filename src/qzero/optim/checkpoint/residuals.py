"""The error-feedback residuals' part of a checkpoint ([Note: residual] in
:mod:`qzero.optim.error_feedback`): their DCP entries, their entry in ``qzero.json``, the checks
of both, and their load.

Checkpoint form: per flat group, a 1-D bf16 tensor of ``world x parameters`` elements: ``world``
rows, each in the logical coordinates the masters are saved in (the parameters back to back;
see :mod:`qzero.optim.checkpoint.logical`), row ``r`` (at ``r x parameters``) rank ``r``'s residuals
(zeros on its own partition), each rank writing its row. A load at the same world size with the same partitions (the
checkpoint records a digest of them) reads every rank's row back: the resumed run is bit
for bit the uninterrupted one. Any other load (another world size, another flat order) sums
every element's residuals over the saved rows (fp32, in row order), rounds the sum to bf16
and gives it to one rank, the one after the element's new owner (``(owner + 1) mod world``):
what the ranks together still owe the reduction is kept, up to that rounding. A checkpoint
without residuals loads as zero residuals; a run without error feedback ignores them. Residuals
that are not finite are refused at load, and the entry's size claim (``world_size`` rows) is
checked before anything is allocated ([Note: the residuals' size claim]).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

from ...quant.gradients import RESIDUAL_DTYPE
from .index import INDEX_FILE, show
from .logical import logical_pieces_between

if TYPE_CHECKING:
    from ...layout.flat_layout import FlatLayout
    from .protocol import Checkpointable, CheckpointGroup, CheckpointResiduals

#: ``qzero.json``'s key for the residuals, and the DCP key of group ``i``'s.
META_KEY = "error_feedback"
RESIDUAL_DTYPE_NAME = "bfloat16"


def state_key(i: int) -> str:
    return f"group{i}.error_feedback"


def _partition_pieces(layout: FlatLayout, q: int) -> list[tuple[int, int, int]]:
    p = layout.partition_numel
    return logical_pieces_between(layout, q * p, (q + 1) * p)


def partitions_digest(layout: FlatLayout, two_level=None) -> int:
    """A fingerprint of where every rank's partition lies in the logical buffer (and, with
    two-level collectives, of the nodes: a rank's residuals are then of its rail's partitions)."""
    head = [layout.world_size] if two_level is None else [layout.world_size, ("two-level", *two_level)]
    text = repr(head + [_partition_pieces(layout, q) for q in range(layout.world_size)])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


def _placement(opt: Checkpointable, device: torch.device) -> str:
    return f"rank:{dist.get_rank()}/{device}"


def _row_shards(opt: Checkpointable, ef: CheckpointResiduals, own: torch.Tensor) -> list[Shard]:
    """This rank's row in logical coordinates: its residuals, and ``own`` on its own partition."""
    where = _placement(opt, ef.residual.device)
    row = ef.rank * ef.layout.used_numel
    shards = []
    for q in range(ef.world):
        src = own if q == ef.rank else ef.partition_view(q)
        for local, length, at in _partition_pieces(ef.layout, q):
            shards.append(Shard(src[local : local + length], ShardMetadata([row + at], [length], where)))
    return shards


def state_entries(opt: Checkpointable) -> dict:
    """The DCP entries of every group's residuals (none without error feedback)."""
    out = {}
    for i, ef in enumerate(opt.error_feedback):
        if ef is not None:
            own = torch.zeros(ef.partition, dtype=RESIDUAL_DTYPE, device=ef.residual.device)
            out[state_key(i)] = init_from_local_shards(_row_shards(opt, ef, own), ef.world * ef.layout.used_numel,
                                                       process_group=opt.process_group)
    return out


def metadata(opt: Checkpointable) -> dict | None:
    """What ``qzero.json`` records about the residuals (None without error feedback)."""
    if not any(ef is not None for ef in opt.error_feedback):
        return None
    return {"world_size": opt.world_size, "dtype": RESIDUAL_DTYPE_NAME,
            "partitions": [None if ef is None else partitions_digest(ef.layout, ef.two_level)
                           for ef in opt.error_feedback]}


def check_metadata(meta: dict, path: str) -> None:
    """The residuals' entry of a checkpoint's ``qzero.json``, if any, field by field; its world
    size must be the checkpoint's (``world_size``, which every rank saved at), the one
    size claim of the entry ([Note: the residuals' size claim])."""
    entry = meta.get(META_KEY)
    if entry is None:
        return
    parts = entry.get("partitions") if isinstance(entry, dict) else None
    world = entry.get("world_size") if isinstance(entry, dict) else None
    if (type(world) is not int or world < 2 or entry.get("dtype") != RESIDUAL_DTYPE_NAME
            or not isinstance(parts, list) or len(parts) != len(meta["groups"])
            or not all(p is None or type(p) is int for p in parts)):
        raise ValueError(f"{path!r}: qzero.json's {META_KEY!r} entry is {show(entry)}; expected world_size (>= 2), "
                         f"dtype {RESIDUAL_DTYPE_NAME!r} and one partition digest (or null) per group")
    if world != meta["world_size"]:
        raise ValueError(f"{path!r}: qzero.json's {META_KEY}.world_size is {world}, but the checkpoint was saved by "
                         f"{show(meta['world_size'])} ranks (world_size); loading refused")


# [Note: the residuals' size claim]
# The residuals' entry of a checkpoint holds a row per saving rank: ``world_size x parameters``
# elements, the only size in a checkpoint that the loading model does not bound. A load at another
# world size reads, per rank, every saved row of one partition (``world_size x partition``
# elements, one shard per row), so a claim of many ranks costs memory and time before a tensor is
# read. It is checked before anything is allocated: ``world_size`` must be the checkpoint's own,
# and the index must hold the rows it claims: every rank writes its own row, so in a genuine index
# each chunk of the entry lies inside one row and (the chunks tile the entry) there are at least
# ``world_size`` of them. A claim of N ranks then needs an index of N chunk records and tensor
# files of N rows (the index's storage entries may not be shorter than their chunks: see
# :mod:`qzero.optim.checkpoint.index`), as a checkpoint genuinely saved by N ranks has.


def check_index(opt: Checkpointable, meta: dict, index, path: str) -> None:
    """Every chunk of a residual entry the load reads lies inside one saved rank's row
    ([Note: the residuals' size claim])."""
    for i, ef in enumerate(opt.error_feedback):
        saved = _saved(meta, i)
        entry = index.state_dict_metadata.get(state_key(i))
        if ef is None or saved is None or entry is None or len(entry.size) != 1:
            continue  # a missing or misshapen entry is refused by its size
        n = ef.layout.used_numel
        for chunk in entry.chunks:
            (o,), (size,) = chunk.offsets, chunk.sizes
            if size and o // n != (o + size - 1) // n:
                raise ValueError(
                    f"{path!r}: the checkpoint index {INDEX_FILE} gives {state_key(i)} a chunk of {show(size)} "
                    f"elements at {show(o)} that spans the rows of several ranks "
                    f"(each rank writes its own row of {n}); "
                    f"it cannot hold the residuals of the {saved[0]} ranks qzero.json claims")


def _saved(meta: dict, i: int):
    entry = meta.get(META_KEY)
    if entry is None or entry["partitions"][i] is None:
        return None
    return entry["world_size"], entry["partitions"][i]


def expected_entries(opt: Checkpointable, meta: dict) -> dict[str, tuple[list[int], torch.dtype]]:
    """DCP entries a load will read, with their sizes and dtypes."""
    out = {}
    for i, ef in enumerate(opt.error_feedback):
        saved = _saved(meta, i)
        if ef is not None and saved is not None:
            out[state_key(i)] = ([saved[0] * ef.layout.used_numel], RESIDUAL_DTYPE)
    return out


class ResidualLoad:
    """The residuals' part of one checkpoint load: what DCP reads them into, and how they are
    put in place. A load at the same world size and partitions reads every rank's row straight
    into its residual buffer (``in_place``: the loader keeps a copy to put back on a refusal);
    a resharded one reads the saved rows of the partition this rank now carries into buffers
    of their own and sums them (at :meth:`check_finite`, put in place at :meth:`commit`);
    without saved residuals :meth:`commit` zeroes them. Residuals that are not finite are
    refused by :meth:`check_finite` before anything is put in place."""

    def __init__(self, opt: Checkpointable, meta: dict):
        """Local only (no collective): it runs before the ranks agree."""
        self.opt = opt
        self._direct, self._summed, self._zeroed = [], [], []
        for i, ef in enumerate(opt.error_feedback):
            if ef is None:
                continue
            saved = _saved(meta, i)
            if saved is None:
                self._zeroed.append(ef)
            elif saved[0] == ef.world and saved[1] == partitions_digest(ef.layout, ef.two_level):
                self._direct.append((i, ef, torch.zeros(ef.partition, dtype=RESIDUAL_DTYPE, device=ef.residual.device)))
            else:  # resharded: this rank carries the residuals of the partition before its own (in its
                # block of ranks that send to each other: one it sends to), every saved row
                q = ef.rank // ef.block * ef.block + (ef.rank % ef.block - 1) % ef.block
                pieces = [(local, torch.zeros(saved[0], length, dtype=RESIDUAL_DTYPE, device=ef.residual.device), at)
                          for local, length, at in _partition_pieces(ef.layout, q)]
                self._summed.append((i, ef, q, pieces, saved[0]))
        self._sums: list[list[torch.Tensor]] = []

    @property
    def in_place(self) -> list[torch.Tensor]:
        return [ef.residual for _, ef, _ in self._direct]

    def targets(self) -> dict:
        """DCP targets (collective at world size > 1: it builds ShardedTensors)."""
        out, pg = {}, self.opt.process_group
        for i, ef, scratch in self._direct:
            out[state_key(i)] = init_from_local_shards(_row_shards(self.opt, ef, scratch),
                                                       ef.world * ef.layout.used_numel, process_group=pg)
        for i, ef, _, pieces, world in self._summed:
            n = ef.layout.used_numel
            where = _placement(self.opt, ef.residual.device)
            shards = [Shard(rows[r], ShardMetadata([r * n + at], [rows.shape[1]], where))
                      for _, rows, at in pieces for r in range(world)]
            out[state_key(i)] = init_from_local_shards(shards, world * n, process_group=pg)
        return out

    def check_finite(self, path: str) -> None:
        """Refuse residuals read that are not finite (NaN, Inf, or a value beyond bf16's range,
        which the copy into bf16 made Inf), naming the entry, the saved rank's row and the
        parameter: the next step would take them for non-finite gradients. A resharded load's
        sums are taken here (and refused likewise when they overflow bf16)."""
        for i, ef, scratch in self._direct:
            for buf, own in ((ef.residual, False), (scratch, True)):
                bad = _first_non_finite(buf)
                if bad is not None:
                    q = ef.rank if own else bad // ef.partition + (bad // ef.partition >= ef.rank)
                    flat = q * ef.partition + (bad if own else bad % ef.partition)
                    raise _non_finite(path, i, self.opt.groups[i], flat, f"rank {ef.rank}'s row")
        self._sums = []
        for i, ef, q, pieces, _ in self._summed:
            sums = []
            for local, rows, _ in pieces:
                flat = q * ef.partition + local
                for r, row in enumerate(rows):
                    bad = _first_non_finite(row)
                    if bad is not None:
                        raise _non_finite(path, i, self.opt.groups[i], flat + bad, f"rank {r}'s row")
                total = torch.zeros(rows.shape[1], dtype=torch.float32, device=rows.device)
                for row in rows:  # fp32, in the saved ranks' order
                    total += row.to(torch.float32)
                total = total.to(RESIDUAL_DTYPE)
                bad = _first_non_finite(total)
                if bad is not None:
                    raise _non_finite(path, i, self.opt.groups[i], flat + bad, "the sum of the saved ranks' rows")
                sums.append(total)
            self._sums.append(sums)

    def commit(self) -> None:
        """Put the residuals in place (after :meth:`check_finite`; nothing here can refuse)."""
        for ef in self._zeroed:
            ef.reset()
        for (_, ef, q, pieces, _), sums in zip(self._summed, self._sums, strict=True):
            ef.reset()
            dst = ef.partition_view(q)
            for (local, rows, _), total in zip(pieces, sums):
                dst[local : local + rows.shape[1]].copy_(total)


def _first_non_finite(t: torch.Tensor) -> int | None:
    """The index of ``t``'s first non-finite element (one host sync when there is none)."""
    if bool(torch.isfinite(t).all()):
        return None
    return int((~torch.isfinite(t)).nonzero()[0, 0])


def _non_finite(path: str, i: int, group: CheckpointGroup, flat: int, row: str) -> ValueError:
    slot = next((s for s in group.layout.slots if s.start <= flat < s.stop), None)
    where = f"{group.names[slot.index]!r}" if slot is not None else f"padding at flat index {flat}"
    return ValueError(f"{path!r}: the error-feedback residuals {state_key(i)} ({row}) hold a non-finite value (NaN, "
                      f"Inf, or beyond bfloat16's range) for {where}; the next step would take it for a non-finite "
                      f"gradient; loading refused")
