"""benchmarks/scripts/host_breakdown.py: what it counts, per phase, on a CPU gather-ahead run."""

import contextlib
import functools
import warnings

from _support import bench_scripts
import torch
import torch.nn.functional as F
from _support.distributed import run_distributed

import qzero


def breakdown_run(rank, world, quantized_gradients=False):
    hb_mod = bench_scripts.load("host_breakdown")
    from qzero.optim import grads
    from qzero.wire import engine, overlap, quantized_reduce

    wrapped = lambda: (engine._Inline._launch_all, engine.pack_chunk, overlap.GatherAhead._hook,  # noqa: E731
                       grads.Stage2Grads._launch, quantized_reduce.QuantizedExchange.finish)
    originals = wrapped()
    hb = hb_mod.HostBreakdown()
    hb.install()  # before the optimizer: gather-ahead binds its hooks when it is built
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)]).bfloat16()
    cfg = qzero.ZeroConfig(zero_quantized_weights=True, overlap_param_gather=True, small_param_numel=8,
                           allgather_bucket_size=world * 64 * 64,  # one Linear a chunk
                           reduce_bucket_size=2 * 64 * 64, zero_quantized_gradients=quantized_gradients)
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
    restored = wrapped() == originals
    return hb.report(2), restored


def test_the_breakdown_counts_each_phase_and_restores_what_it_wrapped():
    for report, restored in run_distributed(breakdown_run, 2):
        assert restored
        per = report["per_step"]
        fwd, step = per["fwd"], per["step"]
        # the forward overlaps the gather: its hooks run and land the chunks still in flight
        assert fwd["hook"][0] >= 6 and fwd["unpack_chunk"][0] > 0
        assert fwd["hook"][1] > 0  # milliseconds
        # step() starts the gather and launches every chunk there (inline schedule), none from the forward
        assert step["launch_all"][0] >= 1 and step["pack_chunk"][0] >= 2
        assert "launch_all" not in fwd and "pack_chunk" not in fwd
        # nothing of the gather runs in the backward (it waited for the whole gather first)
        assert "pack_chunk" not in per["bwd"]
        for phase in ("fwd", "bwd", "step"):
            assert per[phase]["num_device_alloc"] == [0.0, 0.0]  # no CUDA here
        # the synchronizing call is recorded once, the other warning not at all
        assert list(report["syncs"].values()) == [1]
        assert next(iter(report["syncs"])).startswith("called a synchronizing CUDA operation @")


def test_the_breakdown_counts_the_gradient_reduction_in_the_backward():
    """Stage 2's hooks, bucket launches and finishes are counted in the backward; the quantized
    exchange's launch and finish only with quantized gradients (inside them: its calls never
    outnumber the launches)."""
    for quantized in (False, True):
        for report, restored in run_distributed(functools.partial(breakdown_run, quantized_gradients=quantized), 2):
            assert restored
            bwd = report["per_step"]["bwd"]
            assert bwd["grad_hook"][0] >= 12  # a weight and a bias per Linear
            assert bwd["reduce_launch"][0] >= 3 and bwd["reduce_finish"][0] >= 1
            assert bwd["reduce_launch"][1] > 0
            if quantized:
                assert 1 <= bwd["quantized_launch"][0] <= bwd["reduce_launch"][0]
                assert 1 <= bwd["quantized_finish"][0] <= bwd["reduce_finish"][0]
            else:
                assert "quantized_launch" not in bwd and "quantized_finish" not in bwd
            assert "grad_hook" not in report["per_step"]["fwd"]
