"""ZeroConfig: DeepSpeed key names, validation, from_dict."""

import dataclasses
import os
import re

import pytest

from qzero import ZeroConfig


def _readme_defaults() -> dict:
    """The ``| `key` | default | meaning |`` rows of the README's ZeroConfig table, parsed."""
    path = os.path.join(os.path.dirname(__file__), "..", "README.md")
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


def test_the_readme_table_states_every_default():
    """Every ZeroConfig field is in the README's table, with the default the code has."""
    documented = _readme_defaults()
    for f in dataclasses.fields(ZeroConfig):
        assert f.name in documented, f"README's ZeroConfig table lacks {f.name!r}"
        want, got = _parse(documented[f.name]), getattr(ZeroConfig(), f.name)
        assert want == got, f"README says {f.name} defaults to {documented[f.name]!r}, the code to {got!r}"
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
        ({"offload_optimizer": {"device": "cpu"}},
         "zero_optimization.offload_optimizer is not supported: optimizer offload to the host"),
        ({"stage3_prefetch_bucket_size": 5e7}, r"stage3_prefetch_bucket_size is not supported: a ZeRO-3 setting"),
        ({"offload_param": {"device": "cpu"}}, r"offload_param is not supported: a ZeRO-3 setting"),
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


def test_a_zero3_key_is_not_answered_with_a_stage2_key():
    for key in ("stage3_prefetch_bucket_size", "stage3_max_live_parameters", "sub_group_size"):
        with pytest.raises(ValueError) as e:
            ZeroConfig.from_dict({key: 1})
        assert "ZeRO-3" in str(e.value) and "did you mean" not in str(e.value) and "unknown" not in str(e.value)


@pytest.mark.parametrize("name, value", [("allgather_bucket_size", 1e99), ("reduce_bucket_size", 2**49),
                                         ("zero_quantized_weights_delta_resync_steps", 2**63),
                                         ("small_param_numel", 10**20), ("loss_scale_window", 2**62),
                                         ("gather_lookahead", 2**50), ("reduce_buckets_in_flight", 2**60)])
def test_every_count_is_bounded(name, value):
    with pytest.raises(ValueError, match=f"^{name} must be at most 2\\*\\*48 "):
        ZeroConfig(**{name: value})
    assert getattr(ZeroConfig(**{name: 2**40}), name) == 2**40  # large but possible is taken


def test_a_weight_payload_setting_without_the_quantized_gather_is_refused():
    """It would change nothing; the command refuses it, and so does ZeroConfig. The value it
    resolves to anyway is taken, so that a resolved config builds again from its dict."""
    for kwargs in (dict(zero_quantized_weights_format="fp8"), dict(zero_quantized_weights_group_size=128)):
        with pytest.raises(ValueError, match="is a setting of the quantized weight gather, which "
                                             "zero_quantized_weights=false leaves off"):
            ZeroConfig(**kwargs)
    for config in (ZeroConfig(), ZeroConfig(zero_quantized_weights=True, zero_quantized_weights_format="fp8"),
                   ZeroConfig(zero_quantized_weights=True, zero_quantized_weights_delta=True)):
        assert ZeroConfig(**config.to_dict()) == config
    assert ZeroConfig(zero_quantized_weights_format="int8", zero_quantized_weights_group_size=64).to_dict() == \
        ZeroConfig().to_dict()
