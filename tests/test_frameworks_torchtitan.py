"""examples/torchtitan_parallelize.py: torchtitan's own ``parallelize_llama`` (FSDP2) wrapped by
qzero, on a torchtitan Llama-3 built on meta, 2 gloo ranks, 10 steps each of plain FSDP2, the
per-parameter quantized gather and the per-group one.

torchtitan's trainer needs CUDA, so the test calls the hook itself, as the trainer would. CI
installs torchtitan without its training-run dependencies (datasets, wandb, tensorboard: see
.ci/run); the parallelize function needs none of them.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan.models.llama3")

from _support.distributed import run_distributed  # noqa: E402
from _support.frameworks import assert_report_is_what_travels, assert_trains_like_plain, gather_facts, load_example  # noqa: E402

STEPS = 10


def worker(rank, world):
    example = load_example("torchtitan_parallelize")

    from qzero.app.workload import load_corpus

    corpus = load_corpus(limit=200_000)
    out = {}
    for quantize in (None, "parameter", "group"):
        run = example.train(quantize=quantize, steps=STEPS, corpus=corpus)
        out[quantize] = dict(losses=run["losses"], facts=gather_facts(run["model"], run["report"]))
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(worker, 2, timeout=300)


@pytest.mark.parametrize("mode", ["parameter", "group"])
def test_torchtitan_hook_trains_like_plain_fsdp2(runs, mode):
    for r in runs:
        assert_trains_like_plain(r[mode]["losses"], r[None]["losses"], STEPS, mode)
        assert_report_is_what_travels(r["parameter"]["facts"])
