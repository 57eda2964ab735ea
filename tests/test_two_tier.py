"""The two-tier charge of the one-GPU cluster emulation (host arithmetic, no GPU)."""

from __future__ import annotations

import pytest

from qzero.app.benchmarks.two_tier import TwoTierCharge, TwoTierTimeline, scope_of, splits_from_rank0
from qzero.plan import Cluster, collective_cost

C = Cluster(4, 4, 25e9, 12.5e9, 20e-6, 50e-6)


def test_scopes_are_read_from_the_ranks():
    assert scope_of(C, list(range(16))) == "world"
    assert scope_of(C, [0, 4, 8, 12]) == "rail"
    assert scope_of(C, [0, 1, 2, 3]) == "node"
    assert scope_of(C, [0, 1]) is None


def test_rings_are_charged_as_the_plan_charges_them():
    charge = TwoTierCharge(C)
    assert charge.ring("all_gather", [0, 4, 8, 12], 1e6) == collective_cost(C, "all_gather", "rail", 1e6)
    assert charge.ring("reduce_scatter", list(range(16)), 8e6) == collective_cost(C, "reduce_scatter", "world", 8e6)


def test_rank0_splits_rebuild_every_ranks():
    assert splits_from_rank0([0, 5, 7], [0, 3, 3]) == [[0, 5, 7], [3, 0, 7], [3, 5, 0]]


def test_an_incast_is_charged_at_the_owner_not_at_rank_0():
    charge = TwoTierCharge(C)
    world = list(range(16))
    piece = 4e6
    # contiguous order: the bucket's one owner is rank 5; rank 0 sends it the whole piece, receives nothing
    send = [0.0] * 16
    send[5] = piece
    incast = charge.all_to_all(world, send, [0.0] * 16)
    assert incast.wire == pytest.approx(12 * piece / C.inter_rate)  # 12 remote senders into rank 5's node NIC
    closed = collective_cost(C, "all_to_all", "world", piece, incast=True)
    assert (incast.wire, incast.nic_sent) == pytest.approx((closed.wire, closed.nic_sent))
    # rank 0's own bytes would have been piece / rate: the one-link charge
    assert incast.wire > 10 * piece / C.inter_rate
    uniform = charge.all_to_all(world, [0.0] + [piece / 16] * 15, [0.0] + [piece / 16] * 15)
    assert uniform.wire == pytest.approx(collective_cost(C, "all_to_all", "world", piece / 16).wire)


def test_two_stages_on_different_links_overlap_on_the_timeline():
    charge = TwoTierCharge(C)
    t = TwoTierTimeline(charge)
    node = charge.ring("reduce_scatter", [0, 1, 2, 3], 4e7)
    rail = charge.all_to_all([0, 4, 8, 12], [0, 1e6, 1e6, 1e6], [0, 1e6, 1e6, 1e6])
    a = t.place("rs node", node, 0.0)
    b = t.place("a2a rail", rail, 0.0)
    c = t.place("rs node", node, 0.0)
    assert b.start == 0.0  # the NIC was free while the node link worked
    assert c.start == pytest.approx(a.end)  # the node link is one FIFO
    w = t.place("world ring", charge.ring("all_gather", list(range(16)), 1e6), 0.0)
    assert w.start == pytest.approx(max(c.end, b.end))  # a world ring needs both


def test_the_emulators_collectives_by_name():
    charge = TwoTierCharge(C)
    world = list(range(16))
    assert charge.collective("all_gather", world, 1e6) == collective_cost(C, "all_gather", "world", 1e6)
    assert charge.collective("barrier", world).seconds == pytest.approx(50e-6)
    with pytest.raises(ValueError, match="splits"):
        charge.collective("all_to_all", world, 1e6)
    with pytest.raises(ValueError, match="not a ring"):
        charge.collective("gather", world, 1e6)
