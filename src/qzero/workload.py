"""The embedded workload of ``qzero train`` / ``qzero qualify``: models and text.

Models are Qwen3-shaped causal LMs built from a ``transformers`` config (random
init, no downloads): a few presets from tiny (CPU) to Qwen3-4B dimensions, or any
config JSON. Text is byte-level: by default this Python's own standard library
sources in a fixed order (offline, identical on every machine with the same
Python), or a user's file. Batches are drawn from a seeded generator per step, so
every arm and every world size sees the same global batch.
"""

from __future__ import annotations

import json
import os
import sysconfig
from dataclasses import dataclass

import torch

BYTE_VOCAB = 256


@dataclass(frozen=True)
class Preset:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    head_dim: int
    tie: bool
    small_param_numel: int
    """The exact-parameter threshold this preset is meant to run with (the tiny CPU
    presets lower it so that their matrices are quantized as an LLM's would be)."""


PRESETS: dict[str, Preset] = {
    "tiny": Preset(64, 2, 4, 2, 192, BYTE_VOCAB, 16, False, 1024),
    "small": Preset(256, 4, 8, 4, 768, BYTE_VOCAB, 32, False, 4096),
    "qwen3-125m": Preset(768, 12, 12, 4, 2048, 151_936, 64, True, 65_536),
    # ~125M parameters (125,456,640) with the byte vocabulary: the MLP is wider than qwen3-125m's,
    # whose count comes mostly from its 151,936-token embedding (bench/convergence.py)
    "qwen3-125m-byte": Preset(768, 12, 12, 4, 3840, BYTE_VOCAB, 64, False, 65_536),
    "qwen3-0.6b": Preset(1024, 28, 16, 8, 3072, 151_936, 128, True, 65_536),
    "qwen3-1.7b": Preset(2048, 28, 16, 8, 6144, 151_936, 128, True, 65_536),
    "qwen3-4b": Preset(2560, 36, 32, 8, 9728, 151_936, 128, True, 65_536),
}


class WorkloadError(ValueError):
    """A bad workload argument (reported as a one-line error by the CLI)."""


def model_config(preset: str | None = None, config_path: str | None = None, max_positions: int = 4096):
    """A ``transformers`` config from a preset name or a config JSON file."""
    from transformers import AutoConfig, Qwen3Config

    if config_path:
        _check_file(config_path, "model config")
        try:
            with open(config_path) as f:
                d = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise WorkloadError(f"model config file {config_path} is not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise WorkloadError(f"model config file {config_path} is not a JSON object (got {type(d).__name__})")
        if "auto_map" in d:  # it names code to fetch and run; only transformers' own classes are built
            raise WorkloadError(f"model config file {config_path} has 'auto_map' (remote code); qzero does not run it")
        model_type = d.pop("model_type", "qwen3")
        try:
            return AutoConfig.for_model(model_type, **d)
        except (ValueError, TypeError, KeyError) as e:
            raise WorkloadError(f"model config {config_path}: {str(e).splitlines()[0]}") from None
    if preset not in PRESETS:
        raise WorkloadError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    p = PRESETS[preset]
    return Qwen3Config(
        vocab_size=p.vocab,
        hidden_size=p.hidden,
        intermediate_size=p.intermediate,
        num_hidden_layers=p.layers,
        num_attention_heads=p.heads,
        num_key_value_heads=p.kv_heads,
        head_dim=p.head_dim,
        max_position_embeddings=max_positions,
        tie_word_embeddings=p.tie,
        attention_dropout=0.0,
    )


def build_model(config, dtype: torch.dtype, device: torch.device, seed: int, attention: str = "sdpa") -> torch.nn.Module:
    """A randomly initialised causal LM, the same on every rank for the same seed.

    ``attention``: the attention implementation (``sdpa``, or ``eager``, whose backward is
    deterministic where fused attention kernels are not)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention, trust_remote_code=False)
    return model.to(device=device, dtype=dtype)


def load_corpus(path: str | None = None, limit: int = 8_000_000) -> torch.Tensor:
    """Byte tokens of ``path``, or of the standard library's ``*.py`` files in sorted order."""
    if path:
        _check_file(path, "data")
        with open(path, "rb") as f:
            data = bytearray(f.read(limit))
    else:
        root = sysconfig.get_paths()["stdlib"]
        data = bytearray()
        for name in sorted(os.listdir(root)):
            if name.endswith(".py"):
                with open(os.path.join(root, name), "rb") as f:
                    data += f.read()
            if len(data) >= limit:
                break
        del data[limit:]
    if not data:
        raise WorkloadError(f"data file is empty: {path}")
    return torch.frombuffer(data, dtype=torch.uint8).to(torch.long)


def _check_file(path: str, what: str) -> None:
    """A readable regular file, or a WorkloadError that says what is wrong with ``path``."""
    if os.path.isdir(path):
        raise WorkloadError(f"{what} {path} is a directory; give a file")
    if not os.path.exists(path):
        raise WorkloadError(f"{what} file not found: {path}")
    if not os.access(path, os.R_OK):
        raise WorkloadError(f"{what} file {path} is not readable")


def check_corpus(corpus: torch.Tensor, seq_len: int) -> None:
    if corpus.numel() < seq_len + 2:
        raise WorkloadError(f"sequence length {seq_len} is longer than the data ({corpus.numel()} tokens)")


def global_batch(corpus: torch.Tensor, step: int, sequences: int, seq_len: int, seed: int) -> torch.Tensor:
    """``sequences`` windows of ``seq_len + 1`` tokens for ``step`` (inputs and shifted targets)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, corpus.numel() - seq_len - 1, (sequences,), generator=g)
    return torch.stack([corpus[s : s + seq_len + 1] for s in starts.tolist()])
