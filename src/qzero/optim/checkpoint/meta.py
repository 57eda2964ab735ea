"""``qzero.json``: a checkpoint's own metadata file, written last and read as untrusted input.

It records, per parameter group, the parameter names and shapes, the optimizer state's keys
(dtype, shape, sharded or not) and the hyperparameters, plus the loss scaler and the module
state (:func:`qzero.optim.checkpoint.save.save_checkpoint` writes it; its presence marks a
complete checkpoint). Read bounded (no link, no FIFO, at most :data:`MAX_META_BYTES`), as JSON
nested at most :data:`MAX_META_DEPTH` deep with integers inside 64 bits, then checked field by
field against its schema: a refusal is a ``ValueError`` naming the field. What it is checked
against (the optimizer loading it) is :mod:`qzero.optim.checkpoint.checks`'s.
"""

from __future__ import annotations

import json
import math
import os

import torch

from . import residuals
from .index import read_regular_file, show

META_FILE = "qzero.json"
FORMAT_VERSION = 1

#: The largest ``qzero.json`` read (a genuine one holds about 100 bytes per parameter).
MAX_META_BYTES = 16 << 20
#: How deeply ``qzero.json`` may nest (a genuine one: 6 levels).
MAX_META_DEPTH = 16


def read_metadata(path: str) -> dict:
    """``qzero.json`` of the checkpoint at ``path``, checked field by field."""
    if not os.path.lexists(os.path.join(path, META_FILE)):
        raise ValueError(f"{path!r} is not a qzero checkpoint: {META_FILE} is missing")
    raw = read_regular_file(path, META_FILE, MAX_META_BYTES, repr(path))
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, ValueError) as e:
        raise ValueError(f"{path!r}: {META_FILE} is not valid JSON ({type(e).__name__}: {show(str(e))})") from None
    _check_plain(meta, path)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{path!r}: checkpoint format {show(got)} is not {FORMAT_VERSION}")
    _check_schema(meta, path)
    return meta


def _field(parts: tuple) -> str:
    """A field of qzero.json by its path, for a message: ``groups[0].state.step``."""
    out = ""
    for p in parts[:MAX_META_DEPTH + 1]:
        if isinstance(p, int):
            out += f"[{p}]"
        elif p.isidentifier() and len(p) <= 40:
            out += f".{p}" if out else p
        else:
            out += f"[{show(p, 40)}]"
    return out + ("..." if len(parts) > MAX_META_DEPTH + 1 else "")


def _check_plain(meta, path: str) -> None:
    """Every value nests at most :data:`MAX_META_DEPTH` deep and every integer fits 64 bits
    (walked without recursion), so nothing later recurses or overflows on it."""
    stack = [((), meta)]
    while stack:
        parts, v = stack.pop()
        if len(parts) > MAX_META_DEPTH:
            raise ValueError(f"{path!r}: {META_FILE} {_field(parts)} is nested deeper than {MAX_META_DEPTH} levels")
        if type(v) is int and not -(2**63) <= v < 2**63:
            raise ValueError(f"{path!r}: {META_FILE} {_field(parts)} is {show(v)}, an integer outside 64 bits")
        if type(v) is dict:
            stack.extend((parts + (k,), x) for k, x in v.items())
        elif type(v) is list:
            stack.extend((parts + (i,), x) for i, x in enumerate(v))


#: Dtypes a checkpoint's optimizer state may declare (resolved by this table, never by getattr).
STATE_DTYPES = {
    name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8")
}
_SCHEMA = {"optimizer": str, "module_state": dict, "loss_scaler": dict, "groups": list, "world_size": int}
_GROUP_SCHEMA = {"names": list, "shapes": list, "used_numel": int, "state": dict, "hyperparameters": dict}
_SCALER_INTS = ("clean_steps", "hysteresis_left", "skipped_steps")


def _check_schema(meta: dict, path: str) -> None:
    """Every field load_checkpoint reads is present and of the right type."""

    def fail(field: tuple, v, expected: str) -> ValueError:
        return ValueError(f"{path!r}: {META_FILE} {_field(field)} is {show(v)}, expected {expected}")

    def need(obj: dict, schema: dict, at: tuple) -> None:
        for key, kind in schema.items():
            if not isinstance(obj.get(key), kind):
                raise ValueError(
                    f"{path!r}: {META_FILE} lacks a valid {_field(at + (key,))} ({kind.__name__} expected)"
                )

    def sizes(v) -> bool:
        return type(v) is list and all(type(d) is int and d >= 0 for d in v)

    need(meta, _SCHEMA, ())
    for i, g in enumerate(meta["groups"]):
        if not isinstance(g, dict):
            raise ValueError(f"{path!r}: {META_FILE} group {i} is not an object")
        at = ("groups", i)
        need(g, _GROUP_SCHEMA, at)
        if not all(type(n) is str for n in g["names"]) or len(g["names"]) != len(g["shapes"]):
            raise fail(at + ("names",), g["names"], f"{len(g['shapes'])} parameter names (one per shape)")
        for k, shape in enumerate(g["shapes"]):
            if not sizes(shape):
                raise fail(at + ("shapes", k), shape, "a list of non-negative ints")
        for key, spec in g["state"].items():
            where = at + ("state", key)
            if not isinstance(spec, dict):
                raise fail(where, spec, "an object of sharded / shape / dtype")
            if type(spec.get("dtype")) is not str or spec["dtype"] not in STATE_DTYPES:
                raise fail(where + ("dtype",), spec.get("dtype"), f"one of {sorted(STATE_DTYPES)}")
            if not sizes(spec.get("shape")):
                raise fail(where + ("shape",), spec.get("shape"), "a list of non-negative ints")
            if type(spec.get("sharded")) is not bool:
                raise fail(where + ("sharded",), spec.get("sharded"), "true or false")
    scaler = meta["loss_scaler"]
    for key in _SCALER_INTS:
        if type(scaler.get(key)) is not int or scaler[key] < 0:
            raise fail(("loss_scaler", key), scaler.get(key), "a non-negative int")
    scale = scaler.get("scale")
    if type(scale) not in (int, float) or not math.isfinite(scale) or scale <= 0:
        raise fail(("loss_scaler", "scale"), scale, "a positive number")
    residuals.check_metadata(meta, path)


def write_metadata(directory: str, meta: dict) -> None:
    """Write ``meta`` as ``directory/qzero.json``, flushed to disk."""
    with open(os.path.join(directory, META_FILE), "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
