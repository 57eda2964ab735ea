"""QZeroCallback inside the real HF Trainer: DeepSpeed bf16 on CPU, 2 gloo ranks.

One group of ranks runs every Trainer here, one after the other, so that the Trainer and
DeepSpeed are imported once. First a tiny Llama built from a config (no downloads), ZeRO-2:
a baseline (the key off), a quantized run with the same seed and data, and one with CPU
optimizer offload and gather-ahead. Then ``examples/deepspeed_hf_trainer.py``: plain
DeepSpeed ZeRO-2, the same with qzero's callback, and ZeRO-1 with fp32 gradient accumulation
(DeepSpeed's BF16_Optimizer) with and without it, 10 steps each; and a run whose gather stops
going through qzero mid-training, which must stop with an error.

The ranks are *spawned* (fresh interpreters), not forked: forked from a pytest process that
already ran other tests in-process (tests/test_cli.py), the Trainer's first forward hung in
native code.
"""

from __future__ import annotations

import gc
import os
import socket
import tempfile
import types

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from _support import distributed  # noqa: E402
from _support.frameworks import assert_trains_like_plain, load_example  # noqa: E402

from qzero.integrations import deepspeed as qds  # noqa: E402
from qzero.integrations.hf import QZeroCallback  # noqa: E402

STEPS = 3
EXAMPLE_STEPS = 10


def tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


def dataset():
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(16):
        ids = torch.randint(0, 128, (16,), generator=g)
        rows.append({"input_ids": ids, "labels": ids})
    return rows


def train(tmp, quantize, offload=False):
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "bf16": {"enabled": "auto"},
        "steps_per_print": 10**9,
        # the one key a DeepSpeed user adds; the bucket makes several chunks on this tiny model
        "zero_optimization": {"stage": 2, "zero_quantized_weights": quantize, "allgather_bucket_size": 2048},
    }
    if offload:  # DeepSpeed's CPU optimizer offload runs its own CPU Adam, built from this section
        ds_config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        ds_config["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}
    args = transformers.TrainingArguments(
        output_dir=tmp,
        per_device_train_batch_size=2,
        max_steps=STEPS,
        deepspeed=ds_config,
        bf16=True,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        learning_rate=1e-3,
        optim="adamw_torch",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    callback = QZeroCallback(group_size=32, small_param_numel=64, overlap_param_gather=offload)
    trainer = transformers.Trainer(model=tiny_llama(), args=args, train_dataset=dataset(), callbacks=[callback])
    trainer.train()
    engine = trainer.model_wrapped
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    gather = callback.gather
    if gather is not None:
        gather.wait_for_weights()
    return dict(
        losses=losses,
        optimizer=type(engine.optimizer).__name__,
        flats=[f.detach().clone() for f in engine.optimizer.bit16_groups_flat],
        params={n: p.detach().float().clone() for n, p in engine.module.named_parameters()},
        patched=qds.is_patched(),
        calls=None if gather is None else gather.calls,
        ratio=None if gather is None else gather.bytes_sent / gather.plain_bytes,
        on_engine=getattr(engine, "qzero_gather", None) is not None,
        offload=bool(getattr(engine.optimizer, "cpu_offload", False)),
        ahead=gather is not None and gather.wiring is not None,
    )


def example_runs(tmp):
    """examples/deepspeed_hf_trainer.py: plain and with the callback, ZeRO-2 and ZeRO-1 with
    fp32 accumulation; and a run whose gather bypasses qzero from its third step on."""
    example = load_example("deepspeed_hf_trainer")
    from transformers import TrainerCallback

    from qzero.app.workload import load_corpus

    corpus = load_corpus(limit=200_000)
    out = {}
    for name, quantize, zero1 in (("plain", False, False), ("on", True, False),
                                  ("plain_zero1", False, True), ("on_zero1", True, True)):
        run = example.train(os.path.join(tmp, name), quantize=quantize, zero1_fp32_accum=zero1, steps=EXAMPLE_STEPS,
                            cpu=True, corpus=corpus)
        report = run["callback"].report()
        out[name] = dict(losses=run["losses"], optimizer=type(run["trainer"].model_wrapped.optimizer).__name__,
                         report=None if report is None else tuple(report))

    class Bypass(TrainerCallback):
        """From the third step on, DeepSpeed's own gather again, behind the callback's back."""

        def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
            if state.global_step == 2:
                qds.disable(optimizer)

    try:
        example.train(os.path.join(tmp, "bypass"), steps=4, cpu=True, corpus=corpus, callbacks=[Bypass()])
        out["bypass"] = "no error"
    except RuntimeError as e:
        out["bypass"] = str(e)
    return out


def worker(rank, world, tmp, port):
    # launcher variables Accelerate checks; the process group itself already exists (gloo, file store)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    load_example("deepspeed_hf_trainer")  # with it the Trainer: imported before the freeze below

    # What is imported stays: out of the collector's sight, so that DeepSpeed's full
    # collections (one per memory report of its BF16_Optimizer) walk only what training makes.
    gc.freeze()
    off = train(os.path.join(tmp, "off"), quantize=False)
    on = train(os.path.join(tmp, "on"), quantize=True)
    offload = train(os.path.join(tmp, "offload"), quantize=True, offload=True)
    return dict(off=off, on=on, offload=offload, example=example_runs(os.path.join(tmp, "example")))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory() as tmp:
        return distributed.run_distributed(worker, 2, tmp, free_port(), timeout=600, start_method="spawn")


def test_key_off_leaves_the_trainer_alone(runs):
    for r in runs:
        off = r["off"]
        assert off["optimizer"] == "DeepSpeedZeroOptimizer"
        assert not off["patched"] and off["calls"] is None and len(off["losses"]) == STEPS


def test_callback_quantizes_the_trainers_gather(runs):
    r0, r1 = runs
    for r in runs:
        on, off = r["on"], r["off"]
        assert on["patched"] and on["calls"] == STEPS
        assert on["ratio"] < 0.8
        assert max(abs(a - b) for a, b in zip(on["losses"], off["losses"])) < 0.02
        for name, p in on["params"].items():
            torch.testing.assert_close(p, off["params"][name], atol=0.02, rtol=0.02, msg=name)
        assert any(not torch.equal(a, b) for a, b in zip(on["flats"], off["flats"])), "nothing was quantized"
    for a, b in zip(r0["on"]["flats"], r1["on"]["flats"]):
        assert torch.equal(a, b), "replicas differ"


# ------------------------------------------------------------------ the callback's decisions (no Trainer)


def fake_args(zero):
    return types.SimpleNamespace(hf_deepspeed_config=types.SimpleNamespace(config={"zero_optimization": zero}))


@pytest.mark.parametrize(
    "enabled, zero, wanted",
    [
        (None, {"stage": 2, "zero_quantized_weights": True}, True),
        (None, {"stage": 1, "zero_quantized_weights": True}, True),
        (None, {"stage": 2}, False),
        (None, {"stage": 3, "zero_quantized_weights": True}, False),  # DeepSpeed's own at stage 3
        (False, {"stage": 2, "zero_quantized_weights": True}, False),
        (True, {"stage": 2}, True),
    ],
)
def test_callback_follows_the_config_key(enabled, zero, wanted):
    assert QZeroCallback(enabled=enabled)._wanted(fake_args(zero)) is wanted


def test_callback_refusals():
    with pytest.raises(ValueError, match="multiple of 8"):
        QZeroCallback(group_size=12)
    with pytest.raises(ValueError, match="int3"):
        QZeroCallback(fmt="int3")
    with pytest.raises(ValueError, match="zero_quantized_weights_group_size must be a positive multiple of 8"):
        QZeroCallback(zero_quantized_weights_group_size=12)
    with pytest.raises(ValueError, match=r"gather_lookahead must be an int >= 0 .*got -1"):
        QZeroCallback(gather_lookahead=-1)
    assert QZeroCallback(gather_lookahead=4).settings.gather_lookahead == 4  # handed to enable() as it is
    # a keyword of an earlier release: refused, naming the one that replaced it
    with pytest.raises(TypeError, match=r"QZeroCallback\(\) got an unexpected keyword argument 'bucket_numel'; "
                                        r"did you mean allgather_bucket_size="):
        QZeroCallback(bucket_numel=1 << 20)
    no_deepspeed = types.SimpleNamespace(hf_deepspeed_config=None)
    with pytest.raises(ValueError, match="needs the Trainer to run DeepSpeed"):
        QZeroCallback(enabled=True).on_train_begin(no_deepspeed, None, None, optimizer=None)


def test_callback_with_cpu_offload_and_gather_ahead(runs):
    r0, r1 = runs
    for r in runs:
        run, off = r["offload"], r["off"]
        assert run["offload"] and run["ahead"] and run["patched"] and run["calls"] == STEPS
        assert run["ratio"] < 0.8
        assert max(abs(a - b) for a, b in zip(run["losses"], off["losses"])) < 0.02
        for name, p in run["params"].items():
            torch.testing.assert_close(p, off["params"][name], atol=0.02, rtol=0.02, msg=name)
    for a, b in zip(r0["offload"]["flats"], r1["offload"]["flats"]):
        assert torch.equal(a, b), "replicas differ"


# ------------------------------------------------------------------ examples/deepspeed_hf_trainer.py


@pytest.mark.parametrize("on, plain, optimizer", [("on", "plain", "DeepSpeedZeroOptimizer"),
                                                  ("on_zero1", "plain_zero1", "BF16_Optimizer")])
def test_hf_trainer_example_trains_like_plain_deepspeed(runs, on, plain, optimizer):
    for r in runs:
        r = r["example"]
        assert r[on]["optimizer"] == r[plain]["optimizer"] == optimizer
        assert_trains_like_plain(r[on]["losses"], r[plain]["losses"], EXAMPLE_STEPS, on)
        calls, quantized, exact, sent, plain_bytes = r[on]["report"]
        assert calls == EXAMPLE_STEPS and quantized > 10 * exact > 0 and sent < 0.6 * plain_bytes
        assert r[plain]["report"] is None


def test_hf_trainer_gather_that_bypasses_qzero_is_an_error(runs):
    for r in runs:
        r = r["example"]
        assert "ran without qzero's weight gather" in r["bypass"] and "step 3" in r["bypass"]
