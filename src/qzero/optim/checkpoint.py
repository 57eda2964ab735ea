"""Reshardable checkpoints of a ZeroOptimizer through torch.distributed.checkpoint.

What is saved, per parameter group, is world-size independent: the *logical* flat
buffer (the parameters back to back, without the tail padding) of the fp32 masters
and of every optimizer state tensor shaped like them, each rank writing the piece
its partition holds (a ShardedTensor). Scalar state (Adam's ``step``) is saved
replicated. A small JSON file beside it (``qzero.json``) records the parameter
names and shapes, the state's keys and the hyperparameters; it is checked before
anything is read, so a checkpoint of another model is refused by name. Nothing is
unpickled: the tensors come from DCP's tensor files, the rest is JSON.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

if TYPE_CHECKING:
    from .flat import FlatGroup
    from .zero import ZeroOptimizer

META_FILE = "qzero.json"
FORMAT_VERSION = 1


def _sharded(t: torch.Tensor, group: FlatGroup, opt: ZeroOptimizer):
    """Wrap this rank's piece of a partition-shaped tensor as a shard of the logical buffer."""
    n = group.layout.used_numel
    a, b = min(group.lo, n), min(group.hi, n)
    shards = []
    if a < b:
        global_rank = dist.get_rank() if dist.is_initialized() else 0
        meta = ShardMetadata([a], [b - a], f"rank:{global_rank}/{t.device}")
        shards.append(Shard(t[: b - a], meta))
    return init_from_local_shards(shards, n, process_group=opt.process_group)


def _state_keys(opt: ZeroOptimizer, group: FlatGroup) -> dict[str, dict]:
    """Inner optimizer state of one group: which keys are sharded, which are scalars."""
    out = {}
    for key, value in opt.optimizer.state.get(group.master, {}).items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"optimizer state {key!r} is a {type(value).__name__}; only tensors can be checkpointed")
        sharded = value.shape == group.master.shape
        out[key] = {"sharded": sharded, "shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
    return out


def _module_state(opt: ZeroOptimizer) -> dict[str, torch.Tensor]:
    """What the masters do not hold: frozen parameters and buffers (replicated)."""
    out = {f"model.{n}": p.data for n, p in opt.model.named_parameters() if not p.requires_grad}
    out.update({f"model.{n}": b for n, b in opt.model.named_buffers()})
    return out


def sharded_state_dict(opt: ZeroOptimizer) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint, keyed for DCP: sharded masters and optimizer state,
    replicated frozen parameters and buffers."""
    sd = dict(_module_state(opt))
    for i, g in enumerate(opt.groups):
        sd[f"group{i}.master"] = _sharded(g.master, g, opt)
        for key, value in opt.optimizer.state.get(g.master, {}).items():
            sd[f"group{i}.state.{key}"] = _sharded(value, g, opt) if value.shape == g.master.shape else value
    return sd


def _metadata(opt: ZeroOptimizer) -> dict:
    groups = []
    for g, pg in zip(opt.groups, opt.optimizer.param_groups):
        hyper = {k: v for k, v in pg.items() if k != "params"}
        groups.append(
            {
                "names": g.names,
                "shapes": [list(s.shape) for s in g.layout.slots],
                "used_numel": g.layout.used_numel,
                "state": _state_keys(opt, g),
                "hyperparameters": json.loads(json.dumps(hyper, default=_json_default)),
            }
        )
    return {
        "format": FORMAT_VERSION,
        "world_size": opt.world_size,
        "optimizer": type(opt.optimizer).__name__,
        "dtype": str(opt.groups[0].dtype),
        "loss_scaler": opt.scaler.state_dict(),
        "module_state": {k: list(v.shape) for k, v in _module_state(opt).items()},
        "groups": groups,
    }


def _json_default(v):
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    if isinstance(v, tuple):
        return list(v)
    raise TypeError(f"hyperparameter value {v!r} cannot be saved as JSON")


def save_checkpoint(opt: ZeroOptimizer, path: str) -> None:
    os.makedirs(path, exist_ok=True)
    meta = _metadata(opt)
    dcp.save(sharded_state_dict(opt), checkpoint_id=path, process_group=opt.process_group)
    if opt.rank == 0:
        tmp = os.path.join(path, META_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(path, META_FILE))
    if opt.world_size > 1:
        dist.barrier(group=opt.process_group)


def read_metadata(path: str) -> dict:
    meta_path = os.path.join(path, META_FILE)
    if not os.path.isfile(meta_path):
        raise ValueError(f"{path!r} is not a qzero checkpoint: {META_FILE} is missing")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path!r}: checkpoint format {meta.get('format')!r} is not {FORMAT_VERSION}")
    return meta


def check_compatible(opt: ZeroOptimizer, meta: dict, path: str) -> None:
    """Refuse a checkpoint of another model, grouping or optimizer, naming the difference."""
    if len(meta["groups"]) != len(opt.groups):
        raise ValueError(f"{path!r} has {len(meta['groups'])} parameter groups, this optimizer has {len(opt.groups)}")
    here = {k: list(v.shape) for k, v in _module_state(opt).items()}
    if meta["module_state"] != here:
        saved_state = meta["module_state"]
        diff = sorted(set(saved_state) ^ set(here)) or [k for k in here if here[k] != saved_state[k]]
        raise ValueError(f"{path!r} was saved for another model: frozen parameters / buffers differ ({diff[:3]})")
    if meta["optimizer"] != type(opt.optimizer).__name__:
        raise ValueError(f"{path!r} holds {meta['optimizer']} state, this optimizer is {type(opt.optimizer).__name__}")
    for i, (saved, g) in enumerate(zip(meta["groups"], opt.groups)):
        shapes = [list(s.shape) for s in g.layout.slots]
        if len(saved["shapes"]) != len(shapes):
            raise ValueError(
                f"{path!r} was saved for another model: group {i} has {len(saved['shapes'])} parameters there, "
                f"{len(shapes)} here"
            )
        for k, (sn, ss, n, s) in enumerate(zip(saved["names"], saved["shapes"], g.names, shapes)):
            if ss != s:
                raise ValueError(
                    f"{path!r} was saved for another model: parameter {k} of group {i} is {sn!r} {tuple(ss)} there, "
                    f"{n!r} {tuple(s)} here"
                )


def load_checkpoint(opt: ZeroOptimizer, path: str) -> None:
    meta = read_metadata(path)
    check_compatible(opt, meta, path)
    targets, fills = dict(_module_state(opt)), []
    for i, (g, saved) in enumerate(zip(opt.groups, meta["groups"])):
        targets[f"group{i}.master"] = _sharded(g.master, g, opt)
        state = {}
        for key, spec in saved["state"].items():
            dtype = getattr(torch, spec["dtype"])
            if spec["sharded"]:
                t = torch.zeros(g.master.shape, dtype=dtype, device=g.master.device)
                targets[f"group{i}.state.{key}"] = _sharded(t, g, opt)
            else:
                t = torch.zeros(spec["shape"], dtype=dtype, device=_scalar_device(opt, g, key))
                targets[f"group{i}.state.{key}"] = t
            state[key] = t
        fills.append((g, state, saved["hyperparameters"]))
    dcp.load(targets, checkpoint_id=path, process_group=opt.process_group)
    for (g, state, hyper), pg in zip(fills, opt.optimizer.param_groups):
        # padding past the logical buffer holds zeros (it was never trained)
        n = g.layout.used_numel
        if g.hi > n:
            g.master[max(n - g.lo, 0) :].zero_()
        opt.optimizer.state[g.master] = state
        for k, v in hyper.items():
            if k in pg:
                pg[k] = tuple(v) if isinstance(pg[k], tuple) else v
    opt.scaler.load_state_dict(meta["loss_scaler"])
    for grads in opt.grads:
        grads.zero()
    # The configured gather, as after a step: resuming at the same world size is bit-exact.
    with torch.no_grad():
        for g in opt.groups:
            g.gather()


def _scalar_device(opt: ZeroOptimizer, group: FlatGroup, key: str) -> torch.device:
    """Where the inner optimizer keeps a scalar state entry (fused/capturable: the device)."""
    existing = opt.optimizer.state.get(group.master, {}).get(key)
    if existing is not None:
        return existing.device
    pg = opt.optimizer.param_groups[0]
    on_device = pg.get("fused") or pg.get("capturable")
    return group.master.device if on_device else torch.device("cpu")
