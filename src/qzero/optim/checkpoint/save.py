"""Saving a checkpoint: its ``qzero.json`` from the optimizer, the tensors through DCP, written
aside and renamed into place, with rank 0's failures raised on every rank."""

from __future__ import annotations

import json
import os
import shutil
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ...wire.comm import peer_failure
from . import residuals
from .form import OLD_SUFFIX, TMP_SUFFIX, layout_key, module_state, saved_deviations, sharded_state_dict
from .meta import FORMAT_VERSION, write_metadata

if TYPE_CHECKING:
    from .protocol import Checkpointable, CheckpointGroup


def _state_keys(opt: Checkpointable, group: CheckpointGroup) -> dict[str, dict]:
    """Inner optimizer state of one group: which keys are sharded, which are scalars."""
    out = {}
    for key, value in opt.optimizer.state.get(group.master, {}).items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"optimizer state {key!r} is a {type(value).__name__}; only tensors can be checkpointed")
        sharded = value.shape == group.master.shape
        out[key] = {"sharded": sharded, "shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
    return out


def _metadata(opt: Checkpointable) -> dict:
    groups = []
    deviations = saved_deviations(opt)  # [Note: the replica in a checkpoint]
    for g, pg, deviation in zip(opt.groups, opt.optimizer.param_groups, deviations):
        hyper = {k: v for k, v in pg.items() if k != "params"}
        groups.append(
            {
                "names": g.names,
                "shapes": [list(s.shape) for s in g.layout.slots],
                "used_numel": g.layout.used_numel,
                "state": _state_keys(opt, g),
                "hyperparameters": json.loads(json.dumps(hyper, default=_json_default)),
                **({"delta": {**g.delta.state_dict(), "layout": layout_key(g), "deviation": deviation}}
                   if g.delta is not None else {}),
            }
        )
    meta = {
        "format": FORMAT_VERSION,
        "world_size": opt.world_size,
        "optimizer": type(opt.optimizer).__name__,
        "dtype": str(opt.groups[0].dtype),
        "loss_scaler": opt.scaler.state_dict(),
        "module_state": {k: list(v.shape) for k, v in module_state(opt).items()},
        "groups": groups,
    }
    saved_residuals = residuals.metadata(opt)
    if saved_residuals is not None:
        meta[residuals.META_KEY] = saved_residuals
    return meta


def _json_default(v):
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    if isinstance(v, tuple):
        return list(v)
    raise TypeError(f"hyperparameter value {v!r} cannot be saved as JSON")


def save_checkpoint(opt: Checkpointable, path: str) -> None:
    """Write aside, then rename into place: a save killed at any point leaves the previous
    checkpoint at ``path`` (or, between the two renames, at ``path + ".replaced"``, which
    :func:`load_checkpoint` falls back to). What rank 0 does on its own (clearing a killed
    save's leftovers, the metadata file, the renames) ends in one exchange with the other
    ranks, so that its failure (a full disk, a permission) raises on every rank instead of
    leaving them waiting in the next collective."""
    path = os.path.abspath(path).rstrip(os.sep)
    tmp, old = path + TMP_SUFFIX, path + OLD_SUFFIX
    meta = _metadata(opt)

    def clear():
        if os.path.exists(tmp):
            shutil.rmtree(tmp)  # left by a save that was killed

    def publish():
        write_metadata(tmp, meta)  # last: its presence marks a complete checkpoint
        _fsync_dir(tmp)
        if os.path.exists(path):
            if os.path.exists(old):
                shutil.rmtree(old)
            os.rename(path, old)
        os.rename(tmp, path)
        _fsync_dir(os.path.dirname(path))
        if os.path.exists(old):
            shutil.rmtree(old)

    _on_rank_0(opt, clear, f"save_checkpoint({path!r}): rank 0 could not clear {tmp!r}; nothing was written",
               f"clearing {tmp!r}")
    with peer_failure(f"save_checkpoint({path!r}): writing the tensors"):
        dcp.save(sharded_state_dict(opt), storage_writer=dcp.FileSystemWriter(tmp), process_group=opt.process_group)
    _on_rank_0(opt, publish, f"save_checkpoint({path!r}): rank 0 could not put the checkpoint in place (its "
                             f"error says why); {path!r} holds the previous checkpoint, if there was one",
               f"putting {path!r} in place")


def _on_rank_0(opt: Checkpointable, work, failed: str, what: str) -> None:
    """Run ``work`` on rank 0 alone, then let every rank learn whether it succeeded (one
    1-element all-reduce, in place of a barrier): rank 0 raises its own error, every other
    rank a ``RuntimeError`` saying ``failed``."""
    error = None
    if opt.rank == 0:
        try:
            work()
        except Exception as e:  # noqa: BLE001 - any failure must reach the other ranks
            error = e
    failure = error is not None
    if opt.world_size > 1:
        flag = torch.tensor([int(failure)], dtype=torch.int64, device=opt.groups[0].master.device)
        with peer_failure(f"save_checkpoint: rank 0's report on {what}"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=opt.process_group)
            failure = bool(flag.item())
    if error is not None:
        raise error
    if failure:
        raise RuntimeError(failed)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
