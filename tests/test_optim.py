"""ZeroOptimizer against a single-process fp32-master reference, on real gloo groups."""

import functools
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _support.distributed import run_distributed

import qzero
from qzero.optim.checkpoint.logical import logical_pieces

# ------------------------------------------------------------------ a tiny model, fp32 compute on bf16/fp16 weights


class F32Linear(torch.nn.Linear):
    def forward(self, x):
        return F.linear(x, self.weight.float(), None if self.bias is None else self.bias.float())


class TinyNet(torch.nn.Module):
    """Embedding + two linears + a norm + a frozen projection; bf16/fp16 weights, fp32 math."""

    def __init__(self, dtype=torch.bfloat16, vocab=37, d=24, h=40):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.l1 = F32Linear(d, h)
        self.norm_w = torch.nn.Parameter(torch.ones(h))
        self.l2 = F32Linear(h, d)
        self.frozen = F32Linear(d, d, bias=False)
        self.frozen.weight.requires_grad_(False)
        self.head = F32Linear(d, vocab, bias=False)
        self.to(dtype)

    def forward(self, tokens, targets):
        x = self.emb.weight.float()[tokens]
        h = torch.tanh(self.l1(x))
        h = F.layer_norm(h, h.shape[-1:], self.norm_w.float())
        x = x + self.frozen(self.l2(h))
        logits = self.head(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_model(dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    return TinyNet(dtype)


def batch(step, micro, global_batch=12, seq=5, vocab=37):
    g = torch.Generator().manual_seed(1000 * step + micro)
    tokens = torch.randint(0, vocab, (global_batch, seq), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def rank_slice(t, rank, world):
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n]


ADAMW = functools.partial(torch.optim.AdamW, lr=3e-2, betas=(0.9, 0.95), weight_decay=0.1)


def groups_of(model, split):
    if not split:
        return None
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0, "lr": 1e-2}]


# ------------------------------------------------------------------ the single-process reference


def reference_run(world, steps, *, stage, micro=1, clip=0.0, split_groups=False, dtype=torch.bfloat16):
    """Plain PyTorch: per-rank gradients of the bf16 model, averaged in fp32, AdamW on fp32 masters.

    ``world`` may be a list (the world size of each step), to model a run resharded mid-way.
    """
    model = make_model(dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    index = {p: i for i, p in enumerate(params)}
    groups = groups_of(model, split_groups)
    if groups is None:
        opt = ADAMW(masters)
    else:
        opt = ADAMW([{**g, "params": [masters[index[p]] for p in g["params"]]} for g in groups])
    losses = []
    worlds = world if isinstance(world, list) else [world] * steps
    for step in range(steps):
        world = worlds[step]
        acc = [torch.zeros_like(m) for m in masters]
        step_loss = 0.0
        per_rank = [[torch.zeros_like(p, dtype=dtype) for p in params] for _ in range(world)]
        for m in range(micro):
            tokens, targets = batch(step, m)
            summed = [torch.zeros_like(m_) for m_ in masters]
            for r in range(world):
                for p in params:
                    p.grad = None
                loss = model(rank_slice(tokens, r, world), rank_slice(targets, r, world))
                loss.backward()
                step_loss += loss.item() / world
                for i, p in enumerate(params):
                    if stage == 1:
                        per_rank[r][i] += p.grad  # stage 1 accumulates in the parameter dtype
                    else:
                        summed[i] += p.grad.float()
            if stage == 2:
                for a, s in zip(acc, summed):
                    a.add_(s, alpha=1.0 / world)
        if stage == 1:
            for i in range(len(params)):
                s = sum((per_rank[r][i].float() for r in range(1, world)), per_rank[0][i].float())
                acc[i].add_(s, alpha=1.0 / world)
        norm = torch.stack([a.pow(2).sum() for a in acc]).sum().sqrt()
        if clip:
            coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
            for a in acc:
                a.mul_(coef)
        for mst, a in zip(masters, acc):
            mst.grad = a
        opt.step()
        with torch.no_grad():
            for p, mst in zip(params, masters):
                p.copy_(mst)
        losses.append(step_loss / micro)
    return losses, [m.detach() for m in masters], [p.detach().clone() for p in params]


# ------------------------------------------------------------------ the distributed run


def zero_run(rank, world, steps, cfg_kwargs, micro=1, split_groups=False, dtype=torch.bfloat16, optimizer=ADAMW):
    model = make_model(dtype, seed=rank)  # replicas start different: rank 0's weights must win
    frozen_before = model.frozen.weight.detach().clone()
    cfg = qzero.ZeroConfig(**cfg_kwargs)
    opt = qzero.ZeroOptimizer(model, optimizer, config=cfg, param_groups=groups_of(model, split_groups))
    losses, norms = [], []
    for step in range(steps):
        step_loss = 0.0
        for m in range(micro):
            tokens, targets = batch(step, m)
            loss = model(rank_slice(tokens, rank, world), rank_slice(targets, rank, world))
            opt.backward(loss)
            t = loss.detach().reshape(1).clone()
            dist.all_reduce(t)
            step_loss += t.item() / world
        opt.step()
        norms.append(opt.grad_norm.item())
        opt.zero_grad()
        losses.append(step_loss / micro)
    opt.wait_for_weights()  # a quantized gather runs ahead by default: finish it before reading the weights
    params = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    masters = [(logical_pieces(g), g.master.clone(), g.layout.used_numel) for g in opt.groups]
    flats = [g.flat.clone() for g in opt.groups]
    return {
        "losses": losses,
        "norms": norms,
        "params": params,
        "masters": masters,
        "flats": flats,
        "frozen_unchanged": torch.equal(model.frozen.weight, frozen_before),
        "frozen_not_flat": all(model.frozen.weight.data_ptr() != g.flat.data_ptr() for g in opt.groups),
        "gather": [tuple(s) for s in opt.last_gather],
    }


def assemble_masters(results, group=0):
    """The full fp32 master vector of one group (parameters in model order), from every rank's shard."""
    full = None
    for res in results:
        pieces, m, n = res["masters"][group]
        if full is None:
            full = torch.full((n,), float("nan"))
        for local, length, at in pieces:
            full[at : at + length] = m[local : local + length]
    assert not torch.isnan(full).any(), "every parameter element is owned by some rank"
    return full


def assert_matches_reference(cfg_kwargs, *, stage, world=3, steps=3):
    """Train with ZeroOptimizer and with the single-process reference: same fp32 masters."""
    results = run_distributed(zero_run, world, steps, cfg_kwargs)
    _, ref_masters, _ = reference_run(world, steps, stage=stage)
    assert_replicas_identical(results)
    want = torch.cat([m.reshape(-1) for m in ref_masters])
    torch.testing.assert_close(assemble_masters(results), want, rtol=2e-6, atol=2e-7)


def assert_replicas_identical(results):
    for res in results[1:]:
        for a, b in zip(res["flats"], results[0]["flats"]):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), "replicas differ"


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("order", ["contiguous", "interleaved"])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_matches_single_process_reference(stage, world, order):
    steps = 4
    kwargs = dict(stage=stage, reduce_dtype="fp32", reduce_bucket_size=300, allgather_bucket_size=world * 64 * 3,
                  flat_order=order)
    results = run_distributed(zero_run, world, steps, kwargs)
    ref_losses, ref_masters, ref_params = reference_run(world, steps, stage=stage)
    assert_replicas_identical(results)
    got = assemble_masters(results)
    want = torch.cat([m.reshape(-1) for m in ref_masters])
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-7)
    for p, q in zip(results[0]["params"], ref_params):
        torch.testing.assert_close(p.float(), q.float(), rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert results[0]["frozen_unchanged"] and results[0]["frozen_not_flat"]


@pytest.mark.parametrize("stage", [1, 2])
def test_accumulation_clipping_and_param_groups(stage):
    world, steps = 2, 3
    kwargs = dict(stage=stage, reduce_dtype="fp32", gradient_clipping=0.05, reduce_bucket_size=500)
    results = run_distributed(zero_run, world, steps, kwargs, 2, True)
    ref_losses, ref_masters, _ = reference_run(world, steps, stage=stage, micro=2, clip=0.05, split_groups=True)
    model = make_model()
    decay = [i for i, p in enumerate(q for q in model.parameters() if q.requires_grad) if p.dim() == 2]
    no_decay = [i for i, p in enumerate(q for q in model.parameters() if q.requires_grad) if p.dim() < 2]
    for group, idx in enumerate((decay, no_decay)):
        want = torch.cat([ref_masters[i].reshape(-1) for i in idx])
        torch.testing.assert_close(assemble_masters(results, group), want, rtol=5e-6, atol=5e-7)
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert all(n > 0.05 for n in results[0]["norms"]), "clipping must have been active"


def test_default_bf16_reduce_stays_close():
    results = run_distributed(zero_run, 2, 3, dict(stage=2))
    ref_losses, _, _ = reference_run(2, 3, stage=2)
    assert_replicas_identical(results)
    assert max(abs(a - b) for a, b in zip(results[0]["losses"], ref_losses)) < 5e-3


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4"])
def test_quantized_weights_track_plain_and_replicas_agree(stage, fmt):
    world, steps = 3, 5
    base = dict(stage=stage, small_param_numel=40, allgather_bucket_size=3 * 128)
    plain = run_distributed(zero_run, world, steps, base)
    quant = run_distributed(
        zero_run, world, steps, {**base, "zero_quantized_weights": True, "zero_quantized_weights_format": fmt,
                                 "zero_quantized_weights_group_size": 16,
                                 # the synchronous gather's chunks: gather-ahead cuts this tiny bucket in two
                                 # (two chunks in flight), and at 64 elements a chunk its alignment shows
                                 "overlap_param_gather": False}
    )
    assert_replicas_identical(quant)
    tol = {"int8": 0.02, "fp8": 0.05, "int4": 0.2}[fmt]
    assert max(abs(a - b) for a, b in zip(plain[0]["losses"], quant[0]["losses"])) < tol
    sent, plain_bytes = sum(s[1] for s in quant[0]["gather"]), sum(s[2] for s in quant[0]["gather"])
    assert sent < (0.75 if fmt != "int4" else 0.5) * plain_bytes  # group 16: 1.25 (int4: 0.75) B/param + exact
    # small parameters travel exactly: the norm weight equals bf16(master) on every rank
    assert quant[0]["frozen_unchanged"]


def fp16_overflow_run(rank, world):
    model = make_model(torch.float16)
    cfg = qzero.ZeroConfig(stage=2, initial_scale_power=4, hysteresis=1, zero_quantized_weights=True)
    opt = qzero.ZeroOptimizer(model, ADAMW, config=cfg)
    tokens, targets = batch(0, 0)
    tokens, targets = rank_slice(tokens, rank, world), rank_slice(targets, rank, world)
    before = [g.flat.clone() for g in opt.groups]
    scale0 = opt.loss_scale
    loss = model(tokens, targets)
    opt.backward(loss * (torch.inf if rank == 1 else 1.0))  # only rank 1 overflows
    took = opt.step()
    opt.zero_grad()
    unchanged = all(torch.equal(a, g.flat) for a, g in zip(before, opt.groups))
    scale1 = opt.loss_scale
    opt.backward(model(tokens, targets))
    took2 = opt.step()
    changed = any(not torch.equal(a, g.flat) for a, g in zip(before, opt.groups))
    return took, unchanged, scale0, scale1, took2, changed, opt.scaler.skipped_steps


def test_fp16_overflow_skips_step_on_every_rank():
    for took, unchanged, s0, s1, took2, changed, skipped in run_distributed(fp16_overflow_run, 2):
        assert took is False and unchanged, "an overflow step must not update or gather"
        assert s1 == s0 / 2 and skipped == 1
        assert took2 is True and changed


def test_optimizer_variants_run():
    """SGD with momentum and AdamW (foreach / single-tensor) all step the flat masters."""
    for opt_factory in (
        functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
        functools.partial(torch.optim.AdamW, lr=1e-2, foreach=True),
        functools.partial(torch.optim.AdamW, lr=1e-2, foreach=False),
        functools.partial(torch.optim.Adam, lr=1e-2, fused=True),
    ):
        results = run_distributed(zero_run, 2, 2, dict(stage=2), 1, False, torch.bfloat16, opt_factory)
        assert results[0]["losses"][1] < results[0]["losses"][0] + 0.5
        assert_replicas_identical(results)


# ------------------------------------------------------------------ checkpoints


def train_steps(model, opt, rank, world, steps, losses):
    """One micro-batch per step of ``steps`` (its data by step index); the mean loss appended."""
    for step in steps:
        tokens, targets = batch(step, 0)
        loss = model(rank_slice(tokens, rank, world), rank_slice(targets, rank, world))
        opt.backward(loss)
        t = loss.detach().reshape(1).clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
        opt.step()
        opt.zero_grad()


def checkpoint_run(rank, world, path, mode, quantized, order="contiguous"):
    model = make_model(seed=rank if mode == "save" else rank + 10)  # a loaded run must not depend on its init
    cfg = qzero.ZeroConfig(zero_quantized_weights=quantized, reduce_dtype="fp32", allgather_bucket_size=world * 128,
                           flat_order=order)
    opt = qzero.ZeroOptimizer(model, ADAMW, config=cfg)
    losses = []
    if mode == "save":
        train_steps(model, opt, rank, world, range(0, 3), losses)
        opt.save_checkpoint(path)
        train_steps(model, opt, rank, world, range(3, 6), losses)
    else:
        opt.load_checkpoint(path)
        train_steps(model, opt, rank, world, range(3, 6), losses)
    return losses[-3:], [p.detach().clone() for p in model.parameters() if p.requires_grad], {
        "masters": [(logical_pieces(g), g.master.clone(), g.layout.used_numel) for g in opt.groups]
    }, opt.groups[0].lo


@pytest.mark.parametrize("quantized", [False, True])
def test_checkpoint_resume_is_bit_exact(quantized):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        saved = run_distributed(checkpoint_run, 2, path, "save", quantized)
        resumed = run_distributed(checkpoint_run, 2, path, "load", quantized)
    for a, b in zip(saved, resumed):
        assert a[0] == b[0], "losses after resume differ"
        for p, q in zip(a[1], b[1]):
            assert torch.equal(p.view(torch.int16), q.view(torch.int16))
        assert torch.equal(a[2]["masters"][0][1], b[2]["masters"][0][1])


@pytest.mark.parametrize("orders", [("contiguous", "contiguous"), ("interleaved", "contiguous"),
                                    ("contiguous", "interleaved")])
def test_checkpoint_reshards_from_2_to_3_ranks(orders):
    """Saved at world 2 after 3 steps, loaded at world 3 (also across flat orders): the next 3
    steps are what an unsharded run with those per-step batch splits computes."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        run_distributed(checkpoint_run, 2, path, "save", False, orders[0])
        resumed = run_distributed(checkpoint_run, 3, path, "load", False, orders[1])
    ref_losses, ref_masters, _ = reference_run([2, 2, 2, 3, 3, 3], 6, stage=2)
    got = assemble_masters([r[2] for r in resumed])
    torch.testing.assert_close(got, torch.cat([m.reshape(-1) for m in ref_masters]), rtol=2e-6, atol=2e-7)
    torch.testing.assert_close(torch.tensor(resumed[0][0]), torch.tensor(ref_losses[3:]), rtol=1e-5, atol=1e-6)


def other_model_run(rank, world, path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).bfloat16()
    opt = qzero.ZeroOptimizer(model, ADAMW)
    try:
        opt.load_checkpoint(path)
    except ValueError as e:
        return str(e)
    return None


def test_checkpoint_of_another_model_is_refused():
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        run_distributed(checkpoint_run, 2, path, "save", False)
        msgs = run_distributed(other_model_run, 2, path)
    assert all(m and "another model" in m for m in msgs)


# ------------------------------------------------------------------ rejections at construction


def rejection_run(rank, world, case):
    model = make_model()
    kwargs = {}
    if case == "fp32 with quantization":
        model = make_model(torch.float32)
        kwargs["config"] = qzero.ZeroConfig(zero_quantized_weights=True)
    elif case == "mixed dtypes":
        model.l1.float()
    elif case == "settings differ":
        kwargs["config"] = qzero.ZeroConfig(zero_quantized_weights=rank == 0)
    elif case == "shapes differ":
        if rank == 1:
            model.head = F32Linear(24, 5, bias=False).bfloat16()
    elif case == "bucket below one group per rank":
        kwargs["config"] = qzero.ZeroConfig(allgather_bucket_size=64)
    elif case == "not an optimizer":
        kwargs["optimizer"] = functools.partial(lambda params: params)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        qzero.ZeroOptimizer(model, kwargs.pop("optimizer", ADAMW), **kwargs)
    except (TypeError, ValueError) as e:
        same = all(torch.equal(before[n], p) for n, p in model.named_parameters())
        return str(e), same
    return None, True


@pytest.mark.parametrize(
    "case, match",
    [
        ("fp32 with quantization", "fp32"),
        ("mixed dtypes", "several dtypes"),
        ("settings differ", "config differs between ranks|rejected"),
        ("shapes differ", r"parameter and buffer shapes\) differs between ranks"),
        ("bucket below one group per rank", "smaller than one group per rank"),
        ("not an optimizer", "torch.optim.Optimizer"),
    ],
)
def test_rejected_at_construction_on_every_rank(case, match):
    import re

    for msg, unchanged in run_distributed(rejection_run, 2, case, timeout=60):
        assert msg is not None and re.search(match, msg), msg
        assert unchanged


def collectives_run(rank, world, order, stage, solo=False):
    calls = {"reduce_scatter_tensor": 0, "reduce": 0}
    for name in calls:
        real = getattr(dist, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        setattr(dist, name, counted)
    model = make_model()
    cfg = qzero.ZeroConfig(stage=stage, reduce_bucket_size=world * 200, flat_order=order, solo_reduce=solo)
    opt = qzero.ZeroOptimizer(model, ADAMW, config=cfg)
    tokens, targets = batch(0, 0)
    opt.backward(model(rank_slice(tokens, rank, world), rank_slice(targets, rank, world)))
    opt.step()
    return {"calls": calls, "order": opt.groups[0].layout.order,
            "buckets": len(opt.grads[0].reducer.buckets), "solo": len(opt.grads[0].reducer.solo)}


@pytest.mark.parametrize("order,solo", [("contiguous", False), ("interleaved", False), ("interleaved", True)])
def test_stage2_without_overlap_comm_matches_the_reference(order, solo):
    """``overlap_comm=False``: every bucket (and every solo parameter) is reduced after backward
    instead of during it; the result is the same."""
    kwargs = dict(stage=2, overlap_comm=False, reduce_dtype="fp32", reduce_bucket_size=300,
                  allgather_bucket_size=3 * 64 * 3, flat_order=order, solo_reduce=solo)
    assert_matches_reference(kwargs, stage=2)


@pytest.mark.parametrize("stage", [1, 2])
def test_gradients_are_reduce_scattered_in_the_interleaved_order(stage):
    """Interleaved order: one reduce-scatter per window and nothing else by default; with
    ``solo_reduce``, a reduce to its owner for each parameter that starts a partition and spans
    several windows (the embedding and, in this small model, the first parameter of another
    partition); the contiguous order reduces flat ranges to their owners (values: the
    reference tests)."""
    res = run_distributed(collectives_run, 3, "interleaved", stage)[0]
    assert res["order"] == "interleaved" and res["solo"] == 0
    assert res["calls"]["reduce"] == 0
    assert res["calls"]["reduce_scatter_tensor"] == res["buckets"] > 1
    res = run_distributed(collectives_run, 3, "interleaved", stage, True)[0]
    assert res["order"] == "interleaved" and res["solo"] >= 1
    assert res["calls"]["reduce"] == res["solo"]
    assert res["calls"]["reduce_scatter_tensor"] == res["buckets"] > 1
    res = run_distributed(collectives_run, 3, "contiguous", stage)[0]
    assert res["order"] == "contiguous" and res["solo"] == 0
    assert res["calls"]["reduce_scatter_tensor"] == 0
    assert res["calls"]["reduce"] >= res["buckets"] > 1


@pytest.mark.parametrize("stage", [1, 2])
def test_solo_reduce_matches_the_reference(stage):
    """``solo_reduce``: the embedding reduced on its own gives the single-process reference."""
    kwargs = dict(stage=stage, reduce_dtype="fp32", reduce_bucket_size=300, allgather_bucket_size=3 * 64 * 3,
                  flat_order="interleaved", solo_reduce=True)
    assert_matches_reference(kwargs, stage=stage)


def grad_lifetime_run(rank, world, stage):
    model = make_model()
    opt = qzero.ZeroOptimizer(model, ADAMW, config=qzero.ZeroConfig(stage=stage, reduce_bucket_size=300))
    g = opt.groups[0]
    seen = {"before": g.grad is None}
    tokens, targets = batch(0, 0)
    opt.backward(model(rank_slice(tokens, rank, world), rank_slice(targets, rank, world)))
    made = g.grad is not None and g.master.grad is g.grad and bool(g.grad.abs().sum() > 0)
    seen["after_backward"] = made if stage == 2 else g.grad is None  # stage 1 reduces in step()
    opt.step()
    seen["after_step"] = g.grad is not None
    opt.zero_grad(set_to_none=False)
    seen["kept_zero"] = g.grad is not None and not g.grad.any()
    opt.zero_grad()
    seen["dropped"] = g.grad is None and g.master.grad is None
    before, weights = g.master.clone(), [p.detach().clone() for p in model.parameters()]
    try:  # no backward since zero_grad(): refused (torch.optim would skip it; Adam's momentum would still move)
        opt.step()
        seen["step_without_backward"] = False
    except RuntimeError as e:
        seen["step_without_backward"] = ("without opt.backward(loss)" in str(e) and torch.equal(before, g.master)
                                         and all(torch.equal(a, b) for a, b in zip(weights, model.parameters())))
    return seen


@pytest.mark.parametrize("stage", [1, 2])
def test_gradient_shard_lives_from_backward_to_zero_grad(stage):
    """The fp32 gradient shard is not held through the forward: made at the first reduction
    (stage 2: in backward; stage 1: in step), freed by ``zero_grad()`` (zeroed in place with ``set_to_none=False``)."""
    for seen in run_distributed(grad_lifetime_run, 2, stage):
        assert all(seen.values()), seen


def subgroup_run(rank, world, steps, cfg_kwargs):
    """Two data-parallel groups of two, strided as under tensor parallelism ({0, 2}, {1, 3})."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pg, dp_rank = groups[rank % 2], rank // 2
    model = make_model(seed=dp_rank)  # each DP group starts from its DP rank 0's weights
    opt = qzero.ZeroOptimizer(model, ADAMW, config=qzero.ZeroConfig(**cfg_kwargs), process_group=pg)
    losses = []
    for step in range(steps):
        tokens, targets = batch(step, 0)
        loss = model(rank_slice(tokens, dp_rank, 2), rank_slice(targets, dp_rank, 2))
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    opt.wait_for_weights()  # a quantized gather runs ahead by default
    return {"losses": losses, "flats": [g.flat.clone() for g in opt.groups]}


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("order", ["contiguous", "interleaved"])
def test_data_parallel_subgroups_match_a_plain_world_of_two(stage, order):
    """ZeroOptimizer over a DP subgroup of a larger world (global ranks != group ranks): every
    collective (reduce-scatter, reduce to owners, gathers) stays inside the subgroup, and each
    group trains exactly as a world of two would."""
    kwargs = dict(stage=stage, zero_quantized_weights=True, small_param_numel=40, reduce_bucket_size=300,
                  allgather_bucket_size=2 * 64 * 3, flat_order=order)
    sub = run_distributed(subgroup_run, 4, 3, kwargs)
    plain = run_distributed(zero_run, 2, 3, kwargs)
    for rank, res in enumerate(sub):
        want = plain[rank // 2]
        for a, b in zip(res["flats"], want["flats"]):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"rank {rank} differs from a world of two"


def landing_run(rank, world, cfg_kwargs, landing, steps=3, micro=2, dtype=torch.bfloat16):
    """Train with the landing shard on (the default) or off (each sum added into the fp32
    shard as it arrives); record the fp32 gradient shard after each backward, the masters,
    and what existed while the backward ran."""
    model = make_model(dtype)
    opt = qzero.ZeroOptimizer(model, ADAMW, config=qzero.ZeroConfig(**cfg_kwargs))
    for grads in opt.grads:
        if not landing:
            grads.reducer.use_landing = False
    during = {"fp32_shard_seen": False, "landing_seen": False}

    def watch(_):
        for g, grads in zip(opt.groups, opt.grads):
            during["fp32_shard_seen"] |= g.grad is not None and micro == 1
            during["landing_seen"] |= grads.reducer._landing_shard is not None

    hooks = [p.register_post_accumulate_grad_hook(watch) for p in model.parameters() if p.requires_grad]
    shards, masters = [], []
    for step in range(steps):
        for m in range(micro):
            tokens, targets = batch(step, m)
            opt.backward(model(rank_slice(tokens, rank, world), rank_slice(targets, rank, world)) / micro)
            shards.append([g.grad.clone() for g in opt.groups])
            assert all(grads.reducer._landing_shard is None for grads in opt.grads), \
                "the landing shard outlived backward"
        opt.step()
        opt.zero_grad()
        masters.append([g.master.clone() for g in opt.groups])
    for h in hooks:
        h.remove()
    opt.wait_for_weights()
    return {"shards": shards, "masters": masters, "flats": [g.flat.clone() for g in opt.groups], "during": during}


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


@pytest.mark.parametrize(
    "world,order,dtype,micro,overlap",
    [
        (2, "interleaved", torch.bfloat16, 1, True),
        (2, "contiguous", torch.bfloat16, 2, True),
        (3, "interleaved", torch.float16, 2, True),
        (3, "contiguous", torch.bfloat16, 1, False),
    ],
)
def test_landing_shard_is_bitwise_the_direct_add(world, order, dtype, micro, overlap):
    """Stage 2's plain 16-bit sums wait in the landing shard until backward ends: the fp32
    gradient shard after every backward (with accumulation too), the masters after every step
    and the gathered weights are bit for bit those of adding each sum as it arrives; during a
    single-micro-batch backward only the landing shard exists (with overlap_comm off nothing
    is reduced before backward ends)."""
    kw = dict(stage=2, reduce_bucket_size=300, allgather_bucket_size=2 * 64 * 3, flat_order=order, overlap_comm=overlap,
              solo_reduce=order == "interleaved", small_param_numel=40)
    if dtype == torch.float16:
        kw["reduce_dtype"] = "fp16"
    on = run_distributed(landing_run, world, kw, True, 3, micro, dtype)
    off = run_distributed(landing_run, world, kw, False, 3, micro, dtype)
    for a, b in zip(on, off):
        for x, y in zip(sum(a["shards"], []) + sum(a["masters"], []) + a["flats"],
                        sum(b["shards"], []) + sum(b["masters"], []) + b["flats"]):
            assert torch.equal(_bits(x), _bits(y))
        assert a["during"]["landing_seen"] == overlap and not a["during"]["fp32_shard_seen"], a["during"]
        assert not b["during"]["landing_seen"]


def landing_flags_run(rank, world):
    flags = {}
    for name, kw in {"stage2 bf16": dict(stage=2), "stage2 fp32 reduce": dict(stage=2, reduce_dtype="fp32"),
                     "stage2 quantized": dict(stage=2, zero_quantized_gradients=True), "stage1": dict(stage=1)}.items():
        opt = qzero.ZeroOptimizer(make_model(), ADAMW, config=qzero.ZeroConfig(**kw))
        flags[name] = [g.reducer.use_landing for g in opt.grads]
        opt.close()
    return flags


def test_landing_shard_is_used_only_for_plain_16_bit_sums_in_stage_2():
    """An fp32 reduce dtype, quantized gradients (fp32 sums) and stage 1 add straight into the fp32 shard."""
    for flags in run_distributed(landing_flags_run, 2):
        assert flags == {"stage2 bf16": [True], "stage2 fp32 reduce": [False], "stage2 quantized": [False],
                         "stage1": [False]}, flags
