"""examples/deepspeed_hf_trainer.py in the real HF Trainer: DeepSpeed bf16 on CPU, 2 gloo ranks.

Plain DeepSpeed ZeRO-2, the same with qzero's callback, and ZeRO-1 with fp32 gradient
accumulation (DeepSpeed's BF16_Optimizer) with and without it, 10 steps each; and a run
whose gather stops going through qzero mid-training, which must stop with an error. Ranks
are spawned, as in tests/test_hf.py.
"""

from __future__ import annotations

import os
import sys
import tempfile

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("accelerate")
pytest.importorskip("transformers")

import distributed  # noqa: E402
from frameworks import EXAMPLES, assert_trains_like_plain  # noqa: E402
from test_hf import free_port  # noqa: E402

STEPS = 10


def worker(rank, world, tmp, port):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.path.insert(0, EXAMPLES)
    import deepspeed_hf_trainer as example
    from transformers import TrainerCallback

    from qzero.integrations import deepspeed as qds
    from qzero.app.workload import load_corpus

    corpus = load_corpus(limit=200_000)
    out = {}
    for name, quantize, zero1 in (("plain", False, False), ("on", True, False),
                                  ("plain_zero1", False, True), ("on_zero1", True, True)):
        run = example.train(os.path.join(tmp, name), quantize=quantize, zero1_fp32_accum=zero1, steps=STEPS,
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


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory() as tmp:
        return distributed.run_distributed(worker, 2, tmp, free_port(), timeout=400, start_method="spawn")


@pytest.mark.parametrize("on, plain, optimizer", [("on", "plain", "DeepSpeedZeroOptimizer"),
                                                  ("on_zero1", "plain_zero1", "BF16_Optimizer")])
def test_hf_trainer_example_trains_like_plain_deepspeed(runs, on, plain, optimizer):
    for r in runs:
        assert r[on]["optimizer"] == r[plain]["optimizer"] == optimizer
        assert_trains_like_plain(r[on]["losses"], r[plain]["losses"], STEPS, on)
        calls, quantized, exact, sent, plain_bytes = r[on]["report"]
        assert calls == STEPS and quantized > 10 * exact > 0 and sent < 0.6 * plain_bytes
        assert r[plain]["report"] is None


def test_hf_trainer_gather_that_bypasses_qzero_is_an_error(runs):
    for r in runs:
        assert "ran without qzero's weight gather" in r["bypass"] and "step 3" in r["bypass"]
