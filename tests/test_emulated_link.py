"""benchmarks/scripts/emulated_link.py's bookkeeping on the CPU: wire bytes per collective at DP-N, the
link's timeline (issue order, one transfer at a time, async waits), finite outputs of every
collective, the rebinding of collectives imported before the world was made; the hold
kernel compiled for sm_90; benchmarks/scripts/emulated_matrix.py end to end on a tiny model."""

import json
import math
import os
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks", "scripts")

from _support import bench_scripts  # noqa: E402

el = bench_scripts.load("emulated_link")
em = bench_scripts.load("emulated_matrix")


class FakeClock:
    """A host clock that moves only when slept on (the link's holds become readable)."""

    def __init__(self):
        self.now = 100.0
        self.slept = []

    def __call__(self):
        return self.now

    def sleep(self, dt):
        self.slept.append(dt)
        self.now += dt


@pytest.fixture
def world_of():
    """``world_of(n, link)``: an emulated world of ``n`` on a fake clock, torn down afterwards."""
    made = []

    def make(n, link="pcie"):
        if dist.is_initialized():
            pytest.skip("a process group already exists in this process")
        clock = FakeClock()
        w = el.init_emulated_world(n, link, clock=clock, sleep=clock.sleep)
        made.append(w)
        return w, clock

    yield make
    el.close_emulated_world()


# ---------------------------------------------------------------------- wire bytes and the model


@pytest.mark.parametrize("n", [2, 3, 4, 8, 64])
def test_wire_bytes_follow_the_ring(n):
    shard = 1000 * 64  # bytes of one rank's all-gather input
    ag = el.wire_bytes("all_gather", n, shard)
    assert ag.sent == ag.received == (n - 1) * shard and ag.steps == n - 1
    # (N-1)/N of the gathered output, of the reduce-scatter input
    assert ag.sent == (n - 1) * (n * shard) // n
    rs = el.wire_bytes("reduce_scatter", n, n * shard)
    assert rs.sent == rs.received == (n - 1) * shard and rs.steps == n - 1
    ar = el.wire_bytes("all_reduce", n, n * shard)
    assert ar.sent == 2 * (n - 1) * shard and ar.steps == 2 * (n - 1)
    assert el.wire_bytes("broadcast", n, 777).sent == 777
    send, recv = [10 * (r + 1) for r in range(n)], [7] * n
    a2a = el.wire_bytes("all_to_all", n, send=send, recv=recv)
    assert a2a.sent == sum(send) - send[0] and a2a.received == 7 * (n - 1) and a2a.steps == 1


def test_a_world_of_one_moves_nothing():
    for op in ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "reduce", "barrier"):
        assert el.wire_bytes(op, 1, 123) == el.Wire(0, 0, 0)
    assert el.parse_link("pcie").seconds(0, 0, 0) == 0.0


def test_model_seconds_rate_latency_and_time_scale():
    m = el.LinkModel("x", 1e9, 1e-5)
    assert m.seconds(2_000_000, 1_000_000, 3) == pytest.approx(3e-5 + 2e-3)
    assert el.LinkModel("x", 1e9, 1e-5, time_scale=2.0).seconds(2_000_000, 0, 3) == pytest.approx((3e-5 + 2e-3) / 2)
    assert el.parse_link("none").seconds(10**9, 10**9, 1) == 0.0 and not el.parse_link("none").holds


def test_parse_link_regimes_and_overrides():
    m = el.parse_link("pcie:ctas=8,time_scale=1.25,traffic=2")
    assert (m.rate, m.ctas, m.time_scale, m.traffic) == (el.REGIMES["pcie"].rate, 8, 1.25, 2.0)
    assert el.parse_link("ethernet").rate == el.REGIMES["ethernet"].rate
    for bad, what in (("warp", "unknown link"), ("pcie:speed=3", "expected key=value"), ("pcie:ctas=x", "number"),
                      ("pcie:rate=0", "rate must be positive"), ("pcie:traffic=1", "needs ctas"),
                      ("pcie:warps=3", "warps"), ("pcie:time_scale=0", "time_scale")):
        with pytest.raises(ValueError, match=what):
            el.parse_link(bad)


def test_split_links_keeps_a_links_own_keys():
    assert em.split_links("pcie:ctas=8;time_scale=1.2,ethernet,nvlink:ctas=4") == [
        "pcie:ctas=8,time_scale=1.2", "ethernet", "nvlink:ctas=4"]
    assert em.link_dir("pcie:ctas=8,time_scale=1.2") == "pcie_ctas8_time_scale1.2"


# ---------------------------------------------------------------------- the timeline


def test_transfers_run_one_at_a_time_in_issue_order(world_of):
    w, clock = world_of(4, "pcie:latency=1e-5")
    link = w.link
    x = torch.randn(1 << 12)
    out = torch.empty(4 << 12)
    works = [dist.all_gather_into_tensor(out, x, async_op=True) for _ in range(3)]
    assert clock.now == 100.0  # issued, not waited: the host has not been held
    ts = list(link.transfers)
    assert [t.index for t in ts] == [0, 1, 2] and all(t.is_async for t in ts)
    want = el.parse_link("pcie:latency=1e-5").seconds((4 - 1) * x.numel() * 4, (4 - 1) * x.numel() * 4, 3)
    for a, b in zip(ts, ts[1:]):
        assert b.start == pytest.approx(a.end) and b.end - b.start == pytest.approx(want)
    works[1].wait()  # waiting for the second holds the host until the second has ended
    assert clock.now == pytest.approx(ts[1].end) and not works[2].is_completed() and works[0].is_completed()
    assert [t.waits for t in ts] == [0, 1, 0]
    works[2].wait()
    assert clock.now == pytest.approx(ts[2].end)
    # a synchronous call starts after the queue and returns at its end
    t = torch.ones(8)
    dist.all_reduce(t)
    last = link.transfers[-1]
    assert last.start == pytest.approx(ts[2].end) and clock.now == pytest.approx(last.end) and not last.is_async


def test_a_later_call_starts_when_issued_if_the_link_is_idle(world_of):
    w, clock = world_of(2)
    dist.broadcast(torch.ones(4), src=1)
    clock.now += 5.0  # the host computes; the link is idle meanwhile
    dist.broadcast(torch.ones(4), src=1)
    a, b = w.link.transfers
    assert b.start == pytest.approx(a.end + 5.0)


def test_async_work_is_a_distributed_work(world_of):
    world_of(2)
    work = dist.all_reduce(torch.ones(4), async_op=True)
    assert isinstance(work, dist.distributed_c10d.Work)  # FSDP2 waits only for such works
    assert work.is_success() and work.exception() is None
    assert torch.equal(work.get_future().wait()[0], torch.full((4,), 2.0))


def test_bytes_booked_per_collective(world_of):
    n = 8
    w, _ = world_of(n)
    link = w.link
    before = link.snapshot()
    shard = torch.randn(1000, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(torch.empty(n * 1000, dtype=torch.bfloat16), shard)
    dist.reduce_scatter_tensor(torch.empty(1000), torch.randn(n * 1000))
    dist.all_reduce(torch.randn(800))
    dist.all_to_all_single(torch.empty(n * 16, dtype=torch.uint8), torch.zeros(n * 16, dtype=torch.uint8))
    got = el.totals_since(link, before)
    assert got["all_gather"]["sent"] == (n - 1) * 2000
    assert got["reduce_scatter"]["sent"] == (n - 1) * 4000
    assert got["all_reduce"]["sent"] == 2 * (n - 1) * 3200 // n
    assert got["all_to_all"]["sent"] == got["all_to_all"]["received"] == (n - 1) * 16
    assert {k: v["calls"] for k, v in got.items()} == {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 1,
                                                      "all_to_all": 1}
    assert got["all_gather"]["seconds"] == pytest.approx(link.model.seconds((n - 1) * 2000, (n - 1) * 2000, n - 1))


# ---------------------------------------------------------------------- deliveries


@pytest.mark.parametrize("n", [2, 3])
def test_every_collective_writes_finite_outputs(world_of, n):
    world_of(n, "none")
    g = torch.Generator().manual_seed(7)
    nan = lambda *s: torch.full(s, float("nan"))  # noqa: E731
    x = torch.randn(6, generator=g)
    out = nan(n * 6)
    dist.all_gather_into_tensor(out, x)
    assert torch.equal(out.view(n, 6), x.expand(n, 6))
    big = torch.randn(n * 6, generator=g)
    rs = nan(6)
    dist.reduce_scatter_tensor(rs, big)
    assert torch.allclose(rs, n * big[:6])
    rs = nan(6)
    dist.reduce_scatter_tensor(rs, big, op=dist.ReduceOp.AVG)
    assert torch.equal(rs, big[:6])
    premul = nan(6)
    dist.reduce_scatter_tensor(premul, big, op=dist._make_nccl_premul_sum(0.5))
    assert torch.allclose(premul, 0.5 * n * big[:6])
    t = x.clone()
    dist.all_reduce(t)
    assert torch.allclose(t, n * x)
    for op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.AVG):
        t = x.clone()
        dist.all_reduce(t, op=op)
        assert torch.equal(t, x)
    t = x.clone()
    dist.broadcast(t, src=n - 1)
    assert torch.equal(t, x)
    t = x.clone()
    dist.reduce(t, dst=1)  # another rank's result: this rank's tensor is left as it was
    assert torch.equal(t, x)
    dist.reduce(t, dst=0)
    assert torch.allclose(t, n * x)
    outs = [nan(6) for _ in range(n)]
    dist.all_gather(outs, x)
    assert all(torch.equal(o, x) for o in outs)
    rs = nan(6)
    dist.reduce_scatter(rs, [big[6 * r: 6 * (r + 1)] for r in range(n)])
    assert torch.allclose(rs, n * big[:6])
    # all-to-all, equal splits: rank s sends rank 0 what rank 0 sends rank s
    a = torch.randint(0, 255, (n * 4, 3), dtype=torch.uint8, generator=g)
    b = torch.full((n * 4, 3), 9, dtype=torch.uint8)
    dist.all_to_all_single(b, a)
    assert torch.equal(a, b)
    # uneven splits: pieces of the size rank 0 sends are copied, the others arrive as zero bits
    send = [0] + [2] * (n - 1)
    recv = [0] + [3] * (n - 1)
    a = torch.randn(sum(send), generator=g)
    b = nan(sum(recv))
    dist.all_to_all_single(b, a, recv, send)
    assert torch.equal(b, torch.zeros(sum(recv)))
    recv = [0] + [2] * (n - 1)
    b = nan(sum(recv))
    dist.all_to_all_single(b, a, recv, send)
    assert torch.equal(b, a)
    ol, il = [nan(3) for _ in range(n)], [torch.randn(3, generator=g) for _ in range(n)]
    dist.all_to_all(ol, il)
    assert all(torch.equal(o, i) for o, i in zip(ol, il))
    dist.barrier()
    objs = [None] * n
    dist.all_gather_object(objs, {"k": 1})  # built on the emulated all_gather
    assert objs == [{"k": 1}] * n


def test_in_place_all_gather_keeps_rank_0s_slot(world_of):
    world_of(3, "none")
    flat = torch.full((9,), float("nan"))
    flat[:3] = torch.tensor([1.0, 2.0, 3.0])
    dist.all_gather_into_tensor(flat, flat[:3])  # rank 0's input is its own slot of the output
    assert torch.equal(flat, torch.tensor([1.0, 2.0, 3.0] * 3))


def test_collectives_refuse_mismatched_shapes(world_of):
    world_of(2, "none")
    with pytest.raises(ValueError, match="expected 2 x 3"):
        dist.all_gather_into_tensor(torch.empty(5), torch.empty(3))
    with pytest.raises(ValueError, match="split sizes"):
        dist.all_to_all_single(torch.empty(4), torch.empty(4), [1, 1], [2, 2])


def test_install_rebinds_names_imported_before_and_restores_them():
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    original = dist.all_reduce
    mod = types.ModuleType("holds_a_collective")
    mod.all_reduce = original
    sys.modules[mod.__name__] = mod
    try:
        w = el.init_emulated_world(2, "none")
        assert mod.all_reduce is dist.all_reduce and getattr(mod.all_reduce, "__emulated__", False)
        t = torch.ones(2)
        mod.all_reduce(t)
        assert torch.equal(t, torch.full((2,), 2.0)) and w.link.count == 1
        with pytest.raises(RuntimeError, match="already installed"):
            el.init_emulated_world(2, "none")
    finally:
        el.close_emulated_world()
        del sys.modules[mod.__name__]
    assert dist.all_reduce is original and mod.all_reduce is original


# ---------------------------------------------------------------------- the device kernel, the matrix


COMPILE = r"""
import os, sys
os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import link_kernels as lk
sig = dict(state_ptr="*i64", src_ptr="*i32", dst_ptr="*i32", duration_ns="i64", deliver_ns="i32", pieces="i32",
           piece_elems="i32", wrap="i32", parity="i32", slot="i32", BLOCK="constexpr", NAP="constexpr",
           LOG="constexpr")
for warps, nap in ((1, True), (16, True), (16, False)):
    k = triton.compile(ASTSource(fn=lk._hold_kernel, signature=sig,
                                 constexprs={(10,): lk.BLOCK, (11,): nap, (12,): lk.LOG}),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    ptx = k.asm["ptx"]
    print(int(nap), ptx.count("%globaltimer"), ptx.count("nanosleep"), ptx.count("atom.global"))
"""


def test_hold_kernel_compiles_for_sm90_with_its_timer_naps_and_atomics():
    pytest.importorskip("triton")
    out = subprocess.run([sys.executable, "-c", COMPILE, BENCH], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    for line in out.stdout.split("\n"):
        if line.strip():
            nap, timer, naps, atoms = map(int, line.split())
            # the start, each piece's due time and the final wait read the timer inside their loops
            assert timer >= 3 and atoms >= 4 and (naps >= 2 if nap else naps == 0), line


def test_fsdp2_trains_through_the_emulated_collectives(world_of):
    """FSDP2's all-gathers and reduce-scatters (async, waited for as ``dist.Work``) go over the
    link and leave finite gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    w, _ = world_of(2, "none")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    mesh = init_device_mesh("cpu", (2,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    before = w.link.snapshot()
    model(torch.randn(8, 16)).square().sum().backward()
    got = el.totals_since(w.link, before)
    assert got["all_gather"]["calls"] >= 2 and got["reduce_scatter"]["calls"] >= 2, got
    assert all(torch.isfinite(p.grad.to_local()).all() for p in model.parameters())


def test_order_balanced_rounds():
    assert em.order(["a", "b", "c"], 0) == ["a", "b", "c"] and em.order(["a", "b", "c"], 1) == ["c", "b", "a"]


def test_summary_exposure_against_the_world_of_one():
    ok = lambda ts, busy: {"step_times": ts, "wall_seconds": sum(ts), "wall_steps": len(ts), "finite": True,  # noqa: E731
                           "link_busy_ms_modelled": busy, "link_busy_ms_measured": None}
    done = {("c", "pcie"): {"gpu1": [ok([0.30, 0.32], 0.0)], "plain": [ok([0.50, 0.52], 190.0)],
                            "bad": [{"failed": True, "error": "boom\nlast line"}]}}
    rows = {r["arm"]: r for r in em.summarize(done, "gpu1", {"c": ("qwen3-4b", 5e7, 2.6e7)})["rows"]}
    assert rows["plain"]["exposed_ms"] == pytest.approx(200.0) and rows["plain"]["preset"] == "qwen3-4b"
    assert rows["gpu1"]["exposed_ms"] == pytest.approx(0.0) and rows["bad"]["runs"] == 0
    assert "FAILED" in em.summary_markdown(em.summarize(done, "gpu1"), ["# t"])
    done[("c", "pcie")]["cut"] = []  # no run finished: not run, not a failure
    md = em.summary_markdown(em.summarize(done, "gpu1"), ["# t"])
    cut = next(ln for ln in md.splitlines() if "| cut |" in ln)
    assert "NOT RUN" in cut and "FAILED" not in cut


def test_a_median_below_the_links_busy_time_is_reported_as_lagging():
    """A link-bound arm whose transfers fall behind in a short run: its median (0.30 s) is
    below the link's 400 ms a step, which no steady step can be, so the report says so and
    points to the wall time; an arm whose median covers its link time is not flagged."""
    run = lambda ts, busy: {"step_times": ts, "wall_seconds": 0.42 * len(ts), "wall_steps": len(ts),  # noqa: E731
                            "finite": True, "link_busy_ms_modelled": busy, "link_busy_ms_measured": busy}
    done = {("c", "ethernet"): {"ahead": [run([0.30, 0.31], 400.0)], "sync": [run([0.41, 0.42], 400.0)]}}
    summ = em.summarize(done, None)
    rows = {r["arm"]: r for r in summ["rows"]}
    assert rows["ahead"]["lagging"] and not rows["sync"]["lagging"]
    md = em.summary_markdown(summ, ["# t"])
    ahead = next(ln for ln in md.splitlines() if "| ahead |" in ln)
    sync = next(ln for ln in md.splitlines() if "| sync |" in ln)
    assert "lagging" in ahead and "lagging" not in sync and "no steady step" in md


#: A Qwen3 with a tied embedding larger than a partition and every other parameter exact
#: (small_param_numel above them all): the ranks' counts of exact elements per chunk differ, as
#: in Qwen3-4B's gather (rank 0's chunks hold the embedding and none, rank 1's many).


@pytest.mark.slow  # an end-to-end run of a benchmark script: python -m pytest -m slow
def test_the_matrix_runs_arms_in_fresh_processes_on_the_cpu(tmp_path):
    """One arm (INT8 weights, whose other ranks' slots decode with their own counts of exact
    elements, and INT8 gradients: an all-to-all per bucket), two links in its process:
    finite losses (the INT8 arm stops with non-finite gradients at its second step when other
    ranks' side channels hold stale bytes), link time booked only on the held link, the tables."""
    proc = bench_scripts.run_emulated_matrix(
        tmp_path, "--steps", "2", "--warmup", "0", "--links", "none,pcie:time_scale=1e-3", "--rounds", "1",
        "--arm", "qgrad:quantized=true,overlap=false,zero_quantized_gradients=true,small_param_numel=65536",
        "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tmp_path = tmp_path / "out"
    summary = json.load(open(tmp_path / "summary.json"))
    rows = {(r["link"], r["arm"]): r for r in summary["rows"]}
    assert len(rows) == 2 and all(r["runs"] == 1 and r["finite"] for r in rows.values()), rows
    assert rows[("none", "qgrad")]["link_busy_ms_modelled"] == 0
    assert rows[("pcie:time_scale=1e-3", "qgrad")]["link_busy_ms_modelled"] > 0
    cell = next(p for p in tmp_path.iterdir() if p.is_dir() and p.name != "logs")
    m = json.load(open(cell / "pcie_time_scale1e-3" / "matrix.json"))
    run = m["runs"]["qgrad"][0]
    assert run["emulated_world"] == 2 and run["replicas_identical"] is None and "all_to_all" in run["link_per_step"]
    md = open(cell / "pcie_time_scale1e-3" / "matrix.md").read()
    assert "emulated link" in md and "emulated" in m["environment"]["link_regime"]
    assert math.isfinite(m["analysis"]["arms"][0]["median_step_s"])


def test_calibration_compares_exposures_and_fits_the_resident_ctas(tmp_path, monkeypatch):
    cal = bench_scripts.load("emulated_calibration")
    from qzero.app.benchmarks import steps as steps_matrix

    # a two-GPU matrix as qzero bench steps analyses and writes it, in a results tree of its own
    medians = {"gpu1": 0.390, "plain": 0.590, "int8": 0.505, "plain_ahead": 0.516, "fsdp2": 0.487, "deepspeed": 0.713}
    runs = {arm: [{"step_times": [m * f for f in (0.99, 1.0, 1.01)], "wall_seconds": 3 * m, "wall_steps": 3}]
            for arm, m in medians.items()}
    (tmp_path / "dp2_pcie_4b_bucket50m").mkdir()
    matrix = {"runs": runs, "analysis": steps_matrix.analyse(runs, "plain", [])}
    (tmp_path / "dp2_pcie_4b_bucket50m" / "matrix.json").write_text(json.dumps(matrix))
    monkeypatch.setattr(cal, "REAL", tuple(r for r in cal.REAL if r.folder == "dp2_pcie_4b_bucket50m"))
    real = cal.real_rows(str(tmp_path))
    assert {r["arm"] for r in real} == set(medians)  # int8_ahead has no runs here: left out
    floor = next(r["real_ms"] for r in real if r["arm"] == "gpu1")
    assert floor == pytest.approx(390.0)
    exposed = {r["arm"]: r["real_ms"] - floor for r in real}
    base = dict(preset="qwen3-4b", allgather_bucket=5e7, reduce_bucket=2.6e7, runs=1, finite=True, link="x",
                link_busy_ms_modelled=1.0, link_busy_ms_measured=None)
    emu = [dict(base, arm="gpu1", regime="none", ctas=0, median_ms=400.0)]
    for k, off in ((0, 40.0), (8, 3.0), (16, -30.0)):  # ctas=8 lands within 3 ms of every real exposure
        for arm in ("plain", "fsdp2", "plain_ahead"):
            emu.append(dict(base, arm=arm, regime="pcie", ctas=k, median_ms=400.0 + (exposed[arm] + off) / 1.25))
    rows = {r["arm"]: r for r in cal.table(emu, real, 1.25, 8) if r["folder"] == "dp2_pcie_4b_bucket50m"}
    assert rows["plain"]["diff_ms"] == pytest.approx(3.0) and rows["plain"]["within"]
    assert rows["deepspeed"]["emulated_exposed_ms"] is None and rows["deepspeed"]["within"] is None
    fitted = cal.fit(emu, real, 1.25)
    assert fitted["ctas"] == 8 and set(fitted["scores"]) == {0, 8, 16}
    assert cal.time_scale(emu, real) == pytest.approx(floor / 400.0)


def test_a_delivery_backdates_a_transfer_by_a_device_copy_not_by_milliseconds():
    """The hold backdates a transfer's start by the delivery's estimated device time. At the
    rate of a device copy (terabytes a second) 64 MiB take tens of microseconds; an estimate
    in milliseconds would start transfers at the previous one's end although they were issued
    later, and hide the gaps between a gather's chunks."""
    pytest.importorskip("triton")
    lk = bench_scripts.load("link_kernels")

    ns = lk.delivery_ns(64 << 20)
    assert 10_000 < ns < 100_000, ns
    assert lk.delivery_ns(0) == lk.DELIVERY_FIXED_NS


def test_resume_keeps_the_runs_finished_on_every_link_and_refuses_another_matrix(tmp_path):
    """``emulated_matrix.resumed``: a (round, cell, arm) is kept when every link has a run of it
    that did not fail; failed runs and runs missing a link are dropped (they run again whole);
    an arm whose settings differ from the planned ones is refused by name."""
    import dataclasses as dc

    @dc.dataclass
    class S:
        x: int

    plans = {"cell": (None, {"a": S(1), "b": S(2)}, {}, None, None)}
    links = ["pcie:ctas=0", "nvlink"]
    ok = lambda r: {"round": r, "step_times": [0.1]}  # noqa: E731
    runs = {"pcie:ctas=0": {"a": [ok(0), ok(1)], "b": [{"round": 0, "failed": True}]},
            "nvlink": {"a": [ok(0)], "b": [ok(0)]}}
    for link, by_arm in runs.items():
        d = tmp_path / "cell" / em.link_dir(link)
        d.mkdir(parents=True)
        arms = [{"name": n, "settings": dc.asdict(s)} for n, s in plans["cell"][1].items()]
        (d / "matrix.json").write_text(json.dumps({"arms": arms, "runs": by_arm}))
    done, finished = em.resumed(str(tmp_path), plans, links)
    assert finished == {(0, "cell", "a")}  # a's round 1 lacks NVLink; b's round 0 failed on PCIe-class
    assert [r["round"] for r in done[("cell", "pcie:ctas=0")]["a"]] == [0]  # round 1 runs again on both links
    assert [r["round"] for r in done[("cell", "nvlink")]["a"]] == [0]
    assert done[("cell", "pcie:ctas=0")]["b"] == done[("cell", "nvlink")]["b"] == []  # b's round 0 runs again
    assert em.resumed(str(tmp_path / "elsewhere"), plans, links) == (
        {("cell", link): {"a": [], "b": []} for link in links}, set())
    other = {"cell": (None, {"a": S(1), "b": S(3)}, {}, None, None)}
    with pytest.raises(ValueError, match="arm 'b' of cell on pcie:ctas=0 has other settings"):
        em.resumed(str(tmp_path), other, links)


@pytest.mark.slow  # two end-to-end runs of a benchmark script: python -m pytest -m slow
def test_a_resumed_matrix_runs_only_what_is_missing(tmp_path):
    """One round, then the same command with two rounds and --resume: one more run, both in the
    matrix (rounds 0 and 1), the first one's numbers unchanged."""
    out = tmp_path / "out"
    args = ("--steps", "2", "--warmup", "0", "--links", "pcie:time_scale=1e-3",
            "--arm", "int8:quantized=true,overlap=false", "--out", str(out))
    first = bench_scripts.run_emulated_matrix(tmp_path, *args, "--rounds", "1")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    path = next(out.glob("*/pcie_time_scale1e-3/matrix.json"))
    before = json.load(open(path))["runs"]["int8"]
    again = bench_scripts.run_emulated_matrix(tmp_path, *args, "--rounds", "2", "--resume")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "--resume: 1 run(s) kept" in again.stdout and "1 to run" in again.stdout
    m = json.load(open(path))
    assert [r["round"] for r in m["runs"]["int8"]] == [0, 1] and m["complete"] and m["runs_done"] == 2
    assert m["runs"]["int8"][0]["step_times"] == before[0]["step_times"]
    for r in m["runs"]["int8"]:  # each measured step's host start, to line up with a GPU clock log
        t = r["step_started_unix"]
        assert len(t) == len(r["step_times"]) and t == sorted(t) and t[0] > 1.7e9
