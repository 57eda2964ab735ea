"""``qzero bench memory`` (qzero.app.benchmarks.memory): the peak replay and its reports on
synthetic allocator snapshots (no GPU needed)."""

import contextlib
import io
import json

import pytest

from qzero.app.benchmarks import memory as mp


MB = 2**20
SITE = "/usr/lib/python3.11/site-packages"
TORCH_LINEAR = {"filename": f"{SITE}/torch/nn/modules/linear.py", "line": 125, "name": "forward"}
TORCH_CALL = {"filename": f"{SITE}/torch/nn/modules/module.py", "line": 1750, "name": "_call_impl"}
CONTEXTLIB = {"filename": "/usr/lib/python3.11/contextlib.py", "line": 137, "name": "__enter__"}
FSDP = {"filename": f"{SITE}/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", "line": 200,
        "name": "foreach_all_gather"}
MLP = {"filename": f"{SITE}/transformers/models/qwen3/modeling_qwen3.py", "line": 60, "name": "forward"}
GATHER = {"filename": "/work/main/src/qzero/optim/zero.py", "line": 300, "name": "_gather"}
TRAIN = {"filename": "/work/main/src/qzero/app/train.py", "line": 146, "name": "train_worker"}
SELF = {"filename": "/work/main/src/qzero/app/benchmarks/memory.py", "line": 10, "name": "main"}

# innermost frame first, as the allocator records them
ACTIVATION = [TORCH_LINEAR, TORCH_CALL, MLP, TORCH_CALL, TRAIN, SELF]
WEIGHTS = [CONTEXTLIB, GATHER, TRAIN, SELF]
FSDP_BUFFER = [FSDP, TORCH_CALL, MLP, TRAIN, SELF]


def alloc(addr, size, frames):
    return {"action": "alloc", "addr": addr, "size": size, "frames": frames, "stream": 0}


def free(addr, size, requested=True):
    """free_requested then free_completed, as the allocator logs a free with no other stream uses."""
    out = [{"action": "free_requested", "addr": addr, "size": size, "frames": [], "stream": 0}] if requested else []
    return out + [{"action": "free_completed", "addr": addr, "size": size, "frames": [], "stream": 0}]


def snapshot(trace, segments=None, device=0):
    traces = [[] for _ in range(device + 1)]
    traces[device] = trace
    return {"device_traces": traces, "segments": segments if segments is not None else []}


def groups(grouped):
    return {g["key"]: (g["bytes"], g["count"], g["largest"]) for g in grouped["groups"]}


W = "qzero/optim/zero.py:300 _gather"
A = "models/qwen3/modeling_qwen3.py:60 forward"


def test_peak_in_the_middle():
    trace = [
        {"action": "segment_alloc", "addr": 0, "size": 64 * MB, "frames": []},
        alloc(1000, 10 * MB, WEIGHTS),
        alloc(2000, 4 * MB, ACTIVATION),
        alloc(3000, 6 * MB, ACTIVATION),  # index 3: 20 MB live, the peak
        *free(2000, 4 * MB),
        *free(9999, 50 * MB),  # allocated before the trace: ignored
        alloc(4000, 3 * MB, WEIGHTS),  # 19 MB
        *free(3000, 6 * MB),
        *free(1000, 10 * MB),
        {"action": "snapshot", "addr": 0, "size": 0, "frames": []},
    ]
    b = mp.peak_breakdown(snapshot(trace))
    assert b["peak_index"] == 3
    assert b["peak_bytes"] == 20 * MB
    assert b["peak_allocated_bytes"] == 20 * MB
    assert b["pending_free_bytes_at_peak"] == 0
    assert b["live_blocks_at_peak"] == 3
    assert b["events"] == len(trace)
    assert b["peak_alloc"]["size"] == 6 * MB
    assert b["peak_alloc"]["frames"][0] == "nn/modules/linear.py:125 forward"
    assert groups(b["sites"]) == {W: (10 * MB, 1, 10 * MB), A: (10 * MB, 2, 6 * MB)}
    assert [g["key"] for g in b["sites"]["groups"]] == sorted([W, A])  # ties: by key
    assert groups(b["coarse"]) == {
        "qzero: qzero/optim/zero.py _gather": (10 * MB, 1, 10 * MB),
        "transformers: models/qwen3/modeling_qwen3.py forward": (10 * MB, 2, 6 * MB),
    }
    assert groups(b["packages"]) == {"qzero": (10 * MB, 1, 10 * MB), "transformers": (10 * MB, 2, 6 * MB)}
    assert b["baseline_bytes"] is None  # no segments in this snapshot


def test_sorted_and_top():
    trace = [alloc(1, 5 * MB, WEIGHTS), alloc(2, 7 * MB, ACTIVATION), alloc(3, 1 * MB, FSDP_BUFFER)]
    b = mp.peak_breakdown(snapshot(trace), top=1)
    assert b["peak_bytes"] == 13 * MB and b["peak_index"] == 2
    assert [g["key"] for g in b["sites"]["groups"]] == [A]
    # the FSDP buffer is attributed to the model code that ran the FSDP hook ...
    assert b["sites"]["groups"][0]["bytes"] == 8 * MB and b["sites"]["groups"][0]["count"] == 2
    assert b["sites"]["rest"] == {"groups": 1, "bytes": 5 * MB, "count": 1}
    # ... but to FSDP in the coarse grouping, which keeps every group
    assert [g["key"] for g in b["coarse"]["groups"]] == [
        "transformers: models/qwen3/modeling_qwen3.py forward",
        "qzero: qzero/optim/zero.py _gather",
        "fsdp: fsdp/_fully_shard/_fsdp_collectives.py foreach_all_gather",
    ]
    assert groups(b["packages"])["fsdp"] == (1 * MB, 1, 1 * MB)


def test_free_requested_then_completed_counts_once():
    trace = [
        alloc(1, 8 * MB, WEIGHTS),
        {"action": "free_requested", "addr": 1, "size": 8 * MB, "frames": []},  # used on another stream
        alloc(2, 4 * MB, ACTIVATION),  # 12 MB active, 4 MB allocated
        {"action": "free_requested", "addr": 1, "size": 8 * MB, "frames": []},  # repeated: no effect
        {"action": "free_completed", "addr": 1, "size": 8 * MB, "frames": []},
        {"action": "free_completed", "addr": 1, "size": 8 * MB, "frames": []},  # repeated: no effect
        alloc(3, 2 * MB, ACTIVATION),  # 6 MB
    ]
    b = mp.peak_breakdown(snapshot(trace))
    assert b["peak_index"] == 2
    assert b["peak_bytes"] == 12 * MB
    assert b["peak_allocated_bytes"] == 8 * MB  # the first block alone, before its free was requested
    assert b["pending_free_bytes_at_peak"] == 8 * MB
    assert groups(b["sites"]) == {W: (8 * MB, 1, 8 * MB), A: (4 * MB, 1, 4 * MB)}


def test_free_completed_without_request_and_reused_address():
    trace = [
        alloc(1, 3 * MB, WEIGHTS),
        *free(1, 3 * MB, requested=False),
        alloc(1, 5 * MB, ACTIVATION),  # same address, new block
        alloc(2, 1 * MB, ACTIVATION),
    ]
    b = mp.peak_breakdown(snapshot(trace))
    assert b["peak_bytes"] == 6 * MB and b["peak_allocated_bytes"] == 6 * MB
    assert groups(b["sites"]) == {A: (6 * MB, 2, 5 * MB)}


def test_keys():
    assert mp.site_key(WEIGHTS) == W  # contextlib (standard library) skipped
    assert mp.site_key([TORCH_CALL, SELF]) == mp.NO_USER_FRAME
    assert mp.site_key([]) == mp.NO_USER_FRAME
    assert mp.coarse_key([TORCH_CALL, TRAIN]) == ("qzero: qzero/app/train.py train_worker", "qzero")
    assert mp.coarse_key([TORCH_CALL]) == ("other", "other")
    # the command line around it
    checkout = {"filename": "/home/me/qzero/src/qzero/app/cli.py", "line": 1, "name": "main"}
    assert mp.coarse_key([TORCH_CALL, checkout]) == ("other", "other")
    ds = {"filename": f"{SITE}/deepspeed/runtime/zero/stage_1_and_2.py", "line": 9, "name": "step"}
    assert mp.coarse_key([ds, GATHER]) == ("deepspeed: runtime/zero/stage_1_and_2.py step", "deepspeed")
    assert mp.short_path("/a/b/c/d/e.py") == "c/d/e.py" and mp.short_path("e.py") == "e.py"


def test_baseline_and_device():
    trace = [*free(7, 2 * MB), alloc(1, 4 * MB, WEIGHTS), alloc(2, 1 * MB, ACTIVATION), *free(2, 1 * MB)]
    segments = [
        {"device": 1, "address": 0, "total_size": 20 * MB, "blocks": [
            {"address": 0, "size": 2 * MB, "requested_size": 2 * MB - 100, "state": "active_allocated"},  # before
            {"address": 1, "size": 4 * MB, "requested_size": 4 * MB, "state": "active_allocated"},  # traced
            {"address": 2, "size": 1 * MB, "requested_size": 1 * MB, "state": "inactive"},
            {"address": 5, "size": 1 * MB, "requested_size": 1 * MB, "state": "active_awaiting_free"},  # before
        ]},
        {"device": 0, "address": 0, "total_size": 20 * MB, "blocks": [
            {"address": 0, "size": 8 * MB, "requested_size": 8 * MB, "state": "active_allocated"},  # other GPU
        ]},
    ]
    b = mp.peak_breakdown(snapshot(trace, segments, device=1), device=1)
    assert b["device"] == 1 and b["peak_bytes"] == 5 * MB and b["peak_index"] == 3
    assert b["baseline_bytes"] == 3 * MB - 100 and b["baseline_blocks"] == 2
    assert mp.peak_breakdown(snapshot(trace, segments, device=1), device=0)["peak_index"] is None


def test_empty_trace():
    b = mp.peak_breakdown({"device_traces": [[]], "segments": []})
    assert b["peak_index"] is None and b["peak_bytes"] == 0 and b["sites"]["groups"] == []
    assert "No allocation" in mp.format_breakdown(b)
    assert mp.peak_breakdown({"device_traces": []}, device=3)["events"] == 0


def test_format_breakdown():
    trace = [alloc(1, 3 * 2**30, WEIGHTS), alloc(2, 512 * MB, ACTIVATION), alloc(3, 1 * MB, FSDP_BUFFER)]
    b = mp.peak_breakdown(snapshot(trace), top=1)
    b["max_memory_allocated"] = 4 * 2**30
    text = mp.format_breakdown(b)
    assert "**3.50 GiB** in 3 blocks, at event 2 of 3" in text
    assert "max_memory_allocated: 4.00 GiB" in text
    assert "| 3.00 | 1 | 3072.0 | qzero/optim/zero.py:300 _gather |" in text  # sites, top 1
    assert "| 0.50 | 2 | | (1 more) |" in text
    assert "| 3.00 | 1 | 3072.0 | qzero |" in text  # packages
    assert "    fsdp/_fully_shard/_fsdp_collectives.py:200 foreach_all_gather" in text  # the peak's stack
    assert text.index("### By package") < text.index("### By innermost frame outside torch")


def test_compare(tmp_path):
    a = mp.peak_breakdown(snapshot([alloc(1, 3 * 2**30, WEIGHTS), alloc(2, 2**30, ACTIVATION)]))
    b = mp.peak_breakdown(snapshot([alloc(1, 2**30, FSDP_BUFFER), alloc(2, 2**30, ACTIVATION)]))
    text = mp.format_compare(a, b, "qzero", "fsdp2")
    lines = text.splitlines()
    assert "| peak (trace) | 4.00 | 2.00 | +2.00 |" in lines
    assert "| max_memory_allocated | n/a | n/a | n/a |" in lines
    assert "| qzero | 3.00 | 0.00 | +3.00 |" in lines
    assert "| fsdp | 0.00 | 1.00 | -1.00 |" in lines
    assert "| transformers | 1.00 | 1.00 | +0.00 |" in lines
    coarse = [ln for ln in lines if ln.startswith(("| qzero: ", "| fsdp: ", "| transformers: "))]
    assert coarse[0] == "| qzero: qzero/optim/zero.py _gather | 3.00 | 0.00 | +3.00 |"  # largest difference first
    assert coarse[-1].endswith("| 1.00 | 1.00 | +0.00 |")

    # the command line (qzero bench memory --compare) reads the JSON records that main() writes
    from qzero.app.cli import main
    pa, pb = tmp_path / "memory_qzero.json", tmp_path / "fsdp.json"
    pa.write_text(json.dumps({"tag": "qzero", "max_memory_allocated": 5 * 2**30, "breakdown": a}))
    pb.write_text(json.dumps(b))  # a bare breakdown works too, named after its file
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["bench", "memory", "--compare", str(pa), str(pb)]) == 0
    out = buf.getvalue()
    assert "## Peak memory: qzero vs fsdp" in out
    assert "| max_memory_allocated | 5.00 | n/a | n/a |" in out


@pytest.mark.parametrize("n", [10_000])
def test_linear_time(n):
    """Many peaks in a row must not copy the live set each time (a long, rising trace)."""
    trace = [alloc(i, 1, WEIGHTS) for i in range(n)]
    b = mp.peak_breakdown(snapshot(trace))
    assert b["peak_bytes"] == n and b["peak_index"] == n - 1 and b["live_blocks_at_peak"] == n
