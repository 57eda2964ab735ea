"""The CUDA-only kernel tests of tests/ (compiled Triton kernels bitwise the torch reference), in a
pytest of their own without the CPU interpreter, none of them skipped for want of a GPU."""

import os
import subprocess
import sys

import pytest

from _support.gpu import ROOT

KERNEL_TESTS = ["tests/test_triton.py", "tests/test_delta_kernels.py", "tests/test_grad_quant.py",
                "tests/test_engine_streams.py"]


@pytest.mark.gpu(1)
def test_the_kernel_tests_pass_on_cuda():
    pytest.importorskip("triton")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *KERNEL_TESTS],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "needs a CUDA device" not in out, "a kernel test was skipped for want of a GPU:\n" + out[-3000:]
