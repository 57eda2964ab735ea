"""Bytes per element of what each arm sends, from qzero's own formats and defaults.

A quantized payload of ``x`` elements is ``x·bits/8`` value bytes and one fp32 scale per
group (:meth:`qzero.quant.formats.QuantFormat.bytes_per_param`) over every element, and the
elements of small parameters once more, exactly, in the side channel in the source dtype (their
coded values are zeros: the layout of :func:`qzero.layout.gather_planner.aligned_layout`).
Sections are aligned to a few bytes each: not modelled. Formats and group sizes are the ones
:class:`qzero.ZeroConfig` resolves for each mode (its defaults, not constants of this model):
INT8 weights in groups of 64 (8.5 bits an element), INT4 weight differences in groups of 64
(4.5), INT8 gradients in groups of 64 (8.5), INT4 gradients in groups of 256 (4.125). A quantized
node stage (:attr:`qzero.ZeroConfig.zero_quantized_gradients_intra_node`) sends INT8 in groups of
``min(gradient group, 64)`` (8.5 bits), and its rail stage then carries small parameters in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ZeroConfig
from ..quant.formats import get_format
from ..vocabulary import INTRA_NODE_GROUP_SIZE


@dataclass(frozen=True)
class Payload:
    """A payload format: ``fmt`` and ``group_size``, or ``fmt=None`` for plain elements of
    ``plain_bytes`` each."""

    fmt: str | None
    group_size: int = 0
    plain_bytes: int = 2

    def bytes_per_element(self, exact_share: float = 0.0) -> float:
        """Average bytes an element of the flat buffer takes; ``exact_share`` of the elements
        (small parameters) travel exactly too, ``plain_bytes`` each."""
        if self.fmt is None:
            return float(self.plain_bytes)
        return get_format(self.fmt).bytes_per_param(self.group_size) + exact_share * self.plain_bytes

    @property
    def bits(self) -> float:
        return 8 * self.bytes_per_element()

    def describe(self) -> str:
        if self.fmt is None:
            return f"{8 * self.plain_bytes}-bit plain"
        return f"{self.fmt} g{self.group_size} ({self.bits:g} bits)"


def weight_payload(delta: bool, fmt: str | None = None, plain_bytes: int = 2) -> Payload:
    """The weight gather's payload of the quantized gather (with ``delta``: the differences),
    as ZeroConfig resolves it."""
    c = ZeroConfig(zero_quantized_weights=True, zero_quantized_weights_delta=delta,
                   zero_quantized_weights_format=fmt)
    return Payload(c.zero_quantized_weights_format, c.zero_quantized_weights_group_size, plain_bytes)


def gradient_payload(fmt: str, plain_bytes: int = 2) -> Payload:
    """The quantized gradient exchange's payload in format ``fmt``, as ZeroConfig resolves it."""
    c = ZeroConfig(zero_quantized_gradients=True, zero_quantized_gradients_format=fmt)
    return Payload(c.zero_quantized_gradients_format, c.zero_quantized_gradients_group_size, plain_bytes)


def plain(nbytes: int = 2) -> Payload:
    return Payload(None, 0, nbytes)


def intra_node_payload(gradients: Payload, fmt: str = "int8") -> Payload:
    """The quantized node stage's payload under the rail's ``gradients`` (groups capped as the
    reducer caps them; small parameters in the reduce dtype)."""
    return Payload(fmt, min(gradients.group_size, INTRA_NODE_GROUP_SIZE), gradients.plain_bytes)
