"""The bad-input matrix: one parametrised test over invalid configurations, tensors,
process groups, optimizer constructions and checkpoints.

Every case must raise ``ValueError``/``TypeError`` (or the documented exception) whose
message names the bad value, before any communication other than the one agreement
all-gather (counted by wrapping every collective), with nothing modified (parameters,
buffers, flat buffers, optimizer state and checkpoint files are compared before and
after), and on every rank when only one rank has the bad input, without hanging
(distributed cases run on gloo ranks under a timeout; afterwards the group must still
work).

Distributed cases of one kind share one spawned process group (one ``run_distributed``
call per kind, cached); cases that might break the group run alone.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _support.distributed import run_distributed

import qzero
from qzero import ZeroConfig

TIMEOUT = 60.0


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    kind: str  # config | gather | optimizer | checkpoint
    make: Callable
    match: str  # regex the message must match (it names the bad value)
    exc: tuple = (ValueError, TypeError)
    xfail: str | None = None
    alone: bool = False  # run in its own process group (it may break the group or hang)
    timeout: float = TIMEOUT


CASES: list[Case] = []


def case(id, kind, make, match, **kw):
    CASES.append(Case(id, kind, make, match, **kw))


# ====================================================================== configurations (in-process)

CONFIG_CASES = [
    ("stage 3", {"stage": 3}, r"stage must be 1 or 2, got 3"),
    ("stage 0", {"stage": 0}, r"stage must be 1 or 2, got 0"),
    ("stage as string", {"stage": "2"}, r"stage must be 1 or 2, got '2'"),
    ("stage True", {"stage": True}, r"stage must be 1 or 2, got True"),
    ("group size 12", {"zero_quantized_weights_group_size": 12}, r"group_size.*12"),
    ("group size 0", {"zero_quantized_weights_group_size": 0}, r"group_size.*got 0"),
    ("group size -8", {"zero_quantized_weights_group_size": -8}, r"group_size.*-8"),
    ("group size bool", {"zero_quantized_weights_group_size": True}, r"group_size.*True"),
    ("group size float", {"zero_quantized_weights_group_size": 64.0}, r"group_size.*64\.0"),
    ("unknown format", {"zero_quantized_weights_format": "int2"}, r"'int2'"),
    ("unsupported key", {"offload_optimizer": {"device": "cpu"}},
     r"zero_optimization.offload_optimizer is not supported: optimizer offload"),
    ("allgather bucket 0", {"allgather_bucket_size": 0}, r"allgather_bucket_size.*0"),
    ("allgather bucket 1.5", {"allgather_bucket_size": 1.5}, r"allgather_bucket_size.*1\.5"),
    ("allgather bucket below a group", {"allgather_bucket_size": 32}, r"allgather_bucket_size 32 .*smaller"),
    ("reduce bucket -1", {"reduce_bucket_size": -1}, r"reduce_bucket_size.*-1"),
    ("reduce dtype int8", {"reduce_dtype": "int8"}, r"reduce_dtype.*'int8'"),
    ("clipping -1", {"gradient_clipping": -1.0}, r"gradient_clipping.*-1\.0"),
    ("clipping nan", {"gradient_clipping": float("nan")}, r"gradient_clipping.*nan"),
    ("quantized 'yes'", {"zero_quantized_weights": "yes"}, r"zero_quantized_weights.*'yes'"),
    ("overlap_comm 1", {"overlap_comm": 1}, r"overlap_comm.*1"),
    ("check_finite 'no'", {"check_finite": "no"}, r"check_finite.*'no'"),
    ("solo_reduce 1", {"solo_reduce": 1}, r"solo_reduce.*1"),
    ("copy_engine_collectives 1", {"copy_engine_collectives": 1}, r"copy_engine_collectives.*1"),
    ("reduce_scatter false", {"reduce_scatter": False}, r"reduce_scatter=False"),
    ("allgather_partitions false", {"allgather_partitions": False}, r"allgather_partitions=False"),
    ("small threshold -1", {"small_param_numel": -1}, r"small_param_numel.*-1"),
    ("small threshold bool", {"small_param_numel": True}, r"small_param_numel.*True"),
    ("loss scale window 0", {"loss_scale_window": 0}, r"loss_scale_window.*0"),
    ("hysteresis 0", {"hysteresis": 0}, r"hysteresis.*0"),
    ("min loss scale -1", {"min_loss_scale": -1}, r"min_loss_scale.*-1"),
    ("min loss scale 0", {"min_loss_scale": 0}, r"min_loss_scale must be > 0.*got 0"),
]
for _id, _d, _m in CONFIG_CASES:
    case(f"config: {_id}", "config", (lambda d: lambda: ZeroConfig.from_dict(d))(_d), _m)

case("config: from_dict of a list", "config", lambda: ZeroConfig.from_dict([("stage", 2)]), r"expected a dict.*list")
case("config: positional garbage", "config", lambda: ZeroConfig(stage=2, zero_quantized_weights=None),
     r"zero_quantized_weights.*None")
case(
    "config: infinite static loss scale",
    "config",
    lambda: ZeroConfig.from_dict({"loss_scale": float("inf")}),
    r"loss_scale.*inf",
)
case(
    "config: initial_scale_power 2000",
    "config",
    lambda: ZeroConfig.from_dict({"initial_scale_power": 2000}),
    r"initial_scale_power.*2000",
)


def _check_config_case(c: Case):
    # the dict (or arguments) given must come back untouched
    probe = {"zero_quantized_weights_group_size": 12, "nested": {"x": [1]}}
    before = copy.deepcopy(probe)
    with pytest.raises(ValueError):
        ZeroConfig.from_dict(probe)
    assert probe == before
    with pytest.raises(c.exc) as info:
        c.make()
    assert re.search(c.match, str(info.value)), str(info.value)


# ====================================================================== gather inputs (world 3, one group)

BF16 = torch.bfloat16


def _z(n, dtype=BF16):
    return torch.zeros(n, dtype=dtype)


QAG, AG = "quantized_all_gather", "all_gather"

GATHER_CASES = [
    # (id, make(rank, world) -> (function name, flat, kwargs), match)
    ("fp32 flat, quantized", lambda r, w: (QAG, _z(64 * w, torch.float32), {}), r"bf16 or fp16.*float32"),
    ("int8 flat, quantized", lambda r, w: (QAG, _z(64 * w, torch.int8), {}), r"bf16 or fp16.*int8"),
    ("group size 12", lambda r, w: (QAG, _z(64 * w), {"zero_quantized_weights_group_size": 12}),
     r"zero_quantized_weights_group_size.*12"),
    ("group size 0", lambda r, w: (QAG, _z(64 * w), {"zero_quantized_weights_group_size": 0}),
     r"zero_quantized_weights_group_size.*got 0"),
    ("numel not divisible", lambda r, w: (QAG, _z(64 * w + 1), {}), rf"numel {64 * 3 + 1} is not divisible"),
    ("unsorted exact ranges", lambda r, w: (QAG, _z(64 * w), {"exact_ranges": [(9, 12), (1, 2)]}),
     r"exact_ranges\[1\] = \(1, 2\).*sorted"),
    ("overlapping exact ranges", lambda r, w: (QAG, _z(64 * w), {"exact_ranges": [(1, 9), (8, 12)]}),
     r"exact_ranges\[1\] = \(8, 12\) overlaps"),
    ("exact range past the end", lambda r, w: (QAG, _z(64 * w), {"exact_ranges": [(0, 64 * w + 1)]}),
     rf"\(0, {64 * 3 + 1}\) is out of range"),
    ("empty exact range", lambda r, w: (QAG, _z(64 * w), {"exact_ranges": [(7, 7)]}), r"\(7, 7\) is out of range"),
    ("exact range triple", lambda r, w: (QAG, _z(64 * w), {"exact_ranges": [(1, 2, 3)]}),
     r"exact_ranges\[0\] = \(1, 2, 3\) is not a \(start, stop\) pair"),
    ("exact ranges None", lambda r, w: (QAG, _z(64 * w), {"exact_ranges": None}), r"exact_ranges.*None"),
    ("unknown format", lambda r, w: (QAG, _z(64 * w), {"zero_quantized_weights_format": "int2"}),
     r"zero_quantized_weights_format: unknown quantization format 'int2'"),
    ("2-D flat", lambda r, w: (QAG, torch.zeros(w, 64, dtype=BF16), {}), r"1-D, got shape \(3, 64\)"),
    ("non-contiguous flat", lambda r, w: (QAG, _z(128 * w)[::2], {}), r"contiguous, got strides \(2,\)"),
    ("bucket 0", lambda r, w: (QAG, _z(64 * w), {"allgather_bucket_size": 0}), r"allgather_bucket_size.*got 0"),
    ("bucket float", lambda r, w: (QAG, _z(64 * w), {"allgather_bucket_size": 1e6}),
     r"allgather_bucket_size.*1000000\.0"),
    ("bucket below a group per rank", lambda r, w: (QAG, _z(64 * w), {"allgather_bucket_size": 64}),
     r"allgather_bucket_size 64 is smaller than one group per rank \(3 x 64"),
    ("flat is a list", lambda r, w: (QAG, [0.0] * 64 * w, {}), r"torch\.Tensor, got list"),
    ("plain gather: 2-D flat", lambda r, w: (AG, torch.zeros(w, 64), {}), r"1-D"),
    ("plain gather: numel not divisible", lambda r, w: (AG, _z(64 * w + 2), {}), r"numel 194 is not divisible"),
    ("plain gather: bucket -5", lambda r, w: (AG, _z(64 * w), {"allgather_bucket_size": -5}),
     r"allgather_bucket_size.*-5"),
    ("group is a string", lambda r, w: (QAG, _z(64 * w), {"group": "world"}), r"ProcessGroup or None, got str"),
    # only some ranks are wrong, or the ranks disagree: every rank must raise
    ("numel differs between ranks", lambda r, w: (QAG, _z(64 * w * (1 + r)), {}), r"flat numel differs between ranks"),
    ("dtype differs between ranks", lambda r, w: (QAG, _z(64 * w, torch.float16 if r == 2 else BF16), {}),
     r"flat dtype differs between ranks"),
    ("group size differs between ranks",
     lambda r, w: (QAG, _z(64 * w), {"zero_quantized_weights_group_size": 64 if r else 32}),
     r"zero_quantized_weights_group_size differs between ranks: \[32, 64, 64\]"),
    ("format differs between ranks",
     lambda r, w: (QAG, _z(64 * w), {"zero_quantized_weights_format": "int4" if r == 1 else "int8"}),
     r"quantized_all_gather: zero_quantized_weights_format differs between ranks"),
    ("bucket differs between ranks", lambda r, w: (QAG, _z(64 * w), {"allgather_bucket_size": w * 64 * (1 + r)}),
     r"allgather_bucket_size differs between ranks"),
    ("exact ranges differ between ranks", lambda r, w: (QAG, _z(64 * w), {"exact_ranges": [(0, 1 + r)]}),
     r"exact ranges differs between ranks"),
    ("one rank: bad group size",
     lambda r, w: (QAG, _z(64 * w), {"zero_quantized_weights_group_size": 64 if r else 7}),
     r"zero_quantized_weights_group_size.*got 7|rank\(s\) \[0\] rejected"),
    ("one rank: fp32 flat", lambda r, w: (QAG, _z(64 * w, torch.float32 if r == 1 else BF16), {}),
     r"float32|rank\(s\) \[1\] rejected"),
    ("one rank: not a tensor", lambda r, w: (QAG, None if r == 2 else _z(64 * w), {}),
     r"torch\.Tensor, got NoneType|rank\(s\) \[2\] rejected"),
    ("one rank: NaN in its partition", lambda r, w: (QAG, _nan_at(64 * w, 64 + 5 if r == 1 else None), {}),
     r"non-finite.*flat index 69|rank\(s\) \[1\] rejected"),
]


def _destroyed_group(world):
    g = dist.new_group(list(range(world)))
    dist.destroy_process_group(g)
    return g


def _foreign_group(rank, world):
    """A group that does not contain ``rank`` (every rank creates both, in the same order)."""
    low = dist.new_group(list(range(world - 1)))
    last = dist.new_group([world - 1])
    return last if rank < world - 1 else low


def _nan_at(n, index):
    t = torch.randn(n).to(BF16)
    if index is not None:
        t[index] = float("nan")
    return t


for _id, _make, _m in GATHER_CASES:
    case(f"gather: {_id}", "gather", _make, _m)

case("gather: destroyed process group", "gather", lambda r, w: (QAG, _z(64 * w), {"group": _destroyed_group(w)}),
     r"is not registered")
case(
    "gather: a group this rank is not a member of",
    "gather",
    lambda r, w: (QAG, _z(64 * w), {"group": _foreign_group(r, w)}),
    r"not a member",
)
case(
    "gather: one rank passes a string as its group",
    "gather",
    lambda r, w: (QAG, _z(64 * w), {"group": "world" if r == 0 else None}),
    r"ProcessGroup or None, got str|rank\(s\) \[0\] rejected",
    alone=True,
    timeout=30.0,  # a hang waits for gloo's 30-minute timeout; 30 s leaves a loaded machine room
)
case(
    "gather: float exact range",
    "gather",
    lambda r, w: (QAG, _z(64 * w), {"exact_ranges": [(1.5, 3)]}),
    r"1\.5",
)
case(
    "gather: flat that requires grad",
    "gather",
    lambda r, w: (QAG, _z(64 * w).requires_grad_(r == 1), {}),
    r"requires_grad|requires grad|rank\(s\) \[1\] rejected",
    alone=True,
)


# ====================================================================== optimizer construction (world 2, one group)


class Net(torch.nn.Module):
    """bf16 weights, fp32 math: embedding, linear, a norm weight, a frozen projection, a buffer."""

    def __init__(self, dtype=BF16, vocab=11, d=8, h=16, extra=False, buf=3):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.lin = torch.nn.Linear(d, h)
        self.norm = torch.nn.Parameter(torch.ones(h))
        self.frozen = torch.nn.Linear(h, d, bias=False)
        self.frozen.weight.requires_grad_(False)
        if extra:
            self.extra = torch.nn.Parameter(torch.zeros(5))
        self.register_buffer("steps", torch.zeros(buf))
        self.to(dtype)

    def loss(self):
        x = self.emb.weight.float()
        h = F.linear(x, self.lin.weight.float(), self.lin.bias.float()) * self.norm.float()
        out = F.linear(torch.tanh(h), self.frozen.weight.float())
        extra = self.extra.float().sum() if hasattr(self, "extra") else 0.0
        return out.pow(2).mean() + extra


ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)


def _net(rank, seed_by_rank=False, **kw):
    torch.manual_seed(rank if seed_by_rank else 0)
    return Net(**kw)


def _mixed(rank):
    m = _net(rank)
    m.lin.float()
    return m


def _groups(model, kind):
    named = dict(model.named_parameters())
    two_d = [p for n, p in named.items() if p.requires_grad and p.dim() == 2]
    one_d = [p for n, p in named.items() if p.requires_grad and p.dim() < 2]
    return {
        "not a dict": [two_d],
        "foreign tensor": [{"params": two_d + one_d + [torch.nn.Parameter(torch.zeros(3, dtype=BF16))]}],
        "frozen parameter": [{"params": two_d + one_d + [named["frozen.weight"]]}],
        "duplicate": [{"params": two_d + one_d}, {"params": [one_d[0]]}],
        "missing": [{"params": two_d}],
        "empty group": [{"params": two_d + one_d}, {"params": []}],
    }[kind]


OPT_CASES = [
    # (id, make(rank, world) -> (model, optimizer factory, kwargs), match)
    ("fp32 parameters with quantization",
     lambda r, w: (_net(r, dtype=torch.float32), ADAMW, {"config": ZeroConfig(zero_quantized_weights=True)}),
     r"bf16 or fp16 parameters, got fp32"),
    ("float64 parameters", lambda r, w: (_net(r, dtype=torch.float64), ADAMW, {}), r"torch\.float64"),
    ("mixed dtypes", lambda r, w: (_mixed(r), ADAMW, {}),
     r"several dtypes \(torch\.bfloat16 and torch\.float32 for 'lin\.weight'\)"),
    ("bucket below one group per rank",
     lambda r, w: (_net(r), ADAMW, {"config": ZeroConfig(allgather_bucket_size=64)}),
     r"allgather_bucket_size 64 is smaller than one group per rank \(2 x 64\)"),
    ("gather-ahead bucket below its chunks in flight",
     lambda r, w: (_net(r), ADAMW, {"config": ZeroConfig(allgather_bucket_size=128, overlap_param_gather=True)}),
     r"allgather_bucket_size 128 is smaller"),
    ("config is a dict", lambda r, w: (_net(r), ADAMW, {"config": {"stage": 2}}), r"qzero\.ZeroConfig, got dict"),
    ("model is not a Module", lambda r, w: ([torch.nn.Parameter(torch.zeros(4, dtype=BF16))], ADAMW, {}),
     r"torch\.nn\.Module, got list"),
    ("optimizer is a string", lambda r, w: (_net(r), "adamw", {}), r"'adamw'"),
    ("process group is a string", lambda r, w: (_net(r), ADAMW, {"process_group": "world"}),
     r"ProcessGroup or None, got str"),
    ("no trainable parameters", lambda r, w: (_net(r).requires_grad_(False), ADAMW, {}),
     r"parameter group 0 has no trainable parameters"),
    ("param_groups entry not a dict", lambda r, w: (m := _net(r), ADAMW, {"param_groups": _groups(m, "not a dict")}),
     r"param_groups\[0\] must be a dict"),
    ("param_groups holds a foreign tensor",
     lambda r, w: (m := _net(r), ADAMW, {"param_groups": _groups(m, "foreign tensor")}),
     r"param_groups\[0\] holds a tensor that is not a parameter of the model"),
    ("param_groups holds a frozen parameter",
     lambda r, w: (m := _net(r), ADAMW, {"param_groups": _groups(m, "frozen parameter")}),
     r"frozen parameter 'frozen\.weight'"),
    ("parameter in two groups", lambda r, w: (m := _net(r), ADAMW, {"param_groups": _groups(m, "duplicate")}),
     r"parameter 'norm' appears in more than one parameter group"),
    ("parameters missing from param_groups",
     lambda r, w: (m := _net(r), ADAMW, {"param_groups": _groups(m, "missing")}),
     r"missing from param_groups: \['norm', 'lin\.bias'\]"),
    ("empty parameter group", lambda r, w: (m := _net(r), ADAMW, {"param_groups": _groups(m, "empty group")}),
     r"parameter group 1 has no trainable parameters"),
    ("copy-engine collectives on gloo and CPU",
     lambda r, w: (_net(r), ADAMW, {"config": ZeroConfig(copy_engine_collectives=True)}),
     r"copy_engine_collectives=True needs CUDA tensors \(the parameters are on cpu\); a process group with the "
     r"NCCL backend \(this one's is 'gloo'\)"),
    # ranks disagree, or only one is wrong: every rank raises
    ("one rank: copy-engine collectives",
     lambda r, w: (_net(r), ADAMW, {"config": ZeroConfig(copy_engine_collectives=r == 1)}),
     r"copy_engine_collectives=True needs CUDA tensors|rank\(s\) \[1\] rejected"),
    ("settings differ between ranks",
     lambda r, w: (_net(r), ADAMW, {"config": ZeroConfig(zero_quantized_weights=r == 0)}),
     r"config differs between ranks: .*zero_quantized_weights: True \(rank 0\), False \(ranks? [\d, ]+\)"),
    ("shapes differ between ranks", lambda r, w: (_net(r, h=16 + r), ADAMW, {}),
     r"parameter and buffer shapes\) differs between ranks"),
    ("parameter count differs between ranks", lambda r, w: (_net(r, extra=r == 1), ADAMW, {}),
     r"parameter and buffer shapes\) differs between ranks"),
    ("one rank: config is None-like garbage",
     lambda r, w: (_net(r), ADAMW, {"config": ZeroConfig() if r == 0 else 42}),
     r"qzero\.ZeroConfig, got int|rank\(s\) \[1\] rejected"),
    ("one rank: fp64 parameters", lambda r, w: (_net(r, dtype=torch.float64 if r == 1 else BF16), ADAMW, {}),
     r"torch\.float64|rank\(s\) \[1\] rejected"),
]
for _id, _make, _m in OPT_CASES:
    case(f"optimizer: {_id}", "optimizer", _make, _m)

case("optimizer: destroyed process group", "optimizer",
     lambda r, w: (_net(r), ADAMW, {"process_group": _destroyed_group(w)}), r"is not registered")
case(
    "optimizer: a process group this rank is not a member of",
    "optimizer",
    lambda r, w: (_net(r), ADAMW, {"process_group": _foreign_group(r, w)}),
    r"not a member",
)
case(
    "optimizer: factory returns a list",
    "optimizer",
    lambda r, w: (_net(r, seed_by_rank=True), functools.partial(lambda params: params), {}),
    r"torch\.optim\.Optimizer, got list",
)
case(
    "optimizer: factory raises (lr=-1)",
    "optimizer",
    lambda r, w: (_net(r, seed_by_rank=True), functools.partial(torch.optim.AdamW, lr=-1.0), {}),
    r"-1\.0",
)
case(
    "optimizer: factory raises on one rank only",
    "optimizer",
    lambda r, w: (_net(r), functools.partial(torch.optim.AdamW, lr=-1.0 if r == 0 else 1e-2), {}),
    r"-1\.0|rank\(s\) \[0\] rejected",
    alone=True,
)
case(
    "optimizer: buffer shapes differ between ranks",
    "optimizer",
    lambda r, w: (_net(r, buf=3 + r), ADAMW, {}),
    r"buffer|steps",
    alone=True,
)


# ====================================================================== checkpoints (world 2, one group)


def _save_base(path, rank):
    model = _net(rank)
    opt = qzero.ZeroOptimizer(model, ADAMW)
    opt.backward(model.loss())
    opt.step()
    opt.zero_grad()
    opt.save_checkpoint(path)


def _edit_meta(src, dst, edit):
    """A copy of the checkpoint ``src`` whose qzero.json went through ``edit`` (a function of its text)."""
    shutil.copytree(src, dst)
    meta = os.path.join(dst, "qzero.json")
    with open(meta) as f:
        text = f.read()
    out = edit(text)
    if out is None:
        os.remove(meta)
    else:
        with open(meta, "wb") as f:
            f.write(out if isinstance(out, bytes) else out.encode())


def _json_edit(fn):
    def edit(text):
        meta = json.loads(text)
        return json.dumps(fn(meta))

    return edit


CKPT_CASES = [
    # (id, prepare(base, dst) on rank 0 -> None, make(rank) -> (model, factory, kwargs), match)
    ("missing directory", None, None, r"'[^']*/nope' is not a qzero checkpoint: qzero\.json is missing"),
    ("empty directory", lambda b, d: os.makedirs(d), None, r"is not a qzero checkpoint: qzero\.json is missing"),
    ("DCP files without qzero.json", lambda b, d: _edit_meta(b, d, lambda t: None), None,
     r"is not a qzero checkpoint: qzero\.json is missing"),
    ("path is a file", lambda b, d: open(d, "w").close(), None, r"is not a qzero checkpoint"),
    ("wrong format version", lambda b, d: _edit_meta(b, d, _json_edit(lambda m: {**m, "format": 99})), None,
     r"checkpoint format 99 is not 1"),
    ("another model: different shapes", None, lambda r: (_net(r, vocab=12), ADAMW, {}),
     r"saved for another model: parameter \d of group 0 is 'emb\.weight' \(11, 8\) there, 'emb\.weight' \(12, 8\)"),
    ("another model: more parameters", None, lambda r: (_net(r, extra=True), ADAMW, {}),
     r"saved for another model: group 0 has 4 parameters there, 5 here"),
    ("another model: other buffers", None, lambda r: (_net(r, buf=4), ADAMW, {}),
     r"another model: frozen parameters / buffers differ \(\['model\.steps'\]\)"),
    ("another optimizer class", None,
     lambda r: (_net(r), functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9), {}),
     r"holds AdamW state, this optimizer is SGD"),
    ("another grouping", None,
     lambda r: (m := _net(r), ADAMW, {"param_groups": [
         {"params": [p for p in m.parameters() if p.requires_grad and p.dim() == 2]},
         {"params": [p for p in m.parameters() if p.requires_grad and p.dim() < 2]}]}),
     r"has 1 parameter groups, this optimizer has 2"),
    ("path is None", None, None, r"NoneType"),
    ("truncated qzero.json", lambda b, d: _edit_meta(b, d, lambda t: t[: len(t) // 2]), None,
     r"'[^']*/ckpt': qzero\.json is not valid JSON"),
    ("qzero.json of binary garbage", lambda b, d: _edit_meta(b, d, lambda t: b"\x80\xff\x00garbage"), None,
     r"qzero\.json is not valid JSON"),
    ("qzero.json is a list", lambda b, d: _edit_meta(b, d, lambda t: "[1, 2]"), None,
     r"checkpoint format 'list' is not 1"),
]


class _Evil:
    def __reduce__(self):
        return (os.getcwd, ())


def _evil_index(d):
    import pickle

    with open(os.path.join(d, ".metadata"), "wb") as f:
        pickle.dump(_Evil(), f)


def _truncate_data(b, d):
    _edit_meta(b, d, lambda t: t)
    for fn in os.listdir(d):
        if fn.endswith(".distcp"):
            p = os.path.join(d, fn)
            os.truncate(p, os.path.getsize(p) // 2)
for _id, _prep, _make, _m in CKPT_CASES:
    case(f"checkpoint: {_id}", "checkpoint", (_prep, _make), _m)

case(
    "checkpoint: qzero.json without its groups",
    "checkpoint",
    (lambda b, d: _edit_meta(b, d, _json_edit(lambda m: {k: v for k, v in m.items() if k != "groups"})), None),
    r"groups",
)
case(
    "checkpoint: unknown state dtype",
    "checkpoint",
    (lambda b, d: _edit_meta(b, d, _json_edit(lambda m: _set_state_dtype(m, "no_such_dtype"))), None),
    r"no_such_dtype",
)
case(
    "checkpoint: DCP index missing",
    "checkpoint",
    (lambda b, d: _edit_meta(b, d, lambda t: t) or os.remove(os.path.join(d, ".metadata")), None),
    r"cannot read the checkpoint index",
)
case(
    "checkpoint: DCP index is a code-running pickle",
    "checkpoint",
    (lambda b, d: _edit_meta(b, d, lambda t: t) or _evil_index(d), None),
    r"checkpoint index.*refuses",
)
case(
    "checkpoint: truncated tensor file",
    "checkpoint",
    (_truncate_data, None),
    r"\.distcp",
)
case(
    "checkpoint: missing on one rank only",
    "checkpoint",
    ("per-rank", None),
    r"is not a qzero checkpoint|rank\(s\) \[1\]",
    alone=True,
    timeout=30.0,  # a hang waits for gloo's 30-minute timeout; 30 s leaves a loaded machine room
)


def _set_state_dtype(meta, name):
    for g in meta["groups"]:
        for spec in g["state"].values():
            spec["dtype"] = name
    return meta


# ====================================================================== the distributed runner

_COLLECTIVES = (
    "all_gather_into_tensor", "all_gather_single", "all_gather", "all_gather_object", "all_reduce", "broadcast",
    "broadcast_object_list", "barrier", "reduce_scatter_tensor", "reduce_scatter", "gather_object",
    "scatter_object_list", "all_to_all_single", "send", "recv", "gather", "scatter", "reduce",
)


class CommCounter:
    """Counts every collective qzero or DCP makes through torch.distributed while active."""

    def __init__(self):
        import qzero.wire.chunks as qchunks
        import qzero.wire.comm as qcomm
        import torch.distributed.distributed_c10d as c10d

        self.calls: list[str] = []
        self._saved = []
        for mod in (dist, c10d):
            for name in _COLLECTIVES:
                if hasattr(mod, name):
                    self._wrap(mod, name)
        for mod in (qcomm, qchunks):
            for name in ("all_gather_into",):
                if hasattr(mod, name):
                    self._wrap(mod, name)

    def _wrap(self, mod, name):
        orig = getattr(mod, name)
        calls = self.calls

        def wrapper(*a, **k):
            calls.append(name)
            return orig(*a, **k)

        self._saved.append((mod, name, orig))
        setattr(mod, name, wrapper)

    def restore(self):
        for mod, name, orig in reversed(self._saved):
            setattr(mod, name, orig)


def _tensor_bits(t):
    if not isinstance(t, torch.Tensor):
        return copy.deepcopy(t)
    return t.detach().clone()


def _snapshot(obj):
    """Everything a failed call must leave alone."""
    out = {}
    if isinstance(obj, torch.nn.Module):
        for n, p in obj.named_parameters():
            out[f"p.{n}"] = (p.detach().clone(), p.data_ptr(), p.requires_grad, p.grad)
        for n, b in obj.named_buffers():
            out[f"b.{n}"] = (b.clone(), b.data_ptr())
    elif isinstance(obj, qzero.ZeroOptimizer):
        out.update(_snapshot(obj.model))
        for i, g in enumerate(obj.groups):
            out[f"flat{i}"] = g.flat.clone()
            out[f"master{i}"] = g.master.clone()
        for i, (k, st_) in enumerate(obj.optimizer.state.items()):
            for key, v in st_.items():
                out[f"state{i}.{key}"] = _tensor_bits(v)
        out["hyper"] = [{k: v for k, v in pg.items() if k != "params"} for pg in obj.optimizer.param_groups]
        out["scale"] = obj.scaler.state_dict()
    elif isinstance(obj, torch.Tensor):
        out["t"] = (obj.detach().clone(), obj.data_ptr())
    else:
        out["obj"] = copy.deepcopy(obj)
    return out


def _same(a, b) -> bool:
    """Bitwise equality of tensors (NaN-safe), recursively through containers."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
        )
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b or (a != a and b != b)


def _tree_digest(path):
    if not os.path.exists(path):
        return None
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    out = {}
    for root, _, files in os.walk(path):
        for fn in files:
            p = os.path.join(root, fn)
            with open(p, "rb") as f:
                out[os.path.relpath(p, path)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _attempt(call, watched, files=None):
    """Run ``call`` once, counting collectives; report what it raised and what changed."""
    before = [_snapshot(w) for w in watched]
    files_before = _tree_digest(files) if files else None
    counter = CommCounter()
    try:
        call()
        raised = None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        raised = (type(e).__name__, str(e)[:2000], isinstance(e, (ValueError, TypeError)))
    finally:
        counter.restore()
    unchanged = all(_same(a, _snapshot(w)) for a, w in zip(before, watched))
    if files:
        unchanged = unchanged and files_before == _tree_digest(files)
    # the group still works: nothing was left half-done in a collective
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"raised": raised, "unchanged": unchanged, "comms": list(counter.calls), "group_ok": t.item()}


def gather_worker(rank, world, ids):
    out = {}
    for cid in ids:
        c = BY_ID[cid]
        fn, flat, kwargs = c.make(rank, world)
        if isinstance(flat, torch.Tensor) and flat.is_floating_point():
            with torch.no_grad():
                if not torch.isnan(flat).any():
                    flat.copy_(torch.randn(flat.shape))
        plain = {k: v for k, v in kwargs.items() if k != "group"}  # process groups cannot be deep-copied
        out[cid] = _attempt(lambda: getattr(qzero, fn)(flat, **kwargs), [flat, plain])
    return out


def optimizer_worker(rank, world, ids):
    out = {}
    for cid in ids:
        c = BY_ID[cid]
        model, factory, kwargs = c.make(rank, world)
        out[cid] = _attempt(lambda: qzero.ZeroOptimizer(model, factory, **kwargs), [model])
    return out


def checkpoint_worker(rank, world, ids, tmp):
    base = os.path.join(tmp, "base")
    _save_base(base, rank)
    out = {}
    for k, cid in enumerate(ids):
        prepare, make = BY_ID[cid].make
        path = os.path.join(tmp, f"case{k}", "nope" if prepare is None else "ckpt")
        if prepare == "per-rank":
            path = base if rank == 0 else os.path.join(tmp, f"case{k}", "absent")
        elif prepare is None and make is not None:
            path = base  # a good checkpoint, loaded into another model / optimizer
        elif cid.endswith("path is None"):
            path = None
        elif rank == 0 and prepare is not None:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            prepare(base, path)
        dist.barrier()
        model, factory, kwargs = (make or (lambda r: (_net(r), ADAMW, {})))(rank)
        opt = qzero.ZeroOptimizer(model, factory, **kwargs)
        opt.backward(model.loss())
        opt.step()  # some optimizer state to keep
        opt.zero_grad()
        out[cid] = _attempt(lambda: opt.load_checkpoint(path), [opt], files=path if path else None)
    return out


WORLD = {"gather": 3, "optimizer": 2, "checkpoint": 2}
WORKERS = {"gather": gather_worker, "optimizer": optimizer_worker, "checkpoint": checkpoint_worker}
BY_ID = {c.id: c for c in CASES}
assert len(BY_ID) == len(CASES), "case ids must be unique"


_BATCHES: dict = {}


def _run_batch(kind: str, ids: tuple[str, ...], timeout: float = TIMEOUT):
    """One process group for many cases; results by case id, then by rank. A batch that
    fails (or hangs) fails every case in it, once: its error is cached too."""
    key = (kind, ids, timeout)
    if key not in _BATCHES:
        world = WORLD[kind]
        try:
            with tempfile.TemporaryDirectory() as tmp:
                extra = (tmp,) if kind == "checkpoint" else ()
                by_rank = run_distributed(WORKERS[kind], world, list(ids), *extra, timeout=timeout)
            _BATCHES[key] = {cid: [by_rank[r][cid] for r in range(world)] for cid in ids}
        except Exception as e:  # noqa: BLE001 - re-raised for every case of the batch
            _BATCHES[key] = e
    result = _BATCHES[key]
    if isinstance(result, Exception):
        raise result
    return result


def _results(c: Case):
    if c.alone:
        return _run_batch(c.kind, (c.id,), c.timeout)[c.id]
    ids = tuple(x.id for x in CASES if x.kind == c.kind and not x.alone)
    return _run_batch(c.kind, ids)[c.id]


def _params():
    out = []
    for c in CASES:
        marks = [pytest.mark.xfail(strict=True, reason=c.xfail)] if c.xfail else []
        out.append(pytest.param(c, id=c.id, marks=marks))
    return out


@pytest.mark.parametrize("c", _params())
def test_bad_input(c: Case):
    if c.kind == "config":
        _check_config_case(c)
        return
    results = _results(c)
    for rank, res in enumerate(results):
        assert res["raised"] is not None, f"rank {rank} did not raise"
        name, msg, is_value_or_type = res["raised"]
        assert is_value_or_type, f"rank {rank} raised {name}, not ValueError/TypeError: {msg}"
        assert re.search(c.match, msg), f"rank {rank}: {name}: {msg!r} does not match {c.match!r}"
        assert res["unchanged"], f"rank {rank}: something was modified"
        # at most the agreement (qzero.wire.comm.agree_or_raise): its all-gather, and where a
        # setting differs the two that name what differs; nothing else
        assert res["comms"] in ([], ["all_gather_into"], ["all_gather_into"] * 3), \
            f"rank {rank} communicated before raising: {res['comms']}"
        assert res["group_ok"] == len(results), f"rank {rank}: the group is broken afterwards"


def test_the_matrix_is_large_enough():
    kinds = {c.kind for c in CASES}
    assert {"config", "gather", "optimizer", "checkpoint"} <= kinds
    assert len(CASES) >= 25
