"""One process as rank 0 of a DP-N world under torch's ``fake`` process group, whose
collectives return at once and move nothing: everything local to rank 0 (shard sizes,
buckets, staging buffers, kernels, allocations) runs as at DP-N, with no link and
meaningless values. Good for peak memory and for an engine's own local work."""

from __future__ import annotations

import torch.distributed as dist


def launcher_environment(world: int) -> dict[str, str]:
    """What a launcher sets for rank 0 of ``world`` (DeepSpeed asks for it; the process group
    itself is made by :func:`init_fake_world` or the emulated world)."""
    return dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")


def init_fake_world(world: int) -> None:
    """Make this process rank 0 of ``world`` under the ``fake`` process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if world < 1:
        raise SystemExit(f"a fake world needs at least 1 rank, got {world}")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
