"""qzero: ZeRO-1/2 data parallelism with a bounded, quantized post-step weight all-gather.

Each rank steps the fp32 *master shard* of its *partition* of a bf16/fp16 *flat buffer*;
after the step the partitions are gathered *chunk* by chunk, each rank sending a quantized
*payload* per chunk, with small parameters (*exact ranges*) sent bit-exactly. These terms,
and the path of one weight from the master shard to every rank's buffer, are defined in
``docs/design.md``.
"""

import importlib

__version__ = "0.1.0"

# Imported on first use (PEP 562): ``import qzero`` does not import torch, so that the
# ``qzero`` command answers ``--help`` and argument errors without waiting for it.
_EXPORTS = {
    "FORMATS": ".quant",
    "FlatLayout": ".layout.flat_layout",
    "GatherPlan": ".layout.gather_plan",
    "GatherStats": ".wire.comm",
    "ZeroConfig": ".config",
    "ZeroOptimizer": ".optim",
    "all_gather": ".wire.comm",
    "plan_flat_layout": ".layout.flat_layout",
    "plan_gather": ".layout.gather_planner",
    "quantized_all_gather": ".wire.comm",
}

__all__ = sorted(_EXPORTS)

# The library's modules, found as attributes on first use. Not the application (``qzero.app``:
# the ``qzero`` command, its backends and benchmarks), which the library never imports: it is
# imported only by name (``import qzero.app.cli``, ``python -m qzero``).
_LIBRARY = ("config", "fsdp", "integrations", "layout", "optim", "quant", "wire")


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    if name in _LIBRARY:  # a subpackage, as ``import qzero; qzero.optim`` found it when everything was imported eagerly
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
