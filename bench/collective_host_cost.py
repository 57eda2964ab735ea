"""Host time of one collective call: NCCL's against the emulated link's (one GPU).

The emulated link (``bench/emulated_link.py``) runs every collective through Python: it books
the transfer, writes the outputs on the link's stream and launches the kernel that holds the
link. A step whose host is the bottleneck (many small chunks or buckets) pays that host time
where a real NCCL process group pays NCCL's. This measures both the way the gather engine calls
them (``async_op=True``, then ``work.wait()`` from the calling stream), over the same tensors:

* ``nccl``: a one-rank NCCL process group (``ProcessGroupNCCL`` with its stream, events and
  ``ncclAllGather``/... launch; with one rank NCCL moves the data by a local copy);
* ``emulated``: rank 0 of an emulated DP-N world on ``--link`` (``none``: no hold kernel).

Host time per call = the wall time of ``--calls`` calls with nothing synchronized between
them, over ``--calls`` (the GPU runs behind; each call's device work is small). Prints one
table; ``--out`` writes it as JSON too.

    python3 bench/collective_host_cost.py --mode nccl --out nccl.json
    python3 bench/collective_host_cost.py --mode emulated --world 2 --link none --out emulated.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

OPS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "all_reduce")


def calls(op: str, n: int, numel: int, device) -> callable:
    """A closure making one async call of ``op`` at world size ``n`` and waiting for it from
    the current stream, on tensors allocated once."""
    x = torch.randn(n * numel, device=device).to(torch.bfloat16)
    out = torch.empty_like(x)
    shard = x[:numel]
    if op == "all_gather_into_tensor":
        return lambda: dist.all_gather_into_tensor(out, shard, async_op=True).wait()
    if op == "reduce_scatter_tensor":
        small = torch.empty(numel, device=device, dtype=torch.bfloat16)
        return lambda: dist.reduce_scatter_tensor(small, x, async_op=True).wait()
    if op == "all_to_all_single":
        u8, o8 = x.view(torch.uint8), out.view(torch.uint8)
        return lambda: dist.all_to_all_single(o8, u8, async_op=True).wait()
    if op == "all_reduce":
        return lambda: dist.all_reduce(x, async_op=True).wait()
    raise ValueError(op)


def measure(n: int, numel: int, count: int, device, warmup: int = 20) -> dict[str, float]:
    """Microseconds of host time per call, per collective (after ``warmup`` calls; on the CPU,
    gloo, the calls include moving the data)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = {}
    for op in OPS:
        call = calls(op, n, numel, device)
        for _ in range(warmup):
            call()
        sync()
        t = time.perf_counter()
        for _ in range(count):
            call()
        out[op] = 1e6 * (time.perf_counter() - t) / count
        sync()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("nccl", "emulated"), required=True)
    ap.add_argument("--world", type=int, default=2, help="emulated world size (nccl: always 1 rank)")
    ap.add_argument("--link", default="none", help="emulated link (bench/emulated_link.py's text)")
    ap.add_argument("--numel", type=int, default=1 << 19, help="bf16 elements per rank's shard (default 512 Ki)")
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.calls < 1 or a.numel < 1 or a.world < 1:
        raise SystemExit(f"--calls, --numel and --world must be positive, got {a.calls}, {a.numel}, {a.world}")
    if not torch.cuda.is_available():
        raise SystemExit("collective_host_cost.py measures CUDA collectives: no CUDA device here")
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    if a.mode == "nccl":
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
        n, what = 1, "NCCL, one rank"
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from emulated_link import init_emulated_world

        init_emulated_world(a.world, a.link)
        n, what = a.world, f"emulated DP{a.world}, link {a.link}"
    us = measure(n, a.numel, a.calls, dev)
    print(f"host time per call, async + wait, {a.numel} bf16 elements a rank ({what}; {torch.cuda.get_device_name(dev)}, "
          f"torch {torch.__version__}):")
    for op, v in us.items():
        print(f"  {op:24s} {v:8.1f} us")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"mode": a.mode, "world": n, "link": a.link if a.mode == "emulated" else None, "numel": a.numel,
                       "calls": a.calls, "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                       "host_us_per_call": us}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
