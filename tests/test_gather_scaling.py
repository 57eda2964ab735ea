"""bench/gather_scaling.py: the bandwidth model against world size."""

import copy
import json
import os

import pytest

import bench_scripts

ROOT = bench_scripts.ROOT
gs = bench_scripts.load("gather_scaling")
DP2 = os.path.join(ROOT, "bench", "results", "gather", "dp2_pcie.json")


def synthetic(world, busbw_gbps, numel=1 << 30, group=64, extra_ms=0.0):
    """A gather_bench result whose arms follow the model exactly (plus ``extra_ms``)."""
    arms = {}
    for arm, bpp in (("bf16", 2.0), ("int8", 1 + 4 / group), ("int4", 0.5 + 4 / group)):
        ms = 1e3 * bpp * numel * (world - 1) / world / (busbw_gbps * 1e9) + extra_ms
        arms[arm] = {"median_ms": ms, "times_ms": [ms]}
    return {"mode": "multi", "world_size": world, "regime": "test link", "group_size": group, "device": "fake",
            "sizes": [{"numel": numel, "arms": arms}]}


def write(tmp_path, results):
    paths = []
    for r in results:
        p = tmp_path / f"w{r['world_size']}.json"
        p.write_text(json.dumps(r))
        paths.append(str(p))
    return paths


def test_a_link_that_follows_the_model_gives_ratio_one(tmp_path):
    paths = write(tmp_path, [synthetic(w, 40.0) for w in (8, 2, 4)])  # any order
    out = tmp_path / "out"
    assert gs.main([*paths, "--out", str(out)]) == 0
    a = json.loads((out / "gather_scaling.json").read_text())
    assert a["calibration"]["world_size"] == 2
    assert a["calibration"]["busbw_GBps"] == pytest.approx(40.0)
    assert {r["world_size"] for r in a["rows"]} == {2, 4, 8}
    for r in a["rows"]:
        assert r["measured_over_model"] == pytest.approx(1.0)
        assert r["busbw_GBps"] == pytest.approx(40.0)
    assert (out / "gather_scaling.png").read_bytes()[:4] == b"\x89PNG"
    assert "| 8 | 1 Gi | int8 | 1.062 |" in (out / "gather_scaling.md").read_text()


def test_time_the_model_does_not_explain_shows_above_one(tmp_path):
    results = [synthetic(2, 50.0), synthetic(8, 50.0, extra_ms=10.0)]
    a = gs.analyse(gs.load(write(tmp_path, results)))
    at8 = {r["arm"]: r for r in a["rows"] if r["world_size"] == 8}
    assert all(r["measured_over_model"] > 1.0 for r in at8.values())
    # the model's world-size factor: (8-1)/8 over (2-1)/2
    at2 = {r["arm"]: r for r in a["rows"] if r["world_size"] == 2}
    assert at8["bf16"]["model_ms"] / at2["bf16"]["model_ms"] == pytest.approx(1.75)


def test_bad_inputs_are_refused(tmp_path):
    a, b = synthetic(2, 40.0), synthetic(4, 40.0)
    b["regime"] = "other"
    assert gs.main([*write(tmp_path, [a, b]), "--out", str(tmp_path / "o")]) == 2
    single = copy.deepcopy(a)
    single["mode"] = "single"
    assert gs.main([*write(tmp_path, [single]), "--out", str(tmp_path / "o")]) == 2
    no_bf16 = synthetic(2, 40.0)
    del no_bf16["sizes"][0]["arms"]["bf16"]
    assert gs.main([*write(tmp_path, [no_bf16]), "--out", str(tmp_path / "o")]) == 2


def test_the_committed_dp2_result_reads():
    """The committed PCIe-class result: the calibration reads the bf16 arm of the largest size
    (bytes over time, computed here from the raw file), and the INT8 gather is within 10% of
    its bytes' time at that bandwidth."""
    raw = json.load(open(DP2))
    size = max(raw["sizes"], key=lambda s: s["numel"])
    w = raw["world_size"]
    busbw = 2 * size["numel"] * (w - 1) / w / (size["arms"]["bf16"]["median_ms"] / 1e3) / 1e9
    a = gs.analyse(gs.load([DP2]))
    assert a["calibration"]["busbw_GBps"] == pytest.approx(busbw, rel=1e-6)
    int8 = next(r for r in a["rows"] if r["arm"] == "int8" and r["numel"] == size["numel"])
    assert 1.0 <= int8["measured_over_model"] < 1.1
