"""The training loop's step timing: no synchronisation between steps (gather-ahead keeps its overlap)."""

import math

import qzero.app.train as train
from _support.distributed import run_distributed
from qzero.app.train import TrainSettings


def loop(rank, world, settings, where=False):
    syncs, marks = [], []
    real_sync, real_mark = train._sync, train._mark
    train._sync = lambda device: (syncs.append(len(marks)), real_sync(device))[1]
    train._mark = lambda device: (marks.append(1), real_mark(device))[1]
    try:
        result = train.train_worker(settings, None, show_progress=False)
    finally:
        train._sync, train._mark = real_sync, real_mark
    return (result if rank == 0 else None), (syncs if where else len(syncs))


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


def test_the_sync_before_the_measured_steps_leaves_a_warm_up_step_after_it():
    """The device-wide sync that precedes the measured steps comes before the last warm-up
    step, not the first measured one: a gather running ahead would finish during the sync and
    the first measured step would wait for nothing (shorter than any steady-state step)."""
    import functools

    s = TrainSettings(preset="tiny", world_size=2, device="cpu", seq_len=32, micro_batch=2, steps=6, warmup=3,
                      zero={"zero_quantized_weights": True, "overlap_param_gather": True})
    (result, syncs), _ = run_distributed(functools.partial(loop, where=True), 2, s, timeout=300)
    # marks taken before each sync: none (before the loop), 2 (before step 2's mark: the last
    # warm-up step starts after it), and all 6 step marks (after the loop; the wall's end mark follows)
    assert syncs[:2] == [0, 2] and syncs[2] == 6, syncs
    assert result["wall_steps"] == 6 - 3 and len(result["step_times"]) == 6 - 3 - 1
    assert result["wall_seconds"] >= sum(result["step_times"])  # the wall holds the timed steps and the last one
