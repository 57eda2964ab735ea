"""Every example in examples/ trains on the CPU, on two gloo ranks, and its printed loss falls.

Each runs as ``torchrun --nproc_per_node=2 examples/X.py`` would run it (the environment
torchrun sets, :func:`distributed.run_script`), with fewer steps where the default is long,
and the loss it prints (one number per line) must end lower than it starts, by a margin.
The examples for a framework's own trainer (Accelerate, the HF Trainer, Lightning,
torchtitan) are run in it by their framework's test, which checks the same
(``frameworks.assert_trains_like_plain``: the run without qzero learns, the one with it
stays within 1% of it); :data:`ELSEWHERE` names those tests.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from distributed import run_script

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

#: Per example: the extra arguments, the pattern of a printed loss, the least fall (first - last).
CASES = {
    "train_tiny.py": ([], r"^step\s+\d+\s+loss (\d+\.\d+)", 1.0),
    "deepspeed_zero2.py": ([], r"^steps\s+\d+-\s*\d+\s+loss (\d+\.\d+)", 0.5),
    "fsdp2_train.py": (["--steps", "6"], r"^step\s+\d+\s+loss (\d+\.\d+)", 1.0),
}
NEEDS = {"deepspeed_zero2.py": ["deepspeed"], "fsdp2_train.py": ["transformers"]}
#: Examples trained (and checked to learn) by another test, in their framework's trainer.
ELSEWHERE = {
    "accelerate_fsdp2.py": "test_frameworks_accelerate.py",
    "deepspeed_hf_trainer.py": "test_frameworks_hf.py",
    "lightning_model_parallel.py": "test_frameworks_lightning.py",
    "torchtitan_parallelize.py": "test_frameworks_torchtitan.py",
}


def test_every_example_is_tested():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted([*CASES, *ELSEWHERE])
    for example, test in ELSEWHERE.items():
        text = (ROOT / "tests" / test).read_text(encoding="utf-8")
        assert example in text and "assert_trains_like_plain" in text, (example, test)


def losses_of(output: str, pattern: str) -> list[float]:
    return [float(m.group(1)) for m in re.finditer(pattern, output, re.M)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_example_loss_falls(name, tmp_path):
    for module in NEEDS.get(name, []):
        pytest.importorskip(module)
    args, pattern, fall = CASES[name]
    results = run_script([str(EXAMPLES / name), *args], 2, timeout=900, cwd=tmp_path)
    for rank, (code, out) in enumerate(results):
        assert code == 0, f"{name} rank {rank} exited with {code}:\n{out[-4000:]}"
    out = results[0][1]
    losses = losses_of(out, pattern)
    assert len(losses) >= 2, f"{name} printed fewer than two losses:\n{out[-3000:]}"
    assert losses[-1] < losses[0] - fall, f"{name}: the loss did not fall by {fall}: {losses}"


def test_loss_patterns_read_what_the_examples_print():
    assert losses_of("step   0  loss 5.6272   153.7 ms\nstep  29  loss 3.3546", CASES["train_tiny.py"][1]) == [
        5.6272, 3.3546]
    assert losses_of("steps   0-  9  loss 2.9431  (chance: 2.7726)\nsteps  30- 39  loss 1.7410",
                     CASES["deepspeed_zero2.py"][1]) == [2.9431, 1.741]
