"""ZeroConfig: DeepSpeed key names, validation, from_dict."""

import pytest

from qzero import ZeroConfig


def test_gather_ahead_follows_the_quantized_gather_unless_set():
    """(Every default is on docs/settings.md, generated from the code: tests/test_settings_page.py.)"""
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
    assert ZeroConfig(zero_quantized_gradients=True,
                      zero_quantized_gradients_format="int4").zero_quantized_gradients_group_size == 256
    assert ZeroConfig(zero_quantized_gradients=True,
                      zero_quantized_gradients_format="fp8").zero_quantized_gradients_group_size == 64
    assert ZeroConfig(zero_quantized_gradients_format="int4",
                      zero_quantized_gradients_group_size=64).zero_quantized_gradients_group_size == 64
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
