"""Processes qzero starts die with their parent when it is SIGKILLed (qzero.app.orphans), each
mechanism on its own: the kernel's parent-death signal, and the polling thread."""

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

CHILD = """
import sys, time
from qzero.app.orphans import die_with_parent
die_with_parent(int(sys.argv[1]), use_prctl=sys.argv[2] == "prctl", poll=float(sys.argv[3]))
print("ready", flush=True)
time.sleep(600)
"""

PARENT = """
import subprocess, sys, os, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid()), sys.argv[2], sys.argv[3]],
                         stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "ready"
print(child.pid, flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    """Running (a zombie nobody reaps yet counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_dead(pids, timeout: float) -> list[int]:
    """The pids still alive after ``timeout`` seconds (SIGKILLed then, so none is left behind)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    left = [p for p in pids if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    return left


@pytest.mark.parametrize("mechanism, poll", [("prctl", 600.0), ("polling", 0.2)])
def test_a_child_dies_when_its_parent_is_sigkilled(mechanism, poll):
    """With prctl the poll is 600 s, so only the kernel's signal can end the child in time;
    without it, only the polling thread can."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, mechanism, str(poll)], stdout=subprocess.PIPE,
                              text=True)
    try:
        child = int(parent.stdout.readline())
    except ValueError:
        parent.kill()
        raise
    assert alive(child)
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=30)
    assert wait_dead([child], timeout=60) == [], f"the child of a SIGKILLed parent kept running ({mechanism})"


def test_a_child_whose_parent_is_already_gone_ends_at_once():
    res = subprocess.run([sys.executable, "-c", CHILD, "1", "polling", "600"], capture_output=True, text=True,
                         timeout=60)  # pid 1 is not its parent: as if the parent died while it started
    assert res.returncode == -signal.SIGKILL and "ready" not in res.stdout
