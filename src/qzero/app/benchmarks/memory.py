"""What is live on the GPU at a training backend's memory peak, and which code allocated it.

Made to explain why one training backend's peak CUDA memory is higher than another's
(e.g. qzero vs FSDP2 / DeepSpeed on the Qwen3-1.7B-shaped whole-step benchmark). Each
rank records the caching allocator's history (``torch.cuda.memory._record_memory_history``)
while ``qzero.app.train.train_worker`` builds the backend and trains a few steps, then replays the
recorded events to find the moment the most bytes were live and groups the blocks live
then by the code that allocated them:

* ``sites``: the innermost stack frame outside torch's own package (and outside the
  standard library and this script), as ``file:line function``;
* ``coarse``: the innermost frame inside ``qzero``, ``transformers``, ``deepspeed`` or
  ``torch/distributed/fsdp``, as ``package: file function`` (no line), else ``other``;
* ``packages``: the package of that frame.

Run on a 2-GPU host, from the repository root:

    python3 -m torch.distributed.run --nproc_per_node=2 -m qzero bench memory --backend qzero \
        [--quantized] [--overlap] [--preset qwen3-1.7b] [--seq-len 2048] [--micro-batch 2] \
        [--steps 4] [--allgather-bucket-size 5e8] [--reduce-bucket-size 5e7] [--set KEY=VALUE] [--out DIR] [--tag NAME]

On one GPU, ``qzero bench memory --fake-world 2 ...`` is rank 0 of a DP2 run under
torch's fake process group: the same allocations (they do not depend on the values the
collectives would deliver), no traffic.

Rank 0 writes ``DIR/memory_<tag>.md`` and ``DIR/memory_<tag>.json`` and prints the report.
Two such JSON files side by side (no GPU needed):

    qzero bench memory --compare DIR/memory_qzero.json DIR/memory_fsdp2.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from itertools import islice

from qzero.vocabulary import BACKENDS

GiB, MiB = float(2**30), float(2**20)

# (package, path marker), tried in order on each frame's file name
PACKAGES = (
    ("qzero", "/qzero/"),
    ("transformers", "/transformers/"),
    ("deepspeed", "/deepspeed/"),
    ("fsdp", "/torch/distributed/fsdp/"),
    ("fsdp", "/torch/distributed/_composable/fsdp/"),
)
NO_USER_FRAME = "(no frame outside torch)"


# ---------------------------------------------------------------------- frames


def _file(frame: dict) -> str:
    return str(frame.get("filename", "")).replace("\\", "/")


def short_path(filename: str, parts: int = 3) -> str:
    return "/".join(filename.replace("\\", "/").split("/")[-parts:])


def frame_text(frame: dict) -> str:
    return f"{short_path(_file(frame))}:{frame.get('line', '?')} {frame.get('name', '?')}"


#: This command's own frames (and the command line's around it): not who asked for the memory.
SELF_FILES = ("qzero/app/benchmarks/memory.py", "qzero/app/cli.py", "qzero/__main__.py")


def _is_self(filename: str) -> bool:
    return filename.endswith(SELF_FILES)


def _skipped(filename: str) -> bool:
    """Frames that say nothing about who asked for the memory: torch itself, the Python
    standard library (contextlib, functools, runpy, ...), frozen modules and this command."""
    if "/torch/" in filename or filename.startswith("torch/"):
        return True
    if filename.startswith("<") or _is_self(filename):
        return True
    return "/lib/python3" in filename and "-packages/" not in filename


def site_key(frames: list[dict]) -> str:
    """The innermost frame (frames come innermost first) outside torch, as ``file:line name``."""
    for f in frames:
        if not _skipped(_file(f)):
            return frame_text(f)
    return NO_USER_FRAME


def package_of(filename: str) -> str | None:
    for name, marker in PACKAGES:
        if marker in filename:
            return name
    return None


def coarse_key(frames: list[dict]) -> tuple[str, str]:
    """(``package: file function`` of the innermost frame in a package of interest, package)."""
    for f in frames:
        pkg = None if _is_self(_file(f)) else package_of(_file(f))
        if pkg is not None:
            return f"{pkg}: {short_path(_file(f))} {f.get('name', '?')}", pkg
    return "other", "other"


# ---------------------------------------------------------------------- replay


class _Live:
    """Blocks allocated inside the trace and not yet given back, replayed event by event.

    A block is *active* from its ``alloc`` to its ``free_completed`` (the memory cannot be
    reused before); it stops counting as *allocated* at its ``free_requested`` (the tensor
    died, but the allocator may still wait for other streams that used it; the statistic
    behind ``torch.cuda.max_memory_allocated`` drops here already). Frees of addresses never
    seen allocated (blocks from before the trace started) are ignored.
    """

    def __init__(self):
        self.blocks: dict[int, dict] = {}  # addr -> its alloc event
        self.pending: set[int] = set()  # free requested, not completed
        self.active = 0
        self.allocated = 0

    def _drop(self, addr: int) -> None:
        size = self.blocks.pop(addr)["size"]
        self.active -= size
        if addr in self.pending:
            self.pending.discard(addr)
        else:
            self.allocated -= size

    def apply(self, event: dict) -> None:
        action, addr = event["action"], event.get("addr")
        if action == "alloc":
            if addr in self.blocks:  # not expected: an address handed out twice
                self._drop(addr)
            self.blocks[addr] = event
            self.active += event["size"]
            self.allocated += event["size"]
        elif action == "free_requested":
            if addr in self.blocks and addr not in self.pending:
                self.pending.add(addr)
                self.allocated -= self.blocks[addr]["size"]
        elif action == "free_completed" and addr in self.blocks:
            self._drop(addr)
        # segment_alloc / segment_free / segment_map / oom / snapshot: not block events


def _grouped(blocks, key, top: int | None) -> dict:
    groups: dict[str, list[int]] = {}
    for b in blocks:
        g = groups.setdefault(key(b), [0, 0, 0])
        g[0] += b["size"]
        g[1] += 1
        g[2] = max(g[2], b["size"])
    rows = sorted(groups.items(), key=lambda kv: (-kv[1][0], kv[0]))
    shown = rows if top is None else rows[:top]
    rest = rows[len(shown):]
    return {
        "groups": [{"key": k, "bytes": v[0], "count": v[1], "largest": v[2]} for k, v in shown],
        "rest": {"groups": len(rest), "bytes": sum(v[0] for _, v in rest), "count": sum(v[1] for _, v in rest)},
    }


def _baseline(snapshot: dict, device: int, traced: dict) -> tuple[int, int] | None:
    """Bytes and blocks of memory in use at the snapshot that the trace never saw allocated:
    allocated before recording started (or before the ring buffer wrapped), and so live at
    the peak too. None when the snapshot has no segments."""
    segments = snapshot.get("segments")
    if not segments:
        return None
    total = count = 0
    for seg in segments:
        if seg.get("device", device) != device:
            continue
        for b in seg.get("blocks", []):
            if str(b.get("state", "")).startswith("active") and b.get("address") not in traced:
                total += b.get("requested_size", b.get("size", 0))
                count += 1
    return total, count


def peak_breakdown(snapshot: dict, device: int = 0, top: int = 25) -> dict:
    """Replay ``snapshot["device_traces"][device]`` and describe the live blocks at the peak.

    Byte counts are the sizes the trace records (the sizes asked for, before the allocator
    rounds them up) and are relative to the start of the trace. ``sites`` keeps the ``top``
    largest groups, ``coarse`` and ``packages`` keep them all.
    """
    traces = snapshot.get("device_traces") or []
    trace = traces[device] if device < len(traces) else []

    # pass 1: where the peak is (no copies of the live set)
    state = _Live()
    peak, peak_index, peak_allocated = 0, None, 0
    for i, event in enumerate(trace):
        state.apply(event)
        if state.active > peak:
            peak, peak_index = state.active, i
        peak_allocated = max(peak_allocated, state.allocated)
    baseline = _baseline(snapshot, device, state.blocks)

    # pass 2: the live set at the peak
    at = _Live()
    if peak_index is not None:
        for event in islice(trace, peak_index + 1):
            at.apply(event)
    blocks = list(at.blocks.values())
    keys = {id(b): coarse_key(b.get("frames") or []) for b in blocks}
    top_event = trace[peak_index] if peak_index is not None else None
    return {
        "device": device,
        "events": len(trace),
        "peak_index": peak_index,
        "peak_bytes": peak,
        "peak_allocated_bytes": peak_allocated,
        "pending_free_bytes_at_peak": sum(at.blocks[a]["size"] for a in at.pending),
        "live_blocks_at_peak": len(blocks),
        "baseline_bytes": None if baseline is None else baseline[0],
        "baseline_blocks": None if baseline is None else baseline[1],
        "peak_alloc": None if top_event is None else {
            "size": top_event["size"],
            "stream": top_event.get("stream"),
            "frames": [frame_text(f) for f in top_event.get("frames") or []],
        },
        "sites": _grouped(blocks, lambda b: site_key(b.get("frames") or []), top),
        "coarse": _grouped(blocks, lambda b: keys[id(b)][0], None),
        "packages": _grouped(blocks, lambda b: keys[id(b)][1], None),
    }


# ---------------------------------------------------------------------- reports


def _gib(n) -> str:
    return "n/a" if n is None else f"{n / GiB:.2f}"


def _mib(n) -> str:
    return f"{n / MiB:.1f}"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|")


def _table(grouped: dict, title: str, limit: int | None = None) -> list[str]:
    rows = grouped["groups"] if limit is None else grouped["groups"][:limit]
    out = [f"### {title}", "", "| GiB | blocks | largest MiB | allocated by |", "|---:|---:|---:|---|"]
    out += [f"| {_gib(g['bytes'])} | {g['count']} | {_mib(g['largest'])} | {_cell(g['key'])} |" for g in rows]
    hidden = grouped["groups"][len(rows):]
    rest_bytes = grouped["rest"]["bytes"] + sum(g["bytes"] for g in hidden)
    rest_groups = grouped["rest"]["groups"] + len(hidden)
    if rest_groups:
        rest_count = grouped["rest"]["count"] + sum(g["count"] for g in hidden)
        out.append(f"| {_gib(rest_bytes)} | {rest_count} | | ({rest_groups} more) |")
    return out + [""]


def format_breakdown(b: dict, top: int = 25) -> str:
    """A short markdown report of :func:`peak_breakdown`'s result."""
    title = f"## Peak live CUDA memory, device {b['device']}"
    if b.get("tag"):
        title += f" ({b['tag']})"
    out = [title, ""]
    if b["peak_index"] is None:
        return "\n".join(out + [f"No allocation in the trace ({b['events']} events).", ""])
    out.append(f"- peak: **{_gib(b['peak_bytes'])} GiB** in {b['live_blocks_at_peak']} blocks, at event "
               f"{b['peak_index']} of {b['events']} (alloc to free_completed, relative to the trace start)")
    out.append(f"- of which freed but waiting on other streams: {_gib(b['pending_free_bytes_at_peak'])} GiB")
    out.append(f"- peak counting blocks only until free_requested: {_gib(b['peak_allocated_bytes'])} GiB")
    if b.get("baseline_bytes") is not None:
        out.append(f"- in use before the trace started and still at the end: {_gib(b['baseline_bytes'])} GiB "
                   f"({b['baseline_blocks']} blocks)")
    if b.get("max_memory_allocated") is not None:
        out.append(f"- torch.cuda.max_memory_allocated: {_gib(b['max_memory_allocated'])} GiB")
    alloc = b["peak_alloc"]
    out += ["", f"The allocation that reached the peak ({_mib(alloc['size'])} MiB), innermost frame first:", ""]
    out += [f"    {f}" for f in alloc["frames"][:20]]
    if len(alloc["frames"]) > 20:
        out.append(f"    ... {len(alloc['frames']) - 20} more")
    out.append("")
    out += _table(b["packages"], "By package")
    out += _table(b["coarse"], "By innermost qzero / transformers / deepspeed / FSDP frame", top)
    out += _table(b["sites"], "By innermost frame outside torch", top)
    return "\n".join(out)


def format_compare(a: dict, b: dict, name_a: str = "A", name_b: str = "B", top: int = 40) -> str:
    """Two breakdowns side by side: totals, packages, and coarse groups by size of the difference."""
    out = [f"## Peak memory: {name_a} vs {name_b}", "", f"| | {_cell(name_a)} GiB | {_cell(name_b)} GiB | difference |",
           "|---|---:|---:|---:|"]

    def row(label, x, y):
        d = None if x is None or y is None else x - y
        sign = "" if d is None else "+" if d >= 0 else "-"
        return f"| {_cell(label)} | {_gib(x)} | {_gib(y)} | {sign}{_gib(None if d is None else abs(d))} |"

    for label, field in (("peak (trace)", "peak_bytes"), ("peak until free_requested", "peak_allocated_bytes"),
                         ("max_memory_allocated", "max_memory_allocated"), ("before the trace", "baseline_bytes")):
        out.append(row(label, a.get(field), b.get(field)))
    coarse_title = "innermost qzero / transformers / deepspeed / FSDP frame"
    for title, field in (("package", "packages"), (coarse_title, "coarse")):
        xa = {g["key"]: g["bytes"] for g in a[field]["groups"]}
        xb = {g["key"]: g["bytes"] for g in b[field]["groups"]}
        keys = sorted(set(xa) | set(xb), key=lambda k: (-abs(xa.get(k, 0) - xb.get(k, 0)), k))
        out += ["", f"| {title} | {_cell(name_a)} GiB | {_cell(name_b)} GiB | difference |", "|---|---:|---:|---:|"]
        out += [row(k, xa.get(k, 0), xb.get(k, 0)) for k in keys[:top]]
        if len(keys) > top:
            out.append(f"| ({len(keys) - top} more, smaller differences) | | | |")
    return "\n".join(out) + "\n"


def _load(path: str) -> tuple[dict, str]:
    with open(path) as f:
        data = json.load(f)
    b = dict(data.get("breakdown", data))
    b.setdefault("max_memory_allocated", data.get("max_memory_allocated"))
    name = data.get("tag") or os.path.splitext(os.path.basename(path))[0]
    return b, name


# ---------------------------------------------------------------------- torchrun


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="qzero bench memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="print two results side by side")
    ap.add_argument("--backend", choices=BACKENDS, default="qzero")
    ap.add_argument("--engine", help=argparse.SUPPRESS)  # the flag's name in earlier releases: refused
    ap.add_argument("--quantized", action="store_true")
    ap.add_argument("--overlap", action="store_true")
    ap.add_argument("--preset", default="qwen3-1.7b")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--allgather-bucket-size", type=float, default=5e8, help="ZeroConfig.allgather_bucket_size")
    ap.add_argument("--reduce-bucket-size", type=float, default=5e7, help="ZeroConfig.reduce_bucket_size")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="one more ZeroConfig field (repeatable; VALUE as JSON where it parses, else a string)")
    ap.add_argument("--fake-world", type=int, default=0, metavar="N",
                    help="one process as rank 0 of N under torch's fake process group (one GPU; no traffic): "
                         "rank 0's allocations as at DP-N, values meaningless (qzero.app.benchmarks.fake_world)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default="memory-report")
    ap.add_argument("--tag", default=None)
    a = ap.parse_args(argv)
    if a.engine is not None:
        ap.error("--engine is now --backend (the training backend)")
    if a.compare:
        (x, nx), (y, ny) = _load(a.compare[0]), _load(a.compare[1])
        print(format_compare(x, y, nx, ny))
        return

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before any handle
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch
    import torch.distributed as dist

    from qzero.app.train import TrainSettings, train_worker, validate

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    if a.fake_world:
        from .fake_world import init_fake_world, launcher_environment

        init_fake_world(a.fake_world)
        os.environ.update(launcher_environment(a.fake_world))  # one rank of a launched world
    else:
        dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    tag = a.tag or a.backend + ("_int8" if a.quantized else "") + ("_ahead" if a.overlap else "")
    zero = {"allgather_bucket_size": int(a.allgather_bucket_size), "reduce_bucket_size": int(a.reduce_bucket_size),
            "zero_quantized_weights": a.quantized, "overlap_param_gather": a.overlap}
    for item in a.set:
        key, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--set expects KEY=VALUE, got {item!r}")
        try:
            zero[key] = json.loads(value)
        except json.JSONDecodeError:
            zero[key] = value
    if a.fake_world and a.backend == "qzero":
        zero.setdefault("check_finite", False)  # the other ranks' values are rank 0's: they may well blow up
    settings = TrainSettings(
        backend=a.backend, preset=a.preset, seq_len=a.seq_len, micro_batch=a.micro_batch, steps=a.steps,
        warmup=0, lr=1e-4, world_size=world, device="cuda", zero=zero,
    )
    validate(settings)
    max_entries = 2_000_000
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    result = train_worker(settings, None, show_progress=False)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    breakdown = peak_breakdown(snapshot, device=local, top=a.top)
    del snapshot
    breakdown["max_memory_allocated"] = torch.cuda.max_memory_allocated()
    breakdown["tag"] = tag
    if breakdown["events"] >= max_entries:
        print(f"rank {rank}: the trace filled its {max_entries} entries; its start was overwritten", flush=True)
    mine = {k: breakdown[k] for k in ("peak_bytes", "peak_allocated_bytes", "baseline_bytes", "max_memory_allocated")}
    ranks = [None] * world
    if a.fake_world:  # the fake group moves nothing: rank 0 is all there is
        ranks = [{"rank": rank, **mine}]
    else:
        dist.all_gather_object(ranks, {"rank": rank, **mine})
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
        text = format_breakdown(breakdown, a.top)
        text += "\n### Every rank\n\n| rank | peak (trace) GiB | max_memory_allocated GiB |\n|---:|---:|---:|\n"
        text += "".join(f"| {r['rank']} | {_gib(r['peak_bytes'])} | {_gib(r['max_memory_allocated'])} |\n"
                        for r in ranks)
        record = {
            "tag": tag,
            "settings": dataclasses.asdict(settings),
            "fake_world": a.fake_world or None,
            "max_memory_allocated": breakdown["max_memory_allocated"],
            "ranks": ranks,
            "losses": (result or {}).get("losses"),
            "breakdown": breakdown,
        }
        with open(os.path.join(a.out, f"memory_{tag}.md"), "w") as f:
            f.write(text)
        with open(os.path.join(a.out, f"memory_{tag}.json"), "w") as f:
            json.dump(record, f, indent=1)
        print(text, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
