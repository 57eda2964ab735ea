"""``qzero plan`` on a CPU: the table, the JSON record, the plot, and one-line errors (exit 2)."""

from __future__ import annotations

import json

import pytest

from qzero.app.cli import main


def test_plan_prints_the_arms_and_writes_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    assert main(["plan", "--preset", "small", "--step-ms", "100", "--nodes", "2", "--gpus-per-node", "4",
                 "--json", str(out), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "projection" in text and "recommended:" in text
    record = json.loads(out.read_text())
    arms = {a["arm"]: a for a in record["arms"]}
    assert len(arms) == 13 and record["projection"] is True
    for a in arms.values():
        assert {"arm", "bits_per_param_per_node", "link_ms", "step_ms"} <= set(a)
        assert a["step_ms"] >= 100
    assert arms["qzero INT4 delta + INT4 grads (two-level)"]["bits_per_param_per_node"] < \
        arms["qzero INT4 delta + INT4 grads"]["bits_per_param_per_node"]
    inside = [c["collective"] for c in arms["qzero INT4 delta + INT4 grads (two-level, INT8 inside)"]["collectives"]]
    assert "quantized gradient all-to-all (node)" in inside and "gradient reduce-scatter (node)" not in inside
    assert set(record["recommendation"]) >= {"arm", "intra_node"}
    pytest.importorskip("matplotlib")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, named", [
    (["--nodes", "0"], "--nodes"),
    (["--inter-gbps", "-1"], "--inter-gbps"),
    (["--intra-gbps", "nan"], "--intra-gbps"),
    (["--preset", "nope"], "nope"),
    (["--step-ms", "0"], "--step-ms"),
])
def test_bad_input_is_one_line_and_exit_2(argv, named, capsys):
    args = ["plan", "--step-ms", "100"] + argv if "--step-ms" not in argv else ["plan"] + argv
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qzero: error:") and named in err and "\n" not in err
