"""The post-step weight gathers: quantized and plain, chunked and bounded by the bucket.

Both public functions share one contract: ``flat`` is a 1-D contiguous buffer with
the same numel on every rank; rank ``r`` owns ``flat.chunk(world_size)[r]``; on
return every rank holds the gathered buffer, bit-identical on all ranks. They
validate their arguments, agree on them across ranks (a mismatch raises on every
rank instead of hanging), then run :func:`run_gather` on a static
:class:`~qzero.layout.GatherPlan`. Callers that keep a plan (the optimizer) call
:func:`run_gather` directly and skip the checks.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from typing import NamedTuple

import torch
import torch.distributed as dist

from .layout import DEFAULT_BUCKET_NUMEL, ChunkPlan, GatherPlan, plan_gather
from .quant import kernels_for

QUANTIZABLE_DTYPES = (torch.bfloat16, torch.float16)

# torch 2.13 renamed the flat-output all-gather; older releases only have the old name.
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class GatherStats(NamedTuple):
    """What one gather moved. Byte counts are per rank (what each rank contributes)."""

    num_chunks: int
    bytes_sent: int
    plain_bytes: int
    max_recv_numel: int
    max_recv_bytes: int

    @property
    def ratio(self) -> float:
        """Bytes sent relative to a plain gather of the same buffer."""
        return self.bytes_sent / self.plain_bytes if self.plain_bytes else 1.0


def stats_of(plan: GatherPlan) -> GatherStats:
    return GatherStats(
        num_chunks=len(plan.chunks),
        bytes_sent=plan.bytes_per_rank,
        plain_bytes=plan.plain_bytes_per_rank,
        max_recv_numel=plan.max_recv_numel,
        max_recv_bytes=plan.max_recv_bytes,
    )


# --------------------------------------------------------------------------- public API


def quantized_all_gather(
    flat: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    group_size: int = 64,
    exact_ranges=(),
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
    fmt: str = "int8",
) -> GatherStats:
    """Quantize every rank's partition of ``flat`` chunk by chunk, gather, dequantize in place.

    Elements inside ``exact_ranges`` (sorted, disjoint ``(start, stop)`` flat
    indices) arrive bit-exact; every other element is within half a quantization
    step of its group (plus the rounding to ``flat.dtype``). Every rank's own
    partition is overwritten with its dequantized values too, so all replicas are
    bit-identical. Transient memory is bounded by ``bucket_numel`` elements of
    receive buffer; there is one collective per chunk.
    """
    world, agree_group, group_error = _world_or_default(group)

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
            flat.numel(), world, flat.element_size(), bucket_numel, fmt, group_size, _freeze_ranges(exact_ranges)
        )
        check_finite_partition(flat, plan, _world_and_rank(group)[1])
        return plan

    plan = _agreed_plan(build, flat, agree_group, world, "quantized_all_gather")
    return run_gather(flat, plan, group)


def all_gather(
    flat: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
) -> GatherStats:
    """The plain gather: every partition in its original dtype, chunked by the same bucket rule.

    With one chunk it gathers straight into ``flat`` with no extra buffer.
    """
    world, agree_group, group_error = _world_or_default(group)

    def build() -> GatherPlan:
        if group_error is not None:
            raise group_error
        _check_flat(flat)
        return _cached_plan(flat.numel(), world, flat.element_size(), bucket_numel, None, 1, ())

    plan = _agreed_plan(build, flat, agree_group, world, "all_gather")
    return run_gather(flat, plan, group)


# --------------------------------------------------------------------------- execution


class PeerFailure(RuntimeError):
    """A collective failed: a peer rank died, or did not answer within the process group's timeout."""


@contextlib.contextmanager
def peer_failure(what: str):
    """Turn a backend error inside a collective into one clear :class:`PeerFailure`."""
    try:
        yield
    except PeerFailure:
        raise
    except RuntimeError as e:  # DistBackendError, gloo/NCCL errors and timeouts are RuntimeErrors
        raise PeerFailure(
            f"qzero: {what} failed: a peer rank died or did not answer within the process group's timeout "
            f"(set it with init_process_group(timeout=...)). Backend said: {str(e).splitlines()[0] if str(e) else e!r}"
        ) from e


def run_gather(flat: torch.Tensor, plan: GatherPlan, group: dist.ProcessGroup | None = None, prepare=None) -> GatherStats:
    """Execute ``plan`` on ``flat`` (no argument checks: the plan was validated when built).

    ``prepare(stop)``, if given, is called before this rank's partition is read up to local
    offset ``stop``, chunk by chunk in order (the optimizer updates its master shard there)."""
    return _run_gather(flat, plan, group, prepare)


def _run_gather(flat: torch.Tensor, plan: GatherPlan, group: dist.ProcessGroup | None, prepare=None) -> GatherStats:
    world, rank = _world_and_rank(group)
    stats = stats_of(plan)
    if not plan.chunks:
        return stats
    p = plan.partition_numel
    if not plan.quantized and len(plan.chunks) == 1:
        if prepare is not None:
            prepare(p)
        if world > 1:
            with peer_failure("the weight gather"):
                all_gather_into(flat, flat[rank * p : (rank + 1) * p], group=group)
        return stats
    if plan.quantized and flat.device.type == "cuda" and len(plan.chunks) > 1:
        from .pipeline import run_pipelined  # CUDA only: overlapped stages on their own streams

        with peer_failure("the weight gather"):
            if run_pipelined(flat, plan, group, world, rank, prepare):
                return stats
    kernels = kernels_for(flat.device)
    recv = torch.empty(plan.max_recv_bytes, dtype=torch.uint8, device=flat.device)
    for chunk in plan.chunks:
        if prepare is not None:
            prepare(chunk.offset + chunk.numel)
        buf = recv[: world * chunk.payload_bytes]
        mine = pack_chunk(flat, plan, chunk, rank, buf, kernels)
        if world > 1:
            with peer_failure("the weight gather"):
                all_gather_into(buf, mine, group=group)
        unpack_chunk(flat, plan, chunk, rank, buf, kernels)
    return stats


def pack_chunk(flat: torch.Tensor, plan: GatherPlan, chunk: ChunkPlan, rank: int, buf: torch.Tensor, kernels):
    """Write this rank's payload of ``chunk`` into its slot of the receive buffer ``buf``; return the slot."""
    pb, p = chunk.payload_bytes, plan.partition_numel
    mine = buf[rank * pb : (rank + 1) * pb]
    src = flat[rank * p + chunk.offset : rank * p + chunk.offset + chunk.numel]
    if plan.quantized:
        kernels.pack_payload(src, mine, chunk.payload, plan.group_size, plan.fmt, exact_index(plan, chunk, rank, flat.device))
    else:
        mine.view(flat.dtype).copy_(src)
    return mine


def unpack_chunk(flat: torch.Tensor, plan: GatherPlan, chunk: ChunkPlan, rank: int, buf: torch.Tensor, kernels) -> None:
    """Write every source rank's payload of ``chunk`` into the flat buffer, one rank at a time
    (this rank's own included when quantized, so that all replicas hold the same bits)."""
    pb, p = chunk.payload_bytes, plan.partition_numel
    for r in range(plan.world_size):
        dst = flat[r * p + chunk.offset : r * p + chunk.offset + chunk.numel]
        payload = buf[r * pb : (r + 1) * pb]
        if plan.quantized:
            kernels.unpack_payload(
                payload, dst, chunk.payload, plan.group_size, plan.fmt, exact_index(plan, chunk, r, flat.device)
            )
        elif r != rank:
            dst.copy_(payload.view(flat.dtype))


def exact_index(plan: GatherPlan, chunk: ChunkPlan, rank: int, device: torch.device) -> torch.Tensor | None:
    """Indices (relative to ``rank``'s slice of ``chunk``) of its exact elements; cached on the plan."""
    if not plan.exact_ranges:
        return None
    key = ("exact_index", chunk.index, rank, device)
    idx = plan._cache.get(key)
    if idx is None:
        ranges = plan.exact_local_ranges(chunk, rank)
        if ranges:
            idx = torch.cat([torch.arange(a, b, dtype=torch.int64) for a, b in ranges]).to(device)
        else:
            idx = torch.empty(0, dtype=torch.int64, device=device)
        plan._cache[key] = idx
    return idx


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
    if not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def check_group(group) -> None:
    """A ProcessGroup this rank belongs to, or None for the default group."""
    if dist.is_available() and group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("this rank is not a member of the process group it was given")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__} {group!r}")
    if group is not None and not (dist.is_available() and dist.is_initialized()):
        raise ValueError("a process group was given but torch.distributed is not initialized")


def _world_or_default(group) -> tuple[int, dist.ProcessGroup | None, Exception | None]:
    """World size for the agreement; an invalid group is a local error, and the agreement
    then runs on the default group so that the other ranks hear of it instead of waiting."""
    try:
        return _world_and_rank(group)[0], group, None
    except (TypeError, ValueError) as e:
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(), None, e
        return 1, None, e


def _check_flat(flat) -> None:
    if not isinstance(flat, torch.Tensor):
        raise TypeError(f"flat must be a torch.Tensor, got {type(flat).__name__}")
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


@functools.lru_cache(maxsize=64)
def _cached_plan(numel, world, elem_size, bucket_numel, fmt, group_size, exact_ranges) -> GatherPlan:
    return plan_gather(
        numel,
        world,
        elem_size=elem_size,
        bucket_numel=bucket_numel,
        fmt=fmt,
        group_size=group_size,
        exact_ranges=exact_ranges,
    )


_FIELDS = ("arguments valid", "flat numel", "flat dtype", "format", "group size", "bucket_numel", "exact ranges")
_DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3, torch.float64: 4}


def _signature(plan: GatherPlan, dtype: torch.dtype) -> list[int]:
    digest = hashlib.blake2b(repr(plan.exact_ranges).encode(), digest_size=7).digest()
    fmt_code = 0 if plan.fmt is None else 1 + sorted(("fp8", "int4", "int8")).index(plan.fmt)
    return [
        1,
        plan.numel,
        _DTYPE_CODES.get(dtype, 99),
        fmt_code,
        plan.group_size,
        plan.bucket_numel,
        int.from_bytes(digest, "little"),
    ]


def _agreed_plan(build, flat, group, world: int, what: str) -> GatherPlan:
    """Build the plan locally, then make sure every rank built the same one."""
    try:
        plan, error = build(), None
    except (TypeError, ValueError) as e:
        plan, error = None, e
    device = flat.device if isinstance(flat, torch.Tensor) else None
    fields = dict(zip(_FIELDS[1:], _signature(plan, flat.dtype)[1:])) if plan is not None else None
    agree_or_raise(group, world, device, error, fields, what)
    return plan


def agree_or_raise(group, world: int, device, error: Exception | None, fields: dict[str, int] | None, what: str):
    """Exchange a few integers between ranks and raise on *every* rank if they differ.

    A rank whose local checks failed (``error``) still takes part, so the others
    raise too instead of waiting in a collective forever; then it raises its own
    error. ``fields`` maps names to integers (None when ``error`` is set). Nothing
    is modified; this is the only communication before the real work starts.
    """
    if world > 1:
        names = list(fields) if fields is not None else None
        n = len(fields) if fields is not None else 0
        # every rank sends the same length: [ok, count, values... padded to 15]
        row = [0 if error is not None else 1, n] + (list(fields.values()) if fields else [])
        row += [0] * (17 - len(row))
        if device is None:
            device = _default_device(group)
        sig = torch.tensor(row[:17], dtype=torch.int64, device=device)
        table = torch.empty(world * sig.numel(), dtype=torch.int64, device=device)
        all_gather_into(table, sig, group=group)
        rows = table.view(world, -1).tolist()
        bad = [r for r, row in enumerate(rows) if row[0] == 0]
        if error is None and bad:
            raise ValueError(f"{what}: rank(s) {bad} rejected their arguments; nothing was done")
        if error is None:
            for i, name in enumerate(names):
                values = [row[2 + i] for row in rows]
                if len(set(values)) > 1:
                    raise ValueError(f"{what}: {name} differs between ranks: {values} (by rank); nothing was done")
    if error is not None:
        raise error


def _default_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
