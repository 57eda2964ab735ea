"""qzero.fsdp: FSDP2 with the quantized weight gather, on gloo ranks, against plain FSDP2.

The unsharded weights every rank computes with are checked bit for bit against the
reference quantizer applied to the fp32 master shards (independently of the
extension's code path), in both reshard modes, at world sizes 2 and 3, including a
parameter whose shard ends in a short group and one that does not shard evenly.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _support.distributed import run_distributed
from qzero.quant import reference

GS = 64
SMALL = 1000  # parameters up to this many elements travel exactly


class Net(nn.Module):
    """Shapes chosen for the gather: see the sizes in the comments (world 2 / world 3)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(96, 30)  # 2880: shards of 1440 (22.5 groups) / 960 (15 groups)
        self.up = nn.Linear(30, 96)  # weight like embed; bias 96: small, exact
        self.mid = nn.Linear(96, 48)  # 4608: 2304 / 1536
        self.odd = nn.Linear(48, 50)  # 2400: even over 2; 50 rows do not split over 3 -> plain
        self.norm = nn.LayerNorm(50)  # small
        self.out = nn.Linear(50, 96, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        h = torch.relu(self.up(h))
        h = torch.relu(self.mid(h))
        return self.out(self.norm(self.odd(h)))


def build() -> Net:
    torch.manual_seed(0)
    return Net()


def shard(model, world, quantized, reshard, dtype=torch.bfloat16):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from qzero.fsdp import quantize_weight_gathers

    if quantized:
        quantize_weight_gathers(model, group_size=GS, small_param_numel=SMALL)
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for child in (model.up, model.mid, model.odd):
        fully_shard(child, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    return model


def batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 96, (4, 8), generator=g)


def expected_unsharded(full: torch.Tensor, world: int, quantized: bool, dtype) -> torch.Tensor:
    """What every rank must compute with: each rank's fp32 shard through the reference
    quantizer and back (quantized), or the master rounded to the compute dtype (plain)."""
    if not quantized:
        return full.to(dtype)
    parts = []
    for piece in full.chunk(world, dim=0):
        flat = piece.reshape(-1)
        values, scales = reference.quantize(flat, GS, "int8")
        parts.append(reference.dequantize(values, scales, flat.numel(), GS, "int8", dtype))
    return torch.cat(parts).view(full.shape)


def train_worker(rank, world, reshard, dtype, steps):
    """Quantized and plain FSDP2 side by side; unsharded weights captured in the last forward."""
    from qzero.fsdp import gather_report

    out = {}
    for quantized in (False, True):
        model = shard(build(), world, quantized, reshard, dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        seen = {}
        hooks = [
            m.register_forward_pre_hook(
                lambda mod, args, name=name: seen.update(
                    {f"{name}.{k}": p.detach().clone() for k, p in mod.named_parameters(recurse=False)}
                )
            )
            for name, m in model.named_children()
        ]
        losses = []
        for step in range(steps):
            if step == steps - 1:  # the masters the last forward's weights come from
                masters = {k: p.full_tensor() for k, p in model.named_parameters()}
                sharded = dict(model.named_parameters())  # after the forward, modules hold unsharded ones
                local = {k: p.to_local().clone() for k, p in sharded.items()}
            seen.clear()
            loss = model(batch(step, rank)).float().pow(2).mean()
            if step == steps - 1:
                untouched = all(torch.equal(p.to_local(), local[k]) for k, p in sharded.items())
            loss.backward()
            opt.step()
            opt.zero_grad()
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses.append(t.item() / world)
        for h in hooks:
            h.remove()
        out[quantized] = dict(
            losses=losses,
            seen=seen,
            masters=masters,
            untouched=untouched,
            final={k: p.full_tensor() for k, p in model.named_parameters()},
            report=gather_report(model) if quantized else None,
        )
    return out


@pytest.mark.parametrize(
    "world,reshard,dtype",
    [(2, True, torch.bfloat16), (2, False, torch.float16), (3, False, torch.bfloat16), (3, True, torch.bfloat16)],
    ids=["w2-reshard-bf16", "w2-keep-fp16", "w3-keep-bf16", "w3-reshard-bf16"],
)
def test_quantized_gather_against_reference_and_plain(world, reshard, dtype):
    steps, lr = 3, 1e-2
    results = run_distributed(train_worker, world, reshard, dtype, steps)
    r0 = results[0]
    report = r0[True]["report"]
    uneven = world == 3
    quantized_names = {"embed.weight", "up.weight", "mid.weight", "out.weight"} | (set() if uneven else {"odd.weight"})
    assert set(report.quantized) == quantized_names
    assert dict(report.plain).keys() == {n for n in r0[True]["final"] if n not in quantized_names}
    if uneven:
        assert dict(report.plain)["odd.weight"].startswith("uneven")

    for quantized in (False, True):
        run = r0[quantized]
        assert run["untouched"], "the gather modified a master shard"
        for name, full in run["masters"].items():
            want = expected_unsharded(full, world, quantized and name in quantized_names, dtype)
            for rank, res in enumerate(results):  # every replica, bit for bit
                got = res[quantized]["seen"][name]
                assert got.dtype == dtype and torch.equal(got, want), (quantized, name, rank)

    # The quantized run really differs from plain, by no more than the quantization allows.
    plain, quant = r0[False], r0[True]
    assert plain["losses"] != quant["losses"]
    for a, b in zip(plain["losses"], quant["losses"]):
        assert abs(a - b) <= 0.02 * abs(a), (plain["losses"], quant["losses"])
    # Adam moves a weight by at most lr * (1 - beta1) / sqrt(1 - beta2) (about 3.2 lr) a step,
    # so two runs from the same start differ by at most twice that per step.
    bound = 2 * steps * lr * 3.2
    diffs = {k: (plain["final"][k] - quant["final"][k]).abs().max().item() for k in plain["final"]}
    assert max(diffs.values()) <= bound, diffs
    assert diffs["mid.weight"] > 0


def dcp_worker(rank, world, path, save_quantized, raf):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    saved_model = shard(build(), world, save_quantized, raf)
    opt = torch.optim.AdamW(saved_model.parameters(), lr=1e-2)
    saved_model(batch(0, rank)).float().pow(2).mean().backward()
    opt.step()
    state = saved_model.state_dict()
    plain_locals = all(type(v._local_tensor) is torch.Tensor for v in state.values() if isinstance(v, DTensor))
    dcp.save(state, checkpoint_id=path)
    saved = {k: v.full_tensor() for k, v in saved_model.state_dict().items()}

    loaded_model = shard(build(), world, not save_quantized, raf)
    before = loaded_model(batch(1, rank)).detach()
    target = loaded_model.state_dict()
    dcp.load(target, checkpoint_id=path)
    loaded_model.load_state_dict(target)
    loaded = {k: v.full_tensor() for k, v in loaded_model.state_dict().items()}
    after = loaded_model(batch(1, rank)).detach()  # gathers again from the loaded masters
    return plain_locals, saved, loaded, torch.equal(before, after)


@pytest.mark.parametrize("save_quantized", [True, False], ids=["save-quantized", "save-plain"])
def test_checkpoint_round_trip(tmp_path, save_quantized):
    results = run_distributed(dcp_worker, 2, str(tmp_path / "ckpt"), save_quantized, save_quantized)
    for plain_locals, saved, loaded, same_output in results:
        assert plain_locals, "the state dict must hold plain fp32 tensors"
        assert saved.keys() == loaded.keys()
        for k in saved:
            assert saved[k].dtype == torch.float32 and torch.equal(saved[k], loaded[k]), k
        assert not same_output  # the loaded weights are the ones gathered afterwards


# ---------------------------------------------------------------------- bad input


def _snapshot(model):
    return [(n, type(p), p.dtype, p.detach().clone()) for n, p in model.named_parameters()]


def _same(model, snap):
    now = _snapshot(model)
    return len(now) == len(snap) and all(
        a[0] == b[0] and a[1] is b[1] and a[2] == b[2] and torch.equal(a[3], b[3]) for a, b in zip(now, snap)
    )


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(zero_quantized_weights_group_size=12), ValueError,
         "zero_quantized_weights_group_size must be a positive multiple of 8, got 12"),
        (dict(group_size=12), ValueError, "zero_quantized_weights_group_size must be a positive multiple of 8, got 12"),
        (dict(group_size=0), ValueError, "group_size"),
        (dict(group_size=True), ValueError, "group_size"),
        (dict(zero_quantized_weights_format="int3"), ValueError, "unknown quantization format 'int3'"),
        (dict(fmt="int3"), ValueError, "zero_quantized_weights_format: unknown quantization format 'int3'"),
        (dict(small_param_numel=-1), ValueError, "small_param_numel must be >= 0, got -1"),
        (dict(kernels="auto"), TypeError, "unexpected keyword argument 'kernels'"),
        (dict(fmts="int8"), TypeError, "unexpected keyword argument 'fmts'; did you mean fmt="),
        (dict(fmt="int8", zero_quantized_weights_format="fp8"), TypeError,
         "got both fmt= and zero_quantized_weights_format="),
    ],
)
def test_bad_arguments_leave_the_model_alone(kwargs, error, match):
    from qzero.fsdp import quantize_weight_gathers

    model = build()
    snap = _snapshot(model)
    with pytest.raises(error, match=match):
        quantize_weight_gathers(model, **kwargs)
    assert _same(model, snap)


def test_non_fp32_model_and_second_call_are_refused():
    from qzero.fsdp import QuantizedGatherTensor, quantize_weight_gathers

    model = build()
    model.mid.bfloat16()
    snap = _snapshot(model)
    with pytest.raises(TypeError, match=r"fp32 \(master\) model, but parameter 'mid.weight' is torch.bfloat16"):
        quantize_weight_gathers(model, small_param_numel=SMALL)
    assert _same(model, snap)

    model = quantize_weight_gathers(build(), small_param_numel=SMALL)
    assert isinstance(model.mid.weight, QuantizedGatherTensor)
    snap = _snapshot(model)
    with pytest.raises(ValueError, match="already applied to this model"):
        quantize_weight_gathers(model)
    assert _same(model, snap)


def after_shard_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from qzero.fsdp import quantize_weight_gathers

    model = build()
    fully_shard(model.mid, mesh=init_device_mesh("cpu", (world,)))
    snap = _snapshot(model)
    try:
        quantize_weight_gathers(model)
    except ValueError as e:
        return str(e), _same(model, snap)
    return None, None


def test_called_after_fully_shard_is_refused():
    for message, unchanged in run_distributed(after_shard_worker, 2):
        assert message is not None and "before fully_shard" in message and "'mid'" in message
        assert unchanged


def test_tied_parameter_is_wrapped_once_and_state_dict_is_plain():
    from qzero.fsdp import QuantizedGatherTensor, gather_report, quantize_weight_gathers

    model = build()
    model.out.weight = model.embed.weight  # tied, as an LM's embedding and head
    quantize_weight_gathers(model, small_param_numel=SMALL)
    assert model.out.weight is model.embed.weight and isinstance(model.out.weight, QuantizedGatherTensor)
    assert "embed.weight" in gather_report(model).quantized and gather_report(model).world_size is None
    state = model.state_dict()
    assert all(type(v) is torch.Tensor for v in state.values())
    assert state["out.weight"].data_ptr() == model.embed.weight.unwrapped.data_ptr()
    with pytest.raises(ValueError, match="was not passed to qzero.fsdp.quantize_weight_gathers"):
        gather_report(build())



# ---------------------------------------------------------------------- the training arm


def arm_worker(rank, world):
    from qzero.app.train import TrainSettings, train_worker

    records = {}
    for quantized in (False, True):
        settings = TrainSettings(
            backend="fsdp2", zero={"zero_quantized_weights": quantized}, reshard_after_forward=True, steps=3, warmup=0,
            world_size=world,
        )
        records[quantized] = train_worker(settings, None, show_progress=False)
    return records


def test_fsdp2_arm_of_qzero_train():
    """``backend=fsdp2, quantized=true`` (what ``qzero qualify --backend fsdp2`` and
    qzero bench steps A/B) runs the tiny Qwen3 model and sends about half the bytes."""
    plain, quant = run_distributed(arm_worker, 2)[0].values()
    assert quant["losses"] != plain["losses"]
    assert max(abs(a - b) for a, b in zip(plain["losses"], quant["losses"])) < 0.01 * plain["losses"][0]
    assert quant["plain_bytes_per_step"] == plain["bytes_sent_per_step"]
    assert quant["bytes_sent_per_step"] < 0.6 * plain["bytes_sent_per_step"]
    assert quant["sample_hash"] != plain["sample_hash"]



def meta_init_worker(rank, world):
    """The large-model flow: build on meta, shard, materialise, initialise; plain and quantized."""
    out = []
    for quantized in (False, True):
        with torch.device("meta"):
            model = Net()
        model = shard(model, world, quantized, True)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        for module in list(model.modules())[1:]:
            module.reset_parameters()
        masters = {k: p.full_tensor() for k, p in model.named_parameters()}
        loss = model(batch(0, rank)).float().pow(2).mean().item()
        out.append((masters, loss, type(model.mid.weight.to_local()).__name__))
    return out


def test_meta_device_init():
    for (plain_masters, plain_loss, _), (masters, loss, kind) in run_distributed(meta_init_worker, 2):
        assert kind == "QuantizedGatherTensor"
        assert all(torch.equal(plain_masters[k], masters[k]) for k in masters)
        assert loss != plain_loss and abs(loss - plain_loss) <= 0.02 * plain_loss


# ---------------------------------------------------------------------- inside frameworks: what they must not break


def test_wrapped_parameters_have_their_own_addresses():
    """Frameworks tell parameters apart by ``data_ptr()`` (Accelerate's FSDP2 prepare does)."""
    from qzero.fsdp import quantize_weight_gathers

    model = quantize_weight_gathers(build(), small_param_numel=SMALL)
    ptrs = [p.data_ptr() for p in model.parameters()]
    assert 0 not in ptrs and len(set(ptrs)) == len(ptrs)
    assert model.mid.weight.data_ptr() == model.mid.weight.unwrapped.data_ptr()


def test_optimizer_holding_a_quantized_parameter_twice_is_refused():
    """The trace of a re-pointing by a shared key: one parameter several times, the others never updated."""
    from qzero.fsdp import quantize_weight_gathers

    model = quantize_weight_gathers(build(), small_param_numel=SMALL)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.param_groups[0]["params"] = [model.mid.weight, model.mid.weight, model.norm.weight]
    before = model.mid.weight.unwrapped.clone()
    with pytest.raises(RuntimeError, match="more than once.*'mid.weight', 2 times"):
        opt.step()
    assert torch.equal(model.mid.weight.unwrapped, before)
    opt.param_groups[0]["params"] = list(model.parameters())  # a fresh list is checked again, and passes
    model(batch(0, 0)).float().pow(2).mean().backward()
    opt.step()
    assert not torch.equal(model.mid.weight.unwrapped, before)


def test_stripped_parameter_is_refused_at_forward_and_reported():
    from qzero.fsdp import gather_report, quantize_weight_gathers

    model = quantize_weight_gathers(build(), small_param_numel=SMALL)
    assert "mid.weight" in gather_report(model).quantized and gather_report(model).not_gathered
    model.mid.weight = nn.Parameter(model.mid.weight.unwrapped.clone())  # a plain tensor in its place
    report = gather_report(model)
    assert "mid.weight" not in report.quantized
    assert dict(report.plain)["mid.weight"].startswith("stripped") and "stripped" in report.summary()
    with pytest.raises(RuntimeError, match="no longer wrapped.*mid.weight"):
        model(batch(0, 0))


def test_load_state_dict_assign_keeps_the_quantized_gather():
    """``load_state_dict(assign=True)`` (Accelerate's cpu_ram_efficient_loading) replaces the
    parameters: each loaded tensor is wrapped like the parameter it replaces."""
    from qzero.fsdp import QuantizedGatherTensor, gather_report, quantize_weight_gathers

    model = quantize_weight_gathers(build(), small_param_numel=SMALL)
    state = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    assert isinstance(model.mid.weight, QuantizedGatherTensor)
    assert model.mid.weight.unwrapped.data_ptr() == state["mid.weight"].data_ptr()
    assert not any(why.startswith("stripped") for _, why in gather_report(model).plain)
    model(batch(0, 0))  # the forward's check passes


def pickle_worker(rank, world):
    import copy
    import io

    from qzero.fsdp import QuantizedGatherTensor, gather_report, quantize_weight_gathers

    model = quantize_weight_gathers(build(), small_param_numel=SMALL)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    out = []
    for twin in (torch.load(buf, weights_only=False), copy.deepcopy(model)):
        w = twin.mid.weight
        out.append(dict(
            wrapped=isinstance(w, QuantizedGatherTensor) and isinstance(w, nn.Parameter),
            same_values=torch.equal(w.unwrapped, model.mid.weight.unwrapped),
            own_storage=w.data_ptr() != model.mid.weight.data_ptr(),
            same_forward=torch.equal(twin(batch(0, 0)), model(batch(0, 0))),  # its check holds its own parameters
            same_report=gather_report(twin).quantized == gather_report(model).quantized,
        ))
    return out


def test_converted_model_pickles_and_deep_copies():
    """torch tells a wrapper subclass by ``data_ptr() == 0`` when it pickles or copies one;
    the wrapper's own address must not change how it is saved (torch.save(model), EMA copies).
    (Under a process group: converted before one exists, the model holds the install's
    deferred agreement, which does not pickle.)"""
    for twin in run_distributed(pickle_worker, 1)[0]:
        assert all(twin.values()), twin


def test_optimizer_check_leaves_the_sliced_update_alone():
    """The duplicate check is a process-wide optimizer hook; qzero's own sliced update (which
    refuses optimizers with hooks) must still slice once a model was converted."""
    from qzero.fsdp import quantize_weight_gathers
    from qzero.optim.update import sliceable

    quantize_weight_gathers(build(), small_param_numel=SMALL)  # installs the process-wide check
    master = torch.zeros(8, requires_grad=True)
    opt = torch.optim.AdamW([master], lr=1e-3)
    master.grad = torch.ones(8)
    opt.step()
    assert sliceable(opt, [master])
    opt.register_step_pre_hook(lambda *_: None)  # anyone else's hook still turns it off
    assert not sliceable(opt, [master])


def _data_assignment_run(rank, world):
    from qzero.fsdp import quantize_weight_gathers

    torch.manual_seed(0)
    model = quantize_weight_gathers(torch.nn.Sequential(torch.nn.Linear(40, 40), torch.nn.Linear(40, 40)),
                                    small_param_numel=100)
    before = model[0].weight.detach().clone()
    try:
        model[0].weight.data = torch.full((40, 40), 3.0)
        refused = None
    except TypeError as e:
        refused = str(e)
    unchanged = torch.equal(model[0].weight.detach(), before) and model[0].weight.shape == (40, 40)
    with torch.no_grad():  # what the error says to do instead: takes effect in the wrapped tensor
        model[0].weight.copy_(torch.full((40, 40), 3.0))
    return refused, unchanged, float(model[0].weight.unwrapped.sum())


def test_assigning_data_of_a_wrapped_parameter_is_refused_not_lost():
    """``p.data = t`` would change the wrapper's metadata but not the tensor FSDP2 gathers from."""
    for refused, unchanged, copied in run_distributed(_data_assignment_run, 2):
        assert refused is not None and "'0.weight'" in refused and "p.copy_(new)" in refused
        assert unchanged and copied == 4800.0


def _unsupported_sharding_run(rank, world, kind):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    from qzero.fsdp import quantize_weight_gathers

    torch.manual_seed(0)
    model = quantize_weight_gathers(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)),
                                    small_param_numel=100)
    kwargs = ({"shard_placement_fn": lambda p: Shard(1) if p.dim() == 2 else Shard(0)} if kind == "Shard(1)"
              else {"reshard_after_forward": 2})
    for layer in (model[0], model[2]):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    try:
        model(torch.randn(4, 32)).sum().backward()
        return None
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize("kind,world", [("Shard(1)", 2), ("integer reshard_after_forward", 4)])
def test_sharding_the_per_parameter_gather_cannot_carry_is_refused_by_name(kind, world):
    """Not FSDP2's shape or dtype error from inside its all-gather: a qzero error on every
    rank naming the parameter and what to use instead."""
    for raised in run_distributed(_unsupported_sharding_run, world, kind):
        assert (raised is not None and raised.startswith("qzero.fsdp: parameter '")
                and "quantize_group_gathers" in raised)
        assert ("Shard(0) only" if kind == "Shard(1)" else "reshard_after_forward=True or False") in raised
