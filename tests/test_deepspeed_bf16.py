"""The DeepSpeed adapter on DeepSpeed's BF16_Optimizer, and ``initialize`` through a wrapped
``deepspeed.initialize``; CPU, 2 gloo ranks.

ZeRO stage 1 with bf16 and ``data_types.grad_accum_dtype: "fp32"`` makes DeepSpeed build its
``BF16_Optimizer`` rather than ``DeepSpeedZeroOptimizer``. Its post-step gather must be
qzero's (quantized, small parameters exact, replicas bit-identical, close to plain
DeepSpeed), with gather-ahead giving the synchronous gather's bits.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

from _support.distributed import run_distributed  # noqa: E402
from test_deepspeed import SMALL, STEPS, build, ds_config, quantized, train  # noqa: E402

from qzero.integrations import deepspeed as qds  # noqa: E402
from qzero.integrations.deepspeed_layout import flat_groups  # noqa: E402

FP32_ACCUM = {"data_types": {"grad_accum_dtype": "fp32"}}


def own_partition_facts(opt, rank):
    """Per flat group: the rank's own bf16 partition against its fp32 master, split into the
    small (exact) parameters and the rest."""
    layout = flat_groups(opt)
    facts = []
    for i, flat in enumerate(layout.flats):
        p = flat.numel() // len(layout.partitions[i])
        own = flat[rank * p : (rank + 1) * p]
        master = opt.fp32_groups_flat_partition[i].detach().to(flat.dtype)
        exact = torch.zeros(p, dtype=torch.bool)
        for start, n in zip(layout.offsets[i], layout.numels[i]):
            lo, hi = max(start, rank * p), min(start + n, (rank + 1) * p)
            if n <= SMALL and lo < hi:
                exact[lo - rank * p : hi - rank * p] = True
        facts.append((bool(torch.equal(own[exact], master[exact])), bool(torch.equal(own[~exact], master[~exact]))))
    return facts


def arm(engine, rank):
    losses = train(engine, rank)
    gather = getattr(engine, "qzero_gather", None)
    if gather is not None:
        gather.wait_for_weights()
    return dict(
        optimizer=type(engine.optimizer).__name__,
        losses=losses,
        flats=[f.detach().clone() for f in flat_groups(engine.optimizer).flats],
        facts=own_partition_facts(engine.optimizer, rank),
        calls=None if gather is None else gather.calls,
        ratio=None if gather is None else gather.bytes_sent / gather.plain_bytes,
    )


def worker(rank, world):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    out = {"plain": arm(build(deepspeed.initialize, {**ds_config(stage=1), **FP32_ACCUM}), rank)}

    # what a profiler or test harness does: wrap deepspeed.initialize, hiding its signature
    real = deepspeed.initialize

    def wrapped(*args, **kwargs):
        out["wrapper_saw_qzero_keys"] = any(k in str(kwargs.get("config")) for k in qds.QZERO_KEYS)
        return real(*args, **kwargs)

    deepspeed.initialize = wrapped
    try:
        out["on"] = arm(build(qds.initialize, {**quantized(stage=1), **FP32_ACCUM}), rank)
    finally:
        deepspeed.initialize = real
    out["ahead"] = arm(build(qds.initialize, {**quantized(stage=1, overlap_param_gather=True), **FP32_ACCUM}), rank)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(worker, 2, timeout=300)


def test_bf16_optimizer_is_what_deepspeed_builds_here(runs):
    for r in runs:
        assert {r[a]["optimizer"] for a in ("plain", "on", "ahead")} == {"BF16_Optimizer"}
        assert r["plain"]["calls"] is None and all(own for own, rest in r["plain"]["facts"])


@pytest.mark.parametrize("name", ["on", "ahead"])
def test_bf16_optimizer_gather_is_quantized_exact_where_small_and_identical_on_replicas(runs, name):
    r0, r1 = runs
    for a, b in zip(r0[name]["flats"], r1[name]["flats"]):
        assert torch.equal(a, b), "replicas differ"
    for r in runs:
        run = r[name]
        assert run["calls"] == STEPS and run["ratio"] < 0.8
        assert all(small for small, _ in run["facts"])  # small parameters: the bf16 of the master, exactly
        assert not all(rest for _, rest in run["facts"])  # the rest: dequantized, not the master's bf16
        for a, b in zip(run["losses"], r["plain"]["losses"]):
            assert abs(a - b) < 0.02
        for a, b in zip(run["flats"], r["plain"]["flats"]):
            rel = (a.float() - b.float()).norm() / b.float().norm()
            assert rel < 1e-2, f"{name}: relative L2 {rel:.2e} from plain DeepSpeed"


def test_bf16_optimizer_gather_ahead_has_the_synchronous_bits(runs):
    for r in runs:
        assert r["ahead"]["losses"] == r["on"]["losses"]
        assert all(torch.equal(a, b) for a, b in zip(r["ahead"]["flats"], r["on"]["flats"]))


def test_initialize_through_a_wrapped_deepspeed_initialize(runs):
    """qzero binds its arguments by DeepSpeed's parameter names, not by the signature of
    whatever ``deepspeed.initialize`` is now: the wrapper got the config without qzero's keys."""
    for r in runs:
        assert r["wrapper_saw_qzero_keys"] is False


def test_initialize_binds_positional_arguments_by_deepspeeds_names(monkeypatch):
    import inspect

    assert qds.INITIALIZE_PARAMETERS == tuple(inspect.signature(deepspeed.initialize).parameters)
    seen = {}

    def recorder(*args, **kwargs):
        seen.update(args=args, kwargs=kwargs)
        return (None, None, None, None)

    monkeypatch.setattr(deepspeed, "initialize", functools.wraps(lambda *a, **k: None)(recorder))
    monkeypatch.setattr(qds, "_agree_on_config", lambda *a: None)  # no process group here to agree over
    args = object()
    qds.initialize(args, "model", config=ds_config(zero_quantized_weights=False, zero_quantized_weights_group_size=32))
    assert seen["args"] == () and seen["kwargs"]["args"] is args and seen["kwargs"]["model"] == "model"
    assert "zero_quantized_weights_group_size" not in seen["kwargs"]["config"]["zero_optimization"]
    with pytest.raises(TypeError, match="multiple values for argument 'model'"):
        qds.initialize(None, "model", model="model")
    with pytest.raises(TypeError, match="at most 13 positional"):
        qds.initialize(*range(14))
