"""What the docs say about the library, checked against it (claims a snippet cannot show by running)."""

from __future__ import annotations

import functools
import pathlib


import pytest
import torch

import qzero

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_quickstart_says_what_the_plain_and_quantized_gathers_take_of_fp32():
    """docs/quickstart.md: the quantized gather refuses an fp32 model; the plain gather takes it."""
    text = " ".join((ROOT / "docs" / "quickstart.md").read_text().split())
    assert "an fp32 model is refused." not in text
    assert "The quantized gather needs bf16 or fp16" in text and "the plain gather takes fp32 too" in text
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    adam = functools.partial(torch.optim.AdamW, lr=1e-3)
    opt = qzero.ZeroOptimizer(model, adam, config=qzero.ZeroConfig())
    opt.backward(model(torch.randn(2, 16)).sum())
    assert opt.step() is not False
    with pytest.raises(ValueError, match="zero_quantized_weights needs bf16 or fp16 parameters, got fp32"):
        qzero.ZeroOptimizer(torch.nn.Linear(16, 16), adam, config=qzero.ZeroConfig(zero_quantized_weights=True))


def test_the_torchtitan_extra_brings_triton_and_its_page_says_so():
    """torchtitan's models import triton, which a CPU build of torch does not bring."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("triton") for req in extras["torchtitan"]), extras["torchtitan"]
    page = " ".join((ROOT / "docs" / "torchtitan.md").read_text().split())
    assert 'pip install -e ".[torchtitan]"' in page and "`triton`, which torchtitan's models import" in page
