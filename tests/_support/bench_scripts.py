"""Load a script of ``benchmarks/scripts/`` as a module (the scripts are not a package)."""

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def path(name: str) -> str:
    return os.path.join(ROOT, "benchmarks", "scripts", f"{name}.py")


def load(name: str):
    """``benchmarks/scripts/<name>.py`` as module ``name``, registered in ``sys.modules`` (dataclasses
    look their module up there), loaded once: a script that imports a sibling by name (``import
    emulated_link``) gets this same module."""
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__file__", None) == path(name):
        return loaded
    spec = importlib.util.spec_from_file_location(name, path(name))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


#: A two-layer Qwen3-shaped model for end-to-end runs of the emulated matrix on the CPU.
MINI_QWEN3 = {"model_type": "qwen3", "vocab_size": 4096, "hidden_size": 128, "intermediate_size": 384,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
              "max_position_embeddings": 4096, "tie_word_embeddings": True, "attention_dropout": 0.0}


def run_emulated_matrix(tmp_path, *args: str, timeout: float = 600):
    """``benchmarks/scripts/emulated_matrix.py`` on the CPU with :data:`MINI_QWEN3` (at DP2, sequence 16,
    micro-batch 1, 200k/100k buckets) and ``args``; this checkout's ``src`` imported first."""
    import json
    import subprocess

    config = tmp_path / "mini.json"
    config.write_text(json.dumps(MINI_QWEN3))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, path("emulated_matrix"), "--device", "cpu", "--model-config", str(config), "--seq-len", "16",
           "--micro-batch", "1", "--allgather-bucket-size", "200000", "--reduce-bucket-size", "100000",
           "--world-size", "2", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
