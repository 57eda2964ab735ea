"""A cluster as the cost model sees it: ``n`` nodes of ``L`` GPUs, two tiers of links.

[Note: the cluster]
* **ranks**: ``P = n * L``; rank ``r`` sits on node ``r // L`` at local index ``r % L``
  (torchrun's placement: ranks ``i*L ... i*L + L - 1`` form node ``i``).
* **intra-node link**: every GPU has one port into its node's fabric (an NVLink switch, or a
  PCIe switch), ``intra_rate`` bytes per second per direction, ``intra_latency`` seconds per
  step of a collective. Ports are full duplex: sending and receiving do not share a rate.
* **NIC**: ``shared``: one NIC per node, ``inter_rate`` per direction, used by every GPU of
  the node at once; ``rail``: one NIC per GPU (GPU ``i`` of every node on rail ``i``), each
  ``inter_rate``. ``inter_latency`` per step of a collective that crosses nodes. The network
  behind the NICs is taken as non-blocking (no oversubscription, no congestion): a NIC's own
  rate is the only limit.
* Not modelled: the GPU's PCIe hop to its NIC, NCCL's protocol overheads beyond one latency
  a step, and link time lost to congestion control. Every prediction of the model is a
  projection from these assumptions, not a measurement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..vocabulary import NICS  # noqa: E402  (one spelling of the NIC kinds)


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``gpus_per_node`` GPUs; rates in bytes per second per direction, latencies in
    seconds (see [Note: the cluster])."""

    nodes: int
    gpus_per_node: int
    intra_rate: float
    inter_rate: float
    intra_latency: float = 0.0
    inter_latency: float = 0.0
    nic: str = "shared"

    def __post_init__(self):
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("intra_rate", "inter_rate"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value) or value <= 0:
                raise ValueError(f"{name} must be a positive number of bytes per second, got {value!r}")
        for name in ("intra_latency", "inter_latency"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        if self.nic not in NICS:
            raise ValueError(f"nic must be one of {', '.join(NICS)}, got {self.nic!r}")

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def local_of(self, rank: int) -> int:
        return rank % self.gpus_per_node

    def nic_of(self, rank: int) -> tuple[int, int]:
        """The NIC port rank ``rank``'s node-crossing traffic goes through: ``(node, index)``."""
        return (self.node_of(rank), 0 if self.nic == "shared" else self.local_of(rank))

    def with_nodes(self, nodes: int) -> Cluster:
        return Cluster(nodes, self.gpus_per_node, self.intra_rate, self.inter_rate, self.intra_latency,
                       self.inter_latency, self.nic)

    def describe(self) -> str:
        return (f"{self.nodes} x {self.gpus_per_node} GPUs; inside a node {self.intra_rate / 1e9:.4g} GB/s, "
                f"{self.intra_latency * 1e6:.3g} us a step; across nodes {self.inter_rate / 1e9:.4g} GB/s per NIC "
                f"({self.nic}), {self.inter_latency * 1e6:.3g} us a step")


#: The scopes of a collective: which groups of ranks run it, all at once.
#: ``world``: one group of every rank; ``rail``: ``L`` groups, one per local index (one rank
#: per node each); ``node``: ``n`` groups, one per node.
SCOPES = ("world", "rail", "node")


def groups_of(cluster: Cluster, scope: str) -> list[list[int]]:
    """The groups of ``scope`` (see :data:`SCOPES`), each a list of global ranks in ring order
    (node-contiguous)."""
    n, L = cluster.nodes, cluster.gpus_per_node
    if scope == "world":
        return [list(range(n * L))]
    if scope == "rail":
        return [[node * L + i for node in range(n)] for i in range(L)]
    if scope == "node":
        return [[node * L + i for i in range(L)] for node in range(n)]
    raise ValueError(f"unknown scope {scope!r}; expected one of {', '.join(SCOPES)}")
