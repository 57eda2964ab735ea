"""qzero: ZeRO-1/2 data parallelism with a bounded, quantized post-step weight all-gather.

Each rank steps the fp32 *master shard* of its *partition* of a bf16/fp16 *flat buffer*;
after the step the partitions are gathered *chunk* by chunk, each rank sending a quantized
*payload* per chunk, with small parameters (*exact ranges*) sent bit-exactly. These terms,
and the path of one weight from the master shard to every rank's buffer, are defined in
``docs/design.md``.
"""

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
