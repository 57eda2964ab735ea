"""The two ways the benchmarks make one GPU stand for several ranks: ranks sharing one GPU
(benchmarks/scripts/one_gpu.py: every routed collective against gloo on CPU copies, sync and
async) and the link emulator (benchmarks/scripts/emulated_link.py --check: every emulated
collective delivers rank 0's view and holds the link for its modelled time; its cluster,
benchmarks/scripts/emulated_cluster.py --check: each scope held for its two-tier charge, the
intra-node link and the NICs held apart)."""

import os

import pytest

from _support.gpu import SCRIPTS, run_check


@pytest.mark.gpu(1)
def test_ranks_sharing_one_gpu_get_gloos_values():
    run_check(os.path.join(SCRIPTS, "one_gpu.py"), ranks=2)


@pytest.mark.gpu(1)
@pytest.mark.parametrize("world", [2, 8])
def test_the_emulated_link_delivers_and_holds_as_modelled(world):
    run_check(os.path.join(SCRIPTS, "emulated_link.py"), "--check", "--world", str(world))


@pytest.mark.gpu(1)
def test_the_emulated_cluster_holds_each_scope_for_its_charge():
    run_check(os.path.join(SCRIPTS, "emulated_cluster.py"), "--check", "--device", "cuda")
