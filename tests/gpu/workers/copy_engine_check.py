"""GPU check of copy-engine collectives (``ZeroConfig.copy_engine_collectives``).

One GPU (``python tests/gpu/workers/copy_engine_check.py``): detection on this host's PyTorch and NCCL
(prints what is missing, or that nothing is), the refusal on a gloo group naming the
backend, and an optimizer built with the setting at world 1 (the zero-CTA group and the
symmetric-memory backend are created; a world of one moves nothing) stepping to the same
bits as one without it.

Two or more GPUs (``torchrun --nproc_per_node=2 tests/gpu/workers/copy_engine_check.py``): the training
run of ``tests/gpu/workers/gpu_check.py`` (INT8 gather, with and without gather-ahead, plain and INT8
gradients, stages 1 and 2) with and without the setting must give bitwise the same losses
and weights, and the replicas must stay bit-identical. To see which path NCCL chose, run
with ``NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=COLL`` and look for ``[Copy Engine]`` in the
log. Prints one line per check and exits non-zero
on failure.
"""

import functools
import os
import sys

import torch
import torch.distributed as dist

import qzero
from qzero.wire.copy_engine import check_copy_engine_support


def _report(failures: list, name: str, ok: bool) -> None:
    if not ok:
        failures.append(name)
    if dist.get_rank() == 0:
        print(f"{'PASS' if ok else 'FAIL'}  {name}", flush=True)


def _detect(device) -> str | None:
    try:
        check_copy_engine_support(device, None)
    except ValueError as e:
        return str(e)
    return None


def one_gpu(failures: list) -> None:
    device = torch.device("cuda", 0)
    print(f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
          f"{torch.cuda.get_device_name(device)}", flush=True)
    missing = _detect(device)
    print(f"detection: {'every piece present' if missing is None else missing}", flush=True)
    gloo = dist.new_group([0], backend="gloo")
    try:
        check_copy_engine_support(device, gloo)
        _report(failures, "a gloo group is refused", False)
    except ValueError as e:
        _report(failures, f"a gloo group is refused, naming the backend ({e})", "'gloo'" in str(e))
    if missing is not None:
        return

    def steps(on: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256))
        model = model.to(device, torch.bfloat16)
        cfg = qzero.ZeroConfig(zero_quantized_weights=True, zero_quantized_gradients=True,
                               copy_engine_collectives=on, allgather_bucket_size=16_384)
        opt = qzero.ZeroOptimizer(model, functools.partial(torch.optim.AdamW, lr=1e-3), config=cfg)
        x = torch.randn(8, 256, device=device, dtype=torch.bfloat16)
        for _ in range(3):
            opt.backward(model(x).float().square().mean())
            opt.step()
            opt.zero_grad()
        opt.wait_for_weights()
        return torch.cat([g.flat for g in opt.groups]), opt.context.copy_engine

    plain, _ = steps(False)
    ce, comm = steps(True)
    _report(failures, "world 1: the optimizer builds the zero-CTA group with the setting on", comm is not None)
    _report(failures, "world 1: weights after 3 steps bitwise equal with and without the setting",
            torch.equal(plain.view(torch.int16), ce.view(torch.int16)))


def multi_gpu(failures: list) -> None:
    from gpu_check import run  # the training run the other GPU checks compare (this script's folder)

    missing = _detect(torch.device("cuda", dist.get_rank()))
    if missing is not None:
        _report(failures, f"detection: {missing}", False)
        return
    for stage in (1, 2):
        for extra in (dict(), dict(overlap_param_gather=True), dict(zero_quantized_gradients=True),
                      dict(overlap_param_gather=True, zero_quantized_gradients=True)):
            base = dict(stage=stage, zero_quantized_weights=True, **extra)
            off = run(base)
            on = run(dict(base, copy_engine_collectives=True))
            _report(failures, f"stage {stage} {extra or 'synchronous'}: replicas bit-identical with the setting", on[2])
            _report(failures, f"stage {stage} {extra or 'synchronous'}: losses and weights bitwise equal with and "
                              "without copy-engine collectives",
                    torch.equal(off[0], on[0]) and torch.equal(off[1].view(torch.int16), on[1].view(torch.int16)))


def main():
    if "RANK" not in os.environ:  # one process, one GPU
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    else:
        dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank())
    failures: list = []
    (one_gpu if dist.get_world_size() == 1 else multi_gpu)(failures)
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
