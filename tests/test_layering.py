"""The layering of qzero's packages, read from the source (``docs/design.md``, "Modules").

[Note: floors]
Every module of ``src/qzero`` sits on a floor (:data:`FLOORS`). A module may import any
module of its own package, and modules of packages on lower floors; never one on its own
floor in another package (siblings are independent: ``fsdp`` and ``integrations`` know
nothing of each other) and never one above. So a call only goes down, and a file's package
says what it may touch. The application (``qzero.app``, with ``python -m qzero``'s
``qzero/__main__.py``) is the top floor: the library never imports it, neither at import time
nor from inside a function.

Imports are read with ``ast`` from every ``.py`` file, at any depth (top level, inside
functions, under ``if TYPE_CHECKING``): ``import``, ``from ... import`` (relative and
absolute), ``importlib.import_module("...")`` and ``__import__("...")`` with a literal name,
and the lazy tables of ``qzero/__init__.py``.

[Note: no import circle]
Inside a package, too, imports go one way: the modules of ``src/qzero`` with the imports
above as edges form no cycle (:func:`import_cycles`). An import deferred into a function or
hidden under ``TYPE_CHECKING`` counts like any other: it still says that the two modules
know each other. (A package's ``__init__`` runs before any of its modules is imported; that
is Python's order, not an import a module writes, so it is no edge.) So the checkpoint code
knows the optimizer only through protocols (``qzero/optim/checkpoint/protocol.py``), and
``optim/zero.py`` imports it, never the other way round.
"""

from __future__ import annotations

import ast
import collections
import importlib.util
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"

#: Packages by floor, lowest first (a name is ``qzero.<first part>``; ``""`` is ``qzero/__init__.py``).
FLOORS: tuple[tuple[str, ...], ...] = (
    ("vocabulary",),              # setting names and the values they take ([Note: vocabulary]); no torch
    ("quant",),                   # formats, the reference quantizer (the specification), kernels
    ("layout",),                  # the pure planner of the weight gather: flat layouts, chunks, payloads
    ("buckets", "config"),        # the gradient reduction's plan; ZeroConfig: the settings and their names
    ("wire", "plan"),             # chunks, the gather engine, the gradient exchange, agreement; the cost model
    ("optim",),                   # ZeroOptimizer: flat groups, gradients, update, checkpoints
    ("fsdp", "integrations"),     # FSDP2 extensions; the DeepSpeed adapter and HF callback
    ("",),                        # qzero/__init__.py: the public names, imported lazily
    ("app",),                     # the qzero command: train, qualify, backends, benchmarks
    ("__main__",),                # python -m qzero: runs qzero.app.cli
)
FLOOR = {package: level for level, packages in enumerate(FLOORS) for package in packages}
APP = ("app", "__main__")


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(module: str) -> str:
    """``qzero.wire.engine`` -> ``wire``; ``qzero`` -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _resolve(name: str, level: int, importer: str, is_package: bool) -> str:
    if not level:
        return name
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports_of(path: pathlib.Path, source: str | None = None) -> list[tuple[int, str]]:
    """``(line, module)`` for every qzero module the file at ``path`` imports, at any depth."""
    me = module_name(path)
    is_package = path.name == "__init__.py"
    tree = ast.parse(source if source is not None else path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module or "", node.level, me, is_package)
            for a in node.names:  # ``from . import chunks`` imports the module qzero.wire.chunks
                sub = f"{base}.{a.name}"
                spec_path = SRC / sub.replace(".", "/")
                is_module = spec_path.with_suffix(".py").exists() or spec_path.is_dir()
                found.append((node.lineno, sub if is_module else base))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called in ("import_module", "__import__"):
                name = node.args[0].value
                level = len(name) - len(name.lstrip("."))
                found.append((node.lineno, _resolve(name.lstrip("."), level, me, True) if level else name))
    return [(line, m) for line, m in found if m == "qzero" or m.startswith("qzero.")]


def all_imports() -> list[tuple[str, pathlib.Path, int, str]]:
    """``(importer, path, line, imported)`` over src/qzero, plus the lazy tables of qzero/__init__.py."""
    edges = [(module_name(p), p, line, m) for p in sorted((SRC / "qzero").rglob("*.py")) for line, m in imports_of(p)]
    root = SRC / "qzero" / "__init__.py"
    names = _root_tables(root)
    edges += [("qzero", root, 0, _resolve(name.lstrip("."), len(name) - len(name.lstrip(".")), "qzero", True))
              for name in names]
    return edges


def _root_tables(root: pathlib.Path) -> list[str]:
    """The module names in qzero/__init__.py's ``_EXPORTS`` (values) and ``_LIBRARY`` (subpackages)."""
    names = []
    for node in ast.parse(root.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            target, value = node.targets[0].id, node.value
            if target == "_EXPORTS":
                names += [v.value for v in value.values]
            elif target == "_LIBRARY":
                names += ["." + e.value for e in value.elts]
    assert names, "qzero/__init__.py has no _EXPORTS/_LIBRARY tables to check"
    return names


def violations(edges) -> list[str]:
    """What breaks [Note: floors], one line each, or nothing."""
    out = []
    for importer, path, line, imported in edges:
        mine, theirs = package_of(importer), package_of(imported)
        if mine not in FLOOR or theirs not in FLOOR:
            out.append(f"{path.relative_to(SRC)}:{line}: {importer} -> {imported}: "
                       f"package {mine if mine not in FLOOR else theirs!r} has no floor in FLOORS")
        elif mine != theirs and FLOOR[theirs] >= FLOOR[mine]:
            where = "its own floor" if FLOOR[theirs] == FLOOR[mine] else "a floor above"
            out.append(f"{path.relative_to(SRC)}:{line}: {importer} -> {imported} ({where})")
    return out


def test_every_package_has_a_floor():
    packages = {package_of(module_name(p)) for p in (SRC / "qzero").rglob("*.py")}
    assert packages <= set(FLOOR), f"packages without a floor: {sorted(packages - set(FLOOR))}"
    assert set(FLOOR) - {""} <= packages, f"floors naming no package: {sorted(set(FLOOR) - {''} - packages)}"


def test_the_library_never_imports_the_app():
    edges = all_imports()
    assert any(package_of(i) == "app" for _, _, _, i in edges), \
        "found no import of qzero.app at all: the scan is broken"
    bad = [f"{p.relative_to(SRC)}:{line}: {importer} -> {imported}" for importer, p, line, imported in edges
           if package_of(importer) not in APP and package_of(imported) in APP]
    assert not bad, "the library imports the application:\n" + "\n".join(bad)


def test_imports_only_go_down_a_floor():
    edges = all_imports()
    assert len(edges) > 100, f"only {len(edges)} imports found: the scan is broken"
    bad = violations(edges)
    assert not bad, "imports that break [Note: floors] in tests/test_layering.py:\n" + "\n".join(bad)


@pytest.mark.parametrize("source, found", [
    ("from ..app import cli", "qzero.app.cli"),                        # relative, at the top
    ("def f():\n    from ..app.train import launch", "qzero.app.train"),  # inside a function
    ("import qzero.app.backends as b", "qzero.app.backends"),          # absolute
    ("import importlib\nimportlib.import_module('qzero.app.cli')", "qzero.app.cli"),
    ("from qzero.app import workload", "qzero.app.workload"),
    ("from .. import optim", "qzero.optim"),
])
def test_the_scan_finds_every_form_of_import(source, found):
    path = SRC / "qzero" / "wire" / "engine.py"  # read as if written there
    assert found in [m for _, m in imports_of(path, source)]
    edges = [("qzero.wire.engine", path, line, m) for line, m in imports_of(path, source)]
    assert violations(edges), f"{source!r} in qzero/wire/engine.py is an upward import, not reported"


def test_a_sibling_import_is_reported():
    path = SRC / "qzero" / "fsdp" / "group.py"
    edges = [("qzero.fsdp.group", path, 1, "qzero.integrations.deepspeed")]
    assert violations(edges) == [
        "qzero/fsdp/group.py:1: qzero.fsdp.group -> qzero.integrations.deepspeed (its own floor)"]


def import_cycles(edges) -> list[str]:
    """Every import circle among ``edges`` (``(importer, path, line, imported)``), one line
    each: a shortest cycle through each strongly connected set of modules, every edge with
    the file and line that makes it ([Note: no import circle]). Empty when there is none."""
    graph: dict[str, dict[str, str]] = collections.defaultdict(dict)
    for importer, path, line, imported in edges:
        if importer != imported:
            graph[importer].setdefault(imported, f"{path.relative_to(SRC)}:{line}")
    return sorted(_describe_cycle(graph, sorted(component)) for component in _strongly_connected(graph)
                  if len(component) > 1)


def _strongly_connected(graph: dict[str, dict[str, str]]) -> list[set[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit to hit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, {}))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.add(top)
                        if top == node:
                            break
                    out.append(component)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, {})))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def _describe_cycle(graph: dict[str, dict[str, str]], component: list[str]) -> str:
    """The shortest cycle from the first module of ``component`` back to it (breadth first,
    inside the component): ``a -> b -> a (a.py:3, b.py:7)``, and the component's other modules."""
    start, inside = component[0], set(component)
    came_from: dict[str, str] = {}
    queue = collections.deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph.get(node, {})):
            if child not in inside:
                continue
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                path = path[::-1] + [start]
                where = ", ".join(graph[a][b] for a, b in zip(path, path[1:]))
                others = [m for m in component if m not in path]
                also = f"; in the same circle: {', '.join(others)}" if others else ""
                return f"{' -> '.join(path)} ({where}){also}"
            if child not in came_from:
                came_from[child] = node
                queue.append(child)
    raise AssertionError(f"no cycle through {start} inside {component}")


def test_no_import_circle():
    edges = all_imports()
    assert len(edges) > 100, f"only {len(edges)} imports found: the scan is broken"
    found = import_cycles(edges)
    assert not found, "import circles in src/qzero ([Note: no import circle] in tests/test_layering.py):\n" + \
        "\n".join(found)


def _edges_of(sources: dict[str, str]):
    """The edges of ``{path under src/qzero: source}``, read as if the files were there."""
    out = []
    for rel, source in sources.items():
        path = SRC / "qzero" / rel
        out += [(module_name(path), path, line, m) for line, m in imports_of(path, source)]
    return out


def test_a_circle_is_found_however_the_import_hides():
    """The checkpoint modules as they once were: ``zero.py`` imported the checkpoint code inside its
    methods, and the checkpoint code imported ``zero.py`` under ``TYPE_CHECKING`` for its types."""
    old = {
        "optim/zero.py": "def save_checkpoint(self, path):\n    from .checkpoint_save import save_checkpoint\n",
        "optim/checkpoint_save.py": "from typing import TYPE_CHECKING\nfrom .checkpoint import module_state\n"
                                    "if TYPE_CHECKING:\n    from .zero import ZeroOptimizer\n",
        "optim/checkpoint.py": "from . import error_feedback\n",
        "optim/error_feedback.py": "def pieces(layout):\n    from .checkpoint import logical_pieces_between\n",
    }
    assert import_cycles(_edges_of(old)) == [
        "qzero.optim.checkpoint -> qzero.optim.error_feedback -> qzero.optim.checkpoint "
        "(qzero/optim/checkpoint.py:1, qzero/optim/error_feedback.py:2)",
        "qzero.optim.checkpoint_save -> qzero.optim.zero -> qzero.optim.checkpoint_save "
        "(qzero/optim/checkpoint_save.py:4, qzero/optim/zero.py:2)"]
    # a package and its own module: ``from . import NAME`` of a name its __init__ defines
    package = {"fsdp/__init__.py": "NAME = 1\nfrom .group import install\n",
               "fsdp/group.py": "def check(model):\n    from . import NAME\n"}
    assert import_cycles(_edges_of(package)) == [
        "qzero.fsdp -> qzero.fsdp.group -> qzero.fsdp (qzero/fsdp/__init__.py:2, qzero/fsdp/group.py:2)"]
    assert import_cycles(_edges_of({"optim/checkpoint/save.py": "from ..delta import LoopState\n",
                                    "optim/zero.py": "from .checkpoint.save import save_checkpoint\n"})) == []


def test_the_checkpoint_package_only_looks_down():
    """``optim/zero.py`` imports the checkpoint package; nothing in it imports ``zero.py`` or
    ``qzero.optim`` (whose ``__init__`` imports ``zero.py``) at any depth ([Note: checkpoints
    know the optimizer by its protocol] in qzero/optim/checkpoint/protocol.py)."""
    edges = all_imports()
    inside = "qzero.optim.checkpoint"
    assert any(i == "qzero.optim.zero" and m.startswith(inside + ".") for i, _, _, m in edges), \
        "optim/zero.py no longer imports the checkpoint package: the check below proves nothing"
    up = [f"{p.relative_to(SRC)}:{line}: {i} -> {m}" for i, p, line, m in edges
          if (i == inside or i.startswith(inside + ".")) and m in ("qzero", "qzero.optim", "qzero.optim.zero")]
    assert not up, "the checkpoint package imports the optimizer:\n" + "\n".join(up)


#: The modules of the planner (``qzero.layout``), lowest first: each imports only those before it.
LAYOUT_ORDER = ("topology", "gather_plan", "gather_planner", "flat_layout")


def planner_violations(sources: dict[str, str]) -> list[str]:
    """What breaks the planner's purity in ``sources`` (``{module stem: source}`` of
    ``qzero/layout/``): an import of torch at any depth, or an import of a planner module
    that is not below the importer in :data:`LAYOUT_ORDER`."""
    package = SRC / "qzero" / "layout"
    bad = []
    for stem, source in sorted(sources.items()):
        path = package / f"{stem}.py"
        for node in ast.walk(ast.parse(source, str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            bad += [f"{path.relative_to(SRC)}:{node.lineno}: imports {n}" for n in names
                    if n == "torch" or n.startswith("torch.")]
        if stem == "__init__":
            continue
        for line, imported in imports_of(path, source):
            other = imported.split(".")[2] if imported.startswith("qzero.layout.") else None
            if other is not None and LAYOUT_ORDER.index(other) >= LAYOUT_ORDER.index(stem):
                bad.append(f"{path.relative_to(SRC)}:{line}: imports {imported}, not below it in LAYOUT_ORDER")
    return bad


def test_the_planner_is_pure_and_its_modules_import_downward():
    """``qzero.layout`` touches no process group and no tensor: none of its modules imports
    torch; inside it, the plan's values know nothing of the planner, and the gather planner
    nothing of the flat layout."""
    package = SRC / "qzero" / "layout"
    sources = {p.stem: p.read_text() for p in package.glob("*.py")}
    assert sorted(sources) == sorted(("__init__", *LAYOUT_ORDER)), f"list {sorted(sources)} in LAYOUT_ORDER"
    bad = planner_violations(sources)
    assert not bad, "\n".join(bad)
    # the check sees both kinds of import
    broken = {**sources, "gather_plan": "import torch.distributed\nfrom .gather_planner import plan_gather\n"}
    assert planner_violations(broken) == [
        "qzero/layout/gather_plan.py:1: imports torch.distributed",
        "qzero/layout/gather_plan.py:2: imports qzero.layout.gather_planner, not below it in LAYOUT_ORDER"]


def test_importing_the_library_leaves_the_app_unimported():
    """In a fresh interpreter: import the library's ways in (those whose optional dependencies
    are installed), resolve every public name, and find no ``qzero.app`` module loaded."""
    modules = ["qzero", "qzero.optim", "qzero.fsdp", "qzero.wire", "qzero.integrations"]
    if importlib.util.find_spec("deepspeed") is not None:
        modules.append("qzero.integrations.deepspeed")
        if importlib.util.find_spec("transformers") is not None:
            modules.append("qzero.integrations.hf")
    code = textwrap.dedent(f"""
        import importlib, sys
        for m in {modules!r}:
            importlib.import_module(m)
        import qzero
        for name in qzero.__all__:
            getattr(qzero, name)
        for name in qzero._LIBRARY:
            getattr(qzero, name)
        app = sorted(m for m in sys.modules if m == "qzero.app" or m.startswith("qzero.app.") or m == "qzero.__main__")
        print("APP", app)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "APP []" in res.stdout, f"importing {modules} loaded the application: {res.stdout.strip()}"


def test_the_app_is_no_attribute_of_the_library():
    """``qzero.<name>`` finds the library's subpackages on first use, never the application,
    which is imported by name only."""
    code = ("import sys, qzero\n"
            "assert not hasattr(qzero, 'app'), 'qzero.app found as an attribute'\n"
            "assert not hasattr(qzero, 'cli')\n"
            "print(sorted(m for m in sys.modules if m.startswith('qzero.app')))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "[]"
