"""Processes that qzero starts die with the process that started them.

``qzero train`` starts its ranks; ``qzero qualify`` starts one process per arm, which starts
the ranks. When the starting process is killed outright (SIGKILL: what an out-of-memory kill
or a CI timeout sends), nothing in it runs to stop what it started, and its ranks would train
on, reparented, holding CPU and memory. So each started process calls :func:`die_with_parent`
first thing:

* on Linux the kernel sends it SIGKILL when its parent exits (``prctl(PR_SET_PDEATHSIG)``,
  through ctypes);
* everywhere, a daemon thread polls ``os.getppid()`` and kills the process when the parent
  it was started by is gone (the fallback where prctl is missing or refused);
* a parent that is already gone when it is called (it died while the child started) ends the
  child at once.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
POLL_SECONDS = 1.0


def die_with_parent(parent: int, *, use_prctl: bool = True, poll: float = POLL_SECONDS) -> None:
    """End this process (SIGKILL) when the process ``parent`` (its parent's pid as the parent
    saw it: ``os.getpid()`` there) exits. ``use_prctl=False`` leaves only the polling thread."""
    if use_prctl and sys.platform.startswith("linux"):
        _arm_parent_death_signal()
    if os.getppid() != parent:  # gone before the signal was armed: reparented already
        _die()
    threading.Thread(target=_watch, args=(parent, poll), name="qzero-parent-watch", daemon=True).start()


def _arm_parent_death_signal() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):  # no libc prctl here: the polling thread still watches
        return False


def _watch(parent: int, poll: float) -> None:
    while os.getppid() == parent:
        time.sleep(poll)
    _die()


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
