"""The checkpoint package knows the optimizer only through the protocols of
``qzero/optim/checkpoint/protocol.py`` ([Note: checkpoints know the optimizer by its protocol]).

1. Every member a protocol lists is used by checkpoint code (read from the source).
2. The optimizer's own objects have every member (``isinstance`` on the runtime-checkable
   protocols): a ZeroOptimizer, its flat groups, residuals, loss scaler and gradient buffers.
3. A save, a state dict and a load at the same world size (2), and a load at another (3),
   through stand-ins that expose only the protocols' members, touch nothing else and load
   what was saved. Delta gathers and error feedback are on, so the replica and the residuals
   (read in place, and resharded) are part of it.
"""

from __future__ import annotations

import ast
import functools
import pathlib

import torch
from _support.distributed import run_distributed
from test_optim import make_model, train_steps

import qzero
from qzero.optim.checkpoint import protocol
from qzero.optim.checkpoint.form import sharded_state_dict
from qzero.optim.checkpoint.load import load_checkpoint
from qzero.optim.checkpoint.save import save_checkpoint

PACKAGE = pathlib.Path(protocol.__file__).parent
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)
CONFIG = dict(zero_quantized_weights=True, zero_quantized_weights_delta=True, zero_quantized_weights_group_size=16,
              small_param_numel=40, reduce_dtype="fp32", zero_quantized_gradients=True,
              zero_quantized_gradients_group_size=16, zero_quantized_gradients_error_feedback=True)
PROTOCOLS = (protocol.Checkpointable, protocol.CheckpointGroup, protocol.CheckpointResiduals, protocol.LossScale,
             protocol.GradientBuffers)


def members(proto: type) -> set[str]:
    """What a protocol lists: its properties and its methods."""
    return {k for k, v in vars(proto).items() if (callable(v) or isinstance(v, property)) and not k.startswith("_")}


def test_every_member_is_used_by_checkpoint_code():
    used = set()
    for path in PACKAGE.glob("*.py"):
        if path.name != "protocol.py":
            used |= {n.attr for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)}
    for proto in PROTOCOLS:
        unused = sorted(members(proto) - used)
        assert not unused, f"{proto.__name__} lists {unused}, which no checkpoint module uses"
    assert "steps_taken" not in members(protocol.Checkpointable)  # what the optimizer has beyond it stays out


# ------------------------------------------------------------------ stand-ins


class Only:
    """``target`` as ``proto`` shows it: reading a member the protocol does not list, or setting
    any, is recorded in ``seen`` (so an ``except`` in the code under test cannot hide it) and
    raises ``AttributeError``. Members that are protocols themselves come wrapped as well."""

    def __init__(self, target, proto: type, seen: list[str]):
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_proto", proto)
        object.__setattr__(self, "_seen", seen)

    def __getattr__(self, name):
        proto, target = self._proto, self._target
        if name not in members(proto):
            self._seen.append(f"{proto.__name__} has no {name!r} ({type(target).__name__}.{name} was read)")
            raise AttributeError(self._seen[-1])
        value = getattr(target, name)
        inner = _WRAPPED.get((proto.__name__, name))
        if inner is None:
            return value
        wrap = lambda v: None if v is None else Only(v, inner, self._seen)  # noqa: E731
        return [wrap(v) for v in value] if isinstance(value, list) else wrap(value)

    def __setattr__(self, name, value):
        self._seen.append(f"{self._proto.__name__}.{name} was set")
        raise AttributeError(self._seen[-1])


_WRAPPED = {("Checkpointable", "groups"): protocol.CheckpointGroup,
            ("Checkpointable", "error_feedback"): protocol.CheckpointResiduals,
            ("Checkpointable", "scaler"): protocol.LossScale,
            ("Checkpointable", "grads"): protocol.GradientBuffers}


def _optimizer(seed):
    model = make_model(seed=seed)
    return qzero.ZeroOptimizer(model, ADAMW, config=qzero.ZeroConfig(**CONFIG)), model


def _has_every_member(opt) -> list[str]:
    objects = [(opt, protocol.Checkpointable), (opt.scaler, protocol.LossScale)]
    objects += [(g, protocol.CheckpointGroup) for g in opt.groups]
    objects += [(ef, protocol.CheckpointResiduals) for ef in opt.error_feedback]
    objects += [(grads, protocol.GradientBuffers) for grads in opt.grads]
    return [f"{type(o).__name__} is no {p.__name__}: it lacks {sorted(m for m in members(p) if not hasattr(o, m))}"
            for o, p in objects if not isinstance(o, p)]


def _save_and_load(rank, world, path):
    seen: list[str] = []
    opt, model = _optimizer(rank)
    train_steps(model, opt, rank, world, range(3), [])
    opt.wait_for_weights()
    missing = _has_every_member(opt)
    save_checkpoint(Only(opt, protocol.Checkpointable, seen), path)
    keys = sorted(sharded_state_dict(Only(opt, protocol.Checkpointable, seen)))
    other, other_model = _optimizer(50 + rank)
    train_steps(other_model, other, rank, world, range(1), [])
    load_checkpoint(Only(other, protocol.Checkpointable, seen), path)
    same = [torch.equal(a, b) for a, b in [(opt.groups[0].master, other.groups[0].master),
                                          (opt.groups[0].own, other.groups[0].own),
                                          (opt.error_feedback[0].residual, other.error_feedback[0].residual)]]
    return {"seen": seen, "missing": missing, "keys": keys, "same": same}


def _load_resharded(rank, world, path):
    seen: list[str] = []
    opt, model = _optimizer(70 + rank)
    train_steps(model, opt, rank, world, range(1), [])
    before = opt.error_feedback[0].residual.clone()
    load_checkpoint(Only(opt, protocol.Checkpointable, seen), path)
    return {"seen": seen, "residuals_changed": not torch.equal(before, opt.error_feedback[0].residual)}


def test_checkpoint_code_touches_only_the_protocols(tmp_path):
    path = str(tmp_path / "ckpt")
    for rank, r in enumerate(run_distributed(_save_and_load, 2, path, timeout=90.0)):
        assert not r["missing"], f"rank {rank}: {r['missing']}"
        assert not r["seen"], f"rank {rank}: checkpoint code went past the protocols: {r['seen']}"
        assert "group0.error_feedback" in r["keys"] and "group0.replica" in r["keys"], r["keys"]
        assert r["same"] == [True, True, True], f"rank {rank}: masters, replica, residuals loaded alike: {r['same']}"
    for rank, r in enumerate(run_distributed(_load_resharded, 3, path, timeout=90.0)):
        assert not r["seen"], f"rank {rank} of 3: checkpoint code went past the protocols: {r['seen']}"
        assert r["residuals_changed"], f"rank {rank} of 3: the resharded residuals were not put in place"
