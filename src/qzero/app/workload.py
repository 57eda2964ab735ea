"""The embedded workload of ``qzero train`` / ``qzero qualify``: models and text.

Models are Qwen3-shaped causal LMs built from a ``transformers`` config (random
init, no downloads): a few presets from tiny (CPU) to Qwen3-4B dimensions, or any
config JSON. Text is byte-level: by default this Python's own standard library
sources in a fixed order (offline, identical on every machine with the same
Python), or a user's file. Batches are drawn from a seeded generator per step, so
every arm and every world size sees the same global batch.

[Note: held-out text] With ``heldout`` > 0 the corpus's last ``int(heldout * tokens)``
tokens are held out (:func:`split_corpus`): training batches are drawn from the part before
the split only, and the held-out loss is measured on a fixed set of windows of that tail
(:func:`heldout_windows`: evenly spaced starts, the same for every seed, step and world
size, so every arm is evaluated on the same text). ``heldout`` 0 holds nothing out: the
training part is the whole corpus and the draw is the one of a run without the setting.
"""

from __future__ import annotations

import difflib
import json
import os
import stat
import sysconfig
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: ``qzero --help`` does not wait for it
    import torch

BYTE_VOCAB = 256
#: A model config JSON is a few KiB; reading stops past this.
MAX_CONFIG_BYTES = 1 << 20
#: Sizes a model config must give as positive integers (where its model type has them).
CONFIG_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "head_dim", "max_position_embeddings")
#: Counting a config's parameters builds it on the meta device, a layer at a time: more layers
#: than this are refused rather than counted (the deepest published LLMs have under 200).
MAX_LAYERS = 4096


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
    # whose count comes mostly from its 151,936-token embedding (benchmarks/scripts/convergence.py)
    "qwen3-125m-byte": Preset(768, 12, 12, 4, 3840, BYTE_VOCAB, 64, False, 65_536),
    "qwen3-0.6b": Preset(1024, 28, 16, 8, 3072, 151_936, 128, True, 65_536),
    "qwen3-1.7b": Preset(2048, 28, 16, 8, 6144, 151_936, 128, True, 65_536),
    "qwen3-4b": Preset(2560, 36, 32, 8, 9728, 151_936, 128, True, 65_536),
}


class WorkloadError(ValueError):
    """A bad workload argument (reported as a one-line error by the CLI)."""


def model_config(preset: str | None = None, config_path: str | None = None, max_positions: int = 4096):
    """A ``transformers`` config from a preset name or a config JSON file: a causal LM that
    byte-level text can train (sizes positive integers, vocabulary of at least 256)."""
    from transformers import AutoConfig, Qwen3Config

    if config_path:
        raw = read_regular(config_path, "model config", MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise WorkloadError(f"model config file {config_path} is larger than {MAX_CONFIG_BYTES >> 20} MiB; "
                                "a config JSON is a few KiB")
        try:
            d = json.loads(raw)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, a 5000-digit integer
            raise WorkloadError(f"model config file {config_path} is not valid JSON ({_bounded(e)})") from None
        if not isinstance(d, dict):
            raise WorkloadError(f"model config file {config_path} is not a JSON object (got {type(d).__name__})")
        if "auto_map" in d:  # it names code to fetch and run; only transformers' own classes are built
            raise WorkloadError(f"model config file {config_path} has 'auto_map' (remote code); qzero does not run it")
        model_type = d.pop("model_type", "qwen3")
        _check_model_type(model_type, config_path)
        try:
            config = AutoConfig.for_model(model_type, **d)
        except Exception as e:  # transformers' own checks of a user's file: any of them is a bad config
            raise WorkloadError(f"model config {config_path}: {_bounded(e)}") from None
        _check_sizes(config, config_path)
        return config
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


def _check_model_type(model_type, path: str) -> None:
    """A model type transformers knows and builds as a causal LM, or a short WorkloadError."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING_NAMES:
        close = difflib.get_close_matches(str(model_type), list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), n=3)
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else " (e.g. 'qwen3', 'llama', 'gpt2')"
        raise WorkloadError(f"model config {path}: unknown model_type {_short(model_type)}{hint}")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise WorkloadError(f"model config {path}: model_type {model_type!r} is not a causal language model "
                            "(transformers' AutoModelForCausalLM has no class for it); "
                            "qzero trains next-token prediction")


def _check_sizes(config, path: str) -> None:
    for name in CONFIG_SIZES:
        value = getattr(config, name, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise WorkloadError(f"model config {path}: {name} must be a positive integer, got {_short(value)}")
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if heads and kv and heads % kv:
        raise WorkloadError(f"model config {path}: num_attention_heads {heads} is not a multiple of "
                            f"num_key_value_heads {kv}")
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and vocab < BYTE_VOCAB:
        raise WorkloadError(f"model config {path}: vocab_size {vocab} is below the {BYTE_VOCAB} byte values the "
                            "training text is made of")
    layers = getattr(config, "num_hidden_layers", None)
    if layers is not None and layers > MAX_LAYERS:
        raise WorkloadError(f"model config {path}: num_hidden_layers {layers:,} is more than the {MAX_LAYERS:,} "
                            "this workload builds")


def count_parameters(config, where: str) -> int:
    """Trainable parameters of the causal LM ``config`` describes, counted on the meta device
    (nothing allocated). A config transformers cannot build is a WorkloadError naming ``where``."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except Exception as e:  # whatever a user's config makes transformers raise, said in one line
        raise WorkloadError(f"{where}: transformers cannot build a causal LM from it ({_bounded(e)})") from None
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _bounded(e: BaseException, limit: int = 200) -> str:
    """An exception's first line, at most ``limit`` characters."""
    text = (str(e).splitlines() or [type(e).__name__])[0] or type(e).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def build_model(config, dtype: torch.dtype, device: torch.device, seed: int,
                attention: str = "sdpa") -> torch.nn.Module:
    """A randomly initialised causal LM, the same on every rank for the same seed.

    ``attention``: the attention implementation (``sdpa``, or ``eager``, whose backward is
    deterministic where fused attention kernels are not)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention,
                                                 trust_remote_code=False)
    return model.to(device=device, dtype=dtype)


def load_corpus(path: str | None = None, limit: int = 8_000_000) -> torch.Tensor:
    """Byte tokens of ``path`` (its first ``limit`` bytes), or of the standard library's ``*.py``
    files in sorted order."""
    import torch

    if path:
        data = bytearray(read_regular(path, "data", limit))
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


def read_regular(path: str, what: str, limit: int) -> bytes:
    """Up to ``limit`` bytes of the regular file ``path``, or a WorkloadError that says what
    is wrong with it. A pipe, FIFO or device is refused without reading from it (a FIFO is
    opened without waiting for a writer): every rank reads the file for itself, and a pipe
    would hand its bytes to the first reader only, or block forever, or never end."""
    if os.path.isdir(path):
        raise WorkloadError(f"{what} {path} is a directory; give a file")
    if not os.path.exists(path):
        raise WorkloadError(f"{what} file not found: {path}")
    if not os.access(path, os.R_OK):
        raise WorkloadError(f"{what} file {path} is not readable")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise WorkloadError(f"{what} file {path} cannot be opened ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a pipe" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode) else
                    "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a file")
            raise WorkloadError(f"{what} {path} is {kind}, not a regular file: every rank reads it for itself, so "
                                "write it to a file first (e.g. command > file.txt)")
        os.set_blocking(fd, True)
        return f.read(limit)


def check_corpus(corpus: torch.Tensor, seq_len: int) -> None:
    if corpus.numel() < seq_len + 2:
        raise WorkloadError(f"sequence length {seq_len} is longer than the data ({corpus.numel()} tokens)")


def split_corpus(corpus: torch.Tensor, heldout: float, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(training part, held-out part)`` of ``corpus`` ([Note: held-out text]): views, the
    held-out part its last ``int(heldout * tokens)`` tokens. Each part must hold what it is
    used for: the training part a window of ``seq_len + 1`` tokens and a start to draw
    (``seq_len + 2``, as :func:`check_corpus` asks of a whole corpus), the held-out part (when
    ``heldout`` > 0) one window of ``seq_len + 1``; otherwise a WorkloadError naming
    ``heldout`` and the lengths."""
    total = corpus.numel()
    held = int(heldout * total)
    split = total - held
    if heldout > 0 and held < seq_len + 1:
        raise WorkloadError(f"heldout {heldout:g} of the {total:,}-token data holds out {held:,} tokens, fewer than "
                            f"one window of seq_len + 1 = {seq_len + 1}: raise heldout or use more data")
    if split < seq_len + 2:
        raise WorkloadError(f"heldout {heldout:g} of the {total:,}-token data leaves {split:,} tokens to train on, "
                            f"fewer than the seq_len + 2 = {seq_len + 2} a training window needs: lower heldout")
    return corpus[:split], corpus[split:]


def heldout_windows(held: torch.Tensor, sequences: int, seq_len: int) -> torch.Tensor:
    """``sequences`` windows of ``seq_len + 1`` tokens of the held-out part ``held``, at evenly
    spaced starts from its first token to its last window (``i * (len - seq_len - 1) //
    (sequences - 1)``; one window: the first): no seed, no step, so every run evaluates the
    same text. Windows overlap where the part is shorter than ``sequences`` windows."""
    import torch

    width = seq_len + 1
    room = held.numel() - width
    if room < 0:
        raise WorkloadError(f"the held-out part has {held.numel():,} tokens, fewer than one window of {width}")
    starts = [i * room // (sequences - 1) for i in range(sequences)] if sequences > 1 else [0]
    return torch.stack([held[s : s + width] for s in starts])


def global_batch(corpus: torch.Tensor, step: int, sequences: int, seq_len: int, seed: int) -> torch.Tensor:
    """``sequences`` windows of ``seq_len + 1`` tokens for ``step`` (inputs and shifted targets)."""
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, corpus.numel() - seq_len - 1, (sequences,), generator=g)
    return torch.stack([corpus[s : s + seq_len + 1] for s in starts.tolist()])
