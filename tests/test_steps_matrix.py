"""``qzero bench steps`` (qzero.app.benchmarks.steps): the analysis on synthetic runs with known answers, its command
line (refusals before anything runs, failed arms, order balancing) and one real run on the CPU."""

import json
import os
import statistics
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

import qzero  # noqa: E402

from qzero.app.benchmarks import steps as sm  # noqa: E402


def run(times, losses=(5.0, 4.0, 3.0), sample=(1.0, 2.0, 3.0), *, replicas=True, round=0, **extra):
    """A synthetic run summary as run_arm returns it."""
    losses = list(losses)
    summary = {
        "step_times": list(times),
        "losses": losses,
        "grad_norms": [1.0] * len(losses),
        "sample": list(sample) if sample is not None else None,
        "sample_hash": repr(sample),
        "replicas_identical": replicas,
        "peak_allocated_bytes": 3 * 2**30,
        "peak_reserved_bytes": 4 * 2**30,
        "bytes_sent_per_step": 2_000_000_000,
        "plain_bytes_per_step": 2_000_000_000,
        "params": 1000,
        "world_size": 2,
        "device_memory_bytes": 80 * 2**30,
        "round": round,
    }
    if sample is None:
        del summary["sample"]
    summary.update(extra)
    return summary


def failed(msg="Traceback (most recent call last):\n  ...\nModuleNotFoundError: No module named 'deepspeed'\n"):
    return {"failed": True, "round": 0, "error": f"arm exited with code 1; last output:\n{msg}"}


REF = [0.9, 1.0, 1.1]  # median 1.0
FAST = [0.45, 0.5, 0.55]  # median 0.5: twice as fast as REF
SLOW = [1.8, 2.0, 2.2]  # median 2.0: half as fast
PEER = [1.35, 1.5, 1.65]  # median 1.5


def row(result, name):
    return next(r for r in result["arms"] if r["arm"] == name)


# ---------------------------------------------------------------------- order balancing


def test_schedule_reverses_odd_rounds_so_every_arm_has_the_same_mean_position():
    order = sm.schedule(["A", "B", "C", "D"], 3)
    assert "".join(n for _, n in order) == "ABCDDCBAABCD"
    assert [r for r, _ in order] == [0] * 4 + [1] * 4 + [2] * 4
    two = sm.schedule(["A", "B", "C"], 2)
    mean_pos = {n: statistics.mean(i % 3 for i, (_, m) in enumerate(two) if m == n) for n in "ABC"}
    assert len(set(mean_pos.values())) == 1
    assert sm.schedule(["A"], 1) == [(0, "A")]
    with pytest.raises(sm.SpecError):
        sm.schedule(["A", "B"], 0)


# ---------------------------------------------------------------------- analysis


def test_ratios_against_reference_and_peers_from_known_medians():
    runs = {
        "plain": [run(REF), run(REF, round=1)],
        "fast": [run(FAST), run(FAST, round=1)],
        "slow": [run(SLOW), run(SLOW, round=1)],
        "peer": [run(PEER), run(PEER, round=1)],
    }
    a = sm.analyse(runs, "plain", ["peer"], resamples=500)
    assert a["reference"] == "plain" and a["peers"] == ["peer"]
    fast, slow, plain, peer = (row(a, n) for n in ("fast", "slow", "plain", "peer"))
    assert fast["median_step_s"] == pytest.approx(0.5)
    assert fast["measured_steps"] == 6
    # ratio = median(reference) / median(arm): > 1 means the arm is faster
    assert fast["vs_reference"]["ratio"] == pytest.approx(2.0)
    assert slow["vs_reference"]["ratio"] == pytest.approx(0.5)
    assert plain["vs_reference"]["ratio"] == pytest.approx(1.0)
    assert fast["vs_peers"]["peer"]["ratio"] == pytest.approx(3.0)
    assert plain["vs_peers"]["peer"]["ratio"] == pytest.approx(1.5)
    assert peer["vs_peers"]["peer"] is None  # a peer against itself
    # intervals: ordered, bracket the estimate, and exclude 1 where the times do not overlap
    for r in (fast, slow, plain, peer):
        lo, hi = r["vs_reference"]["ci95"]
        assert lo <= r["vs_reference"]["ratio"] <= hi
    assert 1.0 < fast["vs_reference"]["ci95"][0] and fast["vs_reference"]["ci95"][1] <= 1.1 / 0.45
    assert slow["vs_reference"]["ci95"][1] < 1.0
    assert fast["vs_peers"]["peer"]["ci95"][0] > 2.0
    assert all(r["status"] == "ok" and r["reproducible"] is True and r["replicas_identical"] is True for r in a["arms"])


def test_accuracy_reproduction_and_replicas_against_the_reference():
    runs = {
        "ref": [run(REF), run(REF)],
        "close": [run(FAST, losses=[5.0, 4.1, 3.05], sample=[1.0, 2.1, 3.0])],
        "drifts": [run(FAST, losses=[5.0, 4.0, 3.0]), run(FAST, losses=[5.0, 4.0, 3.5])],
        "broken": [run(FAST, replicas=False), run(FAST, replicas=True)],
        "sharded": [run(FAST, replicas=None, sample=None), run(FAST, replicas=None, sample=None)],
        "short": [run(FAST, sample=[1.0, 2.0])],
    }
    a = sm.analyse(runs, "ref")
    assert row(a, "ref")["max_loss_diff"] == 0.0
    assert row(a, "ref")["param_agreement"]["tolerance_violations"] == 0
    close = row(a, "close")
    assert close["max_loss_diff"] == pytest.approx(0.1)
    # |2.1 - 2.0| = 0.1 > 0.02 + 0.02 * 2.0
    assert close["param_agreement"]["tolerance_violations"] == 1
    assert close["param_agreement"]["param_max_abs_diff"] == pytest.approx(0.1)
    assert close["reproducible"] is None  # one run: nothing to compare
    assert row(a, "drifts")["reproducible"] is False
    assert row(a, "drifts")["max_loss_diff"] == 0.0  # first run against the reference's first
    assert row(a, "broken")["replicas_identical"] is False
    sharded = row(a, "sharded")
    assert sharded["replicas_identical"] is None and sharded["param_agreement"] is None
    assert "no weight sample" in sharded["param_agreement_note"]
    assert row(a, "short")["param_agreement"] is None and "length" in row(a, "short")["param_agreement_note"]


def test_failed_and_partial_arms():
    runs = {
        "plain": [run(REF), run(REF)],
        "deepspeed": [failed(), failed()],
        "flaky": [run(FAST), failed("RuntimeError: CUDA out of memory")],
    }
    a = sm.analyse(runs, "plain", ["deepspeed"])
    ds = row(a, "deepspeed")
    assert ds["status"] == "failed" and ds["runs_failed"] == 2 and ds["runs_ok"] == 0
    assert ds["median_step_s"] is None and ds["vs_reference"] is None and ds["max_loss_diff"] is None
    assert ds["error_line"] == "ModuleNotFoundError: No module named 'deepspeed'"
    assert row(a, "plain")["vs_peers"]["deepspeed"] is None  # no times to compare against
    flaky = row(a, "flaky")
    assert flaky["status"] == "partial" and flaky["runs_ok"] == 1
    assert flaky["vs_reference"]["ratio"] == pytest.approx(2.0)
    m = _matrix(runs, a)
    md = sm.markdown(m)
    ds_line = next(ln for ln in md.splitlines() if ln.startswith("| deepspeed |"))
    assert "FAILED" in ds_line and "No module named 'deepspeed'" in ds_line
    header = next(ln for ln in md.splitlines() if ln.startswith("| arm |"))
    assert ds_line.count("|") == header.count("|")  # the table keeps its shape
    assert "(1/2 runs)" in next(ln for ln in md.splitlines() if ln.startswith("| flaky |"))


def test_an_arm_with_no_run_is_not_run_not_failed():
    """An arm none of whose runs finished or failed (a budget or a cut call stopped first) is
    reported as not run, never as a failure with no error."""
    runs = {"plain": [run(REF)], "cut": []}
    a = sm.analyse(runs, "plain", [])
    cut = row(a, "cut")
    assert cut["status"] == "missing" and cut["runs_ok"] == cut["runs_failed"] == 0 and cut["median_step_s"] is None
    line = next(ln for ln in sm.markdown(_matrix(runs, a)).splitlines() if ln.startswith("| cut |"))
    assert "NOT RUN" in line and "FAILED" not in line


def test_reference_that_failed_leaves_no_ratios_but_no_crash(tmp_path):
    runs = {"plain": [failed()], "int8": [run(FAST)]}
    a = sm.analyse(runs, "plain", ["plain"])
    int8 = row(a, "int8")
    assert int8["vs_reference"] is None and int8["vs_peers"]["plain"] is None and int8["max_loss_diff"] is None
    assert int8["median_step_s"] == pytest.approx(0.5)
    m = _matrix(runs, a)
    sm.write(m, str(tmp_path), with_plot=True)
    assert (tmp_path / "steps.png").stat().st_size > 0
    saved = json.loads((tmp_path / "matrix.json").read_text())
    assert "sample" not in saved["runs"]["int8"][0]


def test_analysis_refuses_unknown_reference_or_peer():
    with pytest.raises(sm.SpecError, match="nope"):
        sm.analyse({"a": [run(REF)]}, "nope")
    with pytest.raises(sm.SpecError, match="ghost"):
        sm.analyse({"a": [run(REF)]}, "a", ["ghost"])


def _matrix(runs, analysis):
    # settings as older matrix.json files hold them (ZeRO settings by short names, not nested): still rendered
    return {
        "regime_label": "synthetic", "rounds": 2, "complete": True, "runs_done": 4, "runs_total": 4,
        "settings": dict(preset="tiny", model_config=None, precision="bf16", world_size=2, seq_len=32,
                         micro_batch=2, stage=2, allgather_bucket=5e7, reduce_bucket=5e7, steps=3, warmup=1),
        "arms": [{"name": n, "diff": {}} for n in runs],
        "environment": {"device": "cpu", "link_regime": "test", "date": "today"},
        "runs": runs, "analysis": analysis,
    }


def test_compare_gives_the_ratio_of_two_saved_arms_and_refuses_unknown_ones(tmp_path, capsys):
    """``--compare`` reads a written matrix.json: two arms its table does not pair, with the
    analysis's own ratio and interval."""
    runs = {"plain": [run(REF), run(REF, round=1)], "fast": [run(FAST)], "slow": [run(SLOW)]}
    a = sm.analyse(runs, "plain", [])
    sm.write(_matrix(runs, a), str(tmp_path), with_plot=False)
    path = str(tmp_path / "matrix.json")
    assert sm.main(["--compare", path, "slow:fast"]) == 0
    got = sm.compare(json.loads((tmp_path / "matrix.json").read_text()), "slow", "fast")
    assert got["ratio"] == pytest.approx(4.0) and got["ci95"][0] > 1.0
    assert capsys.readouterr().out == f"slow / fast: 4.000 [{got['ci95'][0]:.3f}, {got['ci95'][1]:.3f}]\n"
    for bad in ("slow:gone", "slow"):
        with pytest.raises(SystemExit) as e:
            sm.main(["--compare", path, bad])
        assert e.value.code == 2
    assert "'gone' is not in the matrix (plain, fast, slow)" in capsys.readouterr().err


# ---------------------------------------------------------------------- arm specs


def test_parse_arm_values_like_json_and_typed_like_trainsettings():
    assert sm.parse_arm("plain:") == ("plain", {})
    assert sm.parse_arm("plain") == ("plain", {})
    # short names become ZeroConfig's
    assert sm.parse_arm("int8_ahead:quantized=true,overlap=true") == (
        "int8_ahead", {"zero_quantized_weights": True, "overlap_param_gather": True})
    assert sm.parse_arm("zero1:stage=1,quantized=true") == ("zero1", {"stage": 1, "zero_quantized_weights": True})
    assert sm.parse_arm("ds:backend=deepspeed")[1] == {"backend": "deepspeed"}
    name, o = sm.parse_arm("b:allgather_bucket=5e7,fmt=int4,check_finite=false,flat_order=contiguous,"
                           "gradient_clipping=1")
    assert o == {"allgather_bucket_size": 50_000_000, "zero_quantized_weights_format": "int4",
                 "check_finite": False, "flat_order": "contiguous", "gradient_clipping": 1.0}
    assert isinstance(o["allgather_bucket_size"], int) and isinstance(o["gradient_clipping"], float)
    assert sm.parse_arm("r:reduce_dtype=null,group-size=128")[1] == {
        "reduce_dtype": None, "zero_quantized_weights_group_size": 128}
    assert sm.parse_arm("lr:lr=1")[1] == {"lr": 1.0}
    assert sm.parse_arm("s:overlap=true,env.NCCL_ALGO=1")[1] == {"overlap_param_gather": True,
                                                                 "env": {"NCCL_ALGO": "1"}}
    with pytest.raises(sm.SpecError, match="given twice"):
        sm.parse_arm("x:quantized=true,zero_quantized_weights=false")
    with pytest.raises(sm.SpecError, match="environment variable"):
        sm.parse_arm("x:env.1BAD=1")
    with pytest.raises(sm.SpecError, match="'colour'"):
        sm.parse_arm("x:colour=blue")
    with pytest.raises(sm.SpecError, match="quantized"):
        sm.parse_arm("x:quantized=maybe")
    with pytest.raises(sm.SpecError, match="key=value"):
        sm.parse_arm("x:quantized")
    with pytest.raises(sm.SpecError):
        sm.parse_arm(":quantized=true")


def _cli(*args, env=None, timeout=600):
    env = dict(os.environ if env is None else env, GLOO_SOCKET_IFNAME="lo", HF_HUB_OFFLINE="1")
    # the children (run_arm's fresh processes) import the same qzero as this test
    src = os.path.dirname(os.path.dirname(os.path.abspath(qzero.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, "-m", "qzero", "bench", "steps", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


TINY = ["--device", "cpu", "--world-size", "2", "--preset", "tiny", "--seq-len", "32", "--micro-batch", "2",
        "--steps", "3", "--warmup", "1"]


@pytest.mark.parametrize("args, named", [
    (["--arm", "plain:", "--arm", "x:quantized=true,colour=blue"], "colour"),
    (["--arm", "plain:", "--arm", "x:backend=nope"], "backend"),
    (["--arm", "plain:", "--arm", "x:engine=deepspeed"], "x: setting 'engine' is now 'backend'"),
    (["--arm", "plain:", "--arm", "x:group_size=12"],
     "x: zero_quantized_weights_group_size must be a positive multiple of 8"),
    (["--arm", "plain:", "--arm", "plain:quantized=true"], "twice"),
    (["--arm", "plain:", "--reference", "other"], "other"),
    (["--arm", "plain:", "--peers", "deepspeed"], "deepspeed"),
    ([], "--arm"),
])
def test_bad_arms_are_refused_before_anything_runs(tmp_path, monkeypatch, capsys, args, named):
    def must_not_run(*a, **k):
        raise AssertionError("an arm ran although the arguments are bad")

    monkeypatch.setattr(sm, "run_arm", must_not_run)
    out = tmp_path / "m"
    with pytest.raises(SystemExit) as exc:
        sm.main([*TINY, *args, "--out", str(out)])
    assert exc.value.code == 2
    assert named in capsys.readouterr().err
    assert not out.exists()


def test_main_runs_order_balanced_and_records_a_failed_arm(tmp_path, monkeypatch, capsys):
    calls = []
    times = {"plain": REF, "int8": FAST}

    envs = {}

    def fake_run_arm(settings, out_path, log_path, env=None):
        name = os.path.basename(log_path).split("_", 1)[1][:-4]
        calls.append(name)
        envs[name] = env
        if settings.backend == "deepspeed":
            raise sm.ArmFailed("arm exited with code 1; last output:\nImportError: deepspeed is not installed")
        return run(times[name])

    monkeypatch.setattr(sm, "run_arm", fake_run_arm)
    out = tmp_path / "m"
    rc = sm.main([*TINY, "--arm", "plain:", "--arm", "int8:quantized=true,env.NCCL_ALGO=1",
                  "--arm", "deepspeed:backend=deepspeed",
                  "--rounds", "2", "--peers", "deepspeed", "--regime-label", "fake", "--out", str(out)])
    assert rc == 0
    assert calls == ["plain", "int8", "deepspeed", "deepspeed", "int8", "plain"]
    assert envs == {"plain": None, "int8": {"NCCL_ALGO": "1"}, "deepspeed": None}
    stdout = capsys.readouterr().out
    assert stdout.count("steps_matrix: [") == 6
    m = json.loads((out / "matrix.json").read_text())
    assert m["complete"] and m["runs_done"] == 6 and m["regime_label"] == "fake"
    assert [s["arm"] for s in m["schedule"]] == calls
    assert m["analysis"]["reference"] == "plain" and m["environment"]["process_group_backend"] == "gloo"
    assert row(m["analysis"], "int8")["vs_reference"]["ratio"] == pytest.approx(2.0)
    assert row(m["analysis"], "deepspeed")["status"] == "failed"
    assert all("sample" not in r for runs in m["runs"].values() for r in runs)
    assert [r["round"] for r in m["runs"]["int8"]] == [0, 1]
    assert (out / "steps.png").read_bytes()[:4] == b"\x89PNG"
    md = (out / "matrix.md").read_text()
    assert stdout.rstrip().endswith(md.rstrip().splitlines()[-1])  # the table is printed last
    assert ('| int8 | zero_quantized_weights=true, overlap_param_gather=true, env={"NCCL_ALGO": "1"} '
            '| 500.0 | — | 2.000 [' in md)
    assert m["settings"]["zero"]["zero_quantized_weights"] is False and "stage 2, buckets 5e+08/5e+08" in md


def test_run_arm_sets_the_arm_environment_for_its_process_only(tmp_path, monkeypatch):
    from qzero.app.qualify import run as qrun
    from qzero.app.train import TrainSettings

    seen = {}

    def fake_subprocess_run(cmd, stdout, stderr, env):
        seen.update(env)
        (tmp_path / "out.json").write_text("{}")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(qrun.subprocess, "run", fake_subprocess_run)
    monkeypatch.setenv("RANK", "3")
    assert qrun.run_arm(TrainSettings(), str(tmp_path / "out.json"), str(tmp_path / "log"), env={"QZERO_X": "1"}) == {}
    assert seen["QZERO_X"] == "1" and "RANK" not in seen
    assert "QZERO_X" not in os.environ


# ---------------------------------------------------------------------- the real thing


@pytest.mark.slow  # an end-to-end run of a benchmark script: python -m pytest -m slow
def test_end_to_end_on_the_cpu(tmp_path):
    out = tmp_path / "matrix"
    # two arms, two order-balanced rounds: the fewest fresh-process runs that still check
    # the schedule, reproduction across runs and the ratios against the reference
    res = _cli(*TINY, "--rounds", "2", "--arm", "plain:",
               "--arm", "ahead:quantized=true,overlap=true", "--regime-label", "cpu test", "--out", str(out))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    m = json.loads((out / "matrix.json").read_text())
    assert [s["arm"] for s in m["schedule"]] == ["plain", "ahead", "ahead", "plain"]
    a = m["analysis"]
    assert [r["arm"] for r in a["arms"]] == ["plain", "ahead"]
    for r in a["arms"]:
        # (3 steps - 1 warm-up - the last) x 2
        assert r["status"] == "ok" and r["runs_ok"] == 2 and r["measured_steps"] == 2
        assert r["reproducible"] is True and r["replicas_identical"] is True
        assert r["param_agreement"]["tolerance_violations"] == 0
        assert r["max_loss_diff"] < 0.05
        # the ratio is recomputed here from the raw times the JSON keeps
        ref_times = [t for x in m["runs"]["plain"] for t in x["step_times"]]
        arm_times = [t for x in m["runs"][r["arm"]] for t in x["step_times"]]
        assert r["vs_reference"]["ratio"] == pytest.approx(statistics.median(ref_times) / statistics.median(arm_times))
        lo, hi = r["vs_reference"]["ci95"]
        assert lo <= hi
    plain, ahead = a["arms"]
    assert plain["vs_reference"]["ratio"] == 1.0 and plain["max_loss_diff"] == 0.0
    assert ahead["bytes_sent_per_step"] < plain["bytes_sent_per_step"]
    assert m["arms"][1]["diff"] == {"zero_quantized_weights": True, "overlap_param_gather": True}
    assert all("sample" not in r and "sample_hash" in r for runs in m["runs"].values() for r in runs)
    assert (out / "steps.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(os.listdir(out / "logs")) == sorted(f"r{r}_{n}.log" for r in (0, 1) for n in ("plain", "ahead"))
    tail = res.stdout.rstrip().splitlines()
    assert tail[-1].startswith("| ahead | zero_quantized_weights=true, overlap_param_gather=true |")
    assert tail[-2].startswith("| plain | (common) |")
    assert "| arm | settings | median ms | wall ms/step | vs plain [CI] |" in res.stdout
