"""docs/multi-node.md's pseudo-node command runs as written (four gloo ranks as two nodes of
two): rank 0 reports two-level collectives and the bits a node sent across the network, every
rank exits 0, and the loss falls."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from _support.distributed import run_script

ROOT = Path(__file__).resolve().parents[1]


def pseudo_node_command() -> list[str]:
    text = (ROOT / "docs" / "multi-node.md").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("torchrun --standalone"))
    argv = shlex.split(line)
    ranks = int(next(a.split("=")[1] for a in argv if a.startswith("--nproc_per_node=")))
    script = next(i for i, a in enumerate(argv) if a.endswith(".py"))
    return ranks, [str(ROOT / argv[script]), *argv[script + 1:]]


def test_the_pseudo_node_command_of_the_docs_runs(tmp_path):
    ranks, argv = pseudo_node_command()
    assert ranks == 4 and "--ranks-per-node" in argv
    results = run_script(argv, ranks, timeout=600, cwd=tmp_path)
    for rank, (code, out) in enumerate(results):
        assert code == 0, f"rank {rank} exited with {code}:\n{out[-3000:]}"
    out = results[0][1]
    assert "topology: 2 node(s) x 2 rank(s), two-level collectives" in out, out[-2000:]
    bits = float(re.search(r"across the network: (\d+\.\d+) bits", out).group(1))
    assert 3.0 < bits < 6.0, out[-2000:]  # INT4 differences + INT4 gradients: ~4.3 at two nodes
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) >= 2 and losses[-1] < losses[0], losses
