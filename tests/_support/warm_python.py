"""Run Python scripts as ``python script.py`` would, from an interpreter that has imported torch.

A fresh interpreter spends seconds importing torch before a script's first line, and the
tests that run many short scripts (every doc snippet, every example on two ranks) paid that
for each process. Here a *zygote* does it once: a fresh interpreter, started with the
scripts' environment, that imports torch and nothing else, then forks one copy of itself per
script. The copy takes the script's environment, working directory, arguments and output
file and runs it as the interpreter runs ``python script.py``: as ``__main__``, with
``sys.argv`` the script and its arguments, ``sys.path[0]`` the script's folder, stdin empty,
stdout and stderr into one file; an uncaught exception prints its traceback and exits 1,
``sys.exit`` gives its code, and atexit handlers and buffered output run at the end.

What differs from a fresh interpreter: torch is imported before the script's first line (the
script's own ``import torch`` finds it done), with the environment the zygote started with.
So a zygote serves only scripts whose environment is its own, but for the variables set per
script that nothing reads on import (:data:`PER_SCRIPT`); for another environment a new zygote
starts. Scripts of one call run at once (the ranks of one job), each under the same deadline;
past it they are killed (SIGKILL), and :func:`run` raises ``TimeoutError``.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import time

#: Set per script (the ranks' torchrun variables; pytest's name of the running test), and read
#: by scripts at run time, never on import: a zygote serves every value of them.
PER_SCRIPT = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "PYTEST_CURRENT_TEST"})

#: The zygote: answers ``"ready"`` once torch is imported, then reads one JSON request per
#: line on fd 0 (the scripts of one job) and answers each with one line of the children's
#: pids, then one of their exit codes (subprocess's convention: -N for a signal N).
ZYGOTE = r"""
import gc, json, os, runpy, sys

# As "python script.py" builds sys.path: the script's folder (unless PYTHONSAFEPATH), then
# PYTHONPATH's entries made absolute against the working directory (an empty one: the
# directory itself), then the rest.
# The interpreter keeps the first of repeated entries after the first one (site.removeduppaths:
# two empty PYTHONPATH entries are one directory, and a PYTHONPATH entry hides the same
# directory later in the interpreter's own part).


def first_of_each(paths):
    out = []
    for p in paths:
        if p not in out:
            out.append(p)
    return out


pythonpath = os.environ.get("PYTHONPATH", "")
entries = pythonpath.split(os.pathsep) if pythonpath else []
first = [] if sys.flags.safe_path else [""]  # "-c" puts the working directory first
rest = sys.path[len(first) + len(first_of_each(os.path.abspath(e) for e in entries)):]
sys.path[:] = first_of_each([os.path.abspath(e) for e in entries] + rest)  # the zygote's own: no working directory
requests, answers = os.dup(0), os.dup(1)
null = os.open(os.devnull, os.O_RDWR)
os.dup2(null, 0)
os.dup2(2, 1)  # nothing the zygote prints can reach the answers

import torch  # noqa: E402,F401 - the import every script here starts with

gc.freeze()  # what the zygote holds stays: no collection in a copy walks (and so copies) its pages
os.write(answers, b'"ready"\n')


def serve():
    pending = b""
    while True:
        while b"\n" not in pending:
            data = os.read(requests, 1 << 16)
            if not data:  # the test process is gone
                os._exit(0)
            pending += data
        line, pending = pending.split(b"\n", 1)
        pids = []
        for script in json.loads(line):
            pid = os.fork()
            if pid == 0:
                return script
            pids.append(pid)
        os.write(answers, (json.dumps(pids) + "\n").encode())
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        os.write(answers, (json.dumps(codes) + "\n").encode())


script = serve()
os.close(requests)
os.close(answers)
out = os.open(script["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
os.dup2(out, 1)
os.dup2(out, 2)
os.close(out)
os.close(null)
sys.stdin = open(os.devnull)  # not the zygote's stdin object, whatever it had read ahead
os.environ.clear()
os.environ.update(script["env"])
os.chdir(script["cwd"])
sys.argv = script["argv"]
folder = [os.path.dirname(os.path.abspath(sys.argv[0]))] if first else []
sys.path[:] = folder + first_of_each([os.path.abspath(e) for e in entries] + rest)
try:
    open(sys.argv[0], "rb").close()
except OSError as e:  # as the interpreter says it
    print(f"{sys.executable}: can't open file {os.path.abspath(sys.argv[0])!r}: [Errno {e.errno}] {e.strerror}",
          file=sys.stderr)
    sys.exit(2)
runpy.run_path(sys.argv[0], run_name="__main__")
"""


class Zygote:
    def __init__(self, env: dict[str, str]):
        self.key = _key(env)
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env={k: v for k, v in env.items() if k not in PER_SCRIPT})
        self.pending = b""
        if self._answer(time.monotonic() + 600) != "ready":  # a loaded machine takes long to import torch
            self.proc.kill()
            raise RuntimeError("the zygote did not import torch within 600 s")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.alive():
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _answer(self, deadline: float):
        """The next answer line, or None at the deadline."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            data = os.read(fd, 1 << 16)
            if not data:
                raise RuntimeError(f"the zygote exited with code {self.proc.wait()}")
            self.pending += data
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, scripts: list[dict], timeout: float) -> list[int]:
        self.proc.stdin.write((json.dumps(scripts) + "\n").encode())
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        pids = self._answer(time.monotonic() + 60)
        if pids is None:
            raise RuntimeError("the zygote started no script within 60 s")
        codes = self._answer(deadline)
        if codes is not None:
            return codes
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._answer(time.monotonic() + 60) is None:  # the zygote reaps them and answers
            raise RuntimeError("the zygote did not reap the scripts it was told to kill")
        raise TimeoutError


_zygote: Zygote | None = None


def _key(env: dict[str, str]) -> frozenset:
    return frozenset((k, v) for k, v in env.items() if k not in PER_SCRIPT)


def run(jobs: list[tuple[list[str], dict[str, str]]], cwd, out_dir, timeout: float) -> list[tuple[int, str]]:
    """Run each ``(argv, env)`` of ``jobs`` at once, ``argv[0]`` a script, in ``cwd``; return
    ``(exit code, stdout and stderr)`` of each. Output goes through files in ``out_dir``."""
    global _zygote
    key = _key(jobs[0][1])
    if any(_key(env) != key for _, env in jobs):
        raise ValueError("the scripts of one call must share their environment but for PER_SCRIPT variables")
    if _zygote is None or _zygote.key != key or not _zygote.alive():
        if _zygote is not None:
            _zygote.close()
        _zygote = Zygote(jobs[0][1])
    outs = [os.path.join(out_dir, f"script{i}.out") for i in range(len(jobs))]
    scripts = [dict(argv=list(argv), env=env, cwd=os.path.abspath(cwd or os.getcwd()), out=out)
               for (argv, env), out in zip(jobs, outs)]
    try:
        codes = _zygote.run(scripts, timeout)
    except RuntimeError:  # the zygote is broken: the next call starts another
        _zygote.proc.kill()
        _zygote = None
        raise
    results = []
    for code, out in zip(codes, outs):
        with open(out, errors="replace") as f:
            results.append((code, f.read()))
    return results


@atexit.register
def _close() -> None:
    if _zygote is not None:
        _zygote.close()
