"""``qzero qualify``: does the quantized gather pay on this cluster, and is it accurate?"""

from .report import verdict, write
from .run import Thresholds, analyse, qualify

__all__ = ["Thresholds", "analyse", "qualify", "verdict", "write"]
