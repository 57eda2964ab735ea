"""The whole-step matrix on one GPU over an emulated link (``benchmarks/scripts/emulated_link.py``).

What ``benchmarks/scripts/run_matrix.sh`` / ``benchmarks/scripts/overlap_sweep.sh`` measure on two GPUs, here on one:
arms x models x gather buckets x reduce buckets x links, each run rank 0 of a fake DP-N
world (``--world-size``) whose collectives hold an emulated link. Every arm of every
(model, buckets) cell runs in a fresh process once per round; rounds are order-balanced
(odd rounds reversed); inside one arm's process the links run one after another, each for
``--steps`` steps back to back (the first ``--warmup`` warm up; then ``wall ms/step`` is the
measured steps between two device-wide synchronizations, and the per-step medians are
timed on the compute stream as in ``qzero bench steps`` (``qzero.app.benchmarks.steps``)), the
link order reversed in odd rounds too. ``--budget`` seconds: no run starts that would not end inside it (a cut run
leaves what it measured).

    python3 benchmarks/scripts/emulated_matrix.py --presets qwen3-4b --allgather-bucket-sizes 5e7 \\
        --reduce-bucket-sizes 2.6e7 \\
        --links pcie,ethernet --world-size 2 --steps 6 --warmup 2 --rounds 1 \\
        --arm gpu1:world_size=1 --arm plain: --arm int8_ahead:quantized=true,overlap=true \\
        --arm fsdp2:backend=fsdp2 --reference plain --peers fsdp2 --out OUT

Writes ``OUT/PRESET_agAG_rsRS/LINK/matrix.{json,md}`` and ``steps.png`` (``qzero bench steps``
(``qzero.app.benchmarks.steps``)'s
tables and plot, titled "emulated link"), and ``OUT/summary.{json,md}``: per cell, link and arm
the median and wall step, the exposed communication against the ``world_size=1`` arm when
there is one, and the link's modelled and measured busy time per step. Every figure is of an
emulated link.

With ``--nodes N`` (and ``qzero plan``'s other cluster flags: ``--gpus-per-node``,
``--intra-gbps``, ``--inter-gbps``, ``--intra-latency-us``, ``--inter-latency-us``, ``--nic``)
the world is a cluster of ``N x L`` ranks (``benchmarks/scripts/emulated_cluster.py``): every
collective is charged by the cluster cost model for its whole group and held on the cluster's
two links; ``--links`` then gives only contention and time scale (regime ``none`` with keys,
default ``none``) and, with the keys ``intra_gbps``, ``inter_gbps``, ``intra_latency_us``,
``inter_latency_us`` and ``nic``, another fabric for the same nodes (``none,none:intra_gbps=290;
inter_gbps=25;nic=rail``: each arm's process measures an Ethernet and a RoCE cluster); every arm
gets ``ranks_per_node = L`` (``hierarchical_collectives=false``
makes an arm flat) and an arm with ``world_size=1`` is the one-GPU floor, with no link. A
record's ``link_busy_ms_modelled`` is then the busier link's, and ``link_per_step`` has the
bytes every node together sent across the network (``nic_sent``) and inside nodes
(``intra_sent``). Folders and tables name the cluster (``cluster_2x4_shared_intra25.2_inter12.5``).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

#: Fields of a run record that are per link (the rest are the arm's, once per process).
PER_LINK = ("step_times", "wall_seconds", "wall_steps", "losses", "skipped_steps", "finite", "link", "link_model",
            "cluster", "link_per_step", "link_busy_ms_modelled", "link_busy_ms_measured", "peak_allocated_bytes",
            "peak_reserved_bytes", "timeline", "step_started_unix")


# ---------------------------------------------------------------------- one arm, in its own process


def _measure(backend, s, world, device, corpus, first_step: int, timeline: bool = False) -> dict:
    """``s.steps`` training steps back to back on the current link; the timing of
    ``qzero.app.train.train_worker`` (per step on the compute stream, and the wall time of the
    steps after the warm-up between two synchronizations). ``timeline``: also stamp each step's
    phases and join them with the link's transfers (``benchmarks/scripts/emulated_timeline.py``'s note) into
    ``rec["timeline"]``."""
    import torch

    from qzero.app.train import _mark, _seconds, _sync
    from qzero.app.workload import global_batch

    from emulated_link import totals_since
    from emulated_timeline import BACKWARD_END, FORWARD_END, START, STEP_END, StepStamps

    link = world.link
    n = world.world
    per_step = n * s.micro_batch * s.grad_accum
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    marks, loss_sums, skipped, started = [], [], 0, []
    wall_start, before, first_index, busy = None, link.snapshot(), link.count, dict(link.busy)
    pauses = _HostPauses()
    stamps = StepStamps(link, device, s.steps) if timeline else None
    _sync(device)
    for k in range(s.steps):
        if k == s.warmup:
            _sync(device)
            wall_start, before, first_index, busy = time.perf_counter(), link.snapshot(), link.count, dict(link.busy)
            pauses.start(device)
        batch = global_batch(corpus, first_step + k, per_step, s.seq_len, s.seed)
        mine = batch.view(s.grad_accum, n, s.micro_batch, -1)[:, 0].to(device)
        marks.append(_mark(device))
        started.append(time.time())
        if stamps:
            stamps.mark(k, START)
        loss_sum = torch.zeros((), device=device, dtype=torch.float32)
        for m in range(s.grad_accum):
            tokens = mine[m]
            logits = backend.model(input_ids=tokens[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)) / s.grad_accum
            if stamps and m == s.grad_accum - 1:
                stamps.mark(k, FORWARD_END)
            backend.backward(loss)
            loss_sum += loss.detach()
        if stamps:
            stamps.mark(k, BACKWARD_END)
        skipped += not backend.step()
        backend.zero_grad()
        if stamps:
            stamps.mark(k, STEP_END)
        loss_sums.append(loss_sum)
    _sync(device)
    wall = time.perf_counter() - wall_start if wall_start is not None else None
    host_pauses = pauses.stop(device)
    measured = s.steps - s.warmup
    times = [_seconds(a, b) for a, b in zip(marks, marks[1:])][s.warmup:]
    losses = torch.stack(loss_sums).tolist()
    per_op = totals_since(link, before)
    busy_modelled = link.busiest_since(busy)  # one link: every transfer's; a cluster: its busier link's
    log = [(i, a, b) for i, a, b in link.device_log() if i >= first_index]
    busy_measured = sum(b - a for _, a, b in log) / 1e6 if log else None
    rec = {
        "step_times": times,
        "wall_seconds": wall,
        "wall_steps": measured,
        "losses": losses,
        "skipped_steps": skipped,
        "finite": all(x == x and abs(x) != float("inf") for x in losses),
        "link": link.describe(),
        "link_model": dataclasses.asdict(link.model),
        "cluster": dataclasses.asdict(link.cluster) if hasattr(link, "cluster") else None,
        "link_per_step": {op: {k: v / measured for k, v in d.items()} for op, d in per_op.items()},
        "link_busy_ms_modelled": 1e3 * busy_modelled / measured,
        "link_busy_ms_measured": busy_measured / measured if busy_measured is not None else None,
        "host_pauses": host_pauses,
        # when each measured step was enqueued (host, Unix seconds): to line steps up with a
        # clock or power log of the GPU (nvidia-smi dmon -o T) taken beside the run
        "step_started_unix": started[s.warmup:-1] if len(started) > s.warmup else [],
    }
    if stamps:
        rec["timeline"] = stamps.record(first=s.warmup)
    if device.type == "cuda":
        rec["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        rec["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    return rec


class _HostPauses:
    """What can stall a step from the host, counted over the measured steps: Python's garbage
    collections (how many, by generation, and their seconds) and the CUDA caching allocator's
    device allocations, frees and out-of-memory retries (a free synchronizes the device)."""

    KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries")

    def __init__(self):
        self.collections, self.seconds, self._t, self._before = [0, 0, 0], 0.0, None, None

    def _gc(self, phase, info):
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            self.collections[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._t

    def start(self, device):
        import gc

        import torch

        gc.callbacks.append(self._gc)
        if device.type == "cuda":
            stats = torch.cuda.memory_stats(device)
            self._before = {k: stats.get(k, 0) for k in self.KEYS}

    def stop(self, device):
        import gc

        import torch

        if self._gc in gc.callbacks:
            gc.callbacks.remove(self._gc)
        out = {"gc_collections": self.collections, "gc_seconds": self.seconds}
        if device.type == "cuda" and self._before is not None:
            stats = torch.cuda.memory_stats(device)
            out.update({k: stats.get(k, 0) - self._before[k] for k in self.KEYS})
        return out


def _clearing_side_channel(pack_chunk):
    """``qzero.wire.chunks.pack_chunk`` for ``qzero.wire.engine`` in an emulated world: this rank's side
    channel of exact elements is zeroed before the pack.

    On a real world every rank writes its own slot of a chunk's receive buffer, its side
    channel as long as its own count of exact elements. Here the other ranks' slots are copies
    of rank 0's, whose side channel is only as long as rank 0's count: the rest of another
    rank's would be whatever the buffer held before (a previous chunk's codes and scales read
    as bf16: NaN, say). Zeroed, it decodes as zeros. One memset of the side channel per chunk,
    on the stream of the pack (microseconds)."""

    def pack(flat, plan, chunk, rank, buf, kernels, *args, **kwargs):
        lay = chunk.payload  # None where each rank has its own layout: see _decoding_as_rank0
        if plan.quantized and lay is not None and lay.exact_numel:
            at = rank * chunk.payload_bytes + lay.exact_offset
            buf[at : at + lay.exact_numel * plan.elem_size].zero_()
        return pack_chunk(flat, plan, chunk, rank, buf, kernels, *args, **kwargs)

    return pack


def _decoding_as_rank0(unpack_chunk):
    """``qzero.wire.chunks.unpack_chunk`` for ``qzero.wire.engine`` in an emulated world: where the ranks'
    payloads of a chunk have layouts of their own (some rank has an exact group: ``PER_RANK``,
    ``[Note: exact groups]`` in qzero/layout/gather_plan.py), every slot, a copy of rank 0's, is decoded with
    rank 0's layout, group runs and side elements into its own rank's slice (decoded with another
    rank's layout, rank 0's bytes would be read as scales where they are codes: NaN, say). The
    same kernels and launches as on a real world; the tables are built once per chunk."""
    import torch

    from qzero.wire.chunks import GatherCache, exact_index
    from qzero.layout import GroupRuns, PayloadKind

    kept = GatherCache()  # for as long as the wrapper is installed

    def rank0_everywhere(plan, chunk, device):
        def make():
            w, pb, es, p = plan.world_size, chunk.payload_bytes, plan.elem_size, plan.partition_numel
            layout = plan.payload_of(chunk, 0)
            runs = GroupRuns(chunk.numel, plan.group_size, (chunk.runs[0],) * w, (layout,) * w, pb)
            idx = exact_index(plan, chunk, 0, torch.device("cpu"))
            idx = torch.empty(0, dtype=torch.int64) if idx is None else idx
            side = torch.arange(idx.numel())
            src = torch.cat([(r * pb + layout.exact_offset) // es + side for r in range(w)])
            dst = torch.cat([r * p + chunk.offset + idx for r in range(w)])
            return runs, (src.to(device), dst.to(device))

        return kept.get(plan, ("emulated: rank 0's payload everywhere", chunk.index, device), make)

    def unpack(flat, plan, chunk, rank, buf, kernels, delta=None, cache=None):
        if chunk.kind is not PayloadKind.PER_RANK:
            return unpack_chunk(flat, plan, chunk, rank, buf, kernels, delta, cache)
        runs, exact = rank0_everywhere(plan, chunk, flat.device)
        args = (buf, flat, plan.partition_numel, chunk.offset, chunk.numel, plan.world_size, None, plan.group_size,
                plan.fmt, exact)
        if plan.delta:
            kernels.unpack_delta_payloads(*args, delta.refused, runs)
        else:
            kernels.unpack_payloads(*args, runs)

    return unpack


def decode_as_rank0() -> None:
    """Patch the gather engine's pack and unpack for an emulated world (every rank's payload a
    copy of rank 0's): :func:`_clearing_side_channel` and :func:`_decoding_as_rank0`."""
    import qzero.wire.engine

    qzero.wire.engine.pack_chunk = _clearing_side_channel(qzero.wire.engine.pack_chunk)
    qzero.wire.engine.unpack_chunk = _decoding_as_rank0(qzero.wire.engine.unpack_chunk)


def run_arm_here(given: dict, links: list[str], out_path: str, timeline: bool = False,
                 cluster: dict | None = None) -> None:
    """The body of one arm's process: the emulated world first (before anything imports
    qzero, whose modules bind torch.distributed's collectives), then the engine, then each
    link in turn; rank 0's record per link, written to ``out_path`` as JSON. ``timeline``:
    each record has its step timeline (:func:`_measure`), whose table goes to the output.
    ``cluster``: the fields of a ``qzero.plan.Cluster``, whose two links every link of
    ``links`` then holds (``benchmarks/scripts/emulated_cluster.py``: regime ``none``, the
    links' keys giving contention and time scale)."""
    from emulated_link import init_emulated_world, parse_link

    fabrics = [None] * len(links)
    if cluster is not None:
        from emulated_cluster import fabric_of

        from qzero.plan import Cluster

        fabrics, links = zip(*(fabric_of(x, Cluster(**cluster)) for x in links))
    models = [parse_link(x) for x in links]
    n = int(given.get("world_size", 2))
    from one_gpu import launcher_environment

    os.environ.update(launcher_environment(n))
    if cluster is not None:
        from emulated_cluster import init_cluster_world

        world = init_cluster_world(fabrics[0], models[0])
    else:
        world = init_emulated_world(n, models[0])
    import torch

    from qzero.app.train import TrainSettings, _summary, build_backend, resolve_device

    decode_as_rank0()

    s = TrainSettings(**given)
    kind = resolve_device(s)
    device = torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
    backend, corpus = build_backend(s, device)
    records, losses, times, skipped = [], [], [], 0
    for i, (model, fabric) in enumerate(zip(models, fabrics)):
        if fabric is not None:
            world.link.set_cluster(fabric)
        world.set_link(model)
        rec = _measure(backend, s, world, device, corpus, first_step=i * s.steps, timeline=timeline)
        if timeline:
            import emulated_timeline

            print(f"{model.name}: " + emulated_timeline.table(rec["timeline"]["median"]), end="", flush=True)
            if rec["timeline"].get("note"):
                print(f"{model.name}: timeline: {rec['timeline']['note']}", flush=True)
        records.append(rec)
        losses += rec["losses"]
        times += rec["step_times"]
        skipped += rec["skipped_steps"]
    world.set_link(parse_link("none"))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    summary = _summary(s, backend, losses, [None] * len(losses), times, skipped, device, [backend.gathered_bytes()])
    backend.finish()
    # every rank holds rank 0's values here: replicas are identical by construction, not by measurement
    summary["replicas_identical"] = None
    summary["emulated_world"] = world.world
    out = [{**summary, **rec} for rec in records]
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, out_path)


def run_arm(settings, links: list[str], out_path: str, log_path: str, timeout: float,
            timeline: bool = False, cluster=None) -> list[dict]:
    """One arm in a fresh process, every link of ``links`` in that order (on ``cluster``'s
    two links where one is given); its records (with their step timelines where ``timeline``)."""
    from qzero.app.qualify.run import ArmFailed

    options = {"timeline": timeline, "cluster": dataclasses.asdict(cluster) if cluster is not None else None}
    cmd = [sys.executable, os.path.abspath(__file__), "_arm", json.dumps(dataclasses.asdict(settings)),
           json.dumps(links), out_path, json.dumps(options)]
    env = dict(os.environ)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    if code != 0 or not os.path.isfile(out_path):
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise ArmFailed(f"an emulated arm exited with {code} (log: {log_path}); last output:\n{tail}")
    with open(out_path) as f:
        return json.load(f)


# ---------------------------------------------------------------------- the matrix


def cells(presets: list[str], ag: list[float], rs: list[float]) -> list[tuple[str, float, float]]:
    return [(p, a, r) for p in presets for a in ag for r in rs]


def cells_of(plans: dict) -> list[tuple[str, float, float]]:
    """The (preset, gather bucket, reduce bucket) of each planned cell."""
    return [(base.preset, float(base.zero.allgather_bucket_size), float(base.zero.reduce_bucket_size))
            for base, *_ in plans.values()]


def cell_name(preset: str, ag: float, rs: float) -> str:
    return f"{preset}_ag{ag:g}_rs{rs:g}"


def link_dir(link: str) -> str:
    """A folder name for a link's text (``pcie:ctas=8`` -> ``pcie_ctas8``)."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in link.replace("=", "")).strip("_")


def order(names: list[str], r: int) -> list[str]:
    return list(names) if r % 2 == 0 else list(reversed(names))


#: A median below this share of the link's busy time per step is reported as lagging (the
#: busy time is modelled; the margin keeps rounding and a drained first step from flagging).
LAG_TOLERANCE = 0.98


def summarize(done: dict, floor_arm: str | None, cell_info: dict | None = None) -> dict:
    """Per cell, link and arm: median and wall step, exposed communication against the floor
    arm (median minus the floor's median), link busy per step (pure: testable). ``cell_info``:
    each cell's ``(preset, gather bucket, reduce bucket)``, copied into its rows."""
    import emulated_timeline

    rows = []
    for (cell, link), arms in done.items():
        preset, ag, rs = (cell_info or {}).get(cell, (None, None, None))
        floor = None
        if floor_arm and arms.get(floor_arm):
            ft = [t for r in arms[floor_arm] if not r.get("failed") for t in r["step_times"]]
            floor = statistics.median(ft) if ft else None
        for arm, runs in arms.items():
            ok = [r for r in runs if not r.get("failed")]
            ts = [t for r in ok for t in r["step_times"]]
            walls = [r["wall_seconds"] / r["wall_steps"] for r in ok if r.get("wall_seconds")]
            med = statistics.median(ts) if ts else None
            busy_m = [r["link_busy_ms_measured"] for r in ok if r.get("link_busy_ms_measured") is not None]
            busy = statistics.median(r["link_busy_ms_modelled"] for r in ok) if ok else None
            rows.append({
                "cell": cell, "preset": preset, "allgather_bucket": ag, "reduce_bucket": rs, "link": link,
                "arm": arm, "runs": len(ok), "failed": len(runs) - len(ok),
                "median_ms": 1e3 * med if med is not None else None,
                "wall_ms": 1e3 * statistics.median(walls) if walls else None,
                "exposed_ms": 1e3 * (med - floor) if med is not None and floor is not None else None,
                "link_busy_ms_modelled": busy,
                # a steady step is never shorter than the link's busy time per step (the footnote below)
                "lagging": bool(med is not None and busy and 1e3 * med < LAG_TOLERANCE * busy),
                "link_busy_ms_measured": statistics.median(busy_m) if busy_m else None,
                "finite": all(r.get("finite") for r in ok) if ok else None,
                "error": next((r.get("error", "")[-300:] for r in runs if r.get("failed")), None),
                "timeline": emulated_timeline.medians([x for r in ok if r.get("timeline")
                                                       for x in r["timeline"]["steps"]]),
            })
    return {"floor_arm": floor_arm, "rows": rows}


def summary_markdown(summ: dict, header: list[str]) -> str:
    f = lambda v: "—" if v is None else f"{v:.1f}"  # noqa: E731
    lines = [*header, "", "| cell | link | arm | median ms | wall ms/step | exposed ms (vs "
             f"{summ['floor_arm'] or '—'}) | link busy ms/step, modelled | measured | finite losses |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in summ["rows"]:
        if not r["runs"]:
            what = (f"FAILED: {(r['error'] or '').splitlines()[-1:]}" if r["failed"]
                    else "NOT RUN (no run finished: a budget or an interrupted run stopped first)")
            lines.append(f"| {r['cell']} | {r['link']} | {r['arm']} | {what} | | | | | |")
            continue
        med = f(r["median_ms"]) + (" (lagging: read the wall)" if r.get("lagging") else "")
        lines.append(f"| {r['cell']} | {r['link']} | {r['arm']} | {med} | {f(r['wall_ms'])} | "
                     f"{f(r['exposed_ms'])} | {f(r['link_busy_ms_modelled'])} | {f(r['link_busy_ms_measured'])} | "
                     f"{'yes' if r['finite'] else '**NO**'} |")
    if any(r.get("lagging") for r in summ["rows"]):
        lines += ["", "lagging: the median step is below the link's busy time per step, which no steady step can "
                  "be: the run's transfers fell further behind its compute every step (too few steps for the "
                  "steady state); its wall ms/step, which ends with a synchronization, is the step's time."]
    import emulated_timeline

    return "\n".join(lines) + "\n" + emulated_timeline.markdown(summ["rows"])


def build_parser():
    from qzero.app.benchmarks import steps as steps_matrix

    p = steps_matrix.build_parser()
    p.prog, p.description = "emulated_matrix.py", __doc__.split("\n\n")[0]
    e = p.add_argument_group("emulated link")
    e.add_argument("--presets", default=None, help="comma-separated presets (default: --preset)")
    e.add_argument("--allgather-bucket-sizes", default=None,
                   help="comma-separated gather buckets (default: --allgather-bucket-size)")
    e.add_argument("--reduce-bucket-sizes", default=None,
                   help="comma-separated reduce buckets (default: --reduce-bucket-size)")
    e.add_argument("--links", default=None,
                   help="comma-separated links, each REGIME or REGIME:key=value;... (';' between a link's keys), "
                        "regimes: none, pcie, ethernet, nvlink (benchmarks/scripts/emulated_link.py); default pcie, "
                        "or with --nodes none (the cluster's links; none:key=value;... for contention and time scale, "
                        "and intra_gbps, inter_gbps, intra_latency_us, inter_latency_us, nic to run the link on "
                        "another fabric of the same nodes: several fabrics in one arm's process)")
    e.add_argument("--budget", type=float, default=0, help="seconds: start no run that would not end inside it")
    e.add_argument("--arm-timeout", type=float, default=540, help="seconds per arm process (default 540)")
    e.add_argument("--resume", action="store_true",
                   help="continue the matrix already in --out: keep its runs (each arm, round and cell whose every "
                        "link has a run that did not fail), run only the rest; the arms' settings must be the same. "
                        "The whole grid then takes several invocations of one command, each within its --budget")
    e.add_argument("--timeline", action="store_true",
                   help="stamp each step's forward, backward and optimizer step on the compute stream and join them "
                        "with the link's transfers: rec['timeline'], a table in summary.md "
                        "(benchmarks/scripts/emulated_timeline.py draws it); off by default, the steps' timing as "
                        "without it")
    from emulated_cluster import add_cluster_arguments

    add_cluster_arguments(p)
    p.set_defaults(world_size=None)  # with --nodes: the cluster's; else TrainSettings'
    return p


def cluster_and_links(args) -> tuple:
    """The emulated cluster of the command line (None: one link per arm) and the links each arm
    runs; sets ``args.world_size`` where it was left out. A one-line ValueError."""
    from emulated_cluster import cluster_from_args
    from emulated_link import parse_link

    from qzero.app.train import TrainSettings

    cluster = cluster_from_args(args)
    links = split_links(args.links if args.links is not None else "none" if cluster else "pcie")
    if not links:
        raise ValueError("--links: give at least one link")
    for x in links:
        if cluster is not None:
            from emulated_cluster import fabric_of

            x = fabric_of(x, cluster)[1]
        parse_link(x)
        if cluster is not None and x.partition(":")[0].strip() != "none":
            raise ValueError(f"--links with --nodes: the cluster sets the rates and latencies; give "
                             f"none:key=value;... for contention, time scale and fabric, not {x!r}")
    if cluster is None:
        args.world_size = TrainSettings().world_size if args.world_size is None else args.world_size
    elif args.world_size is None:
        args.world_size = cluster.world
    elif args.world_size != cluster.world:
        raise ValueError(f"--world-size {args.world_size} is not the cluster's {cluster.nodes} x "
                         f"{cluster.gpus_per_node} = {cluster.world} ranks: leave it out")
    return cluster, links


def on_cluster(settings, cluster):
    """An arm's settings on ``cluster`` (None: as they are): ``ranks_per_node`` is the
    cluster's ``L`` where the arm leaves it 0 (every rank of the fake world is on one host:
    detection would find one node of every rank); a world of one rank (the one-GPU floor)
    stays as it is. A ValueError for another world size or node size."""
    if cluster is None or settings.world_size == 1:
        return settings
    L = cluster.gpus_per_node
    if settings.world_size != cluster.world:
        raise ValueError(f"world_size={settings.world_size} on a cluster of {cluster.world} ranks: leave it out "
                         "(or 1: the one-GPU floor)")
    rpn = settings.zero.ranks_per_node
    if rpn not in (0, L):
        raise ValueError(f"ranks_per_node={rpn} on a cluster of {L} GPUs per node: leave it out (it is set to {L})")
    return dataclasses.replace(settings, zero=dataclasses.replace(settings.zero, ranks_per_node=L))


def _plan_on_cluster(planned: tuple, cluster) -> tuple:
    """One cell's plan (``steps_matrix.plan``'s tuple) with every arm :func:`on_cluster`."""
    from qzero.app.benchmarks.steps import settings_diff

    base, arms, diffs, reference, peers = planned
    base, mine = on_cluster(base, cluster), {}
    for name, s in arms.items():
        try:
            mine[name] = on_cluster(s, cluster)
        except ValueError as e:
            raise ValueError(f"--arm {name}: {e}") from None
    diffs = {n: {**settings_diff(base, s), **({"env": diffs[n]["env"]} if "env" in diffs[n] else {})}
             for n, s in mine.items()}
    return base, mine, diffs, reference, peers


def link_name(link: str, cluster=None) -> str:
    """A link as folders and tables name it: its text, or on a cluster the cluster's (with the
    link's contention keys)."""
    if cluster is None:
        return link
    from emulated_cluster import cluster_label, fabric_of

    cluster, link = fabric_of(link, cluster)
    keys = link.partition(":")[2]
    return f"cluster_{cluster_label(cluster)}" + (f":{keys}" if keys else "")


def split_links(text: str) -> list[str]:
    """``pcie:ctas=8;time_scale=1.2,ethernet`` -> ``["pcie:ctas=8,time_scale=1.2", "ethernet"]``."""
    return [x.strip().replace(";", ",") for x in text.split(",") if x.strip()]


def resumed(out: str, plans: dict, links: list[str], cluster=None) -> tuple[dict, set]:
    """What an earlier invocation left in ``out`` for this matrix: its runs as ``done``
    (``{(cell, link): {arm: [records]}}``) and the set of ``(round, cell, arm)`` whose every
    link has a run that did not fail; only those runs are kept, the others run again whole. Raises
    ``ValueError`` naming the first arm whose settings differ from the planned ones (a different
    matrix in the same folder)."""
    done: dict = {(c, link): {n: [] for n in plans[c][1]} for c in plans for link in links}
    for c, (_, arms, *_rest) in plans.items():
        for link in links:
            path = os.path.join(out, c, link_dir(link_name(link, cluster)), "matrix.json")
            if not os.path.isfile(path):
                continue
            with open(path) as f:
                old = json.load(f)
            was = {a["name"]: a["settings"] for a in old.get("arms", [])}
            for name, settings in arms.items():
                if name in was and was[name] != dataclasses.asdict(settings):
                    raise ValueError(f"--resume: arm {name!r} of {c} on {link} has other settings in {path} than "
                                     "this command's; give another --out, or the same arms")
            for name, runs in old.get("runs", {}).items():
                if name in done[(c, link)]:
                    done[(c, link)][name] = [r for r in runs if not r.get("failed")]
    finished = {(r["round"], c, name) for (c, link), arms in done.items() for name, runs in arms.items() for r in runs
                if all(any(x["round"] == r["round"] for x in done[(c, other)][name]) for other in links)}
    for (c, _), arms in done.items():  # a round not finished on every link runs again whole
        for name, runs in arms.items():
            arms[name] = [r for r in runs if (r["round"], c, name) in finished]
    return done, finished


def main(argv: list[str] | None = None) -> int:
    from qzero.app.benchmarks import steps as steps_matrix
    from qzero.app.qualify.env import describe
    from qzero.app.qualify.run import ArmFailed
    from qzero.app.train import validate

    from emulated_cluster import fabric_of

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cluster, links = cluster_and_links(args)
    except ValueError as e:
        parser.error(str(e))
    presets = (args.presets or args.preset).split(",")
    ag = [float(x) for x in (args.allgather_bucket_sizes or str(args.allgather_bucket_size)).split(",")]
    rs = [float(x) for x in (args.reduce_bucket_sizes or str(args.reduce_bucket_size)).split(",")]
    # one GPU stands in for every rank: check the settings as if the world were one rank
    check = lambda s: validate(dataclasses.replace(s, world_size=1))  # noqa: E731
    plans = {}
    for preset, a, r in cells(presets, ag, rs):
        cell_args = dict(vars(args), preset=preset, allgather_bucket_size=a, reduce_bucket_size=r)
        try:
            plans[cell_name(preset, a, r)] = steps_matrix.plan(type(args)(**cell_args), check=check)
        except steps_matrix.SpecError as e:
            parser.error(str(e))
    try:
        plans = {c: _plan_on_cluster(planned, cluster) for c, planned in plans.items()}
    except ValueError as e:
        parser.error(str(e))
    args.cluster = cluster
    names = list(next(iter(plans.values()))[1])
    reference = next(iter(plans.values()))[3]
    peers = next(iter(plans.values()))[4]
    floor_arm = next((n for n, s in next(iter(plans.values()))[1].items() if s.world_size == 1), None)
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    env = describe("cuda" if args.device != "cpu" else "cpu")
    env["command"] = " ".join(shlex.quote(x) for x in [os.path.basename(sys.argv[0]), *(sys.argv[1:] if argv is None
                                                                                           else argv)])
    start = time.monotonic()
    done: dict = {(c, link): {n: [] for n in names} for c in plans for link in links}
    schedule = [(r, c, n) for r in range(args.rounds) for c in plans for n in order(names, r)]
    kept = 0
    if args.resume:
        try:
            done, finished = resumed(args.out, plans, links, cluster)
        except ValueError as e:
            parser.error(str(e))
        kept = sum(1 for x in schedule if x in finished)
        schedule = [x for x in schedule if x not in finished]
        print(f"emulated_matrix: --resume: {kept} run(s) kept from {args.out}, {len(schedule)} to run", flush=True)
    last = 0.0
    cut = False
    with tempfile.TemporaryDirectory() as tmp:
        for i, (r, c, name) in enumerate(schedule):
            remaining = args.budget - (time.monotonic() - start) if args.budget else args.arm_timeout
            if args.budget and remaining < 1.2 * last:
                print(f"emulated_matrix: budget reached, {len(schedule) - i} run(s) not started", flush=True)
                cut = True
                break
            base, arms, diffs, _, _ = plans[c]
            run_links = order(links, r)
            print(f"emulated_matrix: [{i + 1}/{len(schedule)}] round {r + 1} {c} {name} on "
                  f"{', '.join(link_name(x, cluster) for x in run_links)}",
                  flush=True)
            out = os.path.join(tmp, f"r{r}_{c}_{name}.json")
            log = os.path.join(args.out, "logs", f"r{r}_{c}_{name}.log")
            t0 = time.monotonic()
            try:
                solo = cluster is not None and arms[name].world_size == 1  # the one-GPU floor: no link
                recs = run_arm(arms[name], [fabric_of(x, cluster)[1] for x in run_links] if solo else run_links, out,
                               log, timeout=min(args.arm_timeout, max(remaining, 1)), timeline=args.timeline,
                               cluster=None if solo else cluster)
                for link, rec in zip(run_links, recs):
                    rec["round"], rec["index"] = r, kept + i
                    done[(c, link)][name].append(rec)
                    ms = 1e3 * statistics.median(rec["step_times"]) if rec["step_times"] else float("nan")
                    print(f"emulated_matrix:   {link_name(link, cluster)}: {ms:.1f} ms median, wall "
                          f"{1e3 * rec['wall_seconds'] / rec['wall_steps']:.1f} ms/step", flush=True)
                    if rec.get("timeline"):
                        import emulated_timeline

                        print(emulated_timeline.table(rec["timeline"]["median"]), end="", flush=True)
            except (ArmFailed, OSError, ValueError) as e:
                for link in run_links:
                    done[(c, link)][name].append({"failed": True, "round": r, "index": kept + i,
                                                  "error": str(e)[-3000:]})
                print(f"emulated_matrix:   FAILED: {steps_matrix._last_line(str(e))[:200]} (log {log})", flush=True)
            last = time.monotonic() - t0
            _write_all(args, plans, links, done, env, reference, peers, floor_arm, kept + i + 1, kept + len(schedule),
                       complete=i + 1 == len(schedule))
    text = _write_all(args, plans, links, done, env, reference, peers, floor_arm,
                      kept + (len(schedule) if not cut else i), kept + len(schedule), complete=not cut, plots=True)
    print(text, end="", flush=True)
    return 0 if any(not r.get("failed") for arms in done.values() for runs in arms.values() for r in runs) else 1


def _write_all(args, plans, links, done, env, reference, peers, floor_arm, runs_done, runs_total, complete,
               plots=False) -> str:
    from qzero.app.benchmarks import steps as steps_matrix

    from emulated_cluster import fabric_of
    from emulated_link import parse_link

    cluster = getattr(args, "cluster", None)
    for (c, link), arm_runs in done.items():
        base, arms, diffs, _, _ = plans[c]
        folder = os.path.join(args.out, c, link_dir(link_name(link, cluster)))
        os.makedirs(folder, exist_ok=True)
        what = "link" if cluster is None else "cluster"
        label = f"emulated {what} {link_name(link, cluster)} (one GPU, rank 0 of DP{base.world_size})"
        matrix = {
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "regime_label": label,
            "emulated_link": dataclasses.asdict(parse_link(link if cluster is None else fabric_of(link, cluster)[1])),
            "emulated_cluster": dataclasses.asdict(fabric_of(link, cluster)[0]) if cluster is not None else None,
            "settings": dataclasses.asdict(base),
            "arms": [{"name": n, "diff": diffs[n], "settings": dataclasses.asdict(s)} for n, s in arms.items()],
            "reference": reference, "peers": peers, "rounds": args.rounds,
            "environment": dict(env, link_regime=f"emulated: {parse_link_text(link, cluster)}"),
            "runs_total": runs_total, "runs_done": runs_done, "complete": complete,
            "runs": arm_runs,
            "analysis": steps_matrix.analyse(arm_runs, reference, peers, atol=args.tolerance, rtol=args.tolerance),
        }
        steps_matrix.write(matrix, folder, with_plot=plots)
    summ = summarize(done, floor_arm, {cell_name(*c): c for c in cells_of(plans)})
    for row in summ["rows"]:
        row["link"] = link_name(row["link"], cluster)
    header = [f"# Emulated-link matrix (one GPU: {env.get('device')}; every figure is of an emulated "
              f"{'link' if cluster is None else 'cluster, charged by the cluster cost model'})", "",
              f"- {env.get('date')}, torch {env.get('torch')}; {runs_done}/{runs_total} arm processes"
              f"{'' if complete else ' (incomplete)'}; links: " + "; ".join(parse_link_text(x, cluster) for x in links)]
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summ, f, indent=1)
    text = summary_markdown(summ, header)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(text)
    return text


def parse_link_text(text: str, cluster=None) -> str:
    """A link's description (on ``cluster``: the cluster's, with the link's contention)."""
    from emulated_link import parse_link

    if cluster is None:
        return parse_link(text).describe()
    from emulated_cluster import ClusterLink, fabric_of

    return ClusterLink(*fabric_of(text, cluster)).describe()


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "_arm":
        run_arm_here(json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4], **json.loads(sys.argv[5]))
        sys.stdout.flush()
        os._exit(0)  # as qzero.app.train's ranks: leave without the interpreter's finalization
    sys.exit(main())
