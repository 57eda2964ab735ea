"""Statistics and gates of qzero qualify on synthetic inputs with known answers."""

import pytest

from qzero.app.qualify import Thresholds, analyse, verdict
from qzero.app.qualify import stats
from qzero.app.train import TrainSettings


def test_speedup_is_ratio_of_medians():
    assert stats.speedup([1.0, 2.0, 3.0], [1.0, 1.0, 1.5]) == pytest.approx(2.0)


def test_bootstrap_interval_brackets_a_clear_effect_and_is_reproducible():
    base = [1.00 + 0.01 * (i % 5) for i in range(40)]
    cand = [0.80 + 0.01 * (i % 5) for i in range(40)]
    lo, hi = stats.bootstrap_ci(base, cand)
    assert lo <= stats.speedup(base, cand) <= hi
    assert 1.2 < lo and hi < 1.3
    assert stats.bootstrap_ci(base, cand) == (lo, hi)


def test_bootstrap_interval_covers_one_without_effect():
    import random

    rng = random.Random(3)
    a = [rng.gauss(1.0, 0.05) for _ in range(60)]
    b = [rng.gauss(1.0, 0.05) for _ in range(60)]
    lo, hi = stats.bootstrap_ci(a, b)
    assert lo < 1.0 < hi


def test_param_agreement_counts_violations():
    got = stats.param_agreement([1.0, 2.0, 0.0, 10.0], [1.0, 2.1, 0.03, 10.1])
    # |d| <= 0.02 + 0.02 |b|: 0 ok; 0.1 > 0.062 bad; 0.03 > 0.0206 bad; 0.1 <= 0.222 ok
    assert got["tolerance_violations"] == 2
    assert got["param_max_abs_diff"] == pytest.approx(0.1)


def arm(role, i, losses, times, sample, alloc=100, replicas=True, hash_=None):
    return {
        "arm": f"{role[0].upper()}{i}", "role": role, "losses": losses, "grad_norms": [1.0] * len(losses),
        "step_times": times, "sample": sample, "sample_hash": hash_ or str(sample), "replicas_identical": replicas,
        "peak_allocated_bytes": alloc, "peak_reserved_bytes": alloc, "device_memory_bytes": 10_000,
        "memory_kind": "cuda allocator", "bytes_sent_per_step": 100 if role == "baseline" else 53,
        "plain_bytes_per_step": 100,
        "params": 10, "world_size": 2, "skipped_steps": 0,
    }


def synthetic(device="cuda", **changes):
    b = dict(losses=[3.0, 2.0], times=[1.0, 1.1, 0.9], sample=[1.0, 2.0])
    c = dict(losses=[3.0, 2.001], times=[0.5, 0.55, 0.45], sample=[1.0, 2.001])
    c.update(changes)
    arms = [
        arm("baseline", 1, b["losses"], b["times"], b["sample"]),
        arm("candidate", 2, c["losses"], c["times"], c["sample"], c.get("alloc", 100), c.get("replicas", True)),
        arm("candidate", 3, c.get("losses2", c["losses"]), c.get("times2", c["times"]), c["sample"],
            c.get("alloc", 100)),
        arm("baseline", 4, b["losses"], c.get("base_times2", b["times"]), b["sample"]),
    ]
    settings = TrainSettings(device=device)
    candidate = TrainSettings(device=device, zero={"zero_quantized_weights": True})
    return analyse(arms, settings, settings, candidate, "BCCB", Thresholds())


def test_all_gates_pass_on_a_good_candidate():
    r = synthetic()
    assert r["passed"] and all(r["gates"].values())
    assert r["speedup"] == pytest.approx(2.0)
    # by ZeroConfig's names, with what follows from them (gather-ahead is on when quantized)
    assert r["differing_settings"] == {"overlap_param_gather": [False, True], "zero_quantized_weights": [False, True]}
    assert verdict(r).startswith("FASTER")
    assert "bytes on the wire per rank per step 0.53x the baseline's (-47%)" in verdict(r)


def test_arms_of_one_setting_further_apart_than_the_settings_are_too_noisy():
    # the two baseline arms: medians 1.0 and 1.6 s (60% apart); the settings: 1.3 vs 0.5 s (160%)
    r = synthetic(base_times2=[1.6, 1.7, 1.5])
    assert r["noise"]["within_setting"] == pytest.approx(0.6)
    assert r["noise"]["too_noisy"] is False
    # the same baseline arms against a candidate at 0.9 s: the settings differ by 44%, less than 60%
    r = synthetic(times=[0.9, 0.95, 0.85], base_times2=[1.6, 1.7, 1.5])
    assert r["noise"]["too_noisy"] is True
    assert verdict(r).startswith("TOO NOISY TO DECIDE")


def test_on_a_cpu_the_verdict_says_there_is_nothing_to_save():
    from qzero.app.qualify.report import markdown

    r = synthetic(device="cpu")
    assert verdict(r).startswith("NOTHING TO SAVE ON CPU LOOPBACK") and "(-47%)" in verdict(r)
    assert "nothing to save" in markdown(r) and "--device cuda" in markdown(r)


def test_the_report_is_written_without_matplotlib(tmp_path, monkeypatch):
    import sys

    from qzero.app.qualify import write

    r = synthetic()
    r["environment"] = {"device": "x", "link_regime": "y", "process_group_backend": "z"}
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert write(r, str(tmp_path)) is False
    md = (tmp_path / "report.md").read_text()
    assert "matplotlib is not installed" in md and ".png" not in md
    assert (tmp_path / "report.json").exists() and not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize(
    "change, gate",
    [
        (dict(losses=[3.0, 2.5]), "max_loss_diff"),
        (dict(sample=[1.0, 2.5]), "param_tolerance"),
        (dict(replicas=False), "replicas_identical"),
        (dict(losses2=[3.0, 2.0011]), "candidate_reproducible"),
        (dict(alloc=102), "memory_vs_baseline"),
        (dict(alloc=9_600), "peak_allocated_fraction"),
    ],
)
def test_each_gate_fails_when_it_must(change, gate):
    r = synthetic(**change)
    assert r["gates"][gate] is False
    assert not r["passed"]
    assert "GATES FAILED" in verdict(r) and gate in verdict(r)


def test_on_a_cpu_the_headline_also_says_too_noisy_when_the_report_does():
    from qzero.app.qualify.report import markdown

    r = synthetic(device="cpu", times=[0.9, 0.95, 0.85], base_times2=[1.6, 1.7, 1.5])
    assert r["noise"]["too_noisy"]
    head = verdict(r)
    assert head.startswith("NOTHING TO SAVE ON CPU LOOPBACK") and "TOO NOISY TO DECIDE" in head
    assert "too noisy to decide" in markdown(r)
    assert "TOO NOISY" not in verdict(synthetic(device="cpu"))  # arms of one setting agree there


def test_the_interval_spans_the_spread_between_arms_not_only_between_steps():
    """Two baseline runs 60% apart, each with little step noise: resampling steps pooled gives
    an interval narrower than what the runs themselves show; resampling arms then steps spans
    the ratios of single runs."""
    import random

    rng = random.Random(7)
    base = [[m + rng.gauss(0, 0.01) for _ in range(30)] for m in (1.0, 1.6)]
    cand = [[m + rng.gauss(0, 0.01) for _ in range(30)] for m in (0.9, 0.92)]
    run_ratios = [stats.speedup(b, c) for b in base for c in cand]  # what one run of each setting would report
    lo, hi = stats.bootstrap_ci([t for a in base for t in a], [t for a in cand for t in a])
    assert not lo <= min(run_ratios) or not max(run_ratios) <= hi  # steps alone miss what the runs show
    lo, hi = stats.bootstrap_ci_arms(base, cand)
    assert lo <= min(run_ratios) * 1.01 and max(run_ratios) * 0.99 <= hi
    assert stats.bootstrap_ci_arms(base, cand) == (lo, hi)  # seeded
    lo, hi = stats.bootstrap_ci_arms([base[0]], [cand[0]])  # one arm a setting: steps only, narrow
    assert lo <= run_ratios[0] <= hi and hi - lo < 0.05


def test_the_report_says_what_the_interval_covers():
    r = synthetic()
    assert r["speedup_ci95_covers"].startswith("run-to-run spread as far as 2 baseline and 2 candidate arms")
    assert "over arms and steps" in verdict(r)
    b = arm("baseline", 1, [3.0, 2.0], [1.0, 1.1, 0.9], [1.0, 2.0])
    c = arm("candidate", 2, [3.0, 2.0], [0.5, 0.55, 0.45], [1.0, 2.0])
    one = analyse([b, c], TrainSettings(), TrainSettings(), TrainSettings(zero={"zero_quantized_weights": True}),
                  "BC", Thresholds())
    assert "understates" in one["speedup_ci95_covers"] and "over steps)" in verdict(one)


def test_thresholds_refuse_negative_and_non_finite_limits():
    for bad in (dict(atol=-1.0), dict(max_loss_diff=float("nan")), dict(rtol=float("inf"))):
        with pytest.raises(ValueError, match=f"threshold {next(iter(bad))} must be a finite number >= 0"):
            Thresholds(**bad)


def test_the_plots_show_bytes_by_arm_the_gate_and_every_arm_and_no_speedup_title():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from qzero.app.qualify.report import bytes_figure, loss_figure, step_figure

    r = synthetic()
    for a in r["arms"]:
        a["grad_bytes_sent_per_step"], a["grad_plain_bytes_per_step"] = 40, 40
    figs = [bytes_figure(r, plt), loss_figure(r, plt), step_figure(r, plt)]
    try:
        assert not any("speedup" in ax.get_title().lower() for f in figs for ax in f.axes)
        bars = figs[0].axes[0]
        heights = sorted(round(p.get_height()) for p in bars.patches)  # bytes, shown in B: 100 and 53
        assert heights == sorted([100, 53, 53, 100] + [100] * 4 + [40] * 4)
        assert bars.get_ylabel() == "B per rank per step"
        ax, dx = figs[1].axes
        gate = r["thresholds"]["max_loss_diff"]
        flat = [ln for ln in dx.get_lines() if len(set(ln.get_ydata())) == 1]
        assert {gate, -gate} <= {ln.get_ydata()[0] for ln in flat}  # the gate's limits drawn
        curves = ax.get_lines()
        assert len(curves) == 4 and len({ln.get_marker() for ln in curves}) == 4  # coinciding arms stay visible
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert labels[3] == "B4 (baseline) = B1" and labels[2] == "C3 (candidate) = C2"
    finally:
        for f in figs:
            plt.close(f)


def test_a_cpu_verdict_projects_its_bytes_to_a_cluster_labelled_as_a_projection():
    """[Note: the cluster projection]: FSDP2 bf16 at 8 x 8 is 2 x 63/64 x 16 = 31.5 bits a parameter
    a node a step; a plain qzero arm sends the same; the candidate's measured payload ratio
    (0.53 of plain here) scales its weight half, and quantized gradients go all-to-all."""
    from qzero.app.qualify.projection import bits_per_param_per_node, fsdp2_bits_per_param_per_node

    assert fsdp2_bits_per_param_per_node() == pytest.approx(31.5)
    assert bits_per_param_per_node(16, None) == pytest.approx(31.5)
    assert bits_per_param_per_node(8.5, 8.5) == pytest.approx(63 / 64 * 8.5 + 8 * 7 / 8 * 8.5)
    r = synthetic(device="cpu")
    arm = next(a for a in r["arms"] if a["role"] == "candidate")
    weight_bits = 16 * arm["bytes_sent_per_step"] / arm["plain_bytes_per_step"]
    line = verdict(r)
    assert "\n" not in line
    assert (f"PROJECTION, not measured: on a 100 GbE cluster of 8 nodes x 8 GPUs the candidate would send "
            f"{bits_per_param_per_node(weight_bits, None):.1f} bits per parameter per node per step against "
            "FSDP2's 31.5") in line
    assert "PROJECTION" not in verdict(synthetic(device="cuda"))
