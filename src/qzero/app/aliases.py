"""Short names for ZeroConfig fields, accepted wherever settings are given as ``KEY=VALUE``
(``qzero qualify --baseline/--candidate``, ``bench/steps_matrix.py --arm``).

The one table of them (records and reports use ZeroConfig's own names). A module of its own,
free of torch, so that ``qzero --help`` can list them without importing it.
"""

ZERO_ALIASES = {
    "quantized": "zero_quantized_weights",
    "overlap": "overlap_param_gather",
    "fmt": "zero_quantized_weights_format",
    "group_size": "zero_quantized_weights_group_size",
    "allgather_bucket": "allgather_bucket_size",
    "reduce_bucket": "reduce_bucket_size",
}
