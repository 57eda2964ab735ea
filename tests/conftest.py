import os
import sys

# Tests import helpers from this folder (tests/distributed.py).
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are built from configs; never reach for a hub

# Triton reads TRITON_INTERPRET when it is first imported: without a GPU, set it before
# any test module (or torch) imports Triton, so the kernel tests run on the CPU interpreter.
try:
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass


def _probe_the_cpu_once() -> None:
    """DeepSpeed asks py-cpuinfo about the CPU on every ``DeepSpeedCPUAdam`` it builds (and
    twice more to load the op), and each ask starts a Python interpreter (``cpuinfo --json``,
    over a second each on a loaded machine). The CPU does not change during a test run: ask
    once per process and hand each caller its own copy of the answer."""
    try:
        import cpuinfo
    except ImportError:
        return
    import copy
    import functools

    probe = functools.cache(cpuinfo.get_cpu_info)

    def get_cpu_info():
        return copy.deepcopy(probe())

    cpuinfo.get_cpu_info = cpuinfo.cpuinfo.get_cpu_info = get_cpu_info


_probe_the_cpu_once()
