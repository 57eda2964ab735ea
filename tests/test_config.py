"""ZeroConfig: DeepSpeed key names, validation, from_dict."""

import pytest

from qzero import ZeroConfig


def test_defaults_follow_the_spec():
    c = ZeroConfig()
    assert (c.stage, c.zero_quantized_weights, c.zero_quantized_weights_group_size) == (2, False, 64)
    assert (c.small_param_numel, c.allgather_bucket_size, c.zero_quantized_weights_format) == (65536, 500_000_000, "int8")


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
