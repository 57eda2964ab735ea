"""ZeroConfig's fields (name, type, default, documentation), read from its source without torch.

[Note: fields from the source]
The ``qzero`` command's ZeRO flags and ``docs/settings.md`` are generated from
:class:`qzero.ZeroConfig` itself, so that neither can fall behind the library. Both need
what only the source holds: a field's documentation is the string literal after it (Python
keeps no attribute docstrings at runtime). And ``qzero --help`` must answer without importing
torch, which ``qzero.config`` imports. So this module parses ``qzero/config.py`` with ``ast``:
each annotated field of the class, its annotation as written, its default (a literal, or a
module constant defined as a literal, followed through ``from ... import`` to the module that
defines it) and its docstring. ``tests/test_settings_page.py`` checks the result against
``dataclasses.fields(ZeroConfig)``, so a default this reader cannot follow fails a test rather
than the command.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import pathlib
import re
from dataclasses import dataclass
from typing import Any

_CLASS = "ZeroConfig"


@dataclass(frozen=True)
class Field:
    name: str
    annotation: str  # as written: "int", "str | None", ...
    default: Any
    doc: str  # the docstring, whitespace normalised, reST markup kept

    @property
    def kind(self) -> str:
        """The value's type without ``None``: ``bool``, ``int``, ``float`` or ``str``."""
        return next(t.strip() for t in self.annotation.split("|") if t.strip() != "None")

    @property
    def optional(self) -> bool:
        """``None`` is a value of the field (resolved on construction)."""
        return "None" in (t.strip() for t in self.annotation.split("|"))

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def summary(self) -> str:
        """The docstring's first sentence, as plain text."""
        text = plain(self.doc)
        match = re.search(r"(?<!e\.g)(?<!i\.e)\.(\s|$)", text)
        return text[: match.start() + 1] if match else text


def plain(text: str) -> str:
    """reST inline markup (````code````, ``:class:`x```) as plain text."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", text)
    return text.replace("``", "")


def _source_of(module: str) -> pathlib.Path:
    """The file of a module of qzero, found without importing it or its packages (importing
    ``qzero.layout`` would import torch)."""
    root = pathlib.Path(importlib.util.find_spec("qzero").origin).parent  # qzero/__init__.py imports lazily
    path = root.joinpath(*module.split(".")[1:])
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


@functools.lru_cache(maxsize=None)
def _constants(module: str) -> dict[str, Any]:
    """The module-level names of ``module`` bound to a literal, directly or through ``from ... import``."""
    path = _source_of(module)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, Any] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if len(targets) == 1 and isinstance(targets[0], ast.Name):
                try:
                    found[targets[0].id] = ast.literal_eval(node.value)
                except ValueError:
                    pass
        elif isinstance(node, ast.ImportFrom):
            source = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            if not source.startswith("qzero"):
                continue
            for alias in node.names:
                found.setdefault(alias.asname or alias.name, _Imported(source, alias.name))
    return found


@dataclass(frozen=True)
class _Imported:
    module: str
    name: str


def _value(node: ast.expr, module: str) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        pass
    if isinstance(node, ast.Name):
        value = _constants(module).get(node.id, _Imported(module, node.id))
        for _ in range(8):  # follow re-exports
            if not isinstance(value, _Imported):
                return value
            value = _constants(value.module).get(value.name)
    raise ValueError(f"{module}.{_CLASS}: cannot read the default {ast.unparse(node)!r} without importing it")


@functools.lru_cache(maxsize=1)
def zero_fields() -> tuple[Field, ...]:
    """ZeroConfig's fields, in order ([Note: fields from the source])."""
    module = "qzero.config"
    tree = ast.parse(_source_of(module).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == _CLASS)
    out = []
    body = cls.body
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None):
            continue
        after = body[i + 1] if i + 1 < len(body) else None
        doc = after.value.value if (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                                    and isinstance(after.value.value, str)) else ""
        out.append(Field(node.target.id, ast.unparse(node.annotation), _value(node.value, module),
                         " ".join(doc.split())))
    return tuple(out)
