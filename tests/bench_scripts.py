"""Load a script of ``bench/`` as a module (the scripts are not a package)."""

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def path(name: str) -> str:
    return os.path.join(ROOT, "bench", f"{name}.py")


def load(name: str):
    """``bench/<name>.py`` as module ``name``, registered in ``sys.modules`` (dataclasses
    look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, path(name))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
