"""The training loop's step timing: no synchronisation between steps (gather-ahead keeps its overlap)."""

import math

import qzero.app.train as train
from distributed import run_distributed
from qzero.app.train import TrainSettings


def loop(rank, world, settings):
    syncs = []
    real = train._sync
    train._sync = lambda device: (syncs.append(1), real(device))[1]
    try:
        result = train.train_worker(settings, None, show_progress=False)
    finally:
        train._sync = real
    return (result if rank == 0 else None), len(syncs)


def test_steps_are_timed_start_to_start_without_a_sync_between():
    s = TrainSettings(preset="tiny", world_size=2, device="cpu", seq_len=32, micro_batch=2, steps=5, warmup=1,
                      zero={"zero_quantized_weights": True, "overlap_param_gather": True})
    (result, syncs), (_, syncs1) = run_distributed(loop, 2, s, timeout=300)
    # before the loop, before the first measured step (the wall time starts there), after: never per step
    assert syncs == syncs1 == 3
    assert result["wall_steps"] == 5 - 1 and result["wall_seconds"] > 0
    assert len(result["step_times"]) == 5 - 1 - 1  # warm-up and the last step are not timed
    assert all(t > 0 for t in result["step_times"])
    assert len(result["losses"]) == 5 and all(math.isfinite(x) for x in result["losses"])
    assert len(result["grad_norms"]) == 5 and all(math.isfinite(x) for x in result["grad_norms"])
    assert result["replicas_identical"] is True
