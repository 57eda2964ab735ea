"""``python -m qzero``: the ``qzero`` command (:mod:`qzero.app.cli`), also where no console script is installed."""

import sys

from .app.cli import main

if __name__ == "__main__":
    sys.exit(main())
