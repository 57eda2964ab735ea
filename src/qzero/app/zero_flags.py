"""The ``qzero`` command's ZeRO flags: one per :class:`qzero.ZeroConfig` field, generated from it.

A field's flag is its name with ``-`` for ``_`` ([Note: vocabulary] in qzero/vocabulary.py); its
type, choices and help come from the field (its annotation, ``qzero.vocabulary.SETTING_VALUES``
and the first sentence of its documentation: [Note: fields from the source] in zero_fields.py),
so that a field added to ZeroConfig is a flag at once. Every flag defaults to "not given": a
setting the command leaves alone takes ZeroConfig's default (or the command's own, where it has
one: ``notes``).
"""

from __future__ import annotations

import argparse
import math

from ..vocabulary import SETTING_VALUES
from .zero_fields import Field, zero_fields

#: The settings a quantized part of the exchange refines, by the switch that turns that part on
#: (longest first: a delta setting needs the delta switch, which needs the quantized gather).
SWITCHES = ("zero_quantized_weights_delta", "zero_quantized_weights", "zero_quantized_gradients")


def switch_of(name: str) -> str | None:
    """The ZeroConfig switch whose part ``name`` refines (``zero_quantized_weights_format`` ->
    ``zero_quantized_weights``); None for a setting of no such part."""
    return next((s for s in SWITCHES if name.startswith(s + "_")), None)


def integer(text: str) -> int:
    """An integer, also written as an integral float (``5e8``), as DeepSpeed configs write sizes."""
    try:
        return int(text)
    except ValueError:
        value = float(text)  # a ValueError here: argparse's "invalid integer value"
        if not math.isfinite(value) or not value.is_integer():
            raise ValueError(text) from None
        return int(value)


def number(text: str) -> float:
    """A finite number."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


def _default_text(field: Field, notes: dict[str, str]) -> str:
    if field.name in notes:
        return notes[field.name]
    if field.default is None:
        return "resolved from the other settings: docs/settings.md"
    if isinstance(field.default, bool):
        return "on" if field.default else "off"
    return f"{field.default:,}" if isinstance(field.default, int) and field.default >= 10_000 else f"{field.default}"


def add_zero_flags(group: argparse._ArgumentGroup, notes: dict[str, str] | None = None) -> None:
    """Add one flag per ZeroConfig field to ``group``; ``notes``: the command's own word on a
    field's default, by field name."""
    notes = notes or {}
    for field in zero_fields():
        kind = field.kind
        help_text = f"{field.summary()} (default: {_default_text(field, notes)})".replace("%", "%%")
        if field.name in SETTING_VALUES:  # named values first: a field may take a bool or a name
            group.add_argument(field.flag, choices=SETTING_VALUES[field.name], help=help_text)
        elif kind == "bool":
            group.add_argument(field.flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif kind == "int":
            group.add_argument(field.flag, type=integer, metavar="N", help=help_text)
        elif kind == "float":
            group.add_argument(field.flag, type=number, metavar="X", help=help_text)
        else:  # a test keeps every str field in SETTING_VALUES; a new one still gets a flag
            group.add_argument(field.flag, metavar="VALUE", help=help_text)
