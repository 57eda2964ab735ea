"""Under torchrun, on the CPU: every command of ours runs correctly there or refuses in one line,
never hangs; a training loop that creates no process group is refused, not run unsharded.

Each case starts the real ``torchrun`` (``python -m torch.distributed.run``) under a timeout.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
from _support.distributed import free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT = 120  # seconds: a hang fails the test instead of the suite


def torchrun(nproc: int, *argv: str, cwd) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", HF_HUB_OFFLINE="1")
    for name in [k for k in env if k.startswith("TORCHELASTIC_")] + ["RANK", "WORLD_SIZE", "LOCAL_RANK"]:
        env.pop(name, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           *argv]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=cwd)
    except subprocess.TimeoutExpired:
        pytest.fail(f"torchrun {' '.join(argv)} did not finish within {TIMEOUT} s (a hang)")


def test_qualify_under_torchrun_is_refused_in_one_line(tmp_path):
    """qualify starts each arm's ranks itself; under torchrun it used to wait forever on the
    agent's store (TORCHELASTIC_USE_AGENT_STORE reached the ranks it started)."""
    res = torchrun(1, "-m", "qzero", "qualify", "--steps", "3", "--device", "cpu", "--out", str(tmp_path / "r"),
                   cwd=tmp_path)
    assert res.returncode != 0
    ours = [line for line in res.stderr.splitlines() if line.startswith("qzero: ")]
    assert ours == ["qzero: error: qzero qualify starts the ranks of each arm itself (--world-size, default 2), so it "
                    "does not run under torchrun (WORLD_SIZE=1 here): run qzero qualify without torchrun"], res.stderr
    assert not (tmp_path / "r").exists()


def test_train_under_torchrun_trains_on_the_launchers_ranks(tmp_path):
    res = torchrun(2, "-m", "qzero", "train", "--steps", "3", "--device", "cpu", "--out", str(tmp_path / "r.json"),
                   cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "on 2 ranks" in res.stdout and "replicas identical: True" in res.stdout, res.stdout


README_LINES = '''\
if "WORLD_SIZE" in os.environ:  # under torchrun: one process group over its ranks, so that it shards
    torch.distributed.init_process_group()
'''


def test_a_loop_without_a_process_group_is_refused_and_the_readme_lines_shard_it(tmp_path):
    """Under torchrun --nproc_per_node=2, the README's loop without its two lines would train two
    models at world size 1: ZeroOptimizer refuses, naming init_process_group; with the two lines
    (quoted from the README) both ranks shard one model."""
    assert README_LINES in (ROOT / "README.md").read_text()
    script = tmp_path / "loop.py"
    script.write_text(textwrap.dedent('''\
        import functools, os
        import torch, qzero

        def build():
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)).bfloat16()
            return model, functools.partial(torch.optim.AdamW, lr=1e-2)

        try:
            qzero.ZeroOptimizer(*build(), config=qzero.ZeroConfig(small_param_numel=0))
        except RuntimeError as e:
            print("refused:", e, flush=True)
        ''') + README_LINES + textwrap.dedent('''\
        model, adam = build()
        opt = qzero.ZeroOptimizer(model, adam, config=qzero.ZeroConfig(small_param_numel=0))
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(int(os.environ["RANK"])))
        for _ in range(3):
            opt.backward(model(x.bfloat16()).float().pow(2).mean())
            opt.step()
            opt.zero_grad()
        weights = torch.cat([p.detach().float().flatten() for p in model.parameters()])
        everyone = [torch.empty_like(weights) for _ in range(2)]
        torch.distributed.all_gather(everyone, weights)
        with open(f"rank{os.environ['RANK']}.txt", "w") as f:  # not stdout, which the ranks share
            f.write(f"world {opt.world_size} identical {torch.equal(everyone[0], everyone[1])}")
        torch.distributed.destroy_process_group()
        '''))
    res = torchrun(2, str(script), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("refused: WORLD_SIZE=2 says this job has 2 ranks") == 2, res.stdout
    assert res.stdout.count("call torch.distributed.init_process_group() before") == 2, res.stdout
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)] == ["world 2 identical True"] * 2
