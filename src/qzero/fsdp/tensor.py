"""The parameter wrapper that makes FSDP2 gather a weight quantized.

FSDP2 (``torch.distributed.fsdp.fully_shard``) looks for two methods on a sharded
parameter's local tensor: ``fsdp_pre_all_gather`` turns the local shard into the
tensors to all-gather, ``fsdp_post_all_gather`` turns what came back into the
unsharded parameter used for compute. :class:`QuantizedGatherTensor` wraps the fp32
master and implements both:

Both run the wire's chunk unit (:func:`qzero.wire.chunks.pack_shard`, :func:`~qzero.wire.chunks.unpack_shards`:
a whole shard as one payload with no side channel); FSDP2 runs the all-gather between them.

* pre: quantize the rank's fp32 shard, flattened, in groups of ``group_size``
  (fp32 scales, round half to even: :mod:`qzero.quant.reference`, the Triton kernels
  on CUDA, the same bytes) into one uint8 payload ``[values | scales]``
  (:func:`qzero.layout.quantized_payload_layout`). The master is only read.
* post: dequantize every rank's payload into its rows of the unsharded parameter,
  in the compute dtype (the ``param_dtype`` of FSDP2's ``MixedPrecisionPolicy``).
  Every rank dequantizes the same gathered bytes with the same code, so every rank
  computes with bit-identical weights.

A shard that cannot travel this way (the parameter is not sharded evenly on dim 0
over the mesh: FSDP2 then requires every all-gather input to have the padded shard's
shape, which a payload of another size cannot have) is gathered plainly: the shard
cast to the compute dtype, exactly as FSDP2 itself would gather it.

Everything else (the optimizer's in-place updates, ``copy_`` from a checkpoint,
FSDP2's sharding at ``fully_shard``) acts on the wrapped fp32 tensor: ops are run on
it, and the ones FSDP2 uses to carve the shard out (views, slices, ``new_zeros``,
``copy_``, ``detach``...) return the wrapper again. ``data_ptr()`` is the wrapped
tensor's, so code that tells parameters apart by address (Accelerate's FSDP2
``prepare`` re-points the optimizer that way) sees distinct parameters.

[Note: gather record] Every wrapper made from one parameter (the shard FSDP2 carves
out, its views, a re-wrapped tensor loaded with ``load_state_dict(assign=True)``)
shares one :class:`GatherRecord`: the parameter's name, and how its last all-gather
travelled (:class:`GatherState`), written by ``fsdp_pre_all_gather`` itself. Reports
read what ran from it, never what was installed.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import threading
from typing import Any, NamedTuple

import torch
from torch.utils import _pytree as pytree

from ..layout.gather_planner import quantized_payload_layout
from ..quant import kernels_for, reference
from ..wire.chunks import pack_shard, unpack_shards

aten = torch.ops.aten

#: Ops whose results stay wrapped (what FSDP2 uses to shard, pad and move a parameter).
_KEEP_WRAPPED = {
    aten.detach.default,
    aten.alias.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.as_strided.default,
    aten.slice.Tensor,
    aten.narrow.default,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.chunk.default,
    aten.new_zeros.default,
    aten.new_empty.default,
    aten.empty_like.default,
    aten.clone.default,
    aten.copy_.default,
    aten._to_copy.default,
    aten._pin_memory.default,
}

#: Set while torch's own pickling or copying runs (see QuantizedGatherTensor.data_ptr).
_TORCH_VIEW = threading.local()


@contextlib.contextmanager
def _as_torch_sees_it():
    before = getattr(_TORCH_VIEW, "active", False)
    _TORCH_VIEW.active = True
    try:
        yield
    finally:
        _TORCH_VIEW.active = before


#: Compute dtypes the Triton dequantizing kernel writes; others use the reference.
_KERNEL_DTYPES = (torch.bfloat16, torch.float16)


class GatherFormat(NamedTuple):
    """How a parameter's gather is quantized, and the installer's agreement still to run
    before the first gather (:class:`qzero.fsdp._comms.DeferredAgreement`; None: agreed at
    install, or nothing to agree on)."""

    group_size: int
    fmt: str
    agreement: Any = None


class GatherState(enum.Enum):
    """How a wrapped parameter's last all-gather travelled ([Note: gather record])."""

    NOT_GATHERED = "not gathered yet"
    QUANTIZED = "quantized"
    PLAIN = "plain"  # the shard is not the even one a payload can stand for (see carries)


class GatherRecord:
    """One wrapped parameter's name and its last gather; shared by all its wrappers."""

    __slots__ = ("name", "state", "quantized_gathers")

    def __init__(self, name: str):
        self.name = name
        self.state = GatherState.NOT_GATHERED
        self.quantized_gathers = 0

    def __repr__(self) -> str:
        return f"GatherRecord({self.name!r}, {self.state.value}, {self.quantized_gathers} quantized)"


class QuantizedGatherTensor(torch.Tensor):
    """An fp32 parameter (or its shard) that FSDP2 all-gathers group-quantized."""

    _tensor: torch.Tensor
    _format: GatherFormat
    _record: GatherRecord | None

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, fmt: GatherFormat, record: GatherRecord | None = None):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, fmt: GatherFormat, record: GatherRecord | None = None):
        self._tensor = tensor
        self._format = fmt
        self._record = record

    def __repr__(self) -> str:
        return f"QuantizedGatherTensor({self._format.fmt}, g{self._format.group_size}, {self._tensor!r})"

    @property
    def data(self) -> torch.Tensor:
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, new) -> None:
        # torch's own setter would change the wrapper's metadata but not the wrapped tensor
        # FSDP2 gathers from: the assignment would be lost without a word.
        name = f" {self._record.name!r}" if self._record is not None else ""
        raise TypeError(
            f"qzero.fsdp: cannot assign .data of parameter{name}, which quantize_weight_gathers wrapped (the "
            f"wrapped tensor would keep its old values). Write into it instead (with torch.no_grad(): "
            f"p.copy_(new), or model.load_state_dict(...)), or load the weights before quantize_weight_gathers")

    @property
    def unwrapped(self) -> torch.Tensor:
        """The wrapped fp32 tensor (shares its storage)."""
        return self._tensor

    @property
    def record(self) -> GatherRecord | None:
        """The parameter's :class:`GatherRecord` ([Note: gather record])."""
        return self._record

    def data_ptr(self) -> int:
        """The wrapped tensor's address (a wrapper subclass has no storage of its own, so
        torch would answer 0 for every wrapped parameter alike). Inside torch's own
        ``__reduce_ex__``/``__deepcopy__``, which tell a wrapper subclass by that 0, it is 0."""
        if getattr(_TORCH_VIEW, "active", False):
            return 0
        return self._tensor.data_ptr()

    def __reduce_ex__(self, protocol):
        with _as_torch_sees_it():
            return super().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        with _as_torch_sees_it():
            return super().__deepcopy__(memo)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        first = None  # the results take the first wrapped argument's format and record (``self`` of copy_)

        def unwrap(t: QuantizedGatherTensor) -> torch.Tensor:
            nonlocal first
            if first is None:
                first = t
            return t._tensor

        args, kwargs = pytree.tree_map_only(cls, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP_WRAPPED:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, first._format, first._record), out)

    def __tensor_flatten__(self):
        return ["_tensor"], (self._format, self._record)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        fmt, record = ctx
        return QuantizedGatherTensor(inner_tensors["_tensor"], fmt, record)

    # ------------------------------------------------------------------ FSDP2 extension

    def fsdp_pre_all_gather(
        self,
        mesh,
        outer_size: torch.Size | None = None,
        outer_stride: tuple[int, ...] | None = None,
        module: torch.nn.Module | None = None,
        mp_policy: Any = None,
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        if self._format.agreement is not None:
            self._format.agreement.ensure()
        shard = self._tensor
        world = mesh.size()
        full = tuple(outer_size) if outer_size is not None else None
        compute = getattr(mp_policy, "param_dtype", None) or shard.dtype
        if full is not None and tuple(shard.shape[1:]) != tuple(full[1:]):
            name = f" {self._record.name!r}" if self._record is not None else ""
            raise ValueError(
                f"qzero.fsdp: parameter{name} of shape {list(full)} is sharded along another dimension than 0 "
                f"(this rank's shard: {list(shard.shape)}; fully_shard's shard_placement_fn); quantize_weight_gathers "
                "carries Shard(0) only: return Shard(0) (or None) for it, or use quantize_group_gathers after "
                "fully_shard, which carries any placement")
        if full is None or not carries(full, world) or tuple(shard.shape) != shard_shape(full, world):
            # Plain: the padded shard in the compute dtype, as FSDP2 gathers it itself.
            rows = -(-full[0] // world) if full else shard.shape[0]
            padded = shard.new_zeros((rows, *shard.shape[1:]), dtype=compute)
            padded[: shard.shape[0]].copy_(shard)
            self._note(GatherState.PLAIN)
            return (padded,), None
        self._note(GatherState.QUANTIZED)
        n = shard.numel()
        layout = quantized_payload_layout(n, self._format.group_size, self._format.fmt)
        payload = torch.empty(layout.nbytes, dtype=torch.uint8, device=shard.device)
        pack_shard(shard.detach().reshape(-1), payload, layout, self._format.group_size, self._format.fmt,
                   kernels_for(shard.device))
        return (payload,), (n, layout)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ):
        (gathered,) = all_gather_outputs
        if metadata is None:  # plain: the gathered rows are the parameter (FSDP2 trims the padding)
            if out is not None:
                return None  # FSDP2 already copied them into the storage ``out`` shares
            return gathered, ()
        n, layout = metadata
        payloads = gathered.view(-1, layout.nbytes)
        world = payloads.shape[0]
        if out is None:
            dst = torch.empty(world * n, dtype=param_dtype, device=gathered.device)
            self._dequantize(payloads, dst, n, layout)
            return dst, (dst,)
        # ``out`` is the unsharded parameter autograd may have saved for backward: writing
        # it in place must not bump its version (FSDP2 does the same for its plain copy-out).
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
            self._dequantize(payloads, out.view(-1), n, layout)
        return None

    def _note(self, state: GatherState) -> None:
        record = self._record
        if record is not None:
            record.state = state
            record.quantized_gathers += state is GatherState.QUANTIZED

    def _dequantize(self, payloads: torch.Tensor, dst: torch.Tensor, n: int, layout) -> None:
        """Every rank's payload into its rows of ``dst``, in one launch (rank ``r``'s lands
        at ``dst[r * n:][:n]``)."""
        kernels = kernels_for(dst.device) if dst.dtype in _KERNEL_DTYPES else reference
        world = payloads.shape[0]
        unpack_shards(payloads, dst, n, world, layout, self._format.group_size, self._format.fmt, kernels)


def shard_shape(full: tuple[int, ...], world: int) -> tuple[int, ...]:
    """Shape of every rank's dim-0 shard of an evenly sharded ``full``-shaped parameter."""
    return (full[0] // world, *full[1:])


def carries(full: tuple[int, ...], world: int) -> bool:
    """Whether the quantized gather can carry a parameter of shape ``full`` over ``world`` ranks:
    it must be sharded evenly (and not be empty)."""
    return len(full) > 0 and full[0] > 0 and full[0] % world == 0


# FSDP2 reads the hook's signature (``inspect.signature``) on every all-gather of every
# parameter to choose how to call it. A precomputed ``__signature__`` answers that at once
# instead of re-deriving it from the function each time (tens of microseconds a call).
QuantizedGatherTensor.fsdp_pre_all_gather.__signature__ = inspect.signature(QuantizedGatherTensor.fsdp_pre_all_gather)
