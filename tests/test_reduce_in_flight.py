"""ZeroConfig.reduce_buckets_in_flight: how many bucket reductions are pending at once.

The bound changes when the compute stream waits, never the bits: training with 1, 2 and 5
in flight gives the same weights, plain and INT8-quantized, stage 1 and 2, both flat orders
(both reducers), at world sizes 2 and 3; no reduction is launched with more than the bound
pending (counted by wrapping the reducer's launch and finish); with copy-engine collectives the
quantized exchange never reuses the payload buffers of a pending exchange.
"""

import functools
import re

import pytest
import torch
from _support.distributed import run_distributed

import qzero
from test_optim import ADAMW, batch, make_model, rank_slice

IN_FLIGHT = (1, 2, 5)
#: stage x flat order (interleaved with solo_reduce: the solo launches count too) x quantized
CASES = [
    dict(stage=stage, flat_order=order, solo_reduce=order == "interleaved", zero_quantized_gradients=quant)
    for stage in (1, 2) for order in ("contiguous", "interleaved") for quant in (False, True)
]
STEPS = 2


def _count_pending(reducer, record: list) -> None:
    """Wrap the reducer's launches and finishes (bucket and solo) on the instance: ``record``
    gets the number of reductions pending as each launch starts."""
    pending = [0]

    def launching(launch):
        def wrapped(*a, **kw):
            record.append(pending[0])
            pending[0] += 1
            return launch(*a, **kw)
        return wrapped

    def finishing(finish):
        def wrapped(*a, **kw):
            pending[0] -= 1
            return finish(*a, **kw)
        return wrapped

    for name in ("launch", "launch_solo"):
        if hasattr(reducer, name):
            setattr(reducer, name, launching(getattr(reducer, name)))
    for name in ("finish", "finish_solo"):
        if hasattr(reducer, name):
            setattr(reducer, name, finishing(getattr(reducer, name)))


def _steps(opt, model, rank, world) -> None:
    """STEPS training steps on this rank's share of the batches, then the last gather's end."""
    for step in range(STEPS):
        tokens, targets = batch(step, 0)
        opt.backward(model(rank_slice(tokens, rank, world), rank_slice(targets, rank, world)))
        opt.step()
        opt.zero_grad()
    opt.wait_for_weights()


def _train(rank, world, case, in_flight):
    model = make_model(seed=rank)  # replicas start different: rank 0's weights win
    cfg = qzero.ZeroConfig(**case, reduce_buckets_in_flight=in_flight, reduce_bucket_size=150,
                           small_param_numel=40, allgather_bucket_size=world * 64 * 3)
    opt = qzero.ZeroOptimizer(model, ADAMW, config=cfg)
    counts: list[int] = []
    for g in opt.grads:
        _count_pending(g.reducer, counts)
    _steps(opt, model, rank, world)
    flats = torch.cat([g.flat.view(torch.int16) for g in opt.groups]).clone()
    masters = torch.cat([g.master for g in opt.groups]).clone()
    return flats, masters, counts


def _all_cases(rank, world):
    return {(i, n): _train(rank, world, case, n) for i, case in enumerate(CASES) for n in IN_FLIGHT}


@functools.lru_cache(maxsize=None)
def _runs(world):
    return run_distributed(_all_cases, world, timeout=400.0)


@pytest.mark.parametrize("world", [2, 3])
def test_any_bound_trains_the_same_bits(world):
    results = _runs(world)
    for i, case in enumerate(CASES):
        for rank, res in enumerate(results):
            flats, masters, _ = res[(i, 2)]
            assert torch.equal(flats, results[0][(i, 2)][0]), f"{case}: replicas differ"
            for n in IN_FLIGHT:
                f, m, _ = res[(i, n)]
                assert torch.equal(f, flats), f"{case}, rank {rank}: weights differ with {n} in flight"
                assert torch.equal(m, masters), f"{case}, rank {rank}: masters differ with {n} in flight"


@pytest.mark.parametrize("world", [2, 3])
def test_never_more_than_the_bound_pending(world):
    """As each reduction is launched, at most the bound are pending (the launch then finishes
    the oldest if it made one more); the bound is reached (many more buckets than 5)."""
    for res in _runs(world):
        for i, case in enumerate(CASES):
            for n in IN_FLIGHT:
                counts = res[(i, n)][2]
                assert len(counts) > 2 * max(IN_FLIGHT) * STEPS, (case, len(counts))  # many buckets
                assert max(counts) == n, f"{case}: {max(counts)} pending with reduce_buckets_in_flight={n}"


def _ring_worker(rank, world, in_flight):
    """Quantized exchanges with copy-engine collectives (a gloo stand-in provider): every launch's
    payload slabs, by the provider's keys, are none of a pending launch's."""
    import qzero.optim.zero as zero_mod
    from test_copy_engine import _GlooProvider

    zero_mod.check_copy_engine_support = lambda device, group: None  # CPU stands in for CUDA here
    zero_mod.CopyEngineComm = _GlooProvider
    model = make_model(seed=0)
    cfg = qzero.ZeroConfig(zero_quantized_gradients=True, copy_engine_collectives=True, flat_order="interleaved",
                           reduce_buckets_in_flight=in_flight, reduce_bucket_size=150, small_param_numel=40)
    opt = qzero.ZeroOptimizer(model, ADAMW, config=cfg)
    provider = opt.context.copy_engine
    keys_asked: list = []
    real_buffers = provider.buffers
    provider.buffers = lambda key, *a: keys_asked.append(key) or real_buffers(key, *a)
    reducer = opt.grads[0].reducer
    pending: list = []  # the slab keys of each pending launch, oldest first
    clashes, used = [], set()
    launch, finish = reducer.launch, reducer.finish

    def launching(buf, bucket):
        before = len(keys_asked)
        out = launch(buf, bucket)
        mine = set(keys_asked[before:])
        clashes.extend(k for p in pending for k in p if k in mine)
        pending.append(mine)
        used.update(mine)
        return out

    def finishing(*a):
        pending.pop(0)  # the reducers finish in launch order
        return finish(*a)

    reducer.launch, reducer.finish = launching, finishing
    _steps(opt, model, rank, world)
    return [repr(k) for k in clashes], len(used)  # the keys hold the exchange: not picklable


@pytest.mark.parametrize("in_flight", [1, 5])
def test_payload_ring_outlasts_the_exchanges_in_flight(in_flight):
    """Launch n reuses launch n - (in_flight + 1)'s payload buffers: never a pending one's, and
    no more than in_flight + 1 send/receive pairs exist."""
    for clashes, used in run_distributed(_ring_worker, 2, in_flight, timeout=240.0):
        assert clashes == [], f"payload buffers of a pending exchange reused: {clashes[:3]}"
        assert used == 2 * (in_flight + 1), used


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "2", None])
def test_bad_values_are_refused_by_name(bad):
    want = rf"reduce_buckets_in_flight must be a positive int .*got {re.escape(repr(bad))}"
    with pytest.raises(ValueError, match=want):
        qzero.ZeroConfig(reduce_buckets_in_flight=bad)
    with pytest.raises(ValueError, match=want):
        qzero.ZeroConfig.from_dict({"stage": 2, "reduce_buckets_in_flight": bad})
    assert qzero.ZeroConfig.from_dict({"reduce_buckets_in_flight": 5}).reduce_buckets_in_flight == 5


def _differs_on_one_rank(rank, world):
    model = make_model(seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    cfg = qzero.ZeroConfig(reduce_buckets_in_flight=5 if rank == world - 1 else 2)
    try:
        qzero.ZeroOptimizer(model, ADAMW, config=cfg)
    except ValueError as e:
        return str(e), all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return None, True


def test_a_bound_that_differs_across_ranks_is_refused_on_every_rank():
    """The whole config is agreed across ranks at construction (this bound changes only timing
    and memory, but one agreement covers every field): a rank with another bound is reported by
    the field's name, on every rank, the model untouched."""
    for message, unchanged in run_distributed(_differs_on_one_rank, 3):
        assert message is not None and ("config differs between ranks: reduce_buckets_in_flight: 2 (ranks 0, 1), "
                                        "5 (rank 2)") in message, message
        assert unchanged


@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
def test_the_other_backends_refuse_it(backend):
    """The FSDP2 and DeepSpeed backends reduce gradients their own way: the setting would change nothing."""
    from qzero.app.train import settings_from, validate
    from qzero.app.workload import WorkloadError

    validate(settings_from({"backend": backend, "reduce_buckets_in_flight": 2}))  # the default: nothing asked
    with pytest.raises(WorkloadError, match=f"reduce_buckets_in_flight is a setting of the qzero backend.*{backend}"):
        validate(settings_from({"backend": backend, "reduce_buckets_in_flight": 4}))
