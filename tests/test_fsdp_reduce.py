"""qzero.fsdp.quantize_group_reduces: FSDP2's gradient reduce-scatter of each parameter
group, quantized, on gloo ranks, against the reference quantizer and plain FSDP2.

Every reduce-scatter's input is recorded on every rank; each rank's output (and the sharded
gradients FSDP2 views out of it) must then equal, bit for bit, the reference functions
applied to those inputs: for the part rank ``r`` owns, the fp32 sum in rank order of rank
``r``'s own part unquantized and every other rank's part through
``qzero.quant.reference.quantize``/``dequantize`` (small parameters exact), then the op
(AVG: times ``1 / world``; PREMUL_SUM: the inputs times the factor first; SUM). An fp64 sum
of the same contributions agrees within fp32 rounding. World sizes 2 and 3 (padded,
unevenly sharded parameters), fp32 and bf16 reduce dtypes, both reshard modes, AVG, SUM and
PREMUL_SUM, alone and with quantize_group_gathers.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _support.distributed import run_distributed
from qzero.quant import reference
from test_fsdp import GS, SMALL, _snapshot, batch, build
from test_fsdp_group import GROUPS

try:
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # pragma: no cover
    ReduceScatter = object


class Recorder(ReduceScatter):
    """Wraps a group's reduce-scatter: records (input, output, op) of every call; ``poison``
    may change the input first (as if the gradient held it)."""

    def __init__(self, inner, log, poison=None):
        self.inner, self.log, self.poison = inner, log, poison

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if self.poison is not None:
            self.poison(input_tensor)
        x = input_tensor.clone()
        work = self.inner(output_tensor, input_tensor, group, op, async_op)
        if work is not None:
            work.wait()
        kind = getattr(op, "op", op)
        factor = getattr(op, "factor", None) if kind == dist.ReduceOp.PREMUL_SUM else None
        self.log.append((x, output_tensor.clone(), str(kind).split(".")[-1], factor))
        return work


def shard(model, world, reshard, param_dtype, reduce_dtype):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for child in (model.up, model.mid, model.odd):
        fully_shard(child, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    return model


def _fsdp_modules(model):
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "_get_fsdp_state")]


def _record(model, logs, poison=None):
    for name, m in _fsdp_modules(model):
        pg = m._get_fsdp_state()._fsdp_param_group
        logs[name] = []
        pg._reduce_scatter_comm = Recorder(pg._reduce_scatter_comm, logs[name], (poison or {}).get(name))


def train_worker(rank, world, reshard, reduce_dtype, variant, steps, quant=None):
    from qzero.fsdp import quantize_group_gathers, quantize_group_reduces

    param_dtype = torch.float32 if reduce_dtype == torch.float32 else torch.bfloat16
    out = {}
    for mode in ("plain", "qgrad"):
        model = shard(build(), world, reshard, param_dtype, reduce_dtype)
        report = None
        if mode == "qgrad":
            if variant == "gathers":
                quantize_group_gathers(model, group_size=GS, small_param_numel=SMALL)
            report = quantize_group_reduces(model, zero_quantized_gradients_group_size=GS, small_param_numel=SMALL,
                                            quant_kernels="reference", **(quant or {}))
            for _, m in _fsdp_modules(model):
                if variant == "gathers":  # 1 / (2 world): FSDP2 passes PREMUL_SUM (gloo has none)
                    m.set_gradient_divide_factor(2.0 * world)
        if variant == "sum":  # FSDP2 passes SUM and divides afterwards itself
            for _, m in _fsdp_modules(model):
                m.set_force_sum_reduction_for_comms(True)
        logs = {}
        _record(model, logs)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        losses, grads = [], None
        for step in range(steps):
            loss = model(batch(step, rank)).float().pow(2).mean()
            loss.backward()
            if step == 0:
                grads = {n: p.grad.to_local().detach().clone() for n, p in model.named_parameters()}
                first = {k: v[0] for k, v in logs.items()}
            opt.step()
            opt.zero_grad()
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses.append(t.item() / world)
        calls = {n: dict(m._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm.inner.calls)
                 for n, m in _fsdp_modules(model)} if mode == "qgrad" else None
        out[mode] = dict(losses=losses, grads=grads, first=first, report=report, calls=calls)
    return out


def _padded(world):
    """Per parameter name: (padded shard numel, rows of a padded shard, full rows)."""
    shapes = {n: tuple(p.shape) for n, p in build().named_parameters()}
    out = {}
    for n, shape in shapes.items():
        rows = -(-shape[0] // world)
        rest = 1
        for d in shape[1:]:
            rest *= d
        out[n] = (rows * rest, rows, shape[0], rest)
    return out


def expected_output(inputs, dest, world, names, kind, factor, fmt="int8"):
    """(bitwise expectation, fp64 sum) of rank ``dest``'s reduce-scatter output."""
    sizes = _padded(world)
    n = inputs[0].numel() // world
    exact, offset = [], 0
    for name in names:
        numel = sizes[name][0]
        if build().get_parameter(name).numel() <= SMALL:
            exact.append(torch.arange(offset, offset + numel))
        offset += numel
    assert offset == n
    idx = torch.cat(exact) if exact else None
    total = torch.zeros(n, dtype=torch.float32)
    total64 = torch.zeros(n, dtype=torch.float64)
    for s in range(world):
        x = inputs[s][dest * n : (dest + 1) * n].clone()
        if kind == "PREMUL_SUM":
            x.mul_(factor)
        if s == dest:
            c = x.to(torch.float32)
        else:
            values, scales = reference.quantize(x, GS, fmt, idx)
            c = reference.dequantize(values, scales, n, GS, fmt, torch.float32)
            if idx is not None:
                c[idx] = x[idx].to(torch.float32)
        total += c
        total64 += c.double()
    if kind == "AVG":
        total.mul_(1.0 / world)
        total64 /= world
    return total.to(inputs[0].dtype), total64


def _local(name, grad_out, world, rank, offset):
    numel, rows, full_rows, rest = _padded(world)[name]
    mine = max(0, min(rows, full_rows - rank * rows)) * rest
    return grad_out[offset : offset + mine], numel


CASES = [
    (2, True, torch.float32, "avg"),
    (3, False, torch.bfloat16, "avg"),
    (3, False, torch.float32, "avg"),
    (3, True, torch.float32, "gathers"),
    (2, False, torch.bfloat16, "sum"),
]


@pytest.mark.parametrize("world,reshard,reduce_dtype,variant", CASES,
                         ids=["w2-reshard-fp32-avg", "w3-keep-bf16-avg", "w3-keep-fp32-avg",
                              "w3-reshard-fp32-premul+gathers", "w2-keep-bf16-sum"])
def test_group_reduce_against_reference_and_plain(world, reshard, reduce_dtype, variant):
    steps = 3
    results = run_distributed(train_worker, world, reshard, reduce_dtype, variant, steps)
    report = results[0]["qgrad"]["report"]
    assert {g.module for g in report.groups} == set(GROUPS) and report.exact_params == 5
    assert report.bytes_sent < 0.6 * report.plain_bytes if reduce_dtype == torch.float32 else 0.75 * report.plain_bytes
    want_kind = {"avg": "AVG", "sum": "SUM", "gathers": "PREMUL_SUM"}[variant]
    for group, names in GROUPS.items():
        inputs = [res["qgrad"]["first"][group][0] for res in results]
        for rank, res in enumerate(results):
            x, got, kind, factor = res["qgrad"]["first"][group]
            assert kind == want_kind, (group, kind)
            if kind == "PREMUL_SUM":
                assert factor == pytest.approx(1.0 / (2 * world))
            want, want64 = expected_output(inputs, rank, world, names, kind, factor)
            assert got.dtype == reduce_dtype and torch.equal(got, want), (group, rank)
            assert torch.allclose(got.double(), want64, rtol=1e-5 if reduce_dtype == torch.float32 else 1e-2,
                                  atol=1e-7), (group, rank)
            # the sharded gradients FSDP2 views out of the output (SUM: divided by FSDP2 afterwards)
            post = world if variant == "sum" else 1
            offset = 0
            for name in names:
                part, numel = _local(name, got.float() / post if post != 1 else got.float(), world, rank, offset)
                qg = res["qgrad"]["grads"][name].reshape(-1)
                pg = res["plain"]["grads"][name].reshape(-1)
                assert torch.equal(qg, part), (name, rank)
                offset += numel
                if variant == "gathers":  # computed with other (quantized) weights than plain FSDP2's
                    continue
                small = build().get_parameter(name).numel() <= SMALL
                if small:  # exact, up to the order (fp32) or the rounding (plain gloo sums bf16 in bf16)
                    if reduce_dtype == torch.float32:
                        assert torch.allclose(qg, pg, rtol=1e-5, atol=1e-7), (name, rank)
                    else:
                        assert torch.allclose(qg, pg, rtol=2e-2, atol=1e-2 * pg.abs().max().item()), (name, rank)
                elif qg.numel():
                    assert not torch.equal(qg, pg), (name, rank)
                    assert torch.allclose(qg, pg, rtol=0, atol=0.05 * pg.abs().max().item()), (name, rank)
    for res in results:
        for name, c in res["qgrad"]["calls"].items():
            assert c == {"quantized": steps, "plain": 0}, (name, c)
    plain, q = results[0]["plain"]["losses"], results[0]["qgrad"]["losses"]
    assert plain != q
    for a, b in zip(plain, q):
        assert abs(a - b) <= 0.02 * abs(a), (plain, q)


def test_group_reduce_int4_with_the_rotation():
    """``zero_quantized_gradients_format="int4"`` (the Hadamard rotation by default): each output is
    the gradient reference's rank-ordered sum of the recorded inputs (rotated, summed, rotated
    back), bit for bit."""
    from qzero.layout import aligned_layout
    from qzero.quant import gradients
    from qzero.quant.formats import get_format

    world, steps, block = 3, 2, 8
    results = run_distributed(train_worker, world, False, torch.float32, "avg", steps,
                              {"zero_quantized_gradients_format": "int4",
                               "zero_quantized_gradients_rotation_block": block})
    sizes = _padded(world)
    for group, names in GROUPS.items():
        inputs = [res["qgrad"]["first"][group][0] for res in results]
        n = inputs[0].numel() // world
        exact, offset = [], 0
        for name in names:
            if build().get_parameter(name).numel() <= SMALL:
                exact.append(torch.arange(offset, offset + sizes[name][0]))
            offset += sizes[name][0]
        idx = torch.cat(exact) if exact else None
        count = 0 if idx is None else idx.numel()
        layout = aligned_layout(get_format("int4").value_bytes(n), -(-n // GS), count, 4)
        for dest, res in enumerate(results):
            _, got, kind, _ = res["qgrad"]["first"][group]
            assert kind == "AVG"
            payloads = []
            for s in range(world):
                if s != dest:
                    p = torch.zeros(layout.nbytes, dtype=torch.uint8)
                    gradients.pack_gradient(inputs[s][dest * n : (dest + 1) * n], p, layout, GS, "int4", idx, block)
                    payloads.append(p)
            want = torch.empty(n, dtype=torch.float32)
            gradients.dequantize_sum(torch.cat(payloads), inputs[dest][dest * n : (dest + 1) * n], want, layout, dest,
                                     world, GS, "int4", idx, block)
            want.mul_(1.0 / world)
            assert torch.equal(got, want), (group, dest)
            exact64 = sum(x[dest * n : (dest + 1) * n].double() for x in inputs) / world
            assert torch.allclose(got.double(), exact64, rtol=0, atol=0.1 * float(exact64.abs().max()) + 1e-12)
    for a, b in zip(results[0]["plain"]["losses"], results[0]["qgrad"]["losses"]):
        assert abs(a - b) <= 0.05 * abs(a)


# ---------------------------------------------------------------------- non-finite gradients


def nan_worker(rank, world):
    from qzero.fsdp import quantize_group_reduces

    model = shard(build(), world, True, torch.float32, torch.float32)
    quantize_group_reduces(model, zero_quantized_gradients_group_size=GS, small_param_numel=SMALL)
    weight = _padded(world)["mid.weight"][0]

    def poison(x):  # rank 1's copy of what rank 0 owns: mid.weight elements 5 (NaN), 200 (Inf), mid.bias 3 (NaN)
        if rank == 1:
            x[5] = float("nan")
            x[200] = float("inf")
            x[weight + 3] = float("nan")

    logs = {}
    _record(model, logs, {"mid": poison})
    model(batch(0, rank)).float().pow(2).mean().backward()
    return logs["mid"][0][1], weight


def test_non_finite_gradients_arrive_as_nan():
    results = run_distributed(nan_worker, 2)
    out, weight = results[0]
    bad = ~torch.isfinite(out)
    want = torch.zeros_like(bad)
    want[0:64] = True  # the whole group of element 5 (one scale)
    want[192:256] = True  # the whole group of element 200
    want[weight + 3] = True  # a small parameter: that element alone, exact
    assert torch.equal(bad, want)
    assert torch.isnan(out[weight + 3]) and torch.isnan(out[5]) and torch.isnan(out[200])
    assert torch.isfinite(results[1][0]).all()  # rank 1's own part was not poisoned


# ---------------------------------------------------------------------- bad input


BAD_CALLS = [
    (dict(zero_quantized_gradients_group_size=12), ValueError,
     "zero_quantized_gradients_group_size must be a positive multiple of 8, got 12"),
    (dict(zero_quantized_gradients_format="int5"), ValueError,
     "zero_quantized_gradients_format must be one of ['int8', 'fp8', 'int4'], got 'int5'"),
    (dict(zero_quantized_gradients_format="int4", zero_quantized_gradients_group_size=16,
          zero_quantized_gradients_rotation_block=32), ValueError,
     "zero_quantized_gradients_rotation_block 32 is larger than zero_quantized_gradients_group_size 16"),
    (dict(zero_quantized_gradients_rotation="walsh"), ValueError, "zero_quantized_gradients_rotation must be one of"),
    (dict(zero_quantized_gradients_rotation_block=12), ValueError,
     "zero_quantized_gradients_rotation_block must be a power of two"),
    (dict(small_param_numel=-1), ValueError, "small_param_numel must be >= 0, got -1"),
    (dict(quant_kernels="cuda"), ValueError, "quant_kernels must be one of"),
    # the former keywords, and the weight settings' short names: refused, naming the field to use
    (dict(fmt="int4"), TypeError, "'fmt'; did you mean zero_quantized_gradients_format="),
    (dict(group_size=64), TypeError, "'group_size'; did you mean zero_quantized_gradients_group_size="),
    (dict(rotation="none"), TypeError, "'rotation'; did you mean zero_quantized_gradients_rotation="),
    (dict(rotation_block=32), TypeError, "'rotation_block'; did you mean zero_quantized_gradients_rotation_block="),
    (dict(kernels="auto"), TypeError, "'kernels'; did you mean quant_kernels="),
]


def _comm_types(model):
    return [(n, type(m._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm).__name__)
            for n, m in _fsdp_modules(model)]


def refusal_worker(rank, world):
    from torch.distributed.fsdp import FSDPModule

    from qzero.fsdp import group_reduce_report, quantize_group_reduces

    def attempt(fn, *args, **kwargs):
        try:
            fn(*args, **kwargs)
            return None
        except (ValueError, TypeError) as e:
            return f"{type(e).__name__}: {e}"

    out = {}
    model = shard(build(), world, True, torch.float32, torch.float32)
    before = _comm_types(model)
    out["bad"] = [attempt(quantize_group_reduces, model, **kw) for kw, _, _ in BAD_CALLS]
    out["report_before"] = attempt(group_reduce_report, model)
    saved = FSDPModule.set_custom_reduce_scatter
    del FSDPModule.set_custom_reduce_scatter
    try:
        out["old_torch"] = attempt(quantize_group_reduces, model)
    finally:
        FSDPModule.set_custom_reduce_scatter = saved
    out["untouched"] = _comm_types(model) == before and all(c == "DefaultReduceScatter" for _, c in before)
    report = quantize_group_reduces(model, small_param_numel=SMALL)
    out["installed"] = _comm_types(model)
    out["twice"] = attempt(quantize_group_reduces, model)
    out["same_after_twice"] = _comm_types(model) == out["installed"] and group_reduce_report(model) is report
    comm = model._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm
    n = 8
    out["bad_op"] = attempt(comm, torch.zeros(n), torch.zeros(world * n), dist.group.WORLD, dist.ReduceOp.MAX)
    custom = shard(build(), world, True, torch.float32, torch.float32)
    _record(custom, {})  # a custom reduce-scatter on every module
    before = _comm_types(custom)
    out["custom"] = attempt(quantize_group_reduces, custom)
    out["custom_untouched"] = _comm_types(custom) == before
    return out


def test_bad_input_is_refused_on_every_rank_and_changes_nothing():
    from qzero.fsdp import quantize_group_reduces

    for out in run_distributed(refusal_worker, 2):
        for (kw, error, match), message in zip(BAD_CALLS, out["bad"]):
            assert message is not None and message.startswith(error.__name__) and match in message, (kw, message)
        assert "was not passed to qzero.fsdp.quantize_group_reduces" in out["report_before"]
        assert "has no set_custom_reduce_scatter" in out["old_torch"]
        assert out["untouched"]
        assert len(out["installed"]) == 4 and all(c == "GroupQuantizedReduceScatter" for _, c in out["installed"])
        assert "already applied" in out["twice"] and out["same_after_twice"]
        assert "reduce op" in out["bad_op"] and "SUM, AVG and PREMUL_SUM" in out["bad_op"]
        assert "already has a custom reduce-scatter (Recorder)" in out["custom"] and out["custom_untouched"]
    model = build()  # before fully_shard: nothing sharded (no process group needed to tell)
    snap = _snapshot(model)
    with pytest.raises(ValueError, match="must be called after fully_shard"):
        quantize_group_reduces(model)
    with pytest.raises(TypeError, match="must be a torch.nn.Module, got int"):
        quantize_group_reduces(3)
    assert all(torch.equal(a[3], b[3]) for a, b in zip(snap, _snapshot(model)))


# ---------------------------------------------------------------------- the training arm


def arm_worker(rank, world):
    from qzero.app.train import TrainSettings, train_worker

    records = {}
    for name, zero in (("plain", {}), ("qgrad", {"zero_quantized_gradients": True})):
        settings = TrainSettings(backend="fsdp2", zero=zero, reshard_after_forward=True, steps=3, warmup=0,
                                 world_size=world)
        records[name] = train_worker(settings, None, show_progress=False)
    return records


def test_fsdp2_quantized_gradient_arm_of_qzero_train():
    """``backend=fsdp2,reshard_after_forward=true,zero_quantized_gradients=true`` trains the
    tiny model as plain FSDP2 does, within the quantization's reach, and counts the bytes
    its reduce-scatters sent."""
    plain, q = run_distributed(arm_worker, 2)[0].values()
    assert q["losses"] != plain["losses"]
    assert max(abs(a - b) for a, b in zip(plain["losses"], q["losses"])) < 0.01 * plain["losses"][0]
    assert q["grad_bytes_sent_per_step"] < 0.7 * q["grad_plain_bytes_per_step"]
    assert plain["grad_bytes_sent_per_step"] == plain["grad_plain_bytes_per_step"]
