"""Every Python block in README.md and docs/*.md runs as written.

Each ```python block is one test: it runs as a script in a Python process of its own, as
``python snippet.py`` runs it (this checkout's ``src`` first on the path; the process forked
from one that has imported torch: tests/_support/warm_python.py), under a timeout, and fails if it
raises, exits non-zero or hangs.
A block is self-contained unless the line(s) just above its fence carry a marker::

    <!-- snippet: OPTION OPTION ... -->

Options (unknown ones fail the test, so a typo cannot silently skip a block):

``setup=NAME``
    run the preamble ``SETUPS[NAME]`` (below) first, e.g. ``setup=flat`` defines ``flat``.
``ranks=N``
    run it on N processes at once, with the environment torchrun gives a script (``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``),
    so ``dist.init_process_group("gloo")`` works as under
    ``torchrun --nproc_per_node=N``; every rank must succeed.
``continues``
    the block continues the previous Python block of the same file: the two run together
    (as one program, the earlier one first) and the earlier one is not run on its own.
``compile-only``
    a fragment with placeholders (``Trainer(..., args=...)``): it must parse, and its
    top-level imports must run; nothing else of it runs.
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from _support.distributed import run_script

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT = 600  # seconds per block (a loaded machine; transformers alone takes seconds to import)

#: Preambles a block can ask for with ``setup=NAME``.
SETUPS = {
    "flat": textwrap.dedent("""\
        import torch
        import qzero
        flat = torch.randn(4 * 4096, generator=torch.Generator().manual_seed(0)).bfloat16()
        """),
}
OPTIONS = {"setup", "ranks", "continues", "compile-only"}

_FENCE = re.compile(r"^(\s*)```+\s*(\w[\w+-]*)?\s*$")
_MARKER = re.compile(r"<!--\s*snippet:(.*?)-->")


@dataclass
class Snippet:
    path: Path
    line: int  # 1-based line of the opening fence
    code: str
    options: dict = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{_rel(self.path)}:{self.line}"


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def parse_options(text: str, where: str) -> dict:
    options = {}
    for token in text.split():
        key, _, value = token.partition("=")
        if key not in OPTIONS:
            raise ValueError(f"{where}: unknown snippet option {key!r} (known: {', '.join(sorted(OPTIONS))})")
        options[key] = value or True
    if "setup" in options and options["setup"] not in SETUPS:
        raise ValueError(f"{where}: unknown setup {options['setup']!r} (known: {', '.join(sorted(SETUPS))})")
    if "ranks" in options and not str(options["ranks"]).isdigit():
        raise ValueError(f"{where}: ranks must be a number, got {options['ranks']!r}")
    return options


def extract(path: Path) -> list[Snippet]:
    """The Python blocks of a Markdown file, each with the options of the marker above it;
    a ``continues`` block is merged into the block before it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[Snippet] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m or m.group(2) is None:
            i += 1
            continue
        indent, lang, start = m.group(1), m.group(2), i
        i += 1
        body = []
        while i < len(lines) and not re.match(rf"^{re.escape(indent)}```+\s*$", lines[i]):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1
        if lang.lower() not in ("python", "py"):
            continue
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        marker = _MARKER.search(lines[j]) if j >= 0 else None
        where = f"{_rel(path)}:{start + 1}"
        options = parse_options(marker.group(1), where) if marker else {}
        snippet = Snippet(path, start + 1, "\n".join(body) + "\n", options)
        if options.get("continues"):
            if not out:
                raise ValueError(f"{where}: 'continues' but no Python block comes before it")
            prev = out.pop()
            merged = {**prev.options, **{k: v for k, v in options.items() if k != "continues"}}
            snippet = Snippet(path, prev.line, prev.code + snippet.code, merged)
        out.append(snippet)
    return out


def all_snippets() -> list[Snippet]:
    return [s for path in DOCS for s in extract(path)]


def program(s: Snippet) -> str:
    if s.options.get("compile-only"):
        tree = ast.parse(s.code)  # a syntax error fails here, naming the line
        imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        return ast.unparse(ast.Module(body=imports, type_ignores=[])) + "\n"
    return SETUPS.get(s.options.get("setup"), "") + s.code


def run(s: Snippet, tmp_path: Path) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(program(s), encoding="utf-8")
    ranks = int(s.options.get("ranks", 1))
    try:
        results = run_script([str(script)], ranks, timeout=TIMEOUT, cwd=tmp_path)
    except TimeoutError:
        pytest.fail(f"{s.id}: the snippet did not finish within {TIMEOUT} s")
    for r, (code, out) in enumerate(results):
        if code != 0:
            who = f" (rank {r} of {ranks})" if ranks > 1 else ""
            pytest.fail(f"{s.id}{who}: the snippet failed with exit code {code}:\n{out[-4000:]}")


SNIPPETS = all_snippets()


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.id for s in SNIPPETS])
def test_snippet_runs(snippet, tmp_path):
    run(snippet, tmp_path)


# ------------------------------------------------------------------ the runner itself


def test_every_doc_with_python_has_its_blocks_collected():
    assert any(s.path.name == "README.md" for s in SNIPPETS)
    assert any(s.path.name == "quickstart.md" for s in SNIPPETS)


def test_extract_reads_markers_and_merges_continued_blocks(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text(textwrap.dedent("""\
        Text.

        ```bash
        echo not python
        ```
        <!-- snippet: setup=flat -->

        ```python
        a = 1
        ```
        <!-- snippet: continues ranks=2 -->
        ```python
        b = a + 1
        ```
        ```py
        c = 3
        ```
        <!-- snippet: compile-only -->
        ```python
        import os
        f(...)
        ```
        """))
    got = extract(doc)
    assert [(s.line, s.code, s.options) for s in got] == [
        (8, "a = 1\nb = a + 1\n", {"setup": "flat", "ranks": "2"}),
        (15, "c = 3\n", {}),
        (19, "import os\nf(...)\n", {"compile-only": True}),
    ]
    assert program(got[2]) == "import os\n"
    assert program(got[0]).startswith(SETUPS["flat"]) and program(got[0]).endswith("b = a + 1\n")


@pytest.mark.parametrize("marker, match", [
    ("<!-- snippet: setp=flat -->", "unknown snippet option 'setp'"),
    ("<!-- snippet: setup=nope -->", "unknown setup 'nope'"),
    ("<!-- snippet: ranks=two -->", "ranks must be a number"),
])
def test_bad_markers_are_errors(tmp_path, marker, match):
    doc = tmp_path / "x.md"
    doc.write_text(f"{marker}\n```python\npass\n```\n")
    with pytest.raises(ValueError, match=match):
        extract(doc)


@pytest.mark.parametrize("code, ranks, match", [
    ("raise SystemExit(3)\n", 1, "exit code 3"),
    ("import os\nif os.environ['RANK'] == '1':\n    raise ValueError('rank one fails')\n", 2,
     r"(?s)rank 1 of 2.*rank one fails"),
])
def test_a_failing_snippet_fails(tmp_path, code, ranks, match):
    s = Snippet(tmp_path / "x.md", 1, code, {"ranks": str(ranks)} if ranks > 1 else {})
    with pytest.raises(pytest.fail.Exception, match=match):
        run(s, tmp_path)


def test_every_fragment_says_what_it_assumes():
    """A ``compile-only`` block does not run as written (its marker is an HTML comment, invisible on
    the rendered page): its first line is a visible ``# assumes: ...`` comment naming what it needs."""
    fragments = [s for s in SNIPPETS if s.options.get("compile-only")]
    assert len(fragments) >= 8
    silent = [s.id for s in fragments if not s.code.lstrip().startswith("# assumes: ")]
    assert not silent, f"compile-only blocks without a first '# assumes: ...' line: {silent}"
