"""Bits per parameter per step one node sends across the network, flat against two-level
collectives, measured on gloo pseudo-nodes of this machine (CPU; no timing).

    python benchmarks/scripts/two_level_bytes.py --out benchmarks/reports/two-level-bytes.csv

Each cell trains a model of 24 equal 96x96 parameters (whole partitions at every world used, so
the flat buffer has no padding) for two steps and reads ``ZeroOptimizer.network_bits_per_param()``
of the second (a delta run's first gather is its exact resync). Arms: INT8 weights + INT8
gradients, and INT4 weight differences + INT4 gradients, each with ``hierarchical_collectives``
false and auto.
"""

from __future__ import annotations

import argparse
import csv
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
from _support.distributed import run_distributed  # noqa: E402

import qzero  # noqa: E402

ARMS = {
    "int8+int8": dict(zero_quantized_weights=True, zero_quantized_gradients=True),
    "int4-delta+int4": dict(zero_quantized_weights=True, zero_quantized_weights_delta=True,
                            zero_quantized_gradients=True, zero_quantized_gradients_format="int4"),
}
TOPOLOGIES = [(2, 2), (3, 2), (2, 3), (2, 4)]  # nodes, ranks per node


def worker(rank, world, kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(96, 96, bias=False) for _ in range(24)]).to(torch.bfloat16)
    opt = qzero.ZeroOptimizer(model, functools.partial(torch.optim.AdamW, lr=1e-3), config=qzero.ZeroConfig(**kw))
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        opt.backward(model(torch.randn(4, 96, generator=g).to(torch.bfloat16)).float().pow(2).mean())
        opt.step()
        opt.zero_grad()
    return opt.network_bits_per_param()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="CSV to write")
    args = ap.parse_args()
    rows = []
    for nodes, rpn in TOPOLOGIES:
        for arm, kw in ARMS.items():
            row = {"nodes": nodes, "ranks_per_node": rpn, "arm": arm}
            for mode, h in (("flat", False), ("two_level", "auto")):
                bits = run_distributed(worker, nodes * rpn, dict(kw, ranks_per_node=rpn, small_param_numel=0,
                                                                 hierarchical_collectives=h))
                row[f"{mode}_bits"] = round(sum(bits) / len(bits), 3)
            rows.append(row)
            print(row, flush=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
