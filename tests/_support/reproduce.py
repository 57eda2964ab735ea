"""The reproduce commands of the published results, read out of the Markdown that prints them
(``BENCHMARKS.md``, ``benchmarks/README.md``, ``benchmarks/reports/*.md``, ``docs/benchmarks.md``)
and turned into what they run: a Python script or module with its arguments, after the shell
wrappers of ``benchmarks/scripts/`` (link regimes, torchrun, the matrix, convergence and emulator
drivers) are unfolded the way those wrappers unfold them.

``tests/test_reproduce_commands.py`` parses every one of them with the real argument parsers, so a
renamed flag, a retired script, an unknown link regime or emulator stage, or a stale arm spec in a
published command fails a test instead of a reader."""

from __future__ import annotations

import glob
import os
import re
import shlex
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = "benchmarks/scripts"

#: Where published results print their commands.
SOURCES = ("BENCHMARKS.md", "benchmarks/README.md", "docs/benchmarks.md", "benchmarks/reports/*.md")

_RUNS = re.compile(r"(?:^|\s)(?:python3?|bash|qzero)\s")


@dataclass
class Invocation:
    """One thing a command runs: ``kind`` "script" (a file run with ``argv``), "module"
    (``python -m target argv``), "pytest" (``argv`` its paths and options) or "shell" (a bash
    file checked for syntax only); ``checks``: extra (what, value) facts to verify."""

    kind: str
    target: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    checks: list[tuple[str, str]] = field(default_factory=list)


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel)) as f:
        return f.read()


def sources() -> list[str]:
    out = []
    for pattern in SOURCES:
        out += sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))
    return out


def commands_in(text: str) -> list[str]:
    """Shell commands in ``text``'s code blocks (one per line, backslash continuations joined,
    trailing comments dropped) and inline code spans that run python, bash or qzero."""
    found = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            found.append(re.sub(r"\s+#.*$", "", line).strip())
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    found += [s.strip() for s in re.findall(r"`([^`\n]+)`", prose)]
    return [c for c in found if _RUNS.search(" " + c + " ") and "|" not in c.replace("||", "")
            and (SCRIPTS in c or re.search(r"(?:^|\s)(?:-m )?qzero (?:bench|plan)\b", c)
                 or "pytest" in c)]


class Usage(ValueError):
    """A line that shows a command's syntax (``--arm NAME:key=value,...``), not a command."""


def _placeholders(tokens: list[str]) -> list[str]:
    """Optional parts shown in brackets are taken (``[--fastest]`` -> ``--fastest``, a bare
    ``[stages]`` left out); ``DIRS...`` and globs of an output folder become that folder; any
    other ``...`` makes the line a usage line (:class:`Usage`)."""
    out = []
    for t in tokens:
        if t.startswith("[") and t.endswith("]"):
            inner = t[1:-1]
            if inner.startswith("-"):
                out.append(inner)
            continue
        if re.fullmatch(r"[A-Z]+\.\.\.", t) or "*" in t:
            t = "OUT"
        elif "..." in t:
            raise Usage(t)
        out.append(t)
    return out


def placeholder(value: str) -> bool:
    """``REGIME``, ``OUT``: a word the reader replaces."""
    return value.isupper()


def split(command: str) -> tuple[dict[str, str], list[str]]:
    """Leading ``KEY=value`` assignments and the words after them (``$(seq ...)`` expanded to two
    seeds)."""
    command = re.sub(r"\$\(seq -s ' ' (\d+) \d+\)", lambda m: f"{m.group(1)} {int(m.group(1)) + 1}", command)
    words = shlex.split(command)
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return env, _placeholders(words)


def regimes() -> list[str]:
    m = re.search(r"^REGIMES=\(([^)]*)\)", _read(f"{SCRIPTS}/regimes.sh"), re.M)
    return m.group(1).split()


def emulator_stages() -> set[str]:
    return set(re.findall(r"\bhas ([a-z0-9_]+)", _read(f"{SCRIPTS}/run_emulated.sh")))


def _python(words: list[str], env: dict[str, str]) -> list[Invocation]:
    """``python[3] ...`` after the interpreter's name."""
    if words[:2] == ["-m", "torch.distributed.run"]:
        words = [w for w in words[2:] if not w.startswith("--nproc")]
        return _python(["-m", *words[1:]] if words[0] == "-m" else words, env)
    if words[:2] == ["-m", "pytest"]:
        return [Invocation("pytest", "pytest", words[2:], env)]
    if words[0] == "-m":
        return [Invocation("module", words[1], words[2:], env)]
    return [Invocation("script", words[0], words[1:], env)]


def _matrix(args: list[str], env: dict[str, str]) -> list[Invocation]:
    """``run_matrix.sh OUT [regime ...]``: ``qzero bench steps`` as the script builds it."""
    out, chosen = args[0], args[1:]
    arms = shlex.split(env.get("ARMS", "plain: fsdp2:backend=fsdp2 deepspeed:backend=deepspeed"))
    names = {a.split(":", 1)[0] for a in arms}
    argv = ["bench", "steps", "--device", "cuda", "--world-size", env.get("WORLD", "2"),
            "--preset", env.get("PRESET", "qwen3-1.7b"), "--seq-len", "2048", "--micro-batch", "2",
            "--steps", env.get("STEPS", "10"), "--warmup", "2",
            "--allgather-bucket-size", env.get("ALLGATHER_BUCKET_SIZE", "5e8"),
            "--reduce-bucket-size", env.get("REDUCE_BUCKET_SIZE", "5e7"), "--lr", "1e-4",
            "--rounds", env.get("ROUNDS", "2"), "--out", out]
    for a in arms:
        argv += ["--arm", a]
    peers = [p for p in env.get("PEERS", "deepspeed,fsdp2").split(",") if p in names]
    if peers:
        argv += ["--peers", ",".join(peers)]
    if env.get("REFERENCE"):
        argv += ["--reference", env["REFERENCE"]]
    return [Invocation("module", "qzero", argv, env, [("regime", r) for r in chosen])]


def _convergence(args: list[str], env: dict[str, str]) -> list[Invocation]:
    """``run_convergence.sh OUT [convergence.py args]`` as the script builds the call."""
    argv = ["--device", "cuda", "--out", args[0]]
    world = int(env.get("WORLD", "1"))
    if world > 1:
        argv += ["--world-size", str(world), "--micro-batch", env.get("MICRO_BATCH", "8")]
    elif env.get("MICRO_BATCH"):
        argv += ["--micro-batch", env["MICRO_BATCH"]]
    argv += ["--time-limit", env.get("TIME_LIMIT", "330" if world > 1 else "520")]
    if env.get("ARMS"):
        argv += ["--arms", env["ARMS"]]
    argv += args[1:]
    if env.get("SEEDS"):
        argv += ["--seed", env["SEEDS"].split()[0], "--threads", "1"]
    checks = [("convergence arms", env["ARMS"])] if env.get("ARMS") else []
    return [Invocation("script", f"{SCRIPTS}/convergence.py", argv, env, checks)]


def unfold(command: str) -> list[Invocation]:
    """What ``command`` runs (ValueError: a form this reader does not know)."""
    env, words = split(command)
    if not words:
        raise ValueError(f"no command in {command!r}")
    head, rest = words[0], words[1:]
    if head in ("python", "python3"):
        return _python(rest, env)
    if head == "qzero":
        return [Invocation("module", "qzero", rest, env)]
    if head != "bash" or not rest:
        raise ValueError(f"unknown command form: {command!r}")
    script, args = rest[0], rest[1:]
    shell = Invocation("shell", script, args, env)
    name = os.path.basename(script)
    if name == "regimes.sh":
        shell.checks.append(("regime", args[0]))
        return [shell, *unfold(shlex.join(args[1:]))]
    if name == "run_matrix.sh":
        return [shell, *_matrix(args, env)]
    if name == "run_convergence.sh":
        return [shell, *_convergence(args, env)]
    if name == "run_regimes.sh":
        shell.checks += [("regime", r) for r in args[1:]]
    elif name == "run_emulated.sh":
        shell.checks += [("emulator stage", s) for s in args[1:]]
    return [shell]


def published() -> list[tuple[str, str, list[Invocation]]]:
    """(file, command, what it runs) for every reproduce command in the sources; usage lines and
    bare names of a command (``qzero plan``, ``qzero bench memory``) are left out."""
    out = []
    for rel in sources():
        for c in commands_in(_read(rel)):
            try:
                runs = unfold(c)
            except Usage:
                continue
            runs = [r for r in runs if not (r.kind == "module" and r.target == "qzero" and len(r.argv) <= 2
                                            and all(w.isalpha() for w in r.argv))]
            if runs:
                out.append((rel, c, runs))
    return out


# ---------------------------------------------------------------- checking them (a fresh process)

_SH = [("regime", regimes), ("emulator stage", emulator_stages)]


def _check_fact(what: str, value: str) -> str | None:
    if what == "convergence arms":
        import convergence  # benchmarks/scripts/, on the path while checking

        convergence.parse_arms(value)
        return None
    known = dict(_SH)[what]()
    if not placeholder(value) and value not in known:
        return f"unknown {what} {value!r} (one of: {', '.join(sorted(known))})"
    return None


def _parse_only(kind: str, target: str, argv: list[str]) -> str | None:
    """Run ``target`` with ``argv`` until its argument parser has read them: None if they parse,
    else what the parser said. A parser with a REMAINDER argument (``qzero bench``) hands on to
    the one it dispatches to."""
    import argparse
    import contextlib
    import io
    import runpy
    import sys

    class Parsed(Exception):
        pass

    original = argparse.ArgumentParser.parse_args

    def remainders(parser) -> set[str]:  # REMAINDER arguments, in subcommands too
        found = set()
        for a in parser._actions:
            if a.nargs == argparse.REMAINDER:
                found.add(a.dest)
            for sub in (getattr(a, "choices", None) or {}).values() if isinstance(a, argparse._SubParsersAction) \
                    else ():
                found |= remainders(sub)
        return found

    def parse_args(self, args=None, namespace=None):
        ns = original(self, args, namespace)
        if any(getattr(ns, dest, None) for dest in remainders(self)):
            return ns
        raise Parsed

    err = io.StringIO()
    argparse.ArgumentParser.parse_args = parse_args
    saved_argv = sys.argv
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if kind == "script":
                path = os.path.join(ROOT, target)
                sys.argv = [path, *argv]
                runpy.run_path(path, run_name="__main__")
            else:
                sys.argv = [target, *argv]
                runpy.run_module(target, run_name="__main__", alter_sys=True)
        return "ran to the end without parsing its arguments"
    except Parsed:
        return None
    except SystemExit as e:
        return None if e.code in (0, None) else (err.getvalue().strip().splitlines() or [f"exit {e.code}"])[-1]
    finally:
        argparse.ArgumentParser.parse_args = original
        sys.argv = saved_argv


def _steps_plan(argv: list[str]) -> str | None:
    """``qzero bench steps``: its arms, reference and peers resolved as the command does."""
    from qzero.app.benchmarks import steps

    args = steps.build_parser().parse_args(argv)
    if args.compare:
        return None
    try:
        steps.plan(args, check=lambda settings: None)  # no device here: the settings themselves
    except steps.SpecError as e:
        return str(e)
    return None


def check(run: Invocation) -> str | None:
    """What is wrong with one invocation, or None."""
    import subprocess

    for what, value in run.checks:
        problem = _check_fact(what, value)
        if problem:
            return problem
    if run.kind == "shell":
        path = os.path.join(ROOT, run.target)
        if not os.path.isfile(path):
            return f"no file {run.target}"
        done = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
        return done.stderr.strip() or None
    if run.kind == "pytest":
        missing = [a for a in run.argv if not a.startswith("-") and a != "gpu"
                   and not os.path.exists(os.path.join(ROOT, a.split("::")[0]))]
        return f"no test path {missing[0]}" if missing else None
    if run.kind == "script" and not os.path.isfile(os.path.join(ROOT, run.target)):
        return f"no script {run.target}"
    problem = _parse_only(run.kind, run.target, run.argv)
    if problem is None and run.kind == "module" and run.target == "qzero" and run.argv[:2] == ["bench", "steps"]:
        problem = _steps_plan(run.argv[2:])
    return problem


def main() -> int:
    """Check every published command (or the commands given as arguments), one JSON line each."""
    import json
    import sys

    sys.path.insert(0, os.path.join(ROOT, SCRIPTS))  # the scripts import each other by name
    given = sys.argv[1:]
    items = [("argv", c, unfold(c)) for c in given] if given else published()
    for rel, command, runs in items:
        problems = []
        for run in runs:
            try:
                problem = check(run)
            except Exception as e:  # a check that crashed is a failure to report, not to hide
                problem = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if problem:
                problems.append(f"{run.target}: {problem}")
        print(json.dumps({"file": rel, "command": command, "problems": problems}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
