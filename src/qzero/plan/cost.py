"""The time a collective holds the links: its busiest port, plus its latency steps.

[Note: ports]
Every flow of a :class:`qzero.plan.traffic.Traffic` loads ports, each full duplex (a send
and a receive direction, each at the port's rate):

* a flow inside a node loads the sender's intra-node port (send) and the receiver's
  (receive), at ``intra_rate``;
* a flow between nodes loads a NIC at each end: ``shared``, the node's one NIC; ``rail``, the
  NIC of the sending (receiving) GPU. A ring's node-crossing edge is spread evenly over the
  NICs of the group's ranks on that node, as NCCL's channels each cross at another GPU.

The collective's wire time is its busiest port-direction's bytes over that port's rate: a ring
moves its bytes through every port at once (pipelined), an all-to-all's flows are concurrent,
and an incast (every sender to one owner) is held by the owner's receive port for the whole
group. Latency: ``inter_latency`` for each step across nodes, ``intra_latency`` for the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cluster import Cluster
from .traffic import Traffic


@dataclass(frozen=True)
class Cost:
    """One collective: ``seconds`` = ``wire`` + ``latency``; ``nic_sent`` bytes sent across the
    network by all nodes together; ``intra_sent`` bytes moved inside nodes; ``busiest``: the
    port that sets the wire time (``intra`` or ``nic``)."""

    seconds: float
    wire: float
    latency: float
    nic_sent: float
    intra_sent: float
    busiest: str = ""

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.seconds + other.seconds, self.wire + other.wire, self.latency + other.latency,
                    self.nic_sent + other.nic_sent, self.intra_sent + other.intra_sent, self.busiest or other.busiest)

    def times(self, count: float) -> Cost:
        return Cost(self.seconds * count, self.wire * count, self.latency * count, self.nic_sent * count,
                    self.intra_sent * count, self.busiest)


ZERO = Cost(0.0, 0.0, 0.0, 0.0, 0.0)


def latency(cluster: Cluster, steps: int, inter_steps: int) -> float:
    return inter_steps * cluster.inter_latency + (steps - inter_steps) * cluster.intra_latency


def cost_of(cluster: Cluster, traffic: Traffic) -> Cost:
    """The cost of one collective from its flows (see [Note: ports])."""
    load: dict[tuple, float] = {}

    def add(port: tuple, nbytes: float) -> None:
        load[port] = load.get(port, 0.0) + nbytes

    ring_nics = _ring_nics(cluster, traffic)
    nic_sent = intra_sent = 0.0
    for f in traffic.flows:
        a, b = cluster.node_of(f.src), cluster.node_of(f.dst)
        if a == b:
            add(("intra", "send", f.src), f.nbytes)
            add(("intra", "recv", f.dst), f.nbytes)
            intra_sent += f.nbytes
            continue
        nic_sent += f.nbytes
        sends = ring_nics.get((f.src, a), [cluster.nic_of(f.src)]) if f.ring else [cluster.nic_of(f.src)]
        recvs = ring_nics.get((f.dst, b), [cluster.nic_of(f.dst)]) if f.ring else [cluster.nic_of(f.dst)]
        for nic in sends:
            add(("nic", "send", nic), f.nbytes / len(sends))
        for nic in recvs:
            add(("nic", "recv", nic), f.nbytes / len(recvs))
    wire, busiest = 0.0, ""
    for port, nbytes in load.items():
        t = nbytes / (cluster.intra_rate if port[0] == "intra" else cluster.inter_rate)
        if t > wire:
            wire, busiest = t, port[0]
    lat = latency(cluster, traffic.steps, traffic.inter_steps)
    return Cost(wire + lat, wire, lat, nic_sent, intra_sent, busiest)


def _ring_nics(cluster: Cluster, traffic: Traffic) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """For each ring group and node: the NICs its node-crossing edges spread over, keyed by
    ``(rank, node)`` for every rank of the group on that node."""
    out = {}
    for group in traffic.groups:
        by_node: dict[int, list[int]] = {}
        for r in group:
            by_node.setdefault(cluster.node_of(r), []).append(r)
        for node, ranks in by_node.items():
            nics = sorted({cluster.nic_of(r) for r in ranks})
            for r in ranks:
                out[(r, node)] = nics
    return out
