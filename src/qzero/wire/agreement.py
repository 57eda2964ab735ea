"""What the ranks agree on before their first collective, in the form the exchange takes.

[Note: agreement]
Every public entry point of qzero that runs collectives (the two gathers, the
``ZeroOptimizer`` constructor, ``load_checkpoint``, the DeepSpeed adapter, the
``qzero.fsdp`` installers) first does all of its local work that can fail (argument
checks, planning, building the inner optimizer), catching *any* exception as this rank's
local error. Then every rank takes part in one exchange, :func:`qzero.wire.comm.agree_or_raise`:
a row of named 64-bit integers (the *fields*: settings, or digests of them) plus an ok flag.
A rank whose local work failed still sends its row (flag off), so the other ranks raise
too instead of waiting for it in a collective; when every rank is ok, any field that
differs raises on every rank, naming the field. Only after that does the real work start.
What enters the row is checked before the exchange (a value that does not fit 64 bits
becomes a local error, not an exception between two ranks' collectives).

A field may come with *details*: ``{key: text}`` strings saying what its digest covers
(one hyperparameter each, say). They are exchanged only when that field differs, so that
the error names the differing key and each rank's value.

This module turns values into those fields: :func:`canonical` writes a value as text that
is equal on two ranks exactly when the values are (floats by their exact bits; ints and
floats of the same value alike; lists and tuples alike), and :func:`digest` folds text into
a 63-bit field.
"""

from __future__ import annotations

import enum
import hashlib
import math
import numbers
import re

import torch

#: How many fields one exchange carries (the row has a fixed length on every rank).
MAX_FIELDS = 15
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
#: A tensor with more elements than this is written as a hash of its bytes, not its values.
_TENSOR_VALUES = 16


def digest(text: str | bytes) -> int:
    """A 63-bit fingerprint of ``text`` (non-negative, so it fits a signed 64-bit field)."""
    data = text.encode() if isinstance(text, str) else text
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def canonical(value) -> str:
    """``value`` as text that two ranks produce alike exactly when the values are equal.

    Floats are written by their shortest round-tripping repr (so ``0.1`` and the next
    float differ); a float with an integral value is written as that integer (``1.0``
    and ``1`` agree, and so do ``0.0`` and ``-0.0``); every NaN is ``nan``. Tensors are
    written with dtype, shape and values (or, past a few elements, a hash of their
    bytes); their device is left out. Objects of other types are written by their type
    and repr, with memory addresses removed.
    """
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        f = float(value)
        if math.isnan(f):
            return "nan"
        if f.is_integer() and abs(f) < 2**53:
            return str(int(f))
        return repr(f)
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(canonical(v) for v in value) + ")"
    if isinstance(value, dict):
        items = sorted((canonical(k), canonical(v)) for k, v in value.items())
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if isinstance(value, torch.Tensor):
        return _canonical_tensor(value)
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    kind = type(value)
    return f"{kind.__module__}.{kind.__qualname__}: {_ADDRESS.sub('', repr(value))}"


def _canonical_tensor(t: torch.Tensor) -> str:
    head = f"tensor({str(t.dtype).removeprefix('torch.')}, shape {tuple(t.shape)}"
    if t.device.type == "meta":
        return head + ", no values)"
    t = t.detach()
    if t.numel() <= _TENSOR_VALUES:
        return head + ", " + canonical(t.cpu().reshape(-1).tolist()) + ")"
    data = t.cpu().contiguous().reshape(-1).view(torch.uint8)
    return head + f", bytes {hashlib.blake2b(bytes(data.numpy()), digest_size=8).hexdigest()})"


def class_name(obj) -> str:
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


HYPERPARAMETER = "a hyperparameter of the inner optimizer"


def optimizer_fields(inner: torch.optim.Optimizer) -> tuple[dict[str, int], dict[str, dict[str, str]]]:
    """The fields (and their details) of an inner optimizer as constructed: its class, and
    every hyperparameter of every parameter group (the ``params`` excepted)."""
    hyper = {
        f"param group {i} {key!r}": canonical(value)
        for i, group in enumerate(inner.param_groups)
        for key, value in sorted(group.items())
        if key != "params"
    }
    hyper["param groups"] = str(len(inner.param_groups))
    cls = {"": class_name(inner)}
    fields = {
        "inner optimizer class": digest(cls[""]),
        HYPERPARAMETER: digest(repr(sorted(hyper.items()))),
    }
    return fields, {"inner optimizer class": cls, HYPERPARAMETER: hyper}


def check_fields(fields: dict[str, int], what: str) -> None:
    """What may enter an exchange: at most :data:`MAX_FIELDS` named integers of 64 bits."""
    if len(fields) > MAX_FIELDS:
        raise ValueError(f"{what}: {len(fields)} fields to agree on, at most {MAX_FIELDS} fit")
    for name, value in fields.items():
        if not isinstance(value, numbers.Integral):
            raise TypeError(f"{what}: {name} must be an integer, got {type(value).__name__} {_short(repr(value))}")
        if not INT64_MIN <= int(value) <= INT64_MAX:
            raise ValueError(f"{what}: {name} {_short(str(int(value)))} is out of range: it must fit in a signed "
                             "64-bit integer (at most 2**63 - 1)")


def describe_mismatch(name: str, details_by_rank: list[dict[str, str]], limit: int = 3) -> str:
    """``name differs between ranks: ...`` naming up to ``limit`` differing keys and every
    rank's value of each (ranks with the same value listed together)."""
    keys = []
    for d in details_by_rank:
        keys += [k for k in d if k not in keys]
    parts = []
    for key in keys:
        values = [d.get(key, "(absent)") for d in details_by_rank]
        if len(set(values)) == 1:
            continue
        by_value: dict[str, list[int]] = {}
        for r, v in enumerate(values):
            by_value.setdefault(v, []).append(r)
        said = ", ".join(f"{_short(v)} ({'rank' if len(rs) == 1 else 'ranks'} {', '.join(map(str, rs))})"
                         for v, rs in by_value.items())
        parts.append(f"{key}: {said}" if key else said)
        if len(parts) == limit:
            break
    if not parts:  # the digests differ but the texts do not (cannot happen for equal code on every rank)
        return f"{name} differs between ranks"
    return f"{name} differs between ranks: " + "; ".join(parts)


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
