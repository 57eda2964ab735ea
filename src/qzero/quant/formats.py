"""Quantization formats: what a quantized value is, and how many bytes it takes.

A format is pure description. The arithmetic that turns fp32 values into stored
values lives in :mod:`qzero.quant.reference` (the specification) and in the fused
kernels, which must agree with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..vocabulary import WEIGHT_FORMATS

#: Scales are fp32, one per group.
SCALE_BYTES = 4
#: The payload's format and group size where none is given (``ZeroConfig``'s defaults, the
#: planner's, the reference quantizer's, the public gathers').
DEFAULT_FORMAT = "int8"
DEFAULT_GROUP_SIZE = 64


@dataclass(frozen=True)
class QuantFormat:
    """A symmetric group-wise format.

    ``qmax`` is the largest magnitude a stored value may take; a group's scale is
    ``absmax / qmax``. ``bits`` is the storage width of one value.
    """

    name: str
    bits: int
    qmax: float
    description: str

    def value_bytes(self, numel: int) -> int:
        """Bytes that ``numel`` stored values occupy (int4 packs two per byte)."""
        return (numel * self.bits + 7) // 8

    def bytes_per_param(self, group_size: int) -> float:
        """Average bytes sent per quantized parameter, scale included."""
        return self.bits / 8 + SCALE_BYTES / group_size


#: The formats of :data:`qzero.vocabulary.WEIGHT_FORMATS`, described.
FORMATS: dict[str, QuantFormat] = {f.name: f for f in (
    QuantFormat("int8", 8, 127.0, "symmetric INT8, round half to even"),
    QuantFormat("fp8", 8, 448.0, "FP8 e4m3 (finite, no NaN saturation) with a group scale"),
    QuantFormat("int4", 4, 7.0, "symmetric INT4, two values per byte, low nibble first"),
)}
if tuple(FORMATS) != WEIGHT_FORMATS:  # pragma: no cover - one table, one list of names
    raise ImportError(f"qzero.quant.formats describes {tuple(FORMATS)}, qzero.choices names {WEIGHT_FORMATS}")


def get_format(fmt: str) -> QuantFormat:
    """Look a format up by name; raise ``ValueError`` naming the bad value."""
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}; expected one of {sorted(FORMATS)}")
    return FORMATS[fmt]


def check_group_size(group_size: object, name: str = "group_size") -> int:
    """Group sizes are positive multiples of 8 (so int4 packing and vector loads stay aligned);
    ``name``: the setting the error names."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0 or group_size % 8:
        raise ValueError(f"{name} must be a positive multiple of 8, got {group_size!r}")
    return group_size
