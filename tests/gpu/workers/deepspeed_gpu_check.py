"""The DeepSpeed ZeRO-1/2 adapter on 2 GPUs (NCCL), or on CPU with gloo (``--cpu``).

    python3 -m torch.distributed.run --nproc_per_node=2 tests/gpu/workers/deepspeed_gpu_check.py [--out result.json]
    torchrun --nproc_per_node=2 tests/gpu/workers/deepspeed_gpu_check.py --cpu          # the same checks on CPU

The GPU counterpart of ``tests/test_deepspeed.py`` on a small Qwen3-shaped model built from
a ``transformers`` config (bf16; torch AdamW as the client optimizer, fused on GPU, so
DeepSpeed compiles nothing). For ZeRO stage 2 and stage 1:

(a) ``qzero.integrations.deepspeed.initialize`` with ``zero_quantized_weights: false`` is
    bitwise plain ``deepspeed.initialize``: losses, bf16 parameters and fp32 masters; nothing
    patched. A second plain run is the determinism control (if it differs from the first,
    bitwise comparisons on this machine mean nothing and the check says so).
(b) quantization on (INT8, group size 64) vs plain, by the project's accuracy gates
    (``qzero.app.qualify.run.Thresholds``): max |loss difference| <= max_loss_diff
    (0.05), and every trained parameter element within ``|on - plain| <= atol + rtol *
    |plain|`` (0.02 each; the formula of ``qzero.app.qualify.stats.param_agreement``, applied to
    all elements, not only a sample). Relative L2 (all parameters end to end, the worst single
    parameter, and ``param_agreement`` on ``qzero qualify``'s 4096-element sample) is reported,
    not gated. Further: replicas bitwise equal across the ranks; each rank's own partition holds the
    small parameters exactly and the rest dequantized (the gather really was replaced);
    ``engine.qzero_gather`` ran once per step and sent about half the bytes of DeepSpeed's
    bf16 gather (checked against DeepSpeed's own flat-group sizes), in several chunks.
(c) timing: median step time and median post-step gather time (DeepSpeed's
    ``all_gather_dp_groups`` call inside its optimizer step, device-synchronised), plain vs
    quantized. Reported, not checked.

(d) ``--gradients`` (stage 2): one more arm, INT8 weights and the quantized ZeRO-2 gradient
    reduction (``zero_quantized_gradients``, INT8 g64), by the same gates against plain; its
    replicas bitwise equal; the reduction installed and every bucket reduced by it (none left
    to DeepSpeed's own method); its bytes against DeepSpeed's bucket all-reduce, reported.

``--offload cpu|cpu_pinned`` runs every arm with DeepSpeed's CPU optimizer offload
(DeepSpeedCPUAdam); ``--overlap`` runs the int8 arms with gather-ahead.

Prints PASS/FAIL per check and a table; ``--out`` writes the result as JSON. Exits non-zero
on any FAIL.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

# The on-vs-off accuracy gates are the project's: qzero.app.qualify.run.Thresholds.
PART_TOL = 0.02  # own partition vs its bf16 master, quantized elements
RATIO_RANGE = (0.4, 0.6)  # INT8 + one fp32 scale per 64: 0.53 of bf16, plus exact small params


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="gloo on CPU (a tiny model) instead of NCCL on GPUs")
    p.add_argument("--out", default=None, help="write the JSON result here (default: stdout only)")
    p.add_argument("--stages", default="2,1", help="ZeRO stages to check (default 2,1)")
    p.add_argument("--steps", type=int, default=None, help="steps compared (default 8 GPU, 4 CPU)")
    p.add_argument("--timing-steps", type=int, default=None,
                   help="further steps timed on the plain and quantized engines (default 30 GPU, 4 CPU)")
    p.add_argument("--warmup", type=int, default=None, help="first steps left out of the timing (default 3 GPU, 1 CPU)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default 512 GPU, 64 CPU)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 4 GPU, 2 CPU)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 256 GPU, 32 CPU)")
    p.add_argument("--micro", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--attention", choices=("eager", "sdpa"), default="eager",
                   help="attention implementation (default eager: its backward is deterministic, so the "
                        "bitwise checks hold at long sequences, where cuDNN's fused attention backward is not)")
    p.add_argument("--bucket", type=int, default=None,
                   help="allgather_bucket_size, elements across all ranks (default 2**22 GPU, 8192 CPU)")
    p.add_argument("--offload", choices=("none", "cpu", "cpu_pinned"), default="none",
                   help="every arm with DeepSpeed's CPU optimizer offload "
                        "(DeepSpeedCPUAdam; cpu_pinned: pinned buffers)")
    p.add_argument("--overlap", action="store_true",
                   help="the int8 arm with gather-ahead (overlap_param_gather): its 'post-step gather ms' is then "
                        "only the launch; the gather runs under the next forward and shows in the step time")
    p.add_argument("--gradients", action="store_true",
                   help="stage 2: also an arm with zero_quantized_gradients (INT8 g64) beside the INT8 weights")
    p.add_argument("--no-deterministic", action="store_true",
                   help="GPU: leave torch.use_deterministic_algorithms off")
    a = p.parse_args(argv)
    gpu = not a.cpu
    defaults = dict(steps=(8, 4), timing_steps=(30, 4), warmup=(3, 1), hidden=(512, 64), layers=(4, 2),
                    seq=(256, 32), bucket=(2**22, 8192))
    for k, (g, c) in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, g if gpu else c)
    a.stages = [int(s) for s in a.stages.split(",") if s.strip()]
    return a


# --------------------------------------------------------------------------- setup


def setup(args):
    if args.cpu:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("LOCAL_WORLD_SIZE", "2"))))
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    else:
        if not args.no_deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        device = torch.device("cuda", local)
        if not args.no_deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
            torch.utils.deterministic.fill_uninitialized_memory = False  # no NaN-fill of every empty(): timing
            warnings.filterwarnings("once", message=".*deterministic.*")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return device


def model_config(args):
    from transformers import Qwen3Config

    heads = max(2, args.hidden // 64) if not args.cpu else 4
    return Qwen3Config(
        vocab_size=256,  # byte tokens, as qzero.app.workload
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=args.hidden // heads,
        max_position_embeddings=max(args.seq, 64),
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )


def small_param_numel(args):
    """The exact-parameter threshold: qzero's default on GPU; lowered for the tiny CPU model
    (as its ``tiny`` preset does) so that its matrices are quantized as an LLM's would be."""
    return 65_536 if not args.cpu else 1024


def ds_config(args, stage, quant=None, gradients=False):
    zero = {"stage": stage, "allgather_bucket_size": args.bucket, "reduce_bucket_size": 2**20}
    if gradients:
        zero.update(zero_quantized_gradients=True, zero_quantized_gradients_format="int8",
                    zero_quantized_gradients_group_size=64)
    if stage == 2:
        zero.update(overlap_comm=True, round_robin_gradients=True, contiguous_gradients=True)
    if quant is not None:
        zero.update(zero_quantized_weights=quant, zero_quantized_weights_group_size=64,
                    small_param_numel=small_param_numel(args))
        if quant and args.overlap:
            zero["overlap_param_gather"] = True
    if args.offload != "none":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": args.offload == "cpu_pinned"}
    return {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
    }


def param_groups(model):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def build(args, device, init, config):
    from qzero.app.workload import build_model

    model = build_model(model_config(args), torch.bfloat16, device, seed=0, attention=args.attention)
    if args.offload != "none":  # DeepSpeed's bf16 offload runs its own CPU Adam
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam(param_groups(model), lr=1e-3, betas=(0.9, 0.95), adamw_mode=True)
    else:
        kind = dict(foreach=True) if args.cpu else dict(fused=True)
        opt = torch.optim.AdamW(param_groups(model), lr=1e-3, betas=(0.9, 0.95), **kind)
    engine, _, _, _ = init(model=model, optimizer=opt, config=config, dist_init_required=False)
    return engine


# --------------------------------------------------------------------------- timing


class GatherTimer:
    """Times DeepSpeed's post-step ``all_gather_dp_groups`` call (whatever stands there:
    DeepSpeed's own function or qzero's dispatcher). Installed only around training loops,
    never while an engine is being created, enabled or disabled."""

    def __init__(self, sync):
        self.sync = sync
        self.times: list[float] = []

    def __enter__(self):
        from deepspeed.runtime.zero import stage_1_and_2 as s12

        self.module, self.inner = s12, s12.all_gather_dp_groups

        def timed(*a, **k):
            self.sync()
            t = time.perf_counter()
            r = self.inner(*a, **k)
            self.sync()
            self.times.append(time.perf_counter() - t)
            return r

        s12.all_gather_dp_groups = timed
        return self

    def __exit__(self, *exc):
        self.module.all_gather_dp_groups = self.inner


def train(engine, args, device, corpus, steps, start=0):
    """``steps`` steps from step ``start``; per-step losses (device tensors), step and gather times."""
    from qzero.app.workload import global_batch

    rank, world = dist.get_rank(), dist.get_world_size()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    losses, step_times, opt_times = [], [], []
    with GatherTimer(sync) as timer:
        for step in range(start, start + steps):
            tokens = global_batch(corpus, step, world * args.micro, args.seq, 0).view(world, args.micro, -1)[rank]
            tokens = tokens.to(device)
            sync()
            t0 = time.perf_counter()
            logits = engine(input_ids=tokens[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            engine.backward(loss)
            sync()
            t1 = time.perf_counter()
            engine.step()
            sync()
            t2 = time.perf_counter()
            losses.append(loss.detach().float())
            step_times.append(t2 - t0)
            opt_times.append(t2 - t1)
    return torch.stack(losses).cpu(), step_times, opt_times, timer.times


# --------------------------------------------------------------------------- snapshots


def own_partition_facts(opt, rank, world, small):
    """Per flat group: this rank's partition vs its fp32 master cast to bf16, split into the
    small (exact) parameters and the rest (as tests/test_deepspeed.py's ``layout_facts``)."""
    facts = []
    for i, flat in enumerate(opt.bit16_groups_flat):
        p = flat.numel() // world
        own = flat[rank * p:(rank + 1) * p]
        master = opt.single_partition_of_fp32_groups[i].detach().to(device=flat.device, dtype=flat.dtype)
        exact = torch.zeros(p, dtype=torch.bool, device=flat.device)
        straddle = False
        for off, meta in zip(opt.round_robin_bit16_offsets[i], opt.round_robin_bit16_meta[i]):
            a, b = int(off), int(off) + meta.numel()
            straddle |= any(a < k * p < b for k in range(1, world))
            lo, hi = max(a, rank * p), min(b, (rank + 1) * p)
            if meta.numel() <= small and lo < hi:
                exact[lo - rank * p:hi - rank * p] = True
        rest = ~exact
        err = (own[rest].float() - master[rest].float()).abs().max().item() if rest.any() else 0.0
        facts.append(dict(
            exact_equal=bool(torch.equal(own[exact], master[exact])),
            rest_equal=bool(torch.equal(own[rest], master[rest])),
            rest_max_err=err,
            straddle=straddle,
            numel=flat.numel(),
        ))
    return facts


def snapshot(engine, rank, world, small):
    from qzero.integrations import deepspeed as qds

    opt = engine.optimizer
    gather = getattr(engine, "qzero_gather", None)
    if gather is not None:
        gather.wait_for_weights()  # gather-ahead: the last step's gather may still be running
    flats = [f.detach().clone() for f in opt.bit16_groups_flat]
    # replicas: every rank's full flat groups, compared bitwise (as integers: NaN-proof)
    same = True
    for f in flats:
        copies = [torch.empty_like(f) for _ in range(world)]
        dist.all_gather(copies, f)
        same &= all(torch.equal(c.view(torch.int16), f.view(torch.int16)) for c in copies)
    elem = opt.bit16_groups_flat[0].element_size()
    return dict(
        params={n: p.detach().clone() for n, p in engine.module.named_parameters()},
        masters=[m.detach().clone() for m in opt.single_partition_of_fp32_groups],
        flats=flats,
        replicas_equal=same,
        facts=own_partition_facts(opt, rank, world, small),
        patched=qds.is_patched(),
        # what DeepSpeed's own gather sends per rank per step: its partition of every flat group
        ds_plain_bytes=sum(f.numel() // world * elem for f in opt.bit16_groups_flat),
        calls=None if gather is None else gather.calls,
        bytes_sent=None if gather is None else gather.bytes_sent,
        plain_bytes=None if gather is None else gather.plain_bytes,
        stats=None if gather is None else [tuple(s) for s in gather.last_stats],
    )


def same_bits(a, b):
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype in (torch.bfloat16, torch.float16):
        return torch.equal(a.view(torch.int16), b.view(torch.int16))
    if a.dtype == torch.float32:
        return torch.equal(a.view(torch.int32), b.view(torch.int32))
    return torch.equal(a, b)


def bitwise_equal(x, y):
    """Losses, bf16 parameters and fp32 masters of two runs, bit for bit."""
    return (same_bits(x["losses"], y["losses"])
            and all(same_bits(x["params"][n], y["params"][n]) for n in x["params"])
            and all(same_bits(a, b) for a, b in zip(x["masters"], y["masters"])))


def weight_agreement(on, plain, atol, rtol):
    """Quantized vs plain parameters (name -> tensor) by ``qzero.app.qualify.stats.param_agreement``'s
    rule, ``|on - plain| <= atol + rtol * |plain|`` (NaN counts as a violation), on every element
    of every trained parameter. Also: relative L2 and max abs difference of all parameters laid
    end to end, the worst single parameter's relative L2, and ``param_agreement`` itself on the
    sample ``qzero qualify`` takes (``qzero.app.train.sample_index``). Information except the count."""
    from qzero.app.qualify.stats import param_agreement
    from qzero.app.train import sample_index

    viol, elems, max_abs, sq_diff, sq_ref = 0, 0, 0.0, 0.0, 0.0
    rels, viol_by = {}, {}
    for n, ref in plain.items():
        ref = ref.float()
        d = on[n].float() - ref
        bad = int((~(d.abs() <= atol + rtol * ref.abs())).sum().item())
        if bad:
            viol_by[n] = bad
        viol += bad
        elems += ref.numel()
        max_abs = max(max_abs, d.abs().max().item())
        dn, rn = d.norm().item(), ref.norm().item()
        sq_diff, sq_ref = sq_diff + dn * dn, sq_ref + rn * rn
        rels[n] = dn / max(rn, 1e-12)
    worst = max(rels, key=rels.get)
    index = sample_index(elems)

    def sample(params):
        out, offset = [], 0
        for t in params.values():
            mine = index[(index >= offset) & (index < offset + t.numel())] - offset
            out.append(t.reshape(-1)[mine.to(t.device)].float().cpu())
            offset += t.numel()
        return torch.cat(out).tolist()

    qualify_sample = param_agreement(sample({n: on[n] for n in plain}), sample(plain), atol, rtol)
    return dict(
        atol=atol, rtol=rtol, elements=elems, tolerance_violations=viol,
        violations_by_param=dict(sorted(viol_by.items(), key=lambda kv: -kv[1])[:5]),
        param_max_abs_diff=max_abs, param_rel_l2=(sq_diff ** 0.5) / max(sq_ref ** 0.5, 1e-12),
        worst_param_rel_l2=[worst, rels[worst]],
        qualify_sample=dict(size=int(index.numel()), **qualify_sample),
    )


def free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def median_ms(xs, warmup):
    xs = xs[warmup:] if len(xs) > warmup else xs
    return 1e3 * statistics.median(xs) if xs else float("nan")


# --------------------------------------------------------------------------- main


def main(argv=None):
    args = parse_args(argv)
    device = setup(args)
    import deepspeed

    from qzero.integrations import deepspeed as qds
    from qzero.app.qualify.run import Thresholds
    from qzero.app.workload import load_corpus

    rank, world = dist.get_rank(), dist.get_world_size()
    small = small_param_numel(args)
    gates = Thresholds()  # max_loss_diff, atol, rtol
    corpus = load_corpus()
    checks, table, stages_out = [], [], {}

    def check(name, ok, detail=""):
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # every rank must pass; every rank agrees
        ok = bool(flag.item())
        checks.append(dict(name=name, ok=ok, detail=detail))
        if rank == 0:
            print(f"{'PASS' if ok else 'FAIL'}  {name}" + (f"  [{detail}]" if detail else ""), flush=True)
        return ok

    if rank == 0:
        dev = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
        print(f"deepspeed {deepspeed.__version__}  torch {torch.__version__}  world {world}  device {dev}  "
              f"backend {dist.get_backend()}", flush=True)

    for stage in args.stages:
        S = f"stage {stage}"
        runs = {}
        timing = {}
        arms = [("plain", deepspeed.initialize, ds_config(args, stage)),
                ("plain_repeat", deepspeed.initialize, ds_config(args, stage)),
                ("off", qds.initialize, ds_config(args, stage, quant=False)),
                ("on", qds.initialize, ds_config(args, stage, quant=True))]
        if args.gradients and stage == 2:
            arms.append(("qgrad", qds.initialize, ds_config(args, stage, quant=True, gradients=True)))
        for name, init, cfg in arms:
            engine = build(args, device, init, cfg)
            losses, st, ot, gt = train(engine, args, device, corpus, args.steps)
            runs[name] = dict(losses=losses, **snapshot(engine, rank, world, small))
            runs[name]["has_gather"] = hasattr(engine, "qzero_gather")
            reduction = getattr(engine.optimizer, "qzero_gradient_reduction", None)
            runs[name]["reduction"] = None if reduction is None else dict(
                calls=dict(reduction.calls), bytes_sent=reduction.bytes_sent, plain_bytes=reduction.plain_bytes)
            if name in ("plain", "on") and args.timing_steps > 0:
                _, st2, ot2, gt2 = train(engine, args, device, corpus, args.timing_steps, start=args.steps)
                st, ot, gt = st + st2, ot + ot2, gt + gt2
            timing[name] = dict(step_ms=median_ms(st, args.warmup), opt_step_ms=median_ms(ot, args.warmup),
                                gather_ms=median_ms(gt, args.warmup), samples=max(0, len(st) - args.warmup))
            if name in ("on", "qgrad"):
                qds.disable(engine)
            del engine
            free()
        plain, rep, off, on = runs["plain"], runs["plain_repeat"], runs["off"], runs["on"]
        n_params = sum(p.numel() for p in plain["params"].values())

        # (a) off == plain, bit for bit; nothing patched
        deterministic = bitwise_equal(plain, rep)
        check(f"{S}: plain DeepSpeed run twice is bitwise identical (determinism control)", deterministic)
        check(f"{S}: zero_quantized_weights=false is bitwise plain DeepSpeed (losses, bf16 params, fp32 masters)",
              bitwise_equal(plain, off),
              "" if deterministic else "the control failed too: this machine is not deterministic")
        check(f"{S}: zero_quantized_weights=false patches nothing", not off["patched"] and not off["has_gather"])
        check(f"{S}: replicas bit-identical across ranks (plain, off)",
              plain["replicas_equal"] and off["replicas_equal"])

        # (b) quantization on
        dloss = (on["losses"] - plain["losses"]).abs().max().item()
        check(f"{S}: int8 max |loss difference| vs plain <= {gates.max_loss_diff} (gate)",
              dloss <= gates.max_loss_diff, f"max |dloss| {dloss:.5f} over {len(on['losses'])} steps")
        agree = weight_agreement(on["params"], plain["params"], gates.atol, gates.rtol)
        worst, worst_rel = agree["worst_param_rel_l2"]
        qs = agree["qualify_sample"]
        check(f"{S}: int8 parameters vs plain, every element within atol = {gates.atol}, rtol = {gates.rtol} "
              f"(gate)", agree["tolerance_violations"] == 0,
              f"{agree['tolerance_violations']} violations of {agree['elements']:,} elements"
              + (f" {agree['violations_by_param']}" if agree["tolerance_violations"] else "")
              + f"; max abs diff {agree['param_max_abs_diff']:.2e}; information: relative L2 "
              f"{agree['param_rel_l2']:.2e} (worst {worst} {worst_rel:.2e}; qualify sample of {qs['size']}: "
              f"{qs['param_rel_l2']:.2e}, {qs['tolerance_violations']} violations)")
        check(f"{S}: int8 replicas bit-identical across ranks", on["replicas_equal"])
        check(f"{S}: int8 gather replaced DeepSpeed's: patched, one call per step",
              on["patched"] and on["has_gather"] and on["calls"] == args.steps, f"calls {on['calls']}")
        facts = on["facts"]
        check(f"{S}: own partition: small params exact, the rest dequantized within {PART_TOL}",
              all(f["exact_equal"] for f in facts) and not all(f["rest_equal"] for f in facts)
              and all(f["rest_max_err"] < PART_TOL for f in facts),
              f"max err {max(f['rest_max_err'] for f in facts):.4f}")
        ds_plain = plain["ds_plain_bytes"]
        per_step = on["bytes_sent"] / max(1, on["calls"])
        ratio = per_step / ds_plain
        check(f"{S}: qzero's plain_bytes counter equals DeepSpeed's bf16 gather",
              on["plain_bytes"] == on["calls"] * ds_plain, f"{on['plain_bytes'] // max(1, on['calls'])} vs {ds_plain}")
        check(f"{S}: int8 bytes sent about half of DeepSpeed's ({RATIO_RANGE[0]} < ratio < {RATIO_RANGE[1]})",
              RATIO_RANGE[0] < ratio < RATIO_RANGE[1], f"{per_step:.0f} / {ds_plain} B per rank per step = {ratio:.3f}")
        stats = on["stats"]
        check(f"{S}: several chunks, each within allgather_bucket_size",
              max(s[0] for s in stats) > 1 and all(s[3] <= args.bucket for s in stats),
              f"chunks per group {[s[0] for s in stats]}")

        qgrad = runs.get("qgrad")
        if qgrad is not None:  # (d) the quantized gradient reduction
            dloss_g = (qgrad["losses"] - plain["losses"]).abs().max().item()
            check(f"{S}: int8 weights + int8 gradients max |loss difference| vs plain <= {gates.max_loss_diff} (gate)",
                  dloss_g <= gates.max_loss_diff, f"max |dloss| {dloss_g:.5f} over {len(qgrad['losses'])} steps")
            agree_g = weight_agreement(qgrad["params"], plain["params"], gates.atol, gates.rtol)
            check(f"{S}: int8 weights + int8 gradients, every element within atol = {gates.atol}, rtol = {gates.rtol} "
                  f"(gate)", agree_g["tolerance_violations"] == 0,
                  f"{agree_g['tolerance_violations']} violations of {agree_g['elements']:,} elements; relative L2 "
                  f"{agree_g['param_rel_l2']:.2e}")
            check(f"{S}: int8 gradients: replicas bit-identical across ranks", qgrad["replicas_equal"])
            red = qgrad["reduction"] or {"calls": {"quantized": 0, "plain": 0}, "bytes_sent": 0, "plain_bytes": 0}
            check(f"{S}: int8 gradients: the reduction is installed and reduced every bucket",
                  red["calls"]["quantized"] > 0 and red["calls"]["plain"] == 0, f"calls {red['calls']}")
            grad_ratio = red["bytes_sent"] / max(1, red["plain_bytes"])
            check(f"{S}: int8 gradients send less than half of DeepSpeed's bucket all-reduce",
                  0 < grad_ratio < 0.5, f"{red['bytes_sent']} / {red['plain_bytes']} B = {grad_ratio:.3f}")
        stages_out[stage] = dict(
            params=n_params,
            flat_numels=[f["numel"] for f in facts],
            losses={k: [float(x) for x in runs[k]["losses"]] for k in runs},
            max_loss_diff_int8=dloss,
            worst_param_rel_l2=[worst, worst_rel],
            param_agreement_int8=agree,
            bytes_per_rank_per_step=dict(deepspeed_bf16=ds_plain, qzero_int8=per_step, ratio=ratio),
            chunks=[s[0] for s in stats],
            timing_ms=timing,
            gradients=None if qgrad is None else dict(
                max_loss_diff=dloss_g, param_rel_l2=agree_g["param_rel_l2"], reduction=qgrad["reduction"]),
        )
        for k, name in (("plain", "deepspeed"), ("on", "qzero int8")):
            t = timing[k]
            table.append((stage, name, float(runs[k]["losses"][-1]), ds_plain if k == "plain" else per_step,
                          t["step_ms"], t["opt_step_ms"], t["gather_ms"]))
        runs.clear()
        free()

    failed = [c["name"] for c in checks if not c["ok"]]
    if rank == 0:
        print("\nstage  arm          final loss  bytes/rank/step  step ms  opt.step ms  post-step gather ms")
        for stage, name, loss, b, s, o, g in table:
            print(f"{stage:>5}  {name:<11}  {loss:>10.4f}  {b:>15,.0f}  {s:>7.2f}  {o:>11.2f}  {g:>19.3f}")
        for stage, d in stages_out.items():
            tp, tq = d["timing_ms"]["plain"], d["timing_ms"]["on"]
            print(f"stage {stage}: {d['params']:,} params; "
                  f"int8/bf16 bytes {d['bytes_per_rank_per_step']['ratio']:.3f}; "
                  f"gather {tq['gather_ms'] / tp['gather_ms']:.2f}x, step {tq['step_ms'] / tp['step_ms']:.2f}x "
                  f"of plain DeepSpeed (medians of {tp['samples']} steps)")
        print(f"\n{'ALL PASS' if not failed else 'FAILED: ' + '; '.join(failed)}", flush=True)
        result = dict(
            ok=not failed,
            checks=checks,
            stages={str(k): v for k, v in stages_out.items()},
            setup=dict(
                device=(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
                backend=dist.get_backend(), world=world, deepspeed=deepspeed.__version__, torch=torch.__version__,
                python=platform.python_version(), hidden=args.hidden, layers=args.layers, seq=args.seq,
                micro=args.micro, steps=args.steps, offload=args.offload, overlap=args.overlap,
                timing_steps=args.timing_steps, warmup=args.warmup,
                allgather_bucket_size=args.bucket, group_size=64, small_param_numel=small,
                deterministic=(not args.cpu and not args.no_deterministic),
                gates=dict(max_loss_diff=gates.max_loss_diff, atol=gates.atol, rtol=gates.rtol,
                           source="qzero.app.qualify.run.Thresholds"),
            ),
        )
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
            print(f"wrote {args.out}")
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
