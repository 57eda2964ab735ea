"""qzero.fsdp.quantize_group_gathers: FSDP2's all-gather of each parameter group through
qzero's gather engine, on gloo ranks, against plain FSDP2 and the reference quantizer.

The weights every rank computes with (captured by forward pre-hooks) are checked bit for
bit against the reference quantizer applied, independently of the engine, to what plain
FSDP2 gathers: each rank's padded shards of a group's parameters back to back in the
compute dtype, quantized in groups of 64 from the start of that input, small parameters
exact (and the groups that cost less sent verbatim than coded). World sizes 2 and 3 (with
unevenly sharded, padded parameters), bf16 and fp32 compute, both reshard modes.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _support.distributed import run_distributed
from _support.simulate import side_mask
from qzero.quant import reference
from test_fsdp import GS, SMALL, _snapshot, batch, build, shard

#: Each FSDP module's parameters in FSDP2's order (the module's own, registration order).
GROUPS = {
    "up": ["up.weight", "up.bias"],
    "mid": ["mid.weight", "mid.bias"],
    "odd": ["odd.weight", "odd.bias"],
    "": ["embed.weight", "norm.weight", "norm.bias", "out.weight"],
}


def expected_group(weights: dict, names: list, world: int, dtype) -> dict:
    """What every rank must compute with when ``names`` (a group) are gathered by
    quantize_group_gathers, from the weights plain FSDP2 gathers (``weights``)."""
    rows = {n: -(-weights[n].shape[0] // world) for n in names}
    out_parts = {n: [] for n in names}
    for r in range(world):
        pieces, exact = [], []
        offset = 0
        for n in names:
            w = weights[n].to(dtype)
            padded = torch.zeros((rows[n], *w.shape[1:]), dtype=dtype)
            mine = w[r * rows[n] : (r + 1) * rows[n]]
            padded[: mine.shape[0]] = mine
            flat = padded.reshape(-1)
            if w.numel() <= SMALL:
                exact.append(torch.arange(offset, offset + flat.numel()))
            pieces.append(flat)
            offset += flat.numel()
        x = torch.cat(pieces)
        # and the groups that cost less sent verbatim than coded (see [Note: exact groups])
        ranges = [(int(e[0]), int(e[-1]) + 1) for e in exact]
        mask = torch.from_numpy(side_mask(x.numel(), 1, GS, ranges, "int8", x.element_size()))
        idx = mask.nonzero().flatten() if mask.any() else None
        values, scales = reference.quantize(x, GS, "int8", idx)
        y = reference.dequantize(values, scales, x.numel(), GS, "int8", dtype)
        if idx is not None:
            y[idx] = x[idx]
        offset = 0
        for n, flat in zip(names, pieces):
            seg = y[offset : offset + flat.numel()].view(rows[n], *weights[n].shape[1:])
            out_parts[n].append(seg[: max(0, min(rows[n], weights[n].shape[0] - r * rows[n]))])
            offset += flat.numel()
    return {n: torch.cat(out_parts[n]) for n in names}


def group_worker(rank, world, reshard, dtype, steps):
    from qzero.fsdp import quantize_group_gathers

    out = {}
    for mode in ("plain", "group"):
        model = shard(build(), world, False, reshard, dtype)
        report = quantize_group_gathers(model, group_size=GS, small_param_numel=SMALL) if mode == "group" else None
        if mode == "group":  # poisoned all-gather buffers: every element must be written by the gather
            for m in model.modules():
                if hasattr(m, "_get_fsdp_state"):
                    m._get_fsdp_state()._fsdp_param_group._all_gather_comm.allocate = (
                        lambda size, *, dtype, device: torch.full(tuple(size), float("nan"), dtype=dtype,
                                                                  device=device))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        seen = {}
        for name, m in model.named_children():
            m.register_forward_pre_hook(lambda mod, args, name=name: seen.update(
                {f"{name}.{k}": p.detach().clone() for k, p in mod.named_parameters(recurse=False)}))
        losses, first = [], None
        for step in range(steps):
            seen.clear()
            loss = model(batch(step, rank)).float().pow(2).mean()
            if step == 0:
                first = dict(seen)
            loss.backward()
            opt.step()
            opt.zero_grad()
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses.append(t.item() / world)
        calls = {}
        if mode == "group":
            for name, m in model.named_modules():
                if hasattr(m, "_get_fsdp_state"):
                    calls[name] = dict(m._get_fsdp_state()._fsdp_param_group._all_gather_comm.calls)
        out[mode] = dict(losses=losses, seen=first, report=report, calls=calls)
    return out


@pytest.mark.parametrize(
    "world,reshard,dtype",
    [(2, True, torch.bfloat16), (2, False, torch.float32), (3, False, torch.bfloat16), (3, True, torch.float32)],
    ids=["w2-reshard-bf16", "w2-keep-fp32", "w3-keep-bf16", "w3-reshard-fp32"],
)
def test_group_gather_against_reference_and_plain(world, reshard, dtype):
    steps = 3
    results = run_distributed(group_worker, world, reshard, dtype, steps)
    r0 = results[0]
    report = r0["group"]["report"]
    assert set(report.quantized) == set(GROUPS) and not report.plain
    assert report.exact_params == 5  # the biases of up, mid, odd and the norm's two
    assert report.bytes_sent < 0.7 * report.plain_bytes
    plain_seen = r0["plain"]["seen"]
    want = {}
    for names in GROUPS.values():
        want.update(expected_group(plain_seen, names, world, dtype))
    for name, w in want.items():
        small = plain_seen[name].numel() <= SMALL
        for rank, res in enumerate(results):
            got = res["group"]["seen"][name]
            assert got.dtype == dtype and torch.equal(got, w), (name, rank)
            assert torch.equal(res["plain"]["seen"][name], plain_seen[name])
        if small:
            assert torch.equal(w, plain_seen[name]), name
        else:
            assert not torch.equal(w, plain_seen[name]), name
    for calls in (res["group"]["calls"] for res in results):
        for name, c in calls.items():
            assert c == {"quantized": steps * (2 if reshard else 1), "plain": 0}, (name, c)
    plain, group = r0["plain"]["losses"], r0["group"]["losses"]
    assert plain != group
    for a, b in zip(plain, group):
        assert abs(a - b) <= 0.02 * abs(a), (plain, group)


def dcp_worker(rank, world, path, save_group):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    from qzero.fsdp import quantize_group_gathers

    def make(group):
        model = shard(build(), world, False, True)
        if group:
            quantize_group_gathers(model, group_size=GS, small_param_numel=SMALL)
        return model

    saved_model = make(save_group)
    opt = torch.optim.AdamW(saved_model.parameters(), lr=1e-2)
    saved_model(batch(0, rank)).float().pow(2).mean().backward()
    opt.step()
    state = saved_model.state_dict()
    plain_locals = all(type(v._local_tensor) is torch.Tensor and v.dtype == torch.float32
                       for v in state.values() if isinstance(v, DTensor))
    dcp.save(state, checkpoint_id=path)
    saved = {k: v.full_tensor() for k, v in saved_model.state_dict().items()}

    loaded_model = make(not save_group)
    target = loaded_model.state_dict()
    dcp.load(target, checkpoint_id=path)
    loaded_model.load_state_dict(target)
    loaded = {k: v.full_tensor() for k, v in loaded_model.state_dict().items()}
    return plain_locals, saved, loaded


@pytest.mark.parametrize("save_group", [True, False], ids=["save-group", "save-plain"])
def test_checkpoint_round_trip(tmp_path, save_group):
    results = run_distributed(dcp_worker, 2, str(tmp_path / "ckpt"), save_group)
    for plain_locals, saved, loaded in results:
        assert plain_locals, "the state dict must hold plain fp32 shards"
        assert saved.keys() == loaded.keys()
        for k in saved:
            assert torch.equal(saved[k], loaded[k]), k


# ---------------------------------------------------------------------- bad input


def _comms(model):
    return [(n, type(m._get_fsdp_state()._fsdp_param_group._all_gather_comm).__name__)
            for n, m in model.named_modules() if hasattr(m, "_get_fsdp_state")]


BAD_CALLS = [
    (dict(zero_quantized_weights_group_size=12), "zero_quantized_weights_group_size must be a positive multiple of 8, "
                                                 "got 12"),
    (dict(group_size=12), "zero_quantized_weights_group_size must be a positive multiple of 8, got 12"),  # short name
    (dict(group_size=True), "group_size"),
    (dict(fmt="int3"), "zero_quantized_weights_format: unknown quantization format 'int3'"),
    (dict(small_param_numel=-1), "small_param_numel must be >= 0, got -1"),
    (dict(quant_kernels="cuda"), "quant_kernels must be one of"),
    (dict(kernels="auto"), "TypeError: quantize_group_gathers() got an unexpected keyword argument 'kernels'; did you "
                           "mean quant_kernels="),  # the former keyword
    (dict(fmt="int8", zero_quantized_weights_format="fp8"), "got both fmt= and zero_quantized_weights_format="),
]


def bad_input_worker(rank, world):
    from qzero.fsdp import group_gather_report, quantize_group_gathers

    out = []
    model = shard(build(), world, False, True)
    before = _comms(model)
    for kwargs, _ in BAD_CALLS:
        try:
            quantize_group_gathers(model, **kwargs)
            out.append(None)
        except (ValueError, TypeError) as e:
            out.append(f"{type(e).__name__}: {e}")
    untouched = _comms(model) == before and all(c == "DefaultAllGather" for _, c in before)
    try:
        group_gather_report(model)
        out.append(None)
    except ValueError as e:
        out.append(str(e))
    report = quantize_group_gathers(model, small_param_numel=SMALL)
    installed = _comms(model)
    try:  # a second call
        quantize_group_gathers(model)
        out.append(None)
    except ValueError as e:
        out.append(str(e))
    same_after_second = _comms(model) == installed and group_gather_report(model) is report
    per_param = shard(build(), world, True, True)  # quantize_weight_gathers, then fully_shard
    before_pp = _comms(per_param)
    try:
        quantize_group_gathers(per_param)
        out.append(None)
    except ValueError as e:
        out.append(str(e))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mixed = build()
    mixed.mid.bias.data = mixed.mid.bias.data.double()  # no param_dtype: FSDP2 gathers raw bytes
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(mixed.mid, mesh=mesh)
    fully_shard(mixed, mesh=mesh)
    mixed_report = quantize_group_gathers(mixed, small_param_numel=SMALL)
    return out, untouched, installed, same_after_second, _comms(per_param) == before_pp, mixed_report, _comms(mixed)


def test_bad_input_is_refused_on_every_rank_and_changes_nothing():
    from qzero.fsdp import quantize_group_gathers

    for out, untouched, installed, same, pp_untouched, mixed, mixed_comms in run_distributed(bad_input_worker, 2):
        for (kwargs, match), message in zip(BAD_CALLS, out):
            assert message is not None and match in message, (kwargs, message)
        assert untouched
        assert "was not passed to qzero.fsdp.quantize_group_gathers" in out[len(BAD_CALLS)]
        assert all(c == "GroupQuantizedAllGather" for _, c in installed) and len(installed) == 4
        assert "already applied" in out[len(BAD_CALLS) + 1] and same
        assert "quantize_weight_gathers" in out[len(BAD_CALLS) + 2] and "cannot be combined" in out[-1]
        assert pp_untouched
        # a group of mixed dtypes keeps FSDP2's own all-gather, and the report says so
        assert mixed.quantized == ("",) and mixed.plain == (("mid", "mixed dtypes (float32, float64): FSDP2 gathers "
                                                                     "them as raw bytes"),)
        assert dict(mixed_comms) == {"": "GroupQuantizedAllGather", "mid": "DefaultAllGather"}
    # before fully_shard: nothing is sharded (no process group needed to tell)
    model = build()
    snap = _snapshot(model)
    with pytest.raises(ValueError, match="must be called after fully_shard"):
        quantize_group_gathers(model)
    with pytest.raises(TypeError, match="must be a torch.nn.Module, got int"):
        quantize_group_gathers(3)
    assert all(torch.equal(a[3], b[3]) for a, b in zip(snap, _snapshot(model)))


# ---------------------------------------------------------------------- the training arm


def arm_worker(rank, world):
    from qzero.app.train import TrainSettings, train_worker

    records = {}
    for name, zero, quantize in (("plain", {}, "parameter"), ("group", {"zero_quantized_weights": True}, "group")):
        settings = TrainSettings(backend="fsdp2", zero=zero, fsdp_quantize=quantize, reshard_after_forward=True,
                                 steps=3, warmup=0, world_size=world)
        records[name] = train_worker(settings, None, show_progress=False)
    return records


def test_fsdp2_group_arm_of_qzero_train():
    """``backend=fsdp2,quantized=true,fsdp_quantize=group`` (an arm of qzero bench steps)
    trains the tiny Qwen3 model as plain FSDP2 does, within the quantization's reach, sending
    about half the bytes, counted as the plain arm counts them."""
    plain, group = run_distributed(arm_worker, 2)[0].values()
    assert group["losses"] != plain["losses"]
    assert max(abs(a - b) for a, b in zip(plain["losses"], group["losses"])) < 0.01 * plain["losses"][0]
    assert group["plain_bytes_per_step"] == plain["bytes_sent_per_step"]
    assert group["bytes_sent_per_step"] < 0.6 * plain["bytes_sent_per_step"]
    assert group["sample_hash"] != plain["sample_hash"]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(backend="fsdp2", fsdp_quantize="layer", zero={"zero_quantized_weights": True}),
         "fsdp_quantize must be one of parameter, group, got 'layer'"),
        (dict(backend="qzero", fsdp_quantize="group", zero={"zero_quantized_weights": True}),
         "fsdp_quantize=group is a setting of the fsdp2 backend with quantized=true, not of backend 'qzero'"),
        (dict(backend="fsdp2", fsdp_quantize="group"),
         "with quantized=true, not of backend 'fsdp2' with quantized=false"),
    ],
)
def test_fsdp_quantize_setting_is_validated(kwargs, match):
    from qzero.app.train import TrainSettings, validate
    from qzero.app.workload import WorkloadError

    with pytest.raises(WorkloadError, match=match):
        validate(TrainSettings(device="cpu", **kwargs))
