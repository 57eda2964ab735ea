"""GPU correctness check of the optimizer on NCCL (run with torchrun, 2 GPUs).

For a small Qwen3-shaped model: the quantized gather with and without gather-ahead
must give bitwise the same losses and weights; replicas must be bit-identical; the
plain path must match too. Prints one line per check and exits non-zero on failure.

    torchrun --nproc_per_node=2 bench/gpu_check.py [--delays]

``--delays`` is the race stress: every collective launch and wait of the synchronous,
pipelined and gather-ahead paths first puts a random GPU sleep on the current stream (and
every pipeline stage its own), and every result must still equal the undelayed run's bits.
"""

import functools
import os
import sys

import torch
import torch.distributed as dist

import qzero
from qzero.workload import build_model, global_batch, load_corpus, model_config


def run(cfg_kwargs, steps=6, seq=256, micro=2):
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank)
    model = build_model(model_config("small", max_positions=seq), torch.bfloat16, device, seed=0)
    # one flat order for every arm, so that synchronous and gather-ahead runs compare bit for bit
    cfg_kwargs = {"flat_order": "interleaved", **cfg_kwargs}
    cfg = qzero.ZeroConfig(small_param_numel=4096, allgather_bucket_size=world * 64 * 1024,
                           reduce_bucket_size=60_000, **cfg_kwargs)  # small windows: the embedding spans many
    opt = qzero.ZeroOptimizer(model, functools.partial(torch.optim.AdamW, lr=1e-3, fused=True), config=cfg)
    corpus = load_corpus()
    losses = []
    for step in range(steps):
        tokens = global_batch(corpus, step, world * micro, seq, 0).view(world, micro, -1)[rank].to(device)
        logits = model(input_ids=tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    opt.wait_for_weights()
    flat = torch.cat([g.flat for g in opt.groups])
    copies = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(copies, flat)
    same = all(torch.equal(c.view(torch.int16), flat.view(torch.int16)) for c in copies)
    return torch.stack(losses).cpu(), flat.cpu(), same


def install_delays(seed: int) -> None:
    """Random GPU sleeps before every collective launch and wait, and in every pipeline stage."""
    import random

    import qzero.comm as comm
    import qzero.overlap as overlap
    import qzero.pipeline as pipeline

    rng = random.Random(seed)
    real = comm.all_gather_into

    class SlowWork:
        def __init__(self, work):
            self.work = work

        def wait(self):
            torch.cuda._sleep(rng.randrange(0, 2_000_000))
            return self.work.wait()

    def delayed(out, inp, group=None, async_op=False):
        torch.cuda._sleep(rng.randrange(0, 2_000_000))
        work = real(out, inp, group=group, async_op=async_op)
        return SlowWork(work) if async_op else work

    comm.all_gather_into = overlap.all_gather_into = delayed
    for stage in pipeline.DELAY_CYCLES:
        pipeline.DELAY_CYCLES[stage] = 1_000_000


def main():
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank())
    failures = 0

    def check(name, ok):
        nonlocal failures
        failures += not ok
        if dist.get_rank() == 0:
            print(f"{'PASS' if ok else 'FAIL'}  {name}", flush=True)

    os.environ["QZERO_AHEAD_STREAMS"] = "0"  # the hook-driven pump unless a check asks for side streams
    for stage in (1, 2):
        plain = run(dict(stage=stage))
        quant = run(dict(stage=stage, zero_quantized_weights=True))
        ahead = run(dict(stage=stage, zero_quantized_weights=True, overlap_param_gather=True))
        plain_ahead = run(dict(stage=stage, overlap_param_gather=True))
        check(f"stage {stage}: replicas bit-identical (plain, int8, int8+ahead)", plain[2] and quant[2] and ahead[2])
        check(f"stage {stage}: int8 gather-ahead == int8 synchronous (losses, weights)",
              torch.equal(quant[0], ahead[0]) and torch.equal(quant[1].view(torch.int16), ahead[1].view(torch.int16)))
        os.environ["QZERO_AHEAD_STREAMS"] = "1"  # the whole gather queued at step end on side streams
        streamed = run(dict(stage=stage, zero_quantized_weights=True, overlap_param_gather=True))
        os.environ["QZERO_AHEAD_STREAMS"] = "0"
        check(f"stage {stage}: int8 gather-ahead on side streams == int8 synchronous (losses, weights)",
              streamed[2] and torch.equal(quant[0], streamed[0])
              and torch.equal(quant[1].view(torch.int16), streamed[1].view(torch.int16)))
        check(f"stage {stage}: plain gather-ahead == plain synchronous",
              torch.equal(plain[0], plain_ahead[0]) and torch.equal(plain[1], plain_ahead[1]))
        os.environ["QZERO_SLICED_UPDATE"] = "0"  # the inner optimizer stepped whole, then the gather
        whole = run(dict(stage=stage, zero_quantized_weights=True))
        whole_ahead = run(dict(stage=stage, zero_quantized_weights=True, overlap_param_gather=True))
        os.environ["QZERO_AHEAD_STREAMS"] = "1"
        whole_streamed = run(dict(stage=stage, zero_quantized_weights=True, overlap_param_gather=True))
        os.environ["QZERO_AHEAD_STREAMS"] = "0"
        os.environ.pop("QZERO_SLICED_UPDATE")
        for label, a, b in (("synchronous (pipelined)", whole, quant), ("gather-ahead", whole_ahead, ahead),
                            ("gather-ahead on side streams", whole_streamed, streamed)):
            check(f"stage {stage}: sliced update == whole update, {label} (losses, weights)",
                  torch.equal(a[0], b[0]) and torch.equal(a[1].view(torch.int16), b[1].view(torch.int16)))
        diff = (plain[0] - quant[0]).abs().max().item()
        check(f"stage {stage}: int8 loss within 0.02 of plain (max diff {diff:.5f})", diff < 0.02)
    if "--delays" in sys.argv:
        clean = run(dict(stage=2, zero_quantized_weights=True, overlap_param_gather=True))
        install_delays(1000 + dist.get_rank())
        for cfg in (dict(), dict(overlap_param_gather=True)):
            stressed = run(dict(stage=2, zero_quantized_weights=True, **cfg))
            check(f"race stress {cfg or 'synchronous/pipelined'}: bitwise equal to the undelayed run",
                  torch.equal(clean[0], stressed[0]) and torch.equal(clean[1].view(torch.int16), stressed[1].view(torch.int16)))
        from qzero import pipeline

        os.environ["QZERO_AHEAD_STREAMS"] = "1"
        for stage_name in pipeline.STAGES:  # each side stream late in turn
            pipeline.DELAY_CYCLES[stage_name] = 2_000_000
            stressed = run(dict(stage=2, zero_quantized_weights=True, overlap_param_gather=True))
            pipeline.DELAY_CYCLES[stage_name] = 0
            check(f"race stress side-stream gather-ahead, {stage_name} delayed: bitwise equal to the undelayed run",
                  torch.equal(clean[0], stressed[0]) and torch.equal(clean[1].view(torch.int16), stressed[1].view(torch.int16)))
        os.environ["QZERO_AHEAD_STREAMS"] = "0"
    os.environ["QZERO_KERNELS"] = "reference"
    ref = run(dict(stage=2, zero_quantized_weights=True))
    os.environ.pop("QZERO_KERNELS")
    fused = run(dict(stage=2, zero_quantized_weights=True))
    check("fused Triton kernels == torch reference, whole training run (bitwise)",
          torch.equal(ref[0], fused[0]) and torch.equal(ref[1].view(torch.int16), fused[1].view(torch.int16)))
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
