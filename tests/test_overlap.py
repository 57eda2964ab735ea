"""Gather-ahead: bitwise the same parameters and losses as the synchronous gather."""

import functools
import random
import re
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from _support.distributed import run_distributed

import qzero
import qzero.wire.overlap as overlap
from qzero.layout import plan_gather


class Net(torch.nn.Module):
    """Every parameter is read through its own module, as in transformers models."""

    def __init__(self, reverse=False):
        super().__init__()
        self.emb = torch.nn.Embedding(41, 32)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(20))
        self.norm = torch.nn.LayerNorm(32)
        self.head = torch.nn.Linear(32, 41, bias=False)
        self.reverse = reverse

    def forward(self, tokens):
        x = self.emb(tokens)
        layers = list(self.layers)[::-1] if self.reverse else self.layers
        for layer in layers:
            x = x + torch.tanh(layer(x))
        return self.head(self.norm(x))


def install_delays(opt, seed):
    """Random sleeps around every gather launch and wait, to shake out missing waits (the
    optimizer's gathers run the collective of its context)."""
    rng = random.Random(seed)
    real = opt.context.all_gather

    class SlowWork:
        def __init__(self, work):
            self.work = work

        def wait(self):
            time.sleep(rng.random() * 0.004)
            return self.work.wait()

    def delayed(out, inp, group=None, async_op=False):
        time.sleep(rng.random() * 0.004)
        work = real(out, inp, group=group, async_op=async_op)
        return SlowWork(work) if async_op else work

    opt.context.all_gather = delayed


def run(rank, world, cfg_kwargs, steps, reverse=False, delays=False):
    torch.manual_seed(rank)
    model = Net(reverse).bfloat16()
    opt = qzero.ZeroOptimizer(model, functools.partial(torch.optim.AdamW, lr=1e-2),
                              config=qzero.ZeroConfig(**cfg_kwargs))
    if delays:
        install_delays(opt, 1000 + rank)
    losses, pending_seen = [], False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            tokens = torch.randint(0, 41, (world * 2, 9), generator=g)[rank * 2 : rank * 2 + 2]
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, 41), tokens[:, 1:].reshape(-1))
            opt.backward(loss)
            opt.step()
            if opt.ahead is not None and opt.ahead.busy:
                pending_seen = True
            # a collective of the user's while the gather runs ahead: it must not be
            # matched against a gather chunk of another rank (the ranks would hang)
            if world > 1:
                mean = loss.detach().reshape(1).clone()
                torch.distributed.all_reduce(mean)
            opt.zero_grad()
            losses.append(loss.item())
    opt.wait_for_weights()
    warned = [str(w.message) for w in caught if "gather-ahead" in str(w.message)]
    return losses, [g.flat.clone() for g in opt.groups], pending_seen, warned


# gather-ahead picks the interleaved flat order by default ("auto"); the synchronous arm is
# given the same layout so that the two can be compared bit for bit.
CASES = [
    dict(stage=2, zero_quantized_weights=True, small_param_numel=40, allgather_bucket_size=4 * 64 * 3,
         flat_order="interleaved"),
    dict(stage=1, zero_quantized_weights=True, small_param_numel=40, allgather_bucket_size=4 * 64 * 3,
         flat_order="interleaved"),
    dict(stage=2, zero_quantized_weights=False, allgather_bucket_size=4 * 64 * 3, flat_order="interleaved"),
    dict(stage=2, zero_quantized_weights=True, small_param_numel=40, allgather_bucket_size=4 * 64 * 3,
         flat_order="contiguous"),
]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_overlap_is_bitwise_the_synchronous_gather(world, case):
    cfg = CASES[case]
    sync = run_distributed(run, world, cfg, 4)
    ahead = run_distributed(run, world, {**cfg, "overlap_param_gather": True}, 4, False, True)
    for (l0, f0, _, _), (l1, f1, pending, warned) in zip(sync, ahead):
        assert l0 == l1, "losses differ with gather-ahead"
        for a, b in zip(f0, f1):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        assert pending, "the gather should still be running when step() returns"
        assert not warned
    for _, f, _, _ in ahead[1:]:
        assert all(torch.equal(a, b) for a, b in zip(f, ahead[0][1]))


def test_forward_out_of_flat_order_is_still_correct_and_warns_once():
    cfg = CASES[0]
    sync = run_distributed(run, 2, cfg, 3, True)
    ahead = run_distributed(run, 2, {**cfg, "overlap_param_gather": True}, 3, True, True)
    for (l0, f0, _, _), (l1, f1, _, warned) in zip(sync, ahead):
        assert l0 == l1
        assert all(torch.equal(a, b) for a, b in zip(f0, f1))
        assert len(warned) == 1


def checkpoint_during_gather(rank, world, path):
    torch.manual_seed(0)
    model = Net().bfloat16()
    cfg = qzero.ZeroConfig(**CASES[0], overlap_param_gather=True)
    opt = qzero.ZeroOptimizer(model, functools.partial(torch.optim.AdamW, lr=1e-2), config=cfg)
    tokens = torch.randint(0, 41, (2, 9), generator=torch.Generator().manual_seed(rank))
    opt.backward(F.cross_entropy(model(tokens[:, :-1]).float().reshape(-1, 41), tokens[:, 1:].reshape(-1)))
    opt.step()
    busy = opt.ahead.busy
    opt.save_checkpoint(path)  # must wait for the gather first
    return busy, opt.ahead.busy, [g.flat.clone() for g in opt.groups]


def test_checkpoint_waits_for_the_gather(tmp_path):
    res = run_distributed(checkpoint_during_gather, 2, str(tmp_path / "ck"))
    for busy_before, busy_after, _ in res:
        assert busy_before and not busy_after
    assert all(torch.equal(a, b) for a, b in zip(res[0][2], res[1][2]))


def test_last_chunk_needed():
    plan = plan_gather(4 * 1000, 4, zero_quantized_weights_group_size=8,
                       allgather_bucket_size=4 * 160)  # partitions of 1000, chunks of 160
    assert plan.chunk_numel == 160 and len(plan.chunks) == 7
    assert overlap.last_chunk_needed(plan, 0, 10) == 0
    assert overlap.last_chunk_needed(plan, 150, 170) == 1
    assert overlap.last_chunk_needed(plan, 990, 1010) == 6  # straddles partitions 0 and 1
    assert overlap.last_chunk_needed(plan, 1000, 1100) == 0
    assert overlap.last_chunk_needed(plan, 5, 5) == -1


def test_overlap_needs_room_for_two_chunks():
    with pytest.raises(ValueError, match="each of the 2 chunks"):
        cfg = qzero.ZeroConfig(overlap_param_gather=True, allgather_bucket_size=64)
        qzero.ZeroOptimizer(Net().bfloat16(), torch.optim.AdamW, config=cfg)


def test_streams_are_refused_off_cuda_before_anything_changes():
    model = Net().bfloat16()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="'streams' needs CUDA"):
        qzero.ZeroOptimizer(model, torch.optim.AdamW, config=qzero.ZeroConfig(gather_schedule="streams"))
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    with pytest.raises(ValueError, match="gather_schedule must be one of"):
        qzero.ZeroConfig(gather_schedule="fast")
    with pytest.raises(ValueError, match="quant_kernels must be one of"):
        qzero.ZeroConfig(quant_kernels="cuda")


def test_settings_of_the_engine_keep_the_bits():
    """The reference kernels and a whole (unsliced) update give the bits of the defaults,
    synchronously and ahead (the side-stream schedule: tests/gpu/workers/gpu_check.py on CUDA)."""
    cfg = CASES[0]
    base = run_distributed(run, 2, cfg, 3)
    for extra in ({"quant_kernels": "reference", "sliced_update": False},
                  {"overlap_param_gather": True, "gather_schedule": "inline", "sliced_update": False}):
        other = run_distributed(run, 2, {**cfg, **extra}, 3)
        for (l0, f0, _, _), (l1, f1, _, _) in zip(base, other):
            assert l0 == l1
            assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(f0, f1))


def test_close_finishes_the_gather_and_removes_the_hooks():
    torch.manual_seed(0)
    model = Net().bfloat16()
    opt = qzero.ZeroOptimizer(model, torch.optim.AdamW, config=qzero.ZeroConfig(**CASES[0], overlap_param_gather=True))
    tokens = torch.randint(0, 41, (2, 9))
    opt.backward(F.cross_entropy(model(tokens[:, :-1]).float().reshape(-1, 41), tokens[:, 1:].reshape(-1)))
    opt.step()
    assert not model.emb._forward_pre_hooks == {}
    opt.close()
    assert not opt.ahead.busy
    assert all(not m._forward_pre_hooks for m in model.modules())
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters()
               if p._post_accumulate_grad_hooks is not None)


class AttnNet(torch.nn.Module):
    """``nn.MultiheadAttention`` reads its ``out_proj`` Linear's weight inside its own forward,
    without calling ``out_proj``: no hook of ``out_proj`` ever runs."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(41, 32)
        self.attn = torch.nn.ModuleList(torch.nn.MultiheadAttention(32, 4, batch_first=True) for _ in range(3))
        self.head = torch.nn.Linear(32, 41, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens)
        for a in self.attn:
            x = x + a(x, x, x, need_weights=False)[0]
        return self.head(x)


def attn_run(rank, world, cfg_kwargs, steps):
    torch.manual_seed(0)
    model = AttnNet().bfloat16()
    opt = qzero.ZeroOptimizer(model, functools.partial(torch.optim.AdamW, lr=1e-2),
                              config=qzero.ZeroConfig(**cfg_kwargs))
    losses = []
    for step in range(steps):
        tokens = torch.randint(0, 41, (world * 2, 9),
                               generator=torch.Generator().manual_seed(step))[rank * 2 : rank * 2 + 2]
        loss = F.cross_entropy(model(tokens[:, :-1]).float().reshape(-1, 41), tokens[:, 1:].reshape(-1))
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    opt.wait_for_weights()
    return losses, [g.flat.clone() for g in opt.groups]


def test_parameters_read_inside_another_modules_forward_are_waited_for():
    """The first forward (before any gather runs ahead) shows which modules' forwards run;
    parameters of modules whose forward never runs are waited for by the closest enclosing
    module that runs (here each MultiheadAttention waits for its out_proj)."""
    for order in ("interleaved", "contiguous"):
        cfg = dict(stage=2, zero_quantized_weights=True, small_param_numel=40, allgather_bucket_size=2 * 64 * 4,
                   flat_order=order)
        sync = run_distributed(attn_run, 2, {**cfg, "overlap_param_gather": False}, 4)
        ahead = run_distributed(attn_run, 2, {**cfg, "overlap_param_gather": True}, 4)
        for (l0, f0), (l1, f1) in zip(sync, ahead):
            assert l0 == l1, f"{order}: a stale out_proj weight was read under gather-ahead"
            assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(f0, f1))


def two_forwards_per_step(rank, world):
    """An evaluation forward between step() and the next training forward (no backward
    between them): each forward starts again at the first module, in order."""
    torch.manual_seed(0)
    model = Net().bfloat16()
    cfg = qzero.ZeroConfig(**CASES[0], overlap_param_gather=True)
    opt = qzero.ZeroOptimizer(model, functools.partial(torch.optim.AdamW, lr=1e-2), config=cfg)
    tokens = torch.randint(0, 41, (2, 9), generator=torch.Generator().manual_seed(rank))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with torch.no_grad():
                model(tokens[:, :-1])  # evaluation: overlaps the gather
            opt.backward(F.cross_entropy(model(tokens[:, :-1]).float().reshape(-1, 41), tokens[:, 1:].reshape(-1)))
            opt.step()
            opt.zero_grad()
    opt.wait_for_weights()
    return [str(w.message) for w in caught if "gather-ahead" in str(w.message)]


def test_a_second_forward_after_a_step_is_not_taken_for_an_out_of_order_one():
    for warned in run_distributed(two_forwards_per_step, 2):
        assert warned == []


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4", None])
def test_gather_lookahead_must_be_a_count(bad):
    with pytest.raises(ValueError, match=rf"gather_lookahead must be an int >= 0 .*got {re.escape(repr(bad))}"):
        qzero.ZeroConfig(gather_lookahead=bad)
    with pytest.raises(ValueError, match="gather lookahead must be an int >= 0"):
        from qzero.wire.engine import CommContext

        CommContext("cpu", lookahead=bad)


def lookahead_on_one_rank(rank, world):
    model = Net().bfloat16()
    before = [p.detach().clone() for p in model.parameters()]
    cfg = qzero.ZeroConfig(**CASES[0], overlap_param_gather=True, gather_lookahead=4 if rank == world - 1 else 0)
    try:
        qzero.ZeroOptimizer(model, torch.optim.AdamW, config=cfg)
    except ValueError as e:
        return str(e), all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return None, True


def test_a_gather_lookahead_that_differs_across_ranks_is_refused_on_every_rank():
    """Ranks that enqueue their chunks at different points would order a collective the user
    issues during the forward differently (and hang): refused at construction, on every rank."""
    for message, unchanged in run_distributed(lookahead_on_one_rank, 3):
        assert message is not None and (
            "config differs between ranks: gather_lookahead: 0 (ranks 0, 1), 4 (rank 2)" in message), message
        assert unchanged
