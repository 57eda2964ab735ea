"""examples/torchtitan_parallelize.py: torchtitan's own ``parallelize_llama`` (FSDP2) wrapped by
qzero, on a torchtitan Llama-3 built on meta, 2 gloo ranks, 10 steps each of plain FSDP2, the
per-parameter quantized gather and the per-group one.

torchtitan's trainer needs CUDA, so the test calls the hook itself, as the trainer would. CI
installs torchtitan without its training-run dependencies (datasets, wandb, tensorboard: see
.ci/run); the parallelize function needs none of them.
"""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("torchtitan.models.llama3")

from distributed import run_distributed  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "examples"))

STEPS = 10


def worker(rank, world):
    import torchtitan_parallelize as example

    from qzero.fsdp.guards import wrapped_in
    from qzero.workload import load_corpus

    corpus = load_corpus(limit=200_000)
    out = {}
    for quantize in (None, "parameter", "group"):
        run = example.train(quantize=quantize, steps=STEPS, corpus=corpus)
        report = run["report"]
        out[quantize] = dict(
            losses=run["losses"],
            quantized=() if report is None else tuple(report.quantized),
            not_gathered=tuple(getattr(report, "not_gathered", ())),
            wrapped=sorted(n for n, p in run["model"].named_parameters() if wrapped_in(p) is not None),
        )
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(worker, 2, timeout=300)


@pytest.mark.parametrize("mode", ["parameter", "group"])
def test_torchtitan_hook_trains_like_plain_fsdp2(runs, mode):
    for r in runs:
        plain, run = r[None]["losses"], r[mode]["losses"]
        assert len(run) == len(plain) == STEPS and run != plain
        for step, (a, b) in enumerate(zip(run, plain)):
            assert abs(a - b) <= 0.01 * b, f"{mode} step {step}: {a:.4f} vs plain {b:.4f}"
        assert plain[-1] < 0.9 * plain[0]
    for r in runs:
        parameter = r["parameter"]
        assert len(parameter["quantized"]) > 10 and not parameter["not_gathered"]
        assert sorted(parameter["quantized"]) == parameter["wrapped"]
