"""A checkpoint written by an earlier qzero loads with this one.

``tests/data/checkpoint_v1/`` was written by ``tests/data/make_checkpoint_v1.py`` (world size 2,
stage 2, INT8 quantized weights, INT8 quantized gradients with error feedback);
``tests/data/checkpoint_v1.json`` holds, per rank, the digests of what it saved and of one more
step after the save. Two gloo ranks load it into optimizers that have taken a step of their
own (so every tensor a load writes differs before it), and must find the same masters, optimizer
state, residuals, gathered parameters, buffers and loss scaler, then take the same step.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

from _support.distributed import run_distributed

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
_spec = importlib.util.spec_from_file_location("make_checkpoint_v1", os.path.join(DATA, "make_checkpoint_v1.py"))
v1 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(v1)


def _load(rank, world, path):
    model, opt = v1.build(seed=7 + rank)
    v1.step(model, opt, v1.batch(50, rank))  # state of its own, which the load must replace
    before = v1.record(model, opt)
    opt.load_checkpoint(path)
    return {"before": before, "loaded": v1.record(model, opt), "after_step": v1.after_step(model, opt, rank)}


def _differences(got: dict, want: dict, at: str = "") -> list[str]:
    """The fields (``masters[0]``, ``state[0].exp_avg``, ...) where ``got`` and ``want`` differ."""
    if isinstance(want, dict) and isinstance(got, dict):
        keys = sorted(set(got) | set(want))
        return [d for k in keys for d in _differences(got.get(k), want.get(k), f"{at}.{k}" if at else k)]
    if isinstance(want, list) and isinstance(got, list) and len(got) == len(want):
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in _differences(g, w, f"{at}[{i}]")]
    return [] if got == want else [at]


def test_the_committed_checkpoint_is_small_and_of_format_1():
    files = [os.path.join(d, n) for d, _, names in os.walk(os.path.join(DATA, v1.NAME)) for n in names]
    assert sorted(os.path.basename(f) for f in files) == [".metadata", "__0_0.distcp", "__1_0.distcp", "qzero.json"]
    assert sum(os.path.getsize(f) for f in files) < 200_000
    with open(os.path.join(DATA, v1.NAME, "qzero.json")) as f:
        meta = json.load(f)
    assert meta["format"] == 1 and meta["world_size"] == 2 and "error_feedback" in meta


def test_a_format_1_checkpoint_loads_and_resumes_bit_exactly(tmp_path):
    path = str(tmp_path / v1.NAME)
    shutil.copytree(os.path.join(DATA, v1.NAME), path)  # the load may not touch the committed copy
    with open(os.path.join(DATA, v1.NAME + ".json")) as f:
        expected = json.load(f)
    results = run_distributed(_load, expected["world_size"], path, timeout=60.0)
    for rank, (got, want) in enumerate(zip(results, expected["ranks"])):
        # every tensor the load writes differed before it (else its equality would prove nothing)
        differed = {d.split("[")[0].split(".")[0] for d in _differences(got["before"], want["saved"])}
        assert {"masters", "state", "residuals", "parameters"} <= differed, f"rank {rank}: only {differed} differed"
        assert not _differences(got["loaded"], want["saved"]), \
            f"rank {rank}: loaded differs from saved in {_differences(got['loaded'], want['saved'])}"
        assert not _differences(got["after_step"], want["after_step"]), \
            f"rank {rank}: the step after the load differs in {_differences(got['after_step'], want['after_step'])}"
