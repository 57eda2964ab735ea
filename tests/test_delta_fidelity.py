"""benchmarks/scripts/delta_fidelity.py's measures of a replica against its target: the lag along the step's
update and the share of moved elements the replica did not follow."""

import pytest
import torch

from _support import bench_scripts


def test_lag_is_how_far_behind_along_the_update():
    df = bench_scripts.load("delta_fidelity")
    u = torch.tensor([1.0, -2.0, 0.5, 0.0])
    assert df.lag(-u, u) == pytest.approx(1.0)  # the replica is where the target was a step ago
    assert df.lag(-0.25 * u, u) == pytest.approx(0.25)
    assert df.lag(torch.zeros(4), u) == 0.0
    assert df.lag(torch.tensor([0.0, 0.0, 0.0, 3.0]), u) == 0.0  # orthogonal to the update
    assert df.lag(u, torch.zeros(4)) == 0.0  # no update: nothing to lag behind


def test_a_replica_records_its_error_lag_and_held_share_each_step():
    """A target moving by a ramp, one element of the group far faster than the rest: INT4
    differences leave the slow elements behind (held) until their error reaches a quantization
    step, INT8's less often; the lag, weighted by the update, stays near 0; the closed loop
    never lets an element fall more than half a step behind."""
    df = bench_scripts.load("delta_fidelity")
    n = 64
    start = torch.zeros(n, dtype=torch.bfloat16)
    exact = torch.empty(0, dtype=torch.long)
    speeds = torch.full((n,), 1e-3)
    speeds[0] = 0.25  # one element moves far more than its group
    reps = {fmt: df.DeltaReplica(start, fmt, 64, "fp32") for fmt in ("int8", "int4")}
    for t in range(1, 41):
        target = (speeds * t).to(torch.bfloat16)
        for r in reps.values():
            r.step(target, exact)
    for r in reps.values():
        assert len(r.trace) == len(r.lags) == len(r.held) == 40
    int4, int8 = reps["int4"], reps["int8"]
    # the small movers wait for a quantization step every step under int4, every other one under int8
    assert sum(int4.held) / len(int4.held) > 0.8 and sum(int4.held) > 1.5 * sum(int8.held)
    # the lag is weighted by the update: the large mover, followed at once, keeps it near 0; the
    # slow elements' wait shows as a small lag that turns into a lead when they jump
    assert all(abs(x) < 0.05 for x in int4.lags + int8.lags)
    assert max(int4.lags) > 0.01 > max(abs(x) for x in int8.lags) and min(int4.lags) < -0.01
    step = 0.25 * 40 / 7  # the int4 quantization step of the last difference's group bounds the error
    assert float((int4.r.float() - target.float()).abs().max()) <= step / 2 + 1e-3
