"""The ``qzero`` command: ``train``, ``qualify``, ``bench`` and ``plan``.

Everything a command needs (its optional packages, its inputs, where it writes) is checked
before any work starts. A user error gets a one-line message and exit code 2, never a
traceback; a failed qualification gate exits 1, a run that crashed 3.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import sys
import tempfile
from typing import TYPE_CHECKING

from ..vocabulary import BACKENDS, PRECISIONS, ZERO_ALIASES

if TYPE_CHECKING:
    from .train import TrainSettings

# Nothing above imports torch (nor does the package's __init__): ``qzero --help`` and a bad
# argument answer at once. What needs torch is imported where it is used.

EXIT_GATE_FAILED = 1
EXIT_BAD_ARGS = 2
EXIT_RUN_FAILED = 3
DEFAULT_WARMUP = 2
#: An error is one line of at most this many characters.
MAX_ERROR_CHARS = 400
#: What the command does where a ZeRO flag is not given, where that is not ZeroConfig's default.
ZERO_NOTES = {"small_param_numel": "the preset's threshold",
              "overlap_param_gather": "on when the weight gather is quantized"}
#: Flags of earlier releases and the flags that replaced them: a ZeroConfig setting's flag is its
#: field name with ``-`` for ``_`` ([Note: vocabulary] in qzero/vocabulary.py). Refused, naming the new one.
RENAMED_FLAGS = {
    "--group-size": "--zero-quantized-weights-group-size",
    "--format": "--zero-quantized-weights-format",
    "--allgather-bucket": "--allgather-bucket-size",
    "--reduce-bucket": "--reduce-bucket-size",
    "--overlap": "--overlap-param-gather",
    "--no-overlap": "--no-overlap-param-gather",
    "--engine": "--backend",
}
#: Why a flag of :data:`RENAMED_FLAGS` has its new name (the default: it sets a ZeroConfig field).
_RENAMED_WHY = {"--backend": f"the training backend: {', '.join(BACKENDS)}"}

# the optional packages each part needs, and the extra of qzero that installs them
NEEDS = {
    "workload": (("transformers", "cli"),),  # the models of train and qualify are transformers configs
    "deepspeed": (("deepspeed", "deepspeed"),),
}


class MissingExtra(ValueError):
    """An optional package a command needs is not installed."""


def require(part: str, command: str) -> None:
    """Raise :class:`MissingExtra` naming the extra to install if ``part`` lacks a package."""
    for module, extra in NEEDS[part]:
        if not _has(module):
            raise MissingExtra(f"{command} needs {module}, which is not installed: pip install 'qzero[{extra}]'")


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _check_out_file(path: str | None) -> None:
    """``train --out``: a file we can create (its folder exists), not a folder. The record is
    written as a temporary file beside it, then renamed: creating one there is tried now."""
    if path is None:
        return
    if not path:
        raise ValueError("--out is empty: give a file name for the JSON record")
    if os.path.isdir(path):
        raise ValueError(f"--out {path}: is a directory; give a file name for the JSON record")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--out {path}: the directory {os.path.dirname(path) or folder} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"--out {path}: not writable")
    _probe(folder, f"--out {path}")


def _probe(folder: str, flag: str) -> None:
    """Create and remove a file in ``folder``: permissions alone do not tell (``/proc`` looks
    writable to root, a read-only mount to anyone with write permission)."""
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".qzero-probe-")
    except OSError as e:
        raise ValueError(f"{flag}: cannot create a file in {folder} ({e.strerror or e})") from None
    os.close(fd)
    os.remove(name)


def _check_out_dir(path: str) -> None:
    """``qualify --out``: a folder we can write into (made if missing), not a file."""
    if not path:
        raise ValueError("--out is empty: give a folder for the report")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--out {path}: exists and is not a directory; give a folder for the report")
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(os.path.abspath(probe))
        if parent == os.path.abspath(probe):
            break
        probe = parent
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK):
        raise ValueError(f"--out {path}: cannot write there ({probe} is not a writable directory)")
    _probe(probe, f"--out {path}")


#: What ``qzero qualify`` writes into its report folder (report.write, the arms' logs).
REPORT_FILES = ("report.md", "report.json", "bytes.png", "loss.png", "step_times.png")
#: Arms one qualify runs at the most (each is a fresh process that starts its ranks).
MAX_ARMS = 1000
#: Timed steps an arm needs at the least for the interval of its setting to mean anything.
MIN_TIMED_STEPS = 2


def _check_earlier_report(path: str, force: bool) -> None:
    """An earlier report in ``qualify --out`` is not overwritten silently: refused, or with
    ``--force`` removed (its files only) before the run starts."""
    if not os.path.isdir(path):
        return
    ours = [n for n in sorted(os.listdir(path)) if n in REPORT_FILES or (n.startswith("arm") and n.endswith(".log"))]
    if ours and not force:
        raise ValueError(f"--out {path}: holds an earlier report "
                         f"({', '.join(ours[:3])}{', ...' if len(ours) > 3 else ''}); "
                         "give another --out, or add --force to replace it")
    for name in ours:
        os.remove(os.path.join(path, name))


def _check_interval(settings: TrainSettings, order: str) -> None:
    """Refuse a run whose speedup interval would rest on too few timed steps of one setting."""
    from .train import _timed_steps

    for letter, label in (("B", "baseline"), ("C", "candidate")):
        timed = len(_timed_steps(settings)) * order.count(letter)
        if timed < MIN_TIMED_STEPS:
            raise ValueError(f"--steps {settings.steps} with --warmup {settings.warmup} and --order {order} time "
                             f"{timed} step(s) of the {label}: an interval needs at least {MIN_TIMED_STEPS}; "
                             "give more --steps or --repeats")


def _add_workload(p: argparse.ArgumentParser, steps: int, notes: dict[str, str] | None = None) -> None:
    from .workload import PRESETS
    from .zero_flags import add_zero_flags

    w = p.add_argument_group("workload")
    w.add_argument("--backend", choices=BACKENDS, default="qzero",
                   help="qzero (default), or a peer for side-by-side arms: deepspeed (ZeRO-1/2), fsdp2")
    w.add_argument("--preset", default="tiny", help=f"model preset: {', '.join(PRESETS)} (default: tiny)")
    w.add_argument("--model-config", metavar="JSON", help="a transformers config JSON instead of a preset")
    w.add_argument("--data", metavar="FILE", help="train on this text file (default: the Python stdlib sources)")
    w.add_argument("--world-size", type=int, default=2, help="ranks to start (ignored under torchrun; default 2)")
    w.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    w.add_argument("--precision", choices=PRECISIONS, default="bf16")
    w.add_argument("--seq-len", type=int, default=64)
    w.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per micro-batch")
    w.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    w.add_argument("--steps", type=int, default=steps)
    w.add_argument("--warmup", type=int, default=None,
                   help=f"steps excluded from timing (default {DEFAULT_WARMUP}, fewer when --steps is small)")
    w.add_argument("--lr", type=float, default=1e-3)
    w.add_argument("--lr-warmup", type=int, default=0, metavar="N",
                   help="linear learning-rate warmup over the first N steps (default 0: none)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--heldout", type=float, default=0.0, metavar="FRACTION",
                   help="hold out this fraction of the data (its end) and report the loss on it (default 0: none)")
    w.add_argument("--eval-every", type=int, default=0, metavar="N",
                   help="with --heldout: measure the held-out loss every N steps too (default 0: after the last only)")
    w.add_argument("--eval-sequences", type=int, default=32, metavar="N",
                   help="held-out windows of seq-len + 1 tokens the held-out loss is measured on (default 32)")
    w.add_argument("--oversubscribe", action="store_true",
                   help="run more ranks on the CPU than this host has cores (refused otherwise: each rank would get "
                   "a fraction of a core, and its step times would measure contention)")
    # each flag is the ZeroConfig field it sets, with - for _ (zero_flags.py); not given: ZeroConfig's default
    z = p.add_argument_group("ZeRO (qzero.ZeroConfig fields; docs/settings.md)")
    add_zero_flags(z, {**ZERO_NOTES, **(notes or {})})
    for old, new in RENAMED_FLAGS.items():
        z.add_argument(old, action=_Renamed, new=new)


class _Renamed(argparse.Action):
    """A flag of an earlier release: parsing it records an error naming its new spelling,
    raised as the command's one-line error (:func:`_dispatch`). Not listed in ``--help``."""

    def __init__(self, option_strings, dest, new: str, **kwargs):
        super().__init__(option_strings, dest="renamed_flag", nargs="?", default=None, help=argparse.SUPPRESS)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        if namespace.renamed_flag is None:
            why = _RENAMED_WHY.get(self.new, "a ZeroConfig setting's flag is its field name, - for _")
            namespace.renamed_flag = f"{option_string} is now {self.new} ({why})"


def _given(args: argparse.Namespace, quantized: bool | None) -> dict:
    """The settings the parsed flags give, flat (:func:`qzero.app.train.settings_from`): every flag
    stored under the name of a TrainSettings or ZeroConfig field; ZeroConfig fields only where
    the flag was given, so that the others keep ZeroConfig's defaults (and ``small_param_numel``
    the preset's threshold, ``overlap_param_gather`` its dependence on the quantized gather).
    ``quantized``: the quantized gather's switch, where the command sets it."""
    from .train import WORKLOAD_FIELDS, ZERO_FIELDS

    given = {name: getattr(args, name) for name in WORKLOAD_FIELDS if hasattr(args, name)}
    given.update({name: getattr(args, name) for name in ZERO_FIELDS if getattr(args, name, None) is not None})
    if args.warmup is None:  # the default shrinks with short runs: a step is timed up to the next one's start
        given["warmup"] = max(0, min(DEFAULT_WARMUP, args.steps - 2))
    if quantized is not None:
        given["zero_quantized_weights"] = quantized
    return given


#: The part of the exchange each switch turns on (zero_flags.SWITCHES), as errors name it.
_PARTS = {"zero_quantized_weights": "quantized weight gather", "zero_quantized_weights_delta": "delta gather",
          "zero_quantized_gradients": "quantized gradient reduction"}


def _moot(settings: dict, keys) -> list[tuple[str, str]]:
    """``(key, switch)`` for each of ``keys`` that refines a part the switches in ``settings``
    leave off (every switch is off by default)."""
    from .zero_flags import switch_of

    return [(k, switch_of(k)) for k in keys if switch_of(k) and not settings.get(switch_of(k), False)]


def _train_settings(args: argparse.Namespace) -> TrainSettings:
    """``qzero train``'s settings; a flag of a part of the exchange that is off is refused."""
    from .train import settings_from

    full, short = args.zero_quantized_weights, args.quantized
    if full is not None and short is not None and full != short:
        raise ValueError("--quantized is short for --zero-quantized-weights, and the two disagree: drop one")
    given = _given(args, next((v for v in (full, short) if v is not None), True))
    for key, switch in _moot(given, [k for k in given if getattr(args, k, None) is not None]):
        off = "--no-quantized" if switch == "zero_quantized_weights" else f"--{switch.replace('_', '-')} not given"
        raise ValueError(f"--{key.replace('_', '-')} is a setting of the {_PARTS[switch]}, which is off here ({off}): "
                         "it would change nothing; drop one of them")
    return settings_from(given)


def _overrides(items: list[str], flag: str) -> dict:
    """``KEY=VALUE`` pairs naming TrainSettings or ZeroConfig fields, or a short name of one
    (:data:`qzero.vocabulary.ZERO_ALIASES`), as a flat dict by field name; values parsed as JSON
    when they can be."""
    from .train import setting_name

    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"{flag} {item!r}: expected KEY=VALUE, e.g. {flag} quantized=true")
        try:
            name = setting_name(key)
        except ValueError as e:  # a setting of an earlier release
            raise ValueError(f"{flag} {item!r}: {e}") from None
        if name is None:
            raise ValueError(f"{flag} {item!r}: unknown setting {key.strip()!r}{_did_you_mean(key)}")
        if name in out:
            raise ValueError(f"{flag} {item!r}: {name} is already set")
        try:
            out[name] = json.loads(raw)
        except json.JSONDecodeError:
            out[name] = raw
    return out


def _did_you_mean(key: str) -> str:
    """``; did you mean ...?`` with the closest setting names, or where to find them."""
    from .train import WORKLOAD_FIELDS, ZERO_FIELDS

    names = [*WORKLOAD_FIELDS, *ZERO_FIELDS, *ZERO_ALIASES]
    close = difflib.get_close_matches(key.strip().replace("-", "_"), names, n=3)
    if close:
        return f" (not a workload setting, ZeroConfig field or short name); did you mean {' or '.join(close)}?"
    return ("; KEY is a workload setting (e.g. backend, world_size), a ZeroConfig field (e.g. stage) or a short "
            f"name ({', '.join(ZERO_ALIASES)}): qzero qualify --help")


def _arm(given: dict, overrides: dict, flag: str) -> TrainSettings:
    """An arm's settings: the flags' settings with the arm's on top (ZeroConfig's checks named by
    flag). The flags' settings of a part of the exchange this arm leaves off (the quantized
    gather's format in a plain arm) do not apply to it; the arm's own such settings are refused."""
    from .train import settings_from

    merged = {**given, **overrides}
    for key, _ in _moot(merged, [k for k in given if k not in overrides]):
        del merged[key]
    # a refinement of a quantized gather or reduction that the arm leaves plain: an A/B of nothing
    for key, switch in _moot(merged, overrides):
        raise ValueError(f"{flag} {key}=...: does nothing while this arm's {switch} is false; add "
                         f"{flag} {switch}=true, or drop it")
    try:
        return settings_from(merged)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{flag}: {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    """An error's first line, at most :data:`MAX_ERROR_CHARS` characters."""
    text = (str(e).splitlines() or [""])[0] or type(e).__name__
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qzero", description="ZeRO-1/2 with a quantized weight all-gather",
        epilog="exit codes: 0 done, 1 a qualification gate failed, 2 bad arguments or a missing extra, "
        "3 a run crashed (its log is named)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{train,qualify,bench,plan}")

    t = sub.add_parser("train", help="train the embedded workload (or a config/text of yours)")
    _add_workload(t, steps=50, notes={"zero_quantized_weights": "on, unlike ZeroConfig's"})
    t.add_argument("--quantized", action=argparse.BooleanOptionalAction, default=None,
                   help="short for --zero-quantized-weights (default: on)")
    t.add_argument("--out", metavar="JSON", help="write the run's record here")

    q = sub.add_parser("qualify", help="A/B the quantized gather against the plain one; report and verdict")
    _add_workload(q, steps=30, notes={"zero_quantized_weights": "per arm: off in the baseline, on in the candidate"})
    q.add_argument("--baseline", action="append", default=[], metavar="KEY=VALUE",
                   help="baseline arm setting, on top of the flags: KEY a workload setting (e.g. backend) or a "
                   "ZeroConfig field (e.g. zero_quantized_weights=true); the short names "
                   f"{', '.join(ZERO_ALIASES)} are accepted for {', '.join(ZERO_ALIASES.values())}; "
                   "VALUE parsed as JSON where it can be (default: zero_quantized_weights=false)")
    q.add_argument("--candidate", action="append", default=[], metavar="KEY=VALUE",
                   help="candidate arm setting, as --baseline (default: zero_quantized_weights=true)")
    q.add_argument("--order", default="BCCB", help="arm order, B = baseline, C = candidate (default BCCB)")
    q.add_argument("--repeats", type=int, default=1, help="repeat the order this many times")
    q.add_argument("--out", default="qualify-report", help="report folder (default ./qualify-report)")
    q.add_argument("--force", action="store_true", help="replace an earlier report in --out (refused otherwise)")
    q.add_argument("--max-loss-diff", type=float, default=0.05)
    q.add_argument("--tolerance", type=float, default=0.02, help="atol = rtol for sampled weights")

    b = sub.add_parser("bench", help="benchmarks on this machine's GPUs: gather (the gather and its kernels), steps "
                                     "(whole steps, arms side by side), memory (what is live at the peak); "
                                     "qzero bench WHAT --help")
    b.add_argument("what", choices=("gather", "steps", "memory"))
    b.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of that benchmark")

    from .plan_command import add_parser as add_plan

    add_plan(sub)

    a = sub.add_parser("_arm")  # one arm of qualify, in its own process; not listed in --help
    sub._choices_actions = [c for c in sub._choices_actions if c.dest != "_arm"]
    a.add_argument("settings_json")
    a.add_argument("out")
    a.add_argument("--parent", type=int, help="pid of the qualify process: the arm dies with it")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from .qualify.run import ArmFailed

    try:
        return _dispatch(args)
    except KeyboardInterrupt:
        return 130
    except ArmFailed as e:
        print(f"qzero: error: {e}", file=sys.stderr)
        return EXIT_RUN_FAILED
    except (ValueError, TypeError, OSError) as e:
        print(f"qzero: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_BAD_ARGS


def _warn(message: str) -> None:
    print(f"qzero: warning: {message}", file=sys.stderr)


def _preflight(args: argparse.Namespace, settings: list[TrainSettings]) -> None:
    """What the command needs, checked before any work: packages, inputs, ranks."""
    command = f"qzero {args.command}"
    require("workload", command)
    if any(s.backend == "deepspeed" for s in settings):
        require("deepspeed", f"{command} with backend deepspeed")
    from .train import check_fits, resolve_device, validate

    for s in settings:
        validate(s)
    cores = os.cpu_count() or 1
    world = max(s.world_size for s in settings)
    crowded = "RANK" not in os.environ and resolve_device(settings[0]) == "cpu" and world > cores
    if crowded and not args.oversubscribe:
        raise ValueError(f"--world-size {world}: more ranks than this host's {cores} CPU cores (each would get a "
                         "fraction of a core, and its step times would measure contention): add --oversubscribe "
                         "to run them anyway")
    counted = set()
    for s in settings:  # the model built on the meta device: its size against the device's memory
        key = (s.preset, s.model_config, s.seq_len, s.world_size, s.device)
        if key not in counted:
            check_fits(s)
            counted.add(key)
    if crowded:
        _warn(f"{world} ranks on {cores} CPU cores: each rank gets a fraction of a core, so this will be slow "
              "and its step times measure contention")


def _dispatch(args: argparse.Namespace) -> int:
    from .train import TrainSettings, launch

    if args.command == "_arm":
        if args.parent is not None:
            from .orphans import die_with_parent

            die_with_parent(args.parent)
        launch(TrainSettings(**json.loads(args.settings_json)), args.out, show_progress=False)
        return 0
    if getattr(args, "renamed_flag", None):
        raise ValueError(args.renamed_flag)
    if args.command == "train":
        settings = _train_settings(args)
        _check_out_file(args.out)
        _preflight(args, [settings])
        result = launch(settings, args.out)
        if result is not None:
            s = result
            print(
                f"trained {s['params']:,} parameters on {s['world_size']} ranks: loss {s['losses'][0]:.4f} -> "
                f"{s['losses'][-1]:.4f}; gather {s['bytes_sent_per_step'] / 2**20:.2f} MiB/rank/step "
                f"({s['bytes_sent_per_step'] / max(s['plain_bytes_per_step'], 1):.2f} of plain); "
                f"replicas identical: {s['replicas_identical']}"
            )
            if s.get("heldout_losses"):
                step, loss = s["heldout_losses"][-1]
                print(f"held-out loss {loss:.4f} after step {step} ({settings.eval_sequences} windows of the last "
                      f"{settings.heldout:g} of the data)")
        return 0
    if args.command == "qualify":
        return _qualify(args)
    if args.command == "bench":
        return _bench(args)
    if args.command == "plan":
        from .plan_command import run as run_plan

        return run_plan(args)
    raise ValueError(f"unknown command {args.command!r}")


def _qualify_arms(args: argparse.Namespace) -> tuple[TrainSettings, TrainSettings, TrainSettings]:
    """(common, baseline, candidate) settings of ``qzero qualify``: each arm's ``KEY=VALUE``
    settings on top of the flags'. The arms are built from the settings as given, so what
    ZeroConfig derives (gather-ahead from the quantized gather) follows each arm's own."""
    from .train import settings_from

    given = _given(args, None)
    if "zero_quantized_weights" in given and not (args.baseline and args.candidate):
        raise ValueError("--zero-quantized-weights is what the default arms compare (baseline off, candidate on): "
                         "give both --baseline and --candidate settings to compare something else with it, or drop it")
    arms = {}
    for flag, items, default in (("--baseline", args.baseline, False), ("--candidate", args.candidate, True)):
        overrides = _overrides(items, flag) or {"zero_quantized_weights": default}
        arms[flag] = _arm(given, overrides, flag), {**given, **overrides}
    common = [k for k in given if getattr(args, k, None) is not None]
    for key, switch in _moot(arms["--baseline"][1], common):
        if (key, switch) in _moot(arms["--candidate"][1], common):
            raise ValueError(f"--{key.replace('_', '-')} is a setting of the {_PARTS[switch]}, which neither arm "
                             f"turns on ({switch}): it would change nothing")
    base = settings_from({k: v for k, v in given.items() if k not in dict(_moot(given, given))})
    return base, arms["--baseline"][0], arms["--candidate"][0]


def _qualify(args: argparse.Namespace) -> int:
    from .launcher import under_torchrun
    from .qualify import Thresholds, qualify, verdict, write
    from .qualify.run import differing

    if under_torchrun():  # every rank would run the whole comparison, each with ranks of its own
        raise ValueError(f"qzero qualify starts the ranks of each arm itself (--world-size, default 2), so it does "
                         f"not run under torchrun (WORLD_SIZE={os.environ['WORLD_SIZE']} here): run qzero qualify "
                         "without torchrun")

    if not args.order or set(args.order) - {"B", "C"} or not {"B", "C"} <= set(args.order):
        raise ValueError(f"--order must use B and C, each at least once (got {args.order!r})")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    if len(args.order) * args.repeats > MAX_ARMS:
        raise ValueError(f"--order {args.order} x --repeats {args.repeats} is {len(args.order) * args.repeats:,} arms; "
                         f"at most {MAX_ARMS:,}")
    for flag, value in (("--max-loss-diff", args.max_loss_diff), ("--tolerance", args.tolerance)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{flag} must be a finite number >= 0, got {value}")
    base, baseline, candidate = _qualify_arms(args)
    if not differing(baseline, candidate):
        raise ValueError("the baseline and candidate arms have the same settings: no difference configured, so "
                         "nothing to compare (give --candidate or --baseline a setting that differs)")
    thresholds = Thresholds(max_loss_diff=args.max_loss_diff, atol=args.tolerance, rtol=args.tolerance)
    _check_out_dir(args.out)
    _preflight(args, [baseline, candidate])
    for arm in (baseline, candidate):
        _check_interval(arm, args.order * args.repeats)
    _check_earlier_report(args.out, args.force)
    if not _has("matplotlib"):
        _warn("matplotlib is not installed: the report will have no plots (pip install 'qzero[cli]')")

    def progress(done: int, total: int, letter: str) -> None:
        label = {"B": "baseline", "C": "candidate"}.get(letter, "done")
        print(f"\rqualify: arm {min(done + 1, total)}/{total} ({label})   ", end="" if done < total else "\n",
              file=sys.stderr, flush=True)

    done = [0]

    def counted(i: int, total: int, letter: str) -> None:
        done[0] = i
        progress(i, total, letter)

    try:
        report = qualify(base, baseline, candidate, order=args.order * args.repeats, out_dir=args.out,
                         thresholds=thresholds, progress=counted)
    except KeyboardInterrupt:
        print(f"\nqzero: interrupted after {done[0]} of {len(args.order) * args.repeats} arms: no report written "
              f"(the arms' logs so far are in {args.out})", file=sys.stderr)
        raise
    plotted = write(report, args.out)
    print(verdict(report))
    print(f"report: {os.path.join(args.out, 'report.md')}" + ("" if plotted else " (plots skipped: no matplotlib)"))
    return 0 if report["passed"] else EXIT_GATE_FAILED


def _bench(args: argparse.Namespace) -> int:
    if args.what == "gather":
        from .benchmarks import gather as module
    elif args.what == "steps":
        from .benchmarks import steps as module
    else:
        from .benchmarks import memory as module
    return module.main(args.rest) or 0


if __name__ == "__main__":
    sys.exit(main())
