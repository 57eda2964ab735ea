"""The refusals made before a load reads any tensor: the checkpoint directory found, its
``qzero.json`` checked against this optimizer (model, grouping, optimizer class and
hyperparameters; [Note: the state an optimizer keeps]), its DCP index against both. Nothing
here changes the optimizer, so a checkpoint refused here changes nothing
(:mod:`qzero.optim.checkpoint.load`, [Note: all or nothing])."""

from __future__ import annotations

import collections
import math
import os
import stat
import warnings
from typing import TYPE_CHECKING

import torch

from . import residuals
from .form import OLD_SUFFIX, check_loop_state, module_state, replica_key, restores_replica
from .index import INDEX_FILE, read_index, show
from .meta import META_FILE, STATE_DTYPES
from .reader import castable

if TYPE_CHECKING:
    from .protocol import Checkpointable, CheckpointGroup


def resolve_checkpoint(path: str) -> str:
    """``path``, or the previous checkpoint a killed save left beside it."""
    path = os.path.abspath(path).rstrip(os.sep)
    if os.path.isfile(os.path.join(path, META_FILE)):
        return path
    old = path + OLD_SUFFIX
    if os.path.isfile(os.path.join(old, META_FILE)):
        warnings.warn(f"{path} is missing (a save was interrupted); loading the previous checkpoint {old}",
                      stacklevel=3)
        return old
    return path


def read_checked_index(path: str):
    """The DCP index of ``path`` (read safely: see :mod:`qzero.optim.checkpoint.index`) and its
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


def check_index_matches(opt: Checkpointable, meta: dict, index, path: str) -> None:
    """Every tensor the load will read is in the index with the size this optimizer expects,
    in a dtype that can be copied into where it goes."""
    expected = {k: (list(v.shape), v.dtype) for k, v in module_state(opt).items()}
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
        if restores_replica(g, saved):  # [Note: the replica in a checkpoint] in form.py
            check_loop_state(saved["delta"], f"{path!r}: {META_FILE} groups[{i}].delta", g.world_size)
            expected[replica_key(i)] = ([g.layout.used_numel], g.dtype)
    expected.update(residuals.expected_entries(opt, meta))
    residuals.check_index(opt, meta, index, path)  # before the sizes: a chunk per saved row
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


def check_compatible(opt: Checkpointable, meta: dict, path: str) -> None:
    """Refuse a checkpoint of another model, grouping or optimizer, naming the difference."""
    if len(meta["groups"]) != len(opt.groups):
        raise ValueError(f"{path!r} has {len(meta['groups'])} parameter groups, this optimizer has {len(opt.groups)}")
    here = {k: list(v.shape) for k, v in module_state(opt).items()}
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


def resumed_hyperparameters(pg: dict, saved: dict) -> dict:
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


def _trial_state(opt: Checkpointable, group: CheckpointGroup, hyper: dict) -> tuple[dict, torch.Tensor]:
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


def kept_state(opt: Checkpointable, meta: dict, path: str) -> list[dict[str, dict]]:
    """Per group, what the inner optimizer keeps with the checkpoint's hyperparameters: key ->
    ``{"sharded", "shape", "dtype", "device"}`` ([Note: the state an optimizer keeps])."""
    name = type(opt.optimizer).__name__
    out = []
    for g, saved, pg in zip(opt.groups, meta["groups"], opt.optimizer.param_groups):
        try:
            state, like = _trial_state(opt, g, resumed_hyperparameters(pg, saved["hyperparameters"]))
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


def check_state(opt: Checkpointable, meta: dict, kept: list[dict[str, dict]], path: str) -> None:
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
