"""examples/lightning_model_parallel.py in Lightning's real Trainer and ModelParallelStrategy,
on CPU: 2 gloo ranks (launched here, so Lightning sees an external launcher), 10 steps of plain
FSDP2, the per-parameter quantized gather and the per-group one."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("lightning")
pytest.importorskip("transformers")

from _support.distributed import run_distributed  # noqa: E402
from _support.frameworks import assert_report_is_what_travels, assert_trains_like_plain, gather_facts, load_example  # noqa: E402

STEPS = 10


def worker(rank, world):
    # what torchrun sets: Lightning then takes the processes (and the process group) as given
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    example = load_example("lightning_model_parallel")

    from qzero.app.workload import load_corpus

    corpus = load_corpus(limit=200_000)
    out = {}
    for quantize in (None, "parameter", "group"):
        module = example.train(quantize=quantize, steps=STEPS, devices=world, corpus=corpus)
        out[quantize] = dict(losses=module.losses, report_quantized=bool(module.report and module.report.quantized),
                             facts=gather_facts(module.model, module.report if quantize == "parameter" else None))
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(worker, 2, timeout=300)


@pytest.mark.parametrize("mode", ["parameter", "group"])
def test_lightning_example_trains_like_plain_fsdp2(runs, mode):
    for r in runs:
        assert_trains_like_plain(r[mode]["losses"], r[None]["losses"], STEPS, mode)
        assert r[mode]["report_quantized"]
        assert_report_is_what_travels(r["parameter"]["facts"])
