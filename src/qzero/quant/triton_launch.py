"""How qzero's Triton kernels are launched: the tuning, launch shapes, the launcher and its caches.

Nothing here computes a payload. :class:`KernelTuning` is every setting a launch reads (one
frozen, documented object; :data:`DEFAULT_TUNING` is what the optimizer uses). A
:class:`Launcher` owns what launches reuse:

* the compiled kernels it launches directly (Triton's own launch costs tens of microseconds
  of host time per call; after the first launch of a specialization, :meth:`Launcher.launch`
  calls the compiled kernel itself), keyed by the kernel's Python function;
* the per-program tables derived from the index tensors and group runs its callers keep (the
  gather plans keep theirs), keyed weakly by those objects, so an entry lives exactly as long
  as its index: no table outlives its tensor, and a recycled address never finds a stale one.

Work split (every kernel): each program owns ``G`` whole groups, laid out as a ``[G, GS_PAD]``
tile (``GS_PAD``: the group size rounded up to a power of two; the extra columns are masked
off), so a group's absmax is a row reduction inside one program (:class:`LaunchShape`).

``AVAILABLE`` is False when Triton is missing, or when there is neither a CUDA device nor the
CPU interpreter (``TRITON_INTERPRET=1``) to run on.
"""

from __future__ import annotations

import functools
import os
import weakref
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from .reference import num_groups

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
AVAILABLE = triton is not None and (INTERPRET or torch.cuda.is_available())

#: The format codes the kernels' ``FMT`` constexpr takes.
FMT_CODES = {"int8": 0, "fp8": 1, "int4": 2}

#: Compile options of every kernel whose arithmetic must round step by step (the packs, the
#: delta unpack, the gradient kernels). No fp contraction (LLVM's and ptxas's ``--fmad``):
#: ``x * inv`` followed by the round-half-even add would otherwise be fused into one fma,
#: which rounds once where the reference rounds twice and stores different values.
PACK_OPTIONS = {"enable_fp_fusion": False}


@dataclass(frozen=True)
class KernelTuning:
    """How the Triton kernels are launched. The bytes they write are the same for every
    value (the torch reference's); only their speed changes."""

    block_elems: int = 2048
    """Elements one program handles for a payload without exact elements (a power of two;
    rounded down to whole groups, at least one group)."""

    num_warps: int = 4
    """Warps per program for a payload without exact elements."""

    exact_block_elems: int = 2048
    """Elements one program handles for a payload with exact elements (the exact-element
    walk needs more registers, so it may want a smaller tile)."""

    exact_num_warps: int = 8
    """Warps per program for a payload with exact elements."""

    soft_casts: bool = False
    """Always convert fp32 -> bf16 and fp32 <-> e4m3 with integer and fp32-add arithmetic
    instead of the hardware conversions (the same results; for checking one against the
    other). Off, the soft conversions are still used where they are needed: under the CPU
    interpreter (whose own conversions truncate), off CUDA, and on GPUs older than sm_89
    (no fp8)."""

    fast_launch: bool = True
    """Launch a compiled kernel directly once Triton's own launch has compiled it for the
    same specialization (see :meth:`Launcher.launch`); never under the interpreter. The same
    bytes either way; off, every launch is Triton's own (to time one against the other)."""

    def __post_init__(self) -> None:
        for name in ("block_elems", "exact_block_elems"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0 or v & (v - 1):
                raise ValueError(f"KernelTuning.{name} must be a positive power of two, got {v!r}")
        for name in ("num_warps", "exact_num_warps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0 or v & (v - 1):
                raise ValueError(f"KernelTuning.{name} must be a positive power of two, got {v!r}")

    def shape(self, has_exact: bool) -> tuple[int, int]:
        """``(elements per program, warps)`` for a payload without or with exact elements."""
        if has_exact:
            return self.exact_block_elems, self.exact_num_warps
        return self.block_elems, self.num_warps


#: The tuning of the kernels the optimizer picks (``qzero bench gather --tune`` sweeps others).
DEFAULT_TUNING = KernelTuning()


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class LaunchShape:
    gs_pad: int
    groups_per_prog: int
    programs: int
    search_steps: int
    span: int  # elements of the slice that one program's groups cover
    num_warps: int


@functools.lru_cache(maxsize=4096)
def _shape_of(numel: int, group_size: int, block: int, warps: int) -> LaunchShape:
    gs_pad = _next_pow2(group_size)
    per_prog = max(1, block // gs_pad)
    programs = -(-num_groups(numel, group_size) // per_prog)
    # At most per_prog * group_size exact elements fall in one program's groups;
    # the binary search must be able to step over all of them.
    span = per_prog * group_size
    return LaunchShape(gs_pad, per_prog, programs, span.bit_length(), span, warps)


@functools.lru_cache(maxsize=None)
def _old_gpu(index: int) -> bool:
    return torch.cuda.get_device_capability(index) < (8, 9)


class At(NamedTuple):
    """A pointer argument ``byte_offset`` bytes into ``base``'s data, typed ``dtype``: a
    tensor view for Triton's own launch, a plain address for the compiled kernel's."""

    base: torch.Tensor  # contiguous, 1-D
    byte_offset: int
    nbytes: int
    dtype: torch.dtype

    def address(self) -> int:
        return self.base.data_ptr() + self.byte_offset

    def view(self) -> torch.Tensor:
        return self.base.view(torch.uint8)[self.byte_offset : self.byte_offset + self.nbytes].view(self.dtype)


def _spec(arg) -> tuple:
    """What Triton specializes a compiled kernel on, for one runtime argument, refined:
    a pointer's element type and whether its address is a multiple of 16; an integer's
    width class, whether it is a multiple of 16 and whether it is 1."""
    if isinstance(arg, At):
        return (arg.dtype, arg.address() % 16 == 0)
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if type(arg) is int:
        return (-(2**31) <= arg < 2**31, -(2**63) <= arg < 2**63, arg % 16 == 0, arg == 1)
    return (type(arg), arg)  # anything else: its value (never met by qzero's launchers)


def _specs_and_addresses(args) -> tuple[tuple, list]:
    """:func:`_spec` of every argument and what the compiled kernel takes for it
    (:func:`_address`), in one pass: each pointer's address read once."""
    specs, addresses = [], []
    for arg in args:
        kind = type(arg)
        if kind is int:
            specs.append((-(2**31) <= arg < 2**31, -(2**63) <= arg < 2**63, arg % 16 == 0, arg == 1))
            addresses.append(arg)
        elif kind is At:
            a = arg.base.data_ptr() + arg.byte_offset
            specs.append((arg.dtype, a % 16 == 0))
            addresses.append(a)
        elif isinstance(arg, torch.Tensor):
            a = arg.data_ptr()
            specs.append((arg.dtype, a % 16 == 0))
            addresses.append(a)
        else:
            specs.append(_spec(arg))
            addresses.append(_address(arg))
    return tuple(specs), addresses


def _resolve(arg):
    return arg.view() if isinstance(arg, At) else arg


def _address(arg):
    if isinstance(arg, At):
        return arg.address()
    if isinstance(arg, torch.Tensor):
        return arg.data_ptr()
    return arg


#: Every run of a :class:`RunsTable` starts at a multiple of this many elements (runs start
#: on group boundaries; group sizes are multiples of 8): the packs and the delta unpack tell the compiler so.
RUN_ALIGN = 8


class RunsTable(NamedTuple):
    """Group runs as the kernels read them: one row per payload, ``row_len`` int64 each:
    the payload's scales offset, then per run ``(first program, lo, hi, first coded group)``
    (rows padded to ``n_runs`` runs that no program finds); ``programs``: the most tiles a row has."""

    table: torch.Tensor
    row_len: int
    n_runs: int
    steps: int
    programs: int


def _tile_starts(row, span: int) -> list[int]:
    """Where each tile of one row of group runs starts (tiles of ``span`` elements that never
    cross a run), and the slice's end."""
    starts = [a for lo, hi, _ in row for a in range(lo, hi, span)]
    return starts + [row[-1][1]]


class ByIdentity:
    """Values kept per live object, found by the object's identity: an entry goes when its object
    is freed (a weak reference's callback), and an object at a recycled address never finds
    another one's value. Like ``torch.utils.weak.WeakIdKeyDictionary``, but a lookup makes no
    weak reference (a launch looks its tables up every time); a value must not hold its own key
    alive."""

    def __init__(self):
        self._entries: dict[int, tuple[weakref.ref, object]] = {}

    def get(self, obj):
        hit = self._entries.get(id(obj))
        return hit[1] if hit is not None and hit[0]() is obj else None

    def __setitem__(self, obj, value) -> None:
        key, entries = id(obj), self._entries
        # the callback runs as the object is freed, before its address can be reused
        entries[key] = (weakref.ref(obj, lambda _ref, key=key: entries.pop(key, None)), value)

    def __len__(self) -> int:
        return len(self._entries)


class Launcher:
    """Launches Triton kernels with one :class:`KernelTuning` and owns what launches reuse
    (see the module docstring).

    ``interpret``: whether kernels run under Triton's CPU interpreter (then every launch is
    Triton's own); ``driver``: ``(current_device, current_stream)`` callables for direct
    launches, Triton's active driver's when None (looked up at the first direct launch)."""

    def __init__(self, tuning: KernelTuning = DEFAULT_TUNING, *, interpret: bool = INTERPRET,
                 driver: tuple[Callable, Callable] | None = None):
        if not isinstance(tuning, KernelTuning):
            raise TypeError(f"tuning must be a KernelTuning, got {type(tuning).__name__}")
        self.tuning = tuning
        self.interpret = interpret
        self._driver = driver
        #: kernel's Python function -> {specialization key: compiled kernel} (see :meth:`launch`).
        self._compiled: dict = {}
        #: exact index tensor -> (shape, device, version, runs, idx or None, blk) (see :meth:`exact_tables`).
        self._exact = ByIdentity()
        #: GroupRuns -> {(shape, device): RunsTable} (see :meth:`runs_table`).
        self._runs = ByIdentity()

    def shape(self, numel: int, group_size: int, has_exact: bool) -> LaunchShape:
        """The launch shape of a slice of ``numel`` elements."""
        block, warps = self.tuning.shape(has_exact)
        return _shape_of(numel, group_size, block, warps)

    def soft(self, device: torch.device) -> bool:
        """Whether kernels on ``device`` convert with the soft arithmetic (``KernelTuning.soft_casts``)."""
        if self.tuning.soft_casts or self.interpret or device.type != "cuda":
            return True
        return _old_gpu(device.index if device.index is not None else torch.cuda.current_device())

    def exact_tables(self, exact_index: torch.Tensor | None, shape: LaunchShape, device: torch.device, runs=None):
        """``(idx, blk)``: the index on ``device`` as int64, and for every program where its tile
        starts in it (the tiles of :meth:`runs_table` when ``runs`` is given, one row). Built once
        per index the caller keeps, and again when the index changes in place."""
        if exact_index is None or exact_index.numel() == 0:
            return None, None
        keep = not exact_index.is_inference()  # inference tensors have no version counter
        hit = self._exact.get(exact_index) if keep else None
        if hit is not None and hit[:4] == (shape, device, exact_index._version, runs):
            return (exact_index if hit[4] is None else hit[4]), hit[5]
        idx = exact_index.to(device=device, dtype=torch.int64)
        if runs is None:
            starts = torch.arange(shape.programs + 1, device=device, dtype=torch.int64) * shape.span
        else:
            starts = torch.tensor(_tile_starts(runs.rows[0], shape.span), dtype=torch.int64).to(device)
        blk = torch.searchsorted(idx, starts)
        if keep:  # the entry must not hold its own key alive: the index itself is stored as None
            self._exact[exact_index] = (shape, device, exact_index._version, runs,
                                        None if idx is exact_index else idx, blk)
        return idx, blk

    def runs_table(self, runs, shape: LaunchShape, device: torch.device) -> RunsTable:
        """The :class:`RunsTable` of ``runs`` (:class:`qzero.layout.GroupRuns`) for tiles of ``shape``."""
        per_runs = self._runs.get(runs)
        if per_runs is None:
            per_runs = self._runs[runs] = {}
        hit = per_runs.get((shape, device))
        if hit is None:
            n_runs = max(len(row) for row in runs.rows)
            flat, programs = [], 0
            for row, layout in zip(runs.rows, runs.layouts):
                flat.append(layout.scales_offset)
                p = 0
                for lo, hi, first in row:
                    if lo % RUN_ALIGN:  # the kernels' alignment hint would be false: wrong bytes
                        raise ValueError(f"a group run starts at element {lo}, not a multiple of {RUN_ALIGN}")
                    flat += [p, lo, hi, first]
                    p += -(-(hi - lo) // shape.span)
                flat += [2**62, 0, 0, -1] * (n_runs - len(row))
                programs = max(programs, p)
            table = torch.tensor(flat, dtype=torch.int64).to(device)
            hit = per_runs[(shape, device)] = RunsTable(table, 1 + 4 * n_runs, n_runs, (n_runs - 1).bit_length(),
                                                        programs)
        return hit

    def launch(self, kernel, grid: tuple, args: tuple, consts: dict, options: dict) -> None:
        """``kernel[grid](*args, **consts, **options)``, cheaper from the second time on.

        Triton's launch (``JITFunction.run``) binds and specializes every argument, builds a
        cache key and looks the compiled kernel up on every call: tens of microseconds of
        host time. Here the compiled kernel that Triton's launch returned is kept under a key
        that refines Triton's own specialization (the constexpr values, the options, the
        current device, and per runtime argument :func:`_spec`), and later launches with
        the same key go straight to it (``compiled[grid](*args, stream=...)``, the launch
        ``JITFunction.run`` itself ends with), with pointers passed as addresses. Any
        launch whose key is new goes through Triton's launch, which compiles what it needs.
        Under the interpreter, with ``KernelTuning.fast_launch`` off, or where this Triton's
        launch does not return a compiled kernel with that interface, every launch is
        Triton's own."""
        grid = tuple(grid) + (1,) * (3 - len(grid))
        if self.interpret or not self.tuning.fast_launch:
            kernel[grid](*map(_resolve, args), **consts, **options)
            return
        if self._driver is None:
            drv = triton.runtime.driver.active
            self._driver = (drv.get_current_device, drv.get_current_stream)
        device = self._driver[0]()
        specs, addresses = _specs_and_addresses(args)
        key = (device, tuple(consts.items()), tuple(options.items()), specs)
        # by the Python function: hashing a JITFunction hashes its source under a lock
        cache = self._compiled.setdefault(getattr(kernel, "fn", kernel), {})
        compiled = cache.get(key)
        if compiled is not None:
            compiled[grid](*addresses, *consts.values(), stream=self._driver[1](device))
            return
        compiled = kernel[grid](*map(_resolve, args), **consts, **options)
        if hasattr(compiled, "result"):  # a compilation future (asynchronous compile mode)
            compiled = compiled.result()
        names = getattr(kernel, "arg_names", None)
        # The compiled kernel takes every argument positionally, constexprs included.
        if names is not None and list(names) == [*names[: len(args)], *consts] and callable(
                getattr(compiled, "__getitem__", None)):
            cache[key] = compiled

    def compiled(self, kernel) -> dict:
        """The compiled kernels of ``kernel`` this launcher launches directly, by specialization."""
        return self._compiled.get(getattr(kernel, "fn", kernel), {})
