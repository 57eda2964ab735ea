"""One vocabulary ([Note: vocabulary] in qzero/vocabulary.py): a setting has ZeroConfig's field
name wherever it is named, and every enumeration of values is defined once.

* the installers' keyword arguments (FSDP2, the DeepSpeed adapter, the HF callback) are
  ZeroConfig fields, with ZeroConfig's defaults (the DeepSpeed adapter's two documented
  exceptions aside);
* every keyword argument of the public API (the gathers, the planners, the FSDP2 installers and
  communication objects, the DeepSpeed adapter) that names a setting is a ZeroConfig field, or
  one of a few short names listed here; the keywords of earlier releases are refused, naming
  the new one;
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


# ---------------------------------------------------------------------- the public API's keywords

#: Keyword arguments of the public API that name no setting: the data, the process group, the
#: model, the optimizer, the settings object itself and the plan's shape.
NOT_SETTINGS = {"flat", "group", "process_group", "exact_ranges", "numel", "world_size", "elem_size", "shapes",
                "alignment", "model", "mesh", "enabled", "name", "fsdp_params", "target", "param_groups",
                "optimizer", "config"}
#: Public keywords that are neither ZeroConfig fields nor NOT_SETTINGS, by callable: none. (The
#: public gathers' and planners' short keywords, ``fmt``, ``group_size``, ``order`` and ``delta``,
#: are refused now, naming the field: RENAMED_GATHER_KEYWORDS.)
SHORT_KEYWORDS: dict[str, set[str]] = {}


def public_callables() -> dict:
    """``{name: callable}`` of the public API whose keywords name settings."""
    import qzero
    import qzero.fsdp
    from qzero.fsdp.group import GroupQuantizedAllGather
    from qzero.fsdp.reduce import GroupQuantizedReduceScatter

    out = {name: getattr(qzero, name) for name in ("all_gather", "quantized_all_gather", "plan_gather",
                                                   "plan_flat_layout", "ZeroOptimizer")}
    out.update({name: getattr(qzero.fsdp, name) for name in qzero.fsdp.__all__
                if name.startswith("quantize_")})
    out.update(GroupQuantizedAllGather=GroupQuantizedAllGather, GroupQuantizedReduceScatter=GroupQuantizedReduceScatter)
    try:
        from qzero.integrations import deepspeed as qds
        from qzero.integrations.hf import QZeroCallback
    except ImportError:  # pragma: no cover - deepspeed and transformers are in the test extra
        return out
    out.update(enable=qds.enable, QZeroCallback=QZeroCallback)
    return out


def keywords_of(obj) -> list[str]:
    """The keyword-passable parameters of a function or a class's constructor (``**`` ones aside)."""
    params = inspect.signature(obj).parameters.values()
    return [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self"]


def test_public_keywords_are_zero_config_fields():
    """Scan the public signatures: a keyword that is neither a ZeroConfig field nor one of the
    arguments that name no setting is a setting named another way (``bucket_numel``, ``kernels``,
    ``rotation``, ...), unless it is one of the few short names listed above."""
    found = []
    for name, obj in public_callables().items():
        for key in keywords_of(obj):
            if key not in FIELDS and key not in NOT_SETTINGS and key not in SHORT_KEYWORDS.get(name, ()):
                found.append(f"{name}({key}=)")
    assert not found, "keywords that name a setting otherwise than ZeroConfig: " + ", ".join(found)
    for name, keys in SHORT_KEYWORDS.items():  # the list holds nothing stale
        assert keys <= set(keywords_of(public_callables()[name])), name


def test_the_fsdp2_communication_objects_take_zero_config_fields_only():
    """FSDP2's all-gather and reduce-scatter objects are named by ZeroConfig's full names, never
    the short ones the installers also take."""
    from qzero.fsdp.group import GroupQuantizedAllGather
    from qzero.fsdp.reduce import GroupQuantizedReduceScatter

    for cls in (GroupQuantizedAllGather, GroupQuantizedReduceScatter):
        settings = set(keywords_of(cls)) - NOT_SETTINGS
        assert settings <= set(FIELDS), sorted(settings - set(FIELDS))
    gather = GroupQuantizedAllGather([], zero_quantized_weights_group_size=32, zero_quantized_weights_format="int4",
                                     small_param_numel=7, quant_kernels="reference", name="layer")
    assert (gather.zero_quantized_weights_group_size, gather.zero_quantized_weights_format, gather.small_param_numel,
            gather.quant_kernels) == (32, "int4", 7, "reference")
    reduce = GroupQuantizedReduceScatter([], zero_quantized_gradients_group_size=64,
                                         zero_quantized_gradients_format="int8",
                                         small_param_numel=7, quant_kernels="reference", name="layer",
                                         zero_quantized_gradients_rotation="hadamard",
                                         zero_quantized_gradients_rotation_block=16)
    assert reduce.rotation_block == 16
    assert GroupQuantizedReduceScatter([], zero_quantized_gradients_group_size=64,
                                       zero_quantized_gradients_format="int8", small_param_numel=7,
                                       quant_kernels="reference", name="").rotation_block == 0  # none by default


def _renamed_cases():
    from qzero.app.train import TrainSettings

    objects = {**public_callables(), "TrainSettings": TrainSettings}
    cases = []
    for name, obj in objects.items():
        table = getattr(obj.__init__ if isinstance(obj, type) else obj, "renamed_keywords", {})
        cases += [(name, obj, old, new) for old, new in table.items()]
    return cases


def test_the_renamed_keywords_are_the_expected_ones():
    found = {(name, old, new) for name, _, old, new in _renamed_cases()}
    for name in ("all_gather", "quantized_all_gather", "plan_gather", "plan_flat_layout"):
        assert (name, "bucket_numel", "allgather_bucket_size") in found
    # the public gathers' and planners' short keywords of earlier releases, where the function takes the field
    weights = {("fmt", "zero_quantized_weights_format"), ("group_size", "zero_quantized_weights_group_size")}
    delta = {("delta", "zero_quantized_weights_delta")}
    small = {("zero_quantized_weights_small_param_numel", "small_param_numel")}
    expected = {"all_gather": set(), "quantized_all_gather": weights, "plan_gather": weights | delta,
                "plan_flat_layout": weights | delta | small | {("order", "flat_order")}}
    for name, pairs in expected.items():
        assert {(old, new) for n, old, new in found if n == name and old != "bucket_numel"} == pairs, name
    assert ("TrainSettings", "engine", "backend") in found
    for name, switch in (("GroupQuantizedAllGather", "weights"), ("GroupQuantizedReduceScatter", "gradients")):
        assert {(name, "group_size", f"zero_quantized_{switch}_group_size"),
                (name, "fmt", f"zero_quantized_{switch}_format"), (name, "kernels", "quant_kernels")} <= found


@pytest.mark.parametrize("name, obj, old, new", _renamed_cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_a_renamed_keyword_is_refused_naming_the_new_one(name, obj, old, new):
    with pytest.raises(TypeError) as e:
        obj(**{old: 1})  # refused before anything else is looked at (the other arguments are missing)
    message = str(e.value)
    assert message.startswith(f"{name}() got an unexpected keyword argument {old!r}; did you mean {new}=?")
    assert f"{old} of earlier releases is now {new}" in message and "\n" not in message


def test_the_old_small_param_keyword_names_small_param_numel_everywhere():
    """``zero_quantized_weights_small_param_numel=`` (the key of earlier releases) given to the
    installers, the HF callback or the DeepSpeed adapter's ``enable`` names ``small_param_numel=``,
    not the closest-spelled field."""
    import torch

    from qzero.config import keyword_settings
    from qzero.fsdp import quantize_weight_gathers
    from qzero.integrations.deepspeed import enable
    from qzero.integrations.hf import QZeroCallback

    old = "zero_quantized_weights_small_param_numel"
    # enable() reads its keywords once it has found DeepSpeed's optimizer, as below
    given = {"zero_quantized_weights_format": None, "small_param_numel": 0}
    calls = [lambda: quantize_weight_gathers(torch.nn.Linear(4, 4), **{old: 5}),
             lambda: QZeroCallback(**{old: 5}),
             lambda: keyword_settings(enable, given, {old: 5}, vocabulary.RENAMED_GATHER_KEYWORDS)]
    for call in calls:
        with pytest.raises(TypeError, match=f"{old}'; did you mean small_param_numel=") as e:
            call()
        assert "zero_quantized_weights_format" not in str(e.value)


@pytest.mark.parametrize("old, new, value", [("fmt", "zero_quantized_weights_format", "int4"),
                                             ("group_size", "zero_quantized_weights_group_size", 32),
                                             ("delta", "zero_quantized_weights_delta", True),
                                             ("order", "flat_order", "interleaved")])
def test_the_planners_refuse_their_short_keywords_and_take_zero_config_fields(old, new, value):
    """``plan_gather``/``plan_flat_layout`` (and ``quantized_all_gather``, for the format and the
    group size) refuse the keywords of earlier releases by name, with a valid value, before any
    work; the ZeroConfig field plans the same thing the short keyword did."""
    import torch

    import qzero

    fmt = {"zero_quantized_weights_format": "int4"} if new == "zero_quantized_weights_delta" else {}
    calls = {"plan_flat_layout": lambda **kw: qzero.plan_flat_layout([(512,), (8,)], 2, **fmt, **kw)}
    if new != "flat_order":
        calls["plan_gather"] = lambda **kw: qzero.plan_gather(1024, 2, exact_ranges=[(0, 8)], **fmt, **kw)
    if new in ("zero_quantized_weights_format", "zero_quantized_weights_group_size"):
        flat = torch.zeros(256, dtype=torch.bfloat16)
        calls["quantized_all_gather"] = lambda **kw: qzero.quantized_all_gather(flat, **kw)
    for name, call in calls.items():
        with pytest.raises(TypeError, match=rf"^{name}\(\) got an unexpected keyword argument '{old}'; did you mean "
                                            rf"{new}=\? \({old} of earlier releases is now {new}\)$"):
            call(**{old: value})
        call(**{new: value})  # the new name works
    plan = qzero.plan_flat_layout([(512,), (8,)], 2, **fmt, **{new: value})
    default = qzero.plan_flat_layout([(512,), (8,)], 2, **fmt)
    assert plan != default  # the setting reached the plan
    assert (plan.gather.fmt, plan.gather.group_size, plan.gather.delta, plan.order)[
        ["zero_quantized_weights_format", "zero_quantized_weights_group_size", "zero_quantized_weights_delta",
         "flat_order"].index(new)] == value


def test_the_planners_errors_name_zero_config_fields():
    import qzero

    cases = [(dict(zero_quantized_weights_group_size=12), r"^zero_quantized_weights_group_size must be a positive "
                                                          r"multiple of 8, got 12$"),
             (dict(zero_quantized_weights_format="int2"), r"^zero_quantized_weights_format: unknown quantization "
                                                          r"format 'int2'"),
             (dict(zero_quantized_weights_format="fp8", zero_quantized_weights_delta=True),
              r"^zero_quantized_weights_delta: a delta payload is one of the formats \['int4', 'int8'\], got "
              r"zero_quantized_weights_format='fp8'$")]
    for kwargs, match in cases:
        for plan in (lambda **kw: qzero.plan_gather(1024, 2, **kw),
                     lambda **kw: qzero.plan_flat_layout([(512,)], 2, **kw)):
            with pytest.raises(ValueError, match=match):
                plan(**kwargs)
    with pytest.raises(ValueError, match=r"^flat_order must be one of \('auto', 'contiguous', 'interleaved'\), got "
                                         r"'zigzag'$"):
        qzero.plan_flat_layout([(512,)], 2, flat_order="zigzag")


def test_the_public_gathers_refuse_bucket_numel_before_any_work():
    import torch

    import qzero

    flat = torch.zeros(128, dtype=torch.bfloat16)
    for gather in (qzero.all_gather, qzero.quantized_all_gather):
        with pytest.raises(TypeError, match=r"'bucket_numel'; did you mean allgather_bucket_size=\?"):
            gather(flat, bucket_numel=1 << 20)
    assert qzero.all_gather(flat, allgather_bucket_size=1 << 20).num_chunks == 1  # one rank: the new name works
    with pytest.raises(ValueError, match=r"^allgather_bucket_size 64 is smaller than one group per rank \(2 x 64"):
        qzero.plan_gather(256, 2, allgather_bucket_size=64)  # the planner's errors name the user's keyword
    assert qzero.plan_flat_layout([(512,)], 2, allgather_bucket_size=256).gather.allgather_bucket_size == 256


# ---------------------------------------------------------------------- the workload's settings


def test_the_backend_setting_is_named_backend_and_engine_is_refused(capsys):
    from qzero.app.cli import main
    from qzero.app.train import TrainSettings, flat_settings, setting_name, settings_from

    assert TrainSettings(backend="fsdp2").backend == "fsdp2"
    assert settings_from({"backend": "deepspeed"}).backend == "deepspeed"
    for build in (lambda: setting_name("engine"), lambda: settings_from({"engine": "fsdp2"})):
        with pytest.raises(ValueError, match=r"^setting 'engine' is now 'backend' .*did you mean backend\?$"):
            build()
    assert main(["qualify", "--candidate", "engine=deepspeed"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qzero: error: --candidate 'engine=deepspeed': setting 'engine' is now 'backend'"), err
    assert "\n" not in err
    assert main(["train", "--engine", "fsdp2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "qzero: error: --engine is now --backend (the training backend: qzero, deepspeed, fsdp2)", err
    # a record of an earlier release (its settings name the backend "engine") still reads
    old = {k: v for k, v in flat_settings(TrainSettings(backend="fsdp2")).items() if k != "backend"}
    assert flat_settings({"engine": "fsdp2", **old})["backend"] == "fsdp2"


# ---------------------------------------------------------------------- the qzero command

#: Flags of ``qzero train``/``qualify`` that are not ZeroConfig settings, by destination: the
#: workload (TrainSettings' fields), ``train --quantized`` (zero_quantized_weights, on by
#: default there: the command's switch), and the commands' own.
COMMAND_FLAGS = {"quantized", "out", "oversubscribe", "force", "baseline", "candidate", "order", "repeats",
                 "max_loss_diff", "tolerance", "help", "renamed_flag"}


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
    assert choices["backend"] == vocabulary.BACKENDS
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
                    found.append(f"{path.relative_to(SRC)}:{node.lineno}: {sorted(values)} "
                                 f"(qzero.vocabulary.{hits[0]})")
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
