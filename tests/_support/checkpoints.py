"""Helpers of the checkpoint tests: a small model, a trained optimizer, snapshots of
everything a load may write, and a copy of a genuine checkpoint to tamper with."""

from __future__ import annotations

import copy
import functools
import os
import pickle
import shutil

import pytest
import torch
from torch.distributed.checkpoint import metadata as dcp_md

import qzero

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)


def small_model(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16)).bfloat16()
    model.register_buffer("table", torch.arange(6.0).reshape(2, 3))
    return model


def train(opt, model, steps, seed):
    for s in range(steps):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed + s)).bfloat16()
        opt.backward((model(x).float() ** 2).mean())
        opt.step()
        opt.zero_grad()


def fresh(factory=ADAMW):
    """An optimizer whose state differs from the checkpoint's everywhere (one step of other data)."""
    model = small_model(seed=7)
    opt = qzero.ZeroOptimizer(model, factory)
    train(opt, model, 1, 500)
    return opt, model


def save_genuine(root) -> tuple[str, dict]:
    """A checkpoint after 3 steps at world size 1 under ``root``, and the state it holds."""
    model = small_model()
    opt = qzero.ZeroOptimizer(model, ADAMW)
    train(opt, model, 3, 0)
    path = os.path.join(str(root), "ckpt")
    opt.save_checkpoint(path)
    return path, snapshot(opt, model)


def snapshot(opt, model) -> dict:
    opt.wait_for_weights()
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "masters": [g.master.clone() for g in opt.groups],
        "state": [{k: v.clone() for k, v in opt.optimizer.state.get(g.master, {}).items()} for g in opt.groups],
        "hyper": [{k: copy.deepcopy(v) for k, v in pg.items() if k != "params"} for pg in opt.optimizer.param_groups],
        "scaler": opt.scaler.state_dict(),
    }


def assert_same(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for x, y in zip(a["masters"], b["masters"]):
        assert torch.equal(x, y)
    for x, y in zip(a["state"], b["state"]):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    assert a["hyper"] == b["hyper"] and a["scaler"] == b["scaler"]


def files_under(root) -> dict:
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            st_ = os.lstat(p)
            out[p] = (st_.st_size, st_.st_mtime_ns)
    return out


class Attempt:
    """A copy of a genuine checkpoint to tamper with, inside a folder watched for new files."""

    def __init__(self, root, genuine_path, calls: list | None = None):
        self.root = str(root)
        self.path = os.path.join(self.root, "ckpt")
        shutil.copytree(genuine_path, self.path)
        self.index = os.path.join(self.path, ".metadata")
        self.marker = os.path.join(self.root, "PWNED")
        self.calls = calls if calls is not None else []
        with open(self.index, "rb") as f:
            self.genuine_index = f.read()

    def ship_payload(self, name="payload.pt") -> str:
        """A torch.save file whose unpickling runs a shell command (if anything ever loads it unsafely)."""
        target = os.path.join(self.path, name)
        torch.save({"x": Call(os.system, f"touch {self.marker}")}, target)
        return target

    def write_index(self, data: bytes) -> None:
        with open(self.index, "wb") as f:
            f.write(data)

    def trusted_index(self) -> dcp_md.Metadata:
        return pickle.loads(self.genuine_index)  # the test's own, genuine file

    def load_refused(self, match: str, factory=ADAMW) -> str:
        opt, model = fresh(factory)
        before, files = snapshot(opt, model), files_under(self.root)
        calls = len(self.calls)
        with pytest.raises(ValueError, match=match) as e:
            opt.load_checkpoint(self.path)
        assert len(self.calls) == calls, "a canary ran"
        assert not os.path.exists(self.marker), "the payload ran"
        assert files_under(self.root) == files, "a file was written"
        assert_same(snapshot(opt, model), before)
        return str(e.value)


class Call:
    """Pickles as ``fn(*args)``."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args
