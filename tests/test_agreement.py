"""What the ranks agree on before their first collective ([Note: agreement] in qzero/wire/agreement.py).

Each case runs on every rank of a gloo world of 2 and of 3 (cases of one kind share one
process group, under a timeout: a hang fails the batch, it is never waited out). A case
either must succeed on every rank, or must raise on *every* rank with a message that names
the differing setting (or, on the other ranks, the rank that rejected its arguments),
leaving the process group usable.

* the inner optimizer of ``ZeroOptimizer``: its class and every hyperparameter of every
  parameter group as constructed (tensors, None, bools, tuples, floats by their exact bits);
* ``qzero.fsdp``'s settings (by ZeroConfig's names: the format, the group size,
  ``small_param_numel``, the rotation block, what is quantized; given by their short names
  here), at install when a process group exists, else at the first forward;
* the public gathers and the constructor: an argument that cannot enter the exchange
  (``allgather_bucket_size=2**70``) or a local failure of any exception type on one rank.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import tempfile
from typing import Callable

import pytest
import torch
import torch.distributed as dist
from _support.distributed import run_distributed

import qzero
from qzero import ZeroConfig

TIMEOUT = 90.0
WORLDS = (2, 3)
BF16 = torch.bfloat16


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    kind: str  # gather | optimizer | checkpoint | fsdp | fsdp-deferred
    make: Callable  # make(rank, world) -> a call to run on that rank
    match: str | None  # regex every rank's message must match; None: every rank must succeed


CASES: list[Case] = []


def case(id, kind, make, match=None):
    CASES.append(Case(id, kind, make, match))


def rejected(rank):
    """What the other ranks say when ``rank`` alone failed its local checks."""
    return rf"rank\(s\) \[{rank}\] rejected their arguments"


# ====================================================================== the public gathers (item: 2**63)


def _flat(world, dtype=BF16):
    return torch.randn(64 * world).to(dtype)


def _gather(fn, flat_of, **kwargs_of):
    def make(rank, world):
        flat = flat_of(rank, world)
        kwargs = {k: v(rank, world) for k, v in kwargs_of.items()}
        return lambda: getattr(qzero, fn)(flat, **kwargs)

    return make


def _meta_flat(rank, world):
    return torch.empty(64 * world, dtype=BF16, device="meta") if rank == 1 else _flat(world)


case("quantized: allgather_bucket_size 2**70 on one rank", "gather",
     _gather("quantized_all_gather", lambda r, w: _flat(w),
             allgather_bucket_size=lambda r, w: 2**70 if r == 0 else 2**20),
     rf"allgather_bucket_size 1180591620717411303424 is out of range.*64-bit|{rejected(0)}")
case("quantized: allgather_bucket_size 2**70 on every rank", "gather",
     _gather("quantized_all_gather", lambda r, w: _flat(w), allgather_bucket_size=lambda r, w: 2**70),
     r"allgather_bucket_size 1180591620717411303424 is out of range")
case("quantized: group_size 2**70 (and a bucket to hold it) on the last rank", "gather",
     _gather("quantized_all_gather", lambda r, w: _flat(w),
             allgather_bucket_size=lambda r, w: 2**80 if r == w - 1 else 2**20,
             zero_quantized_weights_group_size=lambda r, w: 2**70 if r == w - 1 else 64),
     r"zero_quantized_weights_group_size (1180591620717411303424 is out of range|must be at most 2\*\*48)"
     r"|rank\(s\) \[[12]\] rejected")
case("plain: allgather_bucket_size 2**64 on one rank", "gather",
     _gather("all_gather", lambda r, w: _flat(w), allgather_bucket_size=lambda r, w: 2**64 if r == 1 else 2**20),
     rf"allgather_bucket_size 18446744073709551616 is out of range|{rejected(1)}")
case("quantized: a meta flat on one rank", "gather",
     _gather("quantized_all_gather", _meta_flat), rf"flat is on the meta device|{rejected(1)}")
case("quantized: 2**62 is fine", "gather",
     _gather("quantized_all_gather", lambda r, w: _flat(w), allgather_bucket_size=lambda r, w: 2**62))


# ====================================================================== the inner optimizer


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 24)
        self.norm = torch.nn.Parameter(torch.ones(24))
        self.to(BF16)

    def loss(self):
        x = torch.linspace(-1, 1, 16).view(2, 8)
        return ((torch.nn.functional.linear(x, self.lin.weight.float(), self.lin.bias.float())
                 * self.norm.float()) ** 2).mean()


def _opt(factory_of, config=None, groups_of=None):
    """A ZeroOptimizer built from ``factory_of(rank, world)``, then one step (success cases)."""

    def make(rank, world):
        model = Net()
        factory = factory_of(rank, world)
        kwargs = {} if groups_of is None else {"param_groups": groups_of(model, rank, world)}

        def call():
            opt = qzero.ZeroOptimizer(model, factory, config=config or ZeroConfig(), **kwargs)
            opt.backward(model.loss())
            opt.step()
            opt.wait_for_weights()

        return call

    return make


def _adamw(rank, world, **hp):
    return functools.partial(torch.optim.AdamW, **{"lr": 1e-2, **hp})


def _raising_factory(params):
    raise RuntimeError("the factory broke (not a ValueError)")


def _two_groups(model, rank, world, wd_last):
    return [{"params": [model.lin.weight]},
            {"params": [model.lin.bias, model.norm], "weight_decay": wd_last if rank == world - 1 else 0.0}]


def _opt_config(config_of):
    """A ZeroOptimizer whose ZeroConfig is ``config_of(rank, world)``."""

    def make(rank, world):
        return _opt(lambda r, w: _adamw(r, w), config=config_of(rank, world))(rank, world)

    return make


case("quant_kernels: reference on the last rank, auto on the others (the whole config is agreed)", "optimizer",
     _opt_config(lambda r, w: ZeroConfig(quant_kernels="reference" if r == w - 1 else "auto")),
     r"quant_kernels")
case("AdamW on rank 0, SGD on the others", "optimizer",
     _opt(lambda r, w: _adamw(r, w) if r == 0 else functools.partial(torch.optim.SGD, lr=1e-2)),
     r"inner optimizer class differs between ranks: torch\.optim\.adamw\.AdamW \(rank 0\), "
     r"torch\.optim\.sgd\.SGD \(ranks? 1")
case("learning rate differs on the last rank", "optimizer",
     _opt(lambda r, w: _adamw(r, w, lr=2e-2 if r == w - 1 else 1e-2)),
     r"a hyperparameter of the inner optimizer differs between ranks: "
     r"param group 0 'lr': 0\.01 \(ranks? 0.*0\.02 \(rank [12]\)")
case("learning rate one float step apart", "optimizer",
     _opt(lambda r, w: _adamw(r, w, lr=1e-2 if r else float.__new__(float, 0.010000000000000002))),
     r"param group 0 'lr': 0\.010000000000000002 \(rank 0\), 0\.01 \(ranks? 1")
case("betas differ (a tuple)", "optimizer",
     _opt(lambda r, w: _adamw(r, w, betas=(0.9, 0.95 if r == 1 else 0.999))),
     r"param group 0 'betas': \(0\.9, 0\.999\) \(ranks? 0.*\(0\.9, 0\.95\) \(rank 1\)")
case("amsgrad differs (a bool)", "optimizer",
     _opt(lambda r, w: _adamw(r, w, amsgrad=r == 0)),
     r"param group 0 'amsgrad': True \(rank 0\), False \(ranks? 1")
case("foreach None on one rank, False on the others (None is not a bool)", "optimizer",
     _opt(lambda r, w: _adamw(r, w, foreach=None if r == 0 else False)),
     r"param group 0 'foreach': None \(rank 0\), False \(ranks? 1")
case("learning rate as tensors of different values", "optimizer",
     _opt(lambda r, w: _adamw(r, w, lr=torch.tensor(1e-2 if r else 3e-2))),
     r"param group 0 'lr': tensor\(float32, shape \(\), \(0\.029999"
     r"\d*\)\) \(rank 0\), tensor\(float32, shape \(\), \(0\.0099999\d*\)\) \(ranks? 1")
case("learning rate a tensor on one rank, a float on the others", "optimizer",
     _opt(lambda r, w: _adamw(r, w, lr=torch.tensor(1e-2) if r == 0 else 1e-2)),
     r"param group 0 'lr': tensor\(float32.*\(rank 0\), 0\.01 \(ranks? 1")
case("weight decay of the second parameter group differs", "optimizer",
     _opt(lambda r, w: _adamw(r, w), groups_of=functools.partial(_two_groups, wd_last=0.1)),
     r"param group 1 'weight_decay': 0 \(ranks? 0.*0\.1 \(rank [12]\)")
case("the factory raises a RuntimeError on one rank", "optimizer",
     _opt(lambda r, w: _raising_factory if r == 1 else _adamw(r, w)),
     rf"the factory broke|{rejected(1)}")
case("same optimizer: lr as equal tensors, betas as list and tuple, 1 and 1.0, 0.0 and -0.0", "optimizer",
     _opt(lambda r, w: _adamw(r, w, lr=torch.tensor(1e-2), betas=[0.9, 0.99] if r else (0.9, 0.99),
                              eps=1 if r else 1.0, weight_decay=0.0 if r else -0.0)))
case("same SGD with momentum in two groups", "optimizer",
     _opt(lambda r, w: functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
          groups_of=functools.partial(_two_groups, wd_last=0.0)))


def _checkpoint(edit_of):
    """Each rank loads its own copy of a checkpoint, edited by ``edit_of(rank, world)`` (a
    function of its qzero.json, or None)."""

    def make(rank, world, tmp):
        import json
        import shutil

        base = os.path.join(tmp, "base")
        model = Net()
        opt = qzero.ZeroOptimizer(model, _adamw(rank, world))
        opt.backward(model.loss())
        opt.step()
        opt.save_checkpoint(base)
        mine = os.path.join(tmp, f"rank{rank}")
        shutil.copytree(base, mine)
        edit = edit_of(rank, world)
        if edit is not None:
            path = os.path.join(mine, "qzero.json")
            with open(path) as f:
                meta = json.load(f)
            edit(meta)
            with open(path, "w") as f:
                json.dump(meta, f)
        return lambda: opt.load_checkpoint(mine)

    return make


def _huge_lr(meta):
    for g in meta["groups"]:
        g["hyperparameters"]["lr"] = 10**400


case("checkpoint: a 401-digit learning rate in one rank's copy (not a ValueError)", "checkpoint",
     _checkpoint(lambda r, w: _huge_lr if r == w - 1 else None), r"too large|\blr\b|rank\(s\) \[[12]\] rejected")
case("checkpoint: every rank's copy intact", "checkpoint", _checkpoint(lambda r, w: None))


# ====================================================================== qzero.fsdp's settings

SMALL = 100  # parameters up to this many elements travel exactly


def _fsdp_net(dtype=torch.float32, width=96):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, 48)).to(dtype)


def _shard(model, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    fully_shard(model[0], mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _train(model, rank):
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    model(x).float().pow(2).mean().backward()


def _per_param(kwargs_of, dtype_of=lambda r, w: torch.float32, width_of=lambda r, w: 96):
    """quantize_weight_gathers before fully_shard (a process group exists); then a step."""

    def make(rank, world):
        from qzero.fsdp import quantize_weight_gathers

        model = _fsdp_net(dtype_of(rank, world), width_of(rank, world))

        def call():
            quantize_weight_gathers(model, **{"small_param_numel": SMALL, **kwargs_of(rank, world)})
            _train(_shard(model, world), rank)

        return call

    return make


def _group(install_of):
    """A group installer (after fully_shard); then a step."""

    def make(rank, world):
        import qzero.fsdp

        model = _shard(_fsdp_net(), world)

        def call():
            for function, kwargs in install_of(rank, world):
                getattr(qzero.fsdp, function)(model, **{"small_param_numel": SMALL, **kwargs})
            _train(model, rank)

        return call

    return make


case("weight gathers: int8 on one rank, fp8 on the others", "fsdp",
     _per_param(lambda r, w: {"fmt": "fp8" if r == 1 else "int8"}),
     r"quantize_weight_gathers: zero_quantized_weights_format differs between ranks: 'int8' \(ranks? 0(, 2)?\), "
     r"'fp8' \(rank 1\)")
case("weight gathers: group size 128 on the last rank", "fsdp",
     _per_param(lambda r, w: {"group_size": 128 if r == w - 1 else 64}),
     r"zero_quantized_weights_group_size differs between ranks: \[64, (64, )?128\] \(by rank\)")
case("weight gathers: small_param_numel differs", "fsdp",
     _per_param(lambda r, w: {"small_param_numel": 5000 if r == 0 else SMALL}),
     r"small_param_numel differs between ranks: \[5000, 100(, 100)?\]")
case("weight gathers: a bad group size on one rank", "fsdp",
     _per_param(lambda r, w: {"group_size": 12 if r == 1 else 64}),
     rf"zero_quantized_weights_group_size must be a positive multiple of 8, got 12|{rejected(1)}")
case("weight gathers: a bf16 model on one rank", "fsdp",
     _per_param(lambda r, w: {}, dtype_of=lambda r, w: BF16 if r == 0 else torch.float32),
     rf"fp32 \(master\) model|{rejected(0)}")
case("weight gathers: group_size 2**70 on one rank", "fsdp",
     _per_param(lambda r, w: {"group_size": 2**70 if r == 0 else 64}),
     rf"zero_quantized_weights_group_size (1180591620717411303424 is out of range|must be at most 2\*\*48)"
     rf"|{rejected(0)}")
case("weight gathers: another model on one rank", "fsdp",
     _per_param(lambda r, w: {}, width_of=lambda r, w: 192 if r == 1 else 96),
     r"which parameters are quantized differs between ranks: 0\.weight: \(96, 16\): quantized \(ranks? 0(, 2)?\), "
     r"\(192, 16\): quantized \(rank 1\)")
case("weight gathers: the same settings", "fsdp", _per_param(lambda r, w: {"fmt": "fp8"}))
case("group gathers: int8 on one rank, int4 on the others", "fsdp",
     _group(lambda r, w: [("quantize_group_gathers", {"fmt": "int8" if r == 0 else "int4"})]),
     r"quantize_group_gathers: zero_quantized_weights_format differs between ranks: 'int8' \(rank 0\), 'int4' "
     r"\(ranks? 1")
case("group gathers: group size differs", "fsdp",
     _group(lambda r, w: [("quantize_group_gathers", {"group_size": 32 if r == 1 else 64})]),
     r"quantize_group_gathers: zero_quantized_weights_group_size differs between ranks: \[64, 32(, 64)?\]")
case("group gathers: unknown kernels on one rank", "fsdp",
     _group(lambda r, w: [("quantize_group_gathers", {"quant_kernels": "cuda" if r == w - 1 else "auto"})]),
     r"quant_kernels must be one of|rank\(s\) \[[12]\] rejected")
case("group reduces: int8 on one rank, fp8 on the others", "fsdp",
     _group(lambda r, w: [("quantize_group_reduces", {"zero_quantized_gradients_format": "fp8" if r else "int8"})]),
     r"quantize_group_reduces: zero_quantized_gradients_format differs between ranks: 'int8' \(rank 0\), 'fp8' "
     r"\(ranks? 1")
case("group reduces: int4 rotated by 16 on one rank, by 32 on the others", "fsdp",
     _group(lambda r, w: [("quantize_group_reduces", {"zero_quantized_gradients_format": "int4",
                                                      "zero_quantized_gradients_rotation_block": 32 if r else 16})]),
     r"quantize_group_reduces: zero_quantized_gradients_rotation_block differs between ranks: \[16, 32(, 32)?\]")
case("group reduces: small_param_numel differs", "fsdp",
     _group(lambda r, w: [("quantize_group_reduces", {"small_param_numel": SMALL + r})]),
     r"quantize_group_reduces: small_param_numel differs between ranks: \[100, 101(, 102)?\]")
case("group gathers and reduces: the same settings", "fsdp",
     _group(lambda r, w: [("quantize_group_gathers", {}),
                          ("quantize_group_reduces", {"zero_quantized_gradients_format": "fp8"})]))


def _deferred(kwargs_of):
    """quantize_weight_gathers before init_process_group: the agreement runs at the first
    forward (twice: a failed agreement raises again, without communicating)."""

    def make(rank, world, store):
        from qzero.fsdp import quantize_weight_gathers

        hooks = torch.nn.modules.module._global_forward_pre_hooks

        def call():
            before = len(hooks)
            dist.destroy_process_group()
            model = quantize_weight_gathers(_fsdp_net(), **{"small_param_numel": SMALL, **kwargs_of(rank, world)})
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
            _shard(model, world)
            errors = []
            for _ in range(2):
                try:
                    _train(model, rank)
                except ValueError as e:
                    errors.append(str(e))
            assert len(hooks) == before + (1 if errors else 0), "the forward hook outlived a successful agreement"
            if errors:
                assert len(errors) == 2 and errors[0] == errors[1], errors
                raise ValueError(errors[0])

        return call

    return make


case("before init_process_group: fmt differs", "fsdp-deferred",
     _deferred(lambda r, w: {"fmt": "int4" if r == w - 1 else "int8"}),
     r"quantize_weight_gathers: zero_quantized_weights_format differs between ranks: 'int8' \(ranks? 0(, 1)?\), "
     r"'int4' \(rank [12]\)")
case("before init_process_group: small_param_numel differs (nothing quantized on rank 0)", "fsdp-deferred",
     _deferred(lambda r, w: {"small_param_numel": 10**6 if r == 0 else SMALL}),
     r"quantize_weight_gathers: small_param_numel differs between ranks: \[1000000, 100(, 100)?\]")
case("before init_process_group: the same settings", "fsdp-deferred", _deferred(lambda r, w: {}))


# ====================================================================== the runner


def worker(rank, world, kind, ids, tmp):
    out = {}
    for k, cid in enumerate(ids):
        extra = {"fsdp-deferred": (os.path.join(tmp, f"store{k}"),), "checkpoint": (os.path.join(tmp, f"ckpt{k}"),)}
        extra = extra.get(kind, ())
        call = BY_ID[cid].make(rank, world, *extra)
        try:
            call()
            raised = None
        except Exception as e:  # noqa: BLE001 - reported to the test
            raised = f"{type(e).__name__}: {e}"
        t = torch.ones(1)
        dist.all_reduce(t)  # the group still works: nothing was left half-done in a collective
        out[cid] = (raised, t.item())
    return out


BY_ID = {c.id: c for c in CASES}
assert len(BY_ID) == len(CASES), "case ids must be unique"
_BATCHES: dict = {}


def _batch(kind: str, world: int):
    """One process group for every case of ``kind``; results by case id, then by rank. A
    batch that fails or hangs fails every case in it (its error is kept)."""
    key = (kind, world)
    if key not in _BATCHES:
        ids = [c.id for c in CASES if c.kind == kind]
        try:
            with tempfile.TemporaryDirectory() as tmp:
                by_rank = run_distributed(worker, world, kind, ids, tmp, timeout=TIMEOUT)
            _BATCHES[key] = {cid: [by_rank[r][cid] for r in range(world)] for cid in ids}
        except Exception as e:  # noqa: BLE001 - re-raised for every case of the batch
            _BATCHES[key] = e
    result = _BATCHES[key]
    if isinstance(result, Exception):
        raise result
    return result


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_agreement(c: Case, world: int):
    for rank, (raised, group_ok) in enumerate(_batch(c.kind, world)[c.id]):
        if c.match is None:
            assert raised is None, f"rank {rank} raised {raised}"
        else:
            assert raised is not None, f"rank {rank} did not raise"
            assert re.search(c.match, raised), f"rank {rank}: {raised!r} does not match {c.match!r}"
        assert group_ok == world, f"rank {rank}: the group is broken afterwards"
