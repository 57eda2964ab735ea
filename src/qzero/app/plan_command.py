"""``qzero plan``: what each way of training would put on a cluster's links, and the step time
the cluster cost model projects (:mod:`qzero.plan`; ``docs/plan.md``). Pure arithmetic: runs on
a CPU-only machine with ``--step-ms``; ``--measure`` times the 1-GPU step on this GPU.

Registered by :func:`add_parser` and run by :func:`run` (``qzero.app.cli`` calls both).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from ..vocabulary import FLAT_ORDERS, NICS  # no torch: --help stays light

#: Node counts of the plot (1 to 128).
PLOT_NODES = (1, 2, 4, 8, 16, 32, 64, 128)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="project step time and network bits per arm on a cluster (no GPU needed)")
    m = p.add_argument_group("model")
    m.add_argument("--preset", default=None, help="model preset (default qwen3-4b): qzero train --help lists them")
    m.add_argument("--model-config", metavar="JSON", help="a transformers config JSON instead of a preset")
    m.add_argument("--micro-batch", type=int, default=2, help="sequences per rank per step (for --measure)")
    m.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (for --measure)")
    c = p.add_argument_group("cluster")
    c.add_argument("--nodes", type=int, default=8)
    c.add_argument("--gpus-per-node", type=int, default=8)
    c.add_argument("--intra-gbps", type=float, default=25.2, help="GB/s per direction of a GPU's link inside a node "
                   "(default 25.2: PCIe-class; NVLink ~290)")
    c.add_argument("--inter-gbps", type=float, default=12.5, help="GB/s per direction of a NIC (default 12.5: 100 GbE)")
    c.add_argument("--intra-latency-us", type=float, default=20.0, help="latency per step inside a node (default 20)")
    c.add_argument("--inter-latency-us", type=float, default=50.0, help="latency per step across nodes (default 50)")
    c.add_argument("--nic", choices=NICS, default="shared", help="one NIC per node (shared) or per GPU (rail)")
    s = p.add_argument_group("step")
    t = s.add_mutually_exclusive_group(required=True)
    t.add_argument("--step-ms", type=float, help="the 1-GPU compute step (forward, backward, optimizer) in ms")
    t.add_argument("--measure", action="store_true", help="time the 1-GPU step on this machine's GPU")
    s.add_argument("--allgather-bucket-size", type=float, default=None, metavar="N",
                   help="qzero's weight gather chunk, elements (default 5e8)")
    s.add_argument("--reduce-bucket-size", type=float, default=None, metavar="N",
                   help="qzero's gradient bucket, elements (default 5e8)")
    s.add_argument("--flat-order", choices=FLAT_ORDERS, default="auto",
                   help="qzero's flat order for the flat arms (default auto: as the planner picks it)")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", help="write one object per arm here")
    o.add_argument("--plot", metavar="PNG", help="plot projected step time against nodes (1 to 128) here")
    return p


def _check(args) -> None:
    """Every flag's value, before any work: a ValueError naming the flag."""
    for flag, value in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node),
                        ("--micro-batch", args.micro_batch), ("--seq-len", args.seq_len)):
        if value < 1:
            raise ValueError(f"{flag} must be a positive integer, got {value}")
    for flag, value in (("--intra-gbps", args.intra_gbps), ("--inter-gbps", args.inter_gbps),
                        ("--step-ms", args.step_ms), ("--allgather-bucket-size", args.allgather_bucket_size),
                        ("--reduce-bucket-size", args.reduce_bucket_size)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag} must be a positive number, got {value}")
    for flag, value in (("--intra-latency-us", args.intra_latency_us), ("--inter-latency-us", args.inter_latency_us)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{flag} must be a number >= 0, got {value}")
    if args.preset is not None and args.model_config:
        raise ValueError("give --preset or --model-config, not both")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None:
            folder = os.path.dirname(os.path.abspath(path))
            if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
                raise ValueError(f"{flag} {path}: not a file name in a writable directory")
    if args.measure:
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--measure times the step on a GPU and this machine has none: give --step-ms")


def _model(args):
    """``(shapes, layers, where)`` of the model, counted on the meta device."""
    import torch

    from .workload import PRESETS, WorkloadError, model_config

    preset = args.preset or ("qwen3-4b" if not args.model_config else None)
    if preset is not None and preset not in PRESETS:
        raise WorkloadError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    config = model_config(preset, args.model_config, max_positions=max(args.seq_len, 4096))
    from transformers import AutoModelForCausalLM

    where = args.model_config or f"preset {preset}"
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except Exception as e:  # a user's config transformers cannot build
        raise WorkloadError(f"{where}: transformers cannot build a causal LM from it "
                            f"({str(e).splitlines()[0][:200]})") from None
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    return shapes, getattr(config, "num_hidden_layers", 1) or 1, config, where


def _measure(config, args) -> float:
    """The 1-GPU step in seconds: forward, backward and an AdamW step of the whole model in
    bf16 at ``--micro-batch`` x ``--seq-len``, the median of 5 after 2 warm-up steps."""
    import statistics
    import time

    import torch

    from .workload import build_model

    model = build_model(config, torch.bfloat16, torch.device("cuda"), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    tokens = torch.randint(0, config.vocab_size, (args.micro_batch, args.seq_len), device="cuda")
    times = []
    for i in range(7):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(args) -> int:
    _check(args)
    from ..plan import Cluster, default_arms, predict
    from ..plan.recommend import recommend
    from ..plan.workload import workload_from_shapes

    shapes, layers, config, where = _model(args)
    cluster = Cluster(args.nodes, args.gpus_per_node, args.intra_gbps * 1e9, args.inter_gbps * 1e9,
                      args.intra_latency_us * 1e-6, args.inter_latency_us * 1e-6, args.nic)
    compute = _measure(config, args) if args.measure else args.step_ms / 1e3
    buckets = {}
    if args.allgather_bucket_size:
        buckets["allgather_bucket"] = int(args.allgather_bucket_size)
    if args.reduce_bucket_size:
        buckets["reduce_bucket"] = int(args.reduce_bucket_size)

    def workload(world: int):
        return workload_from_shapes(shapes, world, units=layers, flat_order=args.flat_order, **buckets)

    w = workload(cluster.world)
    arms = default_arms()
    rows = [predict(a, w, cluster, compute) for a in arms]
    other = None
    if args.flat_order == "auto":  # the order auto did not pick may still win (padding against overlap)
        other = workload_from_shapes(shapes, cluster.world, units=layers, **buckets,
                                     flat_order="interleaved" if w.order == "contiguous" else "contiguous")
    rec = recommend(arms, w, cluster, compute, other)
    _print(rows, w, cluster, compute, where, rec)
    if args.json:
        record = {"projection": True, "model": where, "params": w.params, "qzero_flat_order": w.order,
                  "cluster": {"nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node,
                              "intra_gbps": args.intra_gbps, "inter_gbps": args.inter_gbps, "nic": cluster.nic,
                              "intra_latency_us": args.intra_latency_us, "inter_latency_us": args.inter_latency_us},
                  "compute_step_ms": 1e3 * compute, "measured_compute": bool(args.measure),
                  "arms": [r.as_dict() for r in rows], "recommendation": rec.__dict__}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    if args.plot:
        _plot(args.plot, arms, workload, cluster, compute, where)
    return 0


def _print(rows, w, cluster, compute, where, rec) -> None:
    print(f"qzero plan (a projection from the cluster cost model, not a measurement): {where}, "
          f"{w.params / 1e9:.3g}B parameters; {cluster.describe()}; 1-GPU step {1e3 * compute:.1f} ms; "
          f"qzero's flat order {w.order}")
    width = max(44, *(len(r.arm) for r in rows))
    print(f"{'arm':{width}} {'bits/param/node':>15} {'link ms':>9} {'step ms':>9} {'efficiency':>10}")
    for r in rows:
        print(f"{r.arm:{width}} {r.bits_per_param_per_node:15.2f} {r.link_ms:9.1f} {r.step_ms:9.1f} "
              f"{r.efficiency:10.1%}")
    print(f"recommended: {rec.describe()}")


def _plot(path, arms, workload, cluster, compute, where) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("qzero: warning: matplotlib is not installed: no plot (pip install 'qzero[cli]')", file=sys.stderr)
        return
    from ..plan import predict

    fig, ax = plt.subplots(figsize=(9, 5.5))
    series = {a.name: [] for a in arms}
    for n in PLOT_NODES:
        c = cluster.with_nodes(n)
        w = workload(c.world)
        for a in arms:
            series[a.name].append(predict(a, w, c, compute).step_ms)
    for name, ys in series.items():
        ax.plot(PLOT_NODES, ys, marker="o", ls="--" if "two-level" in name else "-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"nodes of {cluster.gpus_per_node} GPUs")
    ax.set_ylabel("projected step, ms")
    ax.set_title(f"Projection, not measured: {where}, {cluster.nic} NICs {cluster.inter_rate / 1e9:.3g} GB/s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
