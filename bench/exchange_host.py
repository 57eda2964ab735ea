"""Host time of one quantized gradient exchange, piece by piece (one GPU, or the CPU).

A bucket of ``--numel`` bf16 gradients, cut into two owners' pieces the way DeepSpeed's
ZeRO-2 hands the adapter a sub-bucket (``qzero/integrations/deepspeed_grads.py``), goes
through :class:`qzero.wire.quantized_reduce.QuantizedExchange` as rank 0 of an emulated DP2
world (``bench/emulated_link.py``, no link: its collectives write their outputs, so the
payloads decode). Each call is timed on the host in the pieces the adapter runs:

* ``stage``: the slices copied into one buffer by owner (``torch.cat``);
* ``launch``: the pieces other ranks own packed and the all-to-all started;
* ``finish``: the wait from the calling stream and the owner's dequantize-sum;
* ``copy back``: the average, the cast to bf16 and the copy into the bucket.

While the host enqueues, the GPU is kept busy (a sleep longer than the timed loop), so no
launch waits for the device and only host time is measured; a round makes few enough calls
(``--calls``, default 40: about 12 launches each) that CUDA's launch queue never fills, which
would make the host wait for the device after all. The emulated all-to-all's own
host cost (``bench/collective_host_cost.py``) is part of ``launch``; ``--profile`` adds a
cProfile table of the timed calls (the Python functions with the most time of their own).

``--stub-launches`` (CPU): qzero's own Python alone. The Triton kernels go through their real
launcher's direct path (specialization key, tables, arguments) to a compiled kernel that does
nothing, so what is timed is everything but the device's work and Triton's own launch.

    python3 bench/exchange_host.py --out exchange_host.json --profile
    python3 bench/exchange_host.py --device cpu --numel 1e6 --calls 50   # a smoke run (reference kernels)
    python3 bench/exchange_host.py --device cpu --stub-launches --numel 2e6 --calls 400
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PIECES = ("stage", "launch", "finish", "copy back")


class _NoDeviceWork:
    """A compiled kernel that launches nothing (``--stub-launches``)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


class _StubKernel:
    """Stands for a Triton kernel in the launcher: its argument names, and a first (Triton)
    launch that returns :class:`_NoDeviceWork` for the launcher to keep."""

    def __init__(self, real):
        self.arg_names = real.arg_names
        self.fn = self

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _NoDeviceWork()


def stubbed_gradient_kernels():
    """Triton's gradient kernels on the CPU with every launch stubbed (``--stub-launches``)."""
    from qzero.quant import gradients_triton
    from qzero.quant.triton import TritonKernels

    for name in ("_grad_pack_kernel", "_dequantize_sum_kernel"):
        setattr(gradients_triton, name, _StubKernel(getattr(gradients_triton, name)))
    kernels = TritonKernels()
    kernels.launcher.interpret = False
    kernels.launcher._driver = (lambda: 0, lambda device: 0)
    return kernels


def build(numel: int, fmt: str, group_size: int, device: torch.device, kernels):
    """The bucket, its two slices (rank 1's first, as DeepSpeed's backward order puts them),
    the exchange with a few exact ranges (norm weights), and the parts it is called with."""
    from qzero.quant import gradient_kernels_for
    from qzero.wire.quantized_reduce import GradientQuantization, QuantizedExchange

    bucket = torch.randn(numel, device=device).to(torch.bfloat16)
    half = numel // 2
    slices = [bucket[:half], bucket[half:]]
    owners = [1, 0]
    order = [1, 0]  # staged by owner: rank 0's slice first
    at, parts = 0, []
    for i in order:
        parts.append((owners[i], at, slices[i].numel(), at))
        at += slices[i].numel()
    exact = [(k * 4096, k * 4096 + 128) for k in range(8)]
    quant = GradientQuantization(group_size, fmt, 0)
    kernel_set = gradient_kernels_for(device, kernels) if isinstance(kernels, str) else kernels
    exchange = QuantizedExchange.over(quant, torch.bfloat16, dist.group.WORLD, 2, 0, device, kernel_set, exact)
    return bucket, slices, order, tuple(parts), exchange


def one_call(slices, order, parts, exchange, clock, acc=None) -> None:
    """One exchange as the adapter makes it; adds each piece's host seconds into ``acc``."""
    t0 = clock()
    staged = torch.cat([slices[i].reshape(-1) for i in order])
    t1 = clock()
    pending, _ = exchange.launch(staged, 0, parts)
    t2 = clock()
    result = exchange.finish(pending, 0)
    t3 = clock()
    if result is not None:
        total, start = result
        total.div_(2.0)
        total = total.to(torch.bfloat16)
        own = slices[order[0]]
        own.copy_(total[: own.numel()].view(own.shape))
    t4 = clock()
    if acc is not None:
        for name, dt in zip(PIECES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            acc[name].append(dt)


def measure(a, device: torch.device) -> dict:
    kernels = stubbed_gradient_kernels() if a.stub_launches else a.kernels
    bucket, slices, order, parts, exchange = build(int(a.numel), a.fmt, a.group_size, device, kernels)
    cuda = device.type == "cuda"
    clock = time.perf_counter
    for _ in range(a.warmup):
        one_call(slices, order, parts, exchange, clock)
    if cuda:
        torch.cuda.synchronize()
    rounds = []
    profile_text = None
    for r in range(a.rounds):
        acc = {name: [] for name in PIECES}
        if cuda:  # keep the device busy past the timed loop: no launch waits for it
            torch.cuda._sleep(int(a.busy_ms * 1.98e6))
        prof = cProfile.Profile() if (a.profile and r == a.rounds - 1) else None
        if prof:
            prof.enable()
        t = clock()
        for _ in range(a.calls):
            one_call(slices, order, parts, exchange, clock, acc)
        wall = clock() - t
        if prof:
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.profile_rows)
            profile_text = s.getvalue()
        if cuda:
            torch.cuda.synchronize()
        rounds.append({"wall_us_per_call": 1e6 * wall / a.calls,
                       **{name: 1e6 * statistics.median(v) for name, v in acc.items()}})
    return {"rounds": rounds, "profile": profile_text}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--numel", type=float, default=2.6e7, help="bucket elements (default 2.6e7)")
    ap.add_argument("--fmt", default="int8")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--kernels", default="auto", help="ZeroConfig.quant_kernels")
    ap.add_argument("--calls", type=int, default=40, help="calls per round (keep the launch queue short)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--busy-ms", type=float, default=200.0, help="GPU sleep per round, longer than its host loop")
    ap.add_argument("--stub-launches", action="store_true",
                    help="CPU: the Triton kernels' launches stubbed, qzero's own Python timed (see above)")
    ap.add_argument("--profile", action="store_true", help="cProfile the last round")
    ap.add_argument("--profile-rows", type=int, default=25)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.calls < 1 or a.numel < 2 or a.rounds < 1 or a.warmup < 0:
        raise SystemExit(f"--calls, --rounds must be positive and --numel at least 2, got {a.calls}, {a.rounds}, {a.numel}")
    if a.stub_launches and a.device != "cpu":
        raise SystemExit("--stub-launches times the CPU path: use it with --device cpu")
    device = torch.device(a.device, 0) if a.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device here: use --device cpu")
        torch.cuda.set_device(device)
    from emulated_link import close_emulated_world, init_emulated_world

    init_emulated_world(2, "none")
    try:
        res = measure(a, device)
    finally:
        close_emulated_world()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"host us per quantized exchange, {int(a.numel)} bf16 elements, {a.fmt} g{a.group_size}, "
          f"emulated DP2 (no link), {name}, torch {torch.__version__} (medians per piece, per round):")
    print("round  " + "  ".join(f"{p:>10s}" for p in PIECES) + "   wall/call")
    for i, r in enumerate(res["rounds"]):
        print(f"{i:5d}  " + "  ".join(f"{r[p]:10.1f}" for p in PIECES) + f"   {r['wall_us_per_call']:9.1f}")
    if res["profile"]:
        print(res["profile"])
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"numel": int(a.numel), "fmt": a.fmt, "group_size": a.group_size, "device": name,
                       "torch": torch.__version__, "calls": a.calls, **res}, f, indent=1)


if __name__ == "__main__":
    main()
