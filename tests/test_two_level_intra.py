"""The quantized node stage of two-level gradient reductions
(``zero_quantized_gradients_intra_node="int8"``) on gloo pseudo-nodes.

* Gradients: every rank's fp32 gradient shard against the fp64 mean, within the int8 node stage's
  half step (per group of each sender's piece) plus the rail stage's half step of the node's fp32
  sum (int8 or unrotated int4); worlds 4 = 2x2, 6 = 3x2 and 2x3, 8 = 2x4; two micro-batches;
  stages 1 and 2.
* Training: replicas bit-identical after every step (INT4 delta weights with INT4 Hadamard
  gradients, INT8 with INT8), a checkpoint resumed bit for bit, and the setting changing the bits.
* Pipelining: the node stage of the next bucket is issued before a bucket's rail stage.
* Bytes: the node stage sends about half of what its bf16 reduce-scatter sends.
* Refusals: without quantized gradients, with error feedback, with flat collectives (on every rank).
"""

from __future__ import annotations

import functools

import pytest
import torch
from _support.distributed import run_distributed
from _support.two_level import GS, SMALL, Chosen, coeffs, flat_of, small_model

import qzero
from qzero.layout.topology import Topology

# GS is the rail stage's group; the node stage's INT8 group is min(GS, 64) = GS

# ------------------------------------------------------------------ gradients against fp64


def grad_worker(rank, world, kw, micro):
    torch.manual_seed(0)
    model = Chosen()
    opt = qzero.ZeroOptimizer(model, functools.partial(torch.optim.SGD, lr=0.0), config=qzero.ZeroConfig(**kw))
    for m in range(micro):
        opt.backward(model(coeffs(rank, m)))
    opt.step()
    g = opt.groups[0]
    return {"shard": g.grad.clone(), "lo": g.lo, "numel": g.layout.numel, "topology": opt.topology,
            "slots": [(s.start, s.numel) for s in g.layout.slots], "flat": g.flat.clone(),
            "windows": [(b.lo, b.width) for b in opt.grads[0].reducer.buckets], "reduce": opt.last_reduce[0]}


def group_max(v: torch.Tensor, gs: int) -> torch.Tensor:
    """Each element's group absmax, groups of ``gs`` counted from ``v``'s first element."""
    n = v.numel()
    padded = torch.nn.functional.pad(v.abs(), (0, -n % gs)).view(-1, gs)
    return padded.amax(dim=1).repeat_interleave(gs)[:n]


def window_bound(xs, topo, p: int, lo: int, width: int, j: int, qmax: int) -> torch.Tensor:
    """The error bound of rows ``j n + i`` (``i < n``) at ``[lo, lo + width)`` of one reduction:
    ``[n, width]``, row ``i`` that of the rank owning partition ``j n + i``.

    Node stage, in node ``i'``: local rank ``j`` gets from each other local rank ``j'`` its rows
    ``j n + 0 .. j n + n - 1`` of the window, concatenated, as one int8 piece (groups of ``GS``
    from the piece's start, so a group may span two rows): error at most half a step,
    ``absmax / 127 / 2``, per element and sender (the fp32 scale's rounding: ``1 + 2^-7``).
    Rail stage: node ``i'`` sends the owner ``i`` its fp32 node sum of row ``j n + i``, one piece
    of ``width`` (groups from ``lo``), in the rail's format: half a step of that sum's group,
    whose magnitude is at most the exact node sum's plus the node stage's error. The owner's own
    contributions (its own rows, its node's sum) are exact."""
    n, L = topo.nodes, topo.ranks_per_node
    rows = [j * n + i for i in range(n)]
    bound = torch.zeros(n, width, dtype=torch.float64)
    for node in range(n):
        piece = [torch.cat([xs[node * L + jj][q * p + lo:q * p + lo + width] for q in rows]) for jj in range(L)]
        node_err = sum(group_max(piece[jj], GS) for jj in range(L) if jj != j).view(n, width) / 127 / 2
        node_sum = sum(piece).view(n, width)
        for i in range(n):
            if i == node:  # the rail owner's own node sum
                bound[i] += node_err[i]
                continue
            rail = group_max(node_sum[i].abs() + node_err[i], GS) / qmax / 2
            bound[i] += node_err[i] + rail
    return bound * (1 + 2.0 ** -7)


def check_shards(results, world: int, micro: int, stage: int, qmax: int):
    topo = results[0]["topology"]
    p = results[0]["numel"] // world
    if stage == 1:  # one reduction of the micro-batches' bf16 sum
        grads = [[flat_of(results[0], [sum(cs).to(torch.bfloat16).double() for cs in
                                        zip(*(coeffs(r, m) for m in range(micro)))])
                  for r in range(world)]]
    else:
        grads = [[flat_of(results[0], coeffs(r, m)) for r in range(world)] for m in range(micro)]
    for r, res in enumerate(results):
        q = topo.partition_of(r)
        j, i = divmod(q, topo.nodes)
        shard = res["shard"].double()
        want = torch.zeros_like(shard)
        bound = torch.zeros_like(shard)
        for xs in grads:
            want += sum(x[q * p:(q + 1) * p] for x in xs) / world
            # fp32 sums and the average: a few roundings of at most the sum of magnitudes
            bound += sum(x[q * p:(q + 1) * p].abs() for x in xs) * 2.0 ** -20 / world
            for lo, width in res["windows"]:
                bound[lo:lo + width] += window_bound(xs, topo, p, lo, width, j, qmax)[i] / world
        err = (shard - want).abs()
        assert bool((err <= bound).all()), f"rank {r}: worst excess {float((err - bound).max()):.3g}"
        assert float(err.max()) > 0, "nothing was quantized"


# world, ranks per node, stage, the rail's format
GRAD_MATRIX = [(4, 2, 2, "int8"), (6, 2, 1, "int4"), (6, 3, 2, "int8"), (8, 4, 2, "int4")]


@pytest.mark.parametrize("world,rpn,stage,fmt", GRAD_MATRIX)
def test_gradient_shards_within_both_stages_error_of_fp64(world, rpn, stage, fmt):
    micro = 2
    kw = dict(stage=stage, ranks_per_node=rpn, reduce_bucket_size=240, small_param_numel=SMALL,
              zero_quantized_gradients=True, zero_quantized_gradients_group_size=GS,
              zero_quantized_gradients_format=fmt, zero_quantized_gradients_rotation="none",
              zero_quantized_gradients_intra_node="int8", zero_quantized_weights=True, allgather_bucket_size=2048)
    results = run_distributed(grad_worker, world, kw, micro)
    topo = results[0]["topology"]
    assert topo == Topology(world // rpn, rpn, True)
    check_shards(results, world, micro, stage, 127 if fmt == "int8" else 7)
    for res in results[1:]:
        assert torch.equal(res["flat"].view(torch.int16), results[0]["flat"].view(torch.int16)), "replicas differ"
    # the node stage's bytes: int8 codes and an fp32 scale per GS, where the plain stage sends bf16
    n, L = topo.nodes, topo.ranks_per_node
    for res in results:
        red = res["reduce"]
        plain = sum((L - 1) * n * w * 2 for _, w in res["windows"]) * (micro if stage == 2 else 1)
        node = red.bytes_sent - red.bytes_across_nodes
        # exact elements (2 bytes), partial groups and section alignment: at most ~25% on this tiny model
        assert 0.5 * (1 + 4 / GS) * plain <= node <= 0.5 * (1 + 4 / GS) * 1.3 * plain, (node, plain)


# ------------------------------------------------------------------ training: replicas, resume, bits changed


def train(opt, model, rank, steps, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    flats = []
    for _ in range(steps):
        for _ in range(2):  # two micro-batches
            x = torch.randn(8, 32, generator=g).to(torch.bfloat16)
            opt.backward(model(x).float().pow(2).mean())
        opt.step()
        opt.zero_grad()
        opt.wait_for_weights()
        flats.append(opt.groups[0].flat.clone())
    return flats


ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)


def training_worker(rank, world, kw, ckpt):
    model = small_model()
    opt = qzero.ZeroOptimizer(model, ADAMW, config=qzero.ZeroConfig(**kw))
    flats = train(opt, model, rank, 3)
    opt.save_checkpoint(ckpt)
    after = train(opt, model, rank, 2, seed=1)
    model2 = small_model()
    opt2 = qzero.ZeroOptimizer(model2, ADAMW, config=qzero.ZeroConfig(**kw))
    opt2.load_checkpoint(ckpt)
    resumed = train(opt2, model2, rank, 2, seed=1)
    model3 = small_model()
    opt3 = qzero.ZeroOptimizer(model3, ADAMW,
                               config=qzero.ZeroConfig(**{**kw, "zero_quantized_gradients_intra_node": "none"}))
    plain = train(opt3, model3, rank, 3)
    return {"flats": flats + after, "resumed": resumed, "after": after, "plain": plain, "topology": opt.topology}


INT4 = dict(zero_quantized_weights_delta=True, zero_quantized_weights_delta_resync_steps=2,
            zero_quantized_gradients_format="int4")


@pytest.mark.parametrize("world,kw", [
    (4, dict(stage=2, **INT4)),  # 2x2
    (6, dict(stage=1)),  # 3x2, INT8 and INT8
    (6, dict(stage=2, ranks_per_node=3, **INT4)),  # 2x3
    (8, dict(stage=2, ranks_per_node=4, flat_order="contiguous", allgather_bucket_size=1100)),  # 2x4, INT8
])
def test_replicas_identical_and_resume_exact(world, kw, tmp_path):
    kw = dict(dict(ranks_per_node=2, reduce_bucket_size=700, allgather_bucket_size=900, small_param_numel=48,
                   zero_quantized_weights=True, zero_quantized_gradients=True,
                   zero_quantized_gradients_intra_node="int8"), **kw)
    results = run_distributed(training_worker, world, kw, str(tmp_path / "ckpt"))
    assert results[0]["topology"].two_level
    for step in range(5):
        for res in results[1:]:
            assert torch.equal(res["flats"][step].view(torch.int16), results[0]["flats"][step].view(torch.int16)), \
                f"replicas differ after step {step}"
    for res in results:
        for a, b in zip(res["after"], res["resumed"]):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), "the resumed run differs"
    # the setting changes the bits (the node stage is quantized), the plain run's replicas agree too
    assert not torch.equal(results[0]["flats"][2], results[0]["plain"][2])
    for res in results[1:]:
        assert torch.equal(res["plain"][2].view(torch.int16), results[0]["plain"][2].view(torch.int16))


# ------------------------------------------------------------------ pieces of rows apart in flat space


def test_a_piece_of_rows_takes_each_rows_exact_ranges():
    """The node stage's piece for a local rank is ``n`` rows of the window, one block of staging but
    apart in flat space: each row's exact ranges land at the row's offset in the piece."""
    from qzero.wire.quantized_reduce import plan_pieces

    exact = [(5, 12), (100, 104), (203, 230)]  # flat coordinates
    # two rows of 10 at flat 0 and 200, then one piece of a single contiguous row at flat 100
    (a, b) = plan_pieces([(1, 0, 20, (0, 200)), (0, 20, 10, 100)], exact, 16, "int8", 2)
    assert (b.dest, b.exact) == (1, ((5, 10), (13, 20)))  # row 0: [5, 10); row 1: flat [203, 210) -> [13, 20)
    assert (a.dest, a.exact) == (0, ((0, 4),))
    assert b.layout.exact_numel == 12 and b.numel == 20 and b.offset == 0


# ------------------------------------------------------------------ pipelining


def order_worker(rank, world):
    """The stage (node or rail) of every all-to-all this rank issues in one backward."""
    import torch.distributed as dist

    model = small_model()
    opt = qzero.ZeroOptimizer(model, ADAMW, config=qzero.ZeroConfig(
        ranks_per_node=2, flat_order="interleaved", reduce_bucket_size=100, small_param_numel=0,
        zero_quantized_gradients=True, zero_quantized_gradients_intra_node="int8"))
    issued, real = [], dist.all_to_all_single

    def booked(*args, group=None, **kw):
        ranks = dist.get_process_group_ranks(group)
        issued.append("node" if ranks[1] - ranks[0] == 1 else "rail")
        return real(*args, group=group, **kw)

    dist.all_to_all_single = booked
    try:
        opt.backward(model(torch.randn(8, 32).to(torch.bfloat16)).float().pow(2).mean())
        opt.step()
    finally:
        dist.all_to_all_single = real
    return issued


def test_the_node_stage_of_the_next_bucket_goes_before_the_rail_stage_waits():
    """[Note: two-level pipelining]: a bucket's rail stage is launched when the next bucket's
    node stage has been, so the sequence is node, node, rail, node, rail, ..., rail."""
    for issued in run_distributed(order_worker, 4):
        buckets = issued.count("node")
        assert buckets > 2 and issued.count("rail") == buckets
        assert issued == ["node"] + ["node", "rail"] * (buckets - 1) + ["rail"], issued


# ------------------------------------------------------------------ bytes: about half the bf16 node stage


def bytes_worker(rank, world, intra):
    torch.manual_seed(0)
    # 12 equal parameters: whole partitions at world 6, no padding and no small parameters
    model = torch.nn.Sequential(*[torch.nn.Linear(96, 96, bias=False) for _ in range(12)]).to(torch.bfloat16)
    kw = dict(ranks_per_node=2, zero_quantized_gradients=True, small_param_numel=0,
              zero_quantized_gradients_intra_node=intra)
    opt = qzero.ZeroOptimizer(model, ADAMW, config=qzero.ZeroConfig(**kw))
    opt.backward(model(torch.randn(4, 96).to(torch.bfloat16)).float().pow(2).mean())
    opt.step()
    red = opt.last_reduce[0]
    return red.bytes_sent - red.bytes_across_nodes, red.bytes_across_nodes


def test_node_stage_sends_about_half_the_bf16_bytes():
    plain = run_distributed(bytes_worker, 6, "none")
    int8 = run_distributed(bytes_worker, 6, "int8")
    numel = 12 * 96 * 96
    for (node_plain, rail_plain), (node_int8, rail_int8) in zip(plain, int8):
        # a reduce-scatter over L = 2 sends (L - 1) / L of the whole gradient, 2 bytes an element
        assert node_plain == numel // 2 * 2
        assert node_int8 == pytest.approx(node_plain * (8 + 32 / 64) / 16, rel=0.02)  # groups of 64
        # the rail's pieces are the same size either way (its exact side channel is empty here)
        assert rail_int8 == rail_plain


# ------------------------------------------------------------------ refusals


def test_refused_by_the_config():
    with pytest.raises(ValueError, match="one of \\['none', 'int8'\\], got 'int4'"):
        qzero.ZeroConfig(zero_quantized_gradients=True, zero_quantized_gradients_intra_node="int4")
    with pytest.raises(ValueError, match="intra_node='int8' needs zero_quantized_gradients=true"):
        qzero.ZeroConfig(zero_quantized_gradients_intra_node="int8")
    with pytest.raises(ValueError, match="hierarchical_collectives=false"):
        qzero.ZeroConfig(zero_quantized_gradients=True, zero_quantized_gradients_intra_node="int8",
                         hierarchical_collectives=False)
    with pytest.raises(ValueError, match="set zero_quantized_gradients_error_feedback=false"):
        qzero.ZeroConfig(zero_quantized_gradients=True, zero_quantized_gradients_intra_node="int8",
                         zero_quantized_gradients_error_feedback=True)
    c = qzero.ZeroConfig(zero_quantized_gradients=True, zero_quantized_gradients_intra_node="int8")
    assert qzero.ZeroConfig.from_dict(c.to_dict()) == c


def refusal_worker(rank, world):
    out = {}
    for name, kw in (("flat, one host", {}), ("flat, declared", dict(ranks_per_node=4)),
                     ("flat, asked for", dict(ranks_per_node=2, hierarchical_collectives=False))):
        try:
            qzero.ZeroOptimizer(small_model(), ADAMW, config=qzero.ZeroConfig(
                zero_quantized_gradients=True, zero_quantized_gradients_intra_node="int8", **kw))
            out[name] = "ok"
        except ValueError as e:
            out[name] = str(e)
    return out


def test_flat_collectives_refused_on_every_rank():
    for out in run_distributed(refusal_worker, 4):
        for name in ("flat, one host", "flat, declared"):
            assert "needs two-level collectives" in out[name] and "intra_node='none'" in out[name], out[name]
        assert "hierarchical_collectives=false" in out["flat, asked for"], out["flat, asked for"]
