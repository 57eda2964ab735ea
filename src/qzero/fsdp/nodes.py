"""Which nodes an FSDP2 parameter group's shard group spans (:attr:`qzero.ZeroConfig.ranks_per_node`,
:attr:`qzero.ZeroConfig.hierarchical_collectives`), for the installers of :mod:`qzero.fsdp`.

[Note: FSDP2 on several nodes]
FSDP2's all-gathers (plain, or carrying qzero's payloads: :mod:`qzero.fsdp.group`,
:mod:`qzero.fsdp.tensor`) are NCCL all-gathers: a ring over node-contiguous ranks crosses each
node boundary once per payload, so a node receives about the model's payload bytes whatever
its number of ranks. The flat quantized gradient reduce-scatter (:mod:`qzero.fsdp.reduce`) is an
all-to-all instead: every rank sends every other rank its part, so each node sends ``L`` times
what a node-aware reduce-scatter sends (``L`` ranks a node). Over a shard group of several
nodes of several ranks it therefore runs in two stages (unless
``hierarchical_collectives=false``): FSDP2 fixes that rank ``r`` owns part ``r`` of the input,
so each call first restages the ``P`` parts rail-major (row ``j n + i`` is the part of rank
``i L + j``: one copy of the input), which makes the rows what
:class:`qzero.wire.two_level.TwoLevelReduce` takes ([Note: rail-major partitions] in
:mod:`qzero.layout.topology`): a reduce-scatter inside the node in the reduce dtype, then the
quantized exchange among the node's rail on ``1/L`` of it, fp32 sums. An HSDP mesh that shards
inside the node needs none of this: its shard group is one node.

Every rank's host is exchanged once, over the group the installer agrees over (before anything
can fail locally, so no rank waits for another), and each parameter group's topology is decided
from its shard group's hosts by :func:`qzero.layout.topology.topology_from_hosts`: the same on
every rank of that group.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from ..layout.topology import Topology, topology_from_hosts
from ..wire.comm import agreement_device
from ..wire.two_level import exchange_hosts
from ._comms import distributed


def exchange_group_hosts(group) -> dict[int, tuple[int, int]] | None:
    """Every rank of ``group``'s host signature, by global rank (None without a process group,
    or where the exchange itself failed: a topology is then refused by :func:`shard_topology`)."""
    if not distributed():
        return None
    try:
        world = dist.get_world_size(group)
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        hosts = exchange_hosts(group, world, agreement_device(group, torch.device("cpu")))
    except Exception:  # noqa: BLE001 - reported (on every rank, agreed) by the installer that needs it
        return None
    return dict(zip(ranks, hosts))


def shard_topology(pg, hosts: dict[int, tuple[int, int]] | None, config) -> tuple[Topology, str | None]:
    """The topology of FSDP parameter group ``pg``'s shard group, for ``config``'s
    ``ranks_per_node`` and ``hierarchical_collectives``, and a warning where a detected placement
    that does not fit made it flat (:func:`qzero.layout.topology.topology_from_hosts`)."""
    group = pg.mesh_info.shard_process_group
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) == 1 or (config.hierarchical_collectives is False and config.ranks_per_node == 0):
        return Topology.flat(len(ranks)), None
    if hosts is None or any(r not in hosts for r in ranks):
        raise ValueError("the hosts of an FSDP module's shard group are not known (its mesh differs from the first "
                         "fully_shard module's); set hierarchical_collectives=false to skip the topology check")
    return topology_from_hosts([hosts[r] for r in ranks], config.ranks_per_node, config.hierarchical_collectives)


def two_level_groups(cache: dict, pg, topology: Topology):
    """The :class:`qzero.wire.two_level.TwoLevelGroups` of FSDP parameter group ``pg``'s shard
    group (``topology`` two-level), one per distinct shard group (``cache``). Collective: every
    rank of the shard group calls it for the same groups in the same order."""
    from ..wire.two_level import TwoLevelGroups

    group = pg.mesh_info.shard_process_group
    key = tuple(dist.get_process_group_ranks(group))
    if key not in cache:
        cache[key] = TwoLevelGroups(topology, group, group.rank(), torch.device(getattr(pg, "device", "cpu")))
    return cache[key]


def warn_once(warned: set, message: str | None) -> None:
    """Warn ``message`` (a topology's fallback to flat) once per installer call."""
    if message and message not in warned:
        warned.add(message)
        warnings.warn(f"qzero.fsdp: {message}", stacklevel=4)
