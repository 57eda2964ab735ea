"""Write ``checkpoint_v1/`` and ``checkpoint_v1.json`` beside this file: a checkpoint of format 1
that tests/test_checkpoint_compat.py loads with the current code.

Two gloo ranks on the CPU train a tiny bf16 model (fp32 masters, AdamW) for three steps at
ZeRO stage 2, with INT8 quantized weights and INT8 quantized gradients with error feedback,
and save. ``checkpoint_v1.json`` records, per rank, the digests of what the checkpoint holds
(masters, optimizer state, error-feedback residuals, the gathered parameters, the loss scaler)
and of the parameters and masters after one more step on the batch :func:`after_save_batch`
gives. The test loads the checkpoint into an optimizer built by :func:`build` and compares.

Run from the repository root: ``PYTHONPATH=src python tests/data/make_checkpoint_v1.py``
(it refuses to overwrite a checkpoint already there; delete it first to write a new one).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shutil
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/: for _support

from _support.distributed import run_distributed  # noqa: E402 (a script run by path: tests/ goes on the path first)

import qzero  # noqa: E402

NAME = "checkpoint_v1"
WORLD = 2
STEPS = 3
CONFIG = {"stage": 2, "zero_quantized_weights": True, "zero_quantized_weights_format": "int8",
          "zero_quantized_weights_group_size": 16, "zero_quantized_gradients": True,
          "zero_quantized_gradients_format": "int8", "zero_quantized_gradients_group_size": 16,
          "zero_quantized_gradients_error_feedback": True, "small_param_numel": 8, "reduce_dtype": "fp32"}
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)


def build(seed: int):
    """The model (bf16 parameters: quantized weights need a 16-bit model; a buffer besides) and
    its ZeroOptimizer."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.ReLU(), torch.nn.Linear(24, 8)).bfloat16()
    model.register_buffer("table", torch.arange(6.0).reshape(2, 3))
    return model, qzero.ZeroOptimizer(model, ADAMW, config=qzero.ZeroConfig(**CONFIG))


def batch(seed: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * seed + rank)).bfloat16()


def after_save_batch(rank: int) -> torch.Tensor:
    """The batch of the step taken after the save (and after the load)."""
    return batch(99, rank)


def step(model, opt, x: torch.Tensor) -> None:
    opt.backward((model(x).float() ** 2).mean())
    opt.step()
    opt.zero_grad()
    opt.wait_for_weights()


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes."""
    t = t.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{t.dtype} {tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def record(model, opt) -> dict:
    """Digests of everything a checkpoint puts back on this rank."""
    return {
        "masters": [tensor_digest(g.master) for g in opt.groups],
        "state": [{k: tensor_digest(v) for k, v in sorted(opt.optimizer.state.get(g.master, {}).items())}
                  for g in opt.groups],
        "residuals": [None if ef is None else tensor_digest(ef.residual) for ef in opt.error_feedback],
        "parameters": {n: tensor_digest(p) for n, p in model.named_parameters()},
        "buffers": {n: tensor_digest(b) for n, b in model.named_buffers()},
        "loss_scaler": opt.scaler.state_dict(),
    }


def after_step(model, opt, rank: int) -> dict:
    step(model, opt, after_save_batch(rank))
    return {"parameters": {n: tensor_digest(p) for n, p in model.named_parameters()},
            "masters": [tensor_digest(g.master) for g in opt.groups]}


def _save(rank, world, path):
    model, opt = build(seed=0)
    for s in range(STEPS):
        step(model, opt, batch(s, rank))
    opt.save_checkpoint(path)
    saved = record(model, opt)
    assert any(ef is not None and ef.residual.abs().max() > 0 for ef in opt.error_feedback), "no residuals to save"
    return {"saved": saved, "after_step": after_step(model, opt, rank)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=HERE, help="the directory to write into (default: beside this script)")
    out = parser.parse_args().out
    target, expected = os.path.join(out, NAME), os.path.join(out, NAME + ".json")
    for p in (target, expected):
        if os.path.exists(p):
            sys.exit(f"{p} exists; delete it first to write a new one")
    with tempfile.TemporaryDirectory() as tmp:
        results = run_distributed(_save, WORLD, os.path.join(tmp, NAME))
        shutil.copytree(os.path.join(tmp, NAME), target)
    with open(expected, "w") as f:
        json.dump({"torch": torch.__version__, "world_size": WORLD, "ranks": results}, f, indent=1, sort_keys=True)
        f.write("\n")
    size = sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(target) for n in names)
    print(f"wrote {target} ({size} bytes) and {expected}")


if __name__ == "__main__":
    main()
