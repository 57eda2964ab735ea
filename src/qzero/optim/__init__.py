"""ZeRO stage 1/2 optimizer with the (quantized) post-step weight gather."""

from .zero import ZeroOptimizer

__all__ = ["ZeroOptimizer"]
