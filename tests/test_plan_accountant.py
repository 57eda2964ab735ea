"""The byte accountant against the plan: what the ZeroOptimizer arms send across pseudo-nodes on
gloo, flat and two-level, booked collective by collective, equals the cluster model's bytes per
node for the same arm within 1% (the model leaves out the small collectives of checks): every
arm in both flat orders (the quantized gradients' windows of the contiguous order: [Note:
windows in the contiguous order] in qzero/optim/grads.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _support.distributed import run_distributed

import qzero
from qzero.app.benchmarks.accountant import ByteAccountant, cross_node_per_node, merge
from qzero.plan import Cluster, default_arms, predict
from qzero.plan.collectives import collective_cost
from qzero.plan.workload import workload_from_shapes

WIDTH = 256
SMALL = 4096

ARMS = {  # plan arm -> ZeroConfig settings of today's flat path
    "qzero plain": dict(),
    "qzero INT8": dict(zero_quantized_weights=True),
    "qzero INT8 + INT8 grads": dict(zero_quantized_weights=True, zero_quantized_gradients=True),
    "qzero INT4 delta + INT4 grads": dict(zero_quantized_weights=True, zero_quantized_weights_delta=True,
                                          zero_quantized_gradients=True, zero_quantized_gradients_format="int4"),
}


#: the same arms with two-level collectives (hierarchical_collectives="auto" on declared nodes)
TWO_LEVEL = {f"{arm} (two-level)": dict(settings, hierarchical_collectives="auto") for arm, settings in ARMS.items()}
#: and the quantized-gradient ones with an INT8 node stage
TWO_LEVEL.update({f"{arm} (two-level, INT8 inside)": dict(settings, hierarchical_collectives="auto",
                                                         zero_quantized_gradients_intra_node="int8")
                  for arm, settings in ARMS.items() if settings.get("zero_quantized_gradients")})
FLAT = {arm: dict(settings, hierarchical_collectives=False) for arm, settings in ARMS.items()}
#: the arms measured in the contiguous order as well: every one (plain gradients reach their owners by chain
#: reduces there, two-level or not; quantized ones go in windows)
CONTIGUOUS = [*FLAT, *TWO_LEVEL]


def make_model():
    torch.manual_seed(0)
    layers = []
    for _ in range(3):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.LayerNorm(WIDTH), torch.nn.GELU()]
    return torch.nn.Sequential(*layers).to(torch.bfloat16)


def arm_bytes(x, ranks_per_node, settings, order="interleaved"):
    """What one arm's second step sends (its optimizer goes with the return, before the next arm)."""
    model = make_model()
    cfg = qzero.ZeroConfig(flat_order=order, small_param_numel=SMALL, reduce_bucket_size=10**8,
                           allgather_bucket_size=10**8, ranks_per_node=ranks_per_node, **settings)
    # entered before the optimizer is built: its gather engine keeps the collective it was made with
    with ByteAccountant(ranks_per_node) as acct:
        opt = qzero.ZeroOptimizer(model, lambda p: torch.optim.SGD(p, lr=1e-3), config=cfg)

        def step():
            opt.backward(model(x).float().square().mean())
            opt.step()
            opt.wait_for_weights()
            opt.zero_grad()

        step()  # the first gather of delta gathers is an exact resync
        acct.reset()
        step()
    return {"sent": dict(acct.sent), "by_op": dict(acct.by_op)}


def accountant_worker(rank, world, ranks_per_node):
    out = {}
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    for arm, settings in {**FLAT, **TWO_LEVEL}.items():
        out[arm] = arm_bytes(x, ranks_per_node, settings)
    for arm in CONTIGUOUS:
        out[f"{arm}, contiguous"] = arm_bytes(x, ranks_per_node, {**FLAT, **TWO_LEVEL}[arm], order="contiguous")
    # the accountant's own attribution, on known collectives
    with ByteAccountant(ranks_per_node) as acct:
        t = torch.zeros(1000, dtype=torch.bfloat16)
        dist.all_reduce(t)
        big = torch.zeros(world * 10, dtype=torch.float32)
        dist.all_to_all_single(big, big)
    out["probe"] = dict(acct.sent)
    return out


@pytest.mark.parametrize("world, per_node", [(4, 2), (6, 2)])
def test_accountant_equals_the_plan_within_one_percent(world, per_node):
    results = run_distributed(accountant_worker, world, per_node)
    model = make_model()
    params = sum(p.numel() for p in model.parameters())
    nodes = world // per_node
    cluster = Cluster(nodes, per_node, 1e9, 1e9)
    arms = {a.name: a for a in default_arms()}
    for order, names in (("interleaved", [*FLAT, *TWO_LEVEL]), ("contiguous", CONTIGUOUS)):
        workload = workload_from_shapes([p.shape for p in model.parameters()], world, small_param_numel=SMALL,
                                        flat_order=order, allgather_bucket=10**8, reduce_bucket=10**8)
        assert workload.order == order
        for arm in names:
            books = [r[arm if order == "interleaved" else f"{arm}, contiguous"]["sent"] for r in results]
            measured = cross_node_per_node(books, nodes)
            planned = predict(arms[arm], workload, cluster, 0.1).bits_per_param_per_node * params / 8
            assert measured == pytest.approx(planned, rel=0.01), (arm, order, measured, planned, merge(books))
            if arm in TWO_LEVEL:  # inside the nodes too: the node stages (bf16 or INT8 gradients, the gather's)
                inside = sum(v for (s, d), v in merge(books).items() if s == d) / nodes
                planned = planned_inside(predict(arms[arm], workload, cluster, 0.1), cluster)
                assert inside == pytest.approx(planned, rel=0.01), (arm, order, inside, planned)
    # probe: a 2,000-byte all-reduce is a ring (each rank sends 2(P-1)/P of it to the next rank, one crossing
    # edge per node), a 40-byte-per-peer all-to-all sends each rank on another node 40 bytes
    probe = merge([r["probe"] for r in results])
    cross = sum(v for (s, d), v in probe.items() if s != d)
    ring = 2 * (world - 1) / world * 2000 * nodes
    a2a = world * (world - per_node) * 40
    assert cross == pytest.approx(ring + a2a)


def planned_inside(prediction, cluster) -> float:
    """Bytes a node's ranks send each other in one step of the plan: every call's (node-scope
    stages, and a world-scope chain's edges inside the nodes)."""
    return sum(collective_cost(cluster, c["op"], c["scope"], c["bytes"]).intra_sent * c["count"]
               for c in prediction.calls) / cluster.nodes


def test_the_accountant_refuses_a_node_size_that_does_not_divide_the_world():
    results = run_distributed(_bad_size_worker, 2)
    assert all("ranks_per_node" in r for r in results)


def _bad_size_worker(rank, world):
    try:
        ByteAccountant(3)
    except ValueError as e:
        return str(e)
    return "accepted"
