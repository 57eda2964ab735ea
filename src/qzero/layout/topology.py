"""The topology of a data-parallel group: nodes of ranks, rails, and who owns which partition.

[Note: rail-major partitions]
On ``n`` nodes of ``L`` ranks (rank ``r = i L + j``: node ``i``, local index ``j``, torchrun's
placement) two-level collectives move data in two stages: inside a node, then across nodes
among the ranks of one *rail* (the ``n`` ranks with the same local index ``j``). A gradient
bucket staged as one row per partition is reduce-scattered inside the node into ``L`` equal
blocks, block ``j`` to local rank ``j``; that block is then exchanged over rail ``j``, piece
``i`` to node ``i``. For the piece a rank ends with to be its own partition, block ``j`` must
hold the partitions of rail ``j`` in node order: partition ``q = j n + i`` belongs to rank
``i L + j`` (*rail-major*). The weight gather runs the same stages backwards: each rank's
payload is gathered over its rail (partitions ``j n .. j n + n - 1``, contiguous), then the
node gathers the ``L`` rail blocks (partitions ``0 .. P - 1`` in order). Neither direction
then permutes anything: the flat buffer stays in partition order, the layout and the
planner are unchanged, and only the map from partitions to ranks differs. With one node, or
one rank per node, the map is the identity and the collectives are the flat ones.

Pure: no process group, no tensor.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    """``nodes`` x ``ranks_per_node`` ranks; ``two_level``: whether the collectives run in two
    stages (then partitions are numbered rail-major, [Note: rail-major partitions])."""

    nodes: int
    ranks_per_node: int
    two_level: bool = False

    def __post_init__(self) -> None:
        for name in ("nodes", "ranks_per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.two_level and (self.nodes < 2 or self.ranks_per_node < 2):
            raise ValueError(
                f"two-level collectives need more than one node and more than one rank per node, got "
                f"{self.nodes} node(s) of {self.ranks_per_node} rank(s)")

    @classmethod
    def flat(cls, world: int) -> Topology:
        """One node of ``world`` ranks: the flat collectives."""
        return cls(1, world)

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_of(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def partition_of(self, rank: int) -> int:
        """The partition rank ``rank`` owns."""
        if not self.two_level:
            return rank
        return self.local_of(rank) * self.nodes + self.node_of(rank)

    def rank_of(self, partition: int) -> int:
        """The rank that owns ``partition``."""
        if not self.two_level:
            return partition
        local, node = divmod(partition, self.nodes)
        return node * self.ranks_per_node + local

    def node_ranks(self, node: int) -> list[int]:
        """The ranks of node ``node``, in local order."""
        return [node * self.ranks_per_node + j for j in range(self.ranks_per_node)]

    def rail_ranks(self, local: int) -> list[int]:
        """The ranks of rail ``local`` (local index ``local`` on every node), in node order."""
        return [i * self.ranks_per_node + local for i in range(self.nodes)]

    def describe(self) -> str:
        mode = "two-level" if self.two_level else "flat"
        return f"{self.nodes} node(s) x {self.ranks_per_node} rank(s), {mode} collectives"


def resolve_topology(world: int, ranks_per_node: int, hierarchical) -> Topology:
    """The topology of ``world`` ranks with ``ranks_per_node`` per node (already detected or
    given) and the ``hierarchical_collectives`` setting (``auto``/true/false). Refuses a node
    size that does not divide the world, and ``true`` where two levels cannot run."""
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be a positive int here, got {ranks_per_node!r}")
    if world % ranks_per_node:
        raise ValueError(
            f"ranks_per_node={ranks_per_node} does not divide the world size {world}: nodes must hold the same "
            "number of ranks (set ranks_per_node to the ranks of one node, or 0 to detect it)")
    nodes = world // ranks_per_node
    possible = nodes > 1 and ranks_per_node > 1
    if hierarchical is True and not possible:
        raise ValueError(
            f"hierarchical_collectives=true needs more than one node and more than one rank per node; this group is "
            f"{nodes} node(s) of {ranks_per_node} rank(s) (set ranks_per_node, or hierarchical_collectives='auto')")
    two = possible and hierarchical in (True, "auto")
    return Topology(nodes, ranks_per_node, two)


def _runs(hosts: list[int]) -> list[tuple[int, int, int]]:
    """``(host, first rank, count)`` for every run of consecutive ranks on one host."""
    runs: list[list[int]] = []
    for r, h in enumerate(hosts):
        if runs and runs[-1][0] == h:
            runs[-1][2] += 1
        else:
            runs.append([h, r, 1])
    return [tuple(x) for x in runs]


def topology_from_hosts(signatures, ranks_per_node: int, hierarchical) -> tuple[Topology, str | None]:
    """The topology of ranks whose ``(host, LOCAL_WORLD_SIZE)`` are ``signatures`` (by rank;
    ``LOCAL_WORLD_SIZE`` 0 where unset), for the ``ranks_per_node`` and
    ``hierarchical_collectives`` settings; and a warning, when a detected placement that does not
    fit made it fall back to the flat collectives. Raises where the settings contradict the hosts.

    ``ranks_per_node`` given (> 0): each declared node must lie on one host (several declared
    nodes may share one: pseudo-nodes). ``0``: the hosts decide; ranks of one host must be
    consecutive, all hosts must hold the same number of ranks, and that number must match
    ``LOCAL_WORLD_SIZE`` where it is set. ``hierarchical_collectives=false`` needs none of this."""
    world = len(signatures)
    hosts = [h for h, _ in signatures]
    if hierarchical is False and ranks_per_node == 0:
        return Topology.flat(world), None
    if ranks_per_node > 0:
        if world % ranks_per_node == 0:
            for i in range(world // ranks_per_node):
                block = hosts[i * ranks_per_node:(i + 1) * ranks_per_node]
                if len(set(block)) > 1:
                    a, b = i * ranks_per_node, (i + 1) * ranks_per_node - 1
                    raise ValueError(
                        f"ranks_per_node={ranks_per_node} contradicts the hosts: declared node {i} (ranks {a}..{b}) "
                        f"spans {len(set(block))} hosts; set ranks_per_node to the ranks of one host (or 0 to detect)")
        return resolve_topology(world, ranks_per_node, hierarchical), None
    runs = _runs(hosts)
    problem = None
    if len({h for h, _, _ in runs}) != len(runs):
        problem = "the ranks of a host are not consecutive (a cyclic placement)"
    elif len({c for _, _, c in runs}) > 1:
        problem = f"the hosts hold different numbers of ranks ({sorted({c for _, _, c in runs})})"
    else:
        lws = {n for _, n in signatures if n}
        if len(lws) > 1 or (lws and lws != {runs[0][2]}):
            problem = (f"LOCAL_WORLD_SIZE ({sorted(lws)}) does not match the {runs[0][2]} rank(s) per host name "
                       "(duplicate host names?)")
    if problem is None:
        return resolve_topology(world, runs[0][2], hierarchical), None
    if hierarchical is True:
        raise ValueError(f"hierarchical_collectives=true, but {problem}; set ranks_per_node to declare the nodes, or "
                         "hierarchical_collectives='auto' to run the flat collectives")
    return Topology.flat(world), (f"{problem}: running the flat collectives (set ranks_per_node to declare the "
                                  "nodes, or hierarchical_collectives=false to silence this)")
