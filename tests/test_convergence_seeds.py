"""benchmarks/scripts/convergence_seeds.py: an arm's final loss against bf16 over several runs."""

import json
import math
import os
import statistics

from _support import bench_scripts
import pytest

cs = bench_scripts.load("convergence_seeds")
LOGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "convergence_logs")


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


def test_the_f_test_agrees_with_students_t_and_with_itself():
    """P(F(1, n) > t²) is the two-sided tail of t (the module's own t table is independent of the
    continued fraction); F(d1, d2) > x is F(d2, d1) < 1/x; equal degrees of freedom: P(F > 1) = 1/2."""
    for dof in (1, 2, 5, 10, 30):
        assert cs.f_sf(cs.t975(dof) ** 2, 1, dof) == pytest.approx(0.05, abs=2e-4)
    for d1, d2, x in ((18, 3, 24.3), (3, 18, 0.7), (7, 11, 2.0), (2, 2, 5.0)):
        assert cs.f_sf(x, d1, d2) == pytest.approx(1.0 - cs.f_sf(1.0 / x, d2, d1), abs=1e-12)
    assert cs.f_sf(1.0, 6, 6) == pytest.approx(0.5, abs=1e-12)
    # F(2, 2): P(F > x) = 1 / (1 + x), in closed form
    assert cs.f_sf(3.0, 2, 2) == pytest.approx(0.25, abs=1e-12)
    assert cs.f_sf(0.0, 3, 4) == 1.0 and cs.f_sf(1e12, 3, 4) < 1e-6
    with pytest.raises(ValueError, match="at least 1"):
        cs.f_sf(1.0, 0, 3)


def test_an_arm_is_set_against_the_floor_and_the_reference_across_seeds(tmp_path):
    """--floor: each arm's SD of Δ over the floor's, with the F-test; the reference's final loss
    from seed to seed counts each seed once."""
    floor = [0.1, -0.1, 0.05, -0.05]
    wide = [1.0, -1.0, 0.5, -0.5]
    paths = [run(tmp_path, f"s{i}", i, {"rep": f, "delta": w}, reference_loss=1.0 + 0.01 * i)
             for i, (f, w) in enumerate(zip(floor, wide))]
    paths.append(run(tmp_path, "s0again", 0, {"delta": 0.2}, reference_loss=5.0))  # seed 0 again: not counted twice
    res = cs.aggregate([cs.load_run(p) for p in paths], 0.25, floor="rep")
    fl = res["spread_against_floor"]
    assert fl["floor"] == "rep" and fl["floor_runs"] == 4
    d = fl["arms"]["delta"]
    want_sd = statistics.stdev(wide + [0.2])
    assert d["runs"] == 5 and d["ratio"] == pytest.approx(want_sd / statistics.stdev(floor))
    assert d["p_more"] == pytest.approx(cs.f_sf(d["ratio"] ** 2, 4, 3)) and d["p_more"] < 0.05
    across = res["reference_across_seeds"]
    losses = [1.0, 1.01, 1.02, 1.03]
    assert across["seeds"] == 4 and across["sd_pct"] == pytest.approx(
        100 * statistics.stdev(losses) / statistics.fmean(losses))
    text = cs.markdown(res)
    assert "Spread against the floor, REP (4 runs" in text and "| DELTA | 5 |" in text
    assert "from seed to seed (4 seeds" in text
    with pytest.raises(ValueError, match="'nope' is not an arm"):
        cs.aggregate([cs.load_run(p) for p in paths], 0.25, floor="nope")
    one = run(tmp_path, "solo", 9, {"rep": 0.1, "delta": 0.3})
    with pytest.raises(ValueError, match="at least two runs"):
        cs.aggregate([cs.load_run(one)], 0.25, floor="rep")
    assert cs.main([*paths, "--floor", "nope"]) == 2


def test_runs_of_different_studies_or_references_are_refused(tmp_path):
    a = run(tmp_path, "a", 0, {"delta": 0.1})
    b = run(tmp_path, "b", 1, {"delta": 0.1}, steps=40)
    with pytest.raises(ValueError, match="different studies"):
        cs.aggregate([cs.load_run(a), cs.load_run(b)], 0.25)
    warm = run(tmp_path, "warm", 1, {"delta": 0.1}, lr_warmup=100)  # a run recorded without the key had none
    with pytest.raises(ValueError, match="lr_warmup"):
        cs.aggregate([cs.load_run(a), cs.load_run(warm)], 0.25)
    assert cs.aggregate([cs.load_run(a), cs.load_run(run(tmp_path, "zero", 1, {"delta": 0.2}, lr_warmup=0))],
                        0.25)["arms"]["delta"]["diff_pct"]["n"] == 2
    with pytest.raises(ValueError, match="no convergence.json"):
        cs.load_run(str(tmp_path / "missing"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "convergence.json").write_text(json.dumps({"arms": {}}))
    with pytest.raises(ValueError, match="not a benchmarks/scripts/convergence.py study"):
        cs.load_run(str(bad))
    assert cs.main([str(bad)]) == 2


LOG = """\
convergence: preset tiny (1,000 parameters), 2 arms at world size 2, 20 steps of 4 x 64 tokens (2 sequences per rank), bf16{extra}, device cuda
  started bf16         on cuda:0 (pids 1 2)
  started delta on cuda:0 (pids 3 4)
  [   10 s] bf16 20/20 loss 1.0 done | delta 20/20 loss 1.0 done
wrote /x/convergence.json, convergence.md, convergence.png (wall 12 s)
| arm | final loss (mean of steps 11–20) | Δ vs bf16 | Δ % | paired SE of Δ | held-out loss (final, after step 20) | Δ held-out vs bf16 % | gather bytes vs plain |
|---|---|---|---|---|---|---|---|
| bf16 (plain gather) | 1.0000 | — | — | — | 2.0000 | — | 1.000 |
| DELTA | 1.0011 | +0.0011 | {delta} | 0.0010 | 2.0000 | -0.37% | 0.258 |
"""  # noqa: E501 (a log as the study prints it: its header and table lines are that long)


def test_a_run_is_read_from_the_log_it_printed(tmp_path):
    """A run whose convergence.json did not come back counts through the table its log printed;
    the seed is the header's, or the file name's; it aggregates with JSON runs of the same study."""
    old = tmp_path / "seed9.log"
    old.write_text(LOG.format(extra="", delta="+0.11%"))
    new = tmp_path / "run.log"
    new.write_text(LOG.format(extra=", lr 0.0003, seed 4", delta="-0.07%"))
    a = cs.load_run(str(old))
    assert a["seed"] == 9 and a["lr"] is None and a["last"] == 10 and a["steps"] == 20
    assert a["summary"] == {"reference": "bf16", "arms": {"bf16": {"final_loss": 1.0, "diff_pct": 0.0},
                                                          "delta": {"final_loss": 1.0011, "diff_pct": 0.11}}}
    assert a["heldout_summary"]["arms"]["delta"]["diff_pct"] == -0.37 and a["arms"]["delta"]["label"] == "DELTA"
    b = cs.load_run(str(new))
    assert b["seed"] == 4 and b["lr"] == 3e-4
    c = run(tmp_path, "s1", 1, {"delta": 0.2}, heldout={"delta": 0.1})
    res = cs.aggregate([a, b, cs.load_run(c)], 0.25)
    assert res["arms"]["delta"]["diff_pct"]["mean"] == pytest.approx((0.11 - 0.07 + 0.2) / 3)
    assert res["from_logs"] == [str(old), str(new)]
    assert "`seed9.log`, `run.log`" in cs.markdown(res)
    cs.plot(res, str(tmp_path / "seeds.png"))
    assert (tmp_path / "seeds.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a log of another study is refused like a JSON one
    other = tmp_path / "seed5.log"
    other.write_text(LOG.format(extra="", delta="+0.1%").replace("20 steps", "40 steps"))
    with pytest.raises(ValueError, match="steps"):
        cs.aggregate([a, cs.load_run(str(other))], 0.25)
    # a log of a run with a warmup names it in its header (convergence.py prints "lr X (warmup N steps)")
    warm = tmp_path / "seed6.log"
    warm.write_text(LOG.format(extra=", lr 0.0003 (warmup 100 steps), seed 6", delta="+0.1%"))
    assert cs.load_run(str(warm))["lr_warmup"] == 100 and b["lr_warmup"] == 0
    with pytest.raises(ValueError, match="lr_warmup"):
        cs.aggregate([b, cs.load_run(str(warm))], 0.25)


@pytest.mark.parametrize("text,match", [
    ("hello\n", "not a benchmarks/scripts/convergence.py log"),
    (LOG.format(extra="", delta="+0.1%"), "names no seed"),
    (LOG.format(extra=", seed 1", delta="+0.1%").split("wrote")[0], "did not finish"),
])
def test_a_log_that_cannot_be_counted_is_refused(tmp_path, text, match):
    path = tmp_path / "run.log"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        cs.load_run(str(path))
    assert cs.main([str(path)]) == 2


def test_the_logs_of_two_gpu_runs_count():
    """Two logs that GPU runs of the delta study printed (their convergence.json did not come back)."""
    got = [cs.load_run(os.path.join(LOGS, f"seed{s}.log"))["summary"]["arms"]["int4-delta-g256"]["diff_pct"]
           for s in (9, 11)]
    assert got == [-0.41, -0.97]


def test_the_difference_over_the_run_is_per_window_and_paired(tmp_path):
    """--window: per run, Δ % of each window's mean loss from the reference's over the same steps;
    the mean and interval over the runs that kept every step; a run that stopped early, or one
    read from its log, is left out."""
    def with_losses(name, seed, ref, arm, steps=6):
        folder = run(tmp_path, name, seed, {"delta": 100 * (sum(arm[-2:]) / sum(ref[-2:]) - 1)}, steps=steps)
        path = os.path.join(folder, "convergence.json")
        record = json.load(open(path))
        record["arms"]["bf16"]["losses"], record["arms"]["delta"]["losses"] = ref, arm
        json.dump(record, open(path, "w"))
        return folder

    ref = [4.0, 4.0, 2.0, 2.0, 1.0, 1.0]
    a = with_losses("a", 0, ref, [4.4, 4.4, 2.0, 2.0, 1.01, 1.01])   # +10%, 0%, +1%
    b = with_losses("b", 1, ref, [4.0, 4.8, 2.1, 2.1, 0.99, 0.99])   # +10%, +5%, -1%
    short = with_losses("short", 2, ref, [4.0, 4.0, 2.0, 2.0, 1.0])  # 5 of 6 steps: left out
    log = tmp_path / "seed3.log"
    log.write_text(LOG.format(extra="", delta="+0.1%").replace("20 steps", "6 steps").replace("11–20", "5–6"))
    runs = [cs.load_run(p) for p in (a, b, short)] + [cs.load_run(str(log))]
    for r in runs:
        r["last"] = 10  # the log's window, the same study
    res = cs.aggregate(runs, 0.25, window=2)
    over = res["over_steps"]["delta"]
    assert over["runs"] == 2 and over["files"] == [runs[0]["_file"], runs[1]["_file"]]
    assert [(w["first"], w["last"]) for w in over["windows"]] == [(1, 2), (3, 4), (5, 6)]
    assert [w["mean"] for w in over["windows"]] == pytest.approx([10.0, 2.5, 0.0], abs=1e-9)
    half = 12.706 * statistics.stdev([0.0, 5.0]) / math.sqrt(2)
    assert (over["windows"][1]["lo"], over["windows"][1]["hi"]) == (pytest.approx(2.5 - half),
                                                                    pytest.approx(2.5 + half))
    text = cs.markdown(res)
    assert "| steps | DELTA (2 runs) |" in text and "| 1–2 | +10.00% [" in text
    with pytest.raises(ValueError, match="--window must be at least 1 step, got 0"):
        cs.aggregate(runs, 0.25, window=0)
    # the plot needs three runs of an arm
    c = with_losses("c", 4, ref, [4.0, 4.0, 2.0, 2.0, 1.0, 1.0])
    res = cs.aggregate([cs.load_run(p) for p in (a, b, c)], 0.25, window=2)
    cs.plot_over_steps(res, str(tmp_path / "over.png"))
    assert (tmp_path / "over.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_p_value_of_a_zero_mean_is_students_t_two_sided():
    # at the tabled 97.5% quantile the two-sided p is 5%, for every degree of freedom
    for dof in range(1, 31):
        assert cs.t_p_two_sided(cs.t975(dof), dof) == pytest.approx(0.05, abs=2e-4)
    assert cs.t_p_two_sided(0.0, 7) == pytest.approx(1.0)
    assert cs.t_p_two_sided(-3.0, 10) == cs.t_p_two_sided(3.0, 10) == pytest.approx(0.013343, abs=1e-5)
    values = [0.2, 0.1, 0.4, 0.3, 0.25]
    got = cs.interval(values)
    t = statistics.fmean(values) / (statistics.stdev(values) / math.sqrt(5))
    assert got["p_zero"] == pytest.approx(cs.t_p_two_sided(t, 4)) and got["p_zero"] < 0.01
    assert cs.interval([0.3])["p_zero"] is None
    assert cs.interval([0.0, 0.0])["p_zero"] == 1.0 and cs.interval([0.1, 0.1])["p_zero"] == 0.0
    with pytest.raises(ValueError, match="at least 1"):
        cs.t_p_two_sided(1.0, 0)


def test_the_heldout_loss_is_paired_per_evaluation_and_averaged_over_the_last(tmp_path):
    """Held-out Δ % at each evaluation the runs share, and each run's mean over its last K."""
    def with_heldout(name, seed, ref, arm):
        folder = run(tmp_path, name, seed, {"delta": 0.1})
        path = os.path.join(folder, "convergence.json")
        record = json.load(open(path))
        record["arms"]["bf16"]["heldout_losses"], record["arms"]["delta"]["heldout_losses"] = ref, arm
        json.dump(record, open(path, "w"))
        return folder

    ref = [[10, 2.0], [20, 1.0], [30, 1.0]]
    a = with_heldout("a", 0, ref, [[10, 2.2], [20, 1.02], [30, 0.98]])      # +10%, +2%, -2%
    b = with_heldout("b", 1, ref, [[10, 2.0], [20, 1.04], [30, 1.0]])       # 0%, +4%, 0%
    c = with_heldout("c", 2, ref + [[40, 1.0]], [[10, 2.0], [20, 1.0], [30, 1.0], [40, 1.5]])  # 40: not shared
    runs = [cs.load_run(p) for p in (a, b, c)]
    held = cs.aggregate(runs, 0.25, heldout_last=2)["heldout_over_steps"]["delta"]
    assert held["runs"] == 3 and held["steps"] == [10, 20, 30]
    assert [e["mean"] for e in held["evaluations"]] == pytest.approx([10 / 3, 2.0, -2 / 3])
    # per run, the mean of the last two shared evaluations: 0%, +2%, 0%
    last = held["last"]
    assert (last["evaluations"], last["first_step"], last["last_step"]) == (2, 20, 30)
    assert last["mean"] == pytest.approx(2 / 3) and last["sd"] == pytest.approx(statistics.stdev([0.0, 2.0, 0.0]))
    text = cs.markdown(cs.aggregate(runs, 0.25, heldout_last=2))
    assert "| after step | DELTA (3 runs) |" in text and "| 20 | +2.00% [" in text
    assert "| mean of the last 2 (20–30) | +0.67% [" in text
    # more than the runs share: all of them
    assert cs.aggregate(runs, 0.25, heldout_last=9)["heldout_over_steps"]["delta"]["last"]["evaluations"] == 3
    with pytest.raises(ValueError, match="--heldout-last must be at least 1 evaluation, got 0"):
        cs.aggregate(runs, 0.25, heldout_last=0)
    # one run with held-out losses is no curve
    assert cs.aggregate(runs[:1], 0.25)["heldout_over_steps"] == {}
