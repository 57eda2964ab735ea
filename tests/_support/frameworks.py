"""What the framework tests (tests/test_frameworks_*.py) check alike: a run's per-step losses
against the same example without qzero, and that a quantized-gather report names exactly the
parameters that travel quantized."""

from __future__ import annotations

import importlib.util
import os
import sys

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "examples")


def load_example(name: str):
    """``examples/<name>.py`` as module ``name`` (registered in ``sys.modules``, loaded once)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def assert_trains_like_plain(run: list[float], plain: list[float], steps: int, what: str) -> None:
    """Every step's loss within 1% of plain's, not bit-identical (something was quantized),
    and plain learnt (so the 1% is a statement about training)."""
    assert len(run) == len(plain) == steps, f"{what}: {len(run)} and {len(plain)} losses for {steps} steps"
    assert run != plain, f"{what}: bit-identical to the run without qzero: nothing was quantized"
    for step, (a, b) in enumerate(zip(run, plain)):
        assert abs(a - b) <= 0.01 * b, f"{what} step {step}: loss {a:.4f} vs {b:.4f} without qzero"
    assert plain[-1] < 0.9 * plain[0], f"{what}: the run without qzero did not learn ({plain})"


def gather_facts(model, report) -> dict:
    """A quantize_weight_gathers report next to the parameters wrapped now (picklable)."""
    from qzero.fsdp.guards import wrapped_in

    return dict(
        quantized=() if report is None else tuple(report.quantized),
        plain=() if report is None else tuple(report.plain),
        not_gathered=tuple(getattr(report, "not_gathered", ())),
        wrapped=sorted(n for n, p in model.named_parameters() if wrapped_in(p) is not None),
    )


def assert_report_is_what_travels(facts: dict) -> None:
    assert len(facts["quantized"]) > 10 and sorted(facts["quantized"]) == facts["wrapped"]
    assert not facts["not_gathered"]
    assert not any(why.startswith("stripped") for _, why in facts["plain"])
