"""ZeroOptimizer's refusals of a user's mistakes at construction: one clear error, before any work."""

from __future__ import annotations

import functools

import pytest
import torch

import qzero

ADAM = functools.partial(torch.optim.AdamW, lr=1e-3)


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).bfloat16()


def test_world_size_one_is_refused_where_the_launcher_says_more(monkeypatch):
    """Under ``torchrun --nproc_per_node=2`` without ``init_process_group`` each process would
    train a model of its own at world size 1; refused, naming init_process_group."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE=2 .*init_process_group\(\)") as e:
        qzero.ZeroOptimizer(_model(), ADAM)
    assert "\n" not in str(e.value)
    monkeypatch.setenv("WORLD_SIZE", "1")
    qzero.ZeroOptimizer(_model(), ADAM)  # a launcher's single rank is world size 1, rightly


def test_a_meta_model_is_refused_at_construction():
    with torch.device("meta"):
        model = _model()
    with pytest.raises(ValueError, match=r"parameter '0.weight' is on the meta device .*to_empty"):
        qzero.ZeroOptimizer(model, ADAM)


def test_a_string_hyperparameter_is_refused_by_name():
    for factory, groups in ((functools.partial(torch.optim.AdamW, lr="1e-3"), None),
                            (ADAM, "group")):
        model = _model()
        param_groups = [{"params": list(model.parameters()), "lr": "1e-3"}] if groups else None
        with pytest.raises(TypeError, match=r"the optimizer's lr='1e-3' is a string: give a number"):
            qzero.ZeroOptimizer(model, factory, param_groups=param_groups)
    with pytest.raises(TypeError, match=r"betas=\('0.9', 0.99\) is a string"):
        qzero.ZeroOptimizer(_model(), functools.partial(torch.optim.AdamW, betas=("0.9", 0.99)))


def test_an_error_of_the_optimizer_factory_is_the_users_with_one_line_of_ours():
    class Broken(Exception):
        pass

    def factory(groups):
        raise Broken("my factory's own message")

    with pytest.raises(ValueError,
                       match=r"the optimizer factory .*factory raised Broken .*my factory's own message") as e:
        qzero.ZeroOptimizer(_model(), factory)
    assert isinstance(e.value.__cause__, Broken)
