"""qzero.fsdp on NCCL: every rank's unsharded weights bitwise the reference quantizer's (per
parameter and per fully_shard module, both reshard modes, bf16 and fp16), and the quantized
reduce-scatter bitwise the reference applied to all ranks' inputs."""

import os

import pytest

from _support.gpu import WORKERS, run_check


@pytest.mark.gpu(2)
def test_fsdp2_quantized_gathers_and_reduces_are_bitwise_the_reference(tmp_path):
    out = run_check(os.path.join(WORKERS, "fsdp2_check.py"), "--out", str(tmp_path), ranks=2)
    assert out.count("PASS") >= 12
