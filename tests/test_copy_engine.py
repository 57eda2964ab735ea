"""Copy-engine collectives (``ZeroConfig.copy_engine_collectives``): what detection names
when a piece is missing, and the refusal at construction where they cannot run (here: CPU,
gloo). The refusal at world 2 (every rank, nothing modified, one rank alone asking) is in
the bad-input matrix (tests/test_bad_input.py); the gather on copy engines itself needs two
GPUs (tests/gpu/workers/copy_engine_check.py)."""

from __future__ import annotations

import functools
import types

import pytest
import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

import qzero
from qzero import ZeroConfig
from qzero.wire import copy_engine
from qzero.wire.copy_engine import check_copy_engine_support


class _FakePG:
    """What torch's ProcessGroupNCCL offers for the zero-CTA policy."""

    NCCL_CTA_POLICY_ZERO = 2

    class Options:
        def __init__(self):
            self.config = types.SimpleNamespace(cta_policy=0)


@pytest.fixture
def supported(monkeypatch):
    """Every piece present (monkeypatched): the check passes; each test then removes one."""
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 28, 9))
    monkeypatch.setattr(dist, "ProcessGroupNCCL", _FakePG, raising=False)
    return monkeypatch


def _missing(device="cuda:0") -> str:
    with pytest.raises(ValueError) as info:
        check_copy_engine_support(torch.device(device), None)
    return str(info.value)


def test_all_pieces_present_passes(supported):
    assert check_copy_engine_support(torch.device("cuda", 0), None) is None


def _no_options_config(mp):
    class PG(_FakePG):
        class Options:  # an older torch: no .config
            pass

    mp.setattr(dist, "ProcessGroupNCCL", PG)


def _no_zero_policy(mp):
    class PG:
        Options = _FakePG.Options

    mp.setattr(dist, "ProcessGroupNCCL", PG)


def _nccl_raises(mp):
    def version():
        raise RuntimeError("no NCCL in this build")

    mp.setattr(torch.cuda.nccl, "version", version)


@pytest.mark.parametrize(
    "remove, device, named",
    [
        (lambda mp: None, "cpu", r"needs CUDA tensors (the parameters are on cpu)"),
        (lambda mp: mp.setattr(dist, "is_initialized", lambda: False), "cuda:0",
         "an initialized torch.distributed process group with the NCCL backend (none is initialized)"),
        (lambda mp: mp.setattr(dist, "get_backend", lambda group=None: "gloo"), "cuda:0",
         "a process group with the NCCL backend (this one's is 'gloo')"),
        (lambda mp: mp.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 7)), "cuda:0",
         "NCCL >= 2.28 (this PyTorch has NCCL 2.27.7)"),
        (_nccl_raises, "cuda:0", "NCCL >= 2.28 (this PyTorch reports no NCCL)"),
        (lambda mp: mp.delattr(dist, "ProcessGroupNCCL"), "cuda:0",
         "a PyTorch built with NCCL (torch " + torch.__version__ + " has no torch.distributed.ProcessGroupNCCL)"),
        (_no_options_config, "cuda:0", "ProcessGroupNCCL.Options().config.cta_policy"),
        (_no_zero_policy, "cuda:0", "ProcessGroupNCCL.NCCL_CTA_POLICY_ZERO"),
        (lambda mp: mp.delattr(symm_mem, "rendezvous"), "cuda:0",
         "PyTorch's NCCL symmetric memory (torch.distributed._symmetric_memory: rendezvous missing"),
        (lambda mp: mp.delattr(torch.cuda, "use_mem_pool"), "cuda:0", "torch.cuda.use_mem_pool missing"),
    ],
    ids=["not CUDA", "no process group", "backend gloo", "NCCL 2.27", "no NCCL", "torch without NCCL",
         "no Options.config", "no zero-CTA constant", "no symmetric rendezvous", "no mem pool"],
)
def test_each_missing_piece_is_named_alone(supported, remove, device, named):
    remove(supported)
    said = _missing(device)
    assert said.startswith("copy_engine_collectives=True needs "), said
    assert named in said, said
    assert said.count(";") == 0, f"only the removed piece is missing, got: {said}"
    assert "copy_engine_collectives=False" in said


def test_this_cpu_build_names_every_missing_piece():
    """The real torch of a CPU build, no process group: CUDA, the process group, NCCL and the
    NCCL process group class are all named in one message."""
    if torch.cuda.is_available() or dist.is_nccl_available():
        pytest.skip("a CUDA/NCCL build: the pieces are there")
    said = _missing("cpu")
    for piece in ("CUDA tensors", "none is initialized", "reports no NCCL",
                  "has no torch.distributed.ProcessGroupNCCL"):
        assert piece in said, said


def test_config_field():
    assert ZeroConfig().copy_engine_collectives is False
    on = ZeroConfig.from_dict({"copy_engine_collectives": True})
    assert on.copy_engine_collectives is True
    assert on.digest() != ZeroConfig().digest()  # ranks that disagree are refused by the agreement
    with pytest.raises(ValueError, match=r"copy_engine_collectives must be true or false, got 'yes'"):
        ZeroConfig(copy_engine_collectives="yes")


def test_world_one_refused_with_nothing_modified():
    """No process group at all (world 1): refused at construction, the model untouched."""
    assert not dist.is_initialized()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)).to(torch.bfloat16)
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"copy_engine_collectives=True needs CUDA tensors \(the parameters are on "
                                         r"cpu\); an initialized torch.distributed process group"):
        qzero.ZeroOptimizer(model, functools.partial(torch.optim.AdamW, lr=1e-3),
                            config=ZeroConfig(copy_engine_collectives=True))
    for n, p in model.named_parameters():
        assert p.data_ptr() == before[n][0] and torch.equal(p.detach(), before[n][1]), n
    assert not any(m._forward_pre_hooks for m in model.modules())
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())


def test_buffers_allocated_once_reused_and_aligned(monkeypatch):
    """Symmetric slabs are registered once per user and size (collective), reused after, and
    each buffer starts at an aligned offset the same on every rank."""
    registered = []
    monkeypatch.setattr(copy_engine.CopyEngineComm, "_allocate",
                        lambda self, need: registered.append(need) or torch.empty(need, dtype=torch.uint8))
    p = copy_engine.CopyEngineComm.__new__(copy_engine.CopyEngineComm)
    p._slabs = {}
    a = p.buffers("k", 2, 1000)
    assert [b.numel() for b in a] == [1000, 1000] and registered == [2 * 1024]
    assert a[1].data_ptr() - a[0].data_ptr() == 1024
    b = p.buffers("k", 2, 900)  # smaller: the same slab
    assert registered == [2048] and b[0].data_ptr() == a[0].data_ptr()
    p.buffers("k", 1, 3000)  # larger: one new registration, the old slab let go
    assert registered == [2048, 3072] and p.held_bytes == 3072
    assert p.buffers("other", 0, 10) == [] and registered == [2048, 3072]


# ---------------------------------------------------------------------- the hooks, on gloo


class _GlooProvider(copy_engine.CopyEngineComm):
    """CopyEngineComm with a gloo group and plain memory: what the engine and the gradient
    exchange do with a provider (its group, its reused buffers) runs on CPU."""

    def __init__(self, process_group, device):
        self.device = device
        self.group = dist.new_group(list(range(dist.get_world_size())), backend="gloo")
        self._slabs = {}
        self.registered = []

    def _allocate(self, nbytes):
        self.registered.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)


def _train_with_provider(rank, world, on):
    import qzero.wire.chunks as chunks
    import qzero.optim.zero as zero_mod

    zero_mod.check_copy_engine_support = lambda device, group: None  # CPU stands in for CUDA here
    zero_mod.CopyEngineComm = _GlooProvider
    groups_used = []
    real_gather, real_a2a = chunks.all_gather_into, dist.all_to_all_single

    def gather(out, inp, group=None, async_op=False):
        groups_used.append(("gather", group))
        return real_gather(out, inp, group=group, async_op=async_op)

    def a2a(out, inp, *a, group=None, **kw):
        groups_used.append(("a2a", group))
        return real_a2a(out, inp, *a, group=group, **kw)

    chunks.all_gather_into, dist.all_to_all_single = gather, a2a
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 40), torch.nn.LayerNorm(40), torch.nn.Linear(40, 24))
    model = model.to(torch.bfloat16)
    cfg = ZeroConfig(zero_quantized_weights=True, zero_quantized_gradients=True, copy_engine_collectives=on,
                     allgather_bucket_size=world * 64 * 8, reduce_bucket_size=600, small_param_numel=40)
    opt = qzero.ZeroOptimizer(model, functools.partial(torch.optim.AdamW, lr=1e-2), config=cfg)
    provider = opt.context.copy_engine
    registered = []
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(6, 48, generator=g).to(torch.bfloat16)
        opt.backward(model(x).float().square().mean())
        opt.step()
        opt.zero_grad()
        registered.append(list(provider.registered) if provider is not None else [])
    opt.wait_for_weights()
    flat = torch.cat([g.flat for g in opt.groups]).view(torch.int16).clone()
    on_provider = {kind for kind, group in groups_used if provider is not None and group is provider.group}
    return flat, registered, on_provider


def test_gather_and_exchange_use_the_provider_same_bits():
    """World 3 (gloo): with a provider the weight gather and the quantized all-to-all run on its
    group and in its buffers, registered in the first step and reused after (the same sizes on
    every rank: registration is collective), and training gives the same bits as without."""
    from _support.distributed import run_distributed

    off = run_distributed(_train_with_provider, 3, False, timeout=240.0)
    on = run_distributed(_train_with_provider, 3, True, timeout=240.0)
    for r in range(3):
        assert torch.equal(off[r][0], on[r][0]), f"rank {r}: weights differ with the provider"
        assert torch.equal(on[r][0], on[0][0]), "replicas differ"
        assert on[r][2] == {"gather", "a2a"}, on[r][2]
        first, *later = on[r][1]
        assert first and all(step == first for step in later), on[r][1]  # nothing registered after step 1
        assert on[r][1] == on[0][1], "ranks registered different slabs"


@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
def test_the_other_backends_refuse_it(backend):
    """The FSDP2 and DeepSpeed backends run their own collectives: the setting would change nothing."""
    from qzero.app.train import settings_from, validate
    from qzero.app.workload import WorkloadError

    s = settings_from({"backend": backend, "copy_engine_collectives": True})
    with pytest.raises(WorkloadError, match=f"copy_engine_collectives is a setting of the qzero backend.*{backend}"):
        validate(s)


def test_unsorted_group_without_sort_ranks_is_named(supported):
    """A PyTorch whose new_group always sorts ranks could not keep a descending group's order."""
    group = object()
    supported.setattr(dist, "new_group", lambda ranks=None, backend=None, pg_options=None: None)
    supported.setattr(dist, "get_world_size", lambda g=None: 2)
    supported.setattr(dist, "get_global_rank", lambda g, r: [3, 1][r])
    with pytest.raises(ValueError, match=r"needs a process group whose ranks ascend.*global ranks are \[3, 1\]"):
        check_copy_engine_support(torch.device("cuda", 0), group)
    supported.setattr(dist, "get_global_rank", lambda g, r: [1, 3][r])
    assert check_copy_engine_support(torch.device("cuda", 0), group) is None
