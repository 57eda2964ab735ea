"""The DeepSpeed ZeRO-1/2 adapter on CPU: 2 gloo ranks, bf16, torch AdamW as the client optimizer.

DeepSpeed's start-up is slow (its first run builds a small CPU op, cached under
``TORCH_EXTENSIONS_DIR``), so one spawned group trains every arm and runs every
engine-level check; the config-level refusals need no process group at all.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
import types
import warnings

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

from _support.distributed import run_distributed  # noqa: E402

from qzero.integrations import deepspeed as qds  # noqa: E402

STEPS = 4
SMALL = 64  # small-parameter threshold used by the tests: norms, biases and `scale` travel exactly
BUCKET = 512  # allgather_bucket_size: several chunks per gather on this tiny model


class Net(torch.nn.Module):
    """Sizes chosen so that, at DP2, a large and a small parameter straddle partitions and
    both parameter groups mix small (exact) and large (quantized) parameters."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(16, 48)
        self.norm = torch.nn.LayerNorm(48)
        self.embed = torch.nn.Module()  # a large parameter amid small ones in the no-decay group
        self.embed.pos = torch.nn.Parameter(0.1 * torch.randn(2, 48))
        self.scale = torch.nn.Parameter(torch.ones(5))  # odd size: alignment padding after it
        self.mid = torch.nn.Linear(48, 48)
        self.head = torch.nn.Linear(48, 8)
        with torch.no_grad():  # varied small values: a quantized small parameter cannot pass for exact
            for p in self.parameters():
                if p.numel() <= SMALL:
                    p.copy_(torch.randn_like(p) * 0.05)

    def forward(self, x):
        h = torch.tanh(self.norm(self.inp(x)) + self.embed.pos.sum(0))
        h = h + self.mid(h) * self.scale.mean()
        return self.head(h)


def param_groups(model):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() == 2]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() == 2)]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def ds_config(stage=2, **zero):
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage, "allgather_bucket_size": BUCKET, **zero},
    }


def quantized(stage=2, **zero):
    return ds_config(
        stage,
        zero_quantized_weights=True,
        zero_quantized_weights_group_size=32,
        small_param_numel=SMALL,
        **zero,
    )


def data(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)


def build(init, config, **extra):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2, foreach=True)
    kwargs = dict(model=model, optimizer=opt, dist_init_required=False, **extra)
    if "args" not in extra:
        kwargs["config"] = config
    engine, _, _, _ = init(**kwargs)
    return engine


def train(engine, rank):
    losses = []
    for step in range(STEPS):
        x, y = data(step, rank)
        out = engine(x.to(torch.bfloat16))
        loss = torch.nn.functional.mse_loss(out.float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def layout_facts(opt, rank):
    """Per flat group: own partition vs the fp32 master, and which parameters straddle partitions."""
    facts = []
    for i, flat in enumerate(opt.bit16_groups_flat):
        p = flat.numel() // 2
        own = flat[rank * p : (rank + 1) * p]
        master = opt.single_partition_of_fp32_groups[i].detach().to(flat.dtype)
        exact = torch.zeros(p, dtype=torch.bool)
        straddle = {"small": False, "large": False}
        for off, meta in zip(opt.round_robin_bit16_offsets[i], opt.round_robin_bit16_meta[i]):
            a, b = off, off + meta.numel()
            kind = "small" if meta.numel() <= SMALL else "large"
            straddle[kind] |= a < p < b
            lo, hi = max(a, rank * p), min(b, (rank + 1) * p)
            if kind == "small" and lo < hi:
                exact[lo - rank * p : hi - rank * p] = True
        facts.append(
            dict(
                exact_equal=bool(torch.equal(own[exact], master[exact])),
                rest_equal=bool(torch.equal(own[~exact], master[~exact])),
                rest_max_err=max_abs_diff(own[~exact], master[~exact]),
                straddle=straddle,
                padded=any(opt.round_robin_bit16_padding[i]),
            )
        )
    return facts


def max_abs_diff(a, b):
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def snapshot(engine, rank):
    opt = engine.optimizer
    gather = getattr(engine, "qzero_gather", None)
    return dict(
        flats=[f.detach().clone() for f in opt.bit16_groups_flat],
        params={n: p.detach().clone() for n, p in engine.module.named_parameters()},
        facts=layout_facts(opt, rank),
        patched=qds.is_patched(),
        calls=None if gather is None else gather.calls,
        stats=None if gather is None else [tuple(s) for s in gather.last_stats],
        bytes_sent=None if gather is None else gather.bytes_sent,
        plain_bytes=None if gather is None else gather.plain_bytes,
    )


def expect_error(fn, *words):
    try:
        fn()
    except (ValueError, RuntimeError) as e:
        missing = [w for w in words if w not in str(e)]
        return f"message {str(e)!r} lacks {missing}" if missing else "ok"
    return "no error"


def worker(rank, world, tmp):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    out = {}

    # plain DeepSpeed, then qzero with quantization off: nothing may be patched
    engine = build(deepspeed.initialize, ds_config(round_robin_gradients=True))
    out["plain"] = dict(losses=train(engine, rank), **snapshot(engine, rank))
    off_config = ds_config(round_robin_gradients=True, zero_quantized_weights=False,
                           zero_quantized_weights_group_size=32)
    user_copy = copy.deepcopy(off_config)
    engine = build(qds.initialize, off_config)
    out["off"] = dict(losses=train(engine, rank), **snapshot(engine, rank))
    out["off"]["config_untouched"] = off_config == user_copy

    # quantization on: ZeRO-2 with round-robin order, and ZeRO-1 with alignment padding,
    # its config given as a file through args.deepspeed_config
    engine = on_engine = build(qds.initialize, quantized(round_robin_gradients=True))
    out["on"] = dict(losses=train(engine, rank), **snapshot(engine, rank))
    path = os.path.join(tmp, "ds_zero1.json")
    if rank == 0:
        with open(path, "w") as f:
            json.dump(quantized(stage=1, parameter_alignment=True), f)
    torch.distributed.barrier()
    args = types.SimpleNamespace(deepspeed_config=path, local_rank=rank)
    engine = zero1_engine = build(qds.initialize, None, args=args)
    out["on_zero1"] = dict(losses=train(engine, rank), **snapshot(engine, rank))
    out["on_zero1"]["args_untouched"] = args.deepspeed_config == path

    # enable() on an engine made elsewhere, then disable(): back to DeepSpeed's gather
    # (a first enable() with every parameter exact warns that nothing is saved; enabling again replaces it)
    engine = build(deepspeed.initialize, ds_config(round_robin_gradients=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qds.enable(engine, group_size=32, small_param_numel=10**6)
    out["warned_no_saving"] = any("not less than the plain" in str(w.message) for w in caught)
    gather = qds.enable(engine, group_size=32, small_param_numel=SMALL)
    out["enabled"] = dict(losses=train(engine, rank), **snapshot(engine, rank))
    qds.disable(engine)
    train(engine, rank)  # DeepSpeed's own gather again: the own partition is the master, cast
    facts = layout_facts(engine.optimizer, rank)
    out["disabled_plain"] = gather.calls == STEPS and all(f["rest_equal"] and f["exact_equal"] for f in facts)
    out["patched_while_others_on"] = qds.is_patched()
    qds.disable(on_engine)
    qds.disable(zero1_engine)
    out["unpatched_after_all_disabled"] = not qds.is_patched()

    # engine-level refusals
    engine = build(deepspeed.initialize, {**ds_config(), "bf16": {"enabled": False}})
    out["reject_fp32"] = expect_error(lambda: qds.enable(engine), "torch.float32", "bf16")
    engine = build(deepspeed.initialize, ds_config(stage=0))
    out["reject_stage0"] = expect_error(lambda: qds.enable(engine), "is not supported", "DeepSpeedZeroOptimizer")
    out["still_unpatched"] = not qds.is_patched()

    # one rank's bad setting, or settings that differ between ranks: every rank raises, none
    # waits in a collective for the others (the agreement; a hang ends in the run's timeout)
    engine = build(deepspeed.initialize, ds_config())
    culprit = ("group_size", "12") if rank == 1 else ("rank(s) [1] rejected",)
    out["enable_one_rank_bad"] = expect_error(lambda: qds.enable(engine, group_size=12 if rank == 1 else 32), *culprit)
    out["enable_overlap_differs"] = expect_error(
        lambda: qds.enable(engine, group_size=32, overlap_param_gather=rank == 0), "overlap_param_gather differs")
    bad = quantized()
    bad["zero_optimization"]["zero_quantized_weights_group_size"] = 12 if rank == 1 else 32
    out["initialize_one_rank_bad"] = expect_error(lambda: build(qds.initialize, bad), *culprit)
    out["initialize_quantized_differs"] = expect_error(
        lambda: build(qds.initialize, quantized() if rank == 0 else ds_config()), "zero_quantized_weights differs")
    out["unpatched_after_refusals"] = not qds.is_patched()
    torch.distributed.barrier()
    return out


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory() as tmp:
        return run_distributed(worker, 2, tmp, timeout=300)


def test_off_is_bitwise_plain_deepspeed(runs):
    for r in runs:
        assert r["off"]["losses"] == r["plain"]["losses"]
        for a, b in zip(r["off"]["flats"], r["plain"]["flats"]):
            assert torch.equal(a, b)
        assert not r["off"]["patched"] and r["off"]["calls"] is None
        assert r["off"]["config_untouched"]
        assert all(f["exact_equal"] and f["rest_equal"] for f in r["off"]["facts"])


@pytest.mark.parametrize("arm", ["on", "on_zero1", "enabled"])
def test_on_is_close_and_replicas_identical(runs, arm):
    r0, r1 = runs
    for a, b in zip(r0[arm]["flats"], r1[arm]["flats"]):
        assert torch.equal(a, b), "replicas differ"
    for r in runs:
        assert max(abs(a - b) for a, b in zip(r[arm]["losses"], r["off"]["losses"])) < 0.02
        for name, p in r[arm]["params"].items():
            ref = r["off"]["params"][name].float()
            torch.testing.assert_close(p.float(), ref, atol=0.02, rtol=0.02, msg=f"{arm}: {name}")
            rel = (p.float() - ref).norm() / ref.norm()
            assert rel < 1e-2, f"{arm}: {name} relative L2 {rel:.2e}"


@pytest.mark.parametrize("arm", ["on", "on_zero1", "enabled"])
def test_gather_really_replaced(runs, arm):
    for r in runs:
        run = r[arm]
        assert run["patched"] and run["calls"] == STEPS
        # DeepSpeed's gather never touches a rank's own partition; qzero's dequantizes it too,
        # except the small parameters, which must equal the bf16 master exactly
        for f in run["facts"]:
            assert f["exact_equal"]
        assert not all(f["rest_equal"] for f in run["facts"])
        assert all(f["rest_max_err"] < 0.02 for f in run["facts"])
        # bytes: int8 values + scales instead of bf16, several chunks within the bucket
        assert run["bytes_sent"] < 0.8 * run["plain_bytes"]
        assert run["bytes_sent"] == STEPS * sum(s[1] for s in run["stats"])
        assert max(s[0] for s in run["stats"]) > 1
        assert all(s[3] <= BUCKET for s in run["stats"])


def test_layout_covers_straddling_round_robin_and_padding(runs):
    facts = runs[0]["on"]["facts"] + runs[0]["on_zero1"]["facts"]
    assert any(f["straddle"]["small"] for f in facts)
    assert any(f["straddle"]["large"] for f in facts)
    assert any(f["padded"] for f in runs[0]["on_zero1"]["facts"])
    # round-robin reorders parameters, so the flat groups differ from the model order
    assert runs[0]["on_zero1"]["args_untouched"]


def test_enable_disable_and_engine_refusals(runs):
    for r in runs:
        assert r["warned_no_saving"]
        assert r["disabled_plain"]
        assert r["patched_while_others_on"] and r["unpatched_after_all_disabled"]
        assert r["reject_fp32"] == "ok"
        assert r["reject_stage0"] == "ok"  # stage 0: DeepSpeed's bf16 wrapper, not a ZeRO optimizer
        assert r["still_unpatched"]
        for key in ("enable_one_rank_bad", "enable_overlap_differs", "initialize_one_rank_bad",
                    "initialize_quantized_differs"):
            assert r[key] == "ok", (key, r[key])
        assert r["unpatched_after_refusals"]


# ------------------------------------------------------------------ MoE: expert groups have their own DP group


class MoENet(torch.nn.Module):
    def __init__(self, ep_size):
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.inp = torch.nn.Linear(16, 32)
        self.moe = MoE(hidden_size=32, expert=torch.nn.Linear(32, 32), num_experts=2, ep_size=ep_size, k=1)
        self.head = torch.nn.Linear(32, 8)

    def forward(self, x):
        h, _, _ = self.moe(self.inp(x))
        return self.head(h)


def moe_worker(rank, world):
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    out = {}
    for ep_size in (1, 2):  # expert data-parallel size 2 (a group of its own), then 1 (nothing to gather)
        torch.manual_seed(0)
        model = MoENet(ep_size)
        groups = {"params": list(model.parameters()), "name": "all"}
        groups = split_params_into_different_moe_groups_for_optimizer(groups)
        opt = torch.optim.AdamW(groups, lr=1e-2, foreach=True)
        engine, _, _, _ = qds.initialize(model=model, optimizer=opt, config=quantized(), dist_init_required=False)
        train(engine, rank)
        zero = engine.optimizer
        gather = engine.qzero_gather
        out[ep_size] = dict(
            flats=[f.detach().clone() for f in zero.bit16_groups_flat],
            own_group=[pg is not zero.dp_process_group for pg in zero.real_dp_process_group],
            same_group=[g is None or g.process_group is pg for g, pg in zip(gather.groups, zero.real_dp_process_group)],
            planned=[g is not None for g in gather.groups],
            calls=gather.calls,
        )
    return out


def test_moe_groups_use_their_own_process_group():
    r0, r1 = run_distributed(moe_worker, 2, timeout=300)
    for ep_size, planned in ((1, [True, True]), (2, [True, False])):
        a, b = r0[ep_size], r1[ep_size]
        assert a["own_group"] == [False, True]  # group 1 holds the experts
        assert a["same_group"] == [True, True] and a["planned"] == planned and a["calls"] == STEPS
        assert torch.equal(a["flats"][0], b["flats"][0])
        # experts replicated on both ranks (ep 1) are identical replicas; with ep 2 each rank has its own
        assert torch.equal(a["flats"][1], b["flats"][1]) == (ep_size == 1)


# ------------------------------------------------------------------ config-level refusals (no process group)


@pytest.mark.parametrize(
    "zero, extra, words",
    [
        (dict(zenflow={"topk_ratio": 0.1}), {}, ["ZenFlow"]),
        (dict(offload_optimizer={"device": "nvme"}), {}, ["offload_optimizer.device='nvme'", "device 'cpu'"]),
        (dict(overlap_param_gather=True, zero_quantized_weights=False), {}, ["overlap_param_gather=true needs"]),
        (dict(overlap_param_gather="yes"), {}, ["overlap_param_gather", "'yes'"]),
        (dict(stage=3, overlap_param_gather=True), {}, ["stage 3", "overlap_param_gather=True"]),
        ({}, {"bf16": {"enabled": False}}, ["fp32", "bf16"]),
        (dict(stage=3, zero_quantized_weights_group_size=128), {}, ["stage 3", "group_size=128"]),
        (dict(stage=0), {}, ["stage 1 or 2", "stage 0"]),
        (dict(zero_quantized_weights_group_size=12), {}, ["multiple of 8", "12"]),
        (dict(zero_quantized_weights_format="int3"), {}, ["int3"]),
        (dict(small_param_numel=-1), {}, ["small_param_numel", "-1"]),
        # a key of an earlier release: refused, naming the key that replaced it
        (dict(zero_quantized_weights_small_param_numel=64), {}, [
            "zero_optimization.zero_quantized_weights_small_param_numel is now small_param_numel",
            "did you mean small_param_numel?"]),
        (dict(zero_quantized_weights=False, zero_quantized_weights_small_param_numel=64), {}, ["small_param_numel"]),
        (dict(zero_quantized_weights="yes"), {}, ["'yes'"]),
        (dict(gather_lookahead=-2), {}, ["gather_lookahead must be an int >= 0", "-2"]),
        (dict(stage=3, gather_lookahead=4), {}, ["stage 3", "gather_lookahead=4"]),
    ],
)
def test_config_refusals(zero, extra, words):
    config = ds_config(zero_quantized_weights=True, zero_quantized_weights_group_size=64)
    config["zero_optimization"].update(zero)
    config.update(extra)
    before = copy.deepcopy(config)
    with pytest.raises(ValueError) as e:
        qds.initialize(model=torch.nn.Linear(2, 2), config=config)
    for w in words:
        assert w in str(e.value)
    assert config == before, "the user's config was modified"
    assert not qds.is_patched()


def test_prepare_config_strips_only_a_copy():
    config = quantized()
    before = copy.deepcopy(config)
    prepared = qds.prepare_config(config)
    assert config == before
    zero = prepared.ds_config["zero_optimization"]
    assert prepared.quantize and prepared.stage == 2
    assert not any(k in zero for k in qds.QZERO_KEYS) and "zero_quantized_weights" not in zero
    assert prepared.settings == qds.QuantizedWeightsSettings(zero_quantized_weights_group_size=32,
                                                             small_param_numel=SMALL)
    lazy = qds.prepare_config(ds_config(zero_quantized_weights=True, gather_lookahead=4))
    assert lazy.settings.gather_lookahead == 4 and "gather_lookahead" not in lazy.ds_config["zero_optimization"]
    # off: qzero's keys go, DeepSpeed's own key stays, nothing to patch
    off = qds.prepare_config(ds_config(zero_quantized_weights=False, zero_quantized_weights_group_size=32))
    assert not off.quantize and off.ds_config["zero_optimization"]["zero_quantized_weights"] is False


def test_zero3_default_group_size_left_to_deepspeed():
    config = ds_config(stage=3, zero_quantized_weights=True, zero_quantized_weights_group_size=64)
    prepared = qds.prepare_config(config)
    assert not prepared.quantize
    assert prepared.ds_config["zero_optimization"]["zero_quantized_weights"] is True
    assert qds.GROUP_SIZE_KEY not in prepared.ds_config["zero_optimization"]


def test_version_range(monkeypatch):
    assert qds.check_deepspeed_version("0.19.8") == "0.19.8"
    qds.check_deepspeed_version("0.19.9+cu130")
    for bad in ("0.18.9", "0.20.0", "1.0.0"):
        with pytest.raises(RuntimeError, match=r">=0\.19,<0\.20"):
            qds.check_deepspeed_version(bad)
    monkeypatch.setattr(deepspeed, "__version__", "0.20.1")
    with pytest.raises(RuntimeError, match=r"DeepSpeed 0\.20\.1"):
        qds.initialize(model=torch.nn.Linear(2, 2), config=quantized())


def test_unknown_optimizer_class_refused():
    model = torch.nn.Linear(2, 2)
    engine_like = types.SimpleNamespace(optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="torch.optim.sgd.SGD is not supported"):
        qds.enable(engine_like)
    assert not qds.is_patched()


def test_exact_ranges_of_merges_and_sorts():
    # unsorted offsets (round-robin order is still ascending, but do not rely on it), a gap, a large one
    offsets, numels = [22, 0, 10, 30], [4, 10, 10, 100]
    assert qds.exact_ranges_of(offsets, numels, 10) == [(0, 20), (22, 26)]
    assert qds.exact_ranges_of(offsets, numels, 0) == []
