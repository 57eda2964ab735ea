"""Host time of the gather engine, per chunk and per piece (torchrun --nproc_per_node=2).

Builds a flat bf16 buffer of ``--numel`` elements laid out by ``qzero.layout`` from
Qwen3-shaped parameters (norms exact), plans its int8 gather, and times on the host:

* ``pieces``: each piece of the ``streams`` schedule's per-chunk work, as the engine
  issues it (switch to the pack stream and wait for its events, pack, launch the
  collective, switch to the unpack stream and wait for the collective, unpack every rank's
  payload with its exact elements, record the unpack's event and switch back);
* ``whole``: ``start_gather`` then ``wait_until(k)`` for every chunk, as gather-ahead's
  forward hooks call it.

On CUDA the compute stream is kept busy (a GPU sleep longer than the host loop) while the
host enqueues, so no launch waits for the device and only host cost is measured; each arm
runs with the Triton launches through the compiled kernel (``fast``) and through Triton's
own launch (``jit``). Prints a table (microseconds per chunk) on rank 0 and writes JSON to
``--out`` (a file, or a folder to write ``engine_host.json`` into).

Smoke test on CPU (gloo, the ``inline`` schedule, the reference kernels, no busy device)::

    torchrun --nproc_per_node=2 benchmarks/scripts/engine_host.py --device cpu --numel 2e6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from qzero.vocabulary import WEIGHT_FORMATS
from qzero.wire import chunks
from qzero.wire.chunks import pack_chunk, unpack_chunk
from qzero.wire.engine import CommContext, fitting_plan, start_gather
from qzero.layout import plan_flat_layout

PIECES = ("switch+wait", "pack", "collective", "switch+work.wait", "unpack", "record+switch")


def qwen_like_shapes(numel: int, layers: int = 36) -> tuple[list[tuple[int, ...]], int]:
    """Parameter shapes of a Qwen3-like stack (per layer: two norms, q/k norms, q k v o, gate
    up down) whose total is about ``numel``; and the hidden size."""
    per_h2 = 1.6 + 0.4 + 0.4 + 1.6 + 3 * 3.8
    h = max(16, int((numel / (layers * per_h2)) ** 0.5) // 16 * 16)
    i = int(3.8 * h) // 16 * 16
    q = int(1.6 * h) // 16 * 16
    kv = max(16, int(0.4 * h) // 16 * 16)
    shapes: list[tuple[int, ...]] = []
    for _ in range(layers):
        shapes += [(h,), (q, h), (kv, h), (kv, h), (128,), (128,), (h, q), (h,), (i, h), (i, h), (h, i)]
    rest = numel - sum(s[0] * (s[1] if len(s) > 1 else 1) for s in shapes)
    if rest > 4 * h:
        shapes.append((rest,))  # the embedding takes what is left
    return shapes, h


def busy(device: torch.device, ms: float, cycles_per_ms: float) -> None:
    """Keep the current stream busy for about ``ms`` milliseconds (nothing on CPU)."""
    if device.type == "cuda" and ms > 0:
        torch.cuda._sleep(int(ms * cycles_per_ms))


def calibrate(device: torch.device) -> float:
    if device.type != "cuda":
        return 0.0
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    a.record()
    torch.cuda._sleep(20_000_000)
    b.record()
    torch.cuda.synchronize()
    return 20_000_000 / a.elapsed_time(b)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def time_pieces(flat, plan, group, context, world, rank) -> dict[str, float]:
    """Seconds per piece, summed over every chunk, issued as the streams schedule issues
    them (the inline schedule off CUDA: no streams or events, a blocking wait)."""
    t = dict.fromkeys(PIECES, 0.0)
    cuda = context.schedule == "streams"
    work_plan = (fitting_plan(plan, 2) or plan) if cuda else plan
    recv = [torch.empty(work_plan.max_recv_bytes, dtype=torch.uint8, device=flat.device) for _ in range(2)]
    unpacked = [None] * len(work_plan.chunks)
    caller = torch.cuda.current_stream(flat.device) if cuda else None
    if cuda:
        ready = caller.record_event()
    clock = time.perf_counter
    for k, chunk in enumerate(work_plan.chunks):
        buf = recv[k % 2][: world * chunk.payload_bytes]
        t0 = clock()
        if cuda:
            pack = context.streams["pack"]
            torch.cuda.set_stream(pack)
            if k == 0:
                pack.wait_event(ready)
            if k >= 2:
                pack.wait_event(unpacked[k - 2])
        t1 = clock()
        mine = pack_chunk(flat, work_plan, chunk, rank, buf, context.kernels)
        t2 = clock()
        work = chunks.all_gather_into(buf, mine, group=group, async_op=True) if world > 1 else None
        t3 = clock()
        if cuda:
            torch.cuda.set_stream(context.streams["unpack"])
            if work is None:
                context.streams["unpack"].wait_event(pack.record_event())
        if work is not None:
            work.wait()
        t4 = clock()
        unpack_chunk(flat, work_plan, chunk, rank, buf, context.kernels)
        t5 = clock()
        if cuda:
            unpacked[k] = context.streams["unpack"].record_event()
            torch.cuda.set_stream(caller)
        t6 = clock()
        for name, dt in zip(PIECES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5)):
            t[name] += dt
    if cuda:
        caller.wait_event(unpacked[-1])
    return t


def time_whole(flat, plan, group, context) -> tuple[float, int]:
    t0 = time.perf_counter()
    handle = start_gather(flat, plan, group, context, ahead=True)
    for k in range(len(handle.plan.chunks)):
        handle.wait_until(k)
    return time.perf_counter() - t0, len(handle.plan.chunks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=float, default=2e9, help="flat buffer elements (bf16)")
    ap.add_argument("--bucket", type=float, default=5e7,
                    help="ZeroConfig.allgather_bucket_size: gather bucket (elements across all ranks)")
    ap.add_argument("--fmt", default="int8", choices=WEIGHT_FORMATS, help="ZeroConfig.zero_quantized_weights_format")
    ap.add_argument("--group-size", type=int, default=64, help="ZeroConfig.zero_quantized_weights_group_size")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--fake-world", type=int, default=0, metavar="N",
                    help="one process as rank 0 of N under torch's fake process group (one GPU): the engine's "
                         "host cost at DP-N without NCCL's (the collective returns at once)")
    a = ap.parse_args()
    cuda = a.device == "cuda"
    if a.fake_world:
        from one_gpu import init_fake_world

        init_fake_world(a.fake_world)
    else:
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    shapes, hidden = qwen_like_shapes(int(a.numel))
    layout = plan_flat_layout(shapes, world, zero_quantized_weights_group_size=a.group_size,
                              small_param_numel=4 * hidden, allgather_bucket_size=int(a.bucket),
                              zero_quantized_weights_format=a.fmt, flat_order="interleaved")
    plan = layout.gather
    flat = torch.empty(layout.numel, dtype=torch.bfloat16, device=device)
    g = torch.Generator(device=device).manual_seed(rank)
    flat.normal_(generator=g)
    context = CommContext(device)
    cycles_per_ms = calibrate(device)
    contexts = {"default": context}
    if cuda and getattr(context.kernels, "name", None) == "triton":
        from qzero.quant.triton import TritonKernels
        from qzero.quant.triton_launch import KernelTuning, Launcher

        # the same kernels, launched directly once compiled (fast) or always by Triton's own launch (jit)
        contexts = {arm: CommContext(device, kernels=TritonKernels(Launcher(KernelTuning(fast_launch=arm == "fast"))))
                    for arm in ("fast", "jit")}
    arms = tuple(contexts)
    results = {"numel": layout.numel, "world": world, "fake_world": bool(a.fake_world), "bucket": int(a.bucket),
               "fmt": a.fmt, "device": a.device,
               "schedule": context.schedule, "kernels": getattr(context.kernels, "name", str(context.kernels)),
               "exact_ranges": len(plan.exact_ranges), "arms": {}}
    busy_ms = 2000.0
    for arm in arms:
        context = contexts[arm]
        # warm up: compile every kernel variant, fill the caches on the plan and the launcher
        start_gather(flat, plan, None, context).wait()
        time_pieces(flat, plan, None, context, world, rank)
        sync(device)
        pieces, whole, n_chunks = [], [], 0
        for _ in range(a.repeats):
            sync(device)
            busy(device, busy_ms, cycles_per_ms)
            p = time_pieces(flat, plan, None, context, world, rank)
            sync(device)
            busy(device, busy_ms, cycles_per_ms)
            w, n_chunks = time_whole(flat, plan, None, context)
            sync(device)
            pieces.append(p)
            whole.append(w)
            busy_ms = max(50.0, 3e3 * max(w, sum(p.values())))  # device busy well past the host loop
        n = n_chunks
        row = {name: 1e6 * statistics.median(p[name] for p in pieces) / n for name in PIECES}
        row["pieces total"] = sum(row[name] for name in PIECES)
        row["whole start_gather + wait_until"] = 1e6 * statistics.median(whole) / n
        results["arms"][arm] = {"chunks": n, "us_per_chunk": row}
    if rank == 0:
        names = list(next(iter(results["arms"].values()))["us_per_chunk"])
        print(f"engine host time, us per chunk ({results['arms'][arms[0]]['chunks']} chunks, numel {layout.numel:.3g}, "
              f"world {world}, {a.fmt} g{a.group_size}, bucket {a.bucket:.3g}, {context.schedule}, "
              f"{len(plan.exact_ranges)} exact ranges)")
        print(f"{'piece':34s}" + "".join(f"{arm:>10s}" for arm in arms))
        for name in names:
            print(f"{name:34s}" + "".join(f"{results['arms'][arm]['us_per_chunk'][name]:10.1f}" for arm in arms))
        if a.out:
            path = os.path.join(a.out, "engine_host.json") if os.path.isdir(a.out) or a.out.endswith("/") else a.out
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                json.dump(results, f, indent=1)
            print(f"wrote {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
