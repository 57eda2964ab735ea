"""Copy-engine collectives (ZeroConfig.copy_engine_collectives): detection, the refusal on gloo
and the same bits at world 1 on one GPU; on two, the training run bitwise equal with and
without the setting."""

import os

import pytest

from _support.gpu import WORKERS, run_check

SCRIPT = os.path.join(WORKERS, "copy_engine_check.py")


@pytest.mark.gpu(1)
def test_copy_engine_collectives_on_one_gpu():
    run_check(SCRIPT)


@pytest.mark.gpu(2)
def test_copy_engine_collectives_give_the_same_bits_on_two_gpus():
    run_check(SCRIPT, ranks=2)
