"""qzero: ZeRO-1/2 data parallelism with a bounded, quantized post-step weight all-gather."""

from .config import ZeroConfig
from .comm import GatherStats, all_gather, quantized_all_gather
from .layout import FlatLayout, GatherPlan, plan_flat_layout, plan_gather
from .optim import ZeroOptimizer
from .quant import FORMATS

__version__ = "0.1.0"

__all__ = [
    "FORMATS",
    "FlatLayout",
    "GatherPlan",
    "GatherStats",
    "ZeroConfig",
    "ZeroOptimizer",
    "all_gather",
    "plan_flat_layout",
    "plan_gather",
    "quantized_all_gather",
]
