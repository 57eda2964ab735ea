"""Every Triton kernel variant the launchers use compiles for an NVIDIA target (sm_90).

The kernel tests run Triton's interpreter on CPU, which executes a kernel as Python and
cannot see compile-time errors; a GPU run once found fp32-source kernels that did not
compile. This compiles them here, through ptxas, with no GPU (``kernel_compile.py``)."""

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")


def test_kernels_compile_for_sm90():
    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("this Triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "_support", "kernel_compile.py")
    done = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) >= 30, results
    failed = {k: v for k, v in results.items() if v != "ok"}
    assert not failed, "\n\n".join(f"{k}:\n{v}" for k, v in failed.items())
