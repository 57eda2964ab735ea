"""Copy-engine (zero-SM) collectives for qzero's own gather and all-to-all
(:attr:`qzero.ZeroConfig.copy_engine_collectives`).

[Note: copy-engine collectives]

NCCL (2.28 and later) can run an all-gather or an all-to-all on the GPU's copy engines,
with no SMs, when two things hold: the communicator was created with the zero-CTA policy
(``NCCL_CTA_POLICY_ZERO``; in PyTorch ``ProcessGroupNCCL.Options().config.cta_policy``), and
the buffers the collective reads and writes are registered into symmetric windows
(``NCCL_WIN_COLL_SYMMETRIC``; in PyTorch ``torch.distributed._symmetric_memory`` with the
``NCCL`` backend: memory from its pool, then ``rendezvous`` over the group). Where either
does not hold, NCCL runs its ordinary kernels: the bits are the same either way.

With the setting on, a :class:`~qzero.ZeroOptimizer` checks at construction that the
installed PyTorch and NCCL have every piece (:func:`check_copy_engine_support`; a missing
one is named, on every rank, before anything is modified), then creates one
:class:`CopyEngineComm`: a second process group over the same ranks with the zero-CTA
policy, used for the weight gather's chunks and the quantized gradient all-to-all only
(a reduce-scatter needs arithmetic, so the plain gradient reduction stays where it was),
and the symmetric buffers those collectives use.

Buffers: allocated once, kept by their user (a key) and reused every step, grown only when
a user asks for more. Registration is collective, so every rank must allocate in the same
order with the same sizes: the gather's sizes come from its plan (the same on every rank),
the all-to-all's from the largest payload of any rank (computed from the bucket's pieces,
the same on every rank). One user's buffers are views into one slab at offsets that are the
same on every rank (as symmetric windows require), each rounded up to
:data:`ALIGN` bytes: the weight gather's receive buffers together stay within one
bucket (plus that rounding), as without the setting, but they stay allocated between
steps instead of being freed after each gather.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

#: NCCL CE collectives first shipped in this release.
MIN_NCCL = (2, 28)
#: Buffers inside one slab start at multiples of this many bytes.
ALIGN = 256


def _nccl_version() -> tuple[int, ...] | None:
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a build without NCCL raises here; None says "no NCCL"
        return None
    return tuple(v) if isinstance(v, (tuple, list)) else None


def _cta_policy_missing() -> str | None:
    pg = getattr(dist, "ProcessGroupNCCL", None)
    if pg is None:
        return f"a PyTorch built with NCCL (torch {torch.__version__} has no torch.distributed.ProcessGroupNCCL)"
    try:
        has_option = hasattr(pg.Options().config, "cta_policy")
    except Exception:  # noqa: BLE001 - an older Options() has no .config
        has_option = False
    if not has_option or not hasattr(pg, "NCCL_CTA_POLICY_ZERO"):
        return (f"PyTorch's zero-CTA option (ProcessGroupNCCL.Options().config.cta_policy and "
                f"ProcessGroupNCCL.NCCL_CTA_POLICY_ZERO, which torch {torch.__version__} lacks)")
    return None


def _symmetric_memory_missing() -> str | None:
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except Exception:  # noqa: BLE001 - absent or broken: either way it is missing
        symm_mem = None
    need = ("set_backend", "get_mem_pool", "rendezvous")
    absent = [n for n in need if symm_mem is None or not hasattr(symm_mem, n)]
    if not hasattr(torch.cuda, "use_mem_pool"):
        absent.append("torch.cuda.use_mem_pool")
    if absent:
        return (f"PyTorch's NCCL symmetric memory (torch.distributed._symmetric_memory: {', '.join(absent)} "
                f"missing in torch {torch.__version__})")
    return None


def check_copy_engine_support(device, group) -> None:
    """Raise a ValueError naming every missing piece if copy-engine collectives cannot run for
    tensors on ``device`` over ``group`` (None: the default group); return None if they can.

    Local: it communicates nothing (the caller agrees on the outcome across ranks)."""
    device = torch.device(device)
    missing = []
    if device.type != "cuda":
        missing.append(f"CUDA tensors (the parameters are on {device})")
    if not dist.is_available() or not dist.is_initialized():
        missing.append("an initialized torch.distributed process group with the NCCL backend (none is initialized)")
    else:
        backend = str(dist.get_backend(group)).lower()
        if backend != "nccl":
            missing.append(f"a process group with the NCCL backend (this one's is {backend!r})")
        if group is not None and "sort_ranks" not in inspect.signature(dist.new_group).parameters:
            ranks = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
            if ranks != sorted(ranks):
                missing.append(f"a process group whose ranks ascend, or a PyTorch whose new_group takes sort_ranks "
                               f"(this group's global ranks are {ranks})")
    version = _nccl_version()
    if version is None:
        missing.append(f"NCCL >= {'.'.join(map(str, MIN_NCCL))} (this PyTorch reports no NCCL)")
    elif version[:2] < MIN_NCCL:
        missing.append(f"NCCL >= {'.'.join(map(str, MIN_NCCL))} (this PyTorch has NCCL {'.'.join(map(str, version))})")
    for check in (_cta_policy_missing, _symmetric_memory_missing):
        said = check()
        if said is not None:
            missing.append(said)
    if missing:
        raise ValueError(
            "copy_engine_collectives=True needs " + "; ".join(missing)
            + ". Set copy_engine_collectives=False to use NCCL's ordinary kernels (the same bits)."
        )


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class CopyEngineComm:
    """The zero-CTA process group over ``process_group``'s ranks, and the symmetric buffers of
    the collectives issued on it. Created collectively (every rank of ``process_group``), once,
    after :func:`check_copy_engine_support` passed on every rank."""

    def __init__(self, process_group, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem

        self._symm_mem = symm_mem
        self.device = torch.device(device)
        world = dist.get_world_size(process_group)
        # Global ranks in the order of the group's ranks: rank r of the new group is rank r of
        # process_group, so the gather's partitions and the all-to-all's splits mean the same.
        ranks = [dist.get_global_rank(process_group, r) if process_group is not None else r for r in range(world)]
        opts = dist.ProcessGroupNCCL.Options()
        opts.config.cta_policy = dist.ProcessGroupNCCL.NCCL_CTA_POLICY_ZERO
        order = {"sort_ranks": False} if "sort_ranks" in inspect.signature(dist.new_group).parameters else {}
        self.group = dist.new_group(ranks, backend="nccl", pg_options=opts, use_local_synchronization=True, **order)
        if dist.get_rank(self.group) != dist.get_rank(process_group):
            raise RuntimeError(  # check_copy_engine_support refuses such a group before
                f"the zero-CTA group numbers this rank {dist.get_rank(self.group)}, the optimizer's group "
                f"{dist.get_rank(process_group)}: this PyTorch sorts a new group's ranks, so a process group whose "
                "ranks are not in ascending order cannot use copy_engine_collectives"
            )
        symm_mem.set_backend("NCCL")
        # The communicator exists only after a first collective; a rendezvous needs it.
        dist.barrier(group=self.group, device_ids=[self.device.index or 0])
        self._slabs: dict = {}

    def buffers(self, key, count: int, nbytes: int) -> list[torch.Tensor]:
        """``count`` uint8 buffers of ``nbytes`` each for the user ``key`` (views into its slab,
        at offsets the same on every rank). Collective when the slab grows: every rank must ask
        in the same order with the same sizes. The previous views of ``key`` must be out of use
        (their work ordered before the caller's stream), as for memory a user frees."""
        if count == 0:
            return []
        stride = _aligned(max(nbytes, 1))
        need = count * stride
        slab = self._slabs.get(key)
        if slab is None or slab.numel() < need:
            self._slabs.pop(key, None)  # freed before the larger one is allocated
            slab = self._slabs[key] = self._allocate(need)
        return [slab[i * stride : i * stride + nbytes] for i in range(count)]

    def _allocate(self, nbytes: int) -> torch.Tensor:
        """A slab from the NCCL symmetric memory pool, registered over the group (collective)."""
        with torch.cuda.use_mem_pool(self._symm_mem.get_mem_pool(self.device)):
            slab = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._symm_mem.rendezvous(slab, group=self.group.group_name)
        return slab

    @property
    def held_bytes(self) -> int:
        """Bytes of symmetric memory held for reuse."""
        return sum(s.numel() for s in self._slabs.values())
