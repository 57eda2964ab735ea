"""Single-process simulation of the chunked gather, and an independent numpy model of its result.

``simulate_gather`` runs exactly what :mod:`qzero.wire.engine` runs on every rank,
but for all ``world_size`` ranks in one process: per chunk, every simulated rank packs
its payload into its slot of one shared receive buffer (so the buffer holds exactly
what an all-gather would deliver), then every rank unpacks that buffer into its own
copy of the flat buffer. No process group is involved.
"""

from __future__ import annotations

import numpy as np
import torch

from typing import NamedTuple

from qzero.wire.chunks import exact_index, exact_scatter, pack_chunk, unpack_chunk
from qzero.layout import GroupRuns, PayloadKind, compact_layout, round_up
from qzero.quant import reference
from qzero.quant.reference import FLT_MIN

QMAX = {"int8": 127.0, "int4": 7.0, "fp8": 448.0}


def poisoned_copy(truth: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Only ``rank``'s own partition is real; the rest is NaN, which the gather must overwrite."""
    flat = torch.full_like(truth, float("nan"))
    p = truth.numel() // world
    flat[rank * p : (rank + 1) * p] = truth[rank * p : (rank + 1) * p]
    return flat


def simulate_gather(truth: torch.Tensor, plan, kernels=reference, garbage_seed: int | None = 0) -> list[torch.Tensor]:
    """The W flat buffers that W ranks would hold after ``run_gather(flat, plan)``.

    The receive buffer starts as random bytes (``garbage_seed``), so padding or a
    section a rank forgot to write shows up as a difference.
    """
    world = plan.world_size
    copies = [poisoned_copy(truth, r, world) for r in range(world)]
    gen = torch.Generator().manual_seed(garbage_seed or 0)
    for chunk in plan.chunks:
        nbytes = world * chunk.payload_bytes
        if garbage_seed is None:
            buf = torch.zeros(nbytes, dtype=torch.uint8)
        else:
            buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        for r in range(world):
            slot = pack_chunk(copies[r], plan, chunk, r, buf, kernels)
            pb = chunk.payload_bytes
            assert slot.data_ptr() == buf[r * pb : (r + 1) * pb].data_ptr() and slot.numel() == pb
        for r in range(world):
            unpack_chunk(copies[r], plan, chunk, r, buf, kernels)
    return copies


def _e4m3(y: np.ndarray) -> np.ndarray:
    """Round fp32 values to e4m3 (torch's cast defines the rounding) and back to fp32."""
    return torch.from_numpy(np.ascontiguousarray(y)).to(torch.float8_e4m3fn).to(torch.float32).numpy()


#: Bytes of one stored value, in eighths, per format.
VALUE_BITS = {"int8": 8, "int4": 4, "fp8": 8}


def exact_group(numel: int, exact: int, fmt: str, elem_size: int) -> bool:
    """A group with exact elements is sent whole and verbatim unless its values, its 4-byte
    scale and its exact elements cost at least 4 bytes less than that (the rule of
    ``[Note: exact groups]``, restated here for the model)."""
    coded = -(-numel * VALUE_BITS[fmt] // 8) + 4 + exact * elem_size
    return exact > 0 and coded + 4 > numel * elem_size


def side_mask(numel: int, world: int, group_size: int, exact_ranges, fmt: str, elem_size: int) -> np.ndarray:
    """Which elements of a flat buffer arrive verbatim: the exact ranges, and every group
    (counted from its partition's start) that :func:`exact_group` sends whole."""
    exact = np.zeros(numel, bool)
    for a, b in exact_ranges:
        exact[a:b] = True
    p = numel // world
    for r in range(world):
        for g0 in range(r * p, (r + 1) * p, group_size):
            g1 = min(g0 + group_size, (r + 1) * p)
            if exact_group(g1 - g0, int(exact[g0:g1].sum()), fmt, elem_size):
                exact[g0:g1] = True
    return exact


def expected_gather(truth: torch.Tensor, world: int, group_size: int, exact_ranges, fmt: str = "int8") -> torch.Tensor:
    """Per partition, group by group from the partition start, in numpy float32: exact
    elements masked to zero before the scales, then restored bit-exactly; a group that
    :func:`exact_group` sends verbatim arrives bit-exact as a whole."""
    v = truth.float().numpy().astype(np.float32)
    exact = side_mask(v.size, world, group_size, exact_ranges, fmt, truth.element_size())
    p = v.size // world
    masked = np.where(exact, np.float32(0), v)
    qmax = np.float32(QMAX[fmt])
    out = np.empty(v.size, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for r in range(world):
            for g0 in range(r * p, (r + 1) * p, group_size):
                g1 = min(g0 + group_size, (r + 1) * p)
                grp = masked[g0:g1]
                scale = np.float32(max(np.float32(np.abs(grp).max()) / qmax, np.float32(FLT_MIN)))
                y = (grp * (np.float32(1) / scale)).astype(np.float32)
                if fmt == "fp8":
                    q = _e4m3(np.clip(y, -qmax, qmax))
                else:
                    q = np.clip(np.rint(y), -qmax, qmax).astype(np.int8)  # integers: no -0
                out[g0:g1] = (q.astype(np.float32) * scale).astype(np.float32)
    result = torch.from_numpy(out).to(truth.dtype)
    mask = torch.from_numpy(exact)
    result[mask] = truth[mask]
    return result


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a 16-bit tensor (NaN-safe bitwise comparison)."""
    return t.view(torch.int16)


class KernelInputs(NamedTuple):
    """What the gather passes the kernels for one chunk of a quantized plan: per rank its
    payload layout, its group runs (None: every group coded) and its side index; the group
    runs of every rank (for the unpack of all of them), the side elements' positions in the
    receive buffer and the flat buffer, and the slot size. A ``PLAIN`` chunk (which the gather
    sends as it is) is given as the payload of exact groups only it stands for, so the kernels'
    handling of such payloads is checked too."""

    layouts: list
    runs: list
    sides: list
    all_runs: object
    scatter: tuple | None
    payload_bytes: int


def kernel_inputs(plan, chunk, device) -> KernelInputs:
    device = torch.device(device)
    w, n, es = plan.world_size, chunk.numel, plan.elem_size
    if chunk.kind is not PayloadKind.PLAIN:
        return KernelInputs([plan.payload_of(chunk, r) for r in range(w)],
                            [plan.group_runs(chunk, r) for r in range(w)],
                            [exact_index(plan, chunk, r, device) for r in range(w)], plan.group_runs(chunk),
                            exact_scatter(plan, chunk, device), chunk.payload_bytes)
    layout = compact_layout(0, 0, n, es)
    pb = round_up(layout.nbytes, 16)
    layout = layout._replace(nbytes=pb)
    row = ((0, n, -1),)
    runs = GroupRuns(n, plan.group_size, (row,) * w, (layout,) * w, pb)
    side = torch.arange(n, device=device)
    src = torch.cat([(r * pb + layout.exact_offset) // es + torch.arange(n) for r in range(w)]).to(device)
    dst = torch.cat([r * plan.partition_numel + chunk.offset + torch.arange(n) for r in range(w)]).to(device)
    return KernelInputs([layout] * w, [runs.row(r) for r in range(w)], [side] * w, runs, (src, dst), pb)
