"""A byte accountant: what this rank's ``torch.distributed`` collectives send, by (source
node, destination node), the way the cluster cost model (:mod:`qzero.plan`) says NCCL moves it.

[Note: byte accountant]
Inside ``with ByteAccountant(ranks_per_node=L) as acct:`` every collective of
:data:`WRAPPED` (in ``torch.distributed``, ``torch.distributed.distributed_c10d`` and every
loaded module that imported one of them by name, such as qzero's chunk all-gather) first books
this rank's sends, then runs as it would have. Nodes are ``rank // L`` (torchrun's placement;
on one host with ``L`` dividing the world, pseudo-nodes). Each collective is attributed by
the model's traffic (:mod:`qzero.plan.traffic`): a ring collective (all-gather,
reduce-scatter, all-reduce) sends its edge bytes to the next rank of the node-contiguous ring,
a chain (broadcast, reduce) to the next rank of the chain, an all-to-all its exact splits to
each peer, a point-to-point send its tensor. So the sum of every rank's books is the traffic
the plan charges, from what the code actually called: a test compares it with the plan's
bytes for the same arm.

The books: :attr:`ByteAccountant.sent` (``{(src_node, dst_node): bytes}``, this rank's
sends; the diagonal is traffic inside a node) and :attr:`ByteAccountant.by_op` (bytes by
collective name). Combine ranks with :func:`merge`. Enter the accountant before building what
it measures (an optimizer's gather engine keeps the collective it was made with), and
:meth:`ByteAccountant.reset` the books before the steps to count.
"""

from __future__ import annotations

import functools
import math
import sys
import types

import torch
import torch.distributed as dist

from ...plan.cluster import Cluster
from ...plan.traffic import ring_traffic

#: The collectives the accountant books (torch's names, both spellings where torch renamed one).
WRAPPED = ("all_gather_into_tensor", "all_gather_single", "_all_gather_base", "reduce_scatter_tensor",
           "reduce_scatter_single", "_reduce_scatter_base", "all_to_all_single", "all_reduce", "broadcast",
           "reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "isend", "recv", "irecv")
_RING = {"all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather", "_all_gather_base": "all_gather",
         "all_gather": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
         "reduce_scatter_single": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
         "reduce_scatter": "reduce_scatter", "all_reduce": "all_reduce"}
#: Where each collective takes its ``group`` when it is given by position.
_GROUP_AT = {"all_gather_into_tensor": 2, "all_gather_single": 2, "_all_gather_base": 2, "all_gather": 2,
             "reduce_scatter_tensor": 3, "reduce_scatter_single": 3, "_reduce_scatter_base": 3, "reduce_scatter": 3,
             "all_reduce": 2, "broadcast": 2, "reduce": 3, "all_to_all_single": 4, "all_to_all": 2, "send": 2,
             "isend": 2}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class ByteAccountant:
    """Books this rank's collective sends by node pair (see the note); a context manager."""

    def __init__(self, ranks_per_node: int):
        if not dist.is_initialized():
            raise RuntimeError("ByteAccountant needs an initialized process group")
        world = dist.get_world_size()
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1 \
                or world % ranks_per_node:
            raise ValueError(f"ranks_per_node must be a positive divisor of the world size {world}, got "
                             f"{ranks_per_node!r}")
        self.cluster = Cluster(world // ranks_per_node, ranks_per_node, 1.0, 1.0)
        self.rank = dist.get_rank()
        self.sent: dict[tuple[int, int], float] = {}
        self.by_op: dict[str, float] = {}
        self.calls = 0
        self._originals: dict[tuple[object, str], object] = {}
        self._rebound: list[tuple[object, str, object]] = []
        self._inside = False

    # -- the books
    def cross_node_sent(self) -> float:
        """Bytes this rank sent to other nodes."""
        return sum(b for (s, d), b in self.sent.items() if s != d)

    def reset(self) -> None:
        self.sent.clear()
        self.by_op.clear()
        self.calls = 0

    def _book(self, op: str, dst: int, nbytes: float) -> None:
        if nbytes <= 0 or dst == self.rank:
            return
        key = (self.cluster.node_of(self.rank), self.cluster.node_of(dst))
        self.sent[key] = self.sent.get(key, 0.0) + nbytes
        self.by_op[op] = self.by_op.get(op, 0.0) + nbytes

    def _ranks(self, group) -> list[int]:
        return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)

    def _ring(self, op: str, group, nbytes: float, root: int | None = None) -> None:
        ranks = self._ranks(group)
        if self.rank not in ranks:
            return
        t = ring_traffic(self.cluster, op, [ranks], nbytes, ranks.index(root) if root is not None else 0)
        for f in t.flows:
            if f.src == self.rank:
                self._book(op, f.dst, f.nbytes)

    def record(self, name: str, args: tuple, kwargs: dict) -> None:
        """Book one call of ``torch.distributed.<name>`` made with ``args``/``kwargs``."""
        self.calls += 1
        a = _Args(name, args, kwargs)
        if name in _RING:
            op = _RING[name]
            if op == "all_gather":
                nbytes = _nbytes(a.get(1, "tensor", "input_tensor"))
            elif op == "reduce_scatter":
                inp = a.get(1, "input_list", "input")
                nbytes = sum(map(_nbytes, inp)) if isinstance(inp, (list, tuple)) else _nbytes(inp)
            else:
                nbytes = _nbytes(a.get(0, "tensor"))
            self._ring(op, a.group(), nbytes)
        elif name in ("broadcast", "reduce"):
            group = a.group()
            root = a.get(1, "src" if name == "broadcast" else "dst")
            group_root = a.get(None, "group_src" if name == "broadcast" else "group_dst")
            if root is None and group_root is not None:
                root = self._ranks(group)[group_root]
            self._ring(name, group, _nbytes(a.get(0, "tensor")), root)
        elif name == "all_to_all_single":
            self._all_to_all_single(a)
        elif name == "all_to_all":
            ranks = self._ranks(a.group())
            for dst, t in zip(ranks, a.get(1, "input_tensor_list")):
                self._book("all_to_all", dst, _nbytes(t))
        elif name in ("send", "isend"):
            dst = a.get(1, "dst")
            if dst is None:
                dst = self._ranks(a.group())[a.get(None, "group_dst")]
            self._book("send", dst, _nbytes(a.get(0, "tensor")))

    def _all_to_all_single(self, a: _Args) -> None:
        inp = a.get(1, "input")
        splits = a.get(3, "input_split_sizes")
        ranks = self._ranks(a.group())
        n = len(ranks)
        row = math.prod(inp.shape[1:]) * inp.element_size()
        sizes = list(splits) if splits else [inp.shape[0] // n] * n
        for dst, rows in zip(ranks, sizes):
            self._book("all_to_all", dst, rows * row)

    # -- installing
    def __enter__(self) -> ByteAccountant:
        import torch.distributed.distributed_c10d as c10d

        for name in WRAPPED:
            for mod in (dist, c10d):
                fn = getattr(mod, name, None)
                if fn is None or getattr(fn, "__accounted__", False):
                    continue
                self._originals[(mod, name)] = fn
                setattr(mod, name, self._wrap(name, fn))
        by_id = {id(fn): (mod, name) for (mod, name), fn in self._originals.items()}
        for mod in list(sys.modules.values()):
            if mod is None or mod in (dist, c10d) or not hasattr(mod, "__dict__"):
                continue
            for attr, value in list(vars(mod).items()):
                if type(value) is not types.FunctionType:
                    continue
                original = value.__wrapped__ if getattr(value, "__accounted__", False) else value
                if callable(original) and id(original) in by_id:
                    owner, name = by_id[id(original)]
                    self._rebound.append((mod, attr, original))
                    setattr(mod, attr, getattr(owner, name))
        return self

    def _wrap(self, name: str, fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if self._inside:  # torch's deprecated names call the new ones: book the outer call only
                return fn(*args, **kwargs)
            self.record(name, args, kwargs)
            self._inside = True
            try:
                return fn(*args, **kwargs)
            finally:
                self._inside = False

        call.__accounted__ = True
        call.__accounted_by__ = self
        return call

    def __exit__(self, *exc) -> None:
        for (mod, name), fn in self._originals.items():
            setattr(mod, name, fn)
        for mod, attr, value in self._rebound:
            setattr(mod, attr, value)
        # a module imported while the books were open took a wrapper by name: give it the original
        import torch.distributed.distributed_c10d as c10d

        for mod in list(sys.modules.values()):
            if mod is None or mod in (dist, c10d) or not hasattr(mod, "__dict__"):
                continue
            for attr, value in list(vars(mod).items()):
                if type(value) is types.FunctionType and getattr(value, "__accounted_by__", None) is self:
                    setattr(mod, attr, value.__wrapped__)
        self._originals.clear()
        self._rebound.clear()


class _Args:
    """A call's arguments by position or keyword."""

    def __init__(self, name: str, args: tuple, kwargs: dict):
        self.name, self.args, self.kwargs = name, args, kwargs

    def group(self):
        return self.get(_GROUP_AT.get(self.name), "group")

    def get(self, position: int | None, *keywords: str):
        for k in keywords:
            if k in self.kwargs:
                return self.kwargs[k]
        if position is not None and position < len(self.args):
            return self.args[position]
        return None


def merge(books: list[dict[tuple[int, int], float]]) -> dict[tuple[int, int], float]:
    """Every rank's :attr:`ByteAccountant.sent`, summed."""
    out: dict[tuple[int, int], float] = {}
    for b in books:
        for k, v in b.items():
            out[k] = out.get(k, 0.0) + v
    return out


def cross_node_per_node(books: list[dict[tuple[int, int], float]], nodes: int) -> float:
    """Bytes sent across the network per node, from every rank's books."""
    return sum(v for (s, d), v in merge(books).items() if s != d) / nodes
