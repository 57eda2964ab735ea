"""Where a training step's host time goes, by phase (``benchmarks/scripts/step_profile.py --host-breakdown``).

:class:`HostBreakdown` wraps, for as long as it is installed, the gather engine's chunk
launches (the ``streams`` schedule's ``_enqueue_through``, the ``inline`` schedule's ``_launch_all``),
its packs and unpacks, gather-ahead's forward pre-hooks and parameter reads, and stage 2's
gradient hooks, bucket launches and finishes (the quantized exchange's inside them) with host
timers, and counts Python's garbage collections. While a phase is counted (``counting("fwd")``), it
also reads the CUDA caching allocator's device allocations, frees and retries before and
after, and optionally (``sync=True``) turns on ``torch.cuda.set_sync_debug_mode`` to record
every synchronizing CUDA call with the qzero, transformers or torch.nn frames that made it.
Timers are installed before the backend is built: gather-ahead binds its hooks then.
"""

from __future__ import annotations

import contextlib
import time

import torch


class HostBreakdown:
    """Where the host time of each phase (forward, backward, step) goes (``--host-breakdown``):
    seconds and calls of the gather's chunk launches (``_Streamed._enqueue_through`` and the
    inline schedule's ``_launch_all``), its packs and unpacks, gather-ahead's hooks and parameter
    reads; synchronizing CUDA calls (``torch.cuda.set_sync_debug_mode``, with the qzero or
    transformers frame that made them), the caching allocator's device allocations, frees and
    retries, and Python's garbage collections. Installed before the backend is built (the
    hooks are bound then); counts only while :attr:`phase` is set."""

    #: (module under qzero, function or Class.method[, key]): the key defaults to the name
    #: without its leading underscores. Times are inclusive (a reduction's launch holds its pack).
    TIMED = (("wire.engine", "_Streamed._enqueue_through"), ("wire.engine", "_Inline._launch_all"),
             ("wire.engine", "pack_chunk"), ("wire.engine", "unpack_chunk"),
             ("wire.overlap", "GatherAhead._hook"), ("wire.overlap", "GatherAhead.wait_for"),
             # the gradient reduction, stage 2: the hook per parameter (staging its gradient;
             # it launches a full bucket), each bucket's launch and the finish of the oldest
             ("optim.grads", "Stage2Grads._on_grad", "grad_hook"),
             ("optim.grads", "Stage2Grads._launch", "reduce_launch"),
             ("optim.grads", "Stage2Grads._finish_oldest", "reduce_finish"),
             # inside those with quantized gradients: pack + all-to-all, and dequantize + sum
             ("wire.quantized_reduce", "QuantizedExchange.launch", "quantized_launch"),
             ("wire.quantized_reduce", "QuantizedExchange.finish", "quantized_finish"))
    ALLOC = ("num_device_alloc", "num_device_free", "num_alloc_retries")

    def __init__(self):
        self.phase = None
        self.totals: dict = {}
        self._undo = []
        self.syncs: dict = {}

    def _add(self, key, seconds, n=1):
        if self.phase is None:
            return
        t = self.totals.setdefault(self.phase, {}).setdefault(key, [0, 0.0])
        t[0] += n
        t[1] += seconds

    def install(self):
        import gc
        import importlib

        for mod_name, qual, *named in self.TIMED:
            mod = importlib.import_module("qzero." + mod_name)
            owner, _, attr = qual.rpartition(".")
            target = getattr(mod, owner) if owner else mod
            orig = getattr(target, attr)
            key = named[0] if named else attr.lstrip("_")

            def timed(*args, _orig=orig, _key=key, **kw):
                t0 = time.perf_counter()
                try:
                    return _orig(*args, **kw)
                finally:
                    self._add(_key, time.perf_counter() - t0)

            setattr(target, attr, timed)
            self._undo.append((target, attr, orig))
        self._gc_t = None

        def on_gc(phase, info):
            if phase == "start":
                self._gc_t = time.perf_counter()
            elif self._gc_t is not None:
                self._add("gc", time.perf_counter() - self._gc_t)

        gc.callbacks.append(on_gc)
        self._undo.append((gc.callbacks, None, on_gc))

    def uninstall(self):
        for target, attr, orig in reversed(self._undo):
            if attr is None:
                target.remove(orig)
            else:
                setattr(target, attr, orig)
        self._undo = []

    @contextlib.contextmanager
    def counting(self, phase: str, sync: bool = False):
        """Count ``phase`` while the block runs; ``sync``: also record synchronizing CUDA calls."""
        import traceback
        import warnings

        cuda = torch.cuda.is_available()
        before = torch.cuda.memory_stats() if cuda else {}
        sites = []

        def record(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" not in str(message):
                return
            frames = [f for f in traceback.extract_stack()[:-1]
                      if "qzero" in f.filename or "transformers" in f.filename or "torch/nn" in f.filename]
            sites.append(f"{str(message)[:60]} @ " + " < ".join(
                f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}:{f.name}" for f in frames[-3:][::-1]))

        self.phase = phase
        with warnings.catch_warnings():  # restores the filters and showwarning on the way out
            warnings.simplefilter("always")
            warnings.showwarning = record
            if cuda and sync:
                torch.cuda.set_sync_debug_mode(1)  # warn at every synchronizing call
            try:
                yield
            finally:
                if cuda and sync:
                    torch.cuda.set_sync_debug_mode(0)
                self.phase = None
        for site in sites:
            self.syncs[site] = self.syncs.get(site, 0) + 1
        after = torch.cuda.memory_stats() if cuda else {}
        for k in self.ALLOC:
            t = self.totals.setdefault(phase, {}).setdefault(k, [0, 0.0])
            t[0] += after.get(k, 0) - before.get(k, 0)

    def report(self, steps: int) -> dict:
        """Per phase, per key: calls and host milliseconds per measured step; the sync sites."""
        out = {ph: {k: [round(n / steps, 2), round(1e3 * sec / steps, 3)] for k, (n, sec) in d.items()}
               for ph, d in self.totals.items()}
        return {"per_step": out, "syncs": dict(sorted(self.syncs.items(), key=lambda kv: -kv[1])[:12])}
