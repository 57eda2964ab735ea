"""The DeepSpeed adapter's gather-ahead and CPU optimizer offload, on CPU: 2 gloo ranks, bf16.

Gather-ahead must give the bits of the synchronous adapter (every module waits for its own
chunks), and the gather must really still be running when ``step()`` returns. CPU offload
(DeepSpeedCPUAdam, pinned or not) must give the bits of the adapter without offload
wherever DeepSpeed's own offload gives the bits of DeepSpeed without it.
"""

from __future__ import annotations

import os
import types
import tempfile

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

from _support.distributed import run_distributed  # noqa: E402
from test_deepspeed import STEPS, Net, data, ds_config, param_groups, quantized  # noqa: E402

from qzero.integrations import deepspeed as qds  # noqa: E402


def build(init, config, optimizer="torch"):
    torch.manual_seed(0)
    model = Net()
    if optimizer == "cpu_adam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam(param_groups(model), lr=1e-2, adamw_mode=True)
    else:
        opt = torch.optim.AdamW(param_groups(model), lr=1e-2, foreach=True)
    engine, _, _, _ = init(model=model, optimizer=opt, config=config, dist_init_required=False)
    return engine


def step_once(engine, step, rank):
    x, y = data(step, rank)
    loss = torch.nn.functional.mse_loss(engine(x.to(torch.bfloat16)).float(), y)
    engine.backward(loss)
    engine.step()
    return loss.item()


def flats(engine):
    return [f.detach().clone() for f in engine.optimizer.bit16_groups_flat]


def busy(engine):
    return engine.qzero_gather.wiring.ahead.busy


def ahead_checks(engine, rank, tmp):
    """After a step, every reader of the weights outside a training forward waits first."""
    model = engine._modules["module"]  # the model itself: reading it through the engine would wait
    out = {}
    seen = []
    first = model.inp.register_forward_pre_hook(lambda *_: seen.append(busy(engine)))

    step_once(engine, STEPS, rank)  # no gather running during this forward (run_arm waited)
    seen.clear()
    step_once(engine, STEPS + 1, rank)  # a training forward: `inp` waits for its own chunks only
    out["first_module_ran_with_gather_running"] = seen == [True]
    before = flats(engine)
    out["deferred"] = busy(engine)
    _ = engine.module  # export-style access from outside DeepSpeed
    out["module_access_waits"] = not busy(engine)
    out["gather_was_unfinished"] = any(not torch.equal(a, b) for a, b in zip(before, flats(engine)))

    step_once(engine, STEPS + 2, rank)
    model.train(False)  # a non-training forward (not through the engine)
    seen.clear()
    with torch.no_grad():
        model(data(0, rank)[0].to(torch.bfloat16))
    out["eval_forward_waits_first"] = seen == [False]
    model.train(True)
    first.remove()

    for name, read in [
        ("eval", lambda: engine.eval()),
        ("state_dict", lambda: model.state_dict()),
        ("save_checkpoint", lambda: engine.save_checkpoint(tmp, tag="t")),
    ]:
        engine.train()
        step_once(engine, STEPS + 3, rank)
        pending = busy(engine)
        read()
        out[f"{name}_waits"] = pending and not busy(engine)
    engine.train()
    # Reads of the weights that no hook or wrapper sees: each waits for the chunks it reads
    # ([Note: reads wait] in qzero/wire/overlap.py), so it returns the gathered weights.
    for name, read in [
        ("engine.parameters()", lambda: [p.detach().clone() for p in engine.parameters()]),
        ("model.named_parameters()", lambda: [p.detach().clone() for _, p in model.named_parameters()]),
        ("an attribute", lambda: [model.head.weight.detach().clone(), model.embed.pos.detach().clone()]),
        ("a submodule's state_dict", lambda: [t.clone() for t in model.mid.state_dict().values()]),
    ]:
        step_once(engine, STEPS + 4, rank)
        pending = busy(engine)
        got = read()
        engine.qzero_gather.wait_for_weights()
        out[f"{name} reads the gathered weights"] = pending and all(torch.equal(a, b) for a, b in zip(got, read()))
    qds.disable(engine)
    out["disabled_engine_class"] = type(engine) is deepspeed.DeepSpeedEngine
    out["hooks_removed"] = all(not m._forward_pre_hooks or m is model for m in model.modules())
    return out


def run_arm(init, config, rank, optimizer="torch"):
    engine = build(init, config, optimizer)
    losses = [step_once(engine, s, rank) for s in range(STEPS)]
    gather = getattr(engine, "qzero_gather", None)
    if gather is not None:
        gather.wait_for_weights()
    return engine, dict(losses=losses, flats=flats(engine), calls=None if gather is None else gather.calls)


def worker(rank, world, tmp):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    out = {}
    base = dict(round_robin_gradients=True)
    _, out["sync"] = run_arm(qds.initialize, quantized(**base), rank)
    engine, out["ahead"] = run_arm(qds.initialize, quantized(**base, overlap_param_gather=True), rank)
    out["ahead_class_kept_name"] = type(engine).__name__ == "DeepSpeedEngine"
    out["checks"] = ahead_checks(engine, rank, tmp)

    offload = {"device": "cpu", "pin_memory": False}
    pinned = {"device": "cpu", "pin_memory": True}
    _, out["ds"] = run_arm(deepspeed.initialize, ds_config(**base), rank, "cpu_adam")
    _, out["ds_offload"] = run_arm(deepspeed.initialize, ds_config(**base, offload_optimizer=offload), rank, "cpu_adam")
    _, out["q"] = run_arm(qds.initialize, quantized(**base), rank, "cpu_adam")
    _, out["q_offload"] = run_arm(qds.initialize, quantized(**base, offload_optimizer=offload), rank, "cpu_adam")
    engine, out["q_offload_ahead"] = run_arm(
        qds.initialize, quantized(**base, offload_optimizer=pinned, overlap_param_gather=True), rank, "cpu_adam"
    )
    out["offload_is_on"] = bool(engine.optimizer.cpu_offload)
    return out


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory() as tmp:
        return run_distributed(worker, 2, tmp, timeout=400)


def same(a, b):
    return a["losses"] == b["losses"] and all(torch.equal(x, y) for x, y in zip(a["flats"], b["flats"]))


def test_gather_ahead_is_bitwise_the_synchronous_adapter(runs):
    for r in runs:
        assert r["ahead"]["calls"] == r["sync"]["calls"] == STEPS
        assert same(r["ahead"], r["sync"])
        assert r["ahead_class_kept_name"]
    for a, b in zip(runs[0]["ahead"]["flats"], runs[1]["ahead"]["flats"]):
        assert torch.equal(a, b), "replicas differ"


def test_gather_ahead_really_defers_and_every_reader_waits(runs):
    for r in runs:
        c = r["checks"]
        assert c["first_module_ran_with_gather_running"], "the first module waited for the whole gather"
        assert c["deferred"] and c["gather_was_unfinished"], "step() finished the gather itself"
        for key in ("module_access_waits", "eval_forward_waits_first", "eval_waits", "state_dict_waits",
                    "save_checkpoint_waits"):
            assert c[key], key
        reads = [k for k in c if k.endswith("reads the gathered weights")]
        assert len(reads) == 4 and all(c[k] for k in reads), {k: c[k] for k in reads}
        assert c["disabled_engine_class"] and c["hooks_removed"]


def test_cpu_offload_is_bitwise_the_adapter_without_it(runs):
    for r in runs:
        assert r["offload_is_on"]
        # DeepSpeed's own offload keeps its bits here; so must the adapter's, with or without gather-ahead
        assert same(r["ds_offload"], r["ds"])
        assert same(r["q_offload"], r["q"])
        assert same(r["q_offload_ahead"], r["q"])
        assert r["q_offload"]["calls"] == STEPS
        # and quantization really ran: not DeepSpeed's plain gather
        assert not same(r["q"], r["ds"])
        assert max(abs(a - b) for a, b in zip(r["q"]["losses"], r["ds"]["losses"])) < 0.02
    for a, b in zip(runs[0]["q_offload_ahead"]["flats"], runs[1]["q_offload_ahead"]["flats"]):
        assert torch.equal(a, b), "replicas differ"


# ------------------------------------------------------ which module waits for which chunks (no process group)


class _Handle:
    """Stands in for a running gather: records the chunks waited for."""

    def __init__(self, chunks=10, chunk_numel=10):
        self.plan = types.SimpleNamespace(partition_numel=chunks * chunk_numel, chunk_numel=chunk_numel, world_size=1,
                                          chunks=range(chunks))
        self.waited = []

    def wait_until(self, k):
        self.waited.append(k)

    @property
    def done(self):
        return False

    def wait(self):
        self.waited.append("all")


class _Holder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.box = torch.nn.Module()  # a container: no forward of its own
        self.box.p = torch.nn.Parameter(torch.ones(4))
        self.plist = torch.nn.ParameterList([torch.nn.Parameter(torch.ones(4))])

    def forward(self, x):
        return self.lin(x) * self.box.p + self.plist[0]


def test_parameters_of_containers_are_waited_for_by_the_module_that_reads_them():
    from qzero.wire.overlap import GatherAhead

    model = _Holder()
    ranges = [(model.lin.weight, 0, 0, 16), (model.lin.bias, 0, 16, 20), (model.box.p, 0, 90, 94),
              (model.plist[0], 0, 60, 64)]
    ahead = GatherAhead.from_ranges(model, ranges, 1)
    handle = _Handle()
    ahead.start(0, handle)
    model(torch.ones(2, 4))
    # one hook wait per module and flat group, for the last chunk of its ranges there (chunks
    # finish in order): the root's hook for box.p (chunk 9) and plist[0] (chunk 6), then lin's
    # (1); each read of a parameter waits for its own chunk too (lin.weight, lin.bias, box.p,
    # plist[0]: [Note: reads wait] in qzero/wire/overlap.py), which a real gather answers at once.
    first = [9, 1, 1, 1, 9, 6]
    assert handle.waited == first
    model(torch.ones(2, 4))  # the next forward waits for the same chunks (resolved once per plan)
    assert handle.waited == first + first
    ahead.remove()
    assert handle.waited[-1] == "all"


@pytest.mark.parametrize(
    "kwargs, words",
    [(dict(backend="qzero", offload_optimizer="cpu"), "setting of the deepspeed backend"),
     (dict(backend="deepspeed", offload_optimizer="nvme"), "none, cpu, cpu_pinned"),
     (dict(backend="deepspeed", zero={"stage": 1, "zero_quantized_gradients": True}),
      "needs ZeRO stage 2, got stage 1"),
     (dict(backend="deepspeed", zero={"stage": 2, "zero_quantized_gradients": True,
                                      "zero_quantized_gradients_error_feedback": True}),
      "setting of the qzero backend"),
     (dict(backend="fsdp2", zero={"stage": 2, "zero_quantized_gradients": True,
                                  "zero_quantized_gradients_intra_node": "int8"}),
      "zero_quantized_gradients_intra_node is a setting of the qzero backend")],
)
def test_train_settings_offload_is_checked(kwargs, words):
    from qzero.app.train import TrainSettings, validate
    from qzero.app.workload import WorkloadError

    with pytest.raises(WorkloadError, match=words):
        validate(TrainSettings(device="cpu", **kwargs))


def test_train_settings_take_quantized_gradients_on_deepspeed_at_stage_2():
    from qzero.app.train import TrainSettings, validate

    validate(TrainSettings(device="cpu", backend="deepspeed", zero={"stage": 2, "zero_quantized_gradients": True}))


def timer_worker(rank, world):
    """Device synchronizations by DeepSpeed's throughput timer over 4 steps, per arm, and the
    timer's ``synchronized`` setting before and after ``disable``."""
    import warnings

    import deepspeed.utils.timer as timer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    real, syncs = timer.get_accelerator, []

    class Counting:  # the accelerator, counting the timer's synchronize() calls
        def __getattr__(self, name):
            return getattr(real(), name)

        def synchronize(self, *args):
            syncs.append(1)
            return real().synchronize(*args)

    timer.get_accelerator = Counting
    out = {}
    try:
        base = dict(round_robin_gradients=True)
        explicit = {**quantized(**base, overlap_param_gather=True), "timers": {"throughput": {"synchronized": True}}}
        for arm, config in (("sync", quantized(**base)), ("ahead", quantized(**base, overlap_param_gather=True)),
                            ("explicit", explicit)):
            syncs.clear()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine = build(qds.initialize, config)
            for s in range(4):
                step_once(engine, s, rank)
            out[arm] = dict(syncs=len(syncs), synchronized=engine.tput_timer.config.synchronized,
                            warned=any("throughput timer" in str(w.message) for w in caught))
            qds.disable(engine)
            out[arm]["after_disable"] = engine.tput_timer.config.synchronized
    finally:
        timer.get_accelerator = real
    return out


def test_gather_ahead_switches_off_deepspeeds_synchronizing_throughput_timer():
    """DeepSpeed's throughput timer synchronizes the device at every forward's start and step's end
    by default, which would finish every gather before the next forward ([Note: DeepSpeed's
    throughput timer]): gather-ahead switches it off (disable switches it back); a config that
    asks for it keeps it, with a warning; the synchronous gather leaves it alone."""
    for r in run_distributed(timer_worker, 2, timeout=300):
        assert r["sync"]["syncs"] > 0 and r["sync"]["synchronized"] and not r["sync"]["warned"]
        assert r["ahead"]["syncs"] == 0 and r["ahead"]["synchronized"] is False and not r["ahead"]["warned"]
        assert r["ahead"]["after_disable"] is True
        assert r["explicit"]["syncs"] > 0 and r["explicit"]["synchronized"] and r["explicit"]["warned"]


def test_the_trainer_callback_warns_when_deepspeeds_timer_would_synchronize():
    """The HF Trainer builds the engine before the callback runs, so gather-ahead cannot switch
    the timer off there: the callback says how to (and stays quiet when the config did)."""
    import warnings

    pytest.importorskip("transformers")
    from qzero.integrations.hf import QZeroCallback

    def args(timers):
        config = {"zero_optimization": {"stage": 2, "zero_quantized_weights": True}, **timers}
        return types.SimpleNamespace(hf_deepspeed_config=types.SimpleNamespace(config=config))

    for timers, warns in (({}, True), ({"timers": {"throughput": {"synchronized": True}}}, True),
                          ({"timers": {"throughput": {"synchronized": False}}}, False)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(Exception):  # no DeepSpeed optimizer behind a plain object: enable() refuses it
                QZeroCallback(overlap_param_gather=True).on_train_begin(args(timers), None, None, optimizer=object())
        assert any("synchronized" in str(w.message) for w in caught) == warns, timers
