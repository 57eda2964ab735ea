"""GPU correctness check of the optimizer on NCCL (run with torchrun, 2 GPUs).

For a small Qwen3-shaped model: the quantized gather with and without gather-ahead
must give bitwise the same losses and weights; replicas must be bit-identical; the
plain path must match too; the same for delta gathers (int4 and int8), whose fused
kernels must give the torch reference's bits over a whole run. Prints one line per
check and exits non-zero on failure.

    torchrun --nproc_per_node=2 tests/gpu/workers/gpu_check.py [--delays]

``--share-gpu`` runs both ranks on one GPU (``torchrun --nproc_per_node=2 tests/gpu/workers/gpu_check.py
--share-gpu``): gloo for the process group, every collective on a CUDA tensor through the other
rank's device memory (``benchmarks/scripts/one_gpu.py``); the side streams, events and kernels are the real ones.

``--delays`` is the race stress: each side stream of the gather engine is made late in
turn, then every collective launch and wait first puts a random GPU sleep on the current
stream; every result must still equal the undelayed run's bits.
"""

import functools
import os
import sys

import torch
import torch.distributed as dist

#: Both ranks on one GPU: the collectives are routed before qzero keeps references to them.
SHARE_GPU = "--share-gpu" in sys.argv
if SHARE_GPU:  # benchmarks/scripts/one_gpu.py, loaded by its path (the scripts are not a package)
    import importlib.util

    _path = os.path.join(os.path.dirname(os.path.abspath(__file__)), *[os.pardir] * 3, "benchmarks", "scripts",
                         "one_gpu.py")
    _spec = importlib.util.spec_from_file_location("one_gpu", _path)
    _one_gpu = importlib.util.module_from_spec(_spec)
    sys.modules["one_gpu"] = _one_gpu
    _spec.loader.exec_module(_one_gpu)
    route_collectives, share_one_gpu = _one_gpu.route_collectives, _one_gpu.share_one_gpu

    route_collectives()

import qzero  # noqa: E402
from qzero.app.workload import build_model, global_batch, load_corpus, model_config  # noqa: E402


#: Set by install_delays: wraps each optimizer's collective (CommContext.all_gather).
_DELAYED = None


def run(cfg_kwargs, steps=6, seq=256, micro=2, delay_stage=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", 0 if SHARE_GPU else rank)
    model = build_model(model_config("small", max_positions=seq), torch.bfloat16, device, seed=0)
    # one flat order for every arm, so that synchronous and gather-ahead runs compare bit for bit
    cfg_kwargs = {"flat_order": "interleaved", **cfg_kwargs}
    cfg = qzero.ZeroConfig(small_param_numel=4096, allgather_bucket_size=world * 64 * 1024,
                           reduce_bucket_size=60_000, **cfg_kwargs)  # small windows: the embedding spans many
    opt = qzero.ZeroOptimizer(model, functools.partial(torch.optim.AdamW, lr=1e-3, fused=True), config=cfg)
    if delay_stage is not None:  # one side stream late: exposes a missing wait between streams
        opt.context.delays[delay_stage] = 2_000_000
    if _DELAYED is not None:
        opt.context.all_gather = _DELAYED(opt.context.all_gather)
    corpus = load_corpus()
    losses = []
    for step in range(steps):
        tokens = global_batch(corpus, step, world * micro, seq, 0).view(world, micro, -1)[rank].to(device)
        logits = model(input_ids=tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                 tokens[:, 1:].reshape(-1))
        opt.backward(loss)
        opt.step()
        # a collective of the user's while the gather may still run ahead: the ranks must
        # have issued the same gather collectives before it, or they hang
        mean = loss.detach().reshape(1).clone()
        dist.all_reduce(mean)
        opt.zero_grad()
        losses.append(loss.detach())
    opt.wait_for_weights()
    flat = torch.cat([g.flat for g in opt.groups])
    copies = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(copies, flat)
    same = all(torch.equal(c.view(torch.int16), flat.view(torch.int16)) for c in copies)
    return torch.stack(losses).cpu(), flat.cpu(), same


def install_delays(seed: int) -> None:
    """Random GPU sleeps before every collective launch and wait (of the optimizers run() makes from now on)."""
    import random

    global _DELAYED
    rng = random.Random(seed)

    class SlowWork:
        def __init__(self, work):
            self.work = work

        def wait(self):
            torch.cuda._sleep(rng.randrange(0, 2_000_000))
            return self.work.wait()

    def wrap(real):
        def delayed(out, inp, group=None, async_op=False):
            torch.cuda._sleep(rng.randrange(0, 2_000_000))
            work = real(out, inp, group=group, async_op=async_op)
            return SlowWork(work) if async_op else work

        return delayed

    _DELAYED = wrap


def delta_checks(check, plain_by_stage, steps=8) -> None:
    """Delta gathers (``zero_quantized_weights_delta``, docs/delta-gathers.md) on NCCL: the fused
    kernels bitwise the torch reference over a whole run, gather-ahead and the inline schedule
    bitwise the synchronous run, identical replicas, a resync every 3 gathers, losses near plain."""
    for fmt, group in (("int4", 256), ("int8", 64)):
        for stage in (1, 2):
            delta = dict(stage=stage, zero_quantized_weights=True, zero_quantized_weights_delta=True,
                         zero_quantized_weights_format=fmt, zero_quantized_weights_group_size=group,
                         zero_quantized_weights_delta_resync_steps=3, overlap_param_gather=False)
            sync = run(delta, steps=steps)
            name = f"stage {stage}: {fmt} delta g{group}"
            check(f"{name}: replicas bit-identical", sync[2])
            for label, extra in (("fused Triton kernels == torch reference", dict(quant_kernels="reference")),
                                 ("gather-ahead on side streams == synchronous", dict(overlap_param_gather=True)),
                                 ("gather-ahead inline == synchronous",
                                  dict(overlap_param_gather=True, gather_schedule="inline")),
                                 ("sliced update == whole update", dict(sliced_update=False))):
                other = run({**delta, **extra}, steps=steps)
                check(f"{name}: {label} (losses, weights, bitwise)",
                      torch.equal(sync[0], other[0])
                      and torch.equal(sync[1].view(torch.int16), other[1].view(torch.int16)))
            plain = plain_by_stage[stage]
            diff = (plain[0][: len(sync[0])] - sync[0][: len(plain[0])]).abs().max().item()
            check(f"{name}: loss within 0.02 of plain (max diff {diff:.5f})", diff < 0.02)
    if "--delays" in sys.argv:
        delta = dict(stage=2, zero_quantized_weights=True, zero_quantized_weights_delta=True, overlap_param_gather=True)
        clean = run(delta)
        for stage_name in ("pack", "gather", "unpack"):
            stressed = run(delta, delay_stage=stage_name)
            check(f"race stress int4 delta gather-ahead, {stage_name} stream delayed: "
                  "bitwise equal to the undelayed run",
                  torch.equal(clean[0], stressed[0])
                  and torch.equal(clean[1].view(torch.int16), stressed[1].view(torch.int16)))


def main():
    if SHARE_GPU:
        dist.init_process_group("gloo")
        torch.cuda.set_device(0)
        share_one_gpu()
    else:
        dist.init_process_group("nccl")
        torch.cuda.set_device(dist.get_rank())
    failures = 0

    def check(name, ok):
        nonlocal failures
        failures += not ok
        if dist.get_rank() == 0:
            print(f"{'PASS' if ok else 'FAIL'}  {name}", flush=True)

    inline = dict(gather_schedule="inline")  # pack/unpack on the compute stream, async collectives
    plain_by_stage = {}
    for stage in (1, 2):
        plain = plain_by_stage[stage] = run(dict(stage=stage))
        quant = run(dict(stage=stage, zero_quantized_weights=True))
        ahead = run(dict(stage=stage, zero_quantized_weights=True, overlap_param_gather=True))
        ahead_inline = run(dict(stage=stage, zero_quantized_weights=True, overlap_param_gather=True, **inline))
        quant_inline = run(dict(stage=stage, zero_quantized_weights=True, **inline))
        plain_ahead = run(dict(stage=stage, overlap_param_gather=True))
        check(f"stage {stage}: replicas bit-identical (plain, int8, int8+ahead)", plain[2] and quant[2] and ahead[2])
        for label, other in (("gather-ahead on side streams", ahead), ("gather-ahead inline", ahead_inline),
                             ("synchronous inline", quant_inline)):
            check(f"stage {stage}: int8 {label} == int8 synchronous on side streams (losses, weights)",
                  torch.equal(quant[0], other[0])
                  and torch.equal(quant[1].view(torch.int16), other[1].view(torch.int16)))
        check(f"stage {stage}: plain gather-ahead == plain synchronous",
              torch.equal(plain[0], plain_ahead[0]) and torch.equal(plain[1], plain_ahead[1]))
        for label, extra, b in (("synchronous", {}, quant), ("gather-ahead", dict(overlap_param_gather=True), ahead),
                                ("gather-ahead inline", dict(overlap_param_gather=True, **inline), ahead_inline)):
            a = run(dict(stage=stage, zero_quantized_weights=True, sliced_update=False, **extra))
            check(f"stage {stage}: sliced update == whole update, {label} (losses, weights)",
                  torch.equal(a[0], b[0]) and torch.equal(a[1].view(torch.int16), b[1].view(torch.int16)))
        diff = (plain[0] - quant[0]).abs().max().item()
        check(f"stage {stage}: int8 loss within 0.02 of plain (max diff {diff:.5f})", diff < 0.02)
    if "--delays" in sys.argv:
        clean = run(dict(stage=2, zero_quantized_weights=True, overlap_param_gather=True))
        for stage_name in ("pack", "gather", "unpack"):  # each side stream late in turn
            for cfg in (dict(), dict(overlap_param_gather=True)):
                stressed = run(dict(stage=2, zero_quantized_weights=True, **cfg), delay_stage=stage_name)
                check(f"race stress {cfg or 'synchronous'}, {stage_name} stream delayed: "
                      "bitwise equal to the undelayed run",
                      torch.equal(clean[0], stressed[0])
                      and torch.equal(clean[1].view(torch.int16), stressed[1].view(torch.int16)))
        install_delays(1000 + dist.get_rank())
        for cfg in (dict(), dict(overlap_param_gather=True), dict(overlap_param_gather=True, **inline)):
            stressed = run(dict(stage=2, zero_quantized_weights=True, **cfg))
            check(f"race stress {cfg or 'synchronous'}, collectives delayed: bitwise equal to the undelayed run",
                  torch.equal(clean[0], stressed[0])
                  and torch.equal(clean[1].view(torch.int16), stressed[1].view(torch.int16)))
    ref = run(dict(stage=2, zero_quantized_weights=True, quant_kernels="reference"))
    fused = run(dict(stage=2, zero_quantized_weights=True, quant_kernels="triton"))
    check("fused Triton kernels == torch reference, whole training run (bitwise)",
          torch.equal(ref[0], fused[0]) and torch.equal(ref[1].view(torch.int16), fused[1].view(torch.int16)))
    delta_checks(check, plain_by_stage)
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
