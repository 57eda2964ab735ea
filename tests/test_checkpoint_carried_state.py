"""Loading what a checkpoint carries besides the masters and the optimizer state: the error-feedback
residuals of quantized gradients and the replica of delta weight gathers.

1. Residuals that are not finite (NaN, Inf, a float64 1e300 beyond bf16's range) are refused at
   load on every rank, naming the entry, and change nothing (at the same world size, read in
   place, and resharded, summed over the saved rows).
2. The residuals' world size, the one size a checkpoint claims that the model does not bound, is
   refused before anything is allocated when the index does not hold a row per claimed rank or
   it is not the checkpoint's own world size.
3. A saved replica farther from its rounded masters than the delta loop left it at save (0.25 on
   every element, or 1.0 on one element of one rank's partition) is not restored: every rank
   warns and the load ends with an exact resync; a genuine copy is restored.

One checkpoint is saved (world 2, both features on); the tampered copies are loaded by one
spawn of 2 ranks and one of 3 (``tests/_support/distributed.py``).
"""

from __future__ import annotations

import functools
import io
import json
import os
import pickle
import shutil
import time
import warnings

import pytest
import torch
from _support.checkpoints import assert_same, snapshot
from _support.distributed import run_distributed
from test_optim import make_model, train_steps
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint import metadata as dcp_md

import qzero

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)
CONFIG = dict(zero_quantized_weights=True, zero_quantized_weights_delta=True, zero_quantized_weights_group_size=16,
              small_param_numel=40, reduce_dtype="fp32", zero_quantized_gradients=True,
              zero_quantized_gradients_group_size=16, zero_quantized_gradients_error_feedback=True)
TIMEOUT = 90.0
RESIDUALS = "group0.error_feedback"


def _optimizer(seed):
    model = make_model(seed=seed)
    return qzero.ZeroOptimizer(model, ADAMW, config=qzero.ZeroConfig(**CONFIG)), model


def _save(rank, world, path):
    opt, model = _optimizer(rank)
    train_steps(model, opt, rank, world, range(3), [])
    opt.save_checkpoint(path)
    return float(opt.error_feedback[0].residual.float().abs().max())


def _load_each(rank, world, root, names):
    """Per copy: (message or None, unchanged on refusal, seconds, warnings, replica == bf16(master))."""
    out = {}
    for name in names:
        opt, model = _optimizer(50 + rank)
        train_steps(model, opt, rank, world, range(1), [])
        before, residual = snapshot(opt, model), opt.error_feedback[0].residual.clone()
        t0 = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                opt.load_checkpoint(os.path.join(root, name))
            except ValueError as e:
                same = torch.equal(residual.view(torch.int16), opt.error_feedback[0].residual.view(torch.int16))
                try:
                    assert_same(snapshot(opt, model), before)
                except AssertionError:
                    same = False
                out[name] = (str(e), same, time.monotonic() - t0, [], None)
                continue
        seconds = time.monotonic() - t0
        g = opt.groups[0]
        exact = torch.equal(g.own.view(torch.int16), g.master.to(g.dtype).view(torch.int16))
        train_steps(model, opt, rank, world, range(3, 4), [])  # it trains on
        said = [str(w.message) for w in caught if "qzero" in str(w.message)]
        out[name] = (None, None, seconds, said, exact)
    return out


# ------------------------------------------------------------------ tampering with a copy


def _index(path) -> dcp_md.Metadata:
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return pickle.load(f)  # the test's own copy of a genuine index


def _write_index(path, md) -> None:
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def _rewrite(path, fqn, change, dtype=None) -> None:
    """Every chunk of ``fqn`` replaced by ``change(chunk, offset)`` (in ``dtype``, declared so), in
    files of their own."""
    md = _index(path)
    for k, key in enumerate(sorted((k for k in md.storage_data if k.fqn == fqn), key=lambda k: tuple(k.offset))):
        info = md.storage_data[key]
        with open(os.path.join(path, info.relative_path), "rb") as f:
            f.seek(info.offset)
            chunk = torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
        name = f"__tampered_{k}.distcp"
        torch.save(change(chunk.clone() if dtype is None else chunk.to(dtype), key.offset[0]), os.path.join(path, name))
        md.storage_data[key] = dcp_fs._StorageInfo(name, 0, os.path.getsize(os.path.join(path, name)))
    if dtype is not None:
        md.state_dict_metadata[fqn].properties.dtype = dtype
    _write_index(path, md)


def _edit_json(path, edit) -> None:
    with open(os.path.join(path, "qzero.json")) as f:
        meta = json.load(f)
    edit(meta)
    with open(os.path.join(path, "qzero.json"), "w") as f:
        json.dump(meta, f)


def _poke(value, at):
    """Set logical element ``at`` of every saved rank's row (rows of ``n`` elements) to ``value``."""

    def change(chunk, offset):
        for start in range(0, 2 * N, N):
            if offset <= start + at < offset + chunk.numel():
                chunk[start + at - offset] = value
        return chunk

    return change


def _claim_ranks(ranks, also_world_size, stored_bytes=None):
    def tamper(path):
        """qzero.json claims ``ranks`` saving ranks; the index one more chunk, over all the rows
        claimed, stored in a sparse file of the bytes those rows need (or ``stored_bytes``)."""
        _edit_json(path, lambda m: (m["error_feedback"].update(world_size=ranks),
                                    m.update(world_size=ranks) if also_world_size else None))
        md = _index(path)
        entry = md.state_dict_metadata[RESIDUALS]
        entry.size = torch.Size([ranks * N])
        extra = dcp_md.ChunkStorageMetadata(offsets=torch.Size([2 * N]), sizes=torch.Size([(ranks - 2) * N]))
        entry.chunks.append(extra)
        length = (ranks - 2) * N * 2 if stored_bytes is None else stored_bytes
        with open(os.path.join(path, "__claimed.distcp"), "wb") as f:
            f.truncate(length)
        md.storage_data[dcp_md.MetadataIndex(RESIDUALS, extra.offsets)] = dcp_fs._StorageInfo(
            "__claimed.distcp", 0, length)
        _write_index(path, md)
    return tamper


N = 3800  # the logical parameters of make_model (its trainable ones)
AT = 100  # a logical element of 'emb.weight'

TAMPER = {
    "genuine": lambda path: None,
    "residual NaN in rank 1's row": lambda path: _rewrite(path, RESIDUALS,
                                                          lambda c, o: _poke(float("nan"), AT)(c, o) if o >= N else c),
    "residual Inf": lambda path: _rewrite(path, RESIDUALS, _poke(float("inf"), AT)),
    "residual 1e300 in float64": lambda path: _rewrite(path, RESIDUALS, _poke(1e300, AT), torch.float64),
    "16384 ranks claimed": _claim_ranks(16384, also_world_size=False),
    "16384 ranks claimed, world_size too": _claim_ranks(16384, also_world_size=True),
    "16384 ranks claimed, in 4 KiB": _claim_ranks(16384, also_world_size=True, stored_bytes=4096),
    "replica 0.25 away": lambda path: _rewrite(path, "group0.replica", lambda c, o: c + 0.25),
    "replica 1.0 away in one element": lambda path: _rewrite(
        path, "group0.replica", lambda c, o: (c.index_add_(0, torch.tensor([AT - o]), torch.ones(1, dtype=c.dtype))
                                              if o <= AT < o + c.numel() else c)),
}


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    root = tmp_path_factory.mktemp("carried")
    src = str(root / "src")
    residuals = run_distributed(_save, 2, src, timeout=TIMEOUT)
    assert min(residuals) > 0, "the checkpoint carries residuals"
    for name, tamper in TAMPER.items():
        shutil.copytree(src, root / name)
        tamper(str(root / name))
    return str(root)


@pytest.fixture(scope="module")
def at_2(copies):
    return run_distributed(_load_each, 2, copies, list(TAMPER), timeout=TIMEOUT)


@pytest.fixture(scope="module")
def at_3(copies):
    names = [n for n in TAMPER if n.startswith("residual") or n == "genuine"]
    return run_distributed(_load_each, 3, copies, names, timeout=TIMEOUT)


def test_the_genuine_copy_loads(at_2, at_3):
    for results in at_2 + at_3:
        msg, _, _, said, _ = results["genuine"]
        assert msg is None and said == [], (msg, said)


@pytest.mark.parametrize("name", [n for n in TAMPER if n.startswith("residual")])
def test_non_finite_residuals_are_refused_at_load_on_every_rank(at_2, at_3, name):
    """At the same world size (rows read in place) and at another (rows summed); only rank 1's
    row poisoned: the other ranks refuse too."""
    for world, results in ((2, at_2), (3, at_3)):
        for rank, result in enumerate(results):
            msg, unchanged, _, _, _ = result[name]
            assert msg is not None, (world, rank, name)
            assert (RESIDUALS in msg and "non-finite" in msg and "'emb.weight'" in msg) or "rank(s) [" in msg, msg
            assert unchanged, (world, rank, name)
    assert RESIDUALS in at_2[1][name][0]  # the rank that read the poisoned row names it


CLAIM_REFUSED = {
    "16384 ranks claimed": "error_feedback.world_size is 16384, but the checkpoint was saved by 2 ranks",
    "16384 ranks claimed, world_size too": "spans the rows of several ranks",
    "16384 ranks claimed, in 4 KiB": "is 4096 bytes, too short for its chunk of",
}


@pytest.mark.parametrize("name", sorted(CLAIM_REFUSED))
def test_a_claim_of_many_ranks_is_refused_before_anything_is_allocated(at_2, name):
    for msg, unchanged, seconds, _, _ in (r[name] for r in at_2):
        assert msg is not None and CLAIM_REFUSED[name] in msg, msg
        assert unchanged
        assert seconds < 1.0, f"took {seconds:.1f} s to refuse"


@pytest.mark.parametrize("name", [n for n in TAMPER if n.startswith("replica")])
def test_a_replica_far_from_its_masters_is_resynced_with_a_warning_on_every_rank(at_2, name):
    for msg, _, _, said, exact in (r[name] for r in at_2):
        assert msg is None, msg
        assert len(said) == 1 and "replica of group 0 is farther from its rounded masters" in said[0], said
        assert "not restored" in said[0] and "exact resync" in said[0], said
        assert exact, "the replica is bf16(master) after the load"
    assert at_2[0]["genuine"][4] is False, "a genuine replica is restored as saved (not bf16(master))"
