"""The post-step weight gathers: quantized and plain, chunked and bounded by the bucket.

Both public functions share one contract: ``flat`` is a 1-D contiguous buffer with
the same numel on every rank; rank ``r`` owns ``flat.chunk(world_size)[r]``; on
return every rank holds the gathered buffer, bit-identical on all ranks. They
validate their arguments, agree on them across ranks (a mismatch raises on every
rank instead of hanging), then run a static :class:`~qzero.layout.GatherPlan` on the
gather engine (:mod:`qzero.wire.engine`). Callers that keep a plan (the optimizer, the
DeepSpeed adapter) start the engine directly and skip the checks.
"""

from __future__ import annotations

import functools
import json

import torch
import torch.distributed as dist

from .agreement import MAX_FIELDS, check_fields, describe_mismatch, digest
from .chunks import PeerFailure, all_gather_into, peer_failure  # noqa: F401  (public names)
from .engine import CommContext, GatherStats, finish_gather, start_gather, stats_of, world_and_rank  # noqa: F401
from ..layout.gather_plan import GatherPlan
from ..layout.gather_planner import DEFAULT_BUCKET_NUMEL, plan_gather
from ..quant.formats import DEFAULT_FORMAT, DEFAULT_GROUP_SIZE
from ..vocabulary import RENAMED_GATHER_KEYWORDS, WEIGHT_FORMATS, refuse_renamed

QUANTIZABLE_DTYPES = (torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------- public API


@refuse_renamed(**RENAMED_GATHER_KEYWORDS)
def quantized_all_gather(
    flat: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    zero_quantized_weights_group_size: int = DEFAULT_GROUP_SIZE,
    exact_ranges=(),
    allgather_bucket_size: int = DEFAULT_BUCKET_NUMEL,
    zero_quantized_weights_format: str = DEFAULT_FORMAT,
) -> GatherStats:
    """Quantize every rank's partition of ``flat`` chunk by chunk, gather, dequantize in place.

    Elements inside ``exact_ranges`` (sorted, disjoint ``(start, stop)`` flat
    indices) arrive bit-exact; every other element is within half a quantization
    step of its group (plus the rounding to ``flat.dtype``). Every rank's own
    partition is overwritten with its dequantized values too, so all replicas are
    bit-identical. Transient memory is bounded by ``allgather_bucket_size`` elements of
    receive buffer; there is one collective per chunk. The settings are named and checked as
    :class:`qzero.ZeroConfig`'s (``zero_quantized_weights_format=None``: the plain gather, as
    :func:`all_gather`).
    """
    world, _, agree_group, group_error = world_or_default(group)
    fmt = zero_quantized_weights_format

    def build() -> GatherPlan:
        if group_error is not None:
            raise group_error
        _check_flat(flat)
        if fmt is not None and flat.dtype not in QUANTIZABLE_DTYPES:
            raise TypeError(
                f"quantized_all_gather needs a bf16 or fp16 flat buffer, got {flat.dtype}: "
                "an fp32 buffer has nothing to gain from quantization and would lose precision"
            )
        plan = _cached_plan(
            flat.numel(), world, flat.element_size(), allgather_bucket_size, fmt, zero_quantized_weights_group_size,
            _freeze_ranges(exact_ranges)
        )
        check_finite_partition(flat, plan, _world_and_rank(group)[1])
        return plan

    plan = _agreed_plan(build, flat, agree_group, world, "quantized_all_gather")
    return run_gather(flat, plan, group)


@refuse_renamed(**RENAMED_GATHER_KEYWORDS)
def all_gather(
    flat: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    allgather_bucket_size: int = DEFAULT_BUCKET_NUMEL,
) -> GatherStats:
    """The plain gather: every partition in its original dtype, chunked by the same bucket rule.

    It runs as one in-place collective over the whole buffer (each partition is already
    where every rank receives it): no receive buffer at all, so ``allgather_bucket_size`` bounds
    nothing here; it is validated and agreed on all the same. (Inside the optimizer the plain
    gather is chunked where chunks pay: gather-ahead, and the sliced update.)
    """
    world, _, agree_group, group_error = world_or_default(group)

    def build() -> GatherPlan:
        if group_error is not None:
            raise group_error
        _check_flat(flat)
        return _cached_plan(flat.numel(), world, flat.element_size(), allgather_bucket_size, None, 1, ())

    plan = _agreed_plan(build, flat, agree_group, world, "all_gather")
    return run_gather(flat, plan, group)


# --------------------------------------------------------------------------- execution


def run_gather(
    flat: torch.Tensor,
    plan: GatherPlan,
    group: dist.ProcessGroup | None = None,
    *,
    context: CommContext | None = None,
    prepare=None,
) -> GatherStats:
    """Run ``plan`` on ``flat`` synchronously (no argument checks: the plan was validated when
    built): ``finish_gather(start_gather(...))`` on ``context`` (a new one for ``flat``'s device if
    None, whose cache goes with it). ``prepare`` as in :func:`qzero.wire.engine.start_gather`."""
    context = CommContext(flat.device) if context is None else context
    return finish_gather(start_gather(flat, plan, group, context, prepare=prepare))


# --------------------------------------------------------------------------- checks


def check_finite_partition(flat: torch.Tensor, plan: GatherPlan, rank: int) -> None:
    """Refuse to send NaN/Inf: they would reach every replica (and poison whole groups' scales).

    One pass over the partition, a chunk at a time (bounded temporary memory), and one
    host synchronisation at the end."""
    lo, hi = plan.partition(rank)
    step = max(plan.chunk_numel, 1)
    finite = torch.ones((), dtype=torch.bool, device=flat.device)
    for a in range(lo, hi, step):
        finite &= torch.isfinite(flat[a : min(a + step, hi)]).all()
    if bool(finite):
        return
    for a in range(lo, hi, step):
        bad = (~torch.isfinite(flat[a : min(a + step, hi)])).nonzero()
        if bad.numel():
            raise ValueError(
                f"flat holds non-finite values in rank {rank}'s partition (first at flat index "
                f"{a + bad[0, 0].item()}); nothing was gathered"
            )


def _world_and_rank(group) -> tuple[int, int]:
    check_group(group)
    return world_and_rank(group)


def check_group(group) -> None:
    """A ProcessGroup this rank belongs to, or None for the default group."""
    if dist.is_available() and group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("this rank is not a member of the process group it was given")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__} {group!r}")
    if group is not None and not (dist.is_available() and dist.is_initialized()):
        raise ValueError("a process group was given but torch.distributed is not initialized")


def world_or_default(group) -> tuple[int, int, dist.ProcessGroup | None, Exception | None]:
    """World size and rank for ``group``, the group to agree on, and a local error. An invalid
    group is a local error, and the agreement then runs on the default group so that the other
    ranks hear of it instead of waiting."""
    try:
        return *_world_and_rank(group), group, None
    except Exception as e:  # noqa: BLE001 - a local error, agreed on the default group
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(), dist.get_rank(), None, e
        return 1, 0, None, e


def _check_flat(flat) -> None:
    if not isinstance(flat, torch.Tensor):
        raise TypeError(f"flat must be a torch.Tensor, got {type(flat).__name__}")
    if flat.device.type == "meta":
        raise ValueError("flat is on the meta device: it has no values to gather")
    if flat.dim() != 1:
        raise ValueError(f"flat must be 1-D, got shape {tuple(flat.shape)}")
    if not flat.is_contiguous():
        raise ValueError(f"flat must be contiguous, got strides {flat.stride()}")
    if flat.requires_grad:
        raise ValueError("flat requires grad; the gather writes it in place: pass flat.detach() (or a buffer, "
                         "not a leaf that autograd tracks)")


def _freeze_ranges(exact_ranges) -> tuple:
    if isinstance(exact_ranges, torch.Tensor):
        exact_ranges = exact_ranges.tolist()
    try:
        return tuple(tuple(r) if isinstance(r, (list, tuple)) else r for r in exact_ranges)
    except TypeError:
        raise TypeError(f"exact_ranges must be a sequence of (start, stop) pairs, got {exact_ranges!r}") from None


# Plans of the public gathers, by their arguments. A plan is a pure value (host integers and
# tuples, no tensors): what running one puts on a device is kept by the CommContext of the
# call, which goes when the call returns, so this cache holds no device memory.
@functools.lru_cache(maxsize=64)
def _cached_plan(numel, world, elem_size, allgather_bucket_size, fmt, group_size, exact_ranges) -> GatherPlan:
    return plan_gather(
        numel,
        world,
        elem_size=elem_size,
        allgather_bucket_size=allgather_bucket_size,
        zero_quantized_weights_format=fmt,
        zero_quantized_weights_group_size=group_size,
        exact_ranges=exact_ranges,
    )


_DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3, torch.float64: 4}


def plan_fields(plan: GatherPlan, dtype: torch.dtype) -> dict[str, int]:
    """What every rank of a gather must agree on, as named integers (for :func:`agree_or_raise`);
    a setting by its ZeroConfig field name."""
    return {
        "flat numel": plan.numel,
        "flat dtype": _DTYPE_CODES.get(dtype, 99),
        "zero_quantized_weights_format": 0 if plan.fmt is None else 1 + sorted(WEIGHT_FORMATS).index(plan.fmt),
        "zero_quantized_weights_group_size": plan.group_size,
        "allgather_bucket_size": plan.allgather_bucket_size,
        "exact ranges": digest(repr(plan.exact_ranges)),
        "zero_quantized_weights_delta": int(plan.delta),
    }


def _agreed_plan(build, flat, group, world: int, what: str) -> GatherPlan:
    """Build the plan locally, then make sure every rank built the same one ([Note: agreement])."""
    plan, error = local_outcome(build)
    fields = plan_fields(plan, flat.dtype) if plan is not None else None
    agree_or_raise(group, world, flat.device if isinstance(flat, torch.Tensor) else None, error, fields, what)
    return plan


def local_outcome(work):
    """Run the local part of a collective call: ``(result, None)``, or ``(None, exception)``
    for any exception it raised, to be passed to :func:`agree_or_raise` ([Note: agreement])."""
    try:
        return work(), None
    except Exception as e:  # noqa: BLE001 - any local failure must reach the other ranks
        return None, e


def agree_or_raise(group, world: int, device, error: Exception | None, fields: dict[str, int] | None, what: str,
                   details: dict[str, dict[str, str]] | None = None):
    """Exchange a few integers between ranks and raise on *every* rank if they differ.

    A rank whose local checks failed (``error``) still takes part, so the others
    raise too instead of waiting in a collective forever; then it raises its own
    error. ``fields`` maps names to integers (None when ``error`` is set); they are
    checked before the exchange (at most 15, each fitting 64 bits), and one that does
    not pass is this rank's error. ``details`` (optional) maps a field's name to
    ``{key: text}`` saying what it covers; they are exchanged only when that field
    differs, to name the differing keys. Nothing is modified; this is the only
    communication before the real work starts ([Note: agreement]).
    """
    if error is None:
        _, error = local_outcome(lambda: check_fields(fields or {}, what))
    if world > 1:
        names = list(fields) if error is None else []
        # every rank sends the same length: [ok, count, values... padded to MAX_FIELDS]
        row = [0, 0] if error is not None else [1, len(names)] + [int(fields[n]) for n in names]
        row += [0] * (2 + MAX_FIELDS - len(row))
        device = agreement_device(group, device)
        sig = torch.tensor(row, dtype=torch.int64, device=device)
        table = torch.empty(world * sig.numel(), dtype=torch.int64, device=device)
        with peer_failure(f"{what}: the agreement between ranks"):
            all_gather_into(table, sig, group=group)
            rows = table.view(world, -1).tolist()
        bad = [r for r, row in enumerate(rows) if row[0] == 0]
        if error is None and bad:
            raise ValueError(f"{what}: rank(s) {bad} rejected their arguments; nothing was done")
        if error is None:
            if len({row[1] for row in rows}) > 1:
                raise ValueError(f"{what}: the ranks agree on different numbers of settings "
                                 f"({[row[1] for row in rows]} by rank: different qzero versions?); nothing was done")
            for i, name in enumerate(names):
                values = [row[2 + i] for row in rows]
                if len(set(values)) > 1:
                    if details is not None and name in details:
                        said = describe_mismatch(name, _exchange_details(details[name], group, world, device, what))
                    else:
                        said = f"{name} differs between ranks: {values} (by rank)"
                    raise ValueError(f"{what}: {said}; nothing was done")
    if error is not None:
        raise error


def exchange_texts(mine: str, group, world: int, device, what: str = "an exchange between ranks") -> list[str]:
    """Every rank's text (at most 1 MiB each), by rank; collective: every rank calls it. A peer
    that dies during it raises :class:`PeerFailure` naming ``what``."""
    return [d.get("text", "") for d in _exchange_details({"text": mine}, group, world,
                                                         agreement_device(group, device), what)]


def _exchange_details(mine: dict[str, str], group, world: int, device, what: str) -> list[dict[str, str]]:
    """Every rank's details of one field (JSON, through two all-gathers: lengths, then bytes).
    Only called when every rank found the same field differing, so every rank calls it."""
    text, _ = local_outcome(lambda: json.dumps(mine))
    data = (text or "{}").encode()[:_DETAILS_BYTES]
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = torch.empty(world, dtype=torch.int64, device=device)
    with peer_failure(f"{what}: the exchange of details between ranks"):
        all_gather_into(sizes, size, group=group)
        longest = max(max(sizes.tolist()), 1)
    buf = torch.zeros(longest, dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    table = torch.empty(world * longest, dtype=torch.uint8, device=device)
    with peer_failure(f"{what}: the exchange of details between ranks"):
        all_gather_into(table, buf.to(device), group=group)
        table = table.cpu()
    out = []
    for r, n in enumerate(sizes.tolist()):
        raw = table[r * longest : r * longest + n].numpy().tobytes()
        try:
            out.append(json.loads(raw))
        except ValueError:  # cut at the size bound
            out.append({"": f"(details of rank {r} too long to show)"})
    return out


#: Details of one field a rank sends when it differs (a bound: they only name the difference).
_DETAILS_BYTES = 1 << 20


def agreement_device(group, device) -> torch.device:
    """``device`` where the backend can run the exchange on it, else the backend's own."""
    if device is None or device.type not in ("cpu", "cuda"):
        return _default_device(group)
    if device.type == "cpu" and dist.get_backend(group) == "nccl":
        return _default_device(group)
    return device


def _default_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
