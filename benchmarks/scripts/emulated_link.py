"""An emulated link on one GPU: rank 0 of a fake DP-N world whose collectives move finite
data and hold a modelled link.

[Note: emulated link]
Vocabulary used here and in ``benchmarks/scripts/link_kernels.py`` and ``benchmarks/scripts/emulated_matrix.py``:

* **world**: one process is rank 0 of ``N`` ranks under torch's ``fake`` process group
  (``benchmarks/scripts/one_gpu.py``'s fake world): every shard size, bucket, partition and kernel local
  to rank 0 is that of DP-``N``. The collectives of ``torch.distributed`` that training
  code calls (:data:`EMULATED`) are replaced, in ``torch.distributed`` and in every module
  that imported them, by this module's.
* **delivery**: what a collective writes. Every output is what rank 0 would receive if
  every rank held rank 0's tensors: an all-gather repeats rank 0's input ``N`` times; a
  sum (all-reduce, reduce-scatter, reduce) is ``N`` times rank 0's contribution (an
  average, min or max is rank 0's own); a broadcast leaves the tensor as it is; an
  all-to-all gives rank 0, from rank ``s``, what rank 0 sends to rank ``s`` (with equal
  splits the output is the input), so a quantized payload of the same layout decodes as a
  real one does; a piece whose size differs from what rank 0 sends rank ``s`` (another
  layout) arrives as zero bits, which decode as zeros in every format and dtype. Values are finite wherever the inputs
  are; losses and norms of such a run are not those of a real DP-``N`` run.
* **wire bytes**: what one rank sends and receives per direction for a collective, by
  NCCL's ring algorithms (:func:`wire_bytes`): an all-gather of an ``n``-byte shard
  ``(N-1)·n`` each way; a reduce-scatter of ``B`` input bytes ``(N-1)/N·B``; an all-reduce
  ``2(N-1)/N·B``; a broadcast or reduce ``B``; an all-to-all the splits to and from the other
  ranks. Also the number of ring **steps** (``N-1``, ``2(N-1)`` for an all-reduce, 1 for an
  all-to-all or a barrier), each of which pays the link's latency once.
* **link**: one per process, shared by every collective in issue order (one FIFO, like the
  one NCCL stream of a process group). A :class:`LinkModel` gives its rate (bytes per second
  per direction), its latency per ring step, its **contention** (``ctas`` resident CTAs of
  ``warps`` warps each for as long as a transfer is on the link, standing for NCCL's
  kernels, and ``traffic``: HBM bytes those CTAs move per wire byte, paced over the
  transfer) and a **time scale** (``time_scale``: every transfer takes ``1/time_scale`` of
  its modelled time; set it to the ratio of another host's 1-GPU step to this host's to
  emulate that host's link against this host's faster compute).
* **transfer**: one collective on the link. It takes ``latency·steps + max(sent,
  received)/rate`` seconds (over ``time_scale``) and starts when the link is free and the
  issuing stream has reached the call.
* **hold**: on CUDA, a collective waits for its issuing stream on the link's own stream,
  delivers its outputs there, then one kernel (``benchmarks/scripts/link_kernels.py``) keeps the link
  stream busy until the transfer's modelled end; a synchronous call makes the issuing
  stream wait for that end, an asynchronous one returns a :class:`EmulatedWork` whose
  ``wait()`` makes the then current stream wait for it (NCCL's semantics). On the CPU the
  data moves at once and the host sleeps to the transfer's modelled end (a synchronous call
  before returning, an asynchronous one in ``wait()``).

* **cluster**: a :class:`Link` of another kind may charge a collective for its whole group
  instead of rank 0's bytes: every collective reaches :meth:`Link.place` with the call it
  stands for (:class:`Issued`: its group and sizes), and a link says which resources a
  transfer holds, when it starts on the host clock and which device links (streams) hold it on
  CUDA. ``benchmarks/scripts/emulated_cluster.py``'s ``ClusterLink`` is the two links of a
  cluster of nodes ([Note: emulated cluster]); the delivery and the holds are this module's.

Collectives not in :data:`EMULATED` (point-to-point, ``gather``/``scatter``, coalescing
managers, and the functional collectives DTensor uses) go to the fake process group as they
are: moved as it moves them, never on the link.

    python3 benchmarks/scripts/emulated_link.py --check        # on one GPU: every collective, sync and async
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

# ---------------------------------------------------------------------- the link model


@dataclass(frozen=True)
class LinkModel:
    """One link: rate per direction, latency per ring step, contention, time scale (see the note)."""

    name: str
    rate: float  # bytes per second, per direction; math.inf: no link
    latency: float = 0.0  # seconds per ring step
    ctas: int = 0  # CTAs resident while a transfer is on the link (0: one one-warp CTA holds it)
    warps: int = 16  # warps per resident CTA
    traffic: float = 0.0  # HBM bytes the resident CTAs move per wire byte, paced over the transfer
    spin: int = 0  # 1: the resident warps read the timer without pausing (keep issuing), 0: they nap
    time_scale: float = 1.0

    def __post_init__(self):
        if not self.rate > 0:
            raise ValueError(f"link {self.name}: rate must be positive, got {self.rate}")
        for what in ("latency", "traffic"):
            if not getattr(self, what) >= 0 or math.isnan(getattr(self, what)):
                raise ValueError(f"link {self.name}: {what} must be >= 0, got {getattr(self, what)}")
        if self.spin not in (0, 1):
            raise ValueError(f"link {self.name}: spin must be 0 or 1, got {self.spin}")
        if self.ctas < 0 or self.warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"link {self.name}: ctas must be >= 0 and warps one of 1..32 (a power of two), got "
                             f"ctas={self.ctas}, warps={self.warps}")
        if not self.time_scale > 0 or math.isinf(self.time_scale):
            raise ValueError(f"link {self.name}: time_scale must be positive and finite, got {self.time_scale}")
        if self.traffic > 0 and self.ctas == 0:
            raise ValueError(f"link {self.name}: traffic={self.traffic} needs ctas > 0 (the CTAs that move it)")

    def seconds(self, sent: int, received: int, steps: int) -> float:
        """How long one transfer holds the link."""
        if steps == 0 and sent == 0 and received == 0:
            return 0.0
        wire = 0.0 if math.isinf(self.rate) else max(sent, received) / self.rate
        return (self.latency * steps + wire) / self.time_scale

    @property
    def holds(self) -> bool:
        """Whether transfers take any time or resources at all (False for ``none``)."""
        return not math.isinf(self.rate) or self.latency > 0 or self.ctas > 0

    def describe(self) -> str:
        if not self.holds:
            return f"{self.name} (no link: collectives deliver, nothing is held)"
        text = f"{self.name}: {self.rate / 1e9:.4g} GB/s per direction, {1e6 * self.latency:.3g} us per ring step"
        text += f", {self.ctas} resident CTAs x {self.warps} warps" if self.ctas else ", one one-warp CTA holds it"
        if self.traffic:
            text += f", {self.traffic:g} HBM bytes per wire byte"
        if self.spin:
            text += ", spinning"
        if self.time_scale != 1.0:
            text += f", time scale {self.time_scale:.4g}"
        return text


#: The link regimes of the committed two-GPU results (BENCHMARKS.md), as models. Rates:
#: PCIe-class and NVLink from the bare all-gather of the INT8 payload of 2 Gi parameters at DP2
#: (``OUT/gather/dp2_pcie.md``: 1.141 GB per rank in 45.56 ms;
#: ``gather/dp2_nvlink_division_pack.md``: in 4.12 ms); Ethernet-class from one NCCL
#: all-gather of 2 Gi bf16 parameters, 2.147 GB per rank in 555 ms (a measurement on the two-GPU host
#: that is not among the committed results;
#: the gather benchmark's payload-only 2.88 GB/s is below what the whole-step results need:
#: FSDP2 moved 3.63 GB/s per direction over a whole 4B step there). Latencies: not measurable
#: from those results (at the buckets used, a transfer is milliseconds); 20 us per ring step,
#: 50 us on sockets. Contention (``ctas``, ``traffic``): calibrated against the whole-step
#: results, ``OUT/emulated/`` and BENCHMARKS.md (*Emulated link*).
REGIMES: dict[str, LinkModel] = {
    "none": LinkModel("none", math.inf),
    "pcie": LinkModel("pcie", 25.0e9, 20e-6),
    "ethernet": LinkModel("ethernet", 3.87e9, 50e-6),
    "nvlink": LinkModel("nvlink", 277e9, 20e-6),
}


def parse_link(text: str) -> LinkModel:
    """``REGIME`` or ``REGIME:key=value,...`` (keys: the :class:`LinkModel` fields but ``name``;
    ``rate`` in bytes/s, ``latency`` in seconds) -> a :class:`LinkModel`. Raises ValueError."""
    name, _, rest = text.strip().partition(":")
    if name not in REGIMES:
        raise ValueError(f"unknown link {name!r}: one of {', '.join(REGIMES)} (with :key=value,... to change it)")
    fields = {f.name: f.type for f in dataclasses.fields(LinkModel) if f.name != "name"}
    changes = {}
    for pair in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or key not in fields:
            raise ValueError(f"link {text!r}: expected key=value with key one of {', '.join(fields)}, got {pair!r}")
        try:
            changes[key] = int(float(value)) if fields[key] in ("int", int) else float(value)
        except ValueError:
            raise ValueError(f"link {text!r}: {key} must be a number, got {value!r}") from None
    model = REGIMES[name]
    return dataclasses.replace(model, name=text.strip() if changes else model.name, **changes)


@dataclass(frozen=True)
class Wire:
    """What one rank sends and receives, per direction, for one collective, and its ring steps."""

    sent: int
    received: int
    steps: int


@dataclass(frozen=True)
class Issued:
    """One collective as rank 0 issued it: its name (as :func:`wire_bytes` names it), its
    process group (None: the world) and its sizes as :func:`wire_bytes` reads them (``nbytes``; an
    all-to-all's ``send``/``recv`` bytes per rank of the group, in group order). A one-link
    world charges only the :class:`Wire` it implies; a cluster's link
    (``benchmarks/scripts/emulated_cluster.py``) charges the whole group from it."""

    op: str
    group: object = None
    nbytes: int = 0
    send: tuple | None = None
    recv: tuple | None = None


def wire_bytes(op: str, world: int, nbytes: int = 0, send: list[int] | None = None,
               recv: list[int] | None = None, rank: int = 0) -> Wire:
    """Wire bytes of one collective at world size ``world`` (see the note). ``nbytes``: the
    input shard of an all-gather, the whole input of a reduce-scatter, the tensor of an
    all-reduce, broadcast or reduce; ``send``/``recv``: an all-to-all's bytes to and from each
    rank (this rank's own entry does not cross the link)."""
    if world < 1:
        raise ValueError(f"world size must be at least 1, got {world}")
    if world == 1:
        return Wire(0, 0, 0)
    n = world
    if op == "all_gather":
        return Wire((n - 1) * nbytes, (n - 1) * nbytes, n - 1)
    if op == "reduce_scatter":
        b = (n - 1) * (nbytes // n)
        return Wire(b, b, n - 1)
    if op == "all_reduce":
        b = 2 * (n - 1) * nbytes // n
        return Wire(b, b, 2 * (n - 1))
    if op in ("broadcast", "reduce"):
        return Wire(nbytes, nbytes, n - 1)
    if op == "all_to_all":
        if send is None or recv is None or len(send) != n or len(recv) != n:
            raise ValueError(f"an all-to-all at world size {n} needs {n} send and receive sizes")
        return Wire(sum(send) - send[rank], sum(recv) - recv[rank], 1)
    if op == "barrier":
        return Wire(0, 0, 1)
    raise ValueError(f"no wire model for collective {op!r}")


# ---------------------------------------------------------------------- the link's timeline


@dataclass
class Transfer:
    """One collective on the link, in issue order. ``start``/``end`` are the modelled times on
    the host clock for CPU tensors; on CUDA the device keeps them (:meth:`Link.device_log`)."""

    index: int
    op: str
    sent: int
    received: int
    steps: int
    seconds: float
    device: str
    is_async: bool
    start: float | None = None
    end: float | None = None
    waits: int = 0  # how many times its work was waited for
    charge: object = None  # a cluster link's qzero.plan Cost of the whole group (None on one link)


@dataclass
class OpTotals:
    calls: int = 0
    sent: int = 0
    received: int = 0
    seconds: float = 0.0
    nic_sent: float = 0.0  # a cluster link's: bytes every node together sent across the network
    intra_sent: float = 0.0  # a cluster link's: bytes moved inside nodes


class Link:
    """The one link of this process: transfers in issue order, each starting when the one
    before it has ended (CPU tensors: on the host clock; CUDA tensors: on the device, through
    :class:`link_kernels.DeviceLink`). ``clock``/``sleep`` are the host's unless given (tests
    give a fake clock). ``keep`` transfers are kept in :attr:`transfers` (the newest)."""

    def __init__(self, model: LinkModel, clock=time.perf_counter, sleep=time.sleep, keep: int = 4096):
        self.model = model
        self.clock, self.sleep = clock, sleep
        self.transfers: collections.deque[Transfer] = collections.deque(maxlen=keep)
        self.totals: dict[str, OpTotals] = {}
        self.count = 0
        self.free_at = 0.0  # host clock: when the last CPU transfer ends
        self.busy: dict[str, float] = {}  # seconds charged per resource (:meth:`resources`), cumulative
        self._device = None  # link_kernels.DeviceLink, made on the first CUDA transfer

    def place(self, op: str, wire: Wire, device: torch.device, is_async: bool,
              issued: Issued | None = None) -> Transfer:
        """Book one transfer (its bytes, its modelled time) in issue order; ``issued``: the call
        it stands for (what a link that charges whole groups reads)."""
        t = Transfer(self.count, op, wire.sent, wire.received, wire.steps, 0.0, device.type, is_async)
        t.seconds = self.charge(t, wire, issued)
        self.count += 1
        tot = self.totals.setdefault(op, OpTotals())
        tot.calls += 1
        tot.sent += t.sent
        tot.received += t.received
        tot.seconds += t.seconds
        if t.charge is not None:
            tot.nic_sent += t.charge.nic_sent
            tot.intra_sent += t.charge.intra_sent
        for r in self.resources(t):
            self.busy[r] = self.busy.get(r, 0.0) + t.seconds
        if device.type != "cuda":
            t.start, t.end = self.schedule(t, self.clock())
        self.transfers.append(t)
        return t

    # -- what a link of another kind changes (benchmarks/scripts/emulated_cluster.py)
    def charge(self, t: Transfer, wire: Wire, issued: Issued | None) -> float:
        """The seconds ``t`` holds the link: rank 0's bytes on the one link."""
        return self.model.seconds(wire.sent, wire.received, wire.steps)

    def resources(self, t: Transfer) -> tuple[str, ...]:
        """The resources ``t`` holds: the one link."""
        return ("link",)

    def schedule(self, t: Transfer, issued: float) -> tuple[float, float]:
        """A CPU transfer's (start, end) on the host clock: after the one before it, not before its issue."""
        start = max(issued, self.free_at)
        self.free_at = start + t.seconds
        return start, self.free_at

    def lanes(self, t: Transfer, device: torch.device) -> list:
        """The device links a CUDA transfer holds, the first running it: the one link's."""
        return [self.device(device)]

    @property
    def holds(self) -> bool:
        """Whether transfers take any time or resources at all."""
        return self.model.holds

    def describe(self) -> str:
        return self.model.describe()

    def hold_host(self, t: Transfer) -> None:
        """Block the host until CPU transfer ``t`` has ended on the link."""
        now = self.clock()
        if t.end is not None and t.end > now:
            self.sleep(t.end - now)

    def device(self, device: torch.device):
        if self._device is None:
            import link_kernels

            self._device = link_kernels.DeviceLink(device)
        return self._device

    def device_log(self) -> list[tuple[int, int, int]]:
        """``(index, start_ns, end_ns)`` on the GPU's global timer for the CUDA transfers still
        in the device's log (synchronizes)."""
        return [] if self._device is None else self._device.log()

    def busiest_since(self, before: dict[str, float]) -> float:
        """Seconds charged since ``before`` (a copy of :attr:`busy`) on the busiest resource: no
        steady step is shorter."""
        return max((v - before.get(r, 0.0) for r, v in self.busy.items()), default=0.0)

    def snapshot(self) -> dict[str, OpTotals]:
        return {k: dataclasses.replace(v) for k, v in self.totals.items()}


def totals_since(link: Link, before: dict[str, OpTotals]) -> dict[str, dict]:
    """What the link carried since ``before`` (a :meth:`Link.snapshot`), per collective."""
    out = {}
    for op, now in link.totals.items():
        was = before.get(op, OpTotals())
        if now.calls > was.calls:
            out[op] = {"calls": now.calls - was.calls, "sent": now.sent - was.sent,
                       "received": now.received - was.received, "seconds": now.seconds - was.seconds}
            if now.nic_sent or now.intra_sent:  # a cluster link's whole-group bytes
                out[op].update(nic_sent=now.nic_sent - was.nic_sent, intra_sent=now.intra_sent - was.intra_sent)
    return out


# ---------------------------------------------------------------------- works


class EmulatedWork(dist.Work):
    """What an emulated collective returns for ``async_op=True`` (a ``torch.distributed.Work``,
    as FSDP2 checks). ``wait()``: on CUDA the current stream waits for the transfer's end; on
    the CPU the host sleeps to it."""

    def __init__(self, link: Link, transfer: Transfer, event: torch.cuda.Event | None, result):
        super().__init__()
        self._link, self.transfer, self._event, self._result = link, transfer, event, result

    def wait(self, timeout=None) -> bool:
        self.transfer.waits += 1
        self._follow()
        return True

    def _follow(self) -> None:
        """Order what comes next after the transfer: the current stream (CUDA) or the host (CPU)."""
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
        else:
            self._link.hold_host(self.transfer)

    def synchronize(self) -> None:
        self.wait()

    def is_completed(self) -> bool:
        if self._event is not None:
            return self._event.query()
        return self.transfer.end is None or self._link.clock() >= self.transfer.end

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def get_future(self):
        fut = torch.futures.Future()
        fut.set_result(self._result)
        return fut


# ---------------------------------------------------------------------- deliveries


def _red(op):
    """The reduction type of ``op`` (a ``ReduceOp``, a ``RedOpType`` or a premul-sum)."""
    return getattr(op, "op", op)


def _reduced(x: torch.Tensor, op, world: int, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """``op`` over ``world`` copies of ``x``, into ``out`` (in place into ``x`` when None)."""
    R = dist.ReduceOp
    kind = _red(op)
    dst = x if out is None else out
    if kind == R.SUM or kind == R.PREMUL_SUM:
        factor = world * (getattr(op, "factor", None) or 1.0) if kind == R.PREMUL_SUM else world
        if x.dtype == torch.bool:
            factor = 1
        if factor == 1:
            return None if out is None else dst.copy_(x)
        return torch.mul(x, factor, out=dst)
    if kind in (R.AVG, R.MIN, R.MAX, R.BAND, R.BOR):
        return None if out is None else dst.copy_(x)
    if kind == R.BXOR:
        return dst.copy_(x) if world % 2 else dst.zero_()
    if kind == R.PRODUCT:
        return torch.pow(x, world, out=dst)
    raise ValueError(f"emulated link: reduce op {op} not supported")


def _repeat_into(out: torch.Tensor, x: torch.Tensor) -> None:
    """Every row of ``out`` (``N`` rows) becomes ``x``; a row that is ``x`` itself (an
    in-place all-gather: rank 0's input is its own slot of the output) is left alone."""
    n = out.shape[0]
    own = next((k for k in range(n) if out[k].data_ptr() == x.data_ptr()), None)
    if own is None:
        out.copy_(x.reshape(1, -1).expand(n, -1))
        return
    if own > 0:
        out[:own].copy_(x.reshape(1, -1).expand(own, -1))
    if own + 1 < n:
        out[own + 1:].copy_(x.reshape(1, -1).expand(n - own - 1, -1))


# ---------------------------------------------------------------------- the emulated world


#: The collectives emulated here: torch.distributed's names (both of each pair that torch
#: renamed: ``all_gather_single`` / ``all_gather_into_tensor`` and the others).
EMULATED = ("all_gather_into_tensor", "all_gather_single", "_all_gather_base", "reduce_scatter_tensor",
            "reduce_scatter_single", "_reduce_scatter_base", "all_to_all_single", "all_reduce", "broadcast",
            "reduce", "all_gather", "reduce_scatter", "all_to_all", "all_reduce_coalesced", "barrier")


class EmulatedWorld:
    """Rank 0 of a fake DP-``world`` world whose collectives deliver (see the note) and hold
    :attr:`link`. Made by :func:`init_emulated_world`."""

    def __init__(self, world: int, model: LinkModel, clock=time.perf_counter, sleep=time.sleep,
                 link: Link | None = None):
        self.world = world
        self.link = link if link is not None else Link(model, clock=clock, sleep=sleep)
        self.originals: dict[str, object] = {}
        self.rebound: list[tuple[object, str, object]] = []

    def _n(self, group) -> int:
        """The world size of ``group`` (this world's for the default group)."""
        return self.world if group is None or group is dist.group.WORLD else group.size()

    def set_link(self, model: LinkModel) -> None:
        """Change the link's model from the next collective on (synchronize first: transfers
        already queued keep the model they were issued with)."""
        self.link.model = model

    # -- one collective: book it, deliver, hold
    def _run(self, call: Issued, tensors: list[torch.Tensor], deliver, async_op: bool, result=None,
             host_sync: bool = False):
        device = next((t.device for t in tensors if t.device.type == "cuda"), torch.device("cpu"))
        wire = wire_bytes(call.op, self._n(call.group), call.nbytes, call.send, call.recv)
        t = self.link.place(call.op, wire, device, async_op, call)
        if device.type != "cuda":
            deliver()
            work = EmulatedWork(self.link, t, None, result)
            if not async_op:
                self.link.hold_host(t)
                return None
            return work
        lanes = self.link.lanes(t, device)  # the first runs it; the others wait for it and it for them
        dev = lanes[0]
        caller = torch.cuda.current_stream(device)
        stream = dev.stream
        stream.wait_stream(caller)
        for other in lanes[1:]:
            stream.wait_stream(other.stream)
        torch.cuda.set_stream(stream)
        try:
            written = deliver()
            if self.link.holds and wire.steps:
                dev.hold(t.index, t.seconds, written or 0, self.link.model, wire)
            event = torch.cuda.Event()
            event.record(stream)
        finally:
            torch.cuda.set_stream(caller)
        for other in lanes[1:]:
            other.stream.wait_event(event)
        for x in tensors:
            if x.device.type == "cuda":
                x.record_stream(stream)
        work = EmulatedWork(self.link, t, event, result)
        if host_sync:
            event.synchronize()
        if not async_op:
            work._follow()  # NCCL's synchronous call: the issuing stream waits for the transfer's end
            return None
        return work

    # -- the collectives (torch.distributed's signatures)
    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        n = self._n(group)
        if output_tensor.numel() != n * input_tensor.numel():
            raise ValueError(f"all_gather_into_tensor: output has {output_tensor.numel()} elements, expected "
                             f"{n} x {input_tensor.numel()}")

        def deliver():
            _repeat_into(output_tensor.view(n, -1), input_tensor.reshape(-1))
            return output_tensor.numel() * output_tensor.element_size()

        call = Issued("all_gather", group, input_tensor.numel() * input_tensor.element_size())
        return self._run(call, [output_tensor, input_tensor], deliver, async_op, [output_tensor])

    def reduce_scatter_tensor(self, output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        n = self._n(group)
        if input.numel() != n * output.numel():
            raise ValueError(f"reduce_scatter_tensor: input has {input.numel()} elements, expected {n} x "
                             f"{output.numel()}")

        def deliver():
            _reduced(input.reshape(-1)[: output.numel()].view_as(output), op, n, out=output)
            return 2 * output.numel() * output.element_size()

        call = Issued("reduce_scatter", group, input.numel() * input.element_size())
        return self._run(call, [output, input], deliver, async_op, [output])

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        n = self._n(group)

        def deliver():
            _reduced(tensor, op, n)
            return 2 * tensor.numel() * tensor.element_size()

        call = Issued("all_reduce", group, tensor.numel() * tensor.element_size())
        return self._run(call, [tensor], deliver, async_op, [tensor])

    def all_reduce_coalesced(self, tensors, op=dist.ReduceOp.SUM, group=None, async_op=False):
        n = self._n(group)

        def deliver():
            for x in tensors:
                _reduced(x, op, n)
            return sum(2 * x.numel() * x.element_size() for x in tensors)

        call = Issued("all_reduce", group, sum(x.numel() * x.element_size() for x in tensors))
        return self._run(call, list(tensors), deliver, async_op, list(tensors))

    def broadcast(self, tensor, src=None, group=None, async_op=False, group_src=None):
        call = Issued("broadcast", group, tensor.numel() * tensor.element_size())
        return self._run(call, [tensor], lambda: 0, async_op, [tensor])

    def reduce(self, tensor, dst=None, op=dist.ReduceOp.SUM, group=None, async_op=False, group_dst=None):
        n = self._n(group)
        if dst is None and group_dst is None:
            raise ValueError("reduce: give dst or group_dst")
        mine = (group_dst if group_dst is not None else dist.get_group_rank(group or dist.group.WORLD, dst)) == 0

        def deliver():
            if mine:
                _reduced(tensor, op, n)
                return 2 * tensor.numel() * tensor.element_size()
            return 0

        call = Issued("reduce", group, tensor.numel() * tensor.element_size())
        return self._run(call, [tensor], deliver, async_op, [tensor])

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        n = self._n(group)
        if len(tensor_list) != n:
            raise ValueError(f"all_gather: {len(tensor_list)} outputs for world size {n}")

        def deliver():
            for out in tensor_list:
                if out.data_ptr() != tensor.data_ptr():
                    out.copy_(tensor.view_as(out))
            return sum(out.numel() * out.element_size() for out in tensor_list)

        call = Issued("all_gather", group, tensor.numel() * tensor.element_size())
        return self._run(call, [*tensor_list, tensor], deliver, async_op, list(tensor_list))

    def reduce_scatter(self, output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        n = self._n(group)
        if len(input_list) != n:
            raise ValueError(f"reduce_scatter: {len(input_list)} inputs for world size {n}")

        def deliver():
            _reduced(input_list[0].view_as(output), op, n, out=output)
            return 2 * output.numel() * output.element_size()

        call = Issued("reduce_scatter", group, sum(x.numel() * x.element_size() for x in input_list))
        return self._run(call, [output, *input_list], deliver, async_op, [output])

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        n = self._n(group)
        send = list(input_split_sizes) if input_split_sizes else [input.shape[0] // n] * n
        recv = list(output_split_sizes) if output_split_sizes else [output.shape[0] // n] * n
        if len(send) != n or len(recv) != n or sum(send) != input.shape[0] or sum(recv) != output.shape[0]:
            raise ValueError(f"all_to_all_single: split sizes {send} / {recv} do not split input {input.shape[0]} / "
                             f"output {output.shape[0]} into {n} parts")
        row = math.prod(input.shape[1:])  # elements per first-dimension index
        if math.prod(output.shape[1:]) != row:
            raise ValueError(f"all_to_all_single: input rows of {row} elements, output rows of "
                             f"{math.prod(output.shape[1:])}")

        def deliver():
            if send == recv:
                if output.data_ptr() != input.data_ptr():
                    output.copy_(input)  # rank s sends rank 0 what rank 0 sends rank s: the input, as it is
            else:
                o, i = output.reshape(-1), input.reshape(-1)
                at_o = at_i = 0
                for s in range(n):
                    piece = o[at_o: at_o + recv[s] * row]
                    if recv[s] == send[s]:
                        piece.copy_(i[at_i: at_i + send[s] * row])
                    else:  # another size is another layout: zero bits decode as zeros in any format
                        piece.zero_()
                    at_o, at_i = at_o + recv[s] * row, at_i + send[s] * row
            return output.numel() * output.element_size()

        size = row * input.element_size()
        call = Issued("all_to_all", group, send=tuple(s * size for s in send), recv=tuple(r * size for r in recv))
        return self._run(call, [output, input], deliver, async_op, [output])

    def all_to_all(self, output_tensor_list, input_tensor_list, group=None, async_op=False):
        n = self._n(group)
        if len(output_tensor_list) != n or len(input_tensor_list) != n:
            raise ValueError(f"all_to_all: {len(output_tensor_list)} outputs and {len(input_tensor_list)} inputs "
                             f"for world size {n}")

        def deliver():
            for o, i in zip(output_tensor_list, input_tensor_list):
                if o.numel() == i.numel():
                    o.copy_(i.view_as(o))
                else:
                    o.zero_()
            return sum(o.numel() * o.element_size() for o in output_tensor_list)

        call = Issued("all_to_all", group, send=tuple(x.numel() * x.element_size() for x in input_tensor_list),
                      recv=tuple(x.numel() * x.element_size() for x in output_tensor_list))
        return self._run(call, [*output_tensor_list, *input_tensor_list], deliver, async_op,
                         list(output_tensor_list))

    def barrier(self, group=None, async_op=False, device_ids=None, timeout=None):
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        probe = torch.zeros(1, device="cuda" if cuda else "cpu")
        # NCCL's barrier is a one-element all-reduce the host then waits for
        return self._run(Issued("barrier", group), [probe], lambda: 0, async_op, host_sync=not async_op)

    # aliases under torch's other names
    all_gather_single = all_gather_into_tensor
    _all_gather_base = all_gather_into_tensor
    reduce_scatter_single = reduce_scatter_tensor
    _reduce_scatter_base = reduce_scatter_tensor

    # -- installing
    def install(self) -> None:
        """Put this world's collectives in place of torch.distributed's: in ``torch.distributed``,
        ``torch.distributed.distributed_c10d`` and every loaded module holding one of them."""
        import torch.distributed.distributed_c10d as c10d

        for name in EMULATED:
            for mod in (dist, c10d):
                fn = getattr(mod, name, None)
                if fn is None or getattr(fn, "__emulated__", False):
                    continue
                self.originals.setdefault(f"{mod.__name__}.{name}", fn)
                setattr(mod, name, self._wrapped(name, fn))
        by_id = {id(fn): key.rsplit(".", 1)[1] for key, fn in self.originals.items()}
        for mod in list(sys.modules.values()):
            if mod is None or mod in (dist, c10d) or not hasattr(mod, "__dict__"):
                continue
            for attr, value in list(vars(mod).items()):
                if callable(value) and id(value) in by_id:
                    self.rebound.append((mod, attr, value))
                    setattr(mod, attr, getattr(dist, by_id[id(value)], None) or getattr(c10d, by_id[id(value)]))

    def _wrapped(self, name: str, fn):
        mine = getattr(self, name)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            return mine(*args, **kwargs)

        call.__emulated__ = True
        call.__emulated_by__ = self
        return call

    def uninstall(self) -> None:
        """Restore torch.distributed's collectives (and every module rebound by :meth:`install`)."""
        import torch.distributed.distributed_c10d as c10d

        for key, fn in self.originals.items():
            modname, name = key.rsplit(".", 1)
            setattr(dist if modname == dist.__name__ else c10d, name, fn)
        for mod, attr, value in self.rebound:
            setattr(mod, attr, value)
        # a module imported while this world was installed took a wrapper by name: give it the original
        for mod in list(sys.modules.values()):
            if mod is None or not hasattr(mod, "__dict__"):
                continue
            for attr, value in list(vars(mod).items()):
                if callable(value) and getattr(value, "__emulated_by__", None) is self:
                    setattr(mod, attr, value.__wrapped__)
        self.originals.clear()
        self.rebound.clear()


_WORLD: EmulatedWorld | None = None


def init_emulated_world(world: int, link: LinkModel | str | Link = "none", clock=time.perf_counter,
                        sleep=time.sleep) -> EmulatedWorld:
    """Make this process rank 0 of ``world`` (torch's fake process group) with emulated
    collectives on ``link`` (a :class:`LinkModel` or its text, :func:`parse_link`, or a
    :class:`Link` already made, which brings its own clock)."""
    global _WORLD
    from one_gpu import init_fake_world

    made = link if isinstance(link, Link) else None
    model = made.model if made is not None else parse_link(link) if isinstance(link, str) else link
    if _WORLD is not None:
        raise RuntimeError("an emulated world is already installed in this process")
    init_fake_world(world)
    _WORLD = EmulatedWorld(world, model, clock=clock, sleep=sleep, link=made)
    _WORLD.install()
    return _WORLD


def close_emulated_world() -> None:
    """Undo :func:`init_emulated_world` (restore the collectives, destroy the fake group)."""
    global _WORLD
    if _WORLD is not None:
        _WORLD.uninstall()
        _WORLD = None
    if dist.is_initialized():
        dist.destroy_process_group()


def current() -> EmulatedWorld | None:
    return _WORLD


# ---------------------------------------------------------------------- check on one GPU


def _check(world: int = 2) -> int:
    """Every emulated collective on CUDA tensors, sync and async from a side stream: outputs
    written (poisoned before) with the values of the note, one transfer booked each; then a
    burst of large async all-gathers from two streams: each held for its modelled time (the
    device's log against the model) and one at a time in issue order; and the host time of
    one emulated call."""
    w = init_emulated_world(world, "pcie")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    n = world
    g = torch.Generator(device=dev).manual_seed(0)
    failures = []
    m = 1 << 20

    def rnd(numel, dtype=torch.float32):
        return torch.randn(numel, generator=g, device=dev).to(dtype)

    def case_ag(a):
        x, o = rnd(m, torch.bfloat16), torch.full((n * m,), float("nan"), device=dev, dtype=torch.bfloat16)
        return dist.all_gather_into_tensor(o, x, async_op=a), o, lambda: torch.equal(o.view(n, m), x.expand(n, m))

    def case_rs(a):
        x, o = rnd(n * m), torch.full((m,), float("nan"), device=dev)
        return dist.reduce_scatter_tensor(o, x, async_op=a), o, lambda: torch.allclose(o, n * x[:m])

    def case_a2a(a):
        x = torch.randint(0, 255, (n * m,), device=dev, dtype=torch.uint8, generator=g)
        o = torch.full((n * m,), 7, device=dev, dtype=torch.uint8)
        return dist.all_to_all_single(o, x, async_op=a), o, lambda: torch.equal(o, x)

    def case_ar(a):
        x = rnd(m)
        t = x.clone()
        return dist.all_reduce(t, async_op=a), t, lambda: torch.allclose(t, n * x)

    def case_bc(a):
        x = rnd(m, torch.bfloat16)
        t = x.clone()
        return dist.broadcast(t, src=n - 1, async_op=a), t, lambda: torch.equal(t, x)

    def case_red(a):
        x = rnd(m)
        t = x.clone()
        return dist.reduce(t, dst=0, async_op=a), t, lambda: torch.allclose(t, n * x)

    cases = {"all_gather_into_tensor": case_ag, "reduce_scatter_tensor": case_rs, "all_to_all_single": case_a2a,
             "all_reduce": case_ar, "broadcast": case_bc, "reduce": case_red}
    for name, make in cases.items():
        for mode in ("sync", "async"):
            before = w.link.count
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                work, out, right = make(mode == "async")
            if work is not None:
                work.wait()  # the current stream now follows the transfer
            else:
                torch.cuda.current_stream().wait_stream(side)
            finite = bool(torch.isfinite(out.float()).all())
            ok = finite and bool(right()) and w.link.count == before + 1
            t = w.link.transfers[-1]
            print(f"{'PASS' if ok else 'FAIL'} {name} ({mode}, DP{n}): {t.sent:,} bytes sent, "
                  f"{1e3 * t.seconds:.3f} ms modelled", flush=True)
            if not ok:
                failures.append(f"{name} {mode}")
    # a burst: 6 all-gathers of 64 MiB outputs from two streams, issued back to back
    torch.cuda.synchronize()
    first = w.link.count
    big = [rnd((32 << 20) // n, torch.bfloat16) for _ in range(2)]
    outs = [torch.empty(n * big[0].numel(), device=dev, dtype=torch.bfloat16) for _ in range(2)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for st in streams:
        st.wait_stream(torch.cuda.current_stream())
    works = []
    for k in range(6):
        with torch.cuda.stream(streams[k % 2]):
            works.append(dist.all_gather_into_tensor(outs[k % 2], big[k % 2], async_op=True))
    for wk in works:
        wk.wait()
    log = [row for row in w.link.device_log() if row[0] >= first]
    by_index = {t.index: t for t in w.link.transfers}
    errors = [abs((end - start) / 1e9 - by_index[i].seconds) / by_index[i].seconds for i, start, end in log]
    worst = max(errors) if errors else 1.0
    order = [i for i, _, _ in log] == sorted(i for i, _, _ in log) and all(
        b[1] >= a[2] - 1_000 for a, b in zip(log, log[1:]))  # each starts as (or after) the one before ends
    print(f"{'PASS' if worst < 0.02 and len(log) == 6 else 'FAIL'} 6 transfers of {1e3 * by_index[first].seconds:.3f} "
          f"ms modelled each, held for {', '.join(f'{(b - a) / 1e6:.3f}' for _, a, b in log)} ms "
          f"(worst relative error {worst:.4f})", flush=True)
    print(f"{'PASS' if order else 'FAIL'} one at a time in issue order: starts after the previous end by "
          f"{', '.join(f'{(b[1] - a[2]) / 1e3:.1f}' for a, b in zip(log, log[1:]))} us", flush=True)
    failures += [] if worst < 0.02 and len(log) == 6 else ["hold"]
    failures += [] if order else ["order"]
    # held under load: 5 ms transfers while matrix products keep every SM busy
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    for spec in ("pcie", "pcie:ctas=16", "pcie:ctas=16,spin=1"):
        w.set_link(parse_link(spec))
        torch.cuda.synchronize()
        first = w.link.count
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x = torch.empty(int(5e-3 * w.link.model.rate) // (n - 1) // 2, device=dev, dtype=torch.bfloat16)
            o = torch.empty(n * x.numel(), device=dev, dtype=torch.bfloat16)
            works = [dist.all_gather_into_tensor(o, x, async_op=True) for _ in range(4)]
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(20):
            torch.mm(a, a)
        e1.record()
        for wk in works:
            wk.wait()
        log = [row for row in w.link.device_log() if row[0] >= first]
        held = [(b_ - a_) / 1e6 for _, a_, b_ in log]
        print(f"under load, {spec}: 4 transfers of {1e3 * w.link.transfers[-1].seconds:.3f} ms held for "
              f"{', '.join(f'{h:.3f}' for h in held)} ms; 20 products of 8192^3 took {e0.elapsed_time(e1):.1f} ms",
              flush=True)
    w.set_link(parse_link("pcie"))
    # host time of one emulated call (a small all-reduce, async, on the current stream)
    t = torch.ones(1024, device=dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        dist.all_reduce(t, async_op=True)
    host = (time.perf_counter() - t0) / 200
    torch.cuda.synchronize()
    print(f"host time per emulated collective: {1e6 * host:.1f} us", flush=True)
    close_emulated_world()
    print("ALL PASS" if not failures else f"FAILED: {failures}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="check every emulated collective on one GPU")
    ap.add_argument("--world", type=int, default=2)
    a = ap.parse_args()
    if a.check:
        raise SystemExit(_check(a.world))
    ap.print_help()
