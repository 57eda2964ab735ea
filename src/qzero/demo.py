"""A small CPU demonstration of the quantized gather: ``python -m qzero.demo``.

Two gloo ranks (forked processes) share the flat buffer of a tiny transformer-shaped
parameter list. Each rank owns one partition; the plain and the quantized gather
are run on it and compared: bytes sent, error, bit-identical replicas.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .comm import all_gather, quantized_all_gather
from .layout import plan_flat_layout


def tiny_transformer_shapes(layers: int = 4, hidden: int = 256, vocab: int = 4096) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden,), (3 * hidden, hidden), (hidden, hidden), (hidden,), (4 * hidden, hidden), (hidden, 4 * hidden)]
    return shapes + [(hidden,)]


def _worker(rank: int, world: int, store: str, bucket: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    layout = plan_flat_layout(tiny_transformer_shapes(), world, bucket_numel=bucket, small_param_numel=4096)
    truth = (torch.randn(layout.numel) * 0.02).bfloat16()
    lo, hi = layout.partition(rank)
    flat = torch.full_like(truth, float("nan"))
    flat[lo:hi] = truth[lo:hi]
    plain = flat.clone()
    p_stats = all_gather(plain, bucket_numel=bucket)
    q_stats = quantized_all_gather(flat, exact_ranges=layout.exact_ranges, bucket_numel=bucket)
    copies = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(copies, flat)
    if rank == 0:
        err = (flat.float() - truth.float()).abs()
        rel = (err.norm() / truth.float().norm()).item()
        exact_ok = all(torch.equal(flat[a:b], truth[a:b]) for a, b in layout.exact_ranges)
        lines = [
            f"flat buffer: {layout.numel:,} elements (bf16), {world} ranks, {len(layout.exact_ranges)} exact ranges",
            f"plain gather:     {p_stats.bytes_sent:>10,} bytes/rank in {p_stats.num_chunks} chunk(s), exact: "
            f"{torch.equal(plain, truth)}",
            f"quantized gather: {q_stats.bytes_sent:>10,} bytes/rank in {q_stats.num_chunks} chunk(s) "
            f"({q_stats.ratio:.3f} of plain), largest receive buffer {q_stats.max_recv_numel:,} elements "
            f"(bucket {bucket:,})",
            f"error: relative L2 {rel:.2e}, max abs {err.max().item():.2e}; small parameters bit-exact: {exact_ok}",
            f"replicas bit-identical: {all(torch.equal(c, copies[0]) for c in copies)}",
        ]
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m qzero.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--bucket", type=int, default=2 * 2**16, help="all-gather bucket in elements")
    args = parser.parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.txt")
        mp.start_processes(
            _worker,
            args=(args.world_size, os.path.join(tmp, "store"), args.bucket, out),
            nprocs=args.world_size,
            start_method="fork",
        )
        print(open(out).read(), end="")


if __name__ == "__main__":
    main()
