"""One vocabulary ([Note: vocabulary] in qzero/vocabulary.py): a setting has ZeroConfig's field
name wherever it is named, and every enumeration of values is defined once.

* the installers' keyword arguments (FSDP2, the DeepSpeed adapter, the HF callback) are
  ZeroConfig fields, with ZeroConfig's defaults (the DeepSpeed adapter's two documented
  exceptions aside);
* every ``zero_optimization`` key qzero reads is a ZeroConfig field, and the keys of earlier
  releases are refused, naming the new one;
* every ``qzero`` flag that sets a ZeroConfig field is that field with ``-`` for ``_``, the rest
  are workload flags; the flags of earlier releases are refused, naming the new one;
* no module of ``src/qzero`` but ``vocabulary.py`` spells out an enumeration of setting values.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib

import pytest

from qzero import vocabulary
from qzero.config import RENAMED_KEYS, ZeroConfig

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "qzero"
FIELDS = {f.name: f.default for f in dataclasses.fields(ZeroConfig)}


def settings_of(function) -> dict:
    """``{name: default}`` of ``function``'s keyword-only arguments that name a setting."""
    params = inspect.signature(function).parameters.values()
    return {p.name: p.default for p in params
            if p.kind is p.KEYWORD_ONLY and p.name not in ("mesh", "model", "enabled")}


def fsdp_installers():
    from qzero import fsdp

    return [fsdp.quantize_weight_gathers, fsdp.quantize_group_gathers, fsdp.quantize_group_reduces]


@pytest.mark.parametrize("name", ["quantize_weight_gathers", "quantize_group_gathers", "quantize_group_reduces"])
def test_fsdp_installers_take_zero_config_fields_with_its_defaults(name):
    import qzero.fsdp

    function = getattr(qzero.fsdp, name)
    settings = settings_of(function)
    assert settings and set(settings) <= set(FIELDS), sorted(set(settings) - set(FIELDS))
    for key, default in settings.items():
        assert default == FIELDS[key], f"{name}({key}={default!r}): ZeroConfig's default is {FIELDS[key]!r}"
    assert inspect.signature(function).parameters["model"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD


def test_deepspeed_adapter_takes_zero_config_fields():
    pytest.importorskip("deepspeed")
    from qzero.integrations import deepspeed as qds

    # the adapter's own defaults: DeepSpeed's bucket, and gather-ahead only when asked for
    own = {"allgather_bucket_size": None, "overlap_param_gather": False}
    callbacks = [qds.enable]
    try:
        from qzero.integrations.hf import QZeroCallback

        callbacks.append(QZeroCallback.__init__)
    except ImportError:  # pragma: no cover - transformers is in the test extra
        pass
    for function in callbacks:
        settings = settings_of(function)
        assert set(settings) <= set(FIELDS), (function, sorted(set(settings) - set(FIELDS)))
        for key, default in settings.items():
            assert default == own.get(key, FIELDS[key]), (function, key, default)
    fields = {f.name for f in dataclasses.fields(qds.QuantizedWeightsSettings)}
    assert fields == set(settings_of(qds.enable)), "the adapter's settings object and enable() name them alike"


def test_short_names_name_zero_config_fields():
    assert set(vocabulary.ZERO_ALIASES.values()) <= set(FIELDS)
    assert not set(vocabulary.ZERO_ALIASES) & set(FIELDS)


def test_every_deepspeed_key_qzero_reads_is_a_zero_config_field():
    from qzero.integrations import deepspeed_config as dc

    read = {dc.ENABLE_KEY, dc.GRAD_ENABLE_KEY, *dc.QZERO_KEYS, *dc.GRAD_KEYS, *dc.DELTA_KEYS}
    assert read <= set(FIELDS), sorted(read - set(FIELDS))
    assert set(RENAMED_KEYS.values()) <= set(FIELDS) and not set(RENAMED_KEYS) & set(FIELDS)


@pytest.mark.parametrize("old, new", sorted(RENAMED_KEYS.items()))
def test_a_renamed_deepspeed_key_is_refused_naming_the_new_one(old, new):
    from qzero.integrations.deepspeed_config import prepare_config

    config = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2, "zero_quantized_weights": True, old: 64}}
    for build in (lambda: prepare_config(config), lambda: ZeroConfig.from_dict(config["zero_optimization"])):
        with pytest.raises(ValueError) as e:
            build()
        message = str(e.value)
        assert f"{old} is now {new}" in message and f"did you mean {new}?" in message and "\n" not in message
    ZeroConfig.from_dict({new: 64})  # the new name works


def test_an_unknown_zero_optimization_key_gets_the_closest_name():
    with pytest.raises(ValueError, match="unknown zero_optimization key 'allgather_bucket'; did you mean "
                                         "allgather_bucket_size?"):
        ZeroConfig.from_dict({"allgather_bucket": 5e7})


# ---------------------------------------------------------------------- the qzero command

#: Flags of ``qzero train``/``qualify`` that are not ZeroConfig settings, by destination: the
#: workload (TrainSettings' fields), ``train --quantized`` (zero_quantized_weights, on by
#: default there: the command's switch), and the commands' own.
COMMAND_FLAGS = {"quantized", "out", "baseline", "candidate", "order", "repeats", "max_loss_diff", "tolerance",
                 "help", "renamed_flag"}


def _subparser(command: str):
    from qzero.app.cli import build_parser

    return build_parser()._subparsers._group_actions[0].choices[command]


@pytest.mark.parametrize("command", ["train", "qualify"])
def test_every_settings_flag_is_its_zero_config_field(command):
    from qzero.app.train import WORKLOAD_FIELDS

    for action in _subparser(command)._actions:
        flags = [s for s in action.option_strings if s.startswith("--") and not s.startswith("--no-")]
        if not flags:
            continue
        if action.dest in FIELDS:
            assert flags == ["--" + action.dest.replace("_", "-")], (flags, action.dest)
        else:
            assert action.dest in WORKLOAD_FIELDS or action.dest in COMMAND_FLAGS, (flags, action.dest)
            if action.dest == "renamed_flag":  # a flag of an earlier release: not a setting's spelling
                assert all(flag.lstrip("-").replace("-", "_") not in FIELDS for flag in flags)


def test_the_renamed_flags_are_refused_naming_the_new_one(capsys):
    from qzero.app.cli import RENAMED_FLAGS, main

    parser = _subparser("train")
    known = {s for a in parser._actions for s in a.option_strings if a.dest != "renamed_flag"}
    for old, new in RENAMED_FLAGS.items():
        assert new in known and old not in known, (old, new)
        assert main(["train", old, *(["1"] if not old.startswith("--no-") and "overlap" not in old else [])]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"qzero: error: {old} is now {new} ") and "\n" not in err, err


def test_cli_choices_are_the_vocabulary():
    parser = _subparser("train")
    choices = {a.dest: tuple(a.choices) for a in parser._actions if a.choices}
    assert choices["engine"] == vocabulary.BACKENDS
    assert choices["precision"] == vocabulary.PRECISIONS
    assert choices["zero_quantized_weights_format"] == vocabulary.WEIGHT_FORMATS
    assert choices["reduce_dtype"] == vocabulary.REDUCE_DTYPES


# ---------------------------------------------------------------------- each enumeration once


def test_each_enumeration_is_spelled_out_once():
    """No tuple, list or set of two or more setting values (formats, dtypes, backends, kernels,
    schedules, ...) in src/qzero outside vocabulary.py: everything imports them from there."""
    enums = {n: set(getattr(vocabulary, n)) for n in dir(vocabulary)
             if n.isupper() and isinstance(getattr(vocabulary, n), tuple)}
    assert {"WEIGHT_FORMATS", "BACKENDS", "PRECISIONS", "REDUCE_DTYPES", "KERNELS"} <= set(enums)
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "vocabulary.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) >= 2 and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
                values = {e.value for e in node.elts}
                hits = [n for n, s in enums.items() if len(values) >= 2 and values <= s]
                if hits:
                    found.append(f"{path.relative_to(SRC)}:{node.lineno}: {sorted(values)} (qzero.vocabulary.{hits[0]})")
    assert not found, "enumerations spelled out again:\n" + "\n".join(found)


def test_the_tables_that_describe_values_follow_the_vocabulary():
    from qzero.quant import KERNELS
    from qzero.quant.formats import FORMATS

    assert tuple(FORMATS) == vocabulary.WEIGHT_FORMATS
    assert set(vocabulary.DELTA_FORMATS) <= set(FORMATS) and set(vocabulary.GRADIENT_FORMATS) <= set(FORMATS)
    assert KERNELS is vocabulary.KERNELS
    from qzero.app.backends import make_backend

    source = inspect.getsource(make_backend)
    assert all(f'"{name}"' in source for name in vocabulary.BACKENDS)
