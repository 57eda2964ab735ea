"""benchmarks/scripts/emulated_cluster.py on the CPU: rank 0 of a fake world of n x L ranks whose
collectives hold the cluster's two links for the two-tier charge of the whole group (world,
rail and node groups of a DeviceMesh), on a fake clock; qzero's two-level training under it
charged as the plan charges the arm; the cluster's command line of the emulated matrix."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import pytest
import torch
import torch.distributed as dist
from _support import bench_scripts

from qzero.app.benchmarks.two_tier import TwoTierCharge
from qzero.plan import Cluster, collective_cost, default_arms, predict
from qzero.plan.workload import workload_from_shapes

el = bench_scripts.load("emulated_link")
ec = bench_scripts.load("emulated_cluster")
em = bench_scripts.load("emulated_matrix")


class FakeClock:
    """A host clock that moves only when slept on."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now

    def sleep(self, dt):
        self.now += dt


@pytest.fixture
def cluster_world():
    """``cluster_world(cluster, model)``: a cluster world on a fake clock and its world, rail and
    node groups (a DeviceMesh over (node, local), as qzero's two-level groups make them)."""

    def make(cluster, model="none"):
        if dist.is_initialized():
            pytest.skip("a process group already exists in this process")
        clock = FakeClock()
        w = ec.init_cluster_world(cluster, model, clock=clock, sleep=clock.sleep)
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh("cpu", torch.arange(cluster.world).view(cluster.nodes, cluster.gpus_per_node),
                          mesh_dim_names=("node", "local"))
        return w, clock, {"world": None, "rail": mesh.get_group("node"), "node": mesh.get_group("local")}

    yield make
    el.close_emulated_world()


CLUSTERS = [Cluster(2, 2, 25e9, 12.5e9, 20e-6, 50e-6), Cluster(2, 4, 100e9, 12.5e9, 5e-6, 30e-6, "rail"),
            Cluster(3, 2, 25e9, 3e9, 20e-6, 50e-6)]


def _one_of_each(scope: str, g, size: int) -> list[tuple[str, float, object]]:
    """``(op, bytes as the plan reads them, call)`` for one collective of each kind on ``g``."""
    m = 3000  # elements
    bf = {"dtype": torch.bfloat16}
    return [
        ("all_gather", 2 * m, lambda: dist.all_gather_into_tensor(torch.empty(size * m, **bf), torch.ones(m, **bf),
                                                                   group=g)),
        ("reduce_scatter", 4 * size * m, lambda: dist.reduce_scatter_tensor(torch.empty(m), torch.ones(size * m),
                                                                             group=g)),
        ("all_reduce", 4 * m, lambda: dist.all_reduce(torch.ones(m), group=g)),
        ("broadcast", 2 * m, lambda: dist.broadcast(torch.ones(m, **bf), group_src=0, group=g)),
        ("reduce", 4 * m, lambda: dist.reduce(torch.ones(m), group_dst=0, group=g)),
        ("all_to_all", 2 * m, lambda: dist.all_to_all_single(torch.empty(size * m, **bf), torch.ones(size * m, **bf),
                                                              group=g)),
    ]


@pytest.mark.parametrize("cluster", CLUSTERS, ids=lambda c: f"{c.nodes}x{c.gpus_per_node}_{c.nic}")
def test_each_collective_is_held_for_the_charge_of_its_scope(cluster_world, cluster):
    w, clock, groups = cluster_world(cluster)
    for scope, g in groups.items():
        size = cluster.world if g is None else g.size()
        for op, nbytes, call in _one_of_each(scope, g, size):
            before = clock.now
            call()
            want = collective_cost(cluster, op, scope, nbytes)  # all-to-all: nbytes is the split per peer
            t = w.link.transfers[-1]
            got = (t.charge.seconds, t.charge.nic_sent, t.charge.intra_sent)
            assert t.op == op and got == pytest.approx((want.seconds, want.nic_sent, want.intra_sent)), (scope, op)
            assert clock.now - before == pytest.approx(want.seconds, rel=1e-9), (scope, op)  # the idle link
    before = clock.now
    dist.barrier()
    assert clock.now - before == pytest.approx(cluster.inter_latency)


def test_an_incast_is_charged_at_the_owner_from_rank_0s_splits(cluster_world):
    c = CLUSTERS[0]
    _, clock, _ = cluster_world(c)
    piece = 4000  # rank 0 sends its bucket to rank 3 only, and receives nothing
    before = clock.now
    dist.all_to_all_single(torch.empty(0, dtype=torch.uint8), torch.ones(piece, dtype=torch.uint8),
                           output_split_sizes=[0, 0, 0, 0], input_split_sizes=[0, 0, 0, piece])
    want = TwoTierCharge(c).all_to_all(list(range(4)), [0, 0, 0, piece], [0, 0, 0, 0])
    assert clock.now - before == pytest.approx(want.seconds)
    assert want.wire == pytest.approx(2 * piece / c.inter_rate)  # ranks 0 and 1 into node 1's one NIC


def test_the_two_stages_overlap_and_a_world_ring_waits_for_both(cluster_world):
    c = CLUSTERS[1]
    w, clock, groups = cluster_world(c)
    node_in, rail = torch.ones(4 * 10_000), torch.ones(2 * 10_000)
    a = dist.reduce_scatter_tensor(torch.empty(10_000), node_in, group=groups["node"], async_op=True)
    b = dist.all_to_all_single(torch.empty_like(rail), rail, group=groups["rail"], async_op=True)
    c_ = dist.all_gather_into_tensor(torch.empty(8 * 100), torch.ones(100), async_op=True)
    ta, tb, tc = list(w.link.transfers)[-3:]
    assert clock.now == 100.0 and ta.start == tb.start == 100.0  # issued together, on different links
    assert tc.start == pytest.approx(max(ta.end, tb.end)) and tc.end == pytest.approx(tc.start + tc.seconds)
    for work in (a, b, c_):
        work.wait()
    assert clock.now == pytest.approx(tc.end)
    assert w.link.busy["intra"] == pytest.approx(ta.seconds + tc.seconds)
    assert w.link.busy["nic"] == pytest.approx(tb.seconds + tc.seconds)
    assert w.link.busiest_since({}) == pytest.approx(max(w.link.busy.values()))


def test_time_scale_and_what_a_cluster_link_refuses(cluster_world):
    c = CLUSTERS[0]
    w, clock, _ = cluster_world(c, "none:time_scale=2")
    before = clock.now
    dist.all_reduce(torch.ones(1000))
    assert clock.now - before == pytest.approx(collective_cost(c, "all_reduce", "world", 4000).seconds / 2)
    assert "time scale 2" in w.link.describe() and "2 x 2 GPUs" in w.link.describe()
    with pytest.raises(ValueError, match="rates and latencies from the cluster"):
        ec.ClusterLink(c, "pcie")


# ---------------------------------------------------------------------- qzero under the cluster

WIDTH = 256
SMALL = 0
LOWBIT = dict(zero_quantized_weights=True, zero_quantized_weights_delta=True, zero_quantized_gradients=True,
              zero_quantized_gradients_format="int4")


def _model():
    torch.manual_seed(0)
    layers = []
    for _ in range(3):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.LayerNorm(WIDTH), torch.nn.GELU()]
    return torch.nn.Sequential(*layers).to(torch.bfloat16)


def _one_step(w, two_level: bool) -> tuple[dict, float, str]:
    """One measured step (after the delta gather's exact resync) of the lowest-bit arm with
    ranks_per_node=2: the link's charges per collective, the loss, the topology."""
    import qzero

    model = _model()
    cfg = qzero.ZeroConfig(flat_order="interleaved", small_param_numel=SMALL, reduce_bucket_size=10**8,
                           allgather_bucket_size=10**8, ranks_per_node=2,
                           hierarchical_collectives="true" if two_level else "false", **LOWBIT)
    opt = qzero.ZeroOptimizer(model, lambda p: torch.optim.SGD(p, lr=1e-3), config=cfg)
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)

    def step():
        loss = model(x).float().square().mean()
        opt.backward(loss)
        opt.step()
        opt.wait_for_weights()
        opt.zero_grad()
        return loss.item()

    step()
    before = w.link.snapshot()
    loss = step()
    return el.totals_since(w.link, before), loss, opt.topology.describe()


def _plan(cluster: Cluster, arm: str):
    model = _model()
    workload = workload_from_shapes([p.shape for p in model.parameters()], cluster.world, small_param_numel=SMALL,
                                    flat_order="interleaved", allgather_bucket=10**8, reduce_bucket=10**8)
    arms = {a.name: a for a in default_arms()}
    return predict(arms[arm], workload, cluster, 0.1), sum(p.numel() for p in model.parameters())


#: latencies 0: the step's few small collectives the plan leaves out (a flag's all-reduce, the
#: delta gather's checks) cost nothing beside the gathers and exchanges it charges
ZERO_LATENCY = Cluster(2, 2, 25e9, 12.5e9)


@pytest.mark.parametrize("two_level", [True, False], ids=["two-level", "flat"])
def test_a_qzero_step_is_charged_as_the_plan_charges_its_arm(cluster_world, two_level):
    w, _, _ = cluster_world(ZERO_LATENCY)
    got, loss, topology = _one_step(w, two_level)
    assert topology == f"2 node(s) x 2 rank(s), {'two-level' if two_level else 'flat'} collectives"
    assert math.isfinite(loss)
    arm = "qzero INT4 delta + INT4 grads" + (" (two-level)" if two_level else "")
    plan, params = _plan(ZERO_LATENCY, arm)
    charged = sum(v["seconds"] for v in got.values())
    planned = sum(row["ms"] for row in plan.calls) / 1e3  # the plan's per-call costs times their counts
    assert charged == pytest.approx(planned, rel=0.01), (got, plan.calls)
    nic = sum(v["nic_sent"] for v in got.values())
    assert nic / ZERO_LATENCY.nodes == pytest.approx(plan.bits_per_param_per_node * params / 8, rel=0.01)
    if two_level:  # both stages of both collectives ran on their scopes: the node reduce-scatter moves no NIC byte
        assert got["reduce_scatter"]["nic_sent"] == 0 and got["all_to_all"]["intra_sent"] == 0


def test_the_flat_lowest_bit_arm_sends_more_across_nodes_than_the_two_level_one(cluster_world):
    c = Cluster(2, 2, 25e9, 12.5e9, 20e-6, 50e-6)
    w, _, _ = cluster_world(c)
    two, _, _ = _one_step(w, True)
    flat, _, _ = _one_step(w, False)
    across = lambda got: sum(v["nic_sent"] for v in got.values())  # noqa: E731
    assert across(flat) > 1.2 * across(two), (flat, two)
    planned = {a: _plan(c, a)[0].bits_per_param_per_node for a in
               ("qzero INT4 delta + INT4 grads", "qzero INT4 delta + INT4 grads (two-level)")}
    assert across(flat) / across(two) == pytest.approx(planned["qzero INT4 delta + INT4 grads"]
                                                       / planned["qzero INT4 delta + INT4 grads (two-level)"], rel=0.02)


# ---------------------------------------------------------------------- the command line


def _cluster_args(**given):
    p = argparse.ArgumentParser()
    ec.add_cluster_arguments(p)
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in given.items()]
    return p.parse_args(argv)


def test_the_cluster_flags_are_qzero_plans():
    c = ec.cluster_from_args(_cluster_args(nodes=3, gpus_per_node=4, intra_gbps=100, inter_gbps=25, nic="rail"))
    assert c == Cluster(3, 4, 100e9, 25e9, 20 * 1e-6, 50 * 1e-6, "rail")  # qzero plan's arithmetic
    assert ec.cluster_from_args(_cluster_args()) is None
    for given, what in ((dict(nodes=0), "--nodes must be a positive integer, got 0"),
                        (dict(nodes=2, inter_gbps=0), "--inter-gbps must be a positive number"),
                        (dict(nodes=2, intra_latency_us=-1), "--intra-latency-us must be a number >= 0"),
                        (dict(inter_gbps=5), "--inter-gbps describe a cluster: give --nodes too")):
        with pytest.raises(ValueError, match=what):
            ec.cluster_from_args(_cluster_args(**given))


@pytest.mark.parametrize("extra, what", [
    (["--links", "pcie"], "--links with --nodes: the cluster sets the rates and latencies"),
    (["--world-size", "3"], "--world-size 3 is not the cluster's 2 x 2 = 4 ranks"),
    (["--nic", "ring"], "invalid choice: 'ring'"),
    (["--arm", "odd:ranks_per_node=4"], "--arm odd: ranks_per_node=4 on a cluster of 2 GPUs per node"),
])
def test_the_matrix_refuses_a_cluster_run_it_cannot_make_in_one_line(tmp_path, capsys, extra, what):
    argv = ["--device", "cpu", "--nodes", "2", "--gpus-per-node", "2", "--arm", "a:", "--out", str(tmp_path), *extra]
    with pytest.raises(SystemExit) as e:
        em.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and what in err[-1], err


def test_the_matrix_gives_every_arm_the_clusters_nodes():
    cluster = Cluster(2, 4, 25e9, 12.5e9)
    from qzero.app.train import TrainSettings, settings_from

    plain = settings_from({"world_size": 8})
    flat = settings_from({"world_size": 8, "hierarchical_collectives": False})
    assert em.on_cluster(plain, cluster).zero.ranks_per_node == 4
    assert em.on_cluster(flat, cluster).zero.hierarchical_collectives is False
    assert isinstance(em.on_cluster(plain, cluster), TrainSettings)
    with pytest.raises(ValueError, match="ranks_per_node=2 on a cluster of 4 GPUs per node"):
        em.on_cluster(settings_from({"world_size": 8, "ranks_per_node": 2}), cluster)
    assert dataclasses.asdict(em.on_cluster(plain, None)) == dataclasses.asdict(plain)


@pytest.mark.slow  # an end-to-end run of a benchmark script: python -m pytest -m slow
def test_the_matrix_runs_a_cluster_on_the_cpu(tmp_path):
    """FSDP2 and qzero's lowest-bit arm flat and two-level on a 2 x 2 cluster, one process
    each: finite losses, the cluster in the records, the two-level arm's NIC bytes below the
    flat arm's."""
    proc = bench_scripts.run_emulated_matrix(
        tmp_path, "--steps", "3", "--warmup", "1", "--rounds", "1", "--world-size", "4", "--nodes", "2",
        "--gpus-per-node", "2", "--inter-gbps", "50", "--intra-gbps", "100", "--links", "none,none:nic=rail",
        "--arm", "fsdp2:backend=fsdp2",
        "--arm", "flat:quantized=true,zero_quantized_weights_delta=true,zero_quantized_gradients=true,"
                 "zero_quantized_gradients_format=int4,hierarchical_collectives=false,flat_order=interleaved,"
                 "small_param_numel=1024",
        "--arm", "two:quantized=true,zero_quantized_weights_delta=true,zero_quantized_gradients=true,"
                 "zero_quantized_gradients_format=int4,flat_order=interleaved,small_param_numel=1024",
        "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out"
    cell = next(p for p in out.iterdir() if p.is_dir() and p.name != "logs")
    m = json.loads((cell / "cluster_2x2_shared_intra100_inter50" / "matrix.json").read_text())
    runs = {name: r[0] for name, r in m["runs"].items()}
    assert all(r["finite"] and r["emulated_world"] == 4 for r in runs.values()), runs
    assert all(r["cluster"]["nodes"] == 2 and r["link"].startswith("cluster of 2 x 2 GPUs") for r in runs.values())
    assert "two-level" in runs["two"]["network"]["topology"] and "flat" in runs["flat"]["network"]["topology"]
    nic = {n: sum(v.get("nic_sent", 0) for v in r["link_per_step"].values()) for n, r in runs.items()}
    assert 0 < nic["two"] < nic["flat"], nic
    assert "emulated cluster" in m["regime_label"]
    rail = json.loads((cell / "cluster_2x2_rail_intra100_inter50" / "matrix.json").read_text())  # the same processes
    assert all(r[0]["cluster"]["nic"] == "rail" and r[0]["finite"] for r in rail["runs"].values())
    assert rail["emulated_cluster"]["nic"] == "rail" and m["emulated_cluster"]["nic"] == "shared"
    cal = bench_scripts.load("cluster_calibration").rows_of([str(out)], floor_ms=1.0)  # the plan beside each arm
    assert {(r["nic"], r["plan_arm"]) for r in cal} == {(nic, a) for nic in ("shared", "rail") for a in (
        "FSDP2", "qzero INT4 delta + INT4 grads", "qzero INT4 delta + INT4 grads (two-level)")}
    # the bytes the emulator counted are the plan's (with few exact elements: the emulator charges every rank
    # rank 0's all-to-all splits, and where most parameters are small, partitions' exact shares differ)
    for r in cal:
        assert r["emulated_bits_per_param_per_node"] == pytest.approx(r["plan_bits_per_param_per_node"], rel=0.01), r


def test_the_calibration_maps_each_arm_to_the_plans():
    cal = bench_scripts.load("cluster_calibration")
    from qzero.app.train import settings_from

    def name(**given):
        return cal.plan_arm_name(dataclasses.asdict(settings_from({"world_size": 8, **given})))

    q4 = dict(quantized=True, zero_quantized_weights_delta=True, zero_quantized_gradients=True,
              zero_quantized_gradients_format="int4")
    assert name(backend="fsdp2") == "FSDP2" and name() == "qzero plain (two-level)"
    assert name(quantized=True, hierarchical_collectives=False) == "qzero INT8"
    assert name(quantized=True, zero_quantized_gradients=True) == "qzero INT8 + INT8 grads (two-level)"
    assert name(**q4) == "qzero INT4 delta + INT4 grads (two-level)"
    assert name(**q4, zero_quantized_gradients_intra_node="int8") == (
        "qzero INT4 delta + INT4 grads (two-level, INT8 inside)")
    assert name(**q4, hierarchical_collectives=False) == "qzero INT4 delta + INT4 grads"
    assert name(world_size=1) is None and name(backend="fsdp2", quantized=True) is None  # no plan row


def test_a_link_entry_may_change_the_clusters_fabric_not_its_nodes():
    base = Cluster(2, 4, 25.2e9, 12.5e9, 20e-6, 50e-6)
    roce, text = ec.fabric_of("none:ctas=8,intra_gbps=290,inter_gbps=25,nic=rail,time_scale=1.2", base)
    assert roce == Cluster(2, 4, 290e9, 25e9, 20e-6, 50e-6, "rail") and text == "none:ctas=8,time_scale=1.2"
    assert ec.fabric_of("none", base) == (base, "none")
    assert ec.fabric_of("none:inter_latency_us=0", base)[0].inter_latency == 0
    for bad, what in (("none:nic=ring", "nic must be one of"), ("none:inter_gbps=0", "inter_gbps must be a positive"),
                      ("none:intra_latency_us=-1", "intra_latency_us must be a >= 0"),
                      ("none:intra_gbps=fast", "intra_gbps must be a positive number, got 'fast'")):
        with pytest.raises(ValueError, match=what):
            ec.fabric_of(bad, base)
    link = ec.ClusterLink(base)
    link.set_cluster(roce)
    assert link.cluster == roce and link.two_tier.cluster == roce
    with pytest.raises(ValueError, match="only the fabric can change"):
        link.set_cluster(Cluster(4, 2, 25e9, 12.5e9))
    assert em.link_name("none:ctas=8,nic=rail,inter_gbps=25", base) == "cluster_2x4_rail_intra25.2_inter25:ctas=8"
