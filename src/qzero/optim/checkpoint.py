"""Reshardable checkpoints of a ZeroOptimizer through torch.distributed.checkpoint.

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
the files and byte ranges that index names. A load puts all of it in place on every rank,
or nothing on any rank ([Note: all or nothing]); whatever the checkpoint holds, a refusal
is a ``ValueError`` that names the file and the field.
"""

from __future__ import annotations

import collections
import json
import math
import os
import shutil
import stat
import warnings
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards
from torch.distributed.checkpoint.api import CheckpointException

from ..wire.agreement import digest
from . import error_feedback
from .checkpoint_index import INDEX_FILE, IndexedReader, castable, read_index, show
from .checkpoint_meta import FORMAT_VERSION, META_FILE, STATE_DTYPES, read_metadata, write_metadata

if TYPE_CHECKING:
    from .flat import FlatGroup
    from .zero import ZeroOptimizer

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


def _sharded(t: torch.Tensor, group: FlatGroup, opt: ZeroOptimizer):
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
        if g.delta is not None:  # [Note: the replica in a checkpoint]
            sd[replica_key(i)] = _sharded(g.own, g, opt)
    sd.update(error_feedback.state_entries(opt))
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
                **({"delta": {**g.delta.state_dict(), "layout": layout_key(g)}} if g.delta is not None else {}),
            }
        )
    meta = {
        "format": FORMAT_VERSION,
        "world_size": opt.world_size,
        "optimizer": type(opt.optimizer).__name__,
        "dtype": str(opt.groups[0].dtype),
        "loss_scaler": opt.scaler.state_dict(),
        "module_state": {k: list(v.shape) for k, v in _module_state(opt).items()},
        "groups": groups,
    }
    residuals = error_feedback.metadata(opt)
    if residuals is not None:
        meta[error_feedback.META_KEY] = residuals
    return meta


def _json_default(v):
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    if isinstance(v, tuple):
        return list(v)
    raise TypeError(f"hyperparameter value {v!r} cannot be saved as JSON")


def save_checkpoint(opt: ZeroOptimizer, path: str) -> None:
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

    _on_rank_0(opt, clear, f"save_checkpoint({path!r}): rank 0 could not clear {tmp!r}; nothing was written")
    dcp.save(sharded_state_dict(opt), storage_writer=dcp.FileSystemWriter(tmp), process_group=opt.process_group)
    _on_rank_0(opt, publish, f"save_checkpoint({path!r}): rank 0 could not put the checkpoint in place (its "
                             f"error says why); {path!r} holds the previous checkpoint, if there was one")


def _on_rank_0(opt: ZeroOptimizer, work, failed: str) -> None:
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


def resolve_checkpoint(path: str) -> str:
    """``path``, or the previous checkpoint a killed save left beside it."""
    path = os.path.abspath(path).rstrip(os.sep)
    if os.path.isfile(os.path.join(path, META_FILE)):
        return path
    old = path + OLD_SUFFIX
    if os.path.isfile(os.path.join(old, META_FILE)):
        warnings.warn(f"{path} is missing (a save was interrupted); loading the previous checkpoint {old}", stacklevel=3)
        return old
    return path


def read_checked_index(path: str):
    """The DCP index of ``path`` (read safely: see :mod:`qzero.optim.checkpoint_index`) and its
    raw bytes, after making sure every file it names is a regular file long enough."""
    index, raw = read_index(path)
    need: dict[str, int] = {}
    for info in index.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in need.items():
        try:
            st = os.lstat(os.path.join(path, rel))
        except OSError:
            st = None
        if st is None or not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path!r}: tensor file {show(rel)} is missing or not a regular file (a link is refused)")
        if st.st_size < size:
            raise ValueError(f"{path!r}: tensor file {show(rel)} is truncated (needs {size} bytes, has {st.st_size})")
    return index, raw


def check_index_matches(opt: ZeroOptimizer, meta: dict, index, path: str) -> None:
    """Every tensor the load will read is in the index with the size this optimizer expects,
    in a dtype that can be copied into where it goes."""
    expected = {k: (list(v.shape), v.dtype) for k, v in _module_state(opt).items()}
    for i, (g, saved) in enumerate(zip(opt.groups, meta["groups"])):
        expected[f"group{i}.master"] = ([g.layout.used_numel], g.master.dtype)
        for key, spec in saved["state"].items():
            dtype = STATE_DTYPES[spec["dtype"]]
            if spec["sharded"]:
                expected[f"group{i}.state.{key}"] = ([g.layout.used_numel], dtype)
            else:
                if math.prod(spec["shape"]) > g.master.numel():
                    raise ValueError(
                        f"{path!r}: {META_FILE} declares state {show(key)} of group {i} larger than its group"
                    )
                expected[f"group{i}.state.{key}"] = (spec["shape"], dtype)
        if restores_replica(g, saved):  # [Note: the replica in a checkpoint]
            check_loop_state(saved["delta"], f"{path!r}: {META_FILE} groups[{i}].delta")
            expected[replica_key(i)] = ([g.layout.used_numel], g.dtype)
    expected.update(error_feedback.expected_entries(opt, meta))
    for fqn, (shape, dtype) in expected.items():
        entry = index.state_dict_metadata.get(fqn)
        if entry is None:
            raise ValueError(f"{path!r}: the checkpoint index {INDEX_FILE} has no entry {show(fqn)}")
        if list(entry.size) != shape:
            raise ValueError(
                f"{path!r}: the checkpoint index {INDEX_FILE} gives {show(fqn)} size {list(entry.size)}, "
                f"{META_FILE} {shape}"
            )
        if not castable(entry.properties.dtype, dtype):
            raise ValueError(f"{path!r}: the checkpoint index {INDEX_FILE} gives {show(fqn)} dtype "
                             f"{entry.properties.dtype}, which cannot be loaded into {dtype}")


def check_compatible(opt: ZeroOptimizer, meta: dict, path: str) -> None:
    """Refuse a checkpoint of another model, grouping or optimizer, naming the difference."""
    if len(meta["groups"]) != len(opt.groups):
        raise ValueError(f"{path!r} has {len(meta['groups'])} parameter groups, this optimizer has {len(opt.groups)}")
    here = {k: list(v.shape) for k, v in _module_state(opt).items()}
    if meta["module_state"] != here:
        saved_state = meta["module_state"]
        diff = sorted(set(saved_state) ^ set(here)) or [k for k in here if here[k] != saved_state[k]]
        raise ValueError(f"{path!r} was saved for another model: frozen parameters / buffers differ "
                         f"({show(diff[:3])})")
    if meta["optimizer"] != type(opt.optimizer).__name__:
        saved = meta["optimizer"] if meta["optimizer"].isidentifier() and len(meta["optimizer"]) <= 60 else show(
            meta["optimizer"])
        raise ValueError(f"{path!r} holds {saved} state, this optimizer is {type(opt.optimizer).__name__}")
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
                    f"{path!r} was saved for another model: parameter {k} of group {i} is {show(sn)} {tuple(ss)} "
                    f"there, {n!r} {tuple(s)} here"
                )
        if saved["used_numel"] != g.layout.used_numel:
            raise ValueError(f"{path!r}: {META_FILE} groups[{i}].used_numel is {saved['used_numel']}; its shapes "
                             f"hold {g.layout.used_numel} elements")
    for i, (saved, pg) in enumerate(zip(meta["groups"], opt.optimizer.param_groups)):
        for k, v in saved["hyperparameters"].items():
            if k in pg and not _same_kind(pg[k], v):
                raise ValueError(
                    f"{path!r}: {META_FILE} groups[{i}].hyperparameters.{k} is {show(v)}; {show(pg[k])} here is not "
                    "of that kind"
                )


def _same_kind(here, saved) -> bool:
    """A saved hyperparameter may replace the current one: JSON of the same shape, finite numbers."""

    def number(v) -> bool:
        return type(v) in (int, float) and math.isfinite(v)

    if isinstance(here, torch.Tensor) and here.numel() == 1:
        return number(saved)
    if here is None or isinstance(here, bool):  # flags such as foreach / fused: None or a bool
        return saved is None or type(saved) is bool
    if isinstance(here, str):
        return type(saved) is str
    if isinstance(here, (int, float)):
        return number(saved) or (not math.isfinite(here) and type(saved) is float)
    if isinstance(here, (tuple, list)):
        return type(saved) is list and len(saved) == len(here) and all(_same_kind(a, b) for a, b in zip(here, saved))
    return False


def _resumed_hyperparameters(pg: dict, saved: dict) -> dict:
    """A parameter group's hyperparameters once the checkpoint's are in place (no ``params``)."""
    out = {k: v for k, v in pg.items() if k != "params"}
    for k, v in saved.items():
        if k in out:
            out[k] = tuple(v) if isinstance(out[k], tuple) else v
    return out


# --------------------------------------------------------------------------- the state an optimizer keeps

# [Note: the state an optimizer keeps]
# The optimizer state a checkpoint may bring is the state the inner optimizer itself keeps
# with the hyperparameters the load puts in place: the same keys, each shaped like the
# parameter ("sharded") or a fixed-shape scalar, of the same dtype. Which that is, is asked of
# the optimizer: a copy of it that shares nothing it writes (its own state, one parameter
# group over a fresh 2-element fp32 parameter on the masters' device, no step hooks) takes
# one step with a zero gradient. So AdamW's checkpoint must hold step / exp_avg / exp_avg_sq
# (and max_exp_avg_sq exactly when amsgrad is on), fp32, and nothing else; a checkpoint saved
# before the first step holds no state, which is accepted as well. Should the trial step
# raise (an optimizer that needs a closure, say), the state the optimizer holds now stands in
# for it; without either the load is refused.


def _trial_state(opt: ZeroOptimizer, group: FlatGroup, hyper: dict) -> tuple[dict, torch.Tensor]:
    """The inner optimizer's state after one trial step, and the parameter it was taken on."""
    inner = opt.optimizer
    param = torch.zeros(2, dtype=group.master.dtype, device=group.master.device)
    param.grad = torch.zeros_like(param)
    probe = object.__new__(type(inner))
    probe.__dict__.update(inner.__dict__)
    probe.state = collections.defaultdict(dict)
    probe.param_groups = [{**hyper, "params": [param]}]
    probe._optimizer_step_pre_hooks = collections.OrderedDict()
    probe._optimizer_step_post_hooks = collections.OrderedDict()
    step = type(inner).step
    step = getattr(step, "__wrapped__", step) if getattr(step, "hooked", False) else step  # no global hooks
    step(probe)
    return {k: v for k, v in probe.state[param].items() if isinstance(v, torch.Tensor)}, param


def kept_state(opt: ZeroOptimizer, meta: dict, path: str) -> list[dict[str, dict]]:
    """Per group, what the inner optimizer keeps with the checkpoint's hyperparameters: key ->
    ``{"sharded", "shape", "dtype", "device"}`` ([Note: the state an optimizer keeps])."""
    name = type(opt.optimizer).__name__
    out = []
    for g, saved, pg in zip(opt.groups, meta["groups"], opt.optimizer.param_groups):
        try:
            state, like = _trial_state(opt, g, _resumed_hyperparameters(pg, saved["hyperparameters"]))
        except Exception as e:  # noqa: BLE001 - any optimizer may be inside
            state, like = opt.optimizer.state.get(g.master, {}), g.master
            if not state:
                raise ValueError(
                    f"{path!r}: cannot tell which state {name} keeps (a trial step raised {type(e).__name__}: "
                    f"{show(str(e))}), and it holds none yet: step it once before loading"
                ) from None
        out.append({
            k: {"sharded": v.shape == like.shape, "shape": list(v.shape),
                "dtype": str(v.dtype).removeprefix("torch."), "device": g.master.device if v.device == like.device
                else v.device}
            for k, v in state.items() if isinstance(v, torch.Tensor)
        })
    return out


def check_state(opt: ZeroOptimizer, meta: dict, kept: list[dict[str, dict]], path: str) -> None:
    """The checkpoint's optimizer state is what the inner optimizer keeps, or none at all."""
    name = type(opt.optimizer).__name__
    for i, (saved, want) in enumerate(zip(meta["groups"], kept)):
        state = saved["state"]
        if not state:
            continue  # saved before the first step
        at = f"{path!r}: {META_FILE} groups[{i}].state"
        extra = [k for k in state if k not in want]
        if extra:
            raise ValueError(f"{at} declares {show(extra[0])}, which {name} does not keep with these hyperparameters "
                             f"({name} keeps {sorted(want)})")
        missing = [k for k in want if k not in state]
        if missing:
            raise ValueError(f"{at} lacks {missing[0]!r}, which {name} keeps with the hyperparameters it gives "
                             f"({name} keeps {sorted(want)})")
        for key, spec in state.items():
            w = want[key]
            if spec["sharded"] != w["sharded"] or (not w["sharded"] and spec["shape"] != w["shape"]):
                got = "shaped like the parameters" if spec["sharded"] else f"of shape {show(spec['shape'])}"
                keeps = "shaped like the parameters" if w["sharded"] else f"of shape {w['shape']}"
                raise ValueError(f"{at}.{key} is {got}; {name} keeps it {keeps}")
            if spec["dtype"] != w["dtype"]:
                raise ValueError(f"{at}.{key} is {spec['dtype']}; {name} keeps it as {w['dtype']}")


# --------------------------------------------------------------------------- loading

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


def load_checkpoint(opt: ZeroOptimizer, path: str) -> None:
    """See [Note: all or nothing]."""
    from ..wire.comm import agree_or_raise

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

    def __init__(self, opt: ZeroOptimizer, meta: dict, kept: list[dict[str, dict]]):
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
        self.residuals = error_feedback.ResidualLoad(opt, meta)
        # delta gathers: the groups whose replica the checkpoint restores ([Note: the replica in a checkpoint])
        self.replicas = [restores_replica(g, saved) for g, saved in zip(opt.groups, meta["groups"])]
        # what is read in place, copied aside (to the host) to be put back on a refusal
        self._in_place = ([g.master for g in opt.groups] + list(_module_state(opt).values())
                          + [g.own for g, r in zip(opt.groups, self.replicas) if r] + self.residuals.in_place)
        self._saved = [t.detach().to("cpu", copy=True) for t in self._in_place]

    def targets(self) -> dict:
        """The state dict DCP reads into (collective at world size > 1: it builds ShardedTensors)."""
        opt = self.opt
        out: dict = dict(_module_state(opt))
        for i, (g, state) in enumerate(zip(opt.groups, self.states)):
            out[f"group{i}.master"] = _sharded(g.master, g, opt)
            specs = self.meta["groups"][i]["state"]
            for key, t in state.items():
                out[f"group{i}.state.{key}"] = _sharded(t, g, opt) if specs[key]["sharded"] else t
            if self.replicas[i]:
                out[replica_key(i)] = _sharded(g.own, g, opt)
        out.update(self.residuals.targets())
        return out

    def undo(self) -> None:
        with torch.no_grad():
            for t, saved in zip(self._in_place, self._saved):
                t.copy_(saved)

    def agree_after_read(self, path: str) -> None:
        """Finite masters and state; the same replicated tensors on every rank (one exchange,
        [Note: agreement] in qzero/wire/agreement.py: a differing tensor is named by its details)."""
        from ..wire.comm import agree_or_raise

        replicated = dict(_module_state(self.opt))
        for i, state in enumerate(self.states):
            for key, spec in self.meta["groups"][i]["state"].items():
                if not spec["sharded"]:
                    replicated[f"group{i}.state.{key}"] = state[key]
        error, fields, details = None, None, None
        try:
            self._check_finite(path)
            digests = {name: f"bytes digest {_tensor_digest(t):016x}" for name, t in sorted(replicated.items())}
            name = "a replicated tensor (frozen parameter, buffer or scalar optimizer state)"
            fields, details = {name: digest(json.dumps(digests))}, {name: digests}
        except ValueError as e:
            error = e
        except Exception as e:  # noqa: BLE001 - the other ranks must hear of it
            error = ValueError(f"{path!r}: checking the tensors read failed ({type(e).__name__}: {show(str(e))})")
        agree_or_raise(self.opt.process_group, self.opt.world_size, self.opt.groups[0].master.device, error, fields,
                       f"load_checkpoint({path!r}), after reading", details)

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

    def commit(self) -> None:
        """Put the read state in place (nothing here can refuse) and gather the weights."""
        opt = self.opt
        self._saved = []
        for g, state, saved, pg in zip(opt.groups, self.states, self.meta["groups"], opt.optimizer.param_groups):
            for a, b in g.layout.padding_ranges(g.lo, g.hi):  # padding holds zeros (it was never trained)
                g.master[a:b].zero_()
            opt.optimizer.state[g.master] = state
            for k, v in _resumed_hyperparameters(pg, saved["hyperparameters"]).items():
                pg[k] = v
        opt.scaler.load_state_dict(self.meta["loss_scaler"])
        self.residuals.commit()
        for grads in opt.grads:
            grads.zero()
        # The configured gather, as after a step: resuming at the same world size is bit-exact.
        # Delta gathers: the saved replica, or an exact resync ([Note: the replica in a checkpoint]).
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


def replica_key(i: int) -> str:
    return f"group{i}.replica"


def layout_key(group: FlatGroup) -> list:
    """What the replica's bits depend on besides the values: where every parameter sits and how
    the partitions are cut into groups (JSON values)."""
    plan = group.gather_plan
    return [group.world_size, group.layout.numel, group.layout.order, plan.group_size, plan.fmt,
            digest(repr([(s.start, s.numel) for s in group.layout.slots]))]


def check_loop_state(d: dict, where: str) -> None:
    from .delta import LoopState

    if d.get("state") not in [s.value for s in LoopState] or type(d.get("deltas")) is not int or d["deltas"] < 0:
        raise ValueError(f"{where} is {show(d)}; expected a loop state ({[s.value for s in LoopState]}) and a count >= 0")


def restores_replica(group: FlatGroup, saved: dict) -> bool:
    """Whether a load puts the saved replica back (the same on every rank: the metadata and the
    layout are agreed on)."""
    delta = saved.get("delta")
    return group.delta is not None and isinstance(delta, dict) and delta.get("layout") == layout_key(group)
