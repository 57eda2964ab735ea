"""Every example in examples/ trains on the CPU, on two gloo ranks, and its printed loss falls.

Each runs as ``torchrun --nproc_per_node=2 examples/X.py`` would run it (the environment
torchrun sets, :func:`distributed.run_script`), with fewer steps where the default is long,
and the loss it prints (one number per line) must end lower than it starts, by a margin.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _support.distributed import run_script

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

#: Per example: the extra arguments, the pattern of a printed loss, the least fall (first - last).
CASES = {
    "train_tiny.py": ([], r"^step\s+\d+\s+loss (\d+\.\d+)", 1.0),
    "deepspeed_zero2.py": ([], r"^steps\s+\d+-\s*\d+\s+loss (\d+\.\d+)", 0.5),
    "fsdp2_train.py": (["--steps", "6"], r"^step\s+\d+\s+loss (\d+\.\d+)", 1.0),
    "deepspeed_hf_trainer.py": (["--cpu", "--steps", "10"], r"'loss': '?(\d+\.\d+)'?", 0.3),
    "accelerate_fsdp2.py": (["--cpu-fsdp2"], r"^step\s+\d+\s+loss (\d+\.\d+)", 0.5),
    "lightning_model_parallel.py": ([], r"^step\s+\d+\s+loss (\d+\.\d+)", 0.5),
    "torchtitan_parallelize.py": ([], r"^step\s+\d+\s+loss (\d+\.\d+)", 0.5),
}
NEEDS = {"deepspeed_zero2.py": ["deepspeed"], "fsdp2_train.py": ["transformers"],
         "deepspeed_hf_trainer.py": ["deepspeed", "transformers", "accelerate"],
         "accelerate_fsdp2.py": ["accelerate", "transformers"], "lightning_model_parallel.py": ["lightning"],
         "torchtitan_parallelize.py": ["torchtitan.models.llama3"]}


def test_every_example_is_tested():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(CASES)


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
    assert losses_of("x {'loss': '4.274', 'grad_norm': '1.357'} y {'loss': 3.38, 'epoch': 1}",
                     CASES["deepspeed_hf_trainer.py"][1]) == [4.274, 3.38]
