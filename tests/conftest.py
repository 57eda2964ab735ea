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

import distributed  # noqa: E402,F401 - its import asks py-cpuinfo once for the whole process (ask_cpuinfo_once)
