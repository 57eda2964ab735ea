"""The qzero command end to end on the CPU, and its one-line errors."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")


def qzero(*args, timeout=300):
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    return subprocess.run(
        [sys.executable, "-m", "qzero.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


TINY = ["--steps", "4", "--warmup", "1", "--seq-len", "32", "--micro-batch", "2"]


def test_qualify_end_to_end_writes_a_report(tmp_path):
    out = tmp_path / "rep"
    res = qzero("qualify", *TINY, "--out", str(out))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "all gates pass" in res.stdout
    report = json.loads((out / "report.json").read_text())
    for key in ("speedup", "speedup_ci95", "max_loss_diff", "param_rel_l2", "param_max_abs_diff",
                "tolerance_violations", "replicas_identical", "gates"):
        assert key in report
    assert len(report["speedup_ci95"]) == 2
    assert [a["arm"] for a in report["arms"]] == ["B1", "C2", "C3", "B4"]
    assert all("peak_allocated_bytes" in a and "peak_reserved_bytes" in a for a in report["arms"])
    assert report["gates"]["baseline_reproducible"] and report["gates"]["candidate_reproducible"]
    assert report["arms"][1]["bytes_sent_per_step"] < 0.6 * report["arms"][0]["bytes_sent_per_step"]
    assert report["environment"]["command"].startswith("qzero qualify")
    assert report["differing_settings"] == {"overlap_param_gather": [False, True], "zero_quantized_weights": [False, True]}
    for name in ("report.md", "loss.png", "step_times.png"):
        assert (out / name).stat().st_size > 0
    assert all(log.stat().st_size > 0 for log in out.glob("arm*.log"))  # empty logs are not left behind
    assert "NOTHING TO SAVE ON CPU LOOPBACK" in res.stdout and "bytes on the wire per rank per step 0.5" in res.stdout
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_a_gate_that_must_fail_fails(tmp_path):
    res = qzero("qualify", *TINY, "--order", "BC", "--max-loss-diff", "0", "--candidate", "fmt=\"int4\"",
                "--candidate", "quantized=true", "--out", str(tmp_path / "rep"))
    assert res.returncode == 1, res.stderr[-2000:]
    assert "GATES FAILED" in res.stdout and "max_loss_diff" in res.stdout
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert report["gates"]["max_loss_diff"] is False and report["passed"] is False


def test_train_runs_and_records(tmp_path):
    out = tmp_path / "run.json"
    res = qzero("train", *TINY, "--stage", "1", "--out", str(out))
    assert res.returncode == 0, res.stderr[-2000:]
    rec = json.loads(out.read_text())
    assert len(rec["losses"]) == 4 and rec["replicas_identical"]
    assert "replicas identical: True" in res.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "--preset", "qwen9"], "unknown preset 'qwen9'"),
        (["train", "--data", "/no/such/file.txt"], "data file not found"),
        (["train", "--device", "cuda", "--world-size", "64"], "CUDA|GPU"),
        (["train", "--data", "{tiny}", "--seq-len", "4096"], "longer than the data"),
        (["qualify", "--order", "BBB"], "--order"),
        (["qualify", "--candidate", "colour=blue"], "KEY=VALUE"),
        (["train", "--group-size", "12"], "group_size"),
        (["qualify", "--candidate", "group_size=12"], "--candidate: group_size must be a positive multiple of 8"),
        (["qualify", "--baseline", "zero_quantized_weights_format=int5"], "--baseline: .*int5"),
        (["qualify", "--candidate", "quantized=true", "--candidate", "zero_quantized_weights=false"],
         "zero_quantized_weights is already set"),
        (["train", "--allgather-bucket", "0"], "allgather_bucket_size must be positive"),
        (["qualify", "--out", "{tiny}"], "tiny.txt: exists and is not a directory"),
        (["train", "--out", "{tmp}/missing/run.json"], "missing does not exist"),
        (["train", "--out", "{tmp}"], "is a directory"),
        (["train", "--model-config", "{empty}"], "model config file .*empty.json is not valid JSON"),
        (["train", "--data", "{tmp}"], "data .* is a directory"),
        (["train", "--steps", "3", "--warmup", "2"], "use --warmup 1 or fewer"),
        (["train", "--steps", "1"], "steps must be at least 2"),
    ],
)
def test_bad_arguments_get_one_line_and_exit_2(tmp_path, capsys, args, message):
    import re

    from qzero.cli import main

    tiny = tmp_path / "tiny.txt"
    tiny.write_text("hello world\n" * 10)
    (tmp_path / "empty.json").write_text("")
    args = [a.replace("{tiny}", str(tiny)).replace("{empty}", str(tmp_path / "empty.json"))
            .replace("{tmp}", str(tmp_path)) for a in args]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_qualify_against_a_peer_engine(tmp_path):
    """DeepSpeed ZeRO-2 (unmodified) as the baseline arm, qzero INT8 as the candidate."""
    pytest.importorskip("deepspeed")
    out = tmp_path / "rep"
    res = qzero("qualify", *TINY, "--order", "BC", "--baseline", "engine=deepspeed", "--candidate", "quantized=true",
                "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["differing_settings"] == {"engine": ["deepspeed", "qzero"], "overlap_param_gather": [False, True],
                                            "zero_quantized_weights": [False, True]}
    assert report["arms"][0]["replicas_identical"] and report["gates"]["max_loss_diff"]


def test_train_with_fsdp2(tmp_path):
    out = tmp_path / "run.json"
    res = qzero("train", *TINY, "--engine", "fsdp2", "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["replicas_identical"] is None  # sharded: no replicated buffer to compare
    assert rec["losses"][-1] < rec["losses"][0] and len(rec["sample"]) > 4000


def test_bench_gather_ships_with_the_package(tmp_path):
    """``qzero bench gather`` runs from the package: ``--render`` rewrites the Markdown table of a
    saved multi-GPU result (built here by the benchmark's own record code) from its JSON alone."""
    from gather_results import gather_result
    from qzero.cli import main

    times = {"bf16 one NCCL call": [29.0, 30.0, 31.0], "bf16": [39.0, 40.0, 41.0], "int8": [22.0, 20.0, 21.0],
             "int8 payload only": [18.5, 19.0, 19.5]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(gather_result(2, {1 << 30: times})))
    assert main(["bench", "gather", "--render", str(path)]) == 0
    md = (tmp_path / "r.md").read_text()
    assert md.startswith("# Gather, 2 x test GPU: test link\n")
    # median 21 ms; 2 GiB of bf16 in 21 ms = 102 GB/s; 40 / 21 = 1.90x the bf16 arm, 30 / 21 = 1.43x one call
    assert "| 1 Gi | int8 | 21.00 | 102 | 1.90x | 1.43x |" in md
    assert "| 1 Gi | bf16 | 40.00 | 54 | 1.00x | 0.75x |" in md
    assert md.count("| 1 Gi |") == len(times)


def test_a_missing_extra_is_named_before_any_work(monkeypatch, capsys):
    import qzero.cli as cli

    monkeypatch.setattr(cli, "_has", lambda module: module not in ("transformers", "deepspeed"))
    assert cli.main(["train"]) == 2
    assert "pip install 'qzero[cli]'" in capsys.readouterr().err
    monkeypatch.setattr(cli, "_has", lambda module: module != "deepspeed")
    assert cli.main(["qualify", "--baseline", "engine=deepspeed"]) == 2
    assert "pip install 'qzero[deepspeed]'" in capsys.readouterr().err


def test_short_runs_get_a_shorter_warmup_and_more_ranks_than_cores_a_warning(capsys):
    import qzero.cli as cli
    from qzero.train import validate

    args = cli.build_parser().parse_args(["train", "--steps", "3"])
    s = cli._settings(args, True)
    assert s.warmup == 1
    validate(s)
    args = cli.build_parser().parse_args(["train", "--world-size", str((os.cpu_count() or 1) + 1)])
    cli._preflight(args, [cli._settings(args, True)])
    assert "CPU cores" in capsys.readouterr().err


def test_arm_settings_take_zero_config_names_and_short_names():
    """Arms are ZeroConfig settings on top of the flags': short names map onto ZeroConfig's, the
    preset's small-param threshold applies unless set, gather-ahead follows each arm's gather
    unless a flag or the arm sets it."""
    import qzero.cli as cli

    def arms(*argv):
        return cli._qualify_arms(cli.build_parser().parse_args(["qualify", *argv]))

    base, b, c = arms()
    assert not b.zero.zero_quantized_weights and c.zero.zero_quantized_weights
    assert (b.zero.overlap_param_gather, c.zero.overlap_param_gather) == (False, True)
    assert b.zero.small_param_numel == c.zero.small_param_numel == 1024  # the tiny preset's threshold
    assert base.zero == b.zero
    _, b, c = arms("--no-overlap", "--preset", "small", "--baseline", "fmt=int4", "--baseline", "quantized=true",
                   "--candidate", "zero_quantized_weights_format=fp8", "--candidate", "group-size=128",
                   "--candidate", "small_param_numel=0")
    assert (b.zero.zero_quantized_weights_format, c.zero.zero_quantized_weights_format) == ("int4", "fp8")
    assert c.zero.zero_quantized_weights_group_size == 128 and b.zero.zero_quantized_weights_group_size == 64
    assert not b.zero.overlap_param_gather and not c.zero.overlap_param_gather  # --no-overlap holds for both
    assert (b.zero.small_param_numel, c.zero.small_param_numel) == (4096, 0)
    _, b, c = arms("--small-param-numel", "7", "--allgather-bucket", "5e7", "--candidate", "overlap=false")
    assert b.zero.small_param_numel == c.zero.small_param_numel == 7
    assert c.zero.allgather_bucket_size == 50_000_000 and not c.zero.overlap_param_gather
    help_text = cli.build_parser()._subparsers._group_actions[0].choices["qualify"].format_help()
    assert "zero_quantized_weights=true" in help_text and "short names" in help_text


def test_the_help_lists_only_the_public_commands():
    import qzero.cli as cli

    text = cli.build_parser().format_help()
    assert "{train,qualify,bench}" in text and "_arm" not in text and "SUPPRESS" not in text
