"""The device side of the emulated link (``benchmarks/scripts/emulated_link.py``, whose note defines link,
transfer, hold and contention): the link's stream, and the one kernel that holds it.

The hold kernel runs on the link's stream after a collective's delivery. Each of its CTAs
reads the GPU's global timer; the transfer's start is the later of the previous transfer's
end (kept on the device) and the first CTA's start less the delivery's estimated time (the
CTAs agree on it through an atomic minimum, so one that gets its SM late holds to the same
end instead of stretching the transfer); each CTA moves its share of the paced HBM traffic
(copies through a scratch buffer, each piece not before its due time), then waits until
``start + duration`` (in short naps, or reading the
timer without a pause: ``LinkModel.spin``, warps that keep issuing as NCCL's copy loops do),
and records its end. When no CTA gets an SM (the GPU full of compute), the transfer starts late, as NCCL's do
when their kernels are scheduled late. ``ctas == 0``: one one-warp CTA holds the link (no
contention beyond one warp).

The previous transfer's end and the current one's start live in two device words each,
alternating between transfers, so a late CTA of a transfer still reads its own; each
transfer clears the next one's start words for their minimum. A log of
``(start, end)`` per transfer (the last :data:`LOG` transfers) stays on the device for
:meth:`DeviceLink.log`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Transfers whose (start, end) the device log keeps.
LOG = 8192
#: Elements (int32) each CTA copies per inner iteration of the paced traffic.
BLOCK = 4096
#: The scratch the paced traffic runs through: two halves of this many bytes, each larger than L2.
SCRATCH_BYTES = 128 << 20
#: Pieces a CTA's share of the traffic is paced in (at most).
PIECES = 64
#: Delivery bandwidth assumed for its estimated time: bytes per nanosecond, read + write of a
#: device copy (3,000 B/ns = 3 TB/s, below an H200's HBM rate: an underestimate of the time only
#: starts a transfer a little later than it was issued, never earlier).
DELIVERY_BYTES_PER_NS = 3000.0
#: Fixed cost of a delivery (its kernel's launch on the device), nanoseconds.
DELIVERY_FIXED_NS = 2000


def delivery_ns(delivered_bytes: int) -> int:
    """The estimated device time of a delivery of ``delivered_bytes`` (what the hold backdates
    a transfer's start by: the delivery ran on the link's stream just before the hold)."""
    return round(DELIVERY_FIXED_NS + delivered_bytes / DELIVERY_BYTES_PER_NS)


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _nap():
    return tl.inline_asm_elementwise("{ nanosleep.u32 400; mov.u32 $0, 0; }", "=r", [], dtype=tl.int32,
                                     is_pure=False, pack=1)


#: Device words of the link's timeline: the end of the last transfer (two, alternating), the
#: start of the current one (two, alternating), then the log's (start, end) pairs.
FREE, START, LOG_BASE = 0, 2, 4
NEVER = 2**63 - 1


@triton.jit(do_not_specialize=["duration_ns", "deliver_ns", "pieces", "piece_elems", "wrap", "parity", "slot"])
def _hold_kernel(state_ptr, src_ptr, dst_ptr, duration_ns, deliver_ns, pieces, piece_elems, wrap, parity, slot,
                 BLOCK: tl.constexpr, NAP: tl.constexpr, LOG: tl.constexpr):
    pid = tl.program_id(0)
    t0 = _now()
    # the next transfer's start word and log start: cleared for its CTAs' minimum (it cannot
    # begin before every CTA of this one has ended: one stream)
    tl.store(state_ptr + 2 + 1 - parity, 9223372036854775807)
    tl.store(state_ptr + 4 + 2 * ((slot + 1) % LOG), 9223372036854775807)
    free = tl.load(state_ptr + parity)
    duration = duration_ns.to(tl.int64)
    mine = tl.maximum(free, t0 - deliver_ns.to(tl.int64))
    # one start for every CTA: the earliest; a CTA that got its SM late holds to the same end
    first = tl.atomic_min(state_ptr + 2 + parity, mine)
    start = tl.minimum(first, mine)
    end = start + duration
    k = 0
    while k < pieces:
        base = ((pid * pieces + k).to(tl.int64) * piece_elems) % wrap
        for j in range(0, piece_elems, BLOCK):
            offs = base + j + tl.arange(0, BLOCK)
            x = tl.load(src_ptr + offs)
            tl.store(dst_ptr + offs, x)
        due = start + ((k + 1).to(tl.int64) * duration) // pieces
        t = _now()
        while t < due:
            if NAP:
                _nap()
            t = _now()
        k += 1
    t = _now()
    while t < end:
        if NAP:
            _nap()
        t = _now()
    tl.atomic_min(state_ptr + 4 + 2 * slot, start)
    tl.atomic_max(state_ptr + 5 + 2 * slot, t)
    tl.atomic_max(state_ptr + 1 - parity, t)


def _launcher():
    """qzero's cached launch of compiled Triton kernels (tens of microseconds less host time
    per call than Triton's own), or Triton's own where that is not importable."""
    try:
        from qzero.quant.triton_launch import Launcher

        return Launcher().launch
    except Exception:  # pragma: no cover - an older or newer qzero
        def launch(kernel, grid, args, consts, options):
            kernel[grid](*args, **consts, **options)

        return launch


class DeviceLink:
    """The link's stream and the device words of its timeline, on one GPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.state = torch.zeros(LOG_BASE + 2 * LOG, dtype=torch.int64, device=device)
        self.state[START:LOG_BASE] = NEVER
        self.state[LOG_BASE::2] = NEVER
        self.scratch: torch.Tensor | None = None
        self.count = 0  # transfers held so far
        self.indices: list[int] = []  # the link's transfer index of each held transfer (the newest LOG)
        self._launch = _launcher()

    def hold(self, index: int, seconds: float, delivered_bytes: int, model, wire) -> None:
        """Enqueue the hold of one transfer on the current stream (the link's)."""
        duration_ns = max(0, round(seconds * 1e9))
        deliver_ns = delivery_ns(delivered_bytes)
        ctas = model.ctas
        pieces = piece_elems = 0
        wrap = 1
        src = dst = self.state
        if model.traffic > 0 and ctas > 0:
            copy_bytes = model.traffic * max(wire.sent, wire.received) / 2  # a copy moves its bytes twice
            per_cta = copy_bytes / ctas / 4  # int32 elements
            if per_cta >= 1:
                if self.scratch is None:
                    self.scratch = torch.empty(2 * SCRATCH_BYTES // 4, dtype=torch.int32, device=self.device)
                    self.scratch.zero_()
                half = SCRATCH_BYTES // 4
                piece_elems = max(BLOCK, -(-int(per_cta / PIECES) // BLOCK) * BLOCK)
                pieces = max(1, round(per_cta / piece_elems))
                wrap = half - piece_elems
                src, dst = self.scratch[:half], self.scratch[half:]
        slot = self.count % LOG
        args = (self.state, src, dst, duration_ns, deliver_ns, pieces, piece_elems, wrap, self.count % 2, slot)
        self._launch(_hold_kernel, (max(1, ctas),), args, {"BLOCK": BLOCK, "NAP": not model.spin, "LOG": LOG},
                     {"num_warps": model.warps if ctas else 1})
        self.indices.append(index)
        if len(self.indices) > LOG:
            del self.indices[: len(self.indices) - LOG]
        self.count += 1

    def log(self) -> list[tuple[int, int, int]]:
        """``(transfer index, start_ns, end_ns)`` of the held transfers still in the log, oldest first."""
        torch.cuda.synchronize(self.device)
        rows = self.state[LOG_BASE:].view(-1, 2).tolist()
        first = self.count - len(self.indices)
        return [(idx, *rows[(first + k) % LOG]) for k, idx in enumerate(self.indices)]


@triton.jit(do_not_specialize=["slot"])
def _stamp_kernel(buf_ptr, slot):
    tl.store(buf_ptr + slot, _now())


class DeviceStamps:
    """Times on the GPU's global timer (the clock of :meth:`DeviceLink.log`) at points of the
    current stream: :meth:`stamp` enqueues one one-warp kernel that writes the timer into its
    slot of a buffer allocated up front; nothing synchronizes until :meth:`read`."""

    def __init__(self, device: torch.device, slots: int):
        self.device = device
        self.buf = torch.zeros(slots, dtype=torch.int64, device=device)
        self._launch = _launcher()

    def stamp(self, slot: int) -> None:
        """Enqueue the write of the timer into ``slot`` on the current stream."""
        if not 0 <= slot < self.buf.numel():
            raise IndexError(f"stamp slot {slot} outside the buffer's {self.buf.numel()}")
        self._launch(_stamp_kernel, (1,), (self.buf, slot), {}, {"num_warps": 1})

    def read(self) -> list[int]:
        """Every slot's timer value, nanoseconds (synchronizes)."""
        torch.cuda.synchronize(self.device)
        return self.buf.tolist()
