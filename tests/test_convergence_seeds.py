"""bench/convergence_seeds.py: an arm's final loss against bf16 over several runs."""

import json
import math
import os
import statistics

import bench_scripts
import pytest

cs = bench_scripts.load("convergence_seeds")
RESULTS = os.path.join(bench_scripts.ROOT, "bench", "results", "convergence")


def run(tmp_path, name, seed, diffs, reference_loss=1.0, heldout=None, **study):
    """A minimal study record: the reference and arms with the given Δ % (and held-out Δ %)."""
    arms = {"bf16": {"final_loss": reference_loss, "diff_pct": 0.0}}
    arms.update({a: {"final_loss": reference_loss * (1 + d / 100), "diff_pct": d} for a, d in diffs.items()})
    record = {"preset": "tiny", "steps": 20, "seq_len": 64, "micro_batch": 4, "world_size": 2, "lr": 3e-4,
              "last": 10, "seed": seed, **study,
              "summary": {"reference": "bf16", "arms": arms},
              "arms": {a: {"label": a.upper()} for a in arms}}
    if heldout is not None:
        record["heldout_summary"] = {"step": 20, "reference": "bf16",
                                     "arms": {"bf16": {"loss": 2.0, "diff_pct": 0.0},
                                              **{a: {"loss": 2.0, "diff_pct": d} for a, d in heldout.items()}}}
    folder = tmp_path / name
    folder.mkdir()
    (folder / "convergence.json").write_text(json.dumps(record))
    return str(folder)


def test_the_interval_is_students_t_over_the_runs():
    values = [0.1, 0.3, 0.2, 0.4]
    got = cs.interval(values)
    half = 3.182 * statistics.stdev(values) / math.sqrt(4)
    assert got["n"] == 4 and got["mean"] == pytest.approx(0.25)
    assert (got["lo"], got["hi"]) == (pytest.approx(0.25 - half), pytest.approx(0.25 + half))
    assert cs.interval([0.3])["lo"] is None  # one run: no interval
    assert cs.t975(1) == 12.706 and cs.t975(100) == 1.960
    with pytest.raises(ValueError, match="at least 1"):
        cs.t975(0)


@pytest.mark.parametrize("lo,hi,want", [(-0.2, 0.2, "within"), (-0.3, 0.1, "undecided"), (0.3, 0.9, "outside"),
                                        (-0.9, -0.26, "outside"), (None, None, "undecided")])
def test_the_verdict_needs_the_whole_interval(lo, hi, want):
    assert cs.verdict({"lo": lo, "hi": hi}, 0.25) == want


def test_runs_are_paired_within_and_aggregated_across(tmp_path):
    a = run(tmp_path, "s0", 0, {"delta": 0.10, "int8": -0.4}, heldout={"delta": 0.05})
    b = run(tmp_path, "s1", 1, {"delta": 0.12}, heldout={"delta": 0.07})
    c = run(tmp_path, "s2", 2, {"delta": 0.08}, heldout={"delta": 0.06})
    d = run(tmp_path, "s0again", 0, {"delta": 0.11}, reference_loss=1.002)
    res = cs.aggregate([cs.load_run(p) for p in (a, b, c, d)], 0.25)
    delta = res["arms"]["delta"]
    assert delta["diff_pct"]["n"] == 4 and delta["diff_pct"]["mean"] == pytest.approx(0.1025)
    assert delta["verdict"] == "within"
    assert delta["heldout_diff_pct"]["n"] == 3 and delta["heldout_diff_pct"]["mean"] == pytest.approx(0.06)
    assert res["arms"]["int8"]["diff_pct"]["n"] == 1 and res["arms"]["int8"]["verdict"] == "undecided"
    assert "bf16" not in res["arms"]
    # two runs of seed 0: the reference's own spread
    assert res["reference_spread_pct"] == {"0": pytest.approx(0.2)}
    text = cs.markdown(res)
    assert "| DELTA | 4 | +0.10%, +0.12%, +0.08%, +0.11% | +0.10% |" in text and "within" in text
    assert delta["runs_needed"] == {"at_zero": 2, "at_mean": 3} and "| within | 2 / 3 |" in text


def test_runs_needed_is_the_first_count_whose_interval_fits_the_band():
    # SD 0.46 %, target 0.25 %: 16 runs if the true difference is zero (2.131 x 0.46 / 4 = 0.245;
    # 15 give 2.145 x 0.46 / sqrt(15) = 0.255), none at a mean of 0.27 %, more as the mean nears the edge
    assert cs.runs_needed(0.46, 0.25) == 16
    assert cs.runs_needed(0.46, 0.25, 0.27) is None and cs.runs_needed(0.46, 0.25, -0.25) is None
    assert cs.runs_needed(0.46, 0.25, 0.1) > 16
    assert cs.runs_needed(None, 0.25) is None


def test_runs_of_different_studies_or_references_are_refused(tmp_path):
    a = run(tmp_path, "a", 0, {"delta": 0.1})
    b = run(tmp_path, "b", 1, {"delta": 0.1}, steps=40)
    with pytest.raises(ValueError, match="different studies"):
        cs.aggregate([cs.load_run(a), cs.load_run(b)], 0.25)
    with pytest.raises(ValueError, match="no convergence.json"):
        cs.load_run(str(tmp_path / "missing"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "convergence.json").write_text(json.dumps({"arms": {}}))
    with pytest.raises(ValueError, match="not a bench/convergence.py study"):
        cs.load_run(str(bad))
    assert cs.main([str(bad)]) == 2


def test_the_committed_runs_of_seed_0_show_the_reference_spread(tmp_path):
    """bf16, seed 0, in the delta study and in the INT4-gradient study run right after: 0.20%
    apart (what BENCHMARKS.md quotes as the run-to-run spread)."""
    runs = [os.path.join(RESULTS, "dp2_delta_gathers", "seed0"), os.path.join(RESULTS, "dp2_int4_gradients")]
    assert cs.main([*runs, "--target", "0.5", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "seeds.json").read_text())
    assert res["reference_spread_pct"]["0"] == pytest.approx(0.20, abs=0.005)
    assert (tmp_path / "seeds.md").read_text().startswith("# Final loss against bf16 over 2 runs")
