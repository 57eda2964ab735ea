"""The cost of a uniform collective on a scope, in closed form.

[Note: closed forms]
:func:`qzero.plan.cost.cost_of` charges any traffic rank by rank; a step of a 1,024-rank
world has a million all-to-all flows, so the arms use these closed forms instead, for the
uniform cases they are made of (the tests check them against :func:`cost_of` on small
clusters). For a scope (:data:`qzero.plan.cluster.SCOPES`): ``m`` ranks a group, ``g`` of them
on each node it spans, ``k`` nodes spanned, ``c = L / g`` groups running at once on each node.

* ring (all-gather / reduce-scatter / all-reduce) with edge bytes ``E``: each node sends
  ``c·E`` across the network when ``k > 1``; per NIC port that is ``c·E`` (shared) or ``E/g``
  (rail: the ``c`` groups' crossings spread over the node's ``L`` NICs); each GPU's intra port
  carries ``E`` when ``g > 1``.
* chain (reduce / broadcast, one root): as a ring with ``E = B`` without the edge out of the
  root (a reduce's chain runs back to it), which crosses nodes for ``k`` of the ``m`` roots: the
  group sends ``k(m-1)/m·B`` across on average over roots (``k-1`` edges with one rank a node).
* all-to-all, ``p`` bytes from every rank to every other (``incast=False``): a rank sends
  ``(m-g)·p`` across the network and ``(g-1)·p`` inside; a node ``L·(m-g)·p``, through one NIC
  (shared) or ``L`` (rail).
* incast, every other rank sends ``p`` to one owner per group (``incast=True``): the owner's
  receive port carries ``(g-1)·p`` inside and ``(m-g)·p`` through its NIC, ``c`` owners' worth
  on a shared NIC (the owners of concurrent groups taken to share a node, the worst case);
  the same network bytes as the uniform exchange of an ``m·p`` bucket.
"""

from __future__ import annotations

from .cluster import Cluster
from .cost import Cost, latency
from .traffic import CHAIN_OPS, RING_OPS, edge_bytes, ring_steps


def shape(cluster: Cluster, scope: str) -> tuple[int, int, int, int]:
    """``(m, g, k, c)`` of a scope (see the note)."""
    n, L = cluster.nodes, cluster.gpus_per_node
    if scope == "world":
        return n * L, L, n, 1
    if scope == "rail":
        return n, 1, n, L
    if scope == "node":
        return L, L, 1, 1
    raise ValueError(f"unknown scope {scope!r}")


def collective_cost(cluster: Cluster, op: str, scope: str, nbytes: float, incast: bool = False) -> Cost:
    """One ``op`` on every group of ``scope`` at once. ``nbytes``: the shard of an all-gather,
    the input of a reduce-scatter, all-reduce, reduce or broadcast, the bytes a rank sends each
    other rank (``p``) of an all-to-all."""
    m, g, k, c = shape(cluster, scope)
    n, L = cluster.nodes, cluster.gpus_per_node
    if m <= 1 or nbytes == 0:
        return Cost(0.0, 0.0, 0.0, 0.0, 0.0)
    groups = {"world": 1, "rail": L, "node": n}[scope]
    if op in RING_OPS or op in CHAIN_OPS:
        e = edge_bytes(op, m, nbytes)
        steps, inter = ring_steps(op, m, k)
        chain = op in CHAIN_OPS
        # node-crossing edges of one group; a chain leaves out the edge out of its root, which crosses
        # for k of the m roots (the roots of a step's chains are every rank, so averaged over them)
        crossing = (k * (m - 1) / m if chain else k) if k > 1 else 0
        inside = (m - 1 if chain else m) - crossing
        nic_port = (c * e if cluster.nic == "shared" else e / g) if k > 1 else 0.0
        intra_port = e if g > 1 else 0.0
        nic_sent = groups * crossing * e
        intra_sent = groups * inside * e
    elif op == "all_to_all":
        steps, inter = 1, (1 if k > 1 else 0)
        if incast:
            nic_port = (m - g) * nbytes * (c if cluster.nic == "shared" else 1)
            intra_port = (g - 1) * nbytes
            nic_sent = groups * (m - g) * nbytes
            intra_sent = groups * (g - 1) * nbytes
        else:
            nic_port = (L if cluster.nic == "shared" else 1) * (m - g) * nbytes
            intra_port = (g - 1) * nbytes
            nic_sent = n * L * (m - g) * nbytes
            intra_sent = n * L * (g - 1) * nbytes
    else:
        raise ValueError(f"no cost model for collective {op!r}")
    t_nic = nic_port / cluster.inter_rate
    t_intra = intra_port / cluster.intra_rate
    wire = max(t_nic, t_intra)
    lat = latency(cluster, steps, inter)
    return Cost(wire + lat, wire, lat, nic_sent, intra_sent, "nic" if t_nic >= t_intra and t_nic > 0 else "intra")
