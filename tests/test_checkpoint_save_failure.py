"""A save that fails on rank 0 alone (a full disk, a permission) raises on every rank, and
never leaves the other ranks waiting in a collective; the previous checkpoint stays loadable."""

from __future__ import annotations

import errno
import os
import shutil

import pytest
import torch

import qzero
from _support.checkpoints import ADAMW, small_model, train
from _support.distributed import run_distributed
from qzero.optim.checkpoint import save as ckpt


def _saver(rank, world, root, where):
    model = small_model()
    opt = qzero.ZeroOptimizer(model, ADAMW)
    train(opt, model, 2, 0)
    path = os.path.join(root, "ckpt")
    opt.save_checkpoint(path)  # a good one first
    before = [g.master.clone() for g in opt.groups]
    train(opt, model, 1, 10)
    if rank == 0:
        if where == "publish":
            def full_disk(*a, **k):
                raise OSError(errno.ENOSPC, "No space left on device")
            ckpt.write_metadata = full_disk
        else:  # a killed save's leftovers that rank 0 may not remove
            os.makedirs(path + ckpt.TMP_SUFFIX, exist_ok=True)

            def refused(*a, **k):
                raise PermissionError(errno.EACCES, "Permission denied")
            shutil.rmtree = refused
    try:
        opt.save_checkpoint(path)
    except Exception as e:  # noqa: BLE001 - the outcome is the result
        raised = f"{type(e).__name__}: {e}"
    else:
        raised = None
    # Every rank returns: nobody waits for rank 0 in a collective. The previous checkpoint loads.
    fresh = qzero.ZeroOptimizer(small_model(seed=3), ADAMW)
    fresh.load_checkpoint(path)
    same = all(torch.equal(a, g.master) for a, g in zip(before, fresh.groups))
    return raised, same


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("where", ["publish", "clear"])
def test_a_save_failing_on_rank_0_raises_on_every_rank(tmp_path, world, where):
    results = run_distributed(_saver, world, str(tmp_path), where, timeout=90)
    rank0, *others = results
    assert rank0[0] is not None and ("No space left" in rank0[0] or "Permission denied" in rank0[0]), rank0
    for raised, _ in others:
        assert (raised is not None and raised.startswith("RuntimeError: save_checkpoint(")
                and "rank 0 could not" in raised)
    assert all(same for _, same in results), results  # the checkpoint at path is the previous one
