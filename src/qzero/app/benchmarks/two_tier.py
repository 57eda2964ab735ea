"""The two-tier link of a one-GPU cluster emulation: what each collective of rank 0 costs on a
cluster of ``n`` nodes x ``L`` GPUs (an intra-node link and NICs), by the plan's cost model.

[Note: two-tier charge]
The one-link emulator (rank 0 of a fake world does the real work; each collective holds a
modelled link for its time) charged rank 0's own bytes on one link. Here a collective is
charged by :mod:`qzero.plan` for the *whole* group and every group running it at once:

* the group's scope is read from its ranks: every rank (``world``), one rank per node at one
  local index (``rail``: all ``L`` rails run it together), one node's ranks (``node``: every
  node runs it together); any other group is charged alone;
* ring collectives (all-gather, reduce-scatter, all-reduce) and chains (broadcast, reduce) by
  :func:`qzero.plan.collective_cost`, so a ring pays only its node-crossing edges on the NICs
  and ``P-1`` latency steps, ``n-1`` across nodes;
* an all-to-all from every rank's splits. Rank 0 knows only its own; qzero's exchanges send
  every owner the same piece from every other rank (the bucket's layout is the same on every
  rank), so rank ``s`` sends rank ``d`` what rank 0 sends ``d`` (``d != 0``), and rank 0 what
  rank 0 receives from any rank (:func:`splits_from_rank0`). With those, an exchange whose
  pieces go to one or two owners is charged as the incast it is, at the owners' ports.

:class:`TwoTierTimeline` places charged collectives on two resources, the intra-node link and
the NICs: a collective holds those it loads, starts when they are free and the call was
issued, and lasts its charge (the stages of a two-level collective thus overlap when issued
back to back on different links). Everything here is host arithmetic, testable on a CPU; on
CUDA, the emulator's hold kernel keeps a stream busy for the charged time.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from ...plan.cluster import Cluster, groups_of
from ...plan.collectives import collective_cost
from ...plan.cost import Cost, cost_of
from ...plan.traffic import all_to_all_traffic, inter_steps_of_all_to_all

RING = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "reduce")


def scope_of(cluster: Cluster, ranks: list[int]) -> str | None:
    """``world``, ``rail``, ``node`` or None (a group of no scope) for a group of global ranks."""
    rs = sorted(ranks)
    if rs == list(range(cluster.world)):
        return "world"
    for scope in ("rail", "node"):
        if any(sorted(g) == rs for g in groups_of(cluster, scope)):
            return scope
    return None


def splits_from_rank0(send: list[float], recv: list[float]) -> list[list[float]]:
    """Every rank's all-to-all splits from rank 0's (see the note): ``m[s][d]``, bytes ``s`` -> ``d``."""
    n = len(send)
    if len(recv) != n:
        raise ValueError(f"{n} send splits and {len(recv)} receive splits")
    piece = [send[d] if d else max(recv[1:], default=0) for d in range(n)]
    return [[0 if s == d else piece[d] for d in range(n)] for s in range(n)]


class TwoTierCharge:
    """Seconds and bytes of each collective on ``cluster`` (see the note)."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster

    def ring(self, op: str, ranks: list[int], nbytes: float) -> Cost:
        """A ring or chain collective on the group ``ranks``; ``nbytes`` as
        :func:`qzero.plan.collective_cost` reads it."""
        if op not in RING:
            raise ValueError(f"{op!r} is not a ring collective ({', '.join(RING)})")
        scope = scope_of(self.cluster, ranks)
        if scope is not None:
            return collective_cost(self.cluster, op, scope, nbytes)
        from ...plan.traffic import ring_traffic

        return cost_of(self.cluster, ring_traffic(self.cluster, op, [ranks], nbytes))

    def all_to_all(self, ranks: list[int], send: list[float], recv: list[float]) -> Cost:
        """An all-to-all on ``ranks`` whose position-0 rank sends ``send`` and receives ``recv``
        (bytes per peer, in group order); every group of the same scope runs it at once."""
        matrix = splits_from_rank0(send, recv)
        scope = scope_of(self.cluster, ranks)
        groups = groups_of(self.cluster, scope) if scope is not None else [sorted(ranks)]
        t = all_to_all_traffic(groups, [matrix] * len(groups))
        return cost_of(self.cluster, inter_steps_of_all_to_all(self.cluster, t))

    def collective(self, op: str, ranks: list[int], nbytes: float = 0.0, send: list[float] | None = None,
                   recv: list[float] | None = None) -> Cost:
        """The charge of one collective as the one-GPU emulator names them (``all_gather`` with
        the shard's bytes, ``reduce_scatter`` with the input's, ``all_reduce``, ``broadcast``,
        ``reduce`` with the tensor's, ``all_to_all`` with rank 0's ``send``/``recv`` splits,
        ``barrier``): what the emulator holds its links for, in place of its one-link charge."""
        if op == "all_to_all":
            if send is None or recv is None:
                raise ValueError("an all-to-all is charged from rank 0's send and receive splits")
            return self.all_to_all(ranks, send, recv)
        if op == "barrier":
            steps, inter = (1, int(self.cluster.nodes > 1)) if len(ranks) > 1 else (0, 0)
            lat = inter * self.cluster.inter_latency + (steps - inter) * self.cluster.intra_latency
            return Cost(lat, 0.0, lat, 0.0, 0.0)
        return self.ring(op, ranks, nbytes)


@dataclass
class Placed:
    op: str
    start: float
    end: float
    cost: Cost


def resources_of(cost: Cost) -> tuple[str, ...]:
    """The resources a charged collective holds: ``intra`` where it moves bytes inside nodes,
    ``nic`` where it sends any across (a collective that moves nothing: the intra-node link,
    for its latency)."""
    return tuple(r for r, b in (("intra", cost.intra_sent), ("nic", cost.nic_sent)) if b > 0) or ("intra",)


class TwoTierTimeline:
    """Charged collectives on two resources, the intra-node link and the NICs (see the note);
    the newest ``keep`` placements are kept in :attr:`placed`."""

    def __init__(self, charge: TwoTierCharge, keep: int = 4096):
        self.charge = charge
        self.free = {"intra": 0.0, "nic": 0.0}
        self.placed: collections.deque[Placed] = collections.deque(maxlen=keep)

    def place(self, op: str, cost: Cost, issued: float) -> Placed:
        uses = resources_of(cost)
        start = max([issued] + [self.free[r] for r in uses])
        end = start + cost.seconds
        for r in uses:
            self.free[r] = end
        p = Placed(op, start, end, cost)
        self.placed.append(p)
        return p
