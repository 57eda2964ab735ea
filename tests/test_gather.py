"""The gathers on real gloo process groups: world sizes 1-4, many chunks, exact ranges, bad input."""

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _support.distributed import WorkerError, run_distributed
from _support.simulate import side_mask

import qzero
from qzero.quant.reference import FLT_MIN

# ------------------------------------------------------------------ inputs and the independent model


def make_truth(world, numel, dtype, seed):
    """The buffer as the owners hold it: mixed magnitudes, all-zero groups, huge and tiny values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g)
    scale = torch.logspace(-6, 3, numel)[torch.randperm(numel, generator=g)]
    x = x * scale
    x[64:128] = 0  # an all-zero group in partition 0
    big, tiny = (6e4, 1e-4) if dtype == torch.float16 else (1e30, 1e-30)
    x[numel // 2 : numel // 2 + 8] = big * torch.rand(8, generator=g)
    x[numel - 70 : numel - 60] = tiny
    return x.to(dtype)


def expected_result(truth, world, group_size, exact_ranges, fmt="int8"):
    """Per partition, group by group, in numpy float32; exact elements masked, then restored,
    and the groups that are cheaper sent verbatim than coded restored whole."""
    assert fmt == "int8"
    v = truth.float().numpy().astype(np.float32)
    exact = side_mask(v.size, world, group_size, exact_ranges, fmt, truth.element_size())
    p = v.size // world
    masked = np.where(exact, np.float32(0), v)
    out = np.empty(v.size, np.float32)
    for r in range(world):
        for g0 in range(r * p, (r + 1) * p, group_size):
            g1 = min(g0 + group_size, (r + 1) * p)
            grp = masked[g0:g1]
            scale = np.float32(max(np.float32(np.abs(grp).max()) / np.float32(127), np.float32(FLT_MIN)))
            q = np.clip(np.rint(grp * (np.float32(1) / scale)), -127, 127).astype(np.int8)
            out[g0:g1] = q.astype(np.float32) * scale
    result = torch.from_numpy(out).to(truth.dtype)
    mask = torch.from_numpy(exact)
    result[mask] = truth[mask]
    return result


def poisoned_copy(truth, rank, world):
    """Only the rank's own partition is real; the rest is NaN, which the gather must overwrite."""
    flat = torch.full_like(truth, float("nan"))
    p = truth.numel() // world
    flat[rank * p : (rank + 1) * p] = truth[rank * p : (rank + 1) * p]
    return flat


def merge(ranges):
    out = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(b, out[-1][1]))
        else:
            out.append((a, b))
    return out


# cases: (numel per rank, dtype, group size, bucket per rank in groups, exact ranges builder)
def cases(world):
    out = []
    for dtype in (torch.bfloat16, torch.float16):
        p = 64 * 10 + 24  # partition is not a whole number of groups: short last group
        numel = p * world
        # exact ranges at chunk and partition edges, one straddling a partition boundary
        exact = [(0, 3), (128 - 2, 128 + 5), (p - 4, min(p + 6, numel))]
        if world > 1:
            exact.append((2 * p - 1, 2 * p))  # the last element of partition 1
        exact.append((numel - 9, numel))
        exact = merge(exact)
        out.append((numel, dtype, 64, 2, exact))  # 128-element chunks: 6 chunks per partition
        out.append((numel, dtype, 64, 1000, []))  # one chunk
        out.append((numel, dtype, 8, 3, exact))  # tiny groups, 24-element chunks
    return out


def quantized_worker(rank, world, seed):
    results = []
    for numel, dtype, gs, bucket_groups, exact in cases(world):
        truth = make_truth(world, numel, dtype, seed)
        flat = poisoned_copy(truth, rank, world)
        stats = qzero.quantized_all_gather(
            flat, zero_quantized_weights_group_size=gs, exact_ranges=exact,
            allgather_bucket_size=world * gs * bucket_groups
        )
        results.append((flat, stats))
    return results


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_quantized_gather_matches_model_and_replicas_agree(world):
    seed = int(torch.randint(0, 2**31, ()).item())  # fresh inputs every run
    by_rank = run_distributed(quantized_worker, world, seed)
    for i, (numel, dtype, gs, bucket_groups, exact) in enumerate(cases(world)):
        flats = [by_rank[r][i][0] for r in range(world)]
        for r in range(1, world):
            assert torch.equal(flats[r].view(torch.int16), flats[0].view(torch.int16)), f"replica {r} differs"
        truth = make_truth(world, numel, dtype, seed)
        want = expected_result(truth, world, gs, exact)
        got = flats[0]
        assert not torch.isnan(got).any()
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"case {i} (seed {seed})"
        for a, b in exact:
            assert torch.equal(got[a:b].view(torch.int16), truth[a:b].view(torch.int16))
        stats = by_rank[0][i][1]
        p = numel // world
        assert stats.plain_bytes == p * truth.element_size()
        assert stats.max_recv_numel <= world * gs * bucket_groups
        assert stats.num_chunks == -(-p // min(gs * bucket_groups, -(-p // gs) * gs))


def plain_worker(rank, world, seed):
    results = []
    for dtype, bucket in ((torch.bfloat16, world * 7), (torch.float16, 10**9), (torch.float32, world * 100)):
        truth = make_truth(world, 333 * world, dtype, seed)
        flat = poisoned_copy(truth, rank, world)
        stats = qzero.all_gather(flat, allgather_bucket_size=bucket)
        results.append((truth, flat, stats))
    return results


@pytest.mark.parametrize("world", [1, 3])
def test_plain_gather_is_exact(world):
    by_rank = run_distributed(plain_worker, world, 11)
    for r in range(world):
        for truth, flat, stats in by_rank[r]:
            assert torch.equal(flat, truth)
            assert stats.bytes_sent == stats.plain_bytes == 333 * truth.element_size()
            # one in-place collective whatever the bucket: no receive buffer at all
            assert stats.num_chunks == 1 and stats.max_recv_bytes == 0


def engine_worker(rank, world, seed):
    """The engine's two uses of one plan: synchronous, and chunk by chunk as gather-ahead does."""
    from qzero.wire.engine import CommContext, recv_budget_bytes, start_gather
    from qzero.layout import plan_gather

    numel, gs = 64 * 30 * world, 16
    exact = ((0, 40), (500, 530), (numel - 20, numel))
    truth = make_truth(world, numel, torch.bfloat16, seed)
    context = CommContext("cpu")
    out = {}
    for fmt in ("int8", None):
        plan = plan_gather(numel, world, allgather_bucket_size=world * 64 * 5, zero_quantized_weights_format=fmt,
                           zero_quantized_weights_group_size=gs,
                           exact_ranges=exact if fmt else ())
        whole = poisoned_copy(truth, rank, world)
        start_gather(whole, plan, None, context).wait()
        ahead = poisoned_copy(truth, rank, world)
        handle = start_gather(ahead, plan, None, context, ahead=True)
        for k in range(len(handle.plan.chunks)):
            handle.wait_until(k)
        assert handle.done
        out[fmt] = (whole, ahead, handle.plan.max_recv_bytes, recv_budget_bytes(plan), len(handle.plan.chunks),
                    len(plan.chunks))
    return out


@pytest.mark.parametrize("world", [1, 3])
def test_engine_ahead_is_the_synchronous_gather_within_the_bucket(world):
    for res in run_distributed(engine_worker, world, 5):
        for fmt, (whole, ahead, recv, budget, n_ahead, n_plan) in res.items():
            assert torch.equal(whole.view(torch.int16), ahead.view(torch.int16)), fmt
            assert 2 * recv <= budget  # two chunks in flight, together within the bucket
            assert n_ahead >= n_plan  # cut smaller where two would not fit, never larger


def test_bytes_sent_default_settings():
    flat = torch.randn(64 * 4096).bfloat16()
    stats = qzero.quantized_all_gather(flat)
    assert stats.bytes_sent / stats.plain_bytes == pytest.approx((1 + 4 / 64) / 2)
    assert stats.num_chunks == 1


# ------------------------------------------------------------------ bad input, on every rank


GROUP_SIZE, FORMAT = "zero_quantized_weights_group_size", "zero_quantized_weights_format"
BAD_INPUTS = {
    "fp32 flat": (lambda r, w: (torch.zeros(64 * w), {}), "bf16 or fp16"),
    "group size 12": (lambda r, w: (torch.zeros(64 * w, dtype=torch.bfloat16), {GROUP_SIZE: 12}), GROUP_SIZE),
    "group size 0": (lambda r, w: (torch.zeros(64 * w, dtype=torch.bfloat16), {GROUP_SIZE: 0}), GROUP_SIZE),
    "numel not divisible": (lambda r, w: (torch.zeros(64 * w + 1, dtype=torch.bfloat16), {}), "not divisible"),
    "unsorted exact": (
        lambda r, w: (torch.zeros(64 * w, dtype=torch.bfloat16), {"exact_ranges": [(9, 12), (1, 2)]}),
        "sorted",
    ),
    "overlapping exact": (
        lambda r, w: (torch.zeros(64 * w, dtype=torch.bfloat16), {"exact_ranges": [(1, 9), (8, 12)]}),
        "overlaps",
    ),
    "out-of-range exact": (
        lambda r, w: (torch.zeros(64 * w, dtype=torch.bfloat16), {"exact_ranges": [(0, 64 * w + 1)]}),
        "out of range",
    ),
    "unknown format": (lambda r, w: (torch.zeros(64 * w, dtype=torch.bfloat16), {FORMAT: "int2"}),
                       f"{FORMAT}: unknown quantization format 'int2'"),
    "2-D flat": (lambda r, w: (torch.zeros(w, 64, dtype=torch.bfloat16), {}), "1-D"),
    "non-contiguous": (lambda r, w: (torch.zeros(128 * w, dtype=torch.bfloat16)[::2], {}), "contiguous"),
    "bucket 0": (lambda r, w: (torch.zeros(64 * w, dtype=torch.bfloat16), {"allgather_bucket_size": 0}),
                 "allgather_bucket_size"),
    "bucket float": (lambda r, w: (torch.zeros(64 * w, dtype=torch.bfloat16), {"allgather_bucket_size": 1e6}),
                     "allgather_bucket_size"),
    "not a tensor": (lambda r, w: ([0.0] * 64 * w, {}), "torch.Tensor"),
    # distributed mismatches: each must raise on every rank, never hang
    "numel differs": (lambda r, w: (torch.zeros(64 * w * (1 + r), dtype=torch.bfloat16), {}), "differs between ranks"),
    "group size differs": (
        lambda r, w: (torch.zeros(64 * w, dtype=torch.bfloat16), {GROUP_SIZE: 64 if r else 32}),
        "differs between ranks",
    ),
    "one rank bad": (
        lambda r, w: (torch.zeros(64 * w, dtype=torch.bfloat16), {GROUP_SIZE: 64 if r else 7}),
        "group_size|rejected their arguments",
    ),
}


def bad_input_worker(rank, world, name):
    make, _ = BAD_INPUTS[name]
    flat, kwargs = make(rank, world)
    if isinstance(flat, torch.Tensor):
        flat.normal_() if flat.is_contiguous() else flat.copy_(torch.randn(flat.shape))
        before = flat.clone()
    try:
        qzero.quantized_all_gather(flat, **kwargs)
    except (ValueError, TypeError) as e:
        unchanged = torch.equal(flat, before) if isinstance(flat, torch.Tensor) else True
        # the group still works afterwards: nothing is left half-done in a collective
        t = torch.ones(1)
        dist.all_reduce(t)
        return type(e).__name__, str(e), unchanged, t.item()
    return None


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_raises_on_every_rank(name):
    world = 3
    results = run_distributed(bad_input_worker, world, name, timeout=60)
    for r, res in enumerate(results):
        assert res is not None, f"rank {r} did not raise"
        _, msg, unchanged, total = res
        assert __import__("re").search(BAD_INPUTS[name][1], msg), msg
        assert unchanged
        assert total == world


def test_bad_group_argument():
    with pytest.raises(TypeError, match="ProcessGroup"):
        qzero.quantized_all_gather(torch.zeros(64, dtype=torch.bfloat16), group="world")


def failing_worker(rank, world):  # module level: the ranks may be spawned
    raise RuntimeError(f"boom on {rank}")


def test_worker_failures_are_reported():
    with pytest.raises(WorkerError, match="boom on 1"):
        run_distributed(failing_worker, 2)


class _Started(Exception):
    pass


@pytest.mark.parametrize("cuda", [False, True])
def test_ranks_are_spawned_whenever_cuda_is_available(monkeypatch, cuda):
    """With CUDA present the ranks are spawned, even when torch has not initialised CUDA here
    (Triton may have initialised the driver: a forked child then fails in CUDA's init)."""
    from _support import distributed

    methods = []

    def get_context(method):
        methods.append(method)
        raise _Started  # no ranks are started: the start method is the result

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.mp, "get_context", get_context)
    with pytest.raises(_Started):
        run_distributed(failing_worker, 2)
    assert methods == ["spawn" if cuda else "fork"]
