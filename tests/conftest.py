import os

import pytest

# Tests import their helpers from the package tests/_support (``from _support import ...``).
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

from _support import distributed  # noqa: E402,F401 - its import asks py-cpuinfo once for the whole process (ask_cpuinfo_once)


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.gpu(n)``: skipped, saying why, on a host with fewer than n CUDA GPUs."""
    have = None
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        need = marker.args[0] if marker.args else 1
        if have is None:
            try:
                import torch

                have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            except ImportError:  # pragma: no cover
                have = 0
        if have < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA GPU(s), this host has {have}"))
