"""Where a whole training step's time goes, per arm, on 2 GPUs (torchrun --nproc_per_node=2).

On one GPU, ``python3 benchmarks/scripts/step_profile.py --fake-world 2`` times rank 0 of DP2 under torch's
fake process group: each arm's own kernels, host launches and sharded update without any
link (collectives return at once; the values are meaningless, the work is not), beside the
1-GPU compute-only step (``--fake-world 1``).

For each arm (plain / int8 / int8 + gather-ahead, deterministic kernels on and off) the
same Qwen3-shaped model trains a few steps back to back (no synchronisation between
them, so a gather that runs ahead lands in the next forward, as in training); CUDA
events on the compute stream split each step into forward, backward and ``step()``,
"total" runs from one forward's start to the next, and the host time spent inside
the forward, the backward and ``step()`` is recorded (host time close to the device time:
the host is what the step waits for). With ``--profile``, one more step of each arm is
profiled with torch.profiler and the top operations by host and by device time are
printed (rank 0); with ``--cprofile``, one more step under cProfile, its Python functions
listed by their own host time (where a host-bound phase's time goes: qzero's, DeepSpeed's,
torch's or the emulated collectives' Python).

``int8_ahead_nowait`` is a ceiling, not a product setting: gather-ahead whose forward
pre-hooks enqueue the gather's chunks as usual but never make the forward wait for them
(the forward reads weights while they are overwritten: its results are meaningless; the
whole gather is waited for after the forward, by the backward). Its forward time is the
forward's compute under the gather's contention with no dependency stalls. The hooks are
patched here, in the benchmark, for that arm only.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist

from qzero.app.backends import make_backend
from qzero.app.train import make_deterministic, settings_from
from qzero.app.workload import build_model, global_batch, load_corpus, model_config

try:
    from host_breakdown import HostBreakdown
except ImportError:  # loaded from elsewhere (tests load bench scripts by path)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from host_breakdown import HostBreakdown

ARMS = {
    "plain": {},
    "int8": {"quantized": True, "overlap": False},
    "int8_ahead": {"quantized": True, "overlap": True},
    "plain_ahead": {"overlap": True},
    # the same gather-ahead with one optimizer setting changed (ZeroConfig fields)
    "int8_ahead_inline": {"quantized": True, "overlap": True, "gather_schedule": "inline"},
    "int8_ahead_whole": {"quantized": True, "overlap": True, "sliced_update": False},
    # quantized gradient reduction on top of INT8 + gather-ahead
    "int8_ahead_qgrad": {"quantized": True, "overlap": True, "zero_quantized_gradients": True},
    "plain_qgrad": {"zero_quantized_gradients": True},
    # INT4 gradients (their default group of 256 and rotation)
    "int8_ahead_qgrad4": {"quantized": True, "overlap": True, "zero_quantized_gradients": True,
                          "zero_quantized_gradients_format": "int4"},
    # the same with each plain 16-bit gradient sum added into the fp32 shard as it arrives,
    # not through the landing shard (patched here: the landing shard has no switch)
    "int8_ahead_direct": {"quantized": True, "overlap": True},
    "plain_direct": {},
    # timing only: the forward never waits for the gather (see the module note)
    "int8_ahead_nowait": {"quantized": True, "overlap": True},
    # diagnosis only: gather-ahead whose waits run under torch.no_grad() (see NO_GRAD_WAITS)
    "int8_ahead_nograd": {"quantized": True, "overlap": True},
    # gather-ahead enqueuing 4 chunks past the one waited for, from the forward's waits
    # (ZeroConfig.gather_lookahead; the default 0 enqueues every chunk in step())
    "int8_ahead_lazy": {"quantized": True, "overlap": True, "gather_lookahead": 4},
    "delta_ahead": {"quantized": True, "overlap": True, "zero_quantized_weights_delta": True},
    "delta": {"quantized": True, "overlap": False, "zero_quantized_weights_delta": True},
    # PyTorch FSDP2, plain and with qzero.fsdp's quantized gather, both reshard modes
    "fsdp2": {"backend": "fsdp2"},
    "fsdp2_int8": {"backend": "fsdp2", "quantized": True},
    "fsdp2_rs": {"backend": "fsdp2", "reshard_after_forward": True},
    "fsdp2_rs_int8": {"backend": "fsdp2", "reshard_after_forward": True, "quantized": True},
    "fsdp2_rs_gint8": {"backend": "fsdp2", "reshard_after_forward": True, "quantized": True, "fsdp_quantize": "group"},
    # DeepSpeed ZeRO-2, the adapter with INT8 + gather-ahead, and with its quantized gradient reduction
    "deepspeed": {"backend": "deepspeed"},
    "ds_int8_ahead": {"backend": "deepspeed", "quantized": True, "overlap": True},
    "ds_int8_ahead_qgrad": {"backend": "deepspeed", "quantized": True, "overlap": True,
                            "zero_quantized_gradients": True},
    "ds_int8_ahead_lazy": {"backend": "deepspeed", "quantized": True, "overlap": True, "gather_lookahead": 4},
    "ds_int8_ahead_qgrad_lazy": {"backend": "deepspeed", "quantized": True, "overlap": True,
                                 "zero_quantized_gradients": True, "gather_lookahead": 4},
}
#: Arms whose forward pre-hooks enqueue the gather without waiting for it.
NO_WAIT = {"int8_ahead_nowait"}
#: Arms whose gather-ahead waits (forward pre-hooks, parameter reads) run under torch.no_grad()
#: (patched here: a diagnosis of what the autograd-enabled forward adds to a chunk's launch).
NO_GRAD_WAITS = {"int8_ahead_nograd"}
#: Arms whose stage-2 reducers add each sum straight into the fp32 shard (no landing shard).
DIRECT_ADD = {"int8_ahead_direct", "plain_direct"}


@contextlib.contextmanager
def forward_never_waits():
    """Gather-ahead's forward pre-hooks enqueue chunks as ``wait_until`` does but do not make
    the compute stream wait; everything else (the backward's wait for the whole gather,
    ``wait_for_weights``) waits as usual. Must wrap the backend's construction: the hooks
    are bound when they are registered."""
    from qzero.wire import engine, overlap

    hook, wait_for, wait_until = overlap.GatherAhead._hook, overlap.GatherAhead.wait_for, engine._Streamed.wait_until
    inside = [False]

    def enqueue_only(self, chunk_index):
        if not inside[0]:
            return wait_until(self, chunk_index)
        n = len(self.plan.chunks)
        last = min(min(chunk_index, n - 1) + self._lookahead, n - 1)
        if self._enqueued <= last:
            self._enqueue_through(last)

    def no_wait(method):
        def wrapper(*args):
            inside[0] = True
            try:
                return method(*args)
            finally:
                inside[0] = False

        return wrapper

    # Both ways a forward waits: its modules' pre-hooks and its reads of parameters.
    overlap.GatherAhead._hook, overlap.GatherAhead.wait_for = no_wait(hook), no_wait(wait_for)
    engine._Streamed.wait_until = enqueue_only
    try:
        yield
    finally:
        overlap.GatherAhead._hook, overlap.GatherAhead.wait_for = hook, wait_for
        engine._Streamed.wait_until = wait_until


@contextlib.contextmanager
def waits_without_grad():
    """Gather-ahead's forward pre-hooks and parameter reads run under ``torch.no_grad()``
    (must wrap the backend's construction, as :func:`forward_never_waits`)."""
    from qzero.wire import overlap

    hook, wait_for = overlap.GatherAhead._hook, overlap.GatherAhead.wait_for

    def no_grad(method):
        def wrapper(*args):
            with torch.no_grad():
                return method(*args)

        return wrapper

    overlap.GatherAhead._hook, overlap.GatherAhead.wait_for = no_grad(hook), no_grad(wait_for)
    try:
        yield
    finally:
        overlap.GatherAhead._hook, overlap.GatherAhead.wait_for = hook, wait_for


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-1.7b")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--arms", default="plain,int8,int8_ahead")
    ap.add_argument("--deterministic", default="1", help="1, 0 or 1,0 (both)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-rows", type=int, default=14, metavar="N",
                    help="operations listed by host and by device time with --profile")
    ap.add_argument("--cprofile", action="store_true",
                    help="one more step of each arm under cProfile: the Python functions with the most time of "
                         "their own")
    ap.add_argument("--host-breakdown", action="store_true",
                    help="per phase: host time of the gather's launches, packs, unpacks, hooks and reads; "
                         "synchronizing CUDA calls; allocator device allocations/frees/retries; gc (see HostBreakdown)")
    ap.add_argument("--allgather-bucket-size", type=float, default=5e8, help="ZeroConfig.allgather_bucket_size")
    ap.add_argument("--reduce-bucket-size", type=float, default=5e7, help="ZeroConfig.reduce_bucket_size")
    ap.add_argument("--out", default=None)
    ap.add_argument("--fake-world", type=int, default=0, metavar="N",
                    help="one process as rank 0 of N under torch's fake process group (one GPU): every arm's "
                         "local work at DP-N (its kernels, launches and update on its partition), no traffic")
    ap.add_argument("--emulated-world", type=int, default=0, metavar="N",
                    help="the same with benchmarks/scripts/emulated_link.py's collectives on no link: every output "
                         "written (each rank sends what rank 0 sends), so quantized payloads decode (delta gathers, "
                         "DeepSpeed's gradients) at the host cost of an emulated call")
    ap.add_argument("--link", default="none",
                    help="with --emulated-world: the link (benchmarks/scripts/emulated_link.py's text, "
                         "e.g. 'nvlink:ctas=0,time_scale=0.9534'; default none)")
    a = ap.parse_args()
    for name in a.arms.split(","):  # every arm checked before any work
        if name not in ARMS:
            raise SystemExit(f"unknown arm {name!r}: one of {', '.join(ARMS)}")
        if a.fake_world and ARMS[name].get("zero_quantized_weights_delta"):
            # the fake group's collectives leave their outputs unwritten: a delta gather then
            # adds garbage differences to the replicas and (rightly) refuses them as non-finite
            raise SystemExit(f"arm {name!r}: a delta gather needs collectives that deliver data; "
                             "--fake-world's do not (use benchmarks/scripts/emulated_matrix.py --links none)")
    if a.fake_world and a.emulated_world:
        raise SystemExit("--fake-world and --emulated-world: give one")
    if a.link != "none" and not a.emulated_world:
        raise SystemExit(f"--link {a.link!r} needs --emulated-world N")
    if a.fake_world or a.emulated_world:
        torch.cuda.set_device(0)
        from one_gpu import launcher_environment

        os.environ.update(launcher_environment(a.fake_world or a.emulated_world))
    if a.fake_world:
        from one_gpu import init_fake_world

        init_fake_world(a.fake_world)
    elif a.emulated_world:
        from emulated_link import init_emulated_world
        from emulated_matrix import decode_as_rank0

        init_emulated_world(a.emulated_world, a.link)
        decode_as_rank0()
    else:
        dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    cfg = model_config(a.preset, None, max_positions=max(4096, a.seq_len))
    corpus = load_corpus(None)
    rows = []
    for det in a.deterministic.split(","):
        if det == "1":
            make_deterministic()
        else:
            torch.use_deterministic_algorithms(False)
        for name in a.arms.split(","):
            s = settings_from(dict(preset=a.preset, world_size=world, device="cuda", seq_len=a.seq_len,
                                   micro_batch=a.micro_batch, allgather_bucket_size=int(a.allgather_bucket_size),
                                   reduce_bucket_size=int(a.reduce_bucket_size), lr=1e-4, **ARMS[name],
                                   **({"check_finite": False} if a.fake_world and "backend" not in ARMS[name] else {})))
            patch = (forward_never_waits() if name in NO_WAIT else
                     waits_without_grad() if name in NO_GRAD_WAITS else contextlib.nullcontext())
            patch.__enter__()
            hb = HostBreakdown() if a.host_breakdown else None
            if hb is not None:
                hb.install()
            backend = make_backend(s, lambda dt: build_model(cfg, dt, dev, 0), torch.bfloat16, dev)
            if name in DIRECT_ADD:
                for grads in backend.opt.grads:
                    grads.reducer.use_landing = False
            t = {"fwd": [], "bwd": [], "step": [], "total": [], "host_step": [], "host_fwd": [], "host_bwd": []}
            # No synchronisation between measured steps: a gather that runs ahead (on the
            # compute stream's NCCL side or on the side streams) must show up in the next
            # forward, as in training. A step's "total" runs from its forward's start to the
            # next forward's start on the compute stream.
            marks = []
            torch.cuda.synchronize()
            prof_step = a.steps + 1 if a.profile else None
            cprof_step = a.steps + 1 + (1 if a.profile else 0) if a.cprofile else None
            for step in range(a.steps + 1 + (1 if a.profile else 0) + (1 if a.cprofile else 0)):
                batch = global_batch(corpus, step, world * a.micro_batch, a.seq_len, 0)
                tokens = batch.view(world, a.micro_batch, -1)[rank].to(dev)
                prof = cprof = None
                if step == cprof_step:
                    torch.cuda.synchronize()
                    cprof = cProfile.Profile()
                    cprof.enable()
                if step == prof_step:
                    torch.cuda.synchronize()
                    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                              torch.profiler.ProfilerActivity.CUDA])
                    prof.__enter__()
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
                # the breakdown counts the measured steps; synchronizing calls in the first of them
                counting = (hb.counting if hb is not None and 2 <= step <= a.steps
                            else lambda phase, sync=False: contextlib.nullcontext())
                sync = step == 2
                h0 = time.perf_counter()
                ev[0].record()
                with counting("fwd", sync):
                    logits = backend.model(input_ids=tokens[:, :-1]).logits
                    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                             tokens[:, 1:].reshape(-1))
                h1 = time.perf_counter()
                ev[1].record()
                with counting("bwd", sync):
                    backend.backward(loss)
                ev[2].record()
                h2 = time.perf_counter()
                with counting("step", sync):
                    backend.step()
                h3 = time.perf_counter()
                backend.zero_grad()
                ev[3].record()
                if cprof is not None:
                    cprof.disable()
                    torch.cuda.synchronize()
                    if rank == 0:
                        text = io.StringIO()
                        pstats.Stats(cprof, stream=text).sort_stats("tottime").print_stats(a.profile_rows)
                        print(f"--- {name} det={det}: Python functions by their own host time (cProfile, one step)")
                        print(text.getvalue())
                    continue
                if prof is not None:
                    torch.cuda.synchronize()
                    prof.__exit__(None, None, None)
                    if rank == 0:
                        ka = prof.key_averages()
                        print(f"--- {name} det={det}: top host time")
                        print(ka.table(sort_by="self_cpu_time_total", row_limit=a.profile_rows,
                                       max_name_column_width=60))
                        print(f"--- {name} det={det}: top device time")
                        print(ka.table(sort_by="self_device_time_total", row_limit=a.profile_rows,
                                       max_name_column_width=60))
                    continue
                marks.append((ev, 1e3 * (h1 - h0), 1e3 * (h3 - h2), 1e3 * (h2 - h1)))
            torch.cuda.synchronize()
            # steps 0-1 warm up; the last mark only closes the step before it
            for (ev, host_fwd, host_step, host_bwd), (nxt, *_) in list(zip(marks, marks[1:]))[2:]:
                t["fwd"].append(ev[0].elapsed_time(ev[1]))
                t["bwd"].append(ev[1].elapsed_time(ev[2]))
                t["step"].append(ev[2].elapsed_time(ev[3]))
                t["total"].append(ev[0].elapsed_time(nxt[0]))
                t["host_fwd"].append(host_fwd)
                t["host_step"].append(host_step)
                t["host_bwd"].append(host_bwd)
            backend.finish()
            patch.__exit__(None, None, None)
            row = {"arm": name, "deterministic": det, **{k: statistics.median(v) for k, v in t.items()}}
            if hb is not None:
                hb.uninstall()
                row["host_breakdown"] = hb.report(a.steps - 1)
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
            del backend, logits, loss
            gc.collect()
            torch.cuda.empty_cache()
    if rank == 0:
        print(f"{'arm':18s} {'det':>3s} {'fwd':>7s} {'bwd':>7s} {'step':>7s} {'total':>7s} "
              f"{'host fwd':>9s} {'host bwd':>9s} {'host step':>9s}  (ms, medians)")
        for r in rows:
            print(f"{r['arm']:18s} {r['deterministic']:>3s} {r['fwd']:7.1f} {r['bwd']:7.1f} {r['step']:7.1f} "
                  f"{r['total']:7.1f}"
                  f" {r['host_fwd']:9.1f} {r['host_bwd']:9.1f} {r['host_step']:9.1f}")
        if a.out:
            with open(a.out, "w") as f:
                json.dump(rows, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
