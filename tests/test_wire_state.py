"""The wire's state is where it can be seen: plans are pure values and what running them
derives is kept by the context that runs them; the collective and the stage delays are the
context's arguments; gather-ahead moves between named states and refuses the moves its state
does not allow ([Note: gather-ahead states])."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qzero.layout import GatherPlan, plan_gather


def _plan(numel=2 * 64 * 8, world=1):
    return plan_gather(numel, world, zero_quantized_weights_format="int8", zero_quantized_weights_group_size=16,
                       allgather_bucket_size=64 * 4,
                       exact_ranges=((0, 40), (300, 330)))


def _tensors_in(obj, seen=None) -> int:
    """How many tensors ``obj`` reaches through its attributes, dicts, tuples and lists."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return 1
    if isinstance(obj, dict):
        return sum(_tensors_in(k, seen) + _tensors_in(v, seen) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return sum(_tensors_in(v, seen) for v in obj)
    if dataclasses.is_dataclass(obj) or hasattr(obj, "__dict__"):
        return sum(_tensors_in(v, seen) for v in vars(obj).values()) if hasattr(obj, "__dict__") else 0
    return 0


def test_a_plan_holds_no_tensors_after_it_ran_and_its_runner_keeps_what_it_derived():
    from qzero.wire.engine import CommContext, finish_gather, start_gather

    plan = _plan()
    assert "_cache" not in {f.name for f in dataclasses.fields(GatherPlan)}
    first, second = CommContext("cpu"), CommContext("cpu")
    flat = torch.randn(plan.numel).bfloat16()
    handle = start_gather(flat, plan, None, first, ahead=True)  # two buffers: the plan cut to fit
    stats = finish_gather(handle)
    assert stats.num_chunks == len(handle.plan.chunks) > len(plan.chunks) > 1
    assert handle.plan is start_gather(flat, plan, None, first, ahead=True).plan  # the cut plan is kept
    for p in (plan, handle.plan):
        assert _tensors_in(p) == 0, "a plan keeps device tensors after a gather"
    assert len(first.cache) >= 1 and len(second.cache) == 0
    chunk = plan.chunks[0]
    kept = first.cache.exact_index(plan, chunk, 0, flat.device)
    assert kept is first.cache.exact_index(plan, chunk, 0, flat.device)  # made once per runner
    assert second.cache.exact_index(plan, chunk, 0, flat.device) is not kept
    assert torch.equal(kept, second.cache.exact_index(plan, chunk, 0, flat.device))


def test_a_synchronous_gather_derives_its_index_tensors_once_per_context(monkeypatch):
    """The inline gather of one chunk at a time (FSDP2's group gather, the synchronous gather)
    fills nothing in the context before its first pack: an empty cache must still be the one
    kept, not replaced by a throwaway one on every call (which rebuilt and copied the index
    tensors to the device, synchronizing the host, on every gather)."""
    from qzero.wire import chunks
    from qzero.wire.engine import CommContext, finish_gather, start_gather

    made = []
    real = chunks.exact_index
    monkeypatch.setattr(chunks, "exact_index", lambda *a: made.append(a) or real(*a))
    plan, context = _plan(), CommContext("cpu")
    flat = torch.randn(plan.numel).bfloat16()
    assert len(context.cache) == 0
    finish_gather(start_gather(flat, plan, None, context))
    first = len(made)
    assert first >= 1 and len(context.cache) >= 1
    for _ in range(3):
        finish_gather(start_gather(flat, plan, None, context))
    assert len(made) == first, "the synchronous gather rebuilt its index tensors"


def test_the_public_gathers_leave_no_device_tensors_in_their_plan_cache():
    import qzero
    from qzero.wire import comm

    comm._cached_plan.cache_clear()
    flat = torch.randn(2 * 64 * 8).bfloat16()
    qzero.quantized_all_gather(flat, zero_quantized_weights_group_size=16, exact_ranges=[(0, 40)],
                               allgather_bucket_size=64 * 4)
    assert comm._cached_plan.cache_info().currsize == 1
    plan = comm._cached_plan(flat.numel(), 1, 2, 64 * 4, "int8", 16, ((0, 40),))
    assert _tensors_in(plan) == 0


def _counting_worker(rank, world):
    from qzero.wire.chunks import all_gather_into
    from qzero.wire.engine import CommContext, finish_gather, start_gather

    calls = []

    def counting(out, inp, group=None, async_op=False):
        calls.append(out.numel())
        return all_gather_into(out, inp, group=group, async_op=async_op)

    plan = _plan(world=world)
    flat = torch.randn(plan.numel, generator=torch.Generator().manual_seed(rank)).bfloat16()
    want = flat.clone()
    finish_gather(start_gather(want, plan, None, CommContext("cpu")))
    finish_gather(start_gather(flat, plan, None, CommContext("cpu", all_gather=counting)))
    return len(calls), len(plan.chunks), torch.equal(want.view(torch.int16), flat.view(torch.int16))


def test_the_collective_is_the_contexts_argument():
    from _support.distributed import run_distributed
    from qzero.wire.chunks import all_gather_into
    from qzero.wire.engine import CommContext

    assert CommContext("cpu").all_gather is all_gather_into
    for calls, chunks, same in run_distributed(_counting_worker, 2):
        assert calls == chunks > 1 and same  # every chunk's collective, the same bits


def test_delays_are_checked_arguments():
    from qzero.wire.engine import CommContext

    assert CommContext("cpu").delays == {"pack": 0, "gather": 0, "unpack": 0}
    with pytest.raises(ValueError, match="per stage"):
        CommContext("cpu", delays={"pakc": 1})
    with pytest.raises(ValueError, match="need CUDA"):
        CommContext("cpu", delays={"pack": 1000})


def _ahead():
    from qzero.wire.overlap import GatherAhead

    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    plan = plan_gather(64 * 16, 1, zero_quantized_weights_format="int8", zero_quantized_weights_group_size=16,
                       allgather_bucket_size=64 * 2)
    params = list(model.parameters())
    ranges = [(p, 0, i * plan.numel // len(params), (i + 1) * plan.numel // len(params))
              for i, p in enumerate(params)]
    return model, plan, GatherAhead.from_ranges(model, ranges, 1)


def test_gather_ahead_moves_through_its_states():
    from qzero.wire.engine import CommContext, start_gather
    from qzero.wire.overlap import AheadState

    model, plan, ahead = _ahead()
    ctx = CommContext("cpu")
    flat = torch.zeros(plan.numel, dtype=torch.bfloat16)
    assert ahead.state is AheadState.LEARNING and not ahead.busy
    model(torch.zeros(1, 8))  # a forward before the first gather: learning which modules run
    ahead.start(0, start_gather(flat, plan, None, ctx, ahead=True))
    assert ahead.state is AheadState.GATHERING and ahead.busy
    model(torch.zeros(1, 8))  # the forward waits for every chunk it reads
    assert ahead.state is AheadState.GATHERED and not ahead.busy and ahead.pending == [None]
    ahead.wait_all()
    assert ahead.state is AheadState.IDLE
    ahead.start(0, start_gather(flat, plan, None, ctx, ahead=True))
    ahead.wait_all()
    assert ahead.state is AheadState.IDLE and ahead.pending == [None]
    ahead.remove()
    assert ahead.state is AheadState.REMOVED


def test_gather_ahead_refuses_illegal_moves():
    from qzero.wire.engine import CommContext, start_gather
    from qzero.wire.overlap import AheadState, IllegalTransition

    model, plan, ahead = _ahead()
    ctx = CommContext("cpu")
    flat = torch.zeros(plan.numel, dtype=torch.bfloat16)
    running = start_gather(flat, plan, None, ctx, ahead=True)
    ahead.start(0, running)
    with pytest.raises(IllegalTransition, match="flat group 0's previous gather is still running"):
        ahead.start(0, start_gather(flat.clone(), plan, None, CommContext("cpu"), ahead=True))
    assert ahead.pending == [running] and ahead.state is AheadState.GATHERING  # nothing changed
    ahead.remove()
    with pytest.raises(IllegalTransition, match="cannot start a gather while removed"):
        ahead.start(0, start_gather(flat, plan, None, ctx, ahead=True))
    assert ahead.state is AheadState.REMOVED


def test_gather_handle_is_abstract():
    from qzero.wire.engine import GatherHandle

    class Incomplete(GatherHandle):
        pass

    with pytest.raises(TypeError, match="abstract"):
        Incomplete()
