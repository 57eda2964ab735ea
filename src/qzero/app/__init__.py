"""The ``qzero`` command: ``qzero train``, ``qzero qualify`` and ``qzero bench``.

An application built on the library, which the library never imports (``tests/test_layering.py``
checks it):

* ``cli.py`` — the command line: flags, their checks, one ``qzero: error: ...`` line for a bad one.
* ``train.py`` — one training run (an *arm*): its settings, its ranks, its record.
* ``backends.py`` — the training backends an arm can use: ``ZeroOptimizer``, DeepSpeed, FSDP2.
* ``workload.py`` — the embedded models (transformers configs) and the byte-level corpus.
* ``orphans.py`` — ranks that exit when the process that started them dies.
* ``qualify/`` — ``qzero qualify``: A/B arms, statistics, the report and its verdict.
* ``benchmarks/`` — ``qzero bench``: the gather and its kernels.
"""
