"""benchmarks/scripts/one_gpu.py's fake world: one process is rank 0 of a DP2 run (the layout, partition
and buckets of DP2) and trains through qzero.app.train's loop; the CPU stands in for the GPU."""

import json
import os

import pytest

from _support import bench_scripts
from _support.distributed import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
import torch.distributed as dist
from one_gpu import init_fake_world
init_fake_world(int(sys.argv[2]))
from qzero.app import backends
from qzero.app.train import TrainSettings, train_worker
seen = {}
make = backends.make_backend
def spy(*a, **k):
    e = make(*a, **k)
    g = e.opt.groups[0]
    seen.update(world=e.opt.world_size, partition=g.hi - g.lo, numel=g.layout.numel)
    return e
backends.make_backend = spy
settings = TrainSettings(preset="tiny", seq_len=32, micro_batch=2, steps=2, warmup=0, lr=1e-4,
                         world_size=int(sys.argv[2]),
                         device="cpu", zero={"zero_quantized_weights": True, "check_finite": False,
                                             "allgather_bucket_size": 200_000, "reduce_bucket_size": 100_000})
result = train_worker(settings, None, show_progress=False)
seen["steps"] = len(result["losses"]) if result else None
print("RESULT " + json.dumps(seen))
"""


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 3])  # DP2 in the slow set
def test_a_fake_world_runs_rank_0_of_dp_n(world, tmp_path):
    script = tmp_path / "fake_world.py"
    script.write_text(SCRIPT)
    (code, out), = run_script([str(script), os.path.join(ROOT, "benchmarks", "scripts"), str(world)], timeout=300)
    line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, f"exit code {code}:\n{out[-5000:]}"
    seen = json.loads(line[len("RESULT "):])
    assert seen["world"] == world and seen["partition"] * world == seen["numel"] and seen["steps"] == 2, seen


def test_fake_world_needs_a_rank():
    one_gpu = bench_scripts.load("one_gpu")
    with pytest.raises(SystemExit, match="at least 1 rank"):
        one_gpu.init_fake_world(0)
