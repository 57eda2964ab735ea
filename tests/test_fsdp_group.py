"""qzero.fsdp.quantize_group_gathers: FSDP2's all-gather of each parameter group through
qzero's gather engine, on gloo ranks, against plain FSDP2 and the reference quantizer.

The weights every rank computes with (captured by forward pre-hooks) are checked bit for
bit against the reference quantizer applied, independently of the engine, to what plain
FSDP2 gathers: each rank's padded shards of a group's parameters back to back in the
compute dtype, quantized in groups of 64 from the start of that input, small parameters
exact. World sizes 2 and 3 (with unevenly sharded, padded parameters), bf16 and fp32
compute, both reshard modes.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from qzero.quant import reference
from test_fsdp import GS, SMALL, _snapshot, batch, build, shard

#: Each FSDP module's parameters in FSDP2's order (the module's own, registration order).
GROUPS = {
    "up": ["up.weight", "up.bias"],
    "mid": ["mid.weight", "mid.bias"],
    "odd": ["odd.weight", "odd.bias"],
    "": ["embed.weight", "norm.weight", "norm.bias", "out.weight"],
}


def expected_group(weights: dict, names: list, world: int, dtype) -> dict:
    """What every rank must compute with when ``names`` (a group) are gathered by
    quantize_group_gathers, from the weights plain FSDP2 gathers (``weights``)."""
    rows = {n: -(-weights[n].shape[0] // world) for n in names}
    out_parts = {n: [] for n in names}
    for r in range(world):
        pieces, exact = [], []
        offset = 0
        for n in names:
            w = weights[n].to(dtype)
            padded = torch.zeros((rows[n], *w.shape[1:]), dtype=dtype)
            mine = w[r * rows[n] : (r + 1) * rows[n]]
            padded[: mine.shape[0]] = mine
            flat = padded.reshape(-1)
            if w.numel() <= SMALL:
                exact.append(torch.arange(offset, offset + flat.numel()))
            pieces.append(flat)
            offset += flat.numel()
        x = torch.cat(pieces)
        idx = torch.cat(exact) if exact else None
        values, scales = reference.quantize(x, GS, "int8", idx)
        y = reference.dequantize(values, scales, x.numel(), GS, "int8", dtype)
        if idx is not None:
            y[idx] = x[idx]
        offset = 0
        for n, flat in zip(names, pieces):
            seg = y[offset : offset + flat.numel()].view(rows[n], *weights[n].shape[1:])
            out_parts[n].append(seg[: max(0, min(rows[n], weights[n].shape[0] - r * rows[n]))])
            offset += flat.numel()
    return {n: torch.cat(out_parts[n]) for n in names}


def group_worker(rank, world, reshard, dtype, steps):
    from qzero.fsdp import quantize_group_gathers

    out = {}
    for mode in ("plain", "group"):
        model = shard(build(), world, False, reshard, dtype)
        report = quantize_group_gathers(model, group_size=GS, small_param_numel=SMALL) if mode == "group" else None
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        seen = {}
        for name, m in model.named_children():
            m.register_forward_pre_hook(lambda mod, args, name=name: seen.update(
                {f"{name}.{k}": p.detach().clone() for k, p in mod.named_parameters(recurse=False)}))
        losses, first = [], None
        for step in range(steps):
            seen.clear()
            loss = model(batch(step, rank)).float().pow(2).mean()
            if step == 0:
                first = dict(seen)
            loss.backward()
            opt.step()
            opt.zero_grad()
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses.append(t.item() / world)
        calls = {}
        if mode == "group":
            for name, m in model.named_modules():
                if hasattr(m, "_get_fsdp_state"):
                    calls[name] = dict(m._get_fsdp_state()._fsdp_param_group._all_gather_comm.calls)
        out[mode] = dict(losses=losses, seen=first, report=report, calls=calls)
    return out


@pytest.mark.parametrize(
    "world,reshard,dtype",
    [(2, True, torch.bfloat16), (2, False, torch.float32), (3, False, torch.bfloat16), (3, True, torch.float32)],
    ids=["w2-reshard-bf16", "w2-keep-fp32", "w3-keep-bf16", "w3-reshard-fp32"],
)
def test_group_gather_against_reference_and_plain(world, reshard, dtype):
    steps = 3
    results = run_distributed(group_worker, world, reshard, dtype, steps)
    r0 = results[0]
    report = r0["group"]["report"]
    assert set(report.quantized) == set(GROUPS) and not report.plain
    assert report.exact_params == 5  # the biases of up, mid, odd and the norm's two
    assert report.bytes_sent < 0.7 * report.plain_bytes
    plain_seen = r0["plain"]["seen"]
    want = {}
    for names in GROUPS.values():
        want.update(expected_group(plain_seen, names, world, dtype))
    for name, w in want.items():
        small = plain_seen[name].numel() <= SMALL
        for rank, res in enumerate(results):
            got = res["group"]["seen"][name]
            assert got.dtype == dtype and torch.equal(got, w), (name, rank)
            assert torch.equal(res["plain"]["seen"][name], plain_seen[name])
        if small:
            assert torch.equal(w, plain_seen[name]), name
        else:
            assert not torch.equal(w, plain_seen[name]), name
    for calls in (res["group"]["calls"] for res in results):
        for name, c in calls.items():
            assert c == {"quantized": steps * (2 if reshard else 1), "plain": 0}, (name, c)
    plain, group = r0["plain"]["losses"], r0["group"]["losses"]
    assert plain != group
    for a, b in zip(plain, group):
        assert abs(a - b) <= 0.02 * abs(a), (plain, group)
