"""The qzero command end to end on the CPU, and its one-line errors."""

import json
import os
import re
import subprocess
import sys
import time

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")


def qzero(*args, timeout=300):
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    return subprocess.run(
        [sys.executable, "-m", "qzero", *args], capture_output=True, text=True, timeout=timeout, env=env
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
    assert report["differing_settings"] == {"overlap_param_gather": [False, True],
                                            "zero_quantized_weights": [False, True]}
    for name in ("report.md", "loss.png", "step_times.png", "bytes.png"):
        assert (out / name).stat().st_size > 0
    assert all(log.stat().st_size > 0 for log in out.glob("arm*.log"))  # empty logs are not left behind
    assert "NOTHING TO SAVE ON CPU LOOPBACK" in res.stdout and "bytes on the wire per rank per step 0.5" in res.stdout
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow  # the gates' logic: tests/test_qualify_stats.py::test_each_gate_fails_when_it_must
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
    assert "resource_tracker" not in res.stderr and "leaked" not in res.stderr  # tqdm's lock once leaked a semaphore


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "--preset", "qwen9"], "unknown preset 'qwen9'"),
        (["train", "--data", "/no/such/file.txt"], "data file not found"),
        (["train", "--device", "cuda", "--world-size", "64"], "CUDA|GPU"),
        (["train", "--data", "{tiny}", "--seq-len", "4096"], "longer than the data"),
        (["qualify", "--order", "BBB"], "--order"),
        (["qualify", "--candidate", "colour=blue"], "unknown setting .colour.; KEY is a workload setting"),
        (["train", "--zero-quantized-weights-group-size", "12"], "zero_quantized_weights_group_size must be"),
        # the flags of earlier releases: one line naming the flag that replaced each
        (["train", "--group-size", "12"], "^qzero: error: --group-size is now --zero-quantized-weights-group-size "),
        (["train", "--format", "int4"], "--format is now --zero-quantized-weights-format"),
        (["train", "--allgather-bucket", "5e7"], "--allgather-bucket is now --allgather-bucket-size"),
        (["qualify", "--reduce-bucket", "5e7"], "--reduce-bucket is now --reduce-bucket-size"),
        (["qualify", "--overlap"], "--overlap is now --overlap-param-gather"),
        (["qualify", "--no-overlap", "--preset", "tiny"], "--no-overlap is now --no-overlap-param-gather"),
        (["qualify", "--candidate", "quantized=true", "--candidate", "group_size=12"],
         "--candidate: zero_quantized_weights_group_size must be a positive multiple of 8"),
        (["qualify", "--baseline", "quantized=true", "--baseline", "zero_quantized_weights_format=int5"],
         "--baseline: .*int5"),
        (["qualify", "--candidate", "quantized=true", "--candidate", "zero_quantized_weights=false"],
         "zero_quantized_weights is already set"),
        (["train", "--allgather-bucket-size", "0"], "allgather_bucket_size must be positive"),
        (["qualify", "--out", "{tiny}"], "tiny.txt: exists and is not a directory"),
        (["train", "--out", "{tmp}/missing/run.json"], "missing does not exist"),
        (["train", "--out", "{tmp}"], "is a directory"),
        (["train", "--model-config", "{empty}"], "model config file .*empty.json is not valid JSON"),
        (["train", "--data", "{tmp}"], "data .* is a directory"),
        (["train", "--steps", "3", "--warmup", "2"], "use --warmup 1 or fewer"),
        (["train", "--steps", "1"], "steps must be at least 2"),
        # model configs that transformers accepts but no rank could train
        (["train", "--model-config", "{cfg:qwen9}"], "unknown model_type 'qwen9'; did you mean 'qwen3'"),
        (["train", "--model-config", "{cfg:vit}"], "model_type 'vit' is not a causal language model"),
        (["train", "--model-config", "{cfg:heads0}"], "num_attention_heads must be a positive integer, got 0"),
        (["train", "--model-config", "{cfg:hidden-1}"], "hidden_size must be a positive integer, got -1"),
        (["train", "--model-config", "{cfg:vocab100}"], "vocab_size 100 is below the 256 byte values"),
        (["train", "--model-config", "{cfg:kv3}"], "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
        (["train", "--model-config", "{cfg:positions16}", "--seq-len", "32"],
         "max_position_embeddings 16 is shorter than --seq-len 32"),
        (["train", "--model-config", "{cfg:layers}"], "num_hidden_layers 100,000 is more than the 4,096"),
        (["train", "--lr", "nan"], "lr must be a finite number >= 0, got nan"),
        (["train", "--lr", "-1"], "lr must be a finite number >= 0, got -1.0"),
        (["train", "--no-quantized", "--zero-quantized-weights-format", "int4"],
         "--zero-quantized-weights-format is a setting of the quantized weight gather"),
        (["qualify", "--repeats", "0"], "^qzero: error: --repeats must be at least 1, got 0$"),
        (["qualify", "--tolerance", "-1"], "--tolerance must be a finite number >= 0, got -1.0"),
        (["qualify", "--max-loss-diff", "nan"], "--max-loss-diff must be a finite number >= 0, got nan"),
        (["qualify", "--candidate", "quantised=true"],
         "unknown setting 'quantised' .not a workload setting, ZeroConfig field or short name.; "
         "did you mean quantized"),
        (["qualify", "--candidate", "quantized"], "expected KEY=VALUE"),
        (["qualify", "--baseline", "quantized=true", "--candidate", "quantized=true"], "no difference configured"),
        (["qualify", "--candidate", "fmt=int4"],
         "--candidate zero_quantized_weights_format=...: "
         "does nothing while this arm.s zero_quantized_weights is false"),
    ],
)
def test_bad_arguments_get_one_line_and_exit_2(tmp_path, capsys, args, message):
    import re

    from qzero.app.cli import main

    tiny = tmp_path / "tiny.txt"
    tiny.write_text("hello world\n" * 10)
    (tmp_path / "empty.json").write_text("")
    for name, config in CONFIGS.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(config))
    args = [a.replace("{tiny}", str(tiny)).replace("{empty}", str(tmp_path / "empty.json"))
            .replace("{tmp}", str(tmp_path)) for a in args]
    args = [str(tmp_path / f"{a[5:-1]}.json") if a.startswith("{cfg:") else a for a in args]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert re.search(message, err.strip()), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert len(err.strip()) <= 400  # an unknown model_type once printed 12,000 characters


#: Model configs for the cases above: the tiny preset's shape with one thing wrong.
TINY_CONFIG = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256}
CONFIGS = {
    "qwen9": {"model_type": "qwen9"},
    "vit": {"model_type": "vit"},
    "heads0": dict(TINY_CONFIG, num_attention_heads=0),
    "hidden-1": dict(TINY_CONFIG, hidden_size=-1),
    "vocab100": dict(TINY_CONFIG, vocab_size=100),
    "kv3": dict(TINY_CONFIG, num_key_value_heads=3),
    "positions16": dict(TINY_CONFIG, max_position_embeddings=16),
    # ~2.1 T parameters (about 32 TiB of weights and optimizer state): 40 layers at width 65,536
    "huge": dict(TINY_CONFIG, hidden_size=65536, intermediate_size=262144, num_hidden_layers=40,
                 num_attention_heads=64, num_key_value_heads=8, head_dim=128),
    "layers": dict(TINY_CONFIG, num_hidden_layers=100_000),
}

#: Runs ``qzero.app.cli.main`` on each case in one process, each case's stderr captured, and
#: prints [exit code, stderr] per case as JSON. The cases read special files: a FIFO (which
#: blocked forever), a pipe (read by the parent, then empty for the ranks), /dev/zero (read
#: until memory ran out), and a config too large for any machine: so they run in a process of
#: their own, under a timeout and an address-space limit.
SPECIAL_FILES_DRIVER = """
import contextlib, io, json, os, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
from qzero.app.cli import main
read, write = os.pipe()
os.write(write, b"hello world " * 100)
os.close(write)
fifo = sys.argv[1]
cases = [["train", "--data", fifo], ["train", "--model-config", fifo], ["train", "--data", f"/dev/fd/{read}"],
         ["train", "--model-config", "/dev/zero"], ["train", "--model-config", sys.argv[2]],
         ["train", "--out", "/proc/run.json"]]
out = []
for args in cases:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(args)
    out.append([rc, err.getvalue()])
print(json.dumps(out))
"""


def test_special_files_and_impossible_models_are_refused_before_any_rank_starts(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "huge.json").write_text(json.dumps(CONFIGS["huge"]))
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    res = subprocess.run([sys.executable, "-c", SPECIAL_FILES_DRIVER, str(fifo), str(tmp_path / "huge.json")],
                         capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads(res.stdout.strip().splitlines()[-1])
    expected = [f"data {fifo} is a pipe, not a regular file", f"model config {fifo} is a pipe",
                r"data /dev/fd/\d+ is a pipe", "model config /dev/zero is a character device",
                r"2,\d{3},\d{3},\d{3},\d{3} parameters need at least .* TiB a rank",
                "--out /proc/run.json: cannot create a file"]
    for (rc, err), message in zip(results, expected):
        assert rc == 2 and len(err.strip().splitlines()) == 1 and err.startswith("qzero: error: "), err
        assert re.search(message, err), err


@pytest.mark.slow  # a second qualify run end to end, with DeepSpeed as the baseline: python -m pytest -m slow
def test_qualify_against_a_peer_backend(tmp_path):
    """DeepSpeed ZeRO-2 (unmodified) as the baseline arm, qzero INT8 as the candidate."""
    pytest.importorskip("deepspeed")
    out = tmp_path / "rep"
    res = qzero("qualify", *TINY, "--order", "BC", "--baseline", "backend=deepspeed", "--candidate", "quantized=true",
                "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["differing_settings"] == {"backend": ["deepspeed", "qzero"], "overlap_param_gather": [False, True],
                                            "zero_quantized_weights": [False, True]}
    assert report["arms"][0]["replicas_identical"] and report["gates"]["max_loss_diff"]


def test_train_with_fsdp2(tmp_path):
    out = tmp_path / "run.json"
    res = qzero("train", *TINY, "--backend", "fsdp2", "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["replicas_identical"] is None  # sharded: no replicated buffer to compare
    assert rec["losses"][-1] < rec["losses"][0] and len(rec["sample"]) > 4000


def test_bench_gather_ships_with_the_package(tmp_path):
    """``qzero bench gather`` runs from the package: ``--render`` rewrites the Markdown table of a
    saved multi-GPU result (built here by the benchmark's own record code) from its JSON alone."""
    from _support.gather_results import gather_result
    from qzero.app.cli import main

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
    assert "bucket 500,000,000 elements" in md
    # a result saved before the bucket was named allgather_bucket_size renders the same
    old = json.loads(path.read_text())
    old["bucket_numel"] = old.pop("allgather_bucket_size")
    path.write_text(json.dumps(old))
    assert main(["bench", "gather", "--render", str(path)]) == 0
    assert (tmp_path / "r.md").read_text() == md


def test_a_missing_extra_is_named_before_any_work(monkeypatch, capsys):
    import qzero.app.cli as cli

    monkeypatch.setattr(cli, "_has", lambda module: module not in ("transformers", "deepspeed"))
    assert cli.main(["train"]) == 2
    assert "pip install 'qzero[cli]'" in capsys.readouterr().err
    monkeypatch.setattr(cli, "_has", lambda module: module != "deepspeed")
    assert cli.main(["qualify", "--baseline", "backend=deepspeed"]) == 2
    assert "pip install 'qzero[deepspeed]'" in capsys.readouterr().err


def test_short_runs_get_a_shorter_warmup_and_more_ranks_than_cores_a_warning(capsys):
    import qzero.app.cli as cli
    from qzero.app.train import validate

    args = cli.build_parser().parse_args(["train", "--steps", "3"])
    s = cli._train_settings(args)
    assert s.warmup == 1
    validate(s)
    args = cli.build_parser().parse_args(["train", "--world-size", str((os.cpu_count() or 1) + 1), "--oversubscribe"])
    cli._preflight(args, [cli._train_settings(args)])
    assert "CPU cores" in capsys.readouterr().err


def test_arm_settings_take_zero_config_names_and_short_names():
    """Arms are ZeroConfig settings on top of the flags': short names map onto ZeroConfig's, the
    preset's small-param threshold applies unless set, gather-ahead follows each arm's gather
    unless a flag or the arm sets it."""
    import qzero.app.cli as cli

    def arms(*argv):
        return cli._qualify_arms(cli.build_parser().parse_args(["qualify", *argv]))

    base, b, c = arms()
    assert not b.zero.zero_quantized_weights and c.zero.zero_quantized_weights
    assert (b.zero.overlap_param_gather, c.zero.overlap_param_gather) == (False, True)
    assert b.zero.small_param_numel == c.zero.small_param_numel == 1024  # the tiny preset's threshold
    assert base.zero == b.zero
    _, b, c = arms("--no-overlap-param-gather", "--preset", "small", "--baseline", "fmt=int4",
                   "--baseline", "quantized=true",
                   "--candidate", "zero_quantized_weights_format=fp8", "--candidate", "group-size=128",
                   "--candidate", "small_param_numel=0", "--candidate", "quantized=true")
    assert (b.zero.zero_quantized_weights_format, c.zero.zero_quantized_weights_format) == ("int4", "fp8")
    assert c.zero.zero_quantized_weights_group_size == 128 and b.zero.zero_quantized_weights_group_size == 64
    # --no-overlap-param-gather holds for both
    assert not b.zero.overlap_param_gather and not c.zero.overlap_param_gather
    assert (b.zero.small_param_numel, c.zero.small_param_numel) == (4096, 0)
    _, b, c = arms("--small-param-numel", "7", "--allgather-bucket-size", "5e7", "--candidate", "overlap=false")
    assert b.zero.small_param_numel == c.zero.small_param_numel == 7
    assert c.zero.allgather_bucket_size == 50_000_000 and not c.zero.overlap_param_gather
    help_text = cli.build_parser()._subparsers._group_actions[0].choices["qualify"].format_help()
    assert "zero_quantized_weights=true" in help_text and "short names" in help_text


def test_the_help_lists_only_the_public_commands():
    import qzero.app.cli as cli

    text = cli.build_parser().format_help()
    assert "{train,qualify,bench,plan}" in text and "_arm" not in text and "SUPPRESS" not in text


def test_the_parameter_count_is_a_real_builds_and_the_memory_bound_is_its_formula(tmp_path, monkeypatch):
    """check_fits counts on the meta device what a real build holds (tied embeddings once), and
    refuses exactly when 2 bytes a parameter on every rank plus 12 split over the ranks exceed
    the host's memory for its ranks."""
    import torch

    import qzero.app.train as train
    from qzero.app.workload import WorkloadError, build_model, model_config

    path = tmp_path / "tied.json"
    path.write_text(json.dumps(dict(TINY_CONFIG, tie_word_embeddings=True, num_hidden_layers=2)))
    for settings in (train.TrainSettings(preset="tiny", device="cpu", world_size=3),
                     train.TrainSettings(model_config=str(path), device="cpu", world_size=3)):
        real = build_model(model_config(settings.preset, settings.model_config), torch.bfloat16, torch.device("cpu"), 0)
        count = sum(p.numel() for p in real.parameters() if p.requires_grad)
        assert train.check_fits(settings) == count
    need = 3 * (count * (2 + 12 / 3) + train.PROCESS_BYTES)  # the tied config on 3 CPU ranks
    monkeypatch.setattr(train.os, "sysconf", lambda name: 1 if name == "SC_PAGE_SIZE" else int(need))
    assert train.check_fits(settings) == count
    monkeypatch.setattr(train.os, "sysconf", lambda name: 1 if name == "SC_PAGE_SIZE" else int(need) - 1)
    with pytest.raises(WorkloadError, match=f"{count:,} parameters need at least .* for its 3 ranks"):
        train.check_fits(settings)


def test_help_does_not_import_torch():
    code = ("import sys\nfrom qzero.app.cli import main\n"
            "for argv in (['--help'], ['train', '--help'], ['qualify', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print('torch imported:', 'torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "zero_quantized_weights=true" in res.stdout and "qwen3-125m-byte" in res.stdout
    assert res.stdout.strip().endswith("torch imported: False")


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc: each process's parent pid)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                continue
    out, frontier = [], [pid]
    while frontier:
        kids = [p for p, parent in parents.items() if parent in frontier]
        out += kids
        frontier = kids
    return out


def _is_rank(pid: int) -> bool:
    """A rank past its start: spawned by multiprocessing and holding a socket (the process
    group's store connects only after the rank has armed its parent-death handling)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" not in f.read():
                return False
        return any(os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:") for fd in os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("command", ["train", "qualify"])
def test_ranks_die_with_a_sigkilled_parent(tmp_path, command):
    """SIGKILL of the ``qzero train``/``qualify`` process (an OOM kill, a CI timeout) ends
    everything it started: ranks, and for qualify the arm process between (which nothing
    ended: its ranks trained on under it). For train, torch's own spawn already sends the
    ranks SIGINT when the launcher dies; qzero's SIGKILL replaces it, which no rank can catch
    or defer."""
    from test_orphans import wait_dead

    args = ["--steps", "100000", "--seq-len", "32", "--micro-batch", "2"]
    if command == "qualify":
        args += ["--out", str(tmp_path / "rep")]
    parent = subprocess.Popen([sys.executable, "-m", "qzero", command, *args], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env=dict(os.environ, GLOO_SOCKET_IFNAME="lo"))
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and sum(map(_is_rank, _descendants(parent.pid))) < 2:
            assert parent.poll() is None, f"qzero {command} exited early ({parent.returncode})"
            time.sleep(0.5)
        started = _descendants(parent.pid)
        assert sum(map(_is_rank, started)) == 2, "the ranks did not start in time"
    finally:
        parent.kill()  # SIGKILL
        parent.wait(timeout=30)
    assert wait_dead(started, timeout=60) == [], f"processes of a SIGKILLed qzero {command} kept running"
