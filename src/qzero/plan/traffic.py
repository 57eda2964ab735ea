"""What one collective puts on the wire, rank to rank, the way NCCL runs it.

[Note: what NCCL does with a collective]
* **Ring collectives** (all-gather, reduce-scatter, all-reduce): the group's ranks form a
  ring in node-contiguous order (every node's ranks one after the other, the last of a node
  passing to the first of the next), so of a ring's ``m`` edges only ``k`` cross nodes (``k``
  the nodes the group spans; none when ``k == 1``). Every edge carries the same bytes: an
  all-gather of an ``S``-byte shard ``(m-1)·S``, a reduce-scatter of a ``B``-byte input
  ``(m-1)/m·B``, an all-reduce ``2(m-1)/m·B``. Steps: ``m-1`` (``2(m-1)`` for an all-reduce),
  ``k-1`` of them across nodes (``2(k-1)``). NCCL runs several rings at once (channels), each
  entering and leaving a node at another GPU: a ring's node-crossing bytes are spread over the
  NICs of the group's ranks on that node (:mod:`qzero.plan.cost`).
* **Chains** (reduce, broadcast): the ring without its closing edge, from the root
  (broadcast) or the same path back to it (reduce); every
  edge carries the whole ``B`` bytes (pipelined), ``m-1`` steps, ``k-1`` across nodes.
* **All-to-all**: every rank sends each other rank exactly its split; one step. Nothing is
  relayed: a split to another node crosses the network once, from the sender's NIC to the
  receiver's. A collective whose receives concentrate on a few ranks (an incast) is charged
  at its busiest port by the cost model, for the whole group.

:class:`Traffic` lists the flows of every group that runs the collective at once (a rail
collective runs on all ``L`` rails together), so the cost model sees what shares a port.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .cluster import Cluster

RING_OPS = ("all_gather", "reduce_scatter", "all_reduce")
CHAIN_OPS = ("reduce", "broadcast")
OPS = RING_OPS + CHAIN_OPS + ("all_to_all",)


@dataclass(frozen=True)
class Flow:
    """``nbytes`` from rank ``src`` to rank ``dst`` (global ranks). ``ring``: an edge of a ring
    or chain, whose node-crossing bytes NCCL spreads over its channels' NICs."""

    src: int
    dst: int
    nbytes: float
    ring: bool = False


@dataclass
class Traffic:
    """The flows of one collective (all its concurrent groups), and its latency steps."""

    flows: list[Flow] = field(default_factory=list)
    steps: int = 0  # steps of the collective, each paying one latency
    inter_steps: int = 0  # of which across nodes
    groups: list[list[int]] = field(default_factory=list)

    def node_matrix(self, cluster: Cluster) -> dict[tuple[int, int], float]:
        """Bytes by ``(source node, destination node)``; the diagonal is traffic inside a node."""
        out: dict[tuple[int, int], float] = {}
        for f in self.flows:
            key = (cluster.node_of(f.src), cluster.node_of(f.dst))
            out[key] = out.get(key, 0.0) + f.nbytes
        return out


def edge_bytes(op: str, m: int, nbytes: float) -> float:
    """Bytes on every edge of a ring (or chain) of ``m`` ranks (see the note)."""
    if m <= 1:
        return 0.0
    if op == "all_gather":
        return (m - 1) * nbytes
    if op == "reduce_scatter":
        return (m - 1) / m * nbytes
    if op == "all_reduce":
        return 2 * (m - 1) / m * nbytes
    if op in CHAIN_OPS:
        return float(nbytes)
    raise ValueError(f"{op!r} is not a ring collective; expected one of {', '.join(RING_OPS + CHAIN_OPS)}")


def ring_steps(op: str, m: int, k: int) -> tuple[int, int]:
    """``(steps, steps across nodes)`` of a ring or chain of ``m`` ranks over ``k`` nodes."""
    if m <= 1:
        return 0, 0
    factor = 2 if op == "all_reduce" else 1
    return factor * (m - 1), factor * (k - 1)


def ring_order(cluster: Cluster, group: list[int]) -> list[int]:
    """The group in node-contiguous ring order."""
    return sorted(group, key=lambda r: (cluster.node_of(r), cluster.local_of(r)))


def ring_traffic(cluster: Cluster, op: str, groups: list[list[int]], nbytes: float, root: int = 0) -> Traffic:
    """Flows of ring (or chain) collective ``op`` on each of ``groups`` at once; ``nbytes`` as in
    :func:`edge_bytes`; ``root``: the index in the group of a chain's root."""
    t = Traffic(groups=[list(g) for g in groups])
    for group in groups:
        order = ring_order(cluster, group)
        m = len(order)
        e = edge_bytes(op, m, nbytes)
        k = len({cluster.node_of(r) for r in order})
        t.steps, t.inter_steps = (max(a, b) for a, b in zip((t.steps, t.inter_steps), ring_steps(op, m, k)))
        if m <= 1:
            continue
        if op in CHAIN_OPS:  # around the ring without the closing edge: from the root, or back to it
            start = order.index(group[root])
            chain = order[start:] + order[:start]
            edges = list(zip(chain, chain[1:]))
            if op == "reduce":
                edges = [(b, a) for a, b in reversed(edges)]
        else:
            edges = list(zip(order, order[1:] + order[:1]))
        t.flows += [Flow(a, b, e, ring=True) for a, b in edges]
    return t


def all_to_all_traffic(groups: list[list[int]], splits: list[list[list[float]]]) -> Traffic:
    """Flows of one all-to-all on each of ``groups`` at once: ``splits[g][i][j]`` bytes from
    the ``i``-th to the ``j``-th rank of group ``g`` (the diagonal stays on the rank)."""
    t = Traffic(groups=[list(g) for g in groups])
    for group, matrix in zip(groups, splits, strict=True):
        if len(matrix) != len(group) or any(len(row) != len(group) for row in matrix):
            raise ValueError(f"an all-to-all over {len(group)} ranks needs a {len(group)} x {len(group)} split matrix")
        for i, row in enumerate(matrix):
            for j, b in enumerate(row):
                if i != j and b:
                    t.flows.append(Flow(group[i], group[j], float(b)))
        if len(group) > 1:
            t.steps = 1
    return t


def inter_steps_of_all_to_all(cluster: Cluster, t: Traffic) -> Traffic:
    """Set an all-to-all's one step to cross nodes when any of its flows does."""
    if any(cluster.node_of(f.src) != cluster.node_of(f.dst) for f in t.flows):
        t.inter_steps = t.steps
    return t
