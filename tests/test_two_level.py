"""Two-level collectives (``hierarchical_collectives``) on gloo pseudo-nodes (``ranks_per_node``).

* The topology: detected from host names, declared, refused where it contradicts the hosts or
  cannot run, falling back to flat with a warning where a detected placement does not fit
  (pure, and on every rank of a real group).
* Gradients: every rank's fp32 gradient shard against an fp64 average of every rank's gradient,
  within the rounding of the node stage and half a quantization step of every other node's
  group; two micro-batches; stages 1 and 2; worlds 4 = 2x2, 6 = 3x2 and 2x3, 8 = 2x4.
* Weights: replicas bit-identical after every step (INT8, INT4 delta and its exact resyncs).
* Bytes: what each rank sends across nodes, per parameter, against the two-level figure.
* ``hierarchical_collectives=false`` with declared nodes is the flat path, bit for bit; a
  checkpoint resumes bit for bit at the same topology.
* Both flat orders: quantized gradients in the contiguous order are reduced in windows too.
"""

from __future__ import annotations

import functools
import socket
import warnings

import pytest
import torch
from _support.distributed import run_distributed
from _support.two_level import GS, SMALL, Chosen, coeffs, flat_of, small_model

import qzero
from qzero.layout.topology import Topology, resolve_topology, topology_from_hosts

# ------------------------------------------------------------------ the topology, pure


def test_topology_from_hosts():
    one_host = [(7, 0)] * 6
    assert topology_from_hosts(one_host, 0, "auto") == (Topology(1, 6), None)  # one host: flat
    assert topology_from_hosts(one_host, 2, "auto") == (Topology(3, 2, True), None)  # pseudo-nodes
    assert topology_from_hosts(one_host, 2, False) == (Topology(3, 2, False), None)
    two_hosts = [(1, 2), (1, 2), (2, 2), (2, 2)]
    assert topology_from_hosts(two_hosts, 0, "auto") == (Topology(2, 2, True), None)
    topo, warning = topology_from_hosts([(1, 0), (2, 0), (1, 0), (2, 0)], 0, "auto")
    assert topo == Topology.flat(4) and "cyclic" in warning
    topo, warning = topology_from_hosts([(1, 0), (1, 0), (1, 0), (2, 0)], 0, "auto")
    assert topo == Topology.flat(4) and "different numbers" in warning
    topo, warning = topology_from_hosts([(1, 2)] * 4, 0, "auto")  # torchrun says 2 a node, one host name
    assert topo == Topology.flat(4) and "duplicate host names" in warning
    with pytest.raises(ValueError, match="cyclic"):
        topology_from_hosts([(1, 0), (2, 0), (1, 0), (2, 0)], 0, True)
    with pytest.raises(ValueError, match="declared node 0 .* spans 2 hosts"):
        topology_from_hosts(two_hosts, 4, "auto")
    with pytest.raises(ValueError, match="does not divide the world size 6"):
        topology_from_hosts(one_host, 4, "auto")
    with pytest.raises(ValueError, match="more than one node"):
        resolve_topology(4, 4, True)
    t = Topology(3, 2, True)  # rank i L + j owns partition j n + i, and back
    assert [t.partition_of(r) for r in range(6)] == [0, 3, 1, 4, 2, 5]
    assert all(t.rank_of(t.partition_of(r)) == r for r in range(6))


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
            "slots": [(s.start, s.numel, s.exact) for s in g.layout.slots], "flat": g.flat.clone(),
            "reduce": opt.last_reduce[0], "gather": opt.last_gather[0], "params": sum(s.numel for s in g.layout.slots)}


def check_shards(results, world: int, micro: int, stage: int, quantized: bool):
    """Each rank's shard against the fp64 mean. Bound per element: the node stage's bf16 rounding
    (``L`` roundings of at most the node's magnitude), and, quantized, half the step of every other
    node's group of the node sum (the int8 format's step: absmax / 127)."""
    topo = results[0]["topology"]
    n, L = topo.nodes, topo.ranks_per_node
    if stage == 1:  # one reduction of the micro-batches' bf16 sum
        grads = [[flat_of(results[0], [sum(cs).to(torch.bfloat16).double() for cs in
                                        zip(*(coeffs(r, m) for m in range(micro)))])
                  for r in range(world)]]
    else:
        grads = [[flat_of(results[0], coeffs(r, m)) for r in range(world)] for m in range(micro)]
    for r, res in enumerate(results):
        lo, shard = res["lo"], res["shard"].double()
        hi = lo + shard.numel()
        want = torch.zeros_like(shard)
        bound = torch.full_like(shard, 1e-30)
        for xs in grads:
            node_sums = [sum(xs[i * L + j][lo:hi] for j in range(L)) for i in range(n)]
            want += sum(node_sums) / world
            bound += sum(L * ns.abs() + sum(xs[i * L + j][lo:hi].abs() for j in range(L))
                         for i, ns in enumerate(node_sums)) * 2.0 ** -8 / world
            if quantized:
                own = topo.node_of(r)
                for i, ns in enumerate(node_sums):
                    if i == own:
                        continue
                    # groups restart at every piece: bound by the largest magnitude within GS - 1 either side
                    near = torch.nn.functional.max_pool1d(ns.abs()[None, None], 2 * GS - 1, 1, GS - 1)[0, 0]
                    bound += near * (1 + 2.0 ** -7) / 127 / 2 / world
        err = (shard - want).abs()
        assert bool((err <= bound).all()), f"rank {r}: worst excess {float((err - bound).max()):.3g}"


# world, nodes x ranks per node, stage, quantized gradients
GRAD_MATRIX = [(4, 2, 2, True, "interleaved"), (6, 2, 1, True, "interleaved"), (6, 3, 2, False, "interleaved"),
               (8, 4, 2, True, "interleaved"), (4, 2, 1, False, "contiguous"),
               # quantized windows of the contiguous order ([Note: windows in the contiguous order])
               (4, 2, 2, True, "contiguous"), (6, 2, 1, True, "contiguous"), (8, 4, 2, True, "contiguous")]


@pytest.mark.parametrize("world,rpn,stage,quantized,order", GRAD_MATRIX)
def test_gradient_shards_within_the_format_error_of_fp64(world, rpn, stage, quantized, order):
    micro = 2
    kw = dict(stage=stage, ranks_per_node=rpn, reduce_bucket_size=240, small_param_numel=SMALL, flat_order=order,
              zero_quantized_gradients=quantized, zero_quantized_gradients_group_size=GS,
              zero_quantized_weights=True, allgather_bucket_size=2048)
    results = run_distributed(grad_worker, world, kw, micro)
    topo = results[0]["topology"]
    assert topo == Topology(world // rpn, rpn, True)
    # each rank owns partition (local x nodes + node): the rail-major numbering
    part = results[0]["numel"] // world
    assert [res["lo"] // part for res in results] == [topo.partition_of(r) for r in range(world)]
    check_shards(results, world, micro, stage, quantized)
    for res in results[1:]:
        assert torch.equal(res["flat"].view(torch.int16), results[0]["flat"].view(torch.int16)), "replicas differ"
    # bytes across nodes: each rank sends its rail (n - 1) / n of its node block's 1/L
    n = world // rpn
    numel = results[0]["numel"]
    elem = 1 + 4 / GS if quantized else 2  # int8 codes and an fp32 scale per group, or bf16
    if order == "contiguous" and not quantized:  # plain reduces to each owner: NCCL's reduce, not two-level
        return
    for res in results:
        red = res["reduce"]
        per_rank = (n - 1) / n * numel / rpn * elem * (micro if stage == 2 else 1)
        # this tiny model's exact elements (2 bytes) and short windows' partial groups and section
        # alignment add up to ~25% (interleaved, whose skipped padding windows hide some of it) or ~35%
        # (contiguous: no padding to skip)
        top = 1.4 if order == "contiguous" else 1.3
        assert 0.9 * per_rank <= red.bytes_across_nodes <= top * per_rank, red  # windows skip padding
        assert red.bytes_across_nodes <= red.bytes_sent


# ------------------------------------------------------------------ training: replicas, flat, resume


def train(opt, model, rank, steps, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    flats, losses = [], []
    for _ in range(steps):
        x = torch.randn(8, 32, generator=g).to(torch.bfloat16)
        loss = model(x).float().pow(2).mean()
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        opt.wait_for_weights()
        flats.append(opt.groups[0].flat.clone())
        losses.append(loss.item())
    return flats, losses


ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)


def training_worker(rank, world, kw, ckpt):
    model = small_model()
    opt = qzero.ZeroOptimizer(model, ADAMW, config=qzero.ZeroConfig(**kw))
    flats, _ = train(opt, model, rank, 3)
    opt.save_checkpoint(ckpt)
    after, _ = train(opt, model, rank, 2, seed=1)
    model2 = small_model()
    opt2 = qzero.ZeroOptimizer(model2, ADAMW, config=qzero.ZeroConfig(**kw))
    opt2.load_checkpoint(ckpt)
    resumed, _ = train(opt2, model2, rank, 2, seed=1)
    # the flat path with the same nodes declared
    model3 = small_model()
    opt3 = qzero.ZeroOptimizer(model3, ADAMW, config=qzero.ZeroConfig(**{**kw, "hierarchical_collectives": False}))
    model4 = small_model()
    opt4 = qzero.ZeroOptimizer(model4, ADAMW, config=qzero.ZeroConfig(**{**kw, "ranks_per_node": 0}))
    flat3, _ = train(opt3, model3, rank, 2)
    flat4, _ = train(opt4, model4, rank, 2)
    return {"flats": flats + after, "resumed": resumed, "after": after, "topology": (opt.topology, opt3.topology),
            "flat_paths": (flat3, flat4)}


@pytest.mark.parametrize("world,kw", [
    (4, dict(stage=2, zero_quantized_weights=True, zero_quantized_weights_delta=True,
             zero_quantized_weights_delta_resync_steps=2, zero_quantized_gradients=True,
             zero_quantized_gradients_error_feedback=True)),
    # Hadamard-rotated INT4 gradients: their error must not reach the padding ([Note: padding stays zero])
    (4, dict(stage=2, zero_quantized_weights=True, zero_quantized_gradients=True,
             zero_quantized_gradients_format="int4")),
    (6, dict(stage=1, zero_quantized_weights=True, zero_quantized_gradients=True, overlap_param_gather=False)),
    # the contiguous order: quantized gradients in windows, 2x2, 3x2 and 2x4
    (4, dict(stage=2, flat_order="contiguous", zero_quantized_weights=True, zero_quantized_weights_delta=True,
             zero_quantized_weights_delta_resync_steps=2, zero_quantized_gradients=True,
             zero_quantized_gradients_format="int4", zero_quantized_gradients_error_feedback=True)),
    (6, dict(stage=1, flat_order="contiguous", zero_quantized_weights=True, zero_quantized_gradients=True,
             zero_quantized_gradients_error_feedback=True)),
    (8, dict(stage=2, flat_order="contiguous", ranks_per_node=4, allgather_bucket_size=1100,
             zero_quantized_weights=True, zero_quantized_gradients=True, zero_quantized_gradients_format="int4")),
])
def test_replicas_identical_resume_exact_and_flat_unchanged(world, kw, tmp_path):
    kw = dict(dict(ranks_per_node=2, reduce_bucket_size=700, allgather_bucket_size=900, small_param_numel=48), **kw)
    results = run_distributed(training_worker, world, kw, str(tmp_path / "ckpt"))
    assert results[0]["topology"][0].two_level and not results[0]["topology"][1].two_level
    for step in range(5):
        for res in results[1:]:
            assert torch.equal(res["flats"][step].view(torch.int16), results[0]["flats"][step].view(torch.int16)), \
                f"replicas differ after step {step}"
    for res in results:
        for a, b in zip(res["after"], res["resumed"]):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), "the resumed run differs"
        for a, b in zip(*res["flat_paths"]):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), "hierarchical_collectives=false is not flat"


# ------------------------------------------------------------------ refusals on every rank


def refusal_worker(rank, world):
    out = {}

    def attempt(name, **kw):
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt = qzero.ZeroOptimizer(small_model(), ADAMW, config=qzero.ZeroConfig(**kw))
            out[name] = ("ok", opt.topology, [str(w.message) for w in caught if "qzero" in str(w.message)])
        except ValueError as e:
            out[name] = ("refused", str(e))

    attempt("not dividing", ranks_per_node=3)
    attempt("differs between ranks", ranks_per_node=2 if rank else 4)
    attempt("contiguous and quantized", ranks_per_node=2, flat_order="contiguous", zero_quantized_gradients=True,
            reduce_bucket_size=256)
    attempt("solo", ranks_per_node=2, solo_reduce=True)
    real = socket.gethostname
    socket.gethostname = lambda: f"host{rank % 2}"  # a cyclic placement over two hosts
    try:
        attempt("cyclic, asked for", hierarchical_collectives=True)
        attempt("cyclic, auto")
        socket.gethostname = lambda: f"host{rank // 2}"
        attempt("two hosts")
        attempt("declared across hosts", ranks_per_node=4)
    finally:
        socket.gethostname = real
    return out


def test_bad_topologies_are_refused_on_every_rank():
    results = run_distributed(refusal_worker, 4)
    for rank, out in enumerate(results):
        assert out["not dividing"][0] == "refused" and "does not divide the world size 4" in out["not dividing"][1]
        assert out["differs between ranks"][0] == "refused"
        status, topo, said = out["contiguous and quantized"]  # windows: runs, and says what it costs
        assert status == "ok" and topo == Topology(2, 2, True) and len(said) == 1 and "end of backward" in said[0]
        assert "solo_reduce" in out["solo"][1]
        assert out["cyclic, asked for"][0] == "refused" and "cyclic" in out["cyclic, asked for"][1]
        status, topo, said = out["cyclic, auto"]
        assert status == "ok" and not topo.two_level and any("cyclic" in s for s in said)
        # detected without a word about the placement (the small model's plain gradients go by chains: said)
        assert out["two hosts"][:2] == ("ok", Topology(2, 2, True))
        assert [s for s in out["two hosts"][2] if "chain reduce" not in s] == [], out["two hosts"][2]
        assert out["declared across hosts"][0] == "refused" and "spans 2 hosts" in out["declared across hosts"][1]


# ------------------------------------------------------------------ bits per parameter across the network


def bits_worker(rank, world, kw):
    out = []
    for flat in (False, True):
        torch.manual_seed(0)
        # 12 equal parameters: whole partitions at world 6, so the flat buffer has no padding
        model = torch.nn.Sequential(*[torch.nn.Linear(96, 96, bias=False) for _ in range(12)]).to(torch.bfloat16)
        opt = qzero.ZeroOptimizer(model, ADAMW, config=qzero.ZeroConfig(**kw, hierarchical_collectives=not flat))
        g = torch.Generator().manual_seed(rank)
        for _ in range(2):  # the first gather of a delta run is its exact resync: read the second step
            opt.backward(model(torch.randn(4, 96, generator=g).to(torch.bfloat16)).float().pow(2).mean())
            opt.step()
            opt.zero_grad()
        out.append(opt.network_bits_per_param())
    return out


def test_bits_per_parameter_per_node_across_the_network():
    """3 nodes of 2: INT4 delta weights (4.5 bits an element) and INT4 gradients (4.125). Two-level,
    a node sends ``(n - 1) / n`` of both; flat, ``L (n - 1) / n`` of the gradients (an all-to-all)
    and ``(P - 1) / P`` of the weights (a ring)."""
    kw = dict(ranks_per_node=2, zero_quantized_weights=True, zero_quantized_weights_delta=True,
              zero_quantized_gradients=True, zero_quantized_gradients_format="int4", small_param_numel=0)
    for two, flat in run_distributed(bits_worker, 6, kw):
        assert two == pytest.approx(2 / 3 * (4.5 + 4.125), rel=0.1)
        assert flat == pytest.approx(2 / 3 * 2 * 4.125 + 5 / 6 * 4.5, rel=0.1)
