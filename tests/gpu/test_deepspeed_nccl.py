"""The DeepSpeed ZeRO-1/2 adapter on NCCL: with the key off bitwise plain DeepSpeed (losses, bf16
weights, fp32 masters; plain DeepSpeed twice as the determinism control), with it on within the
accuracy gates, replicas bit-identical."""

import os

import pytest

from _support.gpu import WORKERS, run_check


@pytest.mark.gpu(2)
def test_the_deepspeed_adapter_is_exact_off_and_gated_on(tmp_path):
    pytest.importorskip("deepspeed")
    run_check(os.path.join(WORKERS, "deepspeed_gpu_check.py"), "--out", str(tmp_path / "deepspeed.json"), ranks=2)
