"""bench/host_breakdown.py: what it counts, per phase, on a CPU gather-ahead run."""

import contextlib
import functools
import warnings

import bench_scripts
import torch
import torch.nn.functional as F
from distributed import run_distributed

import qzero


def breakdown_run(rank, world):
    hb_mod = bench_scripts.load("host_breakdown")
    from qzero.wire import engine, overlap

    originals = (engine._Inline._pump, engine.pack_chunk, overlap.GatherAhead._hook)
    hb = hb_mod.HostBreakdown()
    hb.install()  # before the optimizer: gather-ahead binds its hooks when it is built
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)]).bfloat16()
    cfg = qzero.ZeroConfig(zero_quantized_weights=True, overlap_param_gather=True, small_param_numel=8,
                           allgather_bucket_size=world * 64 * 64)  # one Linear a chunk
    opt = qzero.ZeroOptimizer(model, functools.partial(torch.optim.AdamW, lr=1e-3), config=cfg)
    x = torch.randn(4, 64).bfloat16()
    for step in range(3):
        with hb.counting("fwd", sync=step == 0) if step else contextlib.nullcontext():
            loss = F.mse_loss(model(x).float(), torch.zeros(4, 64))
            # what torch.cuda.set_sync_debug_mode(1) warns at a synchronizing call (a stand-in
            # on the CPU), once; and a warning of another kind, which is no sync
            warnings.warn("called a synchronizing CUDA operation" if step == 1 else "something else")
        with hb.counting("bwd") if step else contextlib.nullcontext():
            opt.backward(loss)
        with hb.counting("step") if step else contextlib.nullcontext():
            opt.step()
        opt.zero_grad()
    opt.wait_for_weights()
    hb.uninstall()
    restored = (engine._Inline._pump, engine.pack_chunk, overlap.GatherAhead._hook) == originals
    return hb.report(2), restored


def test_the_breakdown_counts_each_phase_and_restores_what_it_wrapped():
    for report, restored in run_distributed(breakdown_run, 2):
        assert restored
        per = report["per_step"]
        fwd, step = per["fwd"], per["step"]
        # the forward overlaps the gather: its hooks run and launch chunks (inline schedule)
        assert fwd["hook"][0] >= 6 and fwd["pump"][0] > 0 and fwd["pack_chunk"][0] > 0
        assert fwd["hook"][1] > 0  # milliseconds
        # step() starts the gather: its first chunks are launched there
        assert step["pack_chunk"][0] >= 1
        # nothing of the gather runs in the backward (it waited for the whole gather first)
        assert "pack_chunk" not in per["bwd"]
        for phase in ("fwd", "bwd", "step"):
            assert per[phase]["num_device_alloc"] == [0.0, 0.0]  # no CUDA here
        # the synchronizing call is recorded once, the other warning not at all
        assert list(report["syncs"].values()) == [1]
        assert next(iter(report["syncs"])).startswith("called a synchronizing CUDA operation @")
