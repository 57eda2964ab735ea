"""The gather and its kernels: :mod:`qzero.app.benchmarks.gather` (also ``qzero bench gather``).

One GPU: ``python bench/gather_bench.py --out DIR``; several: ``torchrun --nproc_per_node=2
bench/gather_bench.py --out DIR``; ``--help`` for the rest.
"""

import sys

from qzero.app.benchmarks.gather import main

if __name__ == "__main__":
    sys.exit(main())
