"""Multi-rank benchmarks on a machine with one GPU.

Two ways to run what is written for several GPUs on a single one, each good for some
questions and not for others:

* **A fake world** (``init_fake_world(n)``): one process is rank 0 of ``n`` under torch's
  ``fake`` process group, whose collectives return at once, moving nothing (they fill their
  outputs as if every rank had sent what rank 0 sends). Everything local to rank 0 runs as
  at DP-``n``: its shard sizes, buckets, staging buffers, pack and unpack kernels and their
  host launches, the optimizer on its partition. Good for peak memory (allocations do not
  depend on the values) and for the step time an engine's own local work costs without any
  link; says nothing of the link or of NCCL's kernels. The other ranks' values are not
  theirs, so losses are meaningless.
* **Ranks sharing one GPU** (``route_collectives()`` before the code under test is
  imported, then ``init_process_group("gloo")`` and ``share_one_gpu()``): ``n`` processes
  all on ``cuda:0``. NCCL refuses two ranks on one device, so every collective on CUDA
  tensors goes through the ranks' device buffers, opened by each other through CUDA IPC
  (:class:`SharedGPU`). The outputs are the values NCCL delivers at world size 2 (data
  movement is exact; a sum of two ranks is order-free), so the numerics of a multi-rank run
  are reproduced, e.g. for a convergence study. Step times are not representative: every
  collective synchronizes the host.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist


# the fake world lives in the package (``qzero bench memory --fake-world`` uses it too)
from qzero.app.benchmarks.fake_world import init_fake_world, launcher_environment  # noqa: E402,F401


class _Done:
    """What a collective between ranks sharing a GPU returns for ``async_op=True``: it has
    finished when the call returns; ``wait()`` orders the caller's current stream after it."""

    def __init__(self, event: torch.cuda.Event | None):
        self.event = event

    def wait(self, timeout=None) -> bool:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
        return True

    def is_completed(self) -> bool:
        return True


#: The collectives routed through :class:`SharedGPU` for CUDA tensors.
SHARED = ("all_reduce", "broadcast", "reduce", "reduce_scatter_tensor", "all_gather_into_tensor",
          "all_to_all_single", "all_gather")
_ALIGN = 256


class SharedGPU:
    """Collectives between processes on one GPU through each other's device memory.

    Every rank owns one device buffer of ``capacity`` bytes, opened by the others through
    CUDA IPC. A collective: each rank copies what it sends into its own buffer (a header of
    its all-to-all send sizes first), synchronizes its stream, meets the others at a gloo
    barrier, reads what it needs from every rank's buffer (device to device) and reduces it in
    rank order where the collective reduces, synchronizes and meets them again (so nobody
    overwrites a buffer still being read). Data movement is exact; a sum of two ranks is
    order-free, so at world size 2 the values are those NCCL delivers."""

    def __init__(self, capacity: int):
        from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.capacity = capacity
        self.mine = torch.zeros(capacity, dtype=torch.uint8, device="cuda")
        _, args = reduce_tensor(self.mine)
        handles = [None] * self.world
        dist.all_gather_object(handles, args)
        self.bufs = [self.mine if r == self.rank else rebuild_cuda_tensor(*handles[r]) for r in range(self.world)]
        self.header = _ALIGN  # bytes reserved for the all-to-all sizes (int64 each)
        if 8 * self.world > self.header:
            raise SystemExit(f"SharedGPU: world size {self.world} too large for its {self.header}-byte header")

    def close(self) -> None:
        """Release the other ranks' buffers, then wait for every rank to have done so (a
        buffer's owner must outlive the processes that opened it)."""
        torch.cuda.synchronize()
        self.bufs = [self.mine]
        dist.barrier()

    def _view(self, r: int, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if offset + nbytes > self.capacity:
            raise SystemExit(f"SharedGPU: a collective needs {offset + nbytes:,} bytes of buffer, more than its "
                             f"{self.capacity:,}: raise the capacity")
        return self.bufs[r][offset : offset + nbytes].view(dtype)

    def _publish(self, x: torch.Tensor, sizes: list[int] | None = None) -> None:
        if sizes is not None:
            self._view(self.rank, 0, len(sizes), torch.int64).copy_(torch.tensor(sizes, dtype=torch.int64))
        self._view(self.rank, self.header, x.numel(), x.dtype).copy_(x.reshape(-1))
        torch.cuda.current_stream().synchronize()
        dist.barrier()

    def _done(self, async_op: bool):
        torch.cuda.current_stream().synchronize()
        dist.barrier()
        event = torch.cuda.Event()
        event.record()
        return _Done(event) if async_op else None

    def _reduce(self, parts: list[torch.Tensor], op) -> torch.Tensor:
        acc = parts[0].clone()
        for p in parts[1:]:
            if op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                acc += p
            elif op == dist.ReduceOp.MAX:
                torch.maximum(acc, p, out=acc)
            elif op == dist.ReduceOp.MIN:
                torch.minimum(acc, p, out=acc)
            else:
                raise SystemExit(f"SharedGPU: reduce op {op} not supported")
        if op == dist.ReduceOp.AVG:
            acc /= self.world
        return acc

    def _parts(self, numel: int, dtype, start: int = 0) -> list[torch.Tensor]:
        size = torch.empty((), dtype=dtype).element_size()
        return [self._view(r, self.header + start * size, numel, dtype) for r in range(self.world)]

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        self._publish(tensor)
        tensor.copy_(self._reduce(self._parts(tensor.numel(), tensor.dtype), op).view_as(tensor))
        return self._done(async_op)

    def reduce(self, tensor, dst, op=dist.ReduceOp.SUM, group=None, async_op=False):
        self._publish(tensor)
        if self.rank == dst:
            tensor.copy_(self._reduce(self._parts(tensor.numel(), tensor.dtype), op).view_as(tensor))
        return self._done(async_op)

    def broadcast(self, tensor, src, group=None, async_op=False):
        self._publish(tensor)
        tensor.copy_(self._parts(tensor.numel(), tensor.dtype)[src].view_as(tensor))
        return self._done(async_op)

    def reduce_scatter_tensor(self, output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        self._publish(input)
        n = output.numel()
        output.copy_(self._reduce(self._parts(n, input.dtype, start=self.rank * n), op).view_as(output))
        return self._done(async_op)

    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        self._publish(input_tensor)
        n = input_tensor.numel()
        flat = output_tensor.view(-1)
        for r, part in enumerate(self._parts(n, input_tensor.dtype)):
            flat[r * n : (r + 1) * n].copy_(part)
        return self._done(async_op)

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        self._publish(tensor)
        for out, part in zip(tensor_list, self._parts(tensor.numel(), tensor.dtype)):
            out.copy_(part.view_as(out))
        return self._done(async_op)

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        w = self.world
        send = list(input_split_sizes) if input_split_sizes else [input.shape[0] // w] * w
        recv = list(output_split_sizes) if output_split_sizes else [output.shape[0] // w] * w
        row = input[0].numel() if input.dim() > 1 else 1  # elements per first-dimension index
        self._publish(input, send)
        out = output.view(-1)
        at = 0
        for r in range(w):
            sizes = self._view(r, 0, w, torch.int64).tolist()
            if sizes[self.rank] != recv[r]:
                raise SystemExit(f"SharedGPU: rank {r} sends {sizes[self.rank]} to rank {self.rank}, which expects "
                                 f"{recv[r]}")
            start = sum(sizes[: self.rank]) * row
            n = recv[r] * row
            out[at : at + n].copy_(self._view(r, self.header + start * input.element_size(), n, input.dtype))
            at += n
        return self._done(async_op)


_SHARED: SharedGPU | None = None


def _routed(name: str, fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        tensors = [x for x in list(args) + list(kwargs.values())
                   if isinstance(x, torch.Tensor) or isinstance(x, (list, tuple))]
        on_gpu = any(t.is_cuda if isinstance(t, torch.Tensor) else
                     any(isinstance(u, torch.Tensor) and u.is_cuda for u in t) for t in tensors)
        if _SHARED is None or not on_gpu:
            return fn(*args, **kwargs)
        return getattr(_SHARED, name)(*args, **kwargs)

    call.__qzero_shared__ = True
    return call


def route_collectives() -> None:
    """Make ``torch.distributed``'s collectives on CUDA tensors go through :class:`SharedGPU`
    once :func:`share_one_gpu` has set it up (CPU tensors keep gloo). Patches the module in
    place: call it before importing code that keeps references to its functions."""
    for name in SHARED:
        fn = getattr(dist, name)
        if not getattr(fn, "__qzero_shared__", False):
            setattr(dist, name, _routed(name, fn))


def share_one_gpu(capacity: int = 1 << 30) -> SharedGPU:
    """After ``init_process_group("gloo")`` on every rank of one GPU: open each other's
    buffers (``capacity`` bytes each) and route the collectives through them."""
    global _SHARED
    route_collectives()
    _SHARED = SharedGPU(capacity)
    return _SHARED


def _check() -> int:
    """``torchrun --nproc_per_node=2 benchmarks/scripts/one_gpu.py`` on one GPU: every shared-GPU collective
    on CUDA tensors (sync, and async waited for from another stream) against the same gloo
    collective on CPU copies of its inputs."""
    import os
    import types

    route_collectives()
    plain = types.SimpleNamespace(**{name: getattr(dist, name).__wrapped__ for name in SHARED})
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    share_one_gpu(1 << 24)
    g = torch.Generator().manual_seed(1234 + rank)
    n = 1024 * world

    def bf16(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype)

    def ints(dtype, lo, hi, numel):
        return torch.randint(lo, hi, (numel,), dtype=dtype, generator=g)

    cases = (  # name, inputs (output first), the call on a module of collectives
        ("all_reduce sum bf16", lambda: [bf16(n)], lambda d, t, a: d.all_reduce(t[0], async_op=a)),
        ("broadcast", lambda: [bf16(n)], lambda d, t, a: d.broadcast(t[0], src=1, async_op=a)),
        ("reduce_scatter_tensor fp32", lambda: [torch.zeros(n // world), bf16(n, dtype=torch.float32)],
         lambda d, t, a: d.reduce_scatter_tensor(t[0], t[1], async_op=a)),
        ("all_gather_into_tensor int8",
         lambda: [torch.zeros(n, dtype=torch.int8), ints(torch.int8, -127, 128, n // world)],
         lambda d, t, a: d.all_gather_into_tensor(t[0], t[1], async_op=a)),
        ("all_to_all_single uint8", lambda: [torch.zeros(n, dtype=torch.uint8), ints(torch.uint8, 0, 256, n)],
         lambda d, t, a: d.all_to_all_single(t[0], t[1], async_op=a)),
        ("all_gather list", lambda: [[torch.zeros(8) for _ in range(world)], bf16(8, dtype=torch.float32)],
         lambda d, t, a: d.all_gather(t[0], t[1], async_op=a)),
    )
    failures = 0
    for name, make, call in cases:
        for mode in ("sync", "async"):
            host = make()
            dev = [t.cuda() if isinstance(t, torch.Tensor) else [x.cuda() for x in t] for t in host]
            call(plain, host, False)
            if mode == "sync":
                call(dist, dev, False)
            else:
                with torch.cuda.stream(torch.cuda.Stream()):
                    work = call(dist, dev, True)
                work.wait()  # the current stream now follows the copy back
            got = dev[0] if isinstance(dev[0], torch.Tensor) else torch.cat(dev[0])
            want = host[0] if isinstance(host[0], torch.Tensor) else torch.cat(host[0])
            ok = torch.equal(got.cpu(), want)
            failures += not ok
            if rank == 0:
                print(f"{'PASS' if ok else 'FAIL'} {name} ({mode})", flush=True)
    _SHARED.close()
    dist.destroy_process_group()
    if rank == 0:
        print("ALL PASS" if not failures else f"{failures} FAILED", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(_check())
