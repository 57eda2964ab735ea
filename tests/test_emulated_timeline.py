"""benchmarks/scripts/emulated_timeline.py: a step's phases against the link's transfers (clipped at the
phase borders, overlaps, idle, tail, after), the stamps' join with the link's transfers on the
CPU, and benchmarks/scripts/emulated_matrix.py --timeline end to end on a tiny model with its chart."""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks", "scripts")

from _support import bench_scripts  # noqa: E402

el = bench_scripts.load("emulated_link")
em = bench_scripts.load("emulated_matrix")
et = bench_scripts.load("emulated_timeline")

PHASES = {"forward": (0.0, 10.0), "backward": (10.0, 25.0), "step": (25.0, 30.0)}


def tr(op, issued, start, end, sent=100):
    return {"op": op, "issued": issued, "start_ms": start, "end_ms": end, "sent": sent}


def test_busy_is_clipped_at_phase_borders_with_overlaps_idle_tail_and_after():
    transfers = [
        tr("all_gather", "earlier", -3.0, 4.0, sent=1),  # issued by the step before: in forward only
        tr("all_gather", "forward", 6.0, 12.0, sent=10),  # across forward | backward
        tr("reduce_scatter", "backward", 20.0, 27.0, sent=20),  # across backward | step: the tail
        tr("reduce_scatter", "backward", 22.0, 24.0, sent=30),  # overlaps the one before
        tr("all_gather", "step", 28.0, 33.0, sent=40),  # issued in the step, runs past its end
        tr("all_reduce", "backward", None, None, sent=7),  # never held: bytes, no time
    ]
    got = et.analyse_step(PHASES, transfers)
    f, b, s = (got["by_phase"][n] for n in ("forward", "backward", "step"))
    assert f["ms"] == 10 and b["ms"] == 15 and s["ms"] == 5
    assert f["busy_ms"] == pytest.approx({"all_gather": 4 + 4})
    assert f["idle_ms"] == pytest.approx(10 - 8)  # [0, 4] and [6, 10] busy
    assert b["busy_ms"] == pytest.approx({"all_gather": 2, "reduce_scatter": 5 + 2})
    assert b["idle_ms"] == pytest.approx(15 - (2 + 5))  # [10, 12], [20, 25]: the overlap counted once
    assert s["busy_ms"] == pytest.approx({"reduce_scatter": 2, "all_gather": 2})
    assert s["idle_ms"] == pytest.approx(5 - 4)
    assert got["tail_ms"] == pytest.approx({"reduce_scatter": 2})  # not the gather the step itself issued
    assert got["after_ms"] == pytest.approx({"all_gather": 3})
    assert got["sent"] == {"all_gather": 50, "reduce_scatter": 50, "all_reduce": 7}  # not the earlier one's


def test_an_idle_link_and_the_medians_count_a_missing_collective_as_zero():
    quiet = et.analyse_step(PHASES, [])
    assert [quiet["by_phase"][n]["idle_ms"] for n in et.PHASES] == [10, 15, 5] and quiet["tail_ms"] == {}
    busy = et.analyse_step(PHASES, [tr("reduce_scatter", "backward", 24.0, 29.0)])
    med = et.medians([quiet, busy, busy])
    assert med["steps"] == 3 and med["tail_ms"] == {"reduce_scatter": 4.0}
    assert et.medians([quiet, quiet, busy])["by_phase"]["step"]["busy_ms"] == {"reduce_scatter": 0.0}
    text = et.table(med)
    assert "emulated link" in text and "reduce_scatter 4.0" in text
    md = et.markdown([{"cell": "c", "link": "pcie", "arm": "a", "timeline": med}, {"cell": "c", "link": "x", "arm": "b",
                                                                                  "timeline": {}}])
    assert md.count("| c |") == 1 and "emulated link" in md


COMPILE = r"""
import os, sys
os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import link_kernels as lk
k = triton.compile(ASTSource(fn=lk._stamp_kernel, signature=dict(buf_ptr="*i64", slot="i32"), constexprs={}),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
ptx = k.asm["ptx"]
print(ptx.count("%globaltimer"), ptx.count("st.global"))
"""


def test_stamp_kernel_compiles_for_sm90_and_writes_the_global_timer():
    pytest.importorskip("triton")
    out = subprocess.run([sys.executable, "-c", COMPILE, BENCH], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    timer, stores = map(int, out.stdout.split())
    assert timer == 1 and stores >= 1, out.stdout


class FakeClock:
    def __init__(self):
        self.now = 1.0

    def __call__(self):
        return self.now


def test_stamps_join_the_transfers_issued_carried_and_missing_on_the_cpu():
    clock = FakeClock()
    link = el.Link(el.parse_link("pcie"), clock=clock, sleep=lambda dt: None, keep=2)
    wire = el.Wire(1000, 1000, 1)
    cpu = torch.device("cpu")
    stamps = et.StepStamps(link, cpu, 2)
    stamps.mark(0, et.START)
    link.place("all_gather", wire, cpu, True)  # step 0's forward
    clock.now += 1.0
    stamps.mark(0, et.FORWARD_END)
    stamps.mark(0, et.BACKWARD_END)
    ahead = link.place("all_gather", el.Wire(int(4e9), int(4e9), 1), cpu, True)  # long: into step 1
    clock.now += 0.01
    stamps.mark(0, et.STEP_END)
    stamps.mark(1, et.START)
    clock.now += 0.01
    stamps.mark(1, et.FORWARD_END)
    for _ in range(3):  # three between two stamps, the link keeps two: one is missing
        link.place("reduce_scatter", wire, cpu, True)
    clock.now += 0.01
    stamps.mark(1, et.BACKWARD_END)
    stamps.mark(1, et.STEP_END)
    rec = stamps.record(first=1)
    assert json.loads(json.dumps(rec)) == rec and rec["clock"] == "host clock"
    assert rec["missing_transfers"] == 1 and "left the link's record" in rec["note"]
    (step,) = rec["steps"]
    assert step["step"] == 1
    got = {t["index"]: t["issued"] for t in step["transfers"]}
    assert got == {ahead.index: "earlier", 3: "backward", 4: "backward"}
    assert step["sent"] == {"reduce_scatter": 2000}
    fwd = step["by_phase"]["forward"]
    assert fwd["busy_ms"]["all_gather"] == pytest.approx(10.0) and fwd["idle_ms"] == pytest.approx(0.0, abs=1e-9)


def test_the_device_path_joins_the_timer_stamps_with_the_device_log():
    """The CUDA branch of the join, with the device's two reads stood in for: stamps and log on
    the GPU's global timer (nanoseconds near 1.7e18: read relative to the first stamp), a held
    transfer whose entry left the device log counted as missing, a transfer of no ring step
    (never held) with its bytes and no time."""
    base = 1_700_000_000_123_456_789

    class Timer:
        def __init__(self):
            self.slots = {}

        def stamp(self, slot):
            self.slots[slot] = base + 1_000_000 * (slot % 4)  # the phases 1 ms each

        def read(self):
            return [self.slots[k] for k in range(len(self.slots))]

    link = el.Link(el.parse_link("pcie"), clock=FakeClock(), sleep=lambda dt: None)
    gpu = torch.device("cuda", 0)  # only named: the link books a CUDA transfer without touching a device
    stamps = et.StepStamps(link, torch.device("cpu"), 1)
    stamps.cuda, stamps._dev = True, Timer()
    stamps.mark(0, et.START)
    link.place("all_gather", el.Wire(1000, 1000, 1), gpu, True)
    stamps.mark(0, et.FORWARD_END)
    link.place("reduce_scatter", el.Wire(500, 500, 1), gpu, True)
    link.place("barrier", el.Wire(0, 0, 0), gpu, False)
    stamps.mark(0, et.BACKWARD_END)
    stamps.mark(0, et.STEP_END)
    link.device_log = lambda: [(0, base + 500_000, base + 1_500_250)]
    rec = stamps.record(first=0)
    assert rec["clock"] == "GPU global timer" and rec["missing_times"] == 1 and rec["missing_transfers"] == 0
    (step,) = rec["steps"]
    assert step["phases"] == {"forward": [0.0, 1.0], "backward": [1.0, 2.0], "step": [2.0, 3.0]}
    assert step["by_phase"]["forward"]["busy_ms"] == {"all_gather": pytest.approx(0.5)}
    assert step["by_phase"]["backward"]["busy_ms"] == {"all_gather": pytest.approx(0.50025, abs=1e-9)}
    assert step["sent"] == {"all_gather": 1000, "reduce_scatter": 500, "barrier": 0}
    assert [t["start_ms"] for t in step["transfers"]] == [pytest.approx(0.5), None, None]


def test_the_host_lead_is_the_gpu_stamp_against_its_enqueue_on_the_host_clock(monkeypatch):
    """CUDA stamps: each stamp's host lead is the GPU's time at it less the host's enqueue time,
    the clocks' offset taken from one more stamp enqueued after the steps (on an idle GPU);
    the medians and the tables carry it; CPU stamps have none."""
    base = 1_700_000_000_000_000_000
    host = iter([0, 1_000_000, 2_000_000, 3_000_000, 10_000_000])  # four enqueues, then the offset's stamp
    monkeypatch.setattr(et.time, "perf_counter_ns", lambda: next(host))
    gpu_at = {0: 5_000_000, 1: 5_500_000, 2: 7_000_000, 3: 9_900_000, 4: 10_000_000}  # the offset's: on time

    class Timer:
        def __init__(self):
            self.slots = {}

        def stamp(self, slot):
            self.slots[slot] = base + gpu_at[slot]

        def read(self):
            return [self.slots.get(k, 0) for k in range(5)]

    link = el.Link(el.parse_link("pcie"), clock=FakeClock(), sleep=lambda dt: None)
    stamps = et.StepStamps(link, torch.device("cpu"), 1)
    stamps.cuda, stamps._dev = True, Timer()
    for point in (et.START, et.FORWARD_END, et.BACKWARD_END, et.STEP_END):
        stamps.mark(0, point)
    link.device_log = lambda: []
    rec = stamps.record(first=0)
    lead = rec["steps"][0]["host_lead_ms"]
    assert lead == {"start": pytest.approx(5.0), "forward_end": pytest.approx(4.5), "backward_end": pytest.approx(5.0),
                    "step_end": pytest.approx(6.9)}
    assert rec["median"]["host_lead_ms"] == lead
    assert "host lead (GPU behind the host) at start 5.0, forward_end 4.5, backward_end 5.0, step_end 6.9" in \
        et.table(rec["median"])
    row = {"cell": "c", "link": "pcie", "arm": "a", "timeline": rec["median"]}
    assert et.markdown([row]).rstrip().endswith("| 4.5 / 5.0 / 6.9 |")
    cpu = et.StepStamps(el.Link(el.parse_link("pcie"), clock=FakeClock(), sleep=lambda dt: None),
                        torch.device("cpu"), 1)
    for point in (et.START, et.FORWARD_END, et.BACKWARD_END, et.STEP_END):
        cpu.mark(0, point)
    crec = cpu.record(first=0)
    assert "host_lead_ms" not in crec["steps"][0] and "host_lead_ms" not in crec["median"]
    assert et.markdown([{**row, "timeline": crec["median"]}]).rstrip().endswith("| — |")



@pytest.mark.slow  # an end-to-end run of a benchmark script (about 15 s): python -m pytest -m slow
def test_the_matrix_with_timeline_on_the_cpu_and_its_chart(tmp_path):
    """A tiny arm with gradient accumulation and the gather ahead, ``--timeline``: every measured
    step, its stamps in order, its transfers' bytes those of the record's link per step; the
    summary's table; a PNG from the plot script."""
    out = tmp_path / "out"
    proc = bench_scripts.run_emulated_matrix(
        tmp_path, "--grad-accum", "2", "--steps", "3", "--warmup", "1", "--links", "pcie:time_scale=1e-2",
        "--rounds", "1",
        "--arm", "ahead:quantized=true,overlap=true", "--timeline", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cell = next(p for p in out.iterdir() if p.is_dir() and p.name != "logs")
    rec = json.load(open(cell / "pcie_time_scale1e-2" / "matrix.json"))["runs"]["ahead"][0]
    tl = rec["timeline"]
    assert [s["step"] for s in tl["steps"]] == [1, 2] and tl["missing_transfers"] == tl["missing_times"] == 0
    for s in tl["steps"]:
        edges = [s["phases"]["forward"][0], *(s["phases"][n][1] for n in et.PHASES)]
        assert edges[0] == 0 and edges == sorted(edges), edges
        for t in s["transfers"]:
            assert t["start_ms"] <= t["end_ms"]
    measured = rec["wall_steps"]
    for op, per in rec["link_per_step"].items():
        got = sum(t["sent"] for s in tl["steps"] for t in s["transfers"] if t["op"] == op and t["issued"] != "earlier")
        assert got == pytest.approx(per["sent"] * measured), op
        assert sum(s["sent"].get(op, 0) for s in tl["steps"]) == got
    assert sum(v for s in tl["steps"] for p in s["by_phase"].values() for v in p["busy_ms"].values()) > 0
    assert "Step timeline" in (out / "summary.md").read_text() and "timeline (emulated link" in proc.stdout
    plot = subprocess.run([sys.executable, os.path.join(BENCH, "emulated_timeline.py"), str(out)], capture_output=True,
                          text=True, timeout=300)
    assert plot.returncode == 0, plot.stderr[-3000:]
    png = cell / "pcie_time_scale1e-2" / "timeline_ahead.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
