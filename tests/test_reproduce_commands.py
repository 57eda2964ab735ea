"""Every published result keeps a reproduce command that works: the commands printed in
BENCHMARKS.md, benchmarks/README.md, docs/benchmarks.md and each report are unfolded through the
shell wrappers of benchmarks/scripts/ and parsed by the real argument parsers (arms, link regimes
and emulator stages included) in a fresh process (tests/_support/reproduce.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from _support import reproduce

TESTS = os.path.dirname(os.path.abspath(__file__))


def _check(*commands: str) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, os.path.join(reproduce.ROOT, "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "_support.reproduce", *commands], cwd=reproduce.ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_every_published_command_parses():
    results = _check()
    bad = [f"{r['file']}: {r['command']}\n    " + "\n    ".join(r["problems"]) for r in results if r["problems"]]
    assert not bad, "published commands that no longer run:\n" + "\n".join(bad)
    assert len(results) == len(reproduce.published())


def test_every_report_and_section_has_a_command():
    found = {rel for rel, _, _ in reproduce.published()}
    reports = [rel for rel in reproduce.sources() if rel.startswith("benchmarks/reports/")]
    assert len(reports) >= 10, reports
    missing = [rel for rel in reports if rel not in found]
    assert not missing, f"reports without a reproduce command this test can read: {missing}"
    benchmarks_md = [c for rel, c, _ in reproduce.published() if rel == "BENCHMARKS.md"]
    assert len(benchmarks_md) >= 10, benchmarks_md


def test_a_stale_command_is_caught():
    stale = [
        "python benchmarks/scripts/emulated_matrix.py --presets qwen3-4b --no-such-flag",  # a removed flag
        "python benchmarks/scripts/no_such_script.py --out OUT",  # a retired script
        "bash benchmarks/scripts/run_matrix.sh OUT infiniband",  # an unknown link regime
        "bash benchmarks/scripts/run_emulated.sh OUT no_such_stage",  # an unknown emulator stage
        'ARMS="a:quantized=maybe" bash benchmarks/scripts/run_matrix.sh OUT pcie',  # a bad arm value
        'ARMS="a: b:overlap=true" REFERENCE=c bash benchmarks/scripts/run_matrix.sh OUT pcie',  # no such reference
        "WORLD=2 ARMS=bf16,int8-g64+gq-int4-g64 bash benchmarks/scripts/run_convergence.sh OUT",  # int4 needs -h/-noh
        "qzero bench steps --arm a: --no-such-flag 1 --out OUT",
        "python -m pytest -m gpu tests/gpu/test_no_such_file.py",
    ]
    results = _check(*stale)
    assert [r["command"] for r in results] == stale
    passed = [r["command"] for r in results if not r["problems"]]
    assert not passed, f"stale commands the check let through: {passed}"
    good = _check("python benchmarks/scripts/two_level_bytes.py --out OUT/x.csv",
                  'ARMS="a: b:overlap=true" REFERENCE=b bash benchmarks/scripts/run_matrix.sh OUT pcie ethernet')
    assert [r["problems"] for r in good] == [[], []]


def test_the_reader_unfolds_the_wrappers():
    runs = reproduce.unfold('PRESET=qwen3-4b ARMS="x: y:quantized=true" bash benchmarks/scripts/run_matrix.sh OUT pcie')
    assert [r.kind for r in runs] == ["shell", "module"]
    steps = runs[1]
    assert steps.argv[:2] == ["bench", "steps"] and ["--arm", "y:quantized=true"] == steps.argv[-2:]
    assert steps.argv[steps.argv.index("--preset") + 1] == "qwen3-4b" and ("regime", "pcie") in steps.checks
    runs = reproduce.unfold("bash benchmarks/scripts/regimes.sh pcie python3 -m torch.distributed.run "
                            "--nproc_per_node=2 -m qzero.app.benchmarks.gather --out OUT")
    assert [(r.kind, r.target, r.argv) for r in runs][1] == ("module", "qzero.app.benchmarks.gather", ["--out", "OUT"])
    runs = reproduce.unfold("""MPS=1 SEEDS="$(seq -s ' ' 0 23)" WORLD=2 ARMS=bf16 """
                            "bash benchmarks/scripts/run_convergence.sh OUT --share-gpu")
    conv = runs[1]
    assert conv.target.endswith("convergence.py") and conv.argv[-4:] == ["--seed", "0", "--threads", "1"]
    assert "--share-gpu" in conv.argv and conv.argv[conv.argv.index("--world-size") + 1] == "2"
