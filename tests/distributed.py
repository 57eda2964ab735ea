"""Run a function on N gloo ranks in forked processes; collect results or tracebacks.

Forking keeps start-up cheap (no re-import of torch per rank). Each rank gets a
fresh process group over a FileStore; a rank that does not finish within the
timeout fails the test instead of hanging the suite.
"""

from __future__ import annotations

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


def _entry(fn, rank, world_size, store_path, queue, args):
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
    if start_method == "fork" and torch.cuda.is_available() and torch.cuda.is_initialized():
        # A forked child cannot use CUDA once this process has (and torch's optimizers ask
        # CUDA whether a graph is being captured), so on a GPU machine fresh interpreters it is.
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
