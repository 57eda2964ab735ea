"""The pure planner of the weight gather: where every parameter sits in its flat buffer, how
the buffer's gather is cut into chunks, and what each rank sends for each chunk.

Nothing here touches a process group or allocates a tensor, so a DP1024 plan can be checked
on a laptop. The terms (flat buffer, partition, chunk, payload, exact range) are defined in
``docs/design.md``; the gradient reduction's buckets and windows are planned in
:mod:`qzero.buckets`. Three modules, each importing only the ones above it:

* :mod:`~qzero.layout.gather_plan` — the plan as a value, what the runners read:
  :class:`GatherPlan`, its :class:`ChunkPlan` s, :class:`PayloadLayout`, :class:`PayloadKind`,
  :class:`GroupRuns`, the ranges they are made of, and [Note: exact groups].
* :mod:`~qzero.layout.gather_planner` — :func:`plan_gather`: the bucket rule, the chunks, the
  exact-group rule applied, the payload layouts, the checks of the planner's arguments.
* :mod:`~qzero.layout.flat_layout` — :func:`plan_flat_layout`: parameters packed into a padded
  flat buffer in the flat order, the small ones made exact ranges, and its gather plan.

The names below are the planner's public names (``qzero.plan_gather`` is
``qzero.layout.plan_gather``); qzero's own modules import them from the module that defines them.
"""

from .flat_layout import (AUTO_INTERLEAVE_MAX_PADDING, DEFAULT_SMALL_PARAM_NUMEL, FlatLayout, ParamSlot,
                          interleaved_starts, is_small_param, padded_flat_numel, plan_flat_layout)
from .gather_plan import (ChunkPlan, GatherPlan, GroupRuns, PayloadKind, PayloadLayout, Range, Run, clip_ranges,
                          merge_adjacent)
from .gather_planner import (DEFAULT_BUCKET_NUMEL, PAYLOAD_ALIGN, aligned_layout, check_exact_ranges, check_format,
                             check_positive_int, chunk_numel_per_rank, codes_pay, compact_layout, exact_group_span,
                             plan_gather, quantized_payload_layout, round_up, slice_runs)

__all__ = [
    "AUTO_INTERLEAVE_MAX_PADDING",
    "ChunkPlan",
    "DEFAULT_BUCKET_NUMEL",
    "DEFAULT_SMALL_PARAM_NUMEL",
    "FlatLayout",
    "GatherPlan",
    "GroupRuns",
    "PAYLOAD_ALIGN",
    "ParamSlot",
    "PayloadKind",
    "PayloadLayout",
    "Range",
    "Run",
    "aligned_layout",
    "check_exact_ranges",
    "check_format",
    "check_positive_int",
    "chunk_numel_per_rank",
    "clip_ranges",
    "codes_pay",
    "compact_layout",
    "exact_group_span",
    "interleaved_starts",
    "is_small_param",
    "merge_adjacent",
    "padded_flat_numel",
    "plan_flat_layout",
    "plan_gather",
    "quantized_payload_layout",
    "round_up",
    "slice_runs",
]
