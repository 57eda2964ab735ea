"""Benchmarks that ship with the package (``qzero bench``); the other studies and their reports
live in ``benchmarks/``."""
