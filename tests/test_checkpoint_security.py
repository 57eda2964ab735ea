"""A checkpoint directory is untrusted input: loading one runs nothing from it and writes nothing.

DCP's index (``.metadata``) is a pickle. Cases: a plain ``os.system`` reduce; the two
gadgets inside ``torch.distributed.checkpoint`` that a prefix allow-list admitted
(``format_utils.torch_save_to_dcp`` makes torch ``torch.load(weights_only=False)`` a
shipped file, ``format_utils.dcp_to_torch_save`` writes where the index says); an index
made only of DCP's own classes that declares a tensor as a "bytes" entry (which DCP
reads with ``torch.load(weights_only=False)``); file names outside the directory; stream
transforms; chunks that leave part of a tensor unread; random pickle programs and
random mutations of a genuine index (hypothesis); empty and truncated index files. Each
raises a ValueError that says what is wrong, calls no canary, writes no file and leaves
the model and the optimizer as they were. A genuine checkpoint still loads bit-exactly,
also at another world size.
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import shutil
import struct
import sys

import pytest
import torch
import torch.distributed.checkpoint.format_utils as format_utils
from _support.checkpoints import (ADAMW, Attempt, Call, assert_same, files_under, fresh, save_genuine, small_model,
                                  snapshot, train)
from _support.distributed import run_distributed
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint import metadata as dcp_md

import qzero
from qzero.optim.checkpoint.index import (
    INDEX_DTYPES,
    INDEX_GLOBALS,
    IndexUnpickler,
    read_index,
    rebuild_index,
)
from qzero.optim.checkpoint.logical import logical_pieces
from qzero.optim.checkpoint.reader import IndexedReader

MODULE = __name__

# ------------------------------------------------------------------ canaries and helpers

CALLS: list = []


def canary(*args, **kwargs):
    """Reachable by name from a pickle; a load that calls it has run code from the checkpoint."""
    CALLS.append(("call", args))


class Canary:
    def __new__(cls, *args, **kwargs):
        CALLS.append(("new", args))
        return super().__new__(cls)

    def __setstate__(self, state):
        CALLS.append(("setstate", state))


@pytest.fixture(scope="module")
def genuine(tmp_path_factory):
    """A checkpoint after 3 steps, and the state it holds."""
    return save_genuine(tmp_path_factory.mktemp("genuine"))


@pytest.fixture
def attempt(tmp_path, genuine):
    return Attempt(tmp_path, genuine[0], CALLS)


# ------------------------------------------------------------------ the reported gadgets


def test_torch_save_to_dcp_gadget_is_refused_and_its_file_never_loaded(attempt):
    payload = attempt.ship_payload()
    out = os.path.join(attempt.root, "converted")
    attempt.write_index(pickle.dumps(Call(format_utils.torch_save_to_dcp, payload, out)))
    msg = attempt.load_refused("torch.distributed.checkpoint.format_utils.torch_save_to_dcp")
    assert "refuses" in msg and not os.path.exists(out)


def test_dcp_to_torch_save_gadget_is_refused_and_writes_nothing(attempt, genuine):
    inner = os.path.join(attempt.path, "inner")
    shutil.copytree(genuine[0], inner)
    target = os.path.join(attempt.root, "written.pt")
    attempt.write_index(pickle.dumps(Call(format_utils.dcp_to_torch_save, inner, target)))
    attempt.load_refused("torch.distributed.checkpoint.format_utils.dcp_to_torch_save")
    assert not os.path.exists(target)


def test_os_system_is_refused(attempt):
    attempt.write_index(pickle.dumps(Call(os.system, f"touch {attempt.marker}")))
    attempt.load_refused(r"refers to (posix|nt|os)\.system")


def test_a_gadget_inside_a_genuine_index_is_refused(attempt):
    md = attempt.trusted_index()
    md.planner_data = Call(format_utils.torch_save_to_dcp, attempt.ship_payload(), os.path.join(attempt.root, "out"))
    attempt.write_index(pickle.dumps(md))
    attempt.load_refused("format_utils.torch_save_to_dcp")


def test_a_tensor_declared_as_bytes_is_refused(attempt):
    """Only DCP's own classes, but DCP would torch.load(weights_only=False) the named bytes."""
    payload = attempt.ship_payload("__9_0.distcp")
    md = attempt.trusted_index()
    md.state_dict_metadata["group0.master"] = dcp_md.BytesStorageMetadata()
    md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != "group0.master"}
    md.storage_data[dcp_md.MetadataIndex("group0.master")] = dcp_fs._StorageInfo(
        os.path.basename(payload), 0, os.path.getsize(payload)
    )
    attempt.write_index(pickle.dumps(md))
    attempt.load_refused("BytesStorageMetadata")


def test_the_reader_refuses_a_non_tensor_read(tmp_path, genuine):
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import _create_read_item_for_byteio

    index, _ = read_index(genuine[0])
    item = _create_read_item_for_byteio(dcp_md.MetadataIndex("x"), 0, dcp_md.MetadataIndex("x"), 0, 0)
    with pytest.raises(ValueError, match="non-tensor read"):
        IndexedReader(genuine[0], index).read_data(LoadPlan([item]), None)


@pytest.mark.parametrize("where", ["../outside.distcp", "/etc/hostname", "sub/dir.distcp", ".."])
def test_a_tensor_file_outside_the_directory_is_refused(attempt, where):
    md = attempt.trusted_index()
    for info in md.storage_data.values():
        info.relative_path = where
    attempt.write_index(pickle.dumps(md))
    attempt.load_refused("is not a file name inside the checkpoint directory")


def test_a_tensor_file_that_is_a_link_is_refused(attempt):
    shard = os.path.join(attempt.path, "__0_0.distcp")
    os.rename(shard, os.path.join(attempt.root, "elsewhere.distcp"))
    os.symlink(os.path.join(attempt.root, "elsewhere.distcp"), shard)
    attempt.load_refused("not a regular file")


def test_stream_transforms_are_refused(attempt):
    md = attempt.trusted_index()
    next(iter(md.storage_data.values())).transform_descriptors = ["zstd"]
    attempt.write_index(pickle.dumps(md))
    attempt.load_refused("stream transforms")


@pytest.mark.parametrize("case", ["gap", "overlap", "short", "no storage"])
def test_chunks_must_cover_each_tensor_once(attempt, case):
    md = attempt.trusted_index()
    entry = md.state_dict_metadata["group0.master"]
    (n,) = entry.size
    if case == "gap":
        entry.chunks = [dcp_md.ChunkStorageMetadata(torch.Size([0]), torch.Size([n - 8]))]
    elif case == "overlap":
        entry.chunks.append(dcp_md.ChunkStorageMetadata(torch.Size([8]), torch.Size([8])))
    elif case == "short":
        entry.size = torch.Size([n - 1])
    else:
        md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != "group0.master"}
    attempt.write_index(pickle.dumps(md))
    attempt.load_refused("malformed|lies outside")


def test_an_index_that_disagrees_with_qzero_json_is_refused(attempt):
    md = attempt.trusted_index()
    del md.state_dict_metadata["group0.state.exp_avg"]
    md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != "group0.state.exp_avg"}
    attempt.write_index(pickle.dumps(md))
    attempt.load_refused("has no entry 'group0.state.exp_avg'")


@pytest.mark.parametrize("length", ["empty", 1, 2, 40, "half", -30, -1])
def test_empty_and_truncated_indexes_are_refused(attempt, length):
    data = attempt.genuine_index
    cut = {"empty": 0, "half": len(data) // 2}.get(length, length)
    attempt.write_index(data[:cut])
    attempt.load_refused("checkpoint index .metadata is (empty|not a valid pickle|malformed)")


def test_a_missing_index_is_refused(attempt):
    os.remove(attempt.index)
    attempt.load_refused("cannot read the checkpoint index")


def corrupt_tail(path: str, n: int = 64) -> None:
    """Scramble the last bytes of a tensor file (its last item's zip directory)."""
    with open(path, "r+b") as f:
        f.seek(-n, os.SEEK_END)
        tail = f.read(n)
        f.seek(-n, os.SEEK_END)
        f.write(bytes(255 - b for b in tail))


def test_a_corrupt_tensor_file_is_refused_before_anything_is_copied(attempt):
    """Its first items are fine, its last is not: none of them may reach the optimizer."""
    corrupt_tail(os.path.join(attempt.path, "__0_0.distcp"))
    attempt.load_refused("cannot be read as a tensor")


def _corrupt_run(rank, world, path, mode):
    model = small_model(seed=rank if mode == "save" else 50 + rank)
    opt = qzero.ZeroOptimizer(model, ADAMW)
    train(opt, model, 1, 10 * rank + (0 if mode == "save" else 99))
    if mode == "save":
        opt.save_checkpoint(path)
        return None
    before = snapshot(opt, model)
    try:
        opt.load_checkpoint(path)
        return "loaded"
    except ValueError as e:
        assert_same(snapshot(opt, model), before)
        return str(e)


def test_a_tensor_file_corrupt_for_one_rank_leaves_every_rank_untouched(tmp_path):
    path = str(tmp_path / "ckpt")
    run_distributed(_corrupt_run, 2, path, "save")
    corrupt_tail(os.path.join(path, "__1_0.distcp"))
    msgs = run_distributed(_corrupt_run, 2, path, "load")
    assert "cannot be read as a tensor" in msgs[1], msgs
    assert "cannot be read as a tensor" in msgs[0] or "rank(s) [1]" in msgs[0], msgs


def _edit_json(meta: dict, case: str):
    g = meta["groups"][0]
    if case == "lr is a string":
        g["hyperparameters"]["lr"] = "0.1; rm -rf /"
    elif case == "lr is NaN":
        g["hyperparameters"]["lr"] = float("nan")
    elif case == "betas of another length":
        g["hyperparameters"]["betas"] = [0.9]
    elif case == "a flag holds a list":
        g["hyperparameters"]["foreach"] = [1]
    elif case == "loss scale missing":
        del meta["loss_scaler"]["scale"]
    elif case == "loss scale infinite":
        meta["loss_scaler"]["scale"] = float("inf")
    elif case == "scalar state as large as the world":
        g["state"]["step"]["shape"] = [10**12]
    elif case == "state shape not ints":
        g["state"]["step"]["shape"] = ["x"]
    return meta


@pytest.mark.parametrize("case", ["lr is a string", "lr is NaN", "betas of another length", "a flag holds a list",
                                  "loss scale missing", "loss scale infinite", "scalar state as large as the world",
                                  "state shape not ints", "deeply nested", "not utf-8"])
def test_a_tampered_qzero_json_is_refused_before_anything_is_loaded(attempt, case):
    import json

    meta_path = os.path.join(attempt.path, "qzero.json")
    if case == "deeply nested":
        data = b"[" * 200_000
    elif case == "not utf-8":
        data = b"\xff\xfe{}"
    else:
        with open(meta_path) as f:
            data = json.dumps(_edit_json(json.load(f), case)).encode()
    with open(meta_path, "wb") as f:
        f.write(data)
    attempt.load_refused("qzero.json|hyperparameter")


@pytest.mark.parametrize("content", ['{"auto_map": {"AutoModelForCausalLM": "x/y--m.M"}}', "[1]", "{"])
def test_a_model_config_file_that_names_remote_code_or_is_not_an_object_is_refused(tmp_path, content):
    from qzero.app.workload import WorkloadError, model_config

    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(WorkloadError, match="model config file .*(auto_map|not a JSON object|not valid JSON)"):
        model_config(config_path=str(path))


# ------------------------------------------------------------------ the allow-list


def traced_globals(data: bytes) -> set:
    seen = set()

    class Trace(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    Trace(io.BytesIO(data)).load()  # a genuine index this test wrote
    return seen


def test_the_list_covers_a_genuine_index_and_holds_only_classes(genuine):
    with open(os.path.join(genuine[0], ".metadata"), "rb") as f:
        data = f.read()
    used = traced_globals(data)
    assert used <= set(INDEX_GLOBALS) | {("torch", n) for n in INDEX_DTYPES}, used
    for module, name in INDEX_GLOBALS:
        try:
            obj = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue  # the spelling of another Python version (pathlib._local)
        if (module, name) == ("torch.serialization", "_get_layout"):
            assert obj(str(torch.strided)) is torch.strided  # how torch pickles layouts; resolved by a table
        else:
            assert isinstance(obj, type) and obj is not dcp_md.BytesStorageMetadata, (module, name)
    for name, dtype in INDEX_DTYPES.items():
        assert isinstance(dtype, torch.dtype) and str(dtype) == f"torch.{name}"


def test_the_unpickler_hands_out_inert_records_only():
    up = IndexUnpickler(io.BytesIO(b""), "test")
    for module, name in INDEX_GLOBALS:
        got = up.find_class(module, name)
        assert got.__module__ == "qzero.optim.checkpoint.index" and got in up.kinds
    assert not callable(up.find_class("torch", "float32"))
    for module, name in [("torch.distributed.checkpoint.format_utils", "torch_save_to_dcp"), ("builtins", "getattr"),
                         ("torch", "load"), ("collections", "OrderedDict"), (MODULE, "canary")]:
        with pytest.raises(ValueError, match=f"refers to {module}.{name}"):
            up.find_class(module, name)


def test_a_genuine_index_pickled_at_protocols_2_to_5_is_read(genuine):
    """(Protocols 0 and 1 pickle dataclasses through copyreg._reconstructor: refused; DCP
    writes the default protocol.)"""
    with open(os.path.join(genuine[0], ".metadata"), "rb") as f:
        md = pickle.loads(f.read())
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        data = pickle.dumps(md, protocol=protocol)
        up = IndexUnpickler(io.BytesIO(data), "test")
        got = rebuild_index(up.load(), up.kinds, "test")
        assert got.state_dict_metadata == md.state_dict_metadata and got.storage_data == md.storage_data


# ------------------------------------------------------------------ fuzz


POOL_GLOBALS = [
    *INDEX_GLOBALS,
    ("torch", "float32"),
    ("torch", "bfloat16"),
    ("os", "system"),
    ("posix", "system"),
    ("builtins", "eval"),
    ("builtins", "exec"),
    ("builtins", "getattr"),
    ("builtins", "__import__"),
    ("subprocess", "Popen"),
    ("shutil", "rmtree"),
    ("torch", "load"),
    ("torch", "save"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("copyreg", "_reconstructor"),
    ("collections", "OrderedDict"),
    ("torch.distributed.checkpoint.format_utils", "torch_save_to_dcp"),
    ("torch.distributed.checkpoint.format_utils", "dcp_to_torch_save"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.filesystem", "FileSystemReader"),
    ("torch.distributed.checkpoint", "load"),
    (MODULE, "canary"),
    (MODULE, "Canary"),
]


def _text(s: str) -> bytes:
    b = s.encode()
    return b"\x8c" + bytes([len(b)]) + b if len(b) < 256 else b"X" + struct.pack("<I", len(b)) + b


def op_strategy(strings):
    simple = st.sampled_from([
        b"(", b")", b"]", b"}", b"N", b"\x88", b"\x89", b"t", b"\x85", b"\x86", b"\x87", b"R", b"b", b"\x81",
        b"\x92", b"a", b"e", b"s", b"u", b"\x94", b"0", b"2", b"l", b"d", b"\x90", b"\x91", b"Q", b"o",
    ])
    return st.one_of(
        simple,
        st.sampled_from(POOL_GLOBALS).map(lambda g: _text(g[0]) + _text(g[1]) + b"\x93"),
        st.sampled_from(POOL_GLOBALS).map(lambda g: b"c" + g[0].encode() + b"\n" + g[1].encode() + b"\n"),
        st.integers(-(2**31), 2**31 - 1).map(lambda i: b"J" + struct.pack("<i", i)),
        st.integers(0, 40).map(lambda i: b"h" + bytes([i])),
        st.integers(0, 255).map(lambda i: b"\x82" + bytes([i])),
        st.sampled_from(strings).map(_text),
    )


@pytest.fixture(scope="module")
def fuzz_box(tmp_path_factory, genuine):
    box = Attempt(tmp_path_factory.mktemp("fuzz"), genuine[0], CALLS)
    payload = box.ship_payload()
    strings = [f"touch {box.marker}", payload, box.path, os.path.join(box.root, "out"), "torch.strided", "float32",
               "group0.master", "__0_0.distcp", "../x", "relative_path", "state_dict_metadata", "storage_data"]
    return box, strings


def _check_attempt(box: Attempt, genuine_state: dict, data: bytes) -> None:
    box.write_index(data)
    opt, model = fresh()
    before, files, calls = snapshot(opt, model), files_under(box.root), len(CALLS)
    try:
        opt.load_checkpoint(box.path)
        loaded = True
    except ValueError as e:
        loaded = False
        assert str(e).startswith(repr(box.path)) and ".metadata" in str(e), str(e)
    assert len(CALLS) == calls, f"a canary ran: {CALLS[calls:]}"
    assert not os.path.exists(box.marker)
    assert files_under(box.root) == files
    assert_same(snapshot(opt, model), genuine_state if loaded else before)


FUZZ = dict(deadline=None, max_examples=120, derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                   HealthCheck.data_too_large])


@settings(**FUZZ)
@given(data=st.data())
def test_fuzz_random_pickle_programs(fuzz_box, genuine, data):
    box, strings = fuzz_box
    ops = data.draw(st.lists(op_strategy(strings), min_size=1, max_size=40))
    proto = data.draw(st.sampled_from([b"", b"\x80\x02", b"\x80\x04"]))
    _check_attempt(box, genuine[1], proto + b"".join(ops) + b".")


@settings(**FUZZ)
@given(data=st.data())
def test_fuzz_mutations_of_a_genuine_index(fuzz_box, genuine, data):
    """A genuine index at protocol 2 (text GLOBAL opcodes, no frames): one of its globals
    swapped for another name, and/or a few bytes changed. Either refused, or (a harmless
    change, such as inside an id string) loaded exactly as the genuine checkpoint."""
    box, _ = fuzz_box
    raw = pickle.dumps(pickle.loads(box.genuine_index), protocol=2)
    names = [b"c" + m.encode() + b"\n" + n.encode() + b"\n" for m, n in traced_globals(raw)]
    if data.draw(st.booleans()):
        old = data.draw(st.sampled_from(sorted(names)))
        new = data.draw(st.sampled_from(POOL_GLOBALS))
        raw = raw.replace(old, b"c" + new[0].encode() + b"\n" + new[1].encode() + b"\n")
    edits = data.draw(st.lists(st.tuples(st.integers(0, len(raw) - 1), st.integers(0, 255), st.sampled_from("rid")),
                               max_size=4))
    buf = bytearray(raw)
    for pos, byte, kind in edits:
        pos = min(pos, len(buf) - 1)
        if kind == "r":
            buf[pos] = byte
        elif kind == "i":
            buf.insert(pos, byte)
        elif len(buf) > 1:
            del buf[pos]
    _check_attempt(box, genuine[1], bytes(buf))


# ------------------------------------------------------------------ genuine checkpoints still load


def test_a_genuine_checkpoint_loads_bit_exactly(genuine):
    opt, model = fresh()
    opt.load_checkpoint(genuine[0])
    assert_same(snapshot(opt, model), genuine[1])


def _logical(parts, name):
    n = parts[0]["used"]
    out = torch.full((n,), float("nan"))
    for p in parts:
        for local, length, at in p["pieces"]:
            out[at : at + length] = p[name][local : local + length]
    return out


def _resharding_run(rank, world, path, mode):
    model = small_model(seed=rank if mode == "save" else 100 + rank)
    opt = qzero.ZeroOptimizer(model, ADAMW)
    if mode == "save":
        train(opt, model, 2, 10 * rank)
        opt.save_checkpoint(path)
    else:
        opt.load_checkpoint(path)
    g = opt.groups[0]
    st_ = opt.optimizer.state[g.master]
    return {"pieces": logical_pieces(g), "used": g.layout.used_numel, "master": g.master.clone(),
            "exp_avg": st_["exp_avg"].clone(), "exp_avg_sq": st_["exp_avg_sq"].clone(), "step": st_["step"].clone(),
            "model": {k: v.clone() for k, v in model.state_dict().items()}}


def test_a_genuine_checkpoint_loads_bit_exactly_across_world_sizes(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_distributed(_resharding_run, 2, path, "save")
    at3 = run_distributed(_resharding_run, 3, path, "load")
    at1 = [_resharding_run(0, 1, path, "load")]
    for loaded in (at3, at1):
        for name in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(_logical(loaded, name), _logical(saved, name)), name
        for r in loaded:
            assert torch.equal(r["step"], saved[0]["step"])
            assert all(torch.equal(r["model"][k], saved[0]["model"][k]) for k in saved[0]["model"])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
