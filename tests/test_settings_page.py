"""One source for every setting: the ``qzero`` command's ZeRO flags and ``docs/settings.md`` are
generated from ZeroConfig's fields ([Note: fields from the source] in qzero/app/zero_fields.py)."""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import subprocess
import sys

import pytest

from qzero import vocabulary
from qzero.app import settings_page
from qzero.app.zero_fields import zero_fields
from qzero.config import ZeroConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_fields_read_from_the_source_are_zero_configs():
    read = [(f.name, f.annotation, f.default) for f in zero_fields()]
    real = [(f.name, f.type, f.default) for f in dataclasses.fields(ZeroConfig)]
    assert read == real
    assert all(f.doc for f in zero_fields()), [f.name for f in zero_fields() if not f.doc]
    named = [f.name for f in zero_fields() if f.kind == "str"]
    assert sorted(named) == sorted(vocabulary.SETTING_VALUES), "every named-value field lists its values"


def test_the_committed_settings_page_is_generated_from_zero_config():
    committed = (ROOT / settings_page.PAGE).read_text()
    assert committed == settings_page.render(), ("docs/settings.md is out of date: run "
                                                 "python -m qzero.app.settings_page")


def _zero_actions(command: str) -> dict[str, argparse.Action]:
    from qzero.app.cli import build_parser

    parser = build_parser()._subparsers._group_actions[0].choices[command]
    fields = {f.name for f in zero_fields()}
    return {a.dest: a for a in parser._actions if a.dest in fields and a.option_strings}


@pytest.mark.parametrize("command", ["train", "qualify"])
def test_every_zero_config_field_is_a_flag_of_its_type(command):
    actions = _zero_actions(command)
    assert set(actions) == {f.name for f in zero_fields()}
    for f in zero_fields():
        action = actions[f.name]
        assert f.flag in action.option_strings and action.default is None, f.name
        if f.kind == "bool":
            assert isinstance(action, argparse.BooleanOptionalAction), f.name
        elif f.name in vocabulary.SETTING_VALUES:
            assert tuple(action.choices) == vocabulary.SETTING_VALUES[f.name], f.name
        else:
            value = 64 if f.default is None else f.default
            assert action.type(str(value)) == value and type(action.type(str(value))) is type(value), f.name


def test_settings_the_command_did_not_have_are_flags_now():
    """``qualify --zero-quantized-gradients`` was unrecognized and ``train`` could not quantize
    gradients: every field is a flag, and it reaches the arm's ZeroConfig."""
    import qzero.app.cli as cli

    args = cli.build_parser().parse_args(["train", "--zero-quantized-gradients", "--zero-quantized-gradients-format",
                                          "int4", "--allgather-bucket-size", "5e7", "--no-sliced-update"])
    zero = cli._train_settings(args).zero
    assert (zero.zero_quantized_gradients, zero.zero_quantized_gradients_format) == (True, "int4")
    assert (zero.allgather_bucket_size, zero.sliced_update) == (50_000_000, False)
    _, b, c = cli._qualify_arms(cli.build_parser().parse_args(
        ["qualify", "--zero-quantized-gradients", "--zero-quantized-weights-format", "int4"]))
    assert b.zero.zero_quantized_gradients and c.zero.zero_quantized_gradients
    # a setting of the quantized gather applies to the arm that runs it
    assert (b.zero.zero_quantized_weights_format, c.zero.zero_quantized_weights_format) == ("int8", "int4")


def test_help_stays_free_of_torch_with_generated_flags():
    code = ("import sys\nfrom qzero.app.cli import main\ntry:\n    main(['qualify', '--help'])\nexcept SystemExit:\n"
            "    pass\nprint('torch imported:', 'torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT / "src"), "PATH": ""})
    assert "--zero-quantized-gradients-error-feedback" in res.stdout
    assert res.stdout.strip().endswith("torch imported: False"), res.stdout[-500:] + res.stderr[-2000:]
