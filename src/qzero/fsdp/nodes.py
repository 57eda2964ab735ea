"""Which nodes an FSDP2 parameter group's shard group spans (:attr:`qzero.ZeroConfig.ranks_per_node`,
:attr:`qzero.ZeroConfig.hierarchical_collectives`), for the installers of :mod:`qzero.fsdp`.

[Note: FSDP2 on several nodes]
FSDP2's all-gathers (plain, or carrying qzero's payloads: :mod:`qzero.fsdp.group`,
:mod:`qzero.fsdp.tensor`) are NCCL all-gathers: a ring over node-contiguous ranks crosses each
node boundary once per payload, so a node receives about the model's payload bytes whatever
its number of ranks. The quantized gradient reduce-scatter (:mod:`qzero.fsdp.reduce`) is an
all-to-all instead: every rank sends every other rank its part, so each node sends ``L`` times
what a node-aware reduce-scatter sends (``L`` ranks a node). Over a shard group of several
nodes of several ranks it is therefore refused, naming what to use instead (shard inside the
node with an HSDP mesh, FSDP2's own reduce-scatter, or ``hierarchical_collectives=false`` to
accept the flat exchange); FSDP2 fixes which rank owns which part, so qzero cannot renumber the
partitions rail-major as the ZeroOptimizer does ([Note: rail-major partitions] in
:mod:`qzero.layout.topology`).

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


def refuse_flat_exchange(name: str, topology: Topology, function: str) -> None:
    """Raise where a quantized all-to-all over ``topology`` would be flat across several nodes of
    several ranks ([Note: FSDP2 on several nodes])."""
    if not topology.two_level:
        return
    L = topology.ranks_per_node
    raise ValueError(
        f"qzero.fsdp.{function}: FSDP module {name or '<root>'!r} shards over {topology.nodes} nodes x {L} ranks, "
        f"where the quantized reduce-scatter (an all-to-all) sends each node's gradients across the network {L} "
        "times; shard inside the node and replicate across nodes (an HSDP mesh), leave the reduce-scatter to FSDP2, "
        "or set hierarchical_collectives=false to run the flat exchange knowingly")


def warn_once(warned: set, message: str | None) -> None:
    """Warn ``message`` (a topology's fallback to flat) once per installer call."""
    if message and message not in warned:
        warned.add(message)
        warnings.warn(f"qzero.fsdp: {message}", stacklevel=4)
