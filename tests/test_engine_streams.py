"""The ``streams`` schedule's host side, on CPU: its CUDA stream calls are replaced by a
recorder (the work itself runs at once, in order), so what the schedule asks of the streams
can be checked here: which stream each launch is issued from, which events are recorded
and waited for, how many collectives are issued after each call (a function of the calls
alone), that the caller's stream is restored, and that the bits are the inline schedule's."""

from __future__ import annotations

import pytest
import torch

from _support.distributed import run_distributed


class _Event:
    def __init__(self, stream, serial):
        self.stream, self.serial = stream, serial


class _Stream:
    def __init__(self, name, log):
        self.name, self.log = name, log
        self.stream_id, self.device_index, self.device_type = hash(name) % 1000, 0, 1

    def record_event(self):
        event = _Event(self.name, len(self.log))
        self.log.append(("record", self.name, event))
        return event

    def wait_event(self, event):
        self.log.append(("wait", self.name, event))


def fake_cuda(monkeypatch_like, log):
    """Patch torch.cuda's stream calls; returns the streams (compute, pack, unpack)."""
    streams = {n: _Stream(n, log) for n in ("compute", "pack", "unpack")}
    state = {"current": streams["compute"]}

    def set_stream(s):
        log.append(("set", s.name))
        state["current"] = s

    monkeypatch_like(torch.cuda, "current_stream", lambda device=None: state["current"])
    monkeypatch_like(torch.cuda, "set_stream", set_stream)
    monkeypatch_like(torch.cuda, "current_device", lambda: 0)
    return streams, state


def worker(rank, world, fmt, lookahead=4):
    import qzero.wire.chunks as chunks
    import qzero.wire.engine as engine
    from qzero.wire.engine import CommContext, start_gather
    from qzero.layout import plan_gather

    log = []
    streams, state = fake_cuda(setattr, log)
    real_gather, real_pack, real_unpack = chunks.all_gather_into, engine.pack_chunk, engine.unpack_chunk

    class Work:
        def __init__(self, work):
            self.work = work

        def wait(self):
            log.append(("work.wait", state["current"].name))
            return self.work.wait()

    def gather(out, inp, group=None, async_op=False):
        log.append(("collective", state["current"].name, async_op))
        return Work(real_gather(out, inp, group=group, async_op=async_op))

    def pack(*a, **k):
        log.append(("pack", state["current"].name))
        return real_pack(*a, **k)

    def unpack(*a, **k):
        log.append(("unpack", state["current"].name))
        return real_unpack(*a, **k)

    engine.pack_chunk, engine.unpack_chunk = pack, unpack
    numel, gs = world * 64 * 12, 16
    plan = plan_gather(numel, world, allgather_bucket_size=world * 64 * 2, zero_quantized_weights_format=fmt,
                       zero_quantized_weights_group_size=gs,
                       exact_ranges=((0, 40), (500, 530), (numel - 20, numel)) if fmt else ())
    g = torch.Generator().manual_seed(7)
    truth = torch.randn(numel, generator=g).bfloat16()
    p = plan.partition_numel
    want = torch.zeros(numel, dtype=torch.bfloat16)
    want[rank * p : (rank + 1) * p] = truth[rank * p : (rank + 1) * p]
    got = want.clone()
    start_gather(want, plan, None, CommContext("cpu", schedule="inline")).wait()
    context = CommContext("cpu", schedule="inline", all_gather=gather, lookahead=lookahead)
    context.schedule, context.streams = "streams", {"pack": streams["pack"], "unpack": streams["unpack"]}
    del log[:]
    handle = start_gather(got, plan, None, context, ahead=True)
    assert type(handle).__name__ == "_Streamed"
    n = len(handle.plan.chunks)
    counts = [sum(e[0] == "collective" for e in log)]
    restored = [state["current"] is streams["compute"]]
    for k in range(n):
        handle.wait_until(k)
        counts.append(sum(e[0] == "collective" for e in log))
        restored.append(state["current"] is streams["compute"])
    assert handle.done
    return want, got, n, counts, restored, [tuple(x if not isinstance(x, _Event) else (x.stream, x.serial) for x in e)
                                            for e in log]


@pytest.mark.parametrize("world,fmt,lookahead", [(3, "int8", 4), (3, None, 4), (1, "int8", 4), (3, "int8", 0),
                                                (3, None, 0)])
def test_streams_schedule_host_protocol(world, fmt, lookahead):
    """``lookahead`` 4: four chunks out when the gather starts, each wait enqueues through four
    past its chunk; 0 (ZeroConfig.gather_lookahead's default): every chunk out at the start."""
    for want, got, n, counts, restored, log in run_distributed(worker, world, fmt, lookahead):
        assert torch.equal(want.view(torch.int16), got.view(torch.int16))
        assert n > 4 + 1
        ahead = lookahead or n
        assert all(restored)
        records = [e for e in log if e[0] == "record"]
        if world == 1:  # no collective: the unpack stream waits for the pack's event
            assert counts == [0] * (n + 1)
            assert sum(e[1] == "pack" for e in records) == n
            assert sum(e[0] == "wait" and e[1] == "unpack" for e in log) == n
            continue
        # how many collectives are out depends on the calls alone
        assert counts == [min(ahead, n)] + [min(k + 1 + ahead, n) for k in range(n)]
        if lookahead == 0:
            assert counts == [n] * (n + 1)
        kinds = [e[0] for e in log]
        assert kinds.count("collective") == n and all(e[1:] == ("pack", True) for e in log if e[0] == "collective")
        assert kinds.count("work.wait") == n and not any(e[0] == "wait" and e[1] == "unpack" for e in log)
        assert all(e[1] == "pack" for e in log if e[0] == "pack")
        assert all(e[1] == "unpack" for e in log if e[0] in ("unpack", "work.wait"))
        # one event per chunk on the side streams (the unpack's), one on the caller's at the start
        assert sum(e[1] == "unpack" for e in records) == n and sum(e[1] == "pack" for e in records) == 0
        assert sum(e[1] == "compute" for e in records) == 1  # what the caller queued before the gather
        unpack_events = {e[2] for e in records if e[1] == "unpack"}
        pack_waits = [e[2] for e in log if e[0] == "wait" and e[1] == "pack"]
        # the caller's event once, then each chunk from the third on waits for the unpack two before it
        assert pack_waits[0][0] == "compute" and len(pack_waits) == 1 + n - 2
        assert all(w in unpack_events for w in pack_waits[1:])
        assert sum(e[0] == "wait" and e[1] == "compute" for e in log) == n  # each wait_until(k) waits once
        sets = [e[1] for e in log if e[0] == "set"]
        assert sets.count("pack") == n and sets.count("unpack") == n  # two switches per chunk


def test_step_profile_no_wait_arm_enqueues_without_waiting(monkeypatch):
    """benchmarks/scripts/step_profile.py's ``int8_ahead_nowait`` arm: inside the forward the hooks enqueue
    every chunk but the compute stream waits for none; the wait after the forward waits;
    leaving the arm restores the product's hooks."""
    from _support import bench_scripts
    from qzero.wire import engine, overlap
    from qzero.wire.engine import CommContext, start_gather
    from qzero.layout import plan_gather

    sp = bench_scripts.load("step_profile")
    log = []
    streams, state = fake_cuda(monkeypatch.setattr, log)
    real_hook, real_wait_for, real_wait = (overlap.GatherAhead._hook, overlap.GatherAhead.wait_for,
                                           engine._Streamed.wait_until)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(6)])
    plan = plan_gather(64 * 24, 1, zero_quantized_weights_format="int8", zero_quantized_weights_group_size=16,
                       allgather_bucket_size=64 * 4)
    params = list(model.parameters())
    ranges = [(p, 0, i * plan.numel // len(params), (i + 1) * plan.numel // len(params)) for i, p in enumerate(params)]
    context = CommContext("cpu", schedule="inline", lookahead=4)  # lazily: the forward's waits enqueue
    context.schedule, context.streams = "streams", {"pack": streams["pack"], "unpack": streams["unpack"]}
    with sp.forward_never_waits():
        ahead = overlap.GatherAhead.from_ranges(model, ranges, 1)
        handle = start_gather(torch.zeros(plan.numel, dtype=torch.bfloat16), plan, None, context, ahead=True)
        ahead.start(0, handle)
        assert handle._enqueued == 4
        del log[:]
        model(torch.zeros(2, 4))
        assert handle._enqueued == len(handle.plan.chunks) > 4 and handle.finished == 0
        assert not any(e[0] == "wait" and e[1] == "compute" for e in log)
        ahead.wait_all()
        assert handle.done and any(e[0] == "wait" and e[1] == "compute" for e in log)
    assert overlap.GatherAhead._hook is real_hook and engine._Streamed.wait_until is real_wait
    assert overlap.GatherAhead.wait_for is real_wait_for
