"""Where DeepSpeed's ZeRO-1/2 optimizers keep the flat groups their post-step gather fills.

Two DeepSpeed optimizers partition the optimizer state over the data-parallel ranks and
all-gather the updated bf16/fp16 weights after each step:

* ``DeepSpeedZeroOptimizer`` (``deepspeed.runtime.zero.stage_1_and_2``): ZeRO stage 1 and 2
  in general. Its flat groups may be in round-robin order, with alignment padding.
* ``BF16_Optimizer`` (``deepspeed.runtime.bf16_optimizer``): what DeepSpeed builds instead at
  ZeRO stage 1 with bf16 weights and fp32 gradient accumulation
  (``data_types.grad_accum_dtype: "fp32"``) without CPU offload. Its flat groups hold the
  parameters in their parameter-group order, padded at the end.

Both call the function ``all_gather_dp_groups`` of their own module on the same kind of
arguments (the list of flat groups, their equal partitions, one data-parallel process group
per flat group). :func:`flat_groups` reads one optimizer's groups as :class:`FlatGroups`,
the one description the adapter (:mod:`qzero.integrations.deepspeed`) and gather-ahead
(:mod:`qzero.integrations.deepspeed_ahead`) work from.
"""

from __future__ import annotations

from typing import Any, NamedTuple

#: The optimizer classes whose gather the adapter replaces: (module, class name).
ZERO_OPTIMIZER = ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer")
BF16_OPTIMIZER = ("deepspeed.runtime.bf16_optimizer", "BF16_Optimizer")
KNOWN_OPTIMIZERS = (ZERO_OPTIMIZER, BF16_OPTIMIZER)


class FlatGroups(NamedTuple):
    """One optimizer's flat groups, as its post-step gather sees them.

    ``flats`` is the very list the optimizer passes to ``all_gather_dp_groups`` (the
    adapter recognises its calls by it); per flat group ``i``: ``partitions[i]`` the
    ranks' equal views of it, ``params[i]``/``offsets[i]``/``numels[i]`` each parameter,
    where it starts in the flat group and its size, ``process_groups[i]`` the
    data-parallel group it is gathered over."""

    flats: list
    partitions: list
    params: list
    offsets: list
    numels: list
    process_groups: list
    allgather_bucket_size: int
    gather_module: str  # the module whose ``all_gather_dp_groups`` the optimizer calls


def known_class(opt: Any) -> tuple[str, str] | None:
    """``(module, class name)`` of ``opt``'s class when the adapter knows it, else None."""
    import importlib

    for module, name in KNOWN_OPTIMIZERS:
        if type(opt) is getattr(importlib.import_module(module), name):
            return module, name
    return None


def flat_groups(opt: Any) -> FlatGroups:
    """The :class:`FlatGroups` of a ``DeepSpeedZeroOptimizer`` or ``BF16_Optimizer``."""
    kind = known_class(opt)
    if kind == ZERO_OPTIMIZER:
        return FlatGroups(
            flats=opt.bit16_groups_flat,
            partitions=opt.parallel_partitioned_bit16_groups,
            params=opt.round_robin_bit16_groups,
            offsets=[[int(o) for o in offsets] for offsets in opt.round_robin_bit16_offsets],
            numels=[[int(m.numel()) for m in metas] for metas in opt.round_robin_bit16_meta],
            process_groups=opt.real_dp_process_group,
            allgather_bucket_size=int(opt.allgather_bucket_size),
            gather_module=ZERO_OPTIMIZER[0],
        )
    if kind == BF16_OPTIMIZER:
        numels = [[int(p.numel()) for p in group] for group in opt.bf16_groups]
        offsets = [[sum(sizes[:k]) for k in range(len(sizes))] for sizes in numels]
        _check_packed(opt.bf16_groups_flat, opt.bf16_groups, offsets)
        return FlatGroups(
            flats=opt.bf16_groups_flat,
            partitions=opt.bf16_partitioned_groups,
            params=opt.bf16_groups,
            offsets=offsets,
            numels=numels,
            process_groups=opt.real_dp_process_group,
            allgather_bucket_size=int(opt.allgather_bucket_size),
            gather_module=BF16_OPTIMIZER[0],
        )
    raise TypeError(f"{type(opt).__name__} is not an optimizer whose flat groups qzero knows")


def _check_packed(flats, params, offsets) -> None:
    """Each parameter must be the view of its flat group at its offset (BF16_Optimizer packs
    them back to back in parameter-group order)."""
    for i, (flat, group, starts) in enumerate(zip(flats, params, offsets)):
        base, size = flat.data_ptr(), flat.element_size()
        for p, start in zip(group, starts):
            if p.numel() and p.data_ptr() != base + start * size:
                raise RuntimeError(
                    f"BF16_Optimizer parameter group {i}: a parameter of shape {tuple(p.shape)} is not the view of "
                    f"elements [{start}, {start + p.numel()}) of its flat group; this DeepSpeed layout is not one "
                    "qzero knows"
                )
