"""ZeroConfig: DeepSpeed key names, validation, from_dict."""

import dataclasses
import os
import re

import pytest

from qzero import ZeroConfig


def _readme_defaults() -> dict:
    """The ``| `key` | default | meaning |`` rows of docs/settings.md, parsed."""
    path = os.path.join(os.path.dirname(__file__), "..", "docs", "settings.md")
    rows = {}
    for line in open(path, encoding="utf-8"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        keys = re.findall(r"`([a-z0-9_]+)`", cells[0])
        values = [v.strip().strip("`") for v in cells[1].split(",")] if len(keys) > 1 else [cells[1].strip("`")]
        rows.update(zip(keys, values))
    return rows


def _parse(text: str):
    if text in ("true", "false"):
        return text == "true"
    if text == "model dtype":
        return None
    if text == "on when quantized":  # resolved on construction: off with the default (plain) gather
        return False
    if text == "hadamard for int4":  # resolved on construction: none with the default (int8) format
        return "none"
    per_format = re.fullmatch(r"(\S+) \((\S+) for int4\)", text)  # the default format's value, then int4's
    if per_format:
        return _parse(per_format[1])
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return text


def test_the_settings_table_states_every_default():
    """Every ZeroConfig field is in docs/settings.md's table, with the default the code has."""
    documented = _readme_defaults()
    for f in dataclasses.fields(ZeroConfig):
        assert f.name in documented, f"docs/settings.md lacks {f.name!r}"
        want, got = _parse(documented[f.name]), getattr(ZeroConfig(), f.name)
        assert want == got, f"docs/settings.md says {f.name} defaults to {documented[f.name]!r}, the code to {got!r}"
    assert ZeroConfig(zero_quantized_weights=True).overlap_param_gather is True
    assert ZeroConfig(zero_quantized_weights=True, overlap_param_gather=False).overlap_param_gather is False


def test_from_deepspeed_dict():
    ds = {
        "stage": 1,
        "zero_quantized_weights": True,
        "zero_quantized_weights_group_size": 128,
        "allgather_bucket_size": 5e7,
        "reduce_bucket_size": 2.6e7,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "allgather_partitions": True,
        "reduce_scatter": True,
    }
    c = ZeroConfig.from_dict(ds)
    assert c.stage == 1 and c.zero_quantized_weights_group_size == 128
    assert c.allgather_bucket_size == 50_000_000 and isinstance(c.reduce_bucket_size, int)


@pytest.mark.parametrize(
    "d, match",
    [
        ({"stage": 3}, "stage must be 1 or 2"),
        ({"zero_quantized_weights_group_size": 12}, "group_size"),
        ({"zero_quantized_weights_format": "int2"}, "'int2'"),
        ({"offload_optimizer": {"device": "cpu"}}, "unknown zero_optimization key 'offload_optimizer'"),
        ({"allgather_bucket_size": 0}, "allgather_bucket_size"),
        ({"allgather_bucket_size": 1.5}, "allgather_bucket_size"),
        ({"reduce_dtype": "int8"}, "reduce_dtype"),
        ({"gradient_clipping": -1.0}, "gradient_clipping"),
        ({"zero_quantized_weights": "yes"}, "zero_quantized_weights"),
        ({"reduce_scatter": False}, "reduce_scatter"),
        ({"small_param_numel": -1}, "small_param_numel"),
    ],
)
def test_bad_settings_are_named(d, match):
    with pytest.raises(ValueError, match=match):
        ZeroConfig.from_dict(d)


def test_digest_differs_with_settings():
    assert ZeroConfig().digest() == ZeroConfig().digest()
    assert ZeroConfig().digest() != ZeroConfig(zero_quantized_weights=True).digest()


def test_int4_gradients_default_to_groups_of_256_and_the_8_bit_formats_to_64():
    """zero_quantized_gradients_group_size left as None resolves by format (the README's
    "64 (256 for int4)"); a value given is kept for every format."""
    assert ZeroConfig().zero_quantized_gradients_group_size == 64
    assert ZeroConfig(zero_quantized_gradients=True, zero_quantized_gradients_format="int4").zero_quantized_gradients_group_size == 256
    assert ZeroConfig(zero_quantized_gradients=True, zero_quantized_gradients_format="fp8").zero_quantized_gradients_group_size == 64
    assert ZeroConfig(zero_quantized_gradients_format="int4", zero_quantized_gradients_group_size=64).zero_quantized_gradients_group_size == 64
    assert ZeroConfig.from_dict({"zero_quantized_gradients_format": "int4"}).zero_quantized_gradients_group_size == 256
    with pytest.raises(ValueError, match="zero_quantized_gradients_group_size"):
        ZeroConfig(zero_quantized_gradients_format="int4", zero_quantized_gradients_group_size=12)
