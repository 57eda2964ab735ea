"""benchmarks/scripts/emulated_ratios.py: speed-ups between arms of emulated matrices, read from their
matrix.json files, with the runs' medians and an interval that holds the ratio."""

import json
import os
import statistics

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks", "scripts")

from _support import bench_scripts  # noqa: E402

er = bench_scripts.load("emulated_ratios")


def matrix(arms: dict[str, list[list[float]]]) -> dict:
    return {"emulated_link": {"name": "pcie:ctas=0"},
            "analysis": {"arms": [{"arm": a, "step_times_by_run": runs} for a, runs in arms.items()]
                         + [{"arm": "failed", "step_times_by_run": []}]}}


def write(tmp_path, arms):
    d = tmp_path / "out" / "qwen3-4b_ag5e+07_rs2.6e+07" / "pcie_ctas0"
    d.mkdir(parents=True)
    (d / "matrix.json").write_text(json.dumps(matrix(arms)))
    return tmp_path / "out"


def test_a_pair_is_the_ratio_of_pooled_medians_with_run_medians_and_an_interval(tmp_path, capsys):
    out = write(tmp_path, {"slow": [[0.50, 0.52, 0.51], [0.60, 0.61, 0.59]],
                           "fast": [[0.40, 0.41, 0.39], [0.42, 0.43, 0.44]]})
    runs = er.arm_runs(json.loads(next(out.rglob("matrix.json")).read_text()))
    assert set(runs) == {"slow", "fast"}  # an arm with no run is left out
    r = er.compare(runs, "slow", "fast")
    assert r["base_ms"] == pytest.approx(555.0) and r["cand_ms"] == pytest.approx(415.0)
    assert r["ratio"] == pytest.approx(555.0 / 415.0)
    assert r["base_runs_ms"] == pytest.approx([510.0, 600.0]) and r["cand_runs_ms"] == pytest.approx([400.0, 430.0])
    lo, hi = r["ci95"]
    assert lo <= r["ratio"] <= hi and lo > 1.0  # every resample has "fast" faster
    assert er.compare(runs, "slow", "absent") is None
    assert er.main([str(out), "--pair", "slow/fast", "--pair", "fast/absent", "--out", str(tmp_path / "r.md")]) == 0
    text = capsys.readouterr().out
    assert "| slow | fast | 555.0 (510.0 / 600.0) | 415.0 (400.0 / 430.0) | 1.337×" in text
    assert "absent" not in text and (tmp_path / "r.md").read_text() == text


def test_bad_pairs_and_empty_folders_are_refused_with_their_value(tmp_path, capsys):
    out = write(tmp_path, {"a": [[0.1]], "b": [[0.2]]})
    with pytest.raises(SystemExit) as e:
        er.main([str(out), "--pair", "a-b"])
    assert e.value.code == 2 and "'a-b'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        er.main([str(tmp_path / "nothing"), "--pair", "a/b"])
    assert "no CELL/LINK/matrix.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        er.main([str(out), "--pair", "x/y"])
    assert "none of the pairs" in capsys.readouterr().err


def test_runs_of_one_cell_and_link_are_pooled_over_folders(tmp_path, capsys):
    one = write(tmp_path / "a", {"slow": [[0.50]], "fast": [[0.40]]})
    two = write(tmp_path / "b", {"slow": [[0.70]], "fast": [[0.44]]})
    assert er.main([str(one), str(two), "--pair", "slow/fast"]) == 0
    text = capsys.readouterr().out
    assert text.count("| slow | fast |") == 1  # one row, both folders' runs
    assert "| 600.0 (500.0 / 700.0) | 420.0 (400.0 / 440.0) |" in text


def test_host_excess_bounds_a_ratio_by_each_arms_calls(tmp_path, capsys):
    """--host-excess: each arm's excess is its calls per step times the emulated call's extra
    host microseconds per kind; the ratio's bounds take each step with none or all of it."""
    m = matrix({"few": [[0.50, 0.50]], "many": [[0.49, 0.49]]})
    m["runs"] = {"few": [{"link_per_step": {"all_gather": {"calls": 10.0}, "reduce_scatter": {"calls": 10.0}}}],
                 "many": [{"link_per_step": {"all_gather": {"calls": 100.0}, "all_to_all": {"calls": 50.0},
                                             "barrier": {"calls": 2.0}}}]}
    d = tmp_path / "out" / "cell" / "pcie"
    d.mkdir(parents=True)
    (d / "matrix.json").write_text(json.dumps(m))
    emulated = {"mode": "emulated", "host_us_per_call": {"all_gather_into_tensor": 130.0,
                                                         "reduce_scatter_tensor": 130.0,
                                                         "all_to_all_single": 120.0, "all_reduce": 110.0}}
    nccl = {"mode": "nccl", "host_us_per_call": {"all_gather_into_tensor": 30.0, "reduce_scatter_tensor": 50.0,
                                                 "all_to_all_single": 40.0, "all_reduce": 30.0}}
    excess = er.host_excess_us(emulated, nccl)
    assert excess["all_gather"] == 100.0 and excess["reduce_scatter"] == 80.0 and excess["barrier"] == 80.0
    got = er.arm_excess_ms(m, excess)
    assert got == {"few": pytest.approx(1.8), "many": pytest.approx(10.0 + 4.0 + 0.16)}
    lo, hi = er.excess_bounds(500.0, 490.0, 1.8, 14.16)
    assert lo == pytest.approx(498.2 / 490.0) and hi == pytest.approx(500.0 / 475.84)
    for name, obj in (("emu.json", emulated), ("nccl.json", nccl)):
        (tmp_path / name).write_text(json.dumps(obj))
    assert er.main([str(tmp_path / "out"), "--pair", "few/many", "--host-excess", str(tmp_path / "emu.json"),
                    str(tmp_path / "nccl.json")]) == 0
    assert f"| 1.8, 14.2 | {lo:.3f}–{hi:.3f}× |" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # the two results in the wrong order
        er.main([str(tmp_path / "out"), "--pair", "few/many", "--host-excess", str(tmp_path / "nccl.json"),
                 str(tmp_path / "emu.json")])
    assert "an emulated and then an NCCL result" in capsys.readouterr().err
    m["runs"]["many"][0]["link_per_step"]["gossip"] = {"calls": 1.0}  # a kind with no host cost: refused, named
    with pytest.raises(ValueError, match="gossip"):
        er.arm_excess_ms(m, excess)


def test_every_named_emulated_arm_is_a_valid_arm_of_the_matrix():
    """benchmarks/scripts/emulated_calibration.ARMS (what run_emulated.sh's stages run) parse as --arm specs
    whose settings are ZeroConfig's fields with valid values."""
    import dataclasses

    ec = bench_scripts.load("emulated_calibration")
    from qzero.app.benchmarks import steps as sm
    from qzero.config import ZeroConfig

    fields = {f.name for f in dataclasses.fields(ZeroConfig)}
    for name in ec.ARMS:
        arm, overrides = sm.parse_arm(ec.arm_spec(name))
        assert arm == name
        zero = {k: v for k, v in overrides.items() if k in fields}
        ZeroConfig(**zero)  # raises on a bad value
    assert sm.parse_arm(ec.arm_spec("int8_ahead_if8"))[1]["reduce_buckets_in_flight"] == 8


def test_fastest_compares_each_arms_fastest_run_alone(tmp_path, capsys):
    """A run the host slowed (the second of "slow") drops out; the other arm's fastest run is
    its second; the interval then resamples steps of those two runs only."""
    out = write(tmp_path, {"slow": [[0.50, 0.52, 0.51], [0.70, 0.71, 0.69]],
                           "fast": [[0.45, 0.46, 0.44], [0.40, 0.41, 0.39]]})
    runs = er.arm_runs(json.loads(next(out.rglob("matrix.json")).read_text()))
    r = er.compare(runs, "slow", "fast", fastest=True)
    assert r["base_runs_ms"] == pytest.approx([510.0]) and r["cand_runs_ms"] == pytest.approx([400.0])
    assert r["ratio"] == pytest.approx(510.0 / 400.0)
    lo, hi = r["ci95"]
    assert 500.0 / 410.0 <= lo <= r["ratio"] <= hi <= 520.0 / 390.0
    assert er.compare(runs, "slow", "fast")["ratio"] == pytest.approx(
        statistics.median([500, 510, 520, 690, 700, 710]) / 425.0)
    assert er.main([str(out), "--pair", "slow/fast", "--fastest"]) == 0
    text = capsys.readouterr().out
    assert "each arm's fastest run" in text and "| 510.0 (510.0) | 400.0 (400.0) | 1.275×" in text
