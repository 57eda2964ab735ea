"""Run a function on N gloo ranks in forked processes; collect results or tracebacks.

Forking keeps start-up cheap (no re-import of torch per rank); on a machine with CUDA
the ranks are spawned instead (see :func:`run_distributed`), so a worker and its
arguments must be picklable: a module-level function, never a closure. Each rank gets a
fresh process group over a FileStore; a rank that does not finish within the
timeout fails the test instead of hanging the suite.
"""

from __future__ import annotations

import gc
import io
import multiprocessing as mp
import queue as queue_mod
import os
import tempfile
import traceback

import torch
import torch.distributed as dist


class WorkerError(AssertionError):
    pass


def ask_cpuinfo_once() -> None:
    """DeepSpeed asks py-cpuinfo about the CPU on every ``DeepSpeedCPUAdam`` it builds (and
    twice more to load the op), and each ask starts a Python interpreter (``cpuinfo --json``,
    over a second each on a loaded machine). The CPU does not change while the tests run: ask
    once per process and hand each caller its own copy of the answer. Done on import of this
    module: in the test process (so in every rank forked from it) and in every spawned rank."""
    try:
        import cpuinfo
    except ImportError:
        return
    if getattr(cpuinfo.get_cpu_info, "asked_once", False):
        return
    import copy
    import functools

    probe = functools.cache(cpuinfo.get_cpu_info)

    def get_cpu_info():
        return copy.deepcopy(probe())

    get_cpu_info.asked_once = True
    cpuinfo.get_cpu_info = cpuinfo.cpuinfo.get_cpu_info = get_cpu_info


ask_cpuinfo_once()


def _entry(fn, rank, world_size, store_path, queue, args):
    # A forked rank inherits every object of the test process (all it imported, every test
    # before): out of the collector's sight, so that a full collection (DeepSpeed runs one per
    # memory report) walks only what this rank makes.
    gc.freeze()
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size
        )
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        buf = io.BytesIO()
        torch.save(result, buf)  # plain bytes: no shared-memory handles outliving the worker
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, False, traceback.format_exc()))


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0, start_method: str = "fork"):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``start_method="spawn"`` gives each rank a fresh interpreter (slower to start; for code
    that must not inherit the test process's state; ``fn`` must then be importable)."""
    if start_method == "fork" and torch.cuda.is_available():
        # A forked child cannot use CUDA once this process has initialised CUDA's driver (and
        # torch's optimizers ask CUDA whether a graph is being captured: "CUDA error:
        # initialization error" in the child). torch.cuda.is_initialized() does not tell: it is
        # False when Triton, not torch, initialised the driver. So on a GPU machine fresh
        # interpreters it is, always; the workers are module-level functions for that.
        start_method = "spawn"
    ctx = mp.get_context(start_method)
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world_size, store, queue, args), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results, errors = {}, {}
        try:
            for _ in range(world_size):
                rank, ok, value = queue.get(timeout=timeout)
                if ok:
                    results[rank] = torch.load(io.BytesIO(value), weights_only=False)
                else:
                    errors[rank] = value
        except queue_mod.Empty:
            errors["timeout"] = f"not every rank finished within {timeout}s (hang?)"
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    if errors:
        raise WorkerError("\n".join(f"--- rank {r}:\n{e}" for r, e in sorted(errors.items(), key=str)))
    return [results[r] for r in range(world_size)]


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_script(argv: list[str], ranks: int = 1, *, timeout: float = 600.0, cwd=None) -> list[tuple[int, str]]:
    """Run ``python argv...`` on ``ranks`` processes at once, each with the environment torchrun
    gives a script (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
    none of them for one process), this checkout's ``src`` first on the path and one thread
    each. Returns ``(exit code, stdout and stderr)`` by rank; raises ``TimeoutError`` (after
    killing them all) when they do not all finish within ``timeout`` seconds. The processes
    are forked from an interpreter that has imported torch (:mod:`warm_python`), as
    ``python argv...`` would run otherwise."""
    from _support import warm_python

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(root, "src"), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    if ranks > 1:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(ranks),
                   LOCAL_WORLD_SIZE=str(ranks))
    jobs = [(argv, dict(env, RANK=str(r), LOCAL_RANK=str(r)) if ranks > 1 else env) for r in range(ranks)]
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            return warm_python.run(jobs, cwd, out_dir, timeout)
        except TimeoutError:
            raise TimeoutError(f"{' '.join(argv)} did not finish within {timeout} s on {ranks} rank(s)") from None
