"""Loading a checkpoint either loads all of it or changes nothing, on every rank, and never hangs.

Grouped by what is protected:

1. all or nothing: a chunk that cannot be copied (a meta tensor, a bits16 or
   float4_e2m1fn_x2 chunk) is refused before anything is written, on every rank;
2. special files: an index that is a FIFO (or a link to one) is refused without
   blocking; the index and ``qzero.json`` are not followed through links;
3. bounded reads: oversized index / ``qzero.json`` files are refused before they are
   read; a storage entry may not be longer than its chunk needs, nor share bytes with
   another;
4. only the state the inner optimizer keeps (keys, dtypes, shapes) is accepted;
5. replicated tensors (buffers, frozen parameters, Adam's ``step``) must be the same
   bytes on every rank;
6. non-finite masters (or state) are refused at load, and a sliced step refuses a
   master that is already non-finite before anything is gathered;
7. every refusal is a ``ValueError`` naming the file and the field, of bounded length;
8. a structurally inconsistent state (a dtype changed, a key dropped, ``amsgrad``
   flipped) is refused at load, and a local error inside ``step()`` is not reported
   as a dead peer.

Distributed cases run on forked gloo ranks (``tests/_support/distributed.py``) under a timeout.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import tracemalloc

import pytest
import torch
import torch.distributed as dist
from _support.checkpoints import ADAMW, Attempt, assert_same, fresh, save_genuine, small_model, snapshot, train
from _support.distributed import run_distributed
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint import metadata as dcp_md

import qzero
import qzero.wire.chunks as chunks
from qzero.optim.checkpoint.logical import logical_pieces

TIMEOUT = 90.0


@pytest.fixture(scope="module")
def genuine(tmp_path_factory):
    """A checkpoint after 3 steps at world size 1, and the state it holds."""
    return save_genuine(tmp_path_factory.mktemp("genuine"))


@pytest.fixture
def attempt(tmp_path, genuine):
    return Attempt(tmp_path, genuine[0])


# ------------------------------------------------------------------ editing a copy


def storage_keys(md: dcp_md.Metadata, fqn: str) -> list[dcp_md.MetadataIndex]:
    return sorted((k for k in md.storage_data if k.fqn == fqn), key=lambda k: tuple(k.offset))


def ship(attempt: Attempt, md: dcp_md.Metadata, fqn: str, tensor: torch.Tensor, name: str, dtype=None) -> None:
    """Store ``tensor`` in a new tensor file as the (only) chunk of ``fqn``, the index edited to match."""
    path = os.path.join(attempt.path, name)
    torch.save(tensor, path)
    (key,) = storage_keys(md, fqn)
    md.storage_data[key] = dcp_fs._StorageInfo(name, 0, os.path.getsize(path))
    if dtype is not None:
        md.state_dict_metadata[fqn].properties.dtype = dtype


def edit_json(path: str, edit) -> None:
    meta_path = os.path.join(path, "qzero.json")
    with open(meta_path) as f:
        meta = json.load(f)
    out = edit(meta)
    with open(meta_path, "w") as f:
        f.write(out if isinstance(out, str) else json.dumps(meta))


def item_range(path: str, fqn: str, offset=None) -> tuple[str, int, int]:
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)  # the test's own genuine index
    keys = storage_keys(md, fqn)
    key = keys[0] if offset is None else next(k for k in keys if tuple(k.offset) == offset)
    info = md.storage_data[key]
    return os.path.join(path, info.relative_path), info.offset, info.length


def rewrite_item(path: str, fqn: str, change) -> None:
    """Replace the bytes of ``fqn``'s stored tensor by those of ``change(tensor)`` (same length)."""
    file, offset, length = item_range(path, fqn)
    with open(file, "r+b") as f:
        f.seek(offset)
        old = torch.load(io.BytesIO(f.read(length)), weights_only=True)
        buf = io.BytesIO()
        torch.save(change(old.clone()), buf)
        assert len(buf.getvalue()) == length
        f.seek(offset)
        f.write(buf.getvalue())


def load_outcome(opt, model, path):
    """(message or None, whether everything is unchanged)."""
    before = snapshot(opt, model)
    try:
        opt.load_checkpoint(path)
    except ValueError as e:
        after = snapshot(opt, model)
        try:
            assert_same(after, before)
            unchanged = True
        except AssertionError:
            unchanged = False
        return str(e), unchanged
    return None, False


# ------------------------------------------------------------------ 1. all or nothing

BAD_CHUNKS = {
    "meta tensor": lambda n: torch.empty(n, device="meta"),
    "bits16": lambda n: torch.zeros(n, dtype=torch.int16).view(torch.bits16),
    "float4_e2m1fn_x2": lambda n: torch.zeros(n, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
}


@pytest.mark.parametrize("kind,declared", [("meta tensor", False), ("bits16", False), ("bits16", True),
                                           ("float4_e2m1fn_x2", False), ("float4_e2m1fn_x2", True)])
def test_a_chunk_that_cannot_be_copied_changes_nothing(attempt, kind, declared):
    """The last tensor read is the bad one: the masters and the buffer before it must stay.
    ``declared``: the index gives the chunk's dtype too (refused before reading), or fp32."""
    md = attempt.trusted_index()
    n = md.state_dict_metadata["group0.state.exp_avg_sq"].size[0]
    bad = BAD_CHUNKS[kind](n)
    ship(attempt, md, "group0.state.exp_avg_sq", bad, "__9_0.distcp", dtype=bad.dtype if declared else None)
    attempt.write_index(pickle.dumps(md))
    msg = attempt.load_refused("group0.state.exp_avg_sq")
    assert ("meta" in msg) if bad.is_meta else (str(bad.dtype).removeprefix("torch.") in msg), msg


def _load_run(rank, world, path):
    model = small_model(seed=50 + rank)
    opt = qzero.ZeroOptimizer(model, ADAMW)
    train(opt, model, 1, 99 + rank)
    return load_outcome(opt, model, path)


def test_a_chunk_only_one_rank_reads_changes_nothing_on_any_rank(tmp_path):
    """Saved at world 2, rank 1's piece of exp_avg_sq is a meta tensor: neither rank may load."""
    path = str(tmp_path / "ckpt")
    run_distributed(_save_run, 2, path, 3)
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)
    key = storage_keys(md, "group0.state.exp_avg_sq")[1]
    info = md.storage_data[key]
    size = next(c.sizes for c in md.state_dict_metadata[key.fqn].chunks if c.offsets == key.offset)
    torch.save(torch.empty(tuple(size), device="meta"), os.path.join(path, "__9_0.distcp"))
    md.storage_data[key] = dcp_fs._StorageInfo("__9_0.distcp", 0, os.path.getsize(os.path.join(path, "__9_0.distcp")))
    assert info.relative_path != "__9_0.distcp"
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    for msg, unchanged in run_distributed(_load_run, 2, path, timeout=TIMEOUT):
        assert msg is not None and ("meta" in msg or "rank 1" in msg), msg
        assert unchanged


def _save_run(rank, world, path, steps, nan_at=None):
    model = small_model()
    opt = qzero.ZeroOptimizer(model, ADAMW)
    train(opt, model, steps, 10 * rank)
    if nan_at is not None:
        name, index = nan_at
        for local, length, at in logical_pieces(opt.groups[0]):
            if at <= index < at + length:
                target = opt.groups[0].master if name == "master" else opt.optimizer.state[opt.groups[0].master][name]
                target[local + index - at] = float("nan")
    opt.save_checkpoint(path)


# ------------------------------------------------------------------ 2. special files


def _fifo(path):
    os.mkfifo(path)


SPECIAL = {
    # name: (file, make(path of the file, genuine copy of it)), expected message
    "index is a FIFO": (".metadata", lambda p, keep: _fifo(p), r"\.metadata is not a regular file"),
    "index links to a FIFO": (".metadata", lambda p, keep: (os.remove(keep), _fifo(keep), os.symlink(keep, p)),
                              r"\.metadata is a link"),
    "index links to a regular copy": (".metadata", lambda p, keep: os.symlink(keep, p), r"\.metadata is a link"),
    "qzero.json links to a regular copy": ("qzero.json", lambda p, keep: os.symlink(keep, p), r"qzero\.json is a link"),
    "qzero.json is a FIFO": ("qzero.json", lambda p, keep: _fifo(p), r"qzero\.json"),
    "qzero.json is a directory": ("qzero.json", lambda p, keep: os.mkdir(p), r"qzero\.json"),
}


def _special_run(rank, world, root, names):
    out = {}
    for name in names:
        model = small_model(seed=50 + rank)
        opt = qzero.ZeroOptimizer(model, ADAMW)
        train(opt, model, 1, 99 + rank)
        out[name] = load_outcome(opt, model, os.path.join(root, name.replace(" ", "_"), "ckpt"))
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_special_files_are_refused_without_blocking(tmp_path, genuine, world):
    for name, (file, make, _) in SPECIAL.items():
        path = os.path.join(tmp_path, name.replace(" ", "_"), "ckpt")
        shutil.copytree(genuine[0], path)
        keep = os.path.join(tmp_path, name.replace(" ", "_"), "elsewhere")
        shutil.move(os.path.join(path, file), keep)
        make(os.path.join(path, file), keep)
    results = run_distributed(_special_run, world, str(tmp_path), list(SPECIAL), timeout=TIMEOUT)
    for rank_results in results:
        for name, (_, _, match) in SPECIAL.items():
            msg, unchanged = rank_results[name]
            assert msg is not None and unchanged, (name, msg)
            assert re.search(match, msg), (name, msg)


# ------------------------------------------------------------------ 3. bounded reads


@pytest.mark.parametrize("file", [".metadata", "qzero.json"])
def test_an_oversized_file_is_refused_before_it_is_read(attempt, file):
    """1 GiB, sparse (nothing on disk): refused by its size, without reading it into memory."""
    os.truncate(os.path.join(attempt.path, file), 1 << 30)
    opt, model = fresh()
    before = snapshot(opt, model)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=rf"{file} is larger than"):
            opt.load_checkpoint(attempt.path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"{peak} bytes were allocated to refuse it"
    assert_same(snapshot(opt, model), before)


def test_a_storage_entry_longer_than_its_chunk_needs_is_refused(attempt):
    """A 6-element buffer whose stored tensor is a view of 4 MiB: torch.save keeps the whole
    storage, torch.load would allocate it all."""
    md = attempt.trusted_index()
    big = torch.arange(float(1 << 20))[:6].view(2, 3)
    ship(attempt, md, "model.table", big, "__9_0.distcp")
    attempt.write_index(pickle.dumps(md))
    attempt.load_refused(r"model\.table.*longer than its chunk needs")


def test_two_entries_naming_the_same_bytes_are_refused(attempt):
    md = attempt.trusted_index()
    (a,), (b,) = storage_keys(md, "group0.state.exp_avg"), storage_keys(md, "group0.state.exp_avg_sq")
    md.storage_data[b] = md.storage_data[a]
    attempt.write_index(pickle.dumps(md))
    attempt.load_refused(r"overlap")


def test_many_chunks_naming_one_range_are_refused(attempt):
    """exp_avg split into 8 chunks that all name the bytes of the whole tensor."""
    md = attempt.trusted_index()
    entry = md.state_dict_metadata["group0.state.exp_avg"]
    (key,) = storage_keys(md, "group0.state.exp_avg")
    info = md.storage_data.pop(key)
    (n,) = entry.size
    step = n // 8
    entry.chunks = []
    for k in range(8):
        lo, hi = k * step, (n if k == 7 else (k + 1) * step)
        entry.chunks.append(dcp_md.ChunkStorageMetadata(torch.Size([lo]), torch.Size([hi - lo])))
        md.storage_data[dcp_md.MetadataIndex("group0.state.exp_avg", torch.Size([lo]), 0)] = info
    attempt.write_index(pickle.dumps(md))
    attempt.load_refused(r"overlap")


# ------------------------------------------------------------------ 4. only the state the optimizer keeps


@pytest.mark.parametrize("sharded", [True, False])
def test_state_the_optimizer_does_not_keep_is_refused(attempt, sharded):
    """qzero.json and the index agree on an extra fp64 state tensor (a few bytes of edit
    each): it would be allocated, kept, and saved again."""
    md = attempt.trusted_index()
    n = md.state_dict_metadata["group0.master"].size[0]
    shape = [n] if sharded else [3]
    md.state_dict_metadata["group0.state.extra"] = dcp_md.TensorStorageMetadata(
        dcp_md.TensorProperties(dtype=torch.float64), torch.Size(shape),
        [dcp_md.ChunkStorageMetadata(torch.Size([0]), torch.Size(shape))])
    md.storage_data[dcp_md.MetadataIndex("group0.state.extra", torch.Size([0]), 0)] = dcp_fs._StorageInfo("x", 0, 0)
    ship(attempt, md, "group0.state.extra", torch.zeros(shape, dtype=torch.float64), "__9_0.distcp")
    attempt.write_index(pickle.dumps(md))
    edit_json(attempt.path, lambda m: m["groups"][0]["state"].__setitem__(
        "extra", {"sharded": sharded, "shape": shape, "dtype": "float64"}))
    attempt.load_refused(r"'extra'.*AdamW keeps")


def _amsgrad(params):
    return torch.optim.AdamW(params, lr=1e-2, amsgrad=True)


def _momentum(params):
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


@pytest.mark.parametrize("factory,steps", [(_amsgrad, 2), (_momentum, 2), (ADAMW, 0)],
                         ids=["AdamW amsgrad", "SGD momentum", "never stepped"])
def test_genuine_checkpoints_of_other_states_still_load_bit_exactly(tmp_path, factory, steps):
    model = small_model()
    opt = qzero.ZeroOptimizer(model, factory)
    train(opt, model, steps, 0)
    opt.save_checkpoint(str(tmp_path / "c"))
    want = snapshot(opt, model)
    other, other_model = fresh(factory)
    if steps == 0:  # a fresh optimizer has no state either
        want["state"] = [{}]
    other.load_checkpoint(str(tmp_path / "c"))
    assert_same(snapshot(other, other_model), want)


# ------------------------------------------------------------------ 5. replicated tensors agree


def frozen_model(seed):
    model = small_model(seed)
    model[2].bias.requires_grad_(False)
    return model


REPLICATED = {
    "buffer": ("model.table", lambda t: t + 1),
    "frozen parameter": ("model.2.bias", lambda t: t * 2),
    "Adam's step": ("group0.state.step", lambda t: t + 1),
}


def _replicated_run(rank, world, root, names):
    out = {}
    for name in names:
        model = frozen_model(seed=50)
        opt = qzero.ZeroOptimizer(model, ADAMW)
        train(opt, model, 1, 99)
        out[name] = load_outcome(opt, model, os.path.join(root, name.replace(" ", "_"), f"rank{rank}"))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_replicated_tensors_that_differ_between_ranks_are_refused_on_every_rank(tmp_path, world):
    """Each rank reads its own copy of the directory; the last rank's copy differs only in
    the bytes of one replicated tensor (index and qzero.json identical)."""
    model = frozen_model(seed=0)
    opt = qzero.ZeroOptimizer(model, ADAMW)
    train(opt, model, 3, 0)
    src = str(tmp_path / "src")
    opt.save_checkpoint(src)
    for name, (fqn, change) in REPLICATED.items():
        for r in range(world):
            dst = os.path.join(tmp_path, name.replace(" ", "_"), f"rank{r}")
            shutil.copytree(src, dst)
            if r == world - 1:
                rewrite_item(dst, fqn, change)
    results = run_distributed(_replicated_run, world, str(tmp_path), list(REPLICATED), timeout=TIMEOUT)
    for rank, rank_results in enumerate(results):
        for name, (fqn, _) in REPLICATED.items():
            msg, unchanged = rank_results[name]
            assert msg is not None and fqn in msg and "differs between ranks" in msg, (rank, name, msg)
            assert unchanged, (rank, name)


# ------------------------------------------------------------------ 6. non-finite masters


@pytest.mark.parametrize("name", ["master", "exp_avg_sq"])
def test_a_non_finite_master_or_state_is_refused_at_load(tmp_path, name):
    path = str(tmp_path / "ckpt")
    _save_run(0, 1, path, 3, (name, 1000))
    opt, model = fresh()
    msg, unchanged = load_outcome(opt, model, path)
    assert msg is not None and "non-finite" in msg and unchanged, msg
    assert ("'0.weight'" if name == "master" else name) in msg, msg


def test_a_non_finite_master_in_one_ranks_shard_is_refused_on_every_rank(tmp_path):
    path = str(tmp_path / "ckpt")
    _save_run(0, 1, path, 3, ("master", 2000))  # loaded at world 2: inside rank 1's partition
    for msg, unchanged in run_distributed(_load_run, 2, path, timeout=TIMEOUT):
        assert msg is not None and ("non-finite" in msg or "rank(s) [1]" in msg) and unchanged, msg


def _nan_master_step(rank, world, quantized):
    model = small_model()
    cfg = qzero.ZeroConfig(zero_quantized_weights=quantized, small_param_numel=16 if quantized else 65536)
    opt = qzero.ZeroOptimizer(model, ADAMW, config=cfg)
    train(opt, model, 1, 0)  # the state exists: the next step is sliced
    opt.wait_for_weights()
    with torch.no_grad():
        if rank == world - 1:
            opt.groups[0].master[1] = float("nan")
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(5)).bfloat16()
    opt.backward((model(x).float() ** 2).mean())
    before = [g.flat.clone() for g in opt.groups]
    try:
        opt.step()
    except FloatingPointError as e:
        unchanged = all(torch.equal(a, g.flat) for a, g in zip(before, opt.groups))
        return str(e), unchanged
    opt.wait_for_weights()
    return None, all(torch.isfinite(g.flat).all() for g in opt.groups)


@pytest.mark.parametrize("world,quantized", [(1, False), (2, True), (3, False)])
def test_a_sliced_step_refuses_an_already_non_finite_master_before_the_gather(world, quantized):
    for msg, unchanged in run_distributed(_nan_master_step, world, quantized, timeout=TIMEOUT):
        assert msg is not None, "an already non-finite master was gathered"
        assert "non-finite weights" in msg and "nothing was gathered" in msg, msg
        assert unchanged, "something was gathered"


# ------------------------------------------------------------------ 7. every refusal: a bounded ValueError


def _deep(n):
    return "[" * n + "]" * n


def _setter(*path):
    def put(meta, value):
        t = meta
        for k in path[:-1]:
            t = t[k]
        t[path[-1]] = value
        return meta
    return put


JSON_CASES = {
    # name: (edit of the parsed qzero.json -> None or the new text, the field the message names)
    "lr of 401 digits": (lambda m: _setter("groups", 0, "hyperparameters", "lr")(m, 10**400), r"lr"),
    "loss scale of 401 digits": (lambda m: _setter("loss_scaler", "scale")(m, 10**400), r"loss_scaler\.scale"),
    "clean steps of 401 digits": (lambda m: _setter("loss_scaler", "clean_steps")(m, 10**400),
                                  r"loss_scaler\.clean_steps"),
    "used_numel of 401 digits": (lambda m: _setter("groups", 0, "used_numel")(m, 10**400), r"used_numel"),
    "a shape that is an int": (lambda m: _setter("groups", 0, "shapes", 0)(m, 5), r"shapes"),
    "a state dtype that is a list": (lambda m: _setter("groups", 0, "state", "step", "dtype")(m, ["x"]), r"dtype"),
    "names nested deeply": (lambda m: json.dumps(_setter("groups", 0, "names")(m, "@@")).replace('"@@"', _deep(500)),
                            r"groups\[0\]\.names"),
    "an unknown field nested deeply": (lambda m: json.dumps({**m, "extra": "@@"}).replace('"@@"', _deep(500)),
                                       r"extra"),
    "a state key of 10 MB": (lambda m: _setter("groups", 0, "state", "x" * 10_000_000)(m, 1), r"state"),
}


@pytest.mark.parametrize("name", sorted(JSON_CASES))
def test_a_tampered_field_is_a_bounded_value_error_naming_it(attempt, name):
    edit, field = JSON_CASES[name]
    edit_json(attempt.path, edit)
    msg = attempt.load_refused(rf"qzero\.json.*{field}|{field}.*qzero\.json")
    assert len(msg) < 1000, f"a message of {len(msg)} characters"


def test_a_long_name_in_the_index_gives_a_bounded_message(attempt):
    md = attempt.trusted_index()
    for info in md.storage_data.values():
        info.relative_path = "../" + "x" * 1_000_000
    attempt.write_index(pickle.dumps(md))
    msg = attempt.load_refused(r"\.metadata.*relative_path")
    assert len(msg) < 1000, f"a message of {len(msg)} characters"


# ------------------------------------------------------------------ 8. inconsistent state


INCONSISTENT = {
    "exp_avg stored as float64": lambda m: _setter("groups", 0, "state", "exp_avg", "dtype")(m, "float64"),
    "exp_avg_sq dropped": lambda m: m["groups"][0]["state"].pop("exp_avg_sq"),
    "amsgrad flipped on": lambda m: _setter("groups", 0, "hyperparameters", "amsgrad")(m, True),
}


@pytest.mark.parametrize("name", sorted(INCONSISTENT))
def test_a_structurally_inconsistent_state_is_refused_at_load(attempt, name):
    edit_json(attempt.path, INCONSISTENT[name])
    attempt.load_refused(r"qzero\.json.*(state|amsgrad)")


def _local_error_step(rank, world):
    model = small_model()
    opt = qzero.ZeroOptimizer(model, ADAMW)
    train(opt, model, 1, 0)
    state = opt.optimizer.state[opt.groups[0].master]
    state["exp_avg"] = state["exp_avg"].double()  # the sliced update fails on every rank, locally
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank)).bfloat16()
    opt.backward((model(x).float() ** 2).mean())
    try:
        opt.step()
    except chunks.PeerFailure as e:
        return "PeerFailure", str(e)
    except RuntimeError as e:
        return type(e).__name__, str(e)
    return None, None


@pytest.mark.parametrize("world", [1, 2])
def test_a_local_error_in_step_is_not_reported_as_a_dead_peer(world):
    for kind, msg in run_distributed(_local_error_step, world, timeout=TIMEOUT):
        assert kind is not None, "the step did not fail"
        assert kind != "PeerFailure" and "peer rank died" not in msg, msg


def _raise_locally():
    raise RuntimeError("expected scalar type Float but found Double")


def test_the_peer_failure_wrapper_wraps_backend_errors_only():
    with pytest.raises(RuntimeError, match="expected scalar type") as e:
        with chunks.peer_failure("the weight gather"):
            _raise_locally()
    assert not isinstance(e.value, chunks.PeerFailure)
    with pytest.raises(chunks.PeerFailure, match="peer rank died.*Connection closed by peer"):
        with chunks.peer_failure("the weight gather"):
            raise dist.DistBackendError("Connection closed by peer")

