"""Benchmarks that ship with the package (``qzero bench``); the GPU studies live in ``bench/``."""
