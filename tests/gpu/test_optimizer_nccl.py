"""The optimizer on NCCL: gather-ahead (side streams and inline), the sliced update and delta
gathers bitwise the synchronous path, replicas bit-identical, with each stream delayed in turn."""

import os

import pytest

from _support.gpu import WORKERS, run_check

SCRIPT = os.path.join(WORKERS, "gpu_check.py")


@pytest.mark.gpu(2)
def test_gather_ahead_and_sliced_update_are_bitwise_on_two_gpus():
    run_check(SCRIPT, "--delays", ranks=2)


@pytest.mark.gpu(1)
def test_the_same_with_both_ranks_sharing_one_gpu():
    run_check(SCRIPT, "--share-gpu", "--delays", ranks=2)
