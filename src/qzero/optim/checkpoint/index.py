"""The DCP index of a checkpoint directory, read as untrusted input, and a reader of its tensors.

``torch.distributed.checkpoint`` stores its index (``.metadata``) as a pickle, and
unpickling runs whatever callables the pickle names. A checkpoint directory may come
from someone else, so the index is read in three steps:

1. :class:`IndexUnpickler` resolves exactly the globals of :data:`INDEX_GLOBALS`, by
   module and name: DCP's metadata dataclasses, its ``_StorageInfo``, ``torch.Size``,
   the memory-format enum, torch's dtypes, the layout look-up torch pickles layouts
   with, and pathlib's path classes. It does not hand the pickle those objects: each
   name resolves to an inert stand-in, created afresh for this one load, that only
   records the arguments and state the pickle gives it. So nothing outside this module
   is imported or called while unpickling, whatever REDUCE/NEWOBJ/BUILD opcodes the
   pickle holds, and every other global (module prefixes, functions, persistent ids)
   is refused with an error naming it.
2. :func:`rebuild_index` checks those records field by field and builds a fresh
   ``Metadata`` from plain values: tensor entries only (DCP reads "bytes" entries
   with ``torch.load(weights_only=False)``; qzero never writes them), chunks that tile
   their tensor, one storage entry per chunk naming a plain file inside the directory,
   no stream transforms.
   Each storage entry is at most as long as its chunk needs (its elements plus the
   archive around them: :data:`ARCHIVE_SLACK`), and no two share a byte, so a read is
   bounded by its chunk and every byte of a tensor file is read once at most. Nor is it
   shorter than a byte per element of its chunk (``torch.save`` stores them uncompressed),
   so the size an entry claims is backed by its tensor files (their lengths are checked
   before reading).
3. :class:`qzero.optim.checkpoint.reader.IndexedReader` gives DCP that rebuilt index (the
   file is not read again) and reads each tensor with ``torch.load(weights_only=True)`` from
   the byte range the index names, checking it before it is copied.

Files are opened without following links and without blocking (a FIFO is refused, not
waited on), must be regular files, and the index may not be larger than
:data:`MAX_INDEX_BYTES`. Values from the files are echoed in messages through
:func:`show`, which bounds their length.
"""

from __future__ import annotations

import errno
import io
import math
import os
import pickle
import reprlib
import stat

import torch
from torch.distributed.checkpoint import filesystem as _dcp_fs
from torch.distributed.checkpoint import metadata as _dcp_md

INDEX_FILE = ".metadata"

#: The largest index read (a genuine one holds a few hundred bytes per tensor and rank).
MAX_INDEX_BYTES = 64 << 20
#: What a storage entry may hold besides its chunk's elements: the zip archive
#: ``torch.save`` writes around them (about 1.6 KiB with torch 2.4 to 2.13).
ARCHIVE_SLACK = 64 << 10

_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"

#: Every global a DCP index may name, by exact module and name, and what it stands for.
#: These are the names a ``.metadata`` written by torch 2.4 to 2.13 through
#: ``FileSystemWriter`` refers to (dataclasses pickle as NEWOBJ + BUILD, ``torch.Size``
#: and the enum as REDUCE, dtypes as globals, layouts through ``_get_layout``,
#: ``StorageMeta.checkpoint_id`` as a pathlib path, under ``pathlib._local`` on
#: Python 3.13). ``BytesStorageMetadata`` is deliberately absent.
INDEX_GLOBALS: dict[tuple[str, str], str] = {
    (_MD, "Metadata"): "Metadata",
    (_MD, "TensorStorageMetadata"): "TensorStorageMetadata",
    (_MD, "TensorProperties"): "TensorProperties",
    (_MD, "ChunkStorageMetadata"): "ChunkStorageMetadata",
    (_MD, "MetadataIndex"): "MetadataIndex",
    (_MD, "StorageMeta"): "StorageMeta",
    (_MD, "_MEM_FORMAT_ENCODING"): "MemoryFormat",
    (_FS, "_StorageInfo"): "StorageInfo",
    ("torch", "Size"): "Size",
    ("torch.serialization", "_get_layout"): "Layout",
    **{(mod, cls): "Path" for mod in ("pathlib", "pathlib._local")
       for cls in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")},
}

#: torch dtypes by the name they pickle under (``torch.<name>``), the only other globals.
INDEX_DTYPES: dict[str, torch.dtype] = {
    name: value for name, value in vars(torch).items()
    if isinstance(value, torch.dtype) and str(value) == f"torch.{name}"
}

_REFUSED_HINTS = {
    (_MD, "BytesStorageMetadata"): "non-tensor entries are read by DCP with torch.load(weights_only=False); "
    "qzero never writes them",
}


class IndexRefused(ValueError):
    """The index names a global outside :data:`INDEX_GLOBALS`, or is malformed."""


_SHOW = reprlib.Repr()
_SHOW.maxlevel, _SHOW.maxstring, _SHOW.maxother, _SHOW.maxlong = 3, 60, 60, 40
_SHOW.maxlist = _SHOW.maxtuple = _SHOW.maxdict = _SHOW.maxset = 6


def show(value, limit: int = 120) -> str:
    """``repr(value)`` for a message: a value read from a checkpoint may be megabytes long or
    nested a thousand levels deep; this is at most ``limit`` characters and never recurses."""
    text = _SHOW.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


#: How checkpoint files are opened: never through a link, never waiting (a FIFO opens at once).
OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def read_regular_file(directory: str, name: str, limit: int, where: str, what: str | None = None) -> bytes:
    """The bytes of ``directory/name`` (``what`` in messages), opened with :data:`OPEN_FLAGS`,
    which must be a regular file of at most ``limit`` bytes (checked before reading it)."""
    what = what or name
    try:
        fd = os.open(os.path.join(directory, name), OPEN_FLAGS)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError(f"{where}: {what} is a link (qzero reads no checkpoint file through a link)") from None
        raise ValueError(f"{where}: cannot read {what}: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{where}: {what} is not a regular file")
        if st.st_size > limit:
            raise ValueError(f"{where}: {what} is larger than {limit} bytes ({st.st_size}); qzero does not read it")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{where}: {what} is larger than {limit} bytes; qzero does not read it")
    return data


class _Record:
    """What one allowed global stands for: arguments and state, recorded, never acted on."""

    __slots__ = ("args", "kwargs", "state", "built")

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj.args, obj.kwargs, obj.state, obj.built = args, kwargs, None, False
        return obj

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __setstate__(self, state) -> None:
        if not isinstance(self, _Record) or self.built:
            raise pickle.UnpicklingError("checkpoint index: an object is built twice")
        self.state, self.built = state, True


class _DType:
    """A dtype named by the index (resolved through :data:`INDEX_DTYPES` afterwards)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class IndexUnpickler(pickle.Unpickler):
    """Unpickles a DCP index into inert records (see the module docstring)."""

    def __init__(self, file, where: str) -> None:
        super().__init__(file)
        self.where = where
        # fresh stand-in classes per load: nothing a pickle does to them outlives it
        self.kinds: dict[type, str] = {}
        self._classes: dict[str, type] = {}

    def find_class(self, module: str, name: str):
        kind = INDEX_GLOBALS.get((module, name))
        if kind is not None:
            cls = self._classes.get(kind)
            if cls is None:
                cls = self._classes[kind] = type(f"_{kind}Record", (_Record,), {"__slots__": ()})
                self.kinds[cls] = kind
            return cls
        if module == "torch" and name in INDEX_DTYPES:
            return _DType(name)
        hint = _REFUSED_HINTS.get((module, name), "not one of the classes a DCP index is made of")
        raise IndexRefused(
            f"{self.where}: the checkpoint index ({INDEX_FILE}) refers to {module}.{name} ({hint}); "
            "qzero refuses to load it (nothing from it was called)"
        )

    def persistent_load(self, pid):
        raise IndexRefused(f"{self.where}: the checkpoint index ({INDEX_FILE}) holds a persistent id; qzero refuses it")


def read_index(directory: str, where: str | None = None) -> tuple[_dcp_md.Metadata, bytes]:
    """The checked, rebuilt DCP index of ``directory`` and the raw bytes it was read from.
    Raises :class:`IndexRefused` (a ValueError) naming what is wrong."""
    where = where or repr(directory)
    try:
        raw = read_regular_file(directory, INDEX_FILE, MAX_INDEX_BYTES, where, f"the checkpoint index {INDEX_FILE}")
    except ValueError as e:
        raise IndexRefused(str(e)) from None
    if not raw:
        raise IndexRefused(f"{where}: the checkpoint index {INDEX_FILE} is empty")
    unpickler = IndexUnpickler(io.BytesIO(raw), where)
    try:
        top = unpickler.load()
    except IndexRefused:
        raise
    except Exception as e:  # noqa: BLE001 - only our records and builtin containers were made
        raise IndexRefused(
            f"{where}: the checkpoint index {INDEX_FILE} is not a valid pickle ({type(e).__name__}: {show(str(e))})"
        ) from None
    try:
        return rebuild_index(top, unpickler.kinds, where), raw
    except IndexRefused:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the records hold, the answer is a refusal
        raise IndexRefused(
            f"{where}: the checkpoint index {INDEX_FILE} is malformed ({type(e).__name__}: {show(str(e))})"
        ) from None


# --------------------------------------------------------------------------- checking and rebuilding


class _Checker:
    def __init__(self, kinds: dict[type, str], where: str) -> None:
        self.kinds, self.where = kinds, where

    def fail(self, what: str) -> IndexRefused:
        what = what if len(what) <= 400 else what[:397] + "..."
        return IndexRefused(f"{self.where}: the checkpoint index {INDEX_FILE} is malformed: {what}")

    def kind(self, obj) -> str | None:
        return self.kinds.get(type(obj)) if isinstance(obj, _Record) else None

    def record(self, obj, kind: str, where: str) -> _Record:
        if self.kind(obj) != kind:
            raise self.fail(f"{where} is {self.describe(obj)}, expected {kind}")
        return obj

    def describe(self, obj) -> str:
        kind = self.kind(obj)
        if kind:
            return f"a {kind}"
        if isinstance(obj, _DType):
            return f"dtype {obj.name}"
        return f"a {type(obj).__name__}"

    def fields(self, obj: _Record, kind: str, where: str, allowed: tuple[str, ...],
               required: tuple[str, ...] = ()) -> dict:
        """The fields of a dataclass record built as NEWOBJ + BUILD (dict state)."""
        self.record(obj, kind, where)
        if obj.args or obj.kwargs:
            raise self.fail(f"{where}: {kind} is constructed with arguments")
        state = obj.state
        if isinstance(state, tuple) and len(state) == 2 and state[0] is None and type(state[1]) is dict:
            state = state[1]  # slots form
        if type(state) is not dict or not all(type(k) is str for k in state):
            raise self.fail(f"{where}: {kind} has state {self.describe(state)}, expected a dict of fields")
        out = {}
        for k, v in state.items():
            if k in allowed:
                out[k] = v
            elif not (v is None or type(v) in (bool, int, str)):
                raise self.fail(f"{where}: {kind} has an unknown field {show(k)} holding {self.describe(v)}")
            # a plain-valued field of a newer torch is dropped: the index is rebuilt from known fields
        missing = [k for k in required if k not in out]
        if missing:
            raise self.fail(f"{where}: {kind} lacks {missing}")
        return out

    def size(self, obj, where: str) -> tuple[int, ...]:
        self.record(obj, "Size", where)
        if obj.kwargs or obj.built or len(obj.args) != 1 or type(obj.args[0]) not in (tuple, list):
            raise self.fail(f"{where}: a torch.Size is made of one tuple of ints")
        dims = tuple(obj.args[0])
        if not all(type(d) is int and 0 <= d < 2**62 for d in dims) or len(dims) > 64:
            raise self.fail(f"{where}: torch.Size{dims!r} is not a size")
        return dims

    def integer(self, v, where: str, optional: bool = False) -> int | None:
        if optional and v is None:
            return None
        if type(v) is not int or not 0 <= v < 2**62:
            raise self.fail(f"{where} is {show(v)}, expected a non-negative int")
        return v

    def text(self, v, where: str, optional: bool = True) -> str | None:
        if v is None and optional:
            return None
        if type(v) is not str:
            raise self.fail(f"{where} is {self.describe(v)}, expected a str")
        return v

    def dtype(self, v, where: str) -> torch.dtype:
        if not isinstance(v, _DType) or v.name not in INDEX_DTYPES:
            raise self.fail(f"{where} is {self.describe(v)}, expected a torch dtype")
        return INDEX_DTYPES[v.name]

    def properties(self, obj, where: str) -> torch.dtype:
        self.record(obj, "TensorProperties", where)
        if obj.args or obj.kwargs:
            raise self.fail(f"{where}: TensorProperties is constructed with arguments")
        state = obj.state
        if type(state) is tuple and len(state) == 5:  # TensorProperties.__getstate__
            dtype, layout, requires_grad, mem_format, pin_memory = state
        elif type(state) is dict:
            fields = self.fields(obj, "TensorProperties", where,
                                 ("dtype", "layout", "requires_grad", "memory_format", "pin_memory"), ("dtype",))
            dtype, layout = fields["dtype"], fields.get("layout")
            requires_grad, pin_memory = fields.get("requires_grad", False), fields.get("pin_memory", False)
            mem_format = None
        else:
            raise self.fail(f"{where}: TensorProperties has state {self.describe(state)}")
        if layout is not None:
            rec = self.record(layout, "Layout", f"{where}.layout")
            if rec.args != ("torch.strided",) or rec.kwargs or rec.built:
                raise self.fail(f"{where}.layout is {show(rec.args)}; only torch.strided tensors are read")
        if type(requires_grad) is not bool or type(pin_memory) is not bool:
            raise self.fail(f"{where}: requires_grad / pin_memory are not bools")
        if mem_format is not None:
            rec = self.record(mem_format, "MemoryFormat", f"{where}.memory_format")
            if (rec.kwargs or rec.built or len(rec.args) != 1 or type(rec.args[0]) is not int
                    or not 0 <= rec.args[0] <= 2):
                raise self.fail(f"{where}.memory_format is {show(rec.args)}")
        return self.dtype(dtype, f"{where}.dtype")

    def plain(self, v, where: str, depth: int = 0):
        """planner_data: str / int / None values in dicts, lists and tuples."""
        if depth > 8:
            raise self.fail(f"{where} is nested too deeply")
        if v is None or type(v) in (str, int, bool):
            return v
        if type(v) in (list, tuple):
            return tuple(self.plain(x, where, depth + 1) for x in v)
        if type(v) is dict:
            return {self.plain(k, where, depth + 1): self.plain(x, where, depth + 1) for k, x in v.items()}
        raise self.fail(f"{where} holds {self.describe(v)}")


def _plain_file_name(name: str) -> bool:
    return (
        bool(name) and name not in (".", "..") and "\0" not in name and "/" not in name and "\\" not in name
        and os.path.basename(name) == name and not os.path.isabs(name)
    )


def rebuild_index(top, kinds: dict[type, str], where: str) -> _dcp_md.Metadata:
    """Check the records an index unpickled into and build a fresh ``Metadata`` of them."""
    c = _Checker(kinds, where)
    meta = c.fields(top, "Metadata", "the index",
                    ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"),
                    ("state_dict_metadata", "storage_data"))
    entries, storage = meta["state_dict_metadata"], meta["storage_data"]
    if type(entries) is not dict or type(storage) is not dict:
        raise c.fail("state_dict_metadata / storage_data are not dicts")
    planner_data = c.plain(meta.get("planner_data"), "planner_data")
    version = c.text(meta.get("version"), "version")
    if meta.get("storage_meta") is not None:  # only checked: a fresh StorageMeta is made on load
        sm = c.fields(meta["storage_meta"], "StorageMeta", "storage_meta",
                      ("checkpoint_id", "save_id", "load_id", "modules"))
        for k in ("save_id", "load_id"):
            c.text(sm.get(k), f"storage_meta.{k}")
        cid = sm.get("checkpoint_id")
        if cid is not None and type(cid) is not str:
            rec = c.record(cid, "Path", "storage_meta.checkpoint_id")
            if rec.kwargs or rec.built or not all(type(p) is str for p in rec.args):
                raise c.fail("storage_meta.checkpoint_id is not a path")
        modules = sm.get("modules", [])
        if type(modules) is not list or not all(type(m) is str for m in modules):
            raise c.fail("storage_meta.modules is not a list of str")

    chunks_of: dict[str, dict[tuple[int, ...], tuple[int, ...]]] = {}
    dtype_of: dict[str, torch.dtype] = {}
    new_entries = {}
    for fqn, entry in entries.items():
        c.text(fqn, "a state_dict_metadata key", optional=False)
        at = f"state_dict_metadata[{show(fqn)}]"
        kind = c.kind(entry)
        if kind != "TensorStorageMetadata":
            raise c.fail(f"{at} is {c.describe(entry)}; only tensor entries are read")
        f = c.fields(entry, kind, at, ("properties", "size", "chunks"), ("properties", "size", "chunks"))
        dtype = c.properties(f["properties"], f"{at}.properties")
        size = c.size(f["size"], f"{at}.size")
        if type(f["chunks"]) is not list or not f["chunks"]:
            raise c.fail(f"{at}.chunks is not a non-empty list")
        chunks = {}
        for k, chunk in enumerate(f["chunks"]):
            where = f"{at}.chunks[{k}]"
            cf = c.fields(chunk, "ChunkStorageMetadata", where, ("offsets", "sizes"), ("offsets", "sizes"))
            offsets, sizes = c.size(cf["offsets"], f"{where}.offsets"), c.size(cf["sizes"], f"{where}.sizes")
            if len(offsets) != len(size) or len(sizes) != len(size) or any(
                o + s > d for o, s, d in zip(offsets, sizes, size)
            ):
                raise c.fail(f"{at}.chunks[{k}] ({offsets}, {sizes}) lies outside the tensor {size}")
            if offsets in chunks:
                raise c.fail(f"{at} has two chunks at {offsets}")
            chunks[offsets] = sizes
        _check_tiling(c, at, size, chunks)
        chunks_of[fqn], dtype_of[fqn] = chunks, dtype
        new_entries[fqn] = _dcp_md.TensorStorageMetadata(
            properties=_dcp_md.TensorProperties(dtype=dtype),
            size=torch.Size(size),
            chunks=[_dcp_md.ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
                    for o, s in chunks.items()],
        )

    new_storage = {}
    for key, info in storage.items():
        kf = c.fields(key, "MetadataIndex", "a storage_data key", ("fqn", "offset", "index"), ("fqn",))
        fqn = c.text(kf["fqn"], "a storage_data key's fqn", optional=False)
        offset = None if kf.get("offset") is None else c.size(kf["offset"], f"storage_data[{show(fqn)}].offset")
        index = c.integer(kf.get("index"), f"storage_data[{show(fqn)}].index", optional=True)
        at = f"storage_data[{show(fqn)}, {offset}]"
        if fqn not in chunks_of or offset not in chunks_of[fqn]:
            raise c.fail(f"{at} names no chunk of a tensor entry")
        sf = c.fields(info, "StorageInfo", at, ("relative_path", "offset", "length", "transform_descriptors"),
                      ("relative_path", "offset", "length"))
        rel = c.text(sf["relative_path"], f"{at}.relative_path", optional=False)
        if not _plain_file_name(rel):
            raise c.fail(f"{at}.relative_path {show(rel)} is not a file name inside the checkpoint directory")
        transforms = sf.get("transform_descriptors")
        if transforms is not None and (type(transforms) not in (list, tuple) or len(transforms)):
            raise c.fail(f"{at} asks for stream transforms {show(transforms)}; qzero writes none and reads none")
        mi = _dcp_md.MetadataIndex(fqn, offset, index)
        if mi in new_storage:
            raise c.fail(f"{at} appears twice")
        length = c.integer(sf["length"], f"{at}.length")
        numel = math.prod(chunks_of[fqn][offset])
        most = numel * dtype_of[fqn].itemsize + ARCHIVE_SLACK
        if length > most:
            raise c.fail(f"{at}.length is {length} bytes, longer than its chunk needs ({numel} elements of "
                         f"{dtype_of[fqn]}: at most {most} bytes with the archive around them)")
        if length < numel:  # whatever dtype the file holds (the reader checks it), a byte per element at least
            raise c.fail(f"{at}.length is {length} bytes, too short for its chunk of {numel} elements (a byte "
                         f"per element at least)")
        new_storage[mi] = _dcp_fs._StorageInfo(relative_path=rel, offset=c.integer(sf["offset"], f"{at}.offset"),
                                               length=length)
    for fqn, chunks in chunks_of.items():
        for offsets in chunks:
            if _dcp_md.MetadataIndex(fqn, offsets) not in new_storage:
                raise c.fail(f"chunk {offsets} of {show(fqn)} has no storage entry")
    _check_disjoint(c, new_storage)

    out = _dcp_md.Metadata(state_dict_metadata=new_entries, planner_data=planner_data, storage_data=new_storage)
    if hasattr(out, "version"):
        out.version = version
    return out


def _check_disjoint(c: _Checker, storage: dict) -> None:
    """No two storage entries share a byte of a file (so no range is read twice, whatever
    the number of chunks that would name it)."""
    by_file: dict[str, list] = {}
    for key, info in storage.items():
        by_file.setdefault(info.relative_path, []).append((info.offset, info.offset + info.length, key))
    for rel, ranges in by_file.items():
        ranges.sort(key=lambda r: (r[0], r[1]))
        for (_, end, a), (start, _, b) in zip(ranges, ranges[1:]):
            if start < end:
                raise c.fail(f"the storage entries of {show(a.fqn)} {tuple(a.offset)} and {show(b.fqn)} "
                             f"{tuple(b.offset)} overlap in {show(rel)} (at byte {start}); each byte is read once")


def _check_tiling(c: _Checker, at: str, size: tuple[int, ...], chunks: dict) -> None:
    """The chunks cover the tensor exactly once: a 1-D tensor by intervals, any other by one
    chunk (what DCP writes for qzero: sharded logical buffers and replicated tensors)."""
    if len(size) == 1:
        pos = 0
        for (o,), (s,) in sorted(chunks.items()):
            if o != pos:
                raise c.fail(f"{at}: chunks {'overlap' if o < pos else 'leave a gap'} at element {min(o, pos)}")
            pos = o + s
        if pos != size[0]:
            raise c.fail(f"{at}: chunks cover {pos} of {size[0]} elements")
    elif len(chunks) != 1 or next(iter(chunks.items())) != ((0,) * len(size), size):
        raise c.fail(f"{at}: a {len(size)}-d entry must be one chunk covering it, got {sorted(chunks.items())[:3]}")


__all__ = ["ARCHIVE_SLACK", "INDEX_DTYPES", "INDEX_FILE", "INDEX_GLOBALS", "IndexRefused", "IndexUnpickler",
           "MAX_INDEX_BYTES", "OPEN_FLAGS", "read_index", "read_regular_file", "rebuild_index", "show"]
