"""benchmarks/scripts/gather_scaling.py: the bandwidth model against world size."""

import copy
import json

import pytest

from _support import bench_scripts
from _support.gather_results import gather_result

gs = bench_scripts.load("gather_scaling")


def synthetic(world, busbw_gbps, numel=1 << 30, group=64, extra_ms=0.0):
    """A gather benchmark result whose arms follow the model exactly (plus ``extra_ms``)."""
    arms = {}
    for arm, bpp in (("bf16", 2.0), ("int8", 1 + 4 / group), ("int4", 0.5 + 4 / group)):
        arms[arm] = [1e3 * bpp * numel * (world - 1) / world / (busbw_gbps * 1e9) + extra_ms]
    return gather_result(world, {numel: arms}, group_size=group)


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


def test_a_result_of_the_gather_benchmark_reads(tmp_path):
    """A result as ``qzero bench gather`` writes it (its record code, two sizes, the arms the
    bandwidth model does not describe beside those it does): the calibration reads the bf16 arm
    of the first size listed, payload-only and public-API arms count their format's bytes, and
    time beyond the bytes shows as measured / model above one."""
    busbw, n_big, n_small = 50e9, 1 << 31, 1 << 28

    def ms(bpp, n, extra=1.0):  # the model's time at DP2, times ``extra``
        return 1e3 * bpp * n / 2 / busbw * extra

    def arms(n):
        return {"bf16 one NCCL call": [ms(2, n, 0.9)] * 3, "bf16": [ms(2, n) * f for f in (0.99, 1.0, 1.02)],
                "int8": [ms(1.0625, n, 1.05)] * 3, "int8 payload only": [ms(1.0625, n)] * 3,
                "int8 via quantized_all_gather": [ms(1.0625, n, 1.2)] * 3}

    path = tmp_path / "dp2.json"
    path.write_text(json.dumps(gather_result(2, {n_big: arms(n_big), n_small: arms(n_small)})))
    a = gs.analyse(gs.load([str(path)]))
    assert a["calibration"]["numel"] == n_big
    assert a["calibration"]["busbw_GBps"] == pytest.approx(busbw / 1e9)
    ratio = {(r["numel"], r["arm"]): r["measured_over_model"] for r in a["rows"]}
    assert len(ratio) == 2 * 5
    for n in (n_big, n_small):
        assert ratio[n, "bf16"] == pytest.approx(1.0)
        assert ratio[n, "int8"] == pytest.approx(1.05)
        assert ratio[n, "int8 payload only"] == pytest.approx(1.0)
        assert ratio[n, "int8 via quantized_all_gather"] == pytest.approx(1.2)
        assert ratio[n, "bf16 one NCCL call"] == pytest.approx(0.9)
