"""Running a GPU check (a script that prints PASS/FAIL lines and exits non-zero on a failure)
in processes of its own, as ``torchrun`` or ``python`` would run it, for tests/gpu/."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKERS = os.path.join(ROOT, "tests", "gpu", "workers")
SCRIPTS = os.path.join(ROOT, "benchmarks", "scripts")


def run_check(script: str, *args: str, ranks: int = 1, timeout: float = 900, env: dict | None = None) -> str:
    """Run ``script`` on ``ranks`` processes (``torch.distributed.run`` when more than one) with
    this checkout's ``src`` first on the path; fail the calling test, with the output's tail,
    when it exits non-zero, prints a ``FAIL`` line or prints no ``PASS`` line. Returns the output."""
    launch = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                   f"--nproc_per_node={ranks}"]
    full_env = dict(os.environ, **(env or {}))
    full_env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), full_env.get("PYTHONPATH", "")])
    full_env.setdefault("NCCL_NVLS_ENABLE", "0")
    full_env.pop("TRITON_INTERPRET", None)  # the CPU tests' interpreter; these run the compiled kernels
    proc = subprocess.run([*launch, script, *args], cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    out = proc.stdout + proc.stderr
    lines = out.splitlines()
    failed = [line for line in lines if line.lstrip().startswith("FAIL")]
    tail = "\n".join(lines[-40:])
    assert proc.returncode == 0, f"{os.path.basename(script)} exited {proc.returncode}:\n{tail}"
    assert not failed, f"{os.path.basename(script)}: {len(failed)} FAIL line(s):\n" + "\n".join(failed[:20])
    assert any("PASS" in line for line in lines), f"{os.path.basename(script)} checked nothing:\n{tail}"
    return out
