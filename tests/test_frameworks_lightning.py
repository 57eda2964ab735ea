"""examples/lightning_model_parallel.py in Lightning's real Trainer and ModelParallelStrategy,
on CPU: 2 gloo ranks (launched here, so Lightning sees an external launcher), 10 steps of plain
FSDP2, the per-parameter quantized gather and the per-group one."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("lightning")
pytest.importorskip("transformers")

from distributed import run_distributed  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "examples"))

STEPS = 10


def worker(rank, world):
    # what torchrun sets: Lightning then takes the processes (and the process group) as given
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    import lightning_model_parallel as example

    from qzero.fsdp.guards import wrapped_in
    from qzero.workload import load_corpus

    corpus = load_corpus(limit=200_000)
    out = {}
    for quantize in (None, "parameter", "group"):
        module = example.train(quantize=quantize, steps=STEPS, devices=world, corpus=corpus)
        report = module.report
        out[quantize] = dict(
            losses=module.losses,
            quantized=() if report is None else tuple(report.quantized),
            not_gathered=tuple(getattr(report, "not_gathered", ())),
            wrapped=sorted(n for n, p in module.model.named_parameters() if wrapped_in(p) is not None),
        )
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(worker, 2, timeout=300)


@pytest.mark.parametrize("mode", ["parameter", "group"])
def test_lightning_example_trains_like_plain_fsdp2(runs, mode):
    for r in runs:
        plain, run = r[None]["losses"], r[mode]["losses"]
        assert len(run) == len(plain) == STEPS and run != plain
        for step, (a, b) in enumerate(zip(run, plain)):
            assert abs(a - b) <= 0.01 * b, f"{mode} step {step}: {a:.4f} vs plain {b:.4f}"
        assert plain[-1] < 0.9 * plain[0]
        assert r[mode]["quantized"]
    for r in runs:
        parameter = r["parameter"]
        assert sorted(parameter["quantized"]) == parameter["wrapped"] and not parameter["not_gathered"]
