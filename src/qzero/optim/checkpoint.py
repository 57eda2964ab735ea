"""Reshardable checkpoints of a ZeroOptimizer through torch.distributed.checkpoint.

What is saved, per parameter group, is world-size independent: the *logical* flat
buffer (the parameters back to back, without the tail padding) of the fp32 masters
and of every optimizer state tensor shaped like them, each rank writing the piece
its partition holds (a ShardedTensor). Scalar state (Adam's ``step``) is saved
replicated. A small JSON file beside it (``qzero.json``) records the parameter
names and shapes, the state's keys and the hyperparameters; it is checked before
anything is read, so a checkpoint of another model is refused by name.

A checkpoint directory is untrusted input. ``qzero.json`` is JSON, checked field by
field. DCP's index (``.metadata``, a pickle) is read once by
:mod:`qzero.optim.checkpoint_index`, which calls nothing while unpickling and rebuilds
the index from plain values; the tensors are read with ``torch.load(weights_only=True)``
from the files and byte ranges that index names. All of this is checked, on every
rank, before any tensor of the optimizer is written.
"""

from __future__ import annotations

import hashlib
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

from .checkpoint_index import INDEX_FILE, IndexedReader, read_index

if TYPE_CHECKING:
    from .flat import FlatGroup
    from .zero import ZeroOptimizer

META_FILE = "qzero.json"
FORMAT_VERSION = 1
TMP_SUFFIX = ".saving"
OLD_SUFFIX = ".replaced"


def logical_pieces(group: FlatGroup) -> list[tuple[int, int, int]]:
    """``(local offset, length, logical offset)`` of the parameter elements in this rank's
    partition. The logical buffer is the parameters back to back in model order, which is
    the same at every world size and for either flat order; adjacent pieces are merged."""
    layout, lo, hi = group.layout, group.lo, group.hi
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
    """Write aside, then rename into place: a save killed at any point leaves the previous
    checkpoint at ``path`` (or, between the two renames, at ``path + ".replaced"``, which
    :func:`load_checkpoint` falls back to)."""
    path = os.path.abspath(path).rstrip(os.sep)
    tmp, old = path + TMP_SUFFIX, path + OLD_SUFFIX
    meta = _metadata(opt)
    if opt.rank == 0 and os.path.exists(tmp):
        shutil.rmtree(tmp)  # left by a save that was killed
    _barrier(opt)
    dcp.save(sharded_state_dict(opt), storage_writer=dcp.FileSystemWriter(tmp), process_group=opt.process_group)
    if opt.rank == 0:
        _write_json(os.path.join(tmp, META_FILE), meta)  # last: its presence marks a complete checkpoint
        _fsync_dir(tmp)
        if os.path.exists(path):
            if os.path.exists(old):
                shutil.rmtree(old)
            os.rename(path, old)
        os.rename(tmp, path)
        _fsync_dir(os.path.dirname(path))
        if os.path.exists(old):
            shutil.rmtree(old)
    _barrier(opt)


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _barrier(opt: ZeroOptimizer) -> None:
    if opt.world_size > 1:
        dist.barrier(group=opt.process_group)


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


def read_metadata(path: str) -> dict:
    """``qzero.json`` of the checkpoint at ``path``, checked field by field."""
    meta_path = os.path.join(path, META_FILE)
    if not os.path.isfile(meta_path):
        raise ValueError(f"{path!r} is not a qzero checkpoint: {META_FILE} is missing")
    try:
        with open(meta_path, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ValueError(f"{path!r}: {META_FILE} is not a regular file")
            meta = json.loads(f.read().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, OSError) as e:
        raise ValueError(f"{path!r}: {META_FILE} is not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{path!r}: checkpoint format {got!r} is not {FORMAT_VERSION}")
    _check_schema(meta, path)
    return meta


#: Dtypes a checkpoint's optimizer state may declare (resolved by this table, never by getattr).
STATE_DTYPES = {
    name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8")
}
_SCHEMA = {"optimizer": str, "module_state": dict, "loss_scaler": dict, "groups": list, "world_size": int}
_GROUP_SCHEMA = {"names": list, "shapes": list, "used_numel": int, "state": dict, "hyperparameters": dict}


def _check_schema(meta: dict, path: str) -> None:
    """Every field load_checkpoint reads is present and of the right type."""

    def need(obj: dict, schema: dict, where: str) -> None:
        for key, kind in schema.items():
            if not isinstance(obj.get(key), kind):
                raise ValueError(f"{path!r}: {META_FILE} lacks a valid {where}{key!r} ({kind.__name__} expected)")

    need(meta, _SCHEMA, "")
    for i, g in enumerate(meta["groups"]):
        if not isinstance(g, dict):
            raise ValueError(f"{path!r}: {META_FILE} group {i} is not an object")
        need(g, _GROUP_SCHEMA, f"groups[{i}].")
        for key, spec in g["state"].items():
            if not isinstance(spec, dict) or spec.get("dtype") not in STATE_DTYPES or not isinstance(
                spec.get("shape"), list
            ) or not isinstance(spec.get("sharded"), bool):
                raise ValueError(
                    f"{path!r}: {META_FILE} declares state {key!r} of group {i} as {spec!r}; expected "
                    f"sharded/shape/dtype with dtype one of {sorted(STATE_DTYPES)}"
                )
            if not all(type(d) is int and d >= 0 for d in spec["shape"]):
                raise ValueError(f"{path!r}: {META_FILE} declares state {key!r} of group {i} with shape {spec['shape']!r}")
    scaler = meta["loss_scaler"]
    for key in _SCALER_INTS:
        if type(scaler.get(key)) is not int:
            raise ValueError(f"{path!r}: {META_FILE} loss_scaler.{key} is {scaler.get(key)!r}, expected an int")
    scale = scaler.get("scale")
    if type(scale) not in (int, float) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{path!r}: {META_FILE} loss_scaler.scale is {scale!r}, expected a positive number")


_SCALER_INTS = ("clean_steps", "hysteresis_left", "skipped_steps")


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
            raise ValueError(f"{path!r}: tensor file {rel!r} is missing or not a regular file (a link is refused)")
        if st.st_size < size:
            raise ValueError(f"{path!r}: tensor file {rel!r} is truncated (needs {size} bytes, has {st.st_size})")
    return index, raw


def check_index_matches(opt: ZeroOptimizer, meta: dict, index, path: str) -> None:
    """Every tensor the load will read is in the index with the size this optimizer expects."""
    expected = {k: list(v.shape) for k, v in _module_state(opt).items()}
    for i, (g, saved) in enumerate(zip(opt.groups, meta["groups"])):
        expected[f"group{i}.master"] = [g.layout.used_numel]
        for key, spec in saved["state"].items():
            if spec["sharded"]:
                expected[f"group{i}.state.{key}"] = [g.layout.used_numel]
            else:
                if math.prod(spec["shape"]) > g.master.numel():
                    raise ValueError(f"{path!r}: {META_FILE} declares state {key!r} of group {i} larger than its group")
                expected[f"group{i}.state.{key}"] = spec["shape"]
        if restores_replica(g, saved):
            check_loop_state(saved["delta"], f"{path!r}: {META_FILE} groups[{i}].delta")
            expected[replica_key(i)] = [g.layout.used_numel]
    for fqn, shape in expected.items():
        entry = index.state_dict_metadata.get(fqn)
        if entry is None:
            raise ValueError(f"{path!r}: the checkpoint index {INDEX_FILE} has no entry {fqn!r}")
        if list(entry.size) != shape:
            raise ValueError(
                f"{path!r}: the checkpoint index {INDEX_FILE} gives {fqn!r} size {list(entry.size)}, {META_FILE} {shape}"
            )


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
    for i, (saved, pg) in enumerate(zip(meta["groups"], opt.optimizer.param_groups)):
        for k, v in saved["hyperparameters"].items():
            if k in pg and not _same_kind(pg[k], v):
                raise ValueError(
                    f"{path!r}: hyperparameter {k!r} of group {i} is {v!r} there; {pg[k]!r} here is not of that kind"
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


def load_checkpoint(opt: ZeroOptimizer, path: str) -> None:
    # Everything that can be checked locally is checked before any communication, and the
    # ranks agree on the outcome (and on the metadata) so that all of them raise together.
    from ..comm import agree_or_raise

    error, fields, meta, index = None, None, None, None
    try:
        path = resolve_checkpoint(path)
        meta = read_metadata(path)
        check_compatible(opt, meta, path)
        index, raw_index = read_checked_index(path)
        check_index_matches(opt, meta, index, path)
        fields = {"checkpoint metadata": _digest(json.dumps(meta, sort_keys=True).encode()),
                  "checkpoint index": _digest(raw_index)}
    except (TypeError, ValueError) as e:
        error, fields = e, None
    agree_group = opt.process_group
    agree_or_raise(agree_group, opt.world_size, opt.groups[0].master.device, error, fields, "load_checkpoint")
    targets, fills = dict(_module_state(opt)), []
    for i, (g, saved) in enumerate(zip(opt.groups, meta["groups"])):
        targets[f"group{i}.master"] = _sharded(g.master, g, opt)
        state = {}
        for key, spec in saved["state"].items():
            dtype = STATE_DTYPES[spec["dtype"]]
            if spec["sharded"]:
                t = torch.zeros(g.master.shape, dtype=dtype, device=g.master.device)
                targets[f"group{i}.state.{key}"] = _sharded(t, g, opt)
            else:
                t = torch.zeros(spec["shape"], dtype=dtype, device=_scalar_device(opt, g, key))
                targets[f"group{i}.state.{key}"] = t
            state[key] = t
        if restores_replica(g, saved):
            targets[replica_key(i)] = _sharded(g.own, g, opt)
        fills.append((g, state, saved["hyperparameters"]))

    def agree(read_error):  # every rank's tensors are checked before any is copied
        agree_or_raise(agree_group, opt.world_size, opt.groups[0].master.device, read_error, {}, "load_checkpoint")

    try:
        dcp.load(targets, storage_reader=IndexedReader(path, index, agree), process_group=opt.process_group)
    except CheckpointException as e:
        raise ValueError(_read_failure(e, path)) from e
    for (g, state, hyper), pg in zip(fills, opt.optimizer.param_groups):
        # padding holds zeros (it was never trained)
        for a, b in g.layout.padding_ranges(g.lo, g.hi):
            g.master[a:b].zero_()
        opt.optimizer.state[g.master] = state
        for k, v in hyper.items():
            if k in pg:
                pg[k] = tuple(v) if isinstance(pg[k], tuple) else v
    opt.scaler.load_state_dict(meta["loss_scaler"])
    for grads in opt.grads:
        grads.zero()
    # The configured gather, as after a step: resuming at the same world size is bit-exact.
    # Delta gathers: the saved replica, or an exact resync ([Note: the replica in a checkpoint]).
    with torch.no_grad():
        for g, saved in zip(opt.groups, meta["groups"]):
            if restores_replica(g, saved):
                g.restore_replica(saved["delta"])
                continue
            if g.delta is not None:
                g.delta.resync_due()
            g.gather()


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little")


def _read_failure(e: CheckpointException, path: str) -> str:
    """What went wrong while reading, as the rank that found it said (every rank gets every
    rank's exception from DCP; those that only echo the agreement are passed over)."""
    errors = []
    for rank, failure in sorted(getattr(e, "failures", {}).items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, ValueError):
            errors.append((str(exc).startswith("load_checkpoint: rank(s)"), rank, str(exc)))
    if errors:
        echo, rank, msg = min(errors)
        return msg if echo or len(e.failures) == 1 else f"{msg} (found by rank {rank})"
    return f"{path!r}: reading the tensors failed: {_first_line(e)}"


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__


def _scalar_device(opt: ZeroOptimizer, group: FlatGroup, key: str) -> torch.device:
    """Where the inner optimizer keeps a scalar state entry (fused/capturable: the device)."""
    existing = opt.optimizer.state.get(group.master, {}).get(key)
    if existing is not None:
        return existing.device
    pg = opt.optimizer.param_groups[0]
    on_device = pg.get("fused") or pg.get("capturable")
    return group.master.device if on_device else torch.device("cpu")


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
    slots = hashlib.blake2b(repr([(s.start, s.numel) for s in group.layout.slots]).encode(), digest_size=7)
    return [group.world_size, group.layout.numel, group.layout.order, plan.group_size, plan.fmt,
            int.from_bytes(slots.digest(), "little")]


def check_loop_state(d: dict, where: str) -> None:
    from .delta import LoopState

    if d.get("state") not in [s.value for s in LoopState] or type(d.get("deltas")) is not int or d["deltas"] < 0:
        raise ValueError(f"{where} is {d!r}; expected a loop state ({[s.value for s in LoopState]}) and a count >= 0")


def restores_replica(group: FlatGroup, saved: dict) -> bool:
    """Whether a load puts the saved replica back (the same on every rank: the metadata and the
    layout are agreed on)."""
    delta = saved.get("delta")
    return group.delta is not None and isinstance(delta, dict) and delta.get("layout") == layout_key(group)
