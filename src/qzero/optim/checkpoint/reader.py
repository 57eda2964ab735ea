"""The tensor files of a checkpoint, read as untrusted input: DCP's storage reader over the
index :mod:`qzero.optim.checkpoint.index` has read and rebuilt.

:class:`IndexedReader` gives DCP that rebuilt index (the file is not read again) and reads
each tensor with ``torch.load(weights_only=True)`` from the byte range the index names,
refusing any read that is not a dense CPU tensor of the dtype the index gives, castable into
its target (:func:`castable`), on every supported torch. Tensor files are opened like every
checkpoint file (:data:`qzero.optim.checkpoint.index.OPEN_FLAGS`: no link, no waiting).
"""

from __future__ import annotations

import io
import os
import stat
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as _dcp_md
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from .index import OPEN_FLAGS, show


def _dtypes(*names: str) -> frozenset:
    return frozenset(getattr(torch, n) for n in names if isinstance(getattr(torch, n, None), torch.dtype))


#: Dtypes that ``Tensor.copy_`` converts between.
CONVERTIBLE_DTYPES = _dtypes(
    "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32", "int64", "int32", "int16",
    "int8", "uint64", "uint32", "uint16", "uint8", "bool", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
    "float8_e5m2fnuz", "float8_e8m0fnu",
)
#: Dtypes that ``Tensor.copy_`` copies into their own dtype only (bit for bit, converting nothing).
SAME_DTYPE_ONLY = _dtypes("bits1x8", "bits2x4", "bits4x2", "bits8", "bits16", "float4_e2m1fn_x2")


class _ByteRange(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes of ``f`` from ``start``."""

    def __init__(self, f, start: int, length: int) -> None:
        super().__init__()
        self._f, self._start, self._len, self._pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, b) -> int:
        n = min(len(b), self._len - self._pos)
        if n <= 0:
            return 0
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(b)[:n]) or 0
        self._pos += got
        return got


class IndexedReader(dcp.FileSystemReader):
    """A DCP storage reader over a checked index (from :func:`read_index`).

    ``read_metadata`` returns that index. ``read_data`` reads tensors only, each with
    ``torch.load(weights_only=True)`` from the byte range of a plain file of the
    directory, checks it (a dense, unquantized CPU tensor of the dtype the index gives,
    which ``copy_`` can convert into its target, of the expected size) and copies it into
    its target. A failure raises: DCP gathers every rank's outcome and raises on all of
    them. Whatever was copied before it is put back by the loader ([Note: all or nothing]
    in :mod:`qzero.optim.checkpoint.load`).
    """

    def __init__(self, directory: str, index: _dcp_md.Metadata) -> None:
        super().__init__(directory)
        self._directory, self._index = str(directory), index

    def read_metadata(self, *args: Any, **kwargs: Any) -> _dcp_md.Metadata:
        storage_meta = getattr(_dcp_md, "StorageMeta", None)
        if storage_meta is not None and hasattr(self._index, "storage_meta"):
            self._index.storage_meta = storage_meta(load_id=getattr(self, "load_id", None))
        return self._index

    def read_data(self, plan, planner) -> Future:
        for req in plan.items:
            if req.type != LoadItemType.TENSOR:
                raise ValueError(
                    f"{self._directory!r}: a non-tensor read of {show(req.dest_index.fqn)} was planned; "
                    "qzero reads tensors only"
                )
        for req in plan.items:
            try:
                tensor, target = self._load(req, planner)
            except ValueError:
                raise
            except Exception as e:  # noqa: BLE001 - reported on every rank by DCP
                raise ValueError(f"{self._directory!r}: reading {show(req.storage_index.fqn)} failed: "
                                 f"{type(e).__name__}: {show(_first_line(e))}") from None
            target.copy_(tensor)
            planner.commit_tensor(req, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _load(self, req, planner) -> tuple[torch.Tensor, torch.Tensor]:
        info = self._index.storage_data[req.storage_index]
        fqn = req.storage_index.fqn
        rel, where = info.relative_path, f"{self._directory!r}: {show(fqn)} in {show(info.relative_path)}"
        fd = os.open(os.path.join(self._directory, rel), OPEN_FLAGS)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ValueError(f"{self._directory!r}: tensor file {show(rel)} is not a regular file")
            try:
                tensor = torch.load(_ByteRange(f, info.offset, info.length), map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - weights_only: nothing but tensors was built
                raise ValueError(
                    f"{where} cannot be read as a tensor ({type(e).__name__}: {show(_first_line(e))})"
                ) from None
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided or tensor.is_quantized:
            raise ValueError(f"{where} is not a dense tensor")
        if tensor.device.type != "cpu":
            raise ValueError(f"{where} is a {tensor.device.type} tensor (it holds no data to copy)")
        declared = self._index.state_dict_metadata[fqn].properties.dtype
        if tensor.dtype != declared:
            raise ValueError(f"{where} holds {tensor.dtype}, the index says {declared}")
        if len(req.storage_offsets) != tensor.dim():
            raise ValueError(f"{where} has {tensor.dim()} dimensions, the index {len(req.storage_offsets)}")
        for dim, (o, n) in enumerate(zip(req.storage_offsets, req.lengths)):
            if o + n > tensor.size(dim):
                raise ValueError(f"{where} holds {tuple(tensor.size())}, too small for the chunk the index gives")
            if n < tensor.size(dim):
                tensor = tensor.narrow(dim, o, n)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise ValueError(f"{where} holds {tuple(tensor.size())}, expected {tuple(target.size())}")
        if not castable(tensor.dtype, target.dtype):
            raise ValueError(f"{where} holds {tensor.dtype}, which cannot be copied into {target.dtype}")
        return tensor, target


def castable(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether ``dst_tensor.copy_(src_tensor)`` can copy ``src`` into ``dst``."""
    if src == dst:
        return src in CONVERTIBLE_DTYPES or src in SAME_DTYPE_ONLY
    return src in CONVERTIBLE_DTYPES and dst in CONVERTIBLE_DTYPES


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else ""



__all__ = ["CONVERTIBLE_DTYPES", "IndexedReader", "SAME_DTYPE_ONLY", "castable"]
