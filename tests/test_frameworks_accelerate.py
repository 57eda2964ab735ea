"""examples/accelerate_fsdp2.py through Accelerate's real ``prepare`` on 2 gloo ranks.

Accelerate chooses FSDP only on GPUs; on this CPU machine the test reaches the very same
FSDP2 path (``Accelerator._prepare_fsdp2``: ``fully_shard`` per decoder layer, the
optimizer re-pointed to the sharded parameters by ``data_ptr()``, and with
``cpu_ram_efficient_loading`` the model moved to ``meta`` and loaded back with
``load_state_dict(assign=True)``) by setting Accelerate's state by hand: its
``distributed_type`` to ``FSDP`` and its ``fsdp_plugin`` to the example's plugin.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from _support.distributed import run_distributed  # noqa: E402
from _support.frameworks import assert_report_is_what_travels, assert_trains_like_plain, gather_facts, load_example  # noqa: E402

STEPS = 10


def worker(rank, world, tmp):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    example = load_example("accelerate_fsdp2")

    from qzero.fsdp.guards import wrapped_in
    from qzero.app.workload import build_model, load_corpus, model_config

    corpus = load_corpus(limit=200_000)
    initial = dict(build_model(model_config(example.PRESET), torch.float32, torch.device("cpu"), 0).named_parameters())
    out = {}
    for arm, quantize, low_ram in (("plain", False, False), ("quantized", True, False), ("low_ram", True, True)):
        accelerator = example.fsdp2_accelerator(low_ram, cpu_by_hand=True)
        run = example.train(accelerator, quantize=quantize, steps=STEPS, corpus=corpus)
        model = run["model"]
        if arm == "quantized":  # the CPU recipe keeps FSDP through prepare(): save_state takes FSDP2's path
            saved = os.path.join(tmp, "state")
            accelerator.save_state(saved)
            out["saved"] = str(accelerator.state.distributed_type), sorted(os.listdir(saved))
        wrapped = {n: wrapped_in(p) for n, p in model.named_parameters() if wrapped_in(p) is not None}
        out[arm] = dict(
            losses=run["losses"],
            facts=gather_facts(model, run["report"]),
            # every rank's shard of every quantized weight moved away from its initial value
            unchanged=[n for n, t in wrapped.items()
                       if torch.equal(t.unwrapped, initial[n].detach().chunk(world)[rank].reshape(t.shape))],
        )
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(worker, 2, str(tmp_path_factory.mktemp("accelerate")), timeout=300)


def test_accelerate_cpu_recipe_saves_state_through_fsdp2(runs):
    """The CPU recipe sets FSDP on Accelerate's shared state, which ``prepare()`` keeps: ``save_state``
    then writes FSDP2's sharded model and optimizer (set on ``accelerator.state`` alone, ``prepare()``
    reverts it and ``save_state`` fails)."""
    for r in runs:
        kind, files = r["saved"]
        assert kind == "DistributedType.FSDP", kind
        assert (any(f.startswith("pytorch_model_fsdp") for f in files)
                and any(f.startswith("optimizer") for f in files)), files


def _check_quantized_arm(runs, arm):
    for r in runs:
        assert_report_is_what_travels(r[arm]["facts"])  # the report counts what travels
        assert r[arm]["unchanged"] == [], f"{arm}: quantized weights never updated: {r[arm]['unchanged']}"
        assert_trains_like_plain(r[arm]["losses"], r["plain"]["losses"], STEPS, arm)


def test_accelerate_fsdp2_trains_like_plain_and_updates_every_quantized_weight(runs):
    """Accelerate re-points the optimizer by ``data_ptr()``: each wrapped parameter must keep its own."""
    _check_quantized_arm(runs, "quantized")


def test_accelerate_cpu_ram_efficient_loading_keeps_the_quantized_gather(runs):
    """``cpu_ram_efficient_loading`` reloads the model with ``load_state_dict(assign=True)``:
    the quantized gather survives it, and the report counts what was gathered."""
    _check_quantized_arm(runs, "low_ram")
    for r in runs:
        assert r["low_ram"]["losses"] == r["quantized"]["losses"]  # rank 0's weights, the same as built
