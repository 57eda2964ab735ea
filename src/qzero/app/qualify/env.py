"""What a report records about where it ran: versions, device, link regime, date."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys

import torch


def link_regime(device: str) -> str:
    if device != "cuda":
        return "gloo over loopback (one host, CPU)"
    p2p = os.environ.get("NCCL_P2P_DISABLE") == "1"
    shm = os.environ.get("NCCL_SHM_DISABLE") == "1"
    if p2p and shm:
        return "Ethernet-class (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1)"
    if p2p:
        return "PCIe-class (NCCL_P2P_DISABLE=1)"
    return "default NCCL transport (NVLink where present)"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def describe(device: str) -> dict:
    from ... import __version__

    info = {
        "command": " ".join(shlex.quote(a) for a in ["qzero", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "qzero": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "link_regime": link_regime(device),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device == "cuda":
        info.update(
            device=torch.cuda.get_device_name(0),
            cuda=torch.version.cuda,
            nccl=".".join(str(v) for v in torch.cuda.nccl.version()),
            driver=_driver(),
            process_group_backend="nccl",
        )
    else:
        info.update(device=_cpu_name(), process_group_backend="gloo", cpu_count=os.cpu_count())
    return info
