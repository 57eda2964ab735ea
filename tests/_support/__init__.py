"""Helpers the tests share (spawned ranks, checkpoints, kernel launch checks, the benchmark
scripts as modules, ...). Imported as ``from _support import distributed``: pytest puts this
folder's parent (``tests/``, the rootdir of its conftest) on the path."""
