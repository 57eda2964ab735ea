"""The DeepSpeed adapter's quantized ZeRO-2 gradient reduction (``zero_quantized_gradients``
at stage 2) on CPU, gloo, bf16: the reduced gradient partitions against a reference built
from every rank's local gradients, both of DeepSpeed's reduction paths, gradient
accumulation, training, the refusals and the agreement.

The reference: DeepSpeed divides each rank's bf16 bucket by the world size, so the exact
mean is the fp32 sum in rank order of ``bf16(g_r / world)``. Small parameters travel exactly:
the owner's partition is that sum cast to bf16, bit for bit. The others are quantized (int8,
symmetric groups): each other rank adds at most half a scale, a scale being at most its
largest ``|g_r / world|`` in the flat group over 127, and the bf16 cast adds half an ulp.
"""

from __future__ import annotations

import os

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

from _support.distributed import run_distributed  # noqa: E402
from test_deepspeed import SMALL, Net, build, data, ds_config, expect_error, quantized, train  # noqa: E402

from qzero.integrations import deepspeed as qds  # noqa: E402
from qzero.integrations import deepspeed_grads  # noqa: E402
from qzero.integrations.deepspeed_config import prepare_config  # noqa: E402

BUCKET = 700  # reduce_bucket_size: several sub-buckets, and the two largest weights take DeepSpeed's oversized path
GRADS = dict(zero_quantized_gradients=True, zero_quantized_gradients_group_size=32, small_param_numel=SMALL,
             reduce_bucket_size=BUCKET)


def local_gradients(engine, x, y):
    """This rank's bf16 gradients of the engine's current weights on ``(x, y)``, by a plain
    torch copy of the model (by name)."""
    model = Net().to(torch.bfloat16)
    model.load_state_dict(engine.module.state_dict())
    torch.nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), y).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def partitions(opt):
    """This rank's reduced gradient partition of every flat group, as DeepSpeed holds it before step."""
    return [torch.cat([t.reshape(-1) for t in opt.averaged_gradients[i]]).float()
            for i in sorted(opt.averaged_gradients)]


def reference(engine, grads_by_rank, rank, world):
    """Per flat group: (exact fp32 mean, error bound, small-parameter mask) of this rank's partition."""
    opt = engine.optimizer
    names = {id(p): n for n, p in engine.module.named_parameters()}
    out = []
    for i, params in enumerate(opt.round_robin_bit16_groups):
        p = int(opt.partition_size[i])
        # bf16 div, as DeepSpeed
        pre = [{n: (g[n].reshape(-1) / float(world)).float() for n in g} for g in grads_by_rank]
        absmax = [max(float(d[names[id(q)]].abs().max()) for q in params) for d in pre]
        mean, bound, small = torch.zeros(p), torch.zeros(p), torch.zeros(p, dtype=torch.bool)
        for param, offset in zip(params, opt.round_robin_bit16_offsets[i]):
            n = param.numel()
            lo, hi = max(int(offset), rank * p), min(int(offset) + n, (rank + 1) * p)
            if lo >= hi:
                continue
            total = torch.zeros(n)
            for d in pre:  # rank order
                total += d[names[id(param)]]
            mean[lo - rank * p : hi - rank * p] = total[lo - int(offset) : hi - int(offset)]
            small[lo - rank * p : hi - rank * p] = n <= SMALL
        others = sum(a / 254 for r, a in enumerate(absmax) if r != rank)
        bound[:] = others
        out.append((mean, bound + mean.abs() * 2.0**-8 + 1e-12, small))
    return out


def check_against_reference(engine, rank, world):
    """One backward; the facts the tests assert on this rank's reduced partitions."""
    x, y = data(0, rank)
    local = local_gradients(engine, x, y)
    engine.backward(torch.nn.functional.mse_loss(engine(x.to(torch.bfloat16)).float(), y))
    names = list(local)
    flat = torch.cat([local[n].reshape(-1).float() for n in names])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    torch.distributed.all_gather(gathered, flat)
    by_rank, sizes = [], [local[n].numel() for n in names]
    for g in gathered:
        parts = torch.split(g, sizes)
        by_rank.append({n: part.to(torch.bfloat16) for n, part in zip(names, parts)})
    facts = []
    for got, (mean, bound, small) in zip(partitions(engine.optimizer), reference(engine, by_rank, rank, world)):
        facts.append(dict(
            small_exact=bool(torch.equal(got[small], mean[small].to(torch.bfloat16).float())),
            within_bound=bool(((got - mean).abs() <= bound)[~small].all()),
            worst=float(((got - mean).abs() / bound)[~small].max()) if (~small).any() else 0.0,
            large_quantized=not torch.equal(got[~small], mean[~small].to(torch.bfloat16).float()),
            has_small=bool(small.any()), has_large=bool((~small).any()),
        ))
    reduction = deepspeed_grads.installed(engine.optimizer)
    return dict(facts=facts, calls=dict(reduction.calls),
                in_place=[(k[3], r.in_place) for k, r in reduction._routes.items()])


PATHS = {"multi_rank": dict(use_multi_rank_bucket_allreduce=True, overlap_comm=False),
         "reduce_overlap": dict(use_multi_rank_bucket_allreduce=False, overlap_comm=True)}


def reference_worker(rank, world, paths):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    return {name: check_against_reference(build(qds.initialize, ds_config(**GRADS, **PATHS[name])), rank, world)
            for name in paths}


def accumulate(engine, rank):
    """Two micro-steps; the partitions DeepSpeed holds at the accumulation boundary, before its step."""
    for micro in range(2):
        x, y = data(micro, rank)
        engine.backward(torch.nn.functional.mse_loss(engine(x.to(torch.bfloat16)).float(), y))
        if micro == 0:
            assert not engine.is_gradient_accumulation_boundary()
            engine.step()  # not a boundary: DeepSpeed only counts the micro-step
    assert engine.is_gradient_accumulation_boundary()
    return partitions(engine.optimizer)


def world2_worker(rank, world):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    out = {"reduce": check_against_reference(
        build(qds.initialize, ds_config(**GRADS, use_multi_rank_bucket_allreduce=False, overlap_comm=False)),
        rank, world)}
    ga = {"gradient_accumulation_steps": 2, "train_batch_size": 16}
    out["ga_plain"] = accumulate(build(deepspeed.initialize, {**ds_config(reduce_bucket_size=BUCKET), **ga}), rank)
    engine = build(qds.initialize, {**ds_config(**GRADS), **ga})
    out["ga_q"] = accumulate(engine, rank)
    out["ga_calls"] = dict(deepspeed_grads.installed(engine.optimizer).calls)

    # training: quantized gradients and quantized weights, against plain DeepSpeed
    out["train_plain"] = train(build(deepspeed.initialize, ds_config(reduce_bucket_size=BUCKET)), rank)
    engine = build(qds.initialize, quantized(**{k: v for k, v in GRADS.items() if k != "small_param_numel"}))
    out["train_q"] = train(engine, rank)
    engine.qzero_gather.wait_for_weights()
    out["flats"] = [f.detach().clone() for f in engine.optimizer.bit16_groups_flat]
    reduction = deepspeed_grads.installed(engine.optimizer)
    out["train_calls"], out["bytes"] = dict(reduction.calls), (reduction.bytes_sent, reduction.plain_bytes)

    # off: the key absent or false, nothing installed on the instance
    out["off"] = []
    for config in (quantized(), ds_config(zero_quantized_gradients=False)):
        opt = build(qds.initialize, config).optimizer
        out["off"].append(not (set(deepspeed_grads.REPLACED) | {deepspeed_grads.ATTR}) & set(vars(opt)))

    # settings that differ between ranks: every rank raises before DeepSpeed builds anything
    mine = ds_config(**GRADS) if rank == 0 else ds_config(reduce_bucket_size=BUCKET)
    out["differs_on"] = expect_error(lambda: build(qds.initialize, mine), "zero_quantized_gradients differs")
    mine = ds_config(**{**GRADS, "zero_quantized_gradients_group_size": 32 * (rank + 1)})
    out["differs_group"] = expect_error(lambda: build(qds.initialize, mine),
                                        "zero_quantized_gradients_group_size differs")
    torch.distributed.barrier()
    return out


@pytest.fixture(scope="module")
def world3():
    return run_distributed(reference_worker, 3, tuple(PATHS), timeout=300)


@pytest.fixture(scope="module")
def world2():
    return run_distributed(world2_worker, 2, timeout=300)


def assert_matches_reference(run, multi_rank: bool):
    assert run["calls"]["quantized"] > 0 and run["calls"]["plain"] == 0
    # DeepSpeed's sub-buckets are views lying back to back: every call whose owners come in one
    # run each is reduced where it lies (a parameter across a partition edge interleaves them)
    assert any(here for _, here in run["in_place"]), run["in_place"]
    if multi_rank:
        for owners, here in run["in_place"]:
            runs = [o for k, o in enumerate(owners) if k == 0 or owners[k - 1] != o]
            assert here == (len(runs) == len(set(runs))), (owners, here)
    assert any(f["has_small"] for f in run["facts"]) and any(f["has_large"] for f in run["facts"])
    for f in run["facts"]:
        assert f["small_exact"], "small parameters must be the exact mean"
        assert f["within_bound"], f"quantization error {f['worst']:.2f}x its bound"
        if f["has_large"]:
            assert f["large_quantized"], "large parameters were reduced exactly: the quantized exchange did not run"


@pytest.mark.parametrize("path", list(PATHS))
def test_reduced_partition_matches_reference_at_world_3(world3, path):
    for r in world3:
        assert_matches_reference(r[path], PATHS[path]["use_multi_rank_bucket_allreduce"])


def test_reduced_partition_matches_reference_at_world_2_reduce_path(world2):
    for r in world2:
        assert_matches_reference(r["reduce"], False)


def test_gradient_accumulation_reduces_every_micro_step_into_the_partition(world2):
    for r in world2:
        assert r["ga_calls"]["quantized"] > 0 and r["ga_calls"]["plain"] == 0
        assert len(r["ga_q"]) == len(r["ga_plain"]) == 2
        for q, plain in zip(r["ga_q"], r["ga_plain"]):
            rel = float((q - plain).norm() / plain.norm())
            assert 0 < rel < 2e-2, f"relative L2 {rel:.2e} from plain DeepSpeed's accumulated gradients"


def test_training_keeps_replicas_identical_and_close_to_plain_deepspeed(world2):
    r0, r1 = world2
    for a, b in zip(r0["flats"], r1["flats"]):
        assert torch.equal(a, b), "replicas differ"
    for r in world2:
        assert r["train_calls"]["quantized"] > 0 and r["train_calls"]["plain"] == 0
        sent, plain = r["bytes"]
        assert 0 < sent < 0.75 * plain
        for a, b in zip(r["train_q"], r["train_plain"]):
            assert abs(a - b) < 0.02


def test_off_installs_nothing(world2):
    for r in world2:
        assert r["off"] == [True, True]


def test_gradient_settings_that_differ_between_ranks_raise_on_every_rank(world2):
    for r in world2:
        assert r["differs_on"] == "ok" and r["differs_group"] == "ok"


@pytest.mark.parametrize("zero, words", [
    (dict(stage=1), ["stage 1", "zero_quantized_gradients"]),
    (dict(reduce_scatter=False), ["reduce_scatter=False"]),
    (dict(contiguous_gradients=False), ["contiguous_gradients=False"]),
    (dict(zero_quantized_gradients_error_feedback=True), ["zero_quantized_gradients_error_feedback=true", "residuals"]),
    (dict(zero_quantized_gradients_intra_node="int8"), ["zero_quantized_gradients_intra_node='int8'", "node stage"]),
    (dict(zero_quantized_gradients_format="int4", zero_quantized_gradients_group_size=12),
     ["zero_quantized_gradients_group_size", "12"]),
    (dict(zero_quantized_gradients_format="int2"), ["zero_quantized_gradients_format", "int2"]),
])
def test_refusals_name_the_key_before_deepspeed_builds_anything(zero, words):
    config = ds_config(**{**GRADS, **zero})
    with pytest.raises(ValueError) as e:
        prepare_config(config)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_stage_2_takes_the_key_out_of_deepspeeds_copy():
    config = ds_config(zero_quantized_gradients=True, small_param_numel=SMALL, zero_quantized_gradients_format="int4")
    prepared = prepare_config(config)
    assert "zero_quantized_gradients" not in prepared.ds_config["zero_optimization"]
    assert config["zero_optimization"]["zero_quantized_gradients"] is True  # the user's dict untouched
    g = prepared.gradients
    assert (g.zero_quantized_gradients_format, g.zero_quantized_gradients_group_size) == ("int4", 256)
    assert g.zero_quantized_gradients_rotation_block > 0 and g.small_param_numel == SMALL
    assert prepare_config(ds_config(stage=3, zero_quantized_gradients=True)).gradients is None  # DeepSpeed's own
    assert prepare_config(ds_config()).gradients is None


def test_install_refuses_an_optimizer_it_does_not_know():
    with pytest.raises(ValueError, match="DeepSpeedZeroOptimizer"):
        deepspeed_grads.install(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1.0), None)


class StandIn:
    """What the reduction reads of DeepSpeed's ZeRO-2 optimizer: the two methods it replaces
    (bound as DeepSpeed's own fallback), the settings ``_reduce`` looks at, no IPG bucket (no
    exact ranges) and DeepSpeed's add into a gradient partition buffer."""

    overlap_comm, gradient_average, sequence_parallel_size = False, True, 1
    ipg_buckets: dict = {}

    @staticmethod
    def _add_to_grad_partition_buffer(output, source):  # as DeepSpeed's
        if output is not None:
            output.add_(source.to(output.dtype))

    def allreduce_and_copy_with_multiple_ranks(self, *a, **k):
        pass

    def allreduce_and_copy(self, *a, **k):
        pass


def _route_worker(rank, world):
    """Routes of calls that differ only in their exact ranges, or only in their owners."""
    settings = deepspeed_grads.GradientReductionSettings("int8", 32, 0, SMALL)
    red = deepspeed_grads.DeepSpeedGradientReduction(StandIn(), settings)
    like = torch.zeros(4, dtype=torch.bfloat16)
    numels = [96, 40, 64]
    plain = red._route(None, like, [1, 0, 1], numels, ((), (), ()))
    again = red._route(None, like, [1, 0, 1], numels, ((), (), ()))
    small = red._route(None, like, [1, 0, 1], numels, ((), ((0, 40),), ()))
    other = red._route(None, like, [0, 0, 1], numels, ((), (), ()))
    here = red._route(None, like, [1, 0, 0], numels, ((), ((0, 40),), ()), True)
    bucket = torch.zeros(300, dtype=torch.bfloat16)
    views = list(bucket[:200].split(numels))
    apart = [bucket[:96], bucket[100:140], bucket[140:204]]
    return dict(
        reused=again is plain,
        exact_differs=small is not plain and small.exchange is not plain.exchange,
        exact_ranges=(plain.exchange._exact, small.exchange._exact),
        order=plain.order, parts=plain.parts, owned=plain.owned, other_owned=other.owned,
        here=(here.in_place, here.order, here.parts, here.owned, here.exchange._exact),
        back_to_back=[deepspeed_grads._back_to_back(views, [1, 0, 0]),  # one run per owner
                      deepspeed_grads._back_to_back(views, [1, 0, 1]),  # owner 1 in two runs
                      deepspeed_grads._back_to_back(apart, [1, 0, 0]),  # a gap between slices
                      deepspeed_grads._back_to_back([v.clone() for v in views], [1, 0, 0]),  # separate tensors
                      deepspeed_grads._back_to_back([views[1], views[0], views[2]], [0, 1, 0])])  # out of order


def test_a_route_is_kept_per_distinct_call_and_staged_by_owner():
    """A call's route is reused only for a call with the same owners, sizes and exact ranges:
    the same slices with a small parameter in them travel with that range exact."""
    r = run_distributed(_route_worker, 1, timeout=120)[0]
    assert r["reused"] and r["exact_differs"]
    # staged by owner (stable): slice 1 (owner 0) first, then slices 0 and 2 (owner 1)
    assert r["order"] == (1, 0, 2) and r["parts"] == ((0, 0, 40, 0), (1, 40, 160, 40))
    assert r["owned"] == ((1, 0),) and r["other_owned"] == ((0, 0), (1, 96))
    assert r["exact_ranges"][0] == [] and r["exact_ranges"][1] == [(0, 40)]
    # slices that lie back to back by owner travel where they lie: no staging order, pieces at
    # their offsets in the bucket, exact ranges in bucket coordinates
    assert r["here"] == (True, (0, 1, 2), ((0, 96, 104, 96), (1, 0, 96, 0)), ((1, 96), (2, 136)), [(96, 136)])
    assert r["back_to_back"] == [True, False, False, False, False]


def _in_place_worker(rank, world):
    """The same slices reduced where they lie in one bucket and as separate tensors (staged)."""
    settings = deepspeed_grads.GradientReductionSettings("int8", 32, 0, SMALL)
    red = deepspeed_grads.DeepSpeedGradientReduction(StandIn(), settings)
    g = torch.Generator().manual_seed(11 + rank)
    sizes = [70, 180, 260, 100]
    before = (torch.randn(sum(sizes), generator=g) * 1e-2).to(torch.bfloat16)
    owners = [2, 2, 1, 0] if world == 3 else [1, 1, 0, 0]
    group = torch.distributed.group.WORLD
    views = list(before.clone().split(sizes))  # one bucket: in place
    copies = [v.clone() for v in before.split(sizes)]  # separate tensors: staged
    red._reduce(views, owners, None, True, group, None)
    red._reduce(copies, owners, None, True, group, None)
    # in place again, with DeepSpeed's gradient partition buffers: the per-slice path
    again = list(before.clone().split(sizes))
    partition = [torch.zeros(n) for n in sizes]
    red._reduce(again, owners, partition, True, group, None)
    mine = [i for i, o in enumerate(owners) if o == rank]
    original = before.split(sizes)
    return dict(
        routes=sorted(r.in_place for r in red._routes.values()),
        same=all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(views, copies, again)),
        changed=all(not torch.equal(views[i], original[i]) for i in mine),
        others_kept=all(torch.equal(views[i], original[i]) for i in range(len(sizes)) if i not in mine),
        partition=all(torch.equal(partition[i], copies[i].float()) if i in mine else not partition[i].any()
                      for i in range(len(sizes))))


@pytest.mark.parametrize("world", [2, 3])
def test_slices_back_to_back_are_reduced_in_place_bit_for_bit_as_staged(world):
    """DeepSpeed's sub-buckets are views lying back to back in its bucket: reduced where they
    lie (no staging copy, one cast into the owner's run) every rank's owned slices are the
    bits the staged route gives, the slices it does not own are left alone, and DeepSpeed's
    gradient partition buffer, where it has one, gets the same values added."""
    for r in run_distributed(_in_place_worker, world, timeout=120):
        assert r["routes"] == [False, True], "one staged and one in-place route (the third call reuses it)"
        assert r["same"] and r["changed"] and r["others_kept"] and r["partition"]
