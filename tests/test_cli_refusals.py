"""The command refuses what cannot run, or would mislead, in one line before any work (exit 2):
absurd sizes, an interval from too few steps, arm settings the ranks would refuse, an empty
--out, an earlier report; and says so when interrupted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from qzero.app.cli import main


@pytest.mark.parametrize("argv, message", [
    (["qualify", "--world-size", "1000", "--device", "cpu"],
     "--world-size 1000: more ranks than this host's .* CPU cores .* add --oversubscribe"),
    (["qualify", "--world-size", "4000", "--oversubscribe", "--device", "cpu"],
     r"256.0 MiB for each rank's process\); this host has"),
    (["qualify", "--world-size", "5000", "--oversubscribe", "--device", "cpu"],
     "world-size must be a whole number from 1"),
    (["qualify", "--allgather-bucket-size", "1e99", "--device", "cpu"],
     "allgather_bucket_size must be at most 2\\*\\*48"),
    (["train", "--seq-len", "100000000", "--device", "cpu"], "seq-len must be a whole number from 1 to"),
    (["qualify", "--steps", "4", "--order", "BC", "--device", "cpu"],
     "time 1 step.s. of the baseline: an interval needs at least 2"),
    (["qualify", "--repeats", "1000000000"], "--order BCCB x --repeats 1000000000 is 4,000,000,000 arms; at most"),
    (["train", "--steps", "-5"], "^qzero: error: steps must be a whole number from 1 to 100,000,000, got -5$"),
    (["train", "--out", ""], "^qzero: error: --out is empty: give a file name"),
    (["qualify", "--out", ""], "^qzero: error: --out is empty: give a folder"),
    # arm settings the ranks used to refuse with a traceback (exit 3)
    (["qualify", "--candidate", "quantized=true", "--candidate", "gather_schedule=streams", "--device", "cpu"],
     "gather_schedule=streams needs CUDA"),
    (["qualify", "--candidate", "copy_engine_collectives=true", "--device", "cpu"],
     "copy_engine_collectives=true needs CUDA"),
    (["qualify", "--candidate", "quantized=true", "--candidate", "zero_quantized_weights_delta=true", "--candidate",
      f"zero_quantized_weights_delta_resync_steps={2**63}", "--device", "cpu"],
     "--candidate: zero_quantized_weights_delta_resync_steps must be at most 2\\*\\*48"),
    (["train", "--no-quantized", "--zero-quantized-gradients-format", "int4"],
     "--zero-quantized-gradients-format is a setting of the quantized gradient reduction, which is off here"),
    (["qualify", "--zero-quantized-weights"], "--zero-quantized-weights is what the default arms compare"),
])
def test_refused_in_one_line_before_any_work(argv, message, capsys, tmp_path, monkeypatch):
    import re

    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert re.search(message, err) and "\n" not in err and "Traceback" not in err, err
    assert os.listdir(tmp_path) == []


def test_an_earlier_report_is_refused_and_force_replaces_it(tmp_path, capsys):
    out = tmp_path / "qualify-report"
    out.mkdir()
    (out / "report.md").write_text("an earlier run")
    (out / "notes.txt").write_text("the user's own")
    argv = ["qualify", "--out", str(out), "--steps", "3", "--device", "cpu", "--candidate", "stage=1",
            "--baseline", "stage=2", "--preset", "tiny"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "holds an earlier report (report.md); give another --out, or add --force" in err
    assert (out / "report.md").read_text() == "an earlier run"
    from qzero.app.cli import _check_earlier_report

    _check_earlier_report(str(out), force=True)  # what --force does before the arms start
    assert sorted(os.listdir(out)) == ["notes.txt"]


def test_an_interrupted_qualify_says_so(tmp_path):
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "qzero", "qualify", "--device", "cpu", "--steps", "200",
                             "--out", str(tmp_path / "r")], stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                            start_new_session=True)
    deadline = time.time() + 60
    while time.time() < deadline and not ((tmp_path / "r").is_dir() and os.listdir(tmp_path / "r")):
        time.sleep(0.2)  # the first arm's log: the arms have started
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "qzero: interrupted after 0 of 4 arms: no report written" in err, err[-2000:]
    assert not (tmp_path / "r" / "report.md").exists()
