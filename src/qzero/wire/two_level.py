"""Two-level collectives: the node's and the rail's process groups, and the gather and gradient
reduction that run in two stages over them (:attr:`qzero.ZeroConfig.hierarchical_collectives`).

Which rank owns which partition, and why nothing is permuted, is [Note: rail-major partitions]
in :mod:`qzero.layout.topology`. Here:

* :func:`exchange_hosts` - every rank's host, exchanged once; the topology it implies is
  :func:`qzero.layout.topology.topology_from_hosts`'s decision, the same on every rank.
* :class:`TwoLevelGroups` - this rank's node group and rail group (a 2-D ``DeviceMesh`` over
  the data-parallel ranks: dimension ``node`` varies along a rail, ``local`` inside a node).
* :meth:`TwoLevelGroups.all_gather` - the weight gather's collective: the payload over the
  rail, then the rail's block over the node; what every rank unpacks is the same bytes, so
  replicas stay bit-identical.
* :class:`TwoLevelReduce` - a gradient bucket of one row per partition: reduce-scattered inside
  the node (in the reduce dtype), then reduced over the rail on ``1/L`` of it, plainly
  (reduce-scatter) or quantized (the all-to-all of :mod:`qzero.wire.quantized_reduce` over the
  rail's ``n`` ranks, fp32 sums). No stage is an incast: every rank of a group sends and
  receives the same amount. With a quantized node stage
  (:attr:`qzero.ZeroConfig.zero_quantized_gradients_intra_node`) the node's reduce-scatter is
  an all-to-all too: local rank ``j`` gets the rows of partitions ``j n + i`` (``i < n``) from
  the node's ``L`` ranks as int8 payloads and sums them in fp32; the rail stage quantizes that
  fp32 block (its small parameters travel in fp32, so they stay exact across both stages).

[Note: two-level pipelining]
The rail stage of a bucket needs its node stage's result. A bucket's node stage is launched
when the bucket is; its rail stage when the *next* bucket is launched, or when the bucket is
finished if that comes first. So the node stage of one bucket overlaps the backward of the next
and the host never waits for it early. Every rank launches and finishes buckets in one shared
order, so the collectives of both groups are issued in the same order everywhere.
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections import deque

import torch
import torch.distributed as dist

from ..layout.topology import Topology
from .chunks import all_gather_into, peer_failure

#: torch.distributed's reduce-scatter into one output tensor (renamed ``reduce_scatter_single`` in torch 2.13).
reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def host_signature() -> tuple[int, int]:
    """This rank's host (a 62-bit hash of its name) and ``LOCAL_WORLD_SIZE`` (0 where unset)."""
    h = int.from_bytes(hashlib.blake2b(socket.gethostname().encode(), digest_size=8).digest(), "little") >> 2
    try:
        lws = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    except ValueError:
        lws = 0
    return h, max(lws, 0)


def exchange_hosts(group, world: int, device) -> list[tuple[int, int]]:
    """Every rank's :func:`host_signature`, by rank (one all-gather of two integers)."""
    mine = host_signature()
    if world == 1:
        return [mine]
    sig = torch.tensor(mine, dtype=torch.int64, device=device)
    table = torch.empty(2 * world, dtype=torch.int64, device=device)
    with peer_failure("the topology exchange"):
        all_gather_into(table, sig, group=group)
    rows = table.view(world, 2).tolist()
    return [(int(h), int(n)) for h, n in rows]


class _Chained:
    """The last work of a chain of collectives, keeping their intermediate buffers alive."""

    def __init__(self, work, keep):
        self._work, self._keep = work, keep

    def wait(self, *args):
        out = self._work.wait(*args)
        self._keep = None
        return out

    def is_completed(self) -> bool:
        return self._work.is_completed()


class TwoLevelGroups:
    """This rank's node and rail groups over ``process_group``'s ranks (``topology`` two-level)."""

    def __init__(self, topology: Topology, process_group, rank: int, device: torch.device):
        if not topology.two_level:
            raise ValueError(f"TwoLevelGroups needs a two-level topology, got {topology.describe()}")
        self.topology = topology
        self.rank = rank
        self.node = topology.node_of(rank)
        self.local = topology.local_of(rank)
        n, L = topology.nodes, topology.ranks_per_node
        ranks = [dist.get_global_rank(process_group, r) if process_group is not None else r
                 for r in range(topology.world)]
        if len(ranks) == dist.get_world_size():
            from torch.distributed.device_mesh import DeviceMesh

            mesh = DeviceMesh(device.type, torch.tensor(ranks).view(n, L), mesh_dim_names=("node", "local"))
            self.node_group = mesh.get_group("local")
            self.rail_group = mesh.get_group("node")
        else:  # a data-parallel group inside a larger world: only its members create these
            self.node_group = dist.new_group([ranks[r] for r in topology.node_ranks(self.node)],
                                             use_local_synchronization=True)
            self.rail_group = dist.new_group([ranks[r] for r in topology.rail_ranks(self.local)],
                                             use_local_synchronization=True)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = True):
        """``output`` = every partition's ``input`` in partition order: over the rail (``n``
        payloads, partitions ``j n .. j n + n - 1``), then over the node. ``group`` is ignored
        (the signature is :func:`qzero.wire.chunks.all_gather_into`'s)."""
        rail = torch.empty(self.topology.nodes * input.numel(), dtype=input.dtype, device=input.device)
        first = all_gather_into(rail, input, group=self.rail_group, async_op=True)
        first.wait()  # on CUDA: the issuing stream waits, not the host
        second = all_gather_into(output, rail, group=self.node_group, async_op=True)
        chained = _Chained(second, rail)
        if not async_op:
            chained.wait()
            return None
        return chained


class _Bucket:
    __slots__ = ("key", "buf", "width", "node_work", "block", "rail", "result")

    def __init__(self, key, buf, width):
        self.key, self.buf, self.width = key, buf, width
        self.node_work = self.block = self.rail = self.result = None


class TwoLevelReduce:
    """Reduce buckets of ``[P, width]`` rows (row ``q``: partition ``q``'s elements) so that
    each rank gets the sum of its own row, in two stages ([Note: two-level pipelining]).

    ``quantized``: a :class:`qzero.wire.quantized_reduce.QuantizedExchange` over the rail (its
    rank is this rank's node) for the rail stage, or None for a plain reduce-scatter;
    ``node_quantized``: one over the node (its rank is this rank's local index) for the node
    stage, or None for a reduce-scatter in the reduce dtype."""

    def __init__(self, groups: TwoLevelGroups, partition_numel: int, quantized=None, node_quantized=None):
        self.groups = groups
        self.n = groups.topology.nodes
        self.L = groups.topology.ranks_per_node
        self.p = partition_numel
        self.quantized = quantized
        self.node_quantized = node_quantized
        self._waiting: deque[_Bucket] = deque()  # node stage launched, rail stage not yet

    def rail_parts(self, lo: int, width: int) -> list[tuple[int, int, int, int]]:
        """The rail stage's pieces of a window at local offset ``lo``: ``(node, offset, numel,
        flat_lo)`` (piece ``i`` is partition ``j n + i``'s row, for node ``i``)."""
        j = self.groups.local
        return [(i, i * width, width, (j * self.n + i) * self.p + lo) for i in range(self.n)]

    def node_parts(self, lo: int, width: int) -> list[tuple[int, int, int, tuple[int, ...]]]:
        """The quantized node stage's pieces of a window at local offset ``lo``: ``(local,
        offset, numel, row starts)`` (local rank ``j``'s piece: the ``n`` rows of partitions
        ``j n + i``, one block of the staging buffer, apart in flat space)."""
        n = self.n
        return [(j, j * n * width, n * width, tuple((j * n + i) * self.p + lo for i in range(n)))
                for j in range(self.L)]

    def launch(self, buf: torch.Tensor, key, width: int, lo: int) -> _Bucket:
        """Start the node stage of a bucket (and the rail stage of the one before it)."""
        b = _Bucket((key, lo), buf, width)
        if self.node_quantized is not None:
            b.node_work, _ = self.node_quantized.launch(buf, b.key, self.node_parts(lo, width))
        else:
            b.block = torch.empty(self.n * width, dtype=buf.dtype, device=buf.device)
            with peer_failure("the gradient reduction (inside the node)"):
                b.node_work = reduce_scatter_into(b.block, buf, group=self.groups.node_group, async_op=True)
        while self._waiting:
            self._launch_rail(self._waiting.popleft())
        self._waiting.append(b)
        return b

    def _launch_rail(self, b: _Bucket) -> None:
        if self.node_quantized is not None:
            b.block, _ = self.node_quantized.finish(b.node_work, b.key)  # fp32 sums of this rank's block
        else:
            with peer_failure("the gradient reduction (inside the node)"):
                b.node_work.wait()
        b.node_work = None
        lo = b.key[1]
        if self.quantized is not None:
            b.rail, _ = self.quantized.launch(b.block, b.key, self.rail_parts(lo, b.width))
            return
        out = torch.empty(b.width, dtype=b.block.dtype, device=b.block.device)
        with peer_failure("the gradient reduction (across nodes)"):
            b.rail = (reduce_scatter_into(out, b.block, group=self.groups.rail_group, async_op=True), out)

    def rail_bytes(self, b: _Bucket) -> int:
        """What this rank sends in the rail stage of ``b``."""
        if self.quantized is None:
            return (self.n - 1) * b.width * b.buf.element_size()
        pieces = self.quantized.pieces(b.key, self.rail_parts(b.key[1], b.width))
        return sum(p.layout.nbytes for p in pieces if p.dest != self.groups.node)

    def node_bytes(self, b: _Bucket) -> int:
        """What this rank sends in the node stage of ``b`` (a reduce-scatter's share, or the
        quantized payloads to the node's other ranks)."""
        if self.node_quantized is None:
            return (self.L - 1) * self.n * b.width * b.buf.element_size()
        pieces = self.node_quantized.pieces(b.key, self.node_parts(b.key[1], b.width))
        return sum(p.layout.nbytes for p in pieces if p.dest != self.groups.local)

    def finish(self, b: _Bucket):
        """Wait for ``b``; returns ``(sum of this rank's row, fp32 or the reduce dtype)``."""
        if b.rail is None:
            self._waiting.remove(b)
            self._launch_rail(b)
        if self.quantized is not None:
            out, _ = self.quantized.finish(b.rail, b.key)
        else:
            work, out = b.rail
            with peer_failure("the gradient reduction (across nodes)"):
                work.wait()
        b.rail = b.block = None
        return out
