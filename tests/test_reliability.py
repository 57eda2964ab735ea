"""Reliability: non-finite weights, dead ranks, killed checkpoint saves (tampered checkpoints:
test_checkpoint_security.py)."""

import datetime
import functools
import multiprocessing as mp
import os
import queue
import random
import signal
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
from _support.distributed import run_distributed

import qzero
import qzero.wire.chunks as chunks
import qzero.wire.comm as comm

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)


def small_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16)).bfloat16()


# ------------------------------------------------------------------ non-finite weights


def nan_step(rank, world):
    model = small_model()
    opt = qzero.ZeroOptimizer(model, ADAMW, config=qzero.ZeroConfig(small_param_numel=16))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank)).bfloat16()
    loss = (model(x).float() ** 2).mean()
    opt.backward(loss * (float("nan") if rank == 1 else 1.0))  # NaN gradients from rank 1 only
    before = [g.flat.clone() for g in opt.groups]
    try:
        opt.step()
    except FloatingPointError as e:
        unchanged = all(torch.equal(a, g.flat) for a, g in zip(before, opt.groups))
        finite = all(torch.isfinite(g.flat).all() for g in opt.groups)
        return str(e), unchanged, finite
    return None, None, None


def test_bf16_nan_is_refused_on_every_rank_before_the_gather():
    for msg, unchanged, finite in run_distributed(nan_step, 2):
        assert msg is not None, "a NaN step must raise"
        assert "non-finite weights" in msg and "'0.weight'" in msg
        assert unchanged and finite, "nothing may have been gathered"


def nan_gather(rank, world):
    flat = torch.randn(64 * world).bfloat16()
    if rank == 1:
        flat[64 + 5] = float("inf")
    before = flat.clone()
    try:
        qzero.quantized_all_gather(flat)
    except ValueError as e:
        return str(e), torch.equal(flat, before)
    return None, None


def test_gather_refuses_non_finite_input_on_every_rank():
    msgs = run_distributed(nan_gather, 3)
    assert "non-finite" in msgs[1][0] and "index 69" in msgs[1][0]
    for msg, unchanged in msgs:
        assert msg is not None and unchanged


# ------------------------------------------------------------------ a rank dies


def _dying_worker(rank, world, store, results, where):
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=20)
        )
        torch.set_num_threads(1)
        if where == "gather":
            flat = torch.randn(64 * 20 * world).bfloat16()
            if rank == world - 1:
                real, calls = chunks.all_gather_into, [0]

                def die_on_third(*a, **k):
                    calls[0] += 1
                    if calls[0] == 3:
                        os._exit(17)  # dies mid-gather, without a word
                    return real(*a, **k)

                comm.all_gather_into = chunks.all_gather_into = die_on_third
            t0 = time.monotonic()
            try:
                qzero.quantized_all_gather(flat, allgather_bucket_size=64 * world)
            except comm.PeerFailure as e:
                results.put((rank, str(e), time.monotonic() - t0))
                return
        else:  # mid-step: the last rank dies inside backward's gradient reduction
            model = small_model()
            opt = qzero.ZeroOptimizer(model, ADAMW, config=qzero.ZeroConfig(reduce_bucket_size=256))
            x = torch.randn(4, 16).bfloat16()
            if rank == world - 1:
                model[2].weight.register_post_accumulate_grad_hook(lambda p: os._exit(17))
            t0 = time.monotonic()
            try:
                opt.backward((model(x).float() ** 2).mean())
                opt.step()
            except comm.PeerFailure as e:
                results.put((rank, str(e), time.monotonic() - t0))
                return
        results.put((rank, None, 0.0))
    except BaseException as e:  # noqa: BLE001
        results.put((rank, f"unexpected {type(e).__name__}: {e}", 0.0))


@pytest.mark.parametrize("where", ["gather", "step"])
def test_a_dead_rank_makes_the_others_fail_clearly(where):
    world = 3
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_dying_worker, args=(r, world, os.path.join(tmp, "store"), results, where), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        got = {}
        deadline = time.monotonic() + 90
        try:
            while len(got) < world - 1 and time.monotonic() < deadline:
                rank, msg, seconds = results.get(timeout=max(0.1, deadline - time.monotonic()))
                got[rank] = (msg, seconds)
        except queue.Empty:
            pass
        finally:
            for p in procs:
                p.join(timeout=2)
                if p.is_alive():
                    p.kill()
        assert procs[-1].exitcode == 17
    assert sorted(got) == list(range(world - 1)), f"survivors did not all report: {got}"
    for msg, seconds in got.values():
        assert msg is not None and msg.startswith("qzero:") and "peer rank died" in msg, msg
        assert seconds < 60


def _die():
    os._exit(17)  # without a word, as a killed or crashed rank does


def _outside_worker(rank, world, store, results, where, tmp):
    """A pair of ranks; the last dies at ``where``, outside the gathers and reductions."""
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=20)
        )
        torch.set_num_threads(1)
        dist.barrier()  # connected: a death is then seen at once (a first connection to a dead rank waits)
        dying = rank == world - 1
        t0 = time.monotonic()
        try:
            if where == "construction" and dying:
                _die()
            model = small_model()
            cfg = qzero.ZeroConfig(stage=1 if where == "before step" else 2)
            opt = qzero.ZeroOptimizer(model, ADAMW, config=cfg)
            x = torch.randn(4, 16).bfloat16()
            if where in ("save", "load"):
                path = os.path.join(tmp, "ckpt")
                if where == "load":
                    opt.save_checkpoint(path)
                if dying:
                    _die()
                t0 = time.monotonic()
                (opt.save_checkpoint if where == "save" else opt.load_checkpoint)(path)
            else:
                if where == "step's norm" and dying:  # the others are in the step's gradient-norm all-reduce
                    opt._global_norm = lambda *args: _die()
                for step in range(2):
                    if where == "before backward" and dying and step == 1:
                        _die()  # right after step() and zero_grad(): the others are in the next backward
                    t0 = time.monotonic()
                    opt.backward((model(x).float() ** 2).mean())
                    if where == "before step" and dying:
                        _die()  # stage 1: backward sends nothing, the others are in step()
                    opt.step()
                    opt.zero_grad()
        except comm.PeerFailure as e:
            results.put((where, rank, str(e), time.monotonic() - t0))
            return
        results.put((where, rank, None, 0.0))
    except BaseException as e:  # noqa: BLE001
        results.put((where, rank, f"unexpected {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", 0.0))


OUTSIDE = ["construction", "before backward", "before step", "step's norm", "save", "load"]


def test_a_rank_dying_outside_the_gathers_and_reductions_makes_the_others_fail_clearly(tmp_path):
    """A peer that dies while the others are in an exchange of their own (the agreement at
    construction, the model guard's before backward and before step, the step's gradient norm,
    a checkpoint's collectives) raises PeerFailure naming that exchange, as a death mid-gather or
    mid-reduce does, not the backend's raw error. One pair of ranks per place, all at once."""
    qzero.ZeroOptimizer(small_model(), ADAMW)  # imports what a construction needs once, before the forks
    world, ctx, results = 2, mp.get_context("fork"), mp.get_context("fork").Queue()
    procs = []
    for k, where in enumerate(OUTSIDE):
        os.makedirs(tmp_path / str(k))
        store = str(tmp_path / str(k) / "store")
        procs += [ctx.Process(target=_outside_worker, args=(r, world, store, results, where, str(tmp_path / str(k))),
                              daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got, deadline = {}, time.monotonic() + 90
    try:
        while len(got) < len(OUTSIDE) and time.monotonic() < deadline:
            where, rank, msg, seconds = results.get(timeout=max(0.1, deadline - time.monotonic()))
            got[where] = (rank, msg, seconds)
    except queue.Empty:
        pass
    finally:
        for p in procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs[1::2]] == [17] * len(OUTSIDE)
    assert sorted(got) == sorted(OUTSIDE), f"survivors did not all report: {got}"
    for where, (rank, msg, seconds) in got.items():
        assert rank == 0 and msg is not None and msg.startswith("qzero:") and "peer rank died" in msg, (where, msg)
        assert seconds < 60, where
    assert "model guard's exchange before optimizer step 2" in got["before backward"][1]
    assert "model guard's exchange before optimizer step 1" in got["before step"][1]
    assert any(w in got["construction"][1] for w in ("ZeroOptimizer", "topology exchange"))  # its first exchange
    assert "gradient norm" in got["step's norm"][1]
    assert "save_checkpoint" in got["save"][1] and "load_checkpoint" in got["load"][1]


# ------------------------------------------------------------------ checkpoints


def _saver(path, conn):
    """Train and save a checkpoint after every step, forever (until killed); one message on
    ``conn`` after each complete save. Runs in a process forked from the test's."""
    torch.set_num_threads(1)
    if dist.is_initialized():  # a process group left by another test: not the world-size-1 run meant here
        conn.send("a default process group is initialised in the test process")
        return
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)).bfloat16()
    opt = qzero.ZeroOptimizer(model, functools.partial(torch.optim.AdamW, lr=1e-3))
    step = 0
    while True:
        step += 1
        opt.backward((model(torch.randn(8, 64).bfloat16()).float() ** 2).mean())
        opt.step()
        opt.zero_grad()
        opt.save_checkpoint(path)
        conn.send(step)


def load_into_fresh(path):
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)).bfloat16()
    opt = qzero.ZeroOptimizer(model, ADAMW)
    opt.load_checkpoint(path)
    return opt


def test_a_save_killed_at_any_point_leaves_a_loadable_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    rng = random.Random(int(time.time()))
    ctx = mp.get_context("fork")  # a copy of this process: no interpreter and torch to start per attempt
    for attempt in range(5):
        ours, theirs = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_saver, args=(path, theirs), daemon=True)
        proc.start()
        try:
            assert ours.poll(120), "the saver finished no save within 120 s"
            assert ours.recv() == 1  # one complete save at least
            time.sleep(rng.random() * 0.3)
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(timeout=30)
        assert proc.exitcode == -signal.SIGKILL
        with pytest.warns(UserWarning) if not os.path.isdir(path) else _nothing():
            opt = load_into_fresh(path)
        assert opt.optimizer.state[opt.groups[0].master]["step"].item() >= 1


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_resume_after_load_is_bit_exact_at_world_size_1(tmp_path):
    def train(opt, model, steps, seed):
        out = []
        for s in range(steps):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed + s)).bfloat16()
            loss = (model(x).float() ** 2).mean()
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    cfg = qzero.ZeroConfig(zero_quantized_weights=True, small_param_numel=16)
    model = small_model()
    opt = qzero.ZeroOptimizer(model, ADAMW, config=cfg)
    train(opt, model, 3, 0)
    opt.save_checkpoint(str(tmp_path / "c"))
    first = train(opt, model, 3, 100)
    model2 = small_model(seed=5)
    opt2 = qzero.ZeroOptimizer(model2, ADAMW, config=cfg)
    opt2.load_checkpoint(str(tmp_path / "c"))
    assert train(opt2, model2, 3, 100) == first
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
