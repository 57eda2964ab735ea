"""benchmarks/scripts/convergence.py: end to end on the CPU at tiny size, its table arithmetic, and the two
facts its design rests on (qzero quantizes at world size 1, with the groups of DP2)."""

import functools
import json
import math
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from _support import bench_scripts  # noqa: E402

SCRIPT = bench_scripts.path("convergence")


def load_script():
    return bench_scripts.load("convergence")


@pytest.mark.slow  # an end-to-end run of a benchmark script: python -m pytest -m slow
def test_end_to_end_on_the_cpu(tmp_path):
    out = tmp_path / "conv"
    steps = 6
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", HF_HUB_OFFLINE="1")
    res = subprocess.run(
        [sys.executable, SCRIPT, "--preset", "tiny", "--steps", str(steps), "--seq-len", "32", "--micro-batch", "2",
         "--arms", "bf16,int8-g64", "--device", "cpu", "--last", "4", "--smooth", "3", "--heldout", "0.05",
         "--eval-every", "3", "--eval-sequences", "4", "--lr-warmup", "3", "--out", str(out)],
        capture_output=True, text=True, timeout=180, env=env,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    # progress lines while running, the table printed last
    assert "bf16 " in res.stdout and f"/{steps}" in res.stdout and "lr 0.0003 (warmup 3 steps)" in res.stdout
    tail = res.stdout.strip().splitlines()
    assert tail[-4].startswith("| arm |") and tail[-1].startswith("| INT8 g64 |")

    study = json.loads((out / "convergence.json").read_text())
    assert study["complete"] and study["preset"] == "tiny" and study["params"] > 0
    assert study["world_size"] == 1 and "date" in study and study["environment"]["torch"] == torch.__version__
    assert set(study["arms"]) == {"bf16", "int8-g64"}
    for name, arm in study["arms"].items():
        assert len(arm["losses"]) == steps and all(math.isfinite(x) for x in arm["losses"])
        assert arm["exit_code"] == 0 and len(arm["grad_norms"]) == steps
        assert len(arm["step_seconds"]) == steps  # streamed while running (the progress lines)
    assert study["settings"]["bf16"]["zero"]["zero_quantized_weights"] is False
    q = study["settings"]["int8-g64"]["zero"]
    assert q["zero_quantized_weights"] is True and q["zero_quantized_weights_group_size"] == 64
    assert study["settings"]["bf16"]["world_size"] == 1
    assert study["lr_warmup"] == 3 and {st["lr_warmup"] for st in study["settings"].values()} == {3}
    # same seed and data: step 1 sees the same initial weights and batch in both arms
    assert study["arms"]["bf16"]["losses"][0] == study["arms"]["int8-g64"]["losses"][0]
    q = study["arms"]["int8-g64"]
    assert q["bytes_sent_per_step"] < 0.6 * q["plain_bytes_per_step"]
    assert study["arms"]["bf16"]["bytes_sent_per_step"] == study["arms"]["bf16"]["plain_bytes_per_step"]
    assert study["summary"]["reference"] == "bf16" and study["summary"]["window"] == [2, 6]
    for name, arm in study["arms"].items():  # measured after steps 3 and 6 on the held-out 5%
        assert [step for step, _ in arm["heldout_losses"]] == [3, 6]
        assert all(math.isfinite(loss) and loss > 0 for _, loss in arm["heldout_losses"])
        assert study["settings"][name]["heldout"] == 0.05 and study["settings"][name]["eval_sequences"] == 4
    assert study["heldout_summary"]["step"] == 6

    md = (out / "convergence.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| arm |") and len(rows) == 3
    assert rows[1].startswith("| bf16 (plain gather) |") and rows[2].startswith("| INT8 g64 |")
    assert "| held-out loss (final, after step 6) | Δ held-out vs bf16 % |" in rows[0]
    assert f"| {study['arms']['int8-g64']['heldout_losses'][-1][1]:.4f} |" in rows[2]
    assert "; held-out loss " in md
    assert "INT8 g64 vs bf16" in md and "standard-library" in md
    assert "(linear warmup over 3 steps, then constant, no weight decay)" in md
    assert (out / "convergence.png").read_bytes()[:4] == b"\x89PNG"

    # --render rewrites the Markdown and the plot from the JSON alone
    (out / "convergence.md").unlink()
    (out / "convergence.png").unlink()
    res = subprocess.run([sys.executable, SCRIPT, "--render", str(out / "convergence.json")],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (out / "convergence.md").read_text() == md
    assert (out / "convergence.png").read_bytes()[:4] == b"\x89PNG"
    assert res.stdout.strip().splitlines()[-1].startswith("| INT8 g64 |")


@pytest.mark.slow  # an end-to-end run of a benchmark script: python -m pytest -m slow
def test_dp2_with_quantized_gradients_on_the_cpu(tmp_path):
    """--world-size 2: every arm one DP2 job (gloo); the gq arm's gradients travel quantized (fewer bytes
    than plain), its gradient error against the exact reduction is measured and reported, and both arms
    train on the global batch split over the ranks (step 1: the same loss)."""
    conv = load_script()
    out = tmp_path / "conv2"
    steps = 5
    rc = conv.main(["--world-size", "2", "--preset", "tiny", "--steps", str(steps), "--seq-len", "32",
                    "--micro-batch", "4", "--arms", "bf16,int8-g64+gq-int8-g64", "--device", "cpu", "--last", "3",
                    "--smooth", "2", "--grad-error-every", "2", "--threads", "1", "--out", str(out)])
    assert rc == 0, (out / "arm_int8-g64+gq-int8-g64.log").read_text()[-3000:]
    study = json.loads((out / "convergence.json").read_text())
    assert study["complete"] and study["world_size"] == 2 and study["micro_batch"] == 4
    assert study["micro_batch_per_rank"] == 2
    settings = study["settings"]["int8-g64+gq-int8-g64"]
    assert settings["world_size"] == 2 and settings["micro_batch"] == 2
    assert settings["zero"]["zero_quantized_gradients"] is True
    assert settings["zero"]["zero_quantized_gradients_group_size"] == 64
    assert study["settings"]["bf16"]["zero"]["zero_quantized_gradients"] is False
    bf16, gq = study["arms"]["bf16"], study["arms"]["int8-g64+gq-int8-g64"]
    for arm in (bf16, gq):
        assert arm["exit_code"] == 0 and len(arm["losses"]) == steps and all(map(math.isfinite, arm["losses"]))
        assert arm["replicas_identical"] is True
    assert bf16["losses"][0] == pytest.approx(gq["losses"][0], abs=1e-6)  # same weights and batch at step 1
    assert bf16["grad_bytes_sent_per_step"] == bf16["grad_plain_bytes_per_step"] > 0
    assert 0 < gq["grad_bytes_sent_per_step"] < 0.6 * gq["grad_plain_bytes_per_step"]
    assert bf16["grad_error"] is None
    ge = gq["grad_error"]
    assert ge["steps"] == [1, 3, 5] and ge["every"] == 2  # 0-based 0, 2 and the last
    for err in ge["reduced_rel_err"] + ge["payload_rel_err"]:
        assert math.isfinite(err) and 0 < err < 0.1
    md = (out / "convergence.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| ")]
    assert rows[0].endswith("| gather bytes vs plain | grad bytes vs plain | grad rel. error |")
    mean = sum(ge["reduced_rel_err"]) / 3
    assert rows[2].startswith("| INT8 g64 + grad INT8 g64 |") and rows[2].endswith(f" {mean:.4f} |")
    assert rows[1].endswith("| 1.000 | 1.000 | — |")
    assert "INT8 g64 + grad INT8 g64 vs bf16:" in md and "DP2 run (2 sequences per rank)" in md
    # --from-arms rebuilds the same study from the DP2 records (they hold a rank's micro-batch)
    records = {name: json.loads((out / f"arm_{name}.json").read_text()) for name in study["arms"]}
    rebuilt = conv.study_from_records(records, conv.parse_arms("bf16,int8-g64+gq-int8-g64"), last=3, smooth_window=2)
    assert rebuilt["summary"] == study["summary"] and rebuilt["world_size"] == 2 and rebuilt["micro_batch"] == 4
    assert rebuilt["arms"]["int8-g64+gq-int8-g64"]["grad_error"] == ge
    records["int8-g64+gq-int8-g256"] = records.pop("int8-g64+gq-int8-g64")
    with pytest.raises(ValueError, match="group_size=64"):
        conv.study_from_records(records, conv.parse_arms("bf16,int8-g64+gq-int8-g256"))


def test_streamed_lines_of_a_stopped_arm(tmp_path):
    """An arm stopped by --time-limit writes no record: its losses, gradient errors and gradient
    bytes come from the lines rank 0 streamed."""
    import io
    import types

    conv = load_script()
    lines = (f"{conv.MARK} 1 5.5 0.01\n{conv.GRAD_MARK} 1 0.0035 0.0056 700 1300\nsome log line\n"
             f"{conv.MARK} 2 5.25 0.02\n{conv.GRAD_MARK} 2 None 0.005 702 1300\n")
    proc = types.SimpleNamespace(stdout=io.StringIO(lines), poll=lambda: -15)
    log = open(tmp_path / "log", "w")
    r = conv.Running(conv.parse_arm("int8-g64+gq-int8-g64"), [proc], log, "cpu", str(tmp_path / "none.json"))
    r.reader.join(timeout=10)
    r.drain()
    log.close()
    assert r.losses == [5.5, 5.25] and r.seconds == [0.01, 0.02] and r.poll() == -15
    assert (tmp_path / "log").read_text() == "some log line\n"
    rec = conv.streamed_record(r, 1)
    assert rec["grad_error"]["steps"] == [1, 2] and rec["grad_error"]["reduced_rel_err"] == [0.0035, None]
    assert rec["grad_error"]["payload_rel_err"] == [0.0056, 0.005]
    assert (rec["grad_bytes_sent_per_step"], rec["grad_plain_bytes_per_step"]) == (702, 1300)


def test_final_loss_table_on_synthetic_losses():
    conv = load_script()
    n = 300
    base = [3.0 - i / n for i in range(n)]
    losses = {
        "bf16": base,
        "int8-g64": [x * 1.004 for x in base],  # +0.4%
        "int4-g64": [x + 0.05 for x in base[:250]],  # stopped early: the arms are compared over 250 steps
    }
    s = conv.final_losses(losses, "bf16", last=100)
    assert s["steps_compared"] == 250 and s["window"] == [150, 250]
    ref = sum(base[150:250]) / 100
    assert s["arms"]["bf16"]["final_loss"] == pytest.approx(ref)
    assert s["arms"]["bf16"]["diff"] == 0 and s["arms"]["bf16"]["diff_pct"] == 0
    assert s["arms"]["int8-g64"]["diff"] == pytest.approx(0.004 * ref)
    assert s["arms"]["int8-g64"]["diff_pct"] == pytest.approx(0.4)
    assert s["arms"]["int4-g64"]["diff"] == pytest.approx(0.05)
    assert s["arms"]["int4-g64"]["diff_pct"] == pytest.approx(100 * 0.05 / ref)
    assert s["arms"]["int4-g64"]["diff_se"] == pytest.approx(0.0, abs=1e-12)  # a constant offset
    assert conv.verdict(s).startswith("INT8 g64 vs bf16: +0.40% — within the 0.5% target")

    arms = conv.parse_arms("bf16,int8-g64,int4-g64")
    table = conv.markdown_table(s, arms).splitlines()
    assert table[0].startswith("| arm | final loss (mean of steps 151–250) | Δ vs bf16 | Δ % |")
    assert table[2] == f"| bf16 (plain gather) | {ref:.4f} | — | — | — |"
    assert table[3].startswith(f"| INT8 g64 | {1.004 * ref:.4f} | +{0.004 * ref:.4f} | +0.40% |")
    assert table[4].startswith(f"| INT4 g64 | {ref + 0.05:.4f} | +0.0500 |")
    with_payload = conv.markdown_table(s, arms, {"bf16": 1.0, "int8-g64": 0.53}).splitlines()
    assert with_payload[0].endswith("| gather bytes vs plain |") and with_payload[1].count("---") == 6
    assert with_payload[2].endswith("| — | 1.000 |") and with_payload[3].endswith(" 0.530 |")
    assert with_payload[4].endswith(" — |")

    worse = conv.final_losses({"bf16": [2.0] * 10, "int8-g64": [2.02] * 10}, "bf16")
    assert worse["arms"]["int8-g64"]["diff_pct"] == pytest.approx(1.0)
    assert "OUTSIDE" in conv.verdict(worse)
    assert conv.smooth([1, 2, 3, 4, 5], 2) == [1, 1.5, 2.5, 3.5, 4.5]


def test_arm_names():
    conv = load_script()
    assert conv.parse_arm("bf16") == conv.Arm("bf16", quantized=False)
    assert conv.parse_arm("fp8-g64") == conv.Arm("fp8-g64", quantized=True, fmt="fp8", group_size=64)
    assert conv.parse_arm("int8-g8192").group_size == 8192
    assert [a.name for a in conv.parse_arms(conv.DEFAULT_ARMS)] == ["bf16", "int8-g64", "int8-g8192", "fp8-g64",
                                                                    "int4-g64"]
    for bad in ("int3-g64", "int8-g60", "int8", "bf16,bf16", ""):
        with pytest.raises(ValueError):
            conv.parse_arms(bad)
    rep = conv.parse_arm("bf16-rep2")  # a replicate: the same settings under its own name
    assert rep == conv.Arm("bf16-rep2", quantized=False) and rep.label == "bf16 (plain gather), replicate 2"
    assert conv.parse_arm("int4-delta-g256-rep3").zero_fields() == conv.parse_arm("int4-delta-g256").zero_fields()
    assert [a.name for a in conv.parse_arms("bf16,bf16-rep2")] == ["bf16", "bf16-rep2"]
    for bad in ("bf16-rep0", "bf16-rep", "bf16-rep2-rep3x", "bf16-rep2,bf16-rep2"):
        with pytest.raises(ValueError):
            conv.parse_arms(bad)
    gq = conv.parse_arm("int8-g64+gq-int8-g256")
    assert gq == conv.Arm("int8-g64+gq-int8-g256", quantized=True, fmt="int8", group_size=64, grad_quantized=True,
                          grad_fmt="int8", grad_group_size=256)
    assert gq.label == "INT8 g64 + grad INT8 g256"
    assert conv.parse_arm("bf16+gq-fp8-g64").zero_fields() == {
        "zero_quantized_weights": False, "zero_quantized_weights_format": "int8",
        "zero_quantized_weights_group_size": 64, "zero_quantized_gradients": True,
        "zero_quantized_gradients_format": "fp8", "zero_quantized_gradients_group_size": 64,
        "zero_quantized_gradients_rotation": "none", "zero_quantized_gradients_rotation_block": 32,
        "zero_quantized_gradients_error_feedback": False}
    int4 = conv.parse_arm("int8-g64+gq-int4-g64-h32-ef")
    assert (int4.grad_fmt, int4.grad_rotation, int4.grad_error_feedback) == ("int4", 32, True)
    assert int4.zero_fields()["zero_quantized_gradients_rotation"] == "hadamard"
    assert int4.label == "INT8 g64 + grad INT4 g64 H32 +EF"
    assert conv.parse_arm("int8-g64+gq-int4-g64-noh").zero_fields()["zero_quantized_gradients_rotation"] == "none"
    assert [a.name for a in conv.parse_arms(conv.DP_ARMS)] == ["bf16", "int8-g64", "int8-g64+gq-int8-g64",
                                                               "int8-g64+gq-int8-g256"]
    for bad, word in (("int8-g64+gq-int4-g64", "gq-int4-g64-h32"), ("int8-g64+gq-int4-g64-h128", "larger than"),
                      ("int8-g64+gq-int4-g64-ef-x", "'x'"), ("int8-g64+int8-g64", "int8-g64"),
                      ("int8-g64+gq-int8-g60", "int8-g60"), ("int8-g64+gq-int8", "int8")):
        with pytest.raises(ValueError, match=word):
            conv.parse_arms(bad)


def test_arguments_are_checked_before_any_work(capsys):
    """A gq arm at world size 1, a global batch the ranks cannot share, a bad arm, ranks sharing
    a GPU at world size 1 or on the CPU: refused by name."""
    conv = load_script()
    for argv, word in ((["--arms", "bf16,int8-g64+gq-int8-g64"], "use --world-size 2"),
                       (["--world-size", "2", "--micro-batch", "5"], "--micro-batch 5"),
                       (["--world-size", "0"], "--world-size must be at least 1"),
                       (["--world-size", "2", "--arms", "bf16,int8-g64+gq-int9-g64"], "int9"),
                       (["--share-gpu"], "needs --world-size 2"),
                       (["--world-size", "2", "--share-gpu", "--device", "cpu"], "--share-gpu is for CUDA"),
                       (["--lr-warmup", "-1"], "--lr-warmup must be from 0 to --steps (2000) steps, got -1"),
                       (["--steps", "10", "--lr-warmup", "11"], "--lr-warmup must be from 0 to --steps (10)")):
        with pytest.raises(SystemExit):
            conv.parse_args(argv)
        assert word in capsys.readouterr().err
    assert conv.parse_args(["--world-size", "2"]).arms == conv.DP_ARMS
    assert conv.parse_args([]).arms == conv.DEFAULT_ARMS
    assert conv.arm_slots(4, "cuda", [0, 1], world=2) == ["cuda:0,1"] * 4
    assert conv.arm_slots(3, "cuda", [0, 1, 2, 3], world=2) == ["cuda:0,1", "cuda:2,3", "cuda:0,1"]
    assert conv.arm_slots(5, "cuda", [0, 1]) == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]
    assert conv.parse_args(["--world-size", "2", "--share-gpu"]).share_gpu


@pytest.mark.parametrize("fmt,group", [("int8", 64), ("int8", 8192), ("fp8", 64), ("int4", 64)])
def test_world_size_1_quantizes_the_weights(fmt, group):
    """A ZeroOptimizer at world size 1 (no process group) runs the quantized gather on its own
    partition: after a step the weights are the dequantized bf16 masters (small parameters exact),
    not the plain bf16 rounding of the masters that quantized=false gives."""
    from _support.simulate import side_mask

    import qzero
    from qzero.quant.reference import dequantize, quantize
    from qzero.app.workload import build_model, model_config

    config = model_config("tiny")
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))

    def one_step(quantized):
        model = build_model(config, torch.bfloat16, torch.device("cpu"), 0)
        payload = dict(zero_quantized_weights_format=fmt, zero_quantized_weights_group_size=group) if quantized else {}
        cfg = qzero.ZeroConfig(zero_quantized_weights=quantized, small_param_numel=1024, **payload)
        opt = qzero.ZeroOptimizer(model, functools.partial(torch.optim.AdamW, lr=1e-3), config=cfg)
        assert opt.world_size == 1
        logits = model(input_ids=tokens[:, :-1]).logits.float()
        opt.backward(torch.nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1)))
        opt.step()
        opt.wait_for_weights()  # gather-ahead is on by default when quantized
        return opt

    plain, quant = one_step(False).groups[0], one_step(True).groups[0]

    def params(g, t):  # the parameters' elements: the layouts pad to different alignments (the group size)
        return torch.cat([t[s.start:s.stop] for s in g.layout.slots])

    # the same update; only the gathered weights differ
    assert torch.equal(params(plain, plain.master), params(quant, quant.master))
    masters = quant.master.to(torch.bfloat16)
    assert torch.equal(params(plain, plain.flat), params(quant, masters))
    # the small parameters, and the groups cheaper sent verbatim than coded ([Note: exact groups])
    exact = torch.from_numpy(side_mask(masters.numel(), 1, group, quant.layout.exact_ranges, fmt, 2)
                             ).nonzero().flatten()
    values, scales = quantize(masters, group, fmt, exact)
    expected = dequantize(values, scales, masters.numel(), group, fmt, torch.bfloat16)
    expected[exact] = masters[exact]
    assert torch.equal(quant.flat, expected)
    differ = (params(quant, quant.flat) != params(plain, plain.flat)).sum().item()
    assert differ > 0.5 * (masters.numel() - exact.numel())


@pytest.mark.parametrize("group", [64, 8192])
def test_quantization_groups_are_those_of_dp2(group):
    """Partitions hold whole groups, so groups start at multiples of the group size from flat
    index 0 at any world size. Group 64: every quantized parameter of qwen3-125m-byte starts at a
    multiple of 64 and holds a multiple of 64 elements, at world size 1 and at DP2 in either flat
    order, so its groups are its own aligned blocks everywhere. Group 8192: the world-1 layout
    puts every parameter where DP2's contiguous order does (the same groups); DP2's interleaved
    order does not (what the study's report says)."""
    from transformers import AutoModelForCausalLM

    from qzero.layout import plan_flat_layout
    from qzero.app.workload import PRESETS, model_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config("qwen3-125m-byte"))
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert sum(math.prod(s) for s in shapes) == 125_456_640

    def layout(world, order):
        return plan_flat_layout(shapes, world, elem_size=2, zero_quantized_weights_group_size=group,
                                small_param_numel=PRESETS["qwen3-125m-byte"].small_param_numel,
                                allgather_bucket_size=500_000_000, zero_quantized_weights_format="int8",
                                flat_order=order)

    layouts = {(w, o): layout(w, o) for w in (1, 2) for o in ("contiguous", "interleaved", "auto")}
    for lay in layouts.values():
        assert lay.gather.partition_numel % group == 0
        assert all(c.offset % group == 0 and c.numel % group == 0 for c in lay.gather.chunks)
    quantized = lambda lay: [(s.start, s.numel) for s in lay.slots if s.numel and not s.exact]  # noqa: E731
    if group == 64:
        for lay in layouts.values():
            assert all(start % group == 0 and n % group == 0 for start, n in quantized(lay))
    else:
        world1 = [(s.start, s.stop) for s in layouts[(1, "auto")].slots]
        assert world1 == [(s.start, s.stop) for s in layouts[(2, "contiguous")].slots]
        assert layouts[(1, "auto")].exact_ranges == layouts[(2, "contiguous")].exact_ranges
        starts = lambda lay: [start % group for start, _ in quantized(lay)]  # noqa: E731
        assert starts(layouts[(1, "auto")]) != starts(layouts[(2, "interleaved")])


def test_from_arms_rebuilds_the_study_from_per_arm_records(tmp_path):
    """--from-arms: a run whose convergence.json was lost is rebuilt from its arm_<name>.json records
    (the arms of --arms that have one; their GPUs from --arms' order and --gpus), with the same
    summary the run computes, the note in the JSON and the .md, and null where the records hold nothing."""
    import dataclasses

    conv = load_script()
    steps = 40
    run_args = conv.parse_args(["--steps", str(steps), "--micro-batch", "8"])
    base = [3.0 - i / steps for i in range(steps)]
    losses = {"bf16": base, "int8-g64": [x * 1.002 for x in base], "fp8-g64": [x * 0.99 for x in base]}
    src = tmp_path / "records"
    src.mkdir()
    for name, vals in losses.items():
        settings = dataclasses.asdict(dataclasses.replace(conv.arm_settings(conv.parse_arm(name), run_args),
                                                          device="cuda"))
        plain = 1000
        record = {"settings": settings, "world_size": 1, "losses": vals, "grad_norms": [1.0] * steps,
                  "step_times": [0.1, 0.3, 0.2], "peak_allocated_bytes": 5, "params": 125_456_640,
                  "bytes_sent_per_step": plain if name == "bf16" else 531, "plain_bytes_per_step": plain}
        (src / f"arm_{name}.json").write_text(json.dumps(record))
    out = tmp_path / "rebuilt"
    rc = conv.main(["--from-arms", str(src), "--gpus", "0,1", "--wall-s", "188", "--last", "10", "--smooth", "5",
                    "--env", "torch=2.11.0+cu130", "--env", "date=2026-11-30T14:08+00:00",
                    "--note", "INT8 g8192's record was lost", "--out", str(out)])  # default arms: 5, 2 missing
    assert rc == 0
    study = json.loads((out / "convergence.json").read_text())
    assert list(study["arms"]) == ["bf16", "int8-g64", "fp8-g64"]
    # the run's round-robin over GPUs 0,1 in --arms order (bf16 int8-g64 int8-g8192 fp8-g64 int4-g64)
    assert study["arm_devices"] == {"bf16": "cuda:0", "int8-g64": "cuda:1", "fp8-g64": "cuda:1"}
    assert study["rebuilt_from"]["missing_arms"] == ["int8-g8192", "int4-g64"]
    assert study["note"] == "INT8 g8192's record was lost" and study["wall_s"] == 188
    assert study["date"] == "2026-11-30T14:08+00:00" and study["environment"]["torch"] == "2.11.0+cu130"
    assert study["complete"] and study["steps"] == steps and study["micro_batch"] == 8 and study["clip"] == 1.0
    assert (study["params"] == 125_456_640
            and study["settings"]["fp8-g64"]["zero"]["zero_quantized_weights_format"] == "fp8")
    assert study["summary"] == json.loads(json.dumps(conv.final_losses(losses, "bf16", last=10)))
    assert study["target"]["verdict"].startswith("INT8 g64 vs bf16: +0.20% — within")
    for arm in study["arms"].values():
        assert arm["exit_code"] is None and arm["step_seconds"] is None and arm["median_step_s"] == 0.2
    md = (out / "convergence.md").read_text()
    assert "**Note:** INT8 g8192's record was lost" in md and "Wall time 188 s" in md
    assert "qzero not recorded" in md and "fp8-g64 cuda:1" in md
    rows = [line for line in md.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0] for r in rows[1:]] == ["| bf16 (plain gather)", "| INT8 g64", "| FP8 g64"]
    assert rows[1].endswith(" 1.000 |") and rows[2].endswith(" 0.531 |")
    assert (out / "convergence.png").read_bytes()[:4] == b"\x89PNG"
    # --render reproduces the .md from the rebuilt JSON
    (out / "convergence.md").unlink()
    assert conv.main(["--render", str(out / "convergence.json")]) == 0
    assert (out / "convergence.md").read_text() == md

    # records of different runs are refused; so is a record whose settings do not match its name
    other = json.loads((src / "arm_fp8-g64.json").read_text())
    other["settings"]["lr"] = 1e-3
    (src / "arm_fp8-g64.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="lr"):
        conv.main(["--from-arms", str(src), "--out", str(out)])
    other["settings"]["lr"] = 3e-4
    other["settings"]["zero"]["zero_quantized_weights_format"] = "int4"
    (src / "arm_fp8-g64.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="fmt=int4"):
        conv.main(["--from-arms", str(src), "--out", str(out)])
    assert conv.main(["--from-arms", str(tmp_path / "nothing"), "--out", str(out)]) == 1


def older_record(quantized: bool, fmt: str = "int8", steps: int = 2000) -> dict:
    """A per-arm record with its settings in the older flat form (ZeRO settings by short names,
    the rest under ``extra_config``), as earlier runs of ``benchmarks/scripts/convergence.py`` wrote them."""
    settings = {"engine": "qzero", "preset": "qwen3-125m-byte", "model_config": None, "data": None, "world_size": 1,
                "device": "cuda", "precision": "bf16", "stage": 2, "quantized": quantized, "overlap": False,
                "group_size": 64, "fmt": fmt, "small_param_numel": None, "allgather_bucket": 500000000,
                "reduce_bucket": 500000000, "reduce_dtype": None, "seq_len": 512, "micro_batch": 8, "grad_accum": 1,
                "steps": steps, "warmup": 10, "lr": 0.0003, "seed": 0, "deterministic": True,
                "extra_config": {"gradient_clipping": 1.0}}
    return {"settings": settings, "world_size": 1, "losses": [3.0 - i / steps for i in range(steps)],
            "grad_norms": [1.0] * steps, "step_times": [0.1, 0.2], "params": 125_456_640,
            "bytes_sent_per_step": 531 if quantized else 1000, "plain_bytes_per_step": 1000}


def test_from_arms_reads_older_records():
    """Records with settings in the older flat form are rebuilt into a study all the same, and a
    record whose format is not its arm's is refused."""
    conv = load_script()
    arms = "bf16,int8-g64,fp8-g64"
    records = {"bf16": older_record(False), "int8-g64": older_record(True), "fp8-g64": older_record(True, "fp8")}
    study = conv.study_from_records(records, conv.parse_arms(arms))
    assert list(study["arms"]) == arms.split(",")
    want = {"steps": 2000, "micro_batch": 8, "lr": 0.0003, "lr_warmup": 0, "clip": 1.0, "seq_len": 512,
            "preset": "qwen3-125m-byte"}
    assert {key: study[key] for key in want} == want
    broken = dict(records, **{"fp8-g64": older_record(True, "int4")})
    with pytest.raises(ValueError, match="fmt=int4"):
        conv.study_from_records(broken, conv.parse_arms(arms))


@pytest.mark.slow  # an end-to-end run of a benchmark script: python -m pytest -m slow
def test_delta_arms_and_their_replica_error_on_the_cpu(tmp_path):
    """A delta arm (``int4-delta-g64``) beside direct INT4 at world size 1: the arm runs with
    ``zero_quantized_weights_delta``, its replica error is measured (every 2 steps and the last),
    stays far below direct INT4's and is reported with its bytes per parameter and a plot; the
    0.25% target applies to it."""
    conv = load_script()
    assert conv.parse_arm("int4-delta-g256") == conv.Arm("int4-delta-g256", quantized=True, fmt="int4",
                                                         group_size=256, delta=True)
    assert conv.parse_arm("int4-delta-g256").label == "INT4 delta g256"
    assert conv.parse_arm("int8-delta-g64").zero_fields()["zero_quantized_weights_delta"] is True
    assert [a.name for a in conv.parse_arms(conv.DELTA_ARMS)][-2:] == ["int4-delta-g256", "int4-delta-g2048"]
    with pytest.raises(ValueError, match="fp8-delta-g64"):
        conv.parse_arm("fp8-delta-g64")
    out = tmp_path / "conv"
    steps = 5
    rc = conv.main(["--preset", "tiny", "--steps", str(steps), "--seq-len", "32", "--micro-batch", "2",
                    "--arms", "bf16,int4-g64,int4-delta-g64", "--device", "cpu", "--last", "3", "--smooth", "2",
                    "--replica-error-every", "2", "--threads", "1", "--out", str(out)])
    assert rc == 0, (out / "arm_int4-delta-g64.log").read_text()[-3000:]
    study = json.loads((out / "convergence.json").read_text())
    assert study["settings"]["int4-delta-g64"]["zero"]["zero_quantized_weights_delta"] is True
    direct, delta = study["arms"]["int4-g64"], study["arms"]["int4-delta-g64"]
    assert delta["replica_error"]["steps"] == [1, 3, 5] and direct["replica_error"]["steps"] == [1, 3, 5]
    assert delta["replica_error"]["rel_err"][0] == 0.0  # the first gather is an exact resync
    assert 0 < max(delta["replica_error"]["rel_err"]) < 0.1 * min(direct["replica_error"]["rel_err"])
    assert study["arms"]["bf16"]["replica_error"] is None  # not quantized: nothing to measure
    assert 0.5 < delta["weight_bytes_per_param"] < 2.0 and direct["weight_bytes_per_param"] < 0.8
    md = (out / "convergence.md").read_text()
    assert "INT4 delta g64 vs bf16:" in md and "the 0.25% target" in md and "Replica error" in md
    assert (out / "replica_error.png").read_bytes()[:4] == b"\x89PNG"


def test_heldout_losses_are_tabled_plotted_and_kept(tmp_path):
    """Records with held-out losses: the table gains the final held-out loss (after the last step every
    arm with one measured) and its Δ % from bf16 (— for an arm without one), the verdicts name the
    held-out Δ, convergence.json keeps every arm's curve, and the arms' settings carry the flags."""
    import dataclasses

    conv = load_script()
    steps = 40
    run_args = conv.parse_args(["--steps", str(steps), "--micro-batch", "8", "--heldout", "0.1", "--eval-every", "10",
                                "--eval-sequences", "7"])
    s = conv.arm_settings(conv.parse_arm("int8-g64"), run_args)
    assert (s.heldout, s.eval_every, s.eval_sequences) == (0.1, 10, 7)
    assert conv.arm_settings(conv.parse_arm("bf16"), conv.parse_args(["--heldout", "0"])).eval_every == 0
    base = [3.0 - i / steps for i in range(steps)]
    held = {"bf16": [[10, 3.2], [20, 3.0], [30, 2.9], [40, 2.8]],
            "int8-g64": [[10, 3.21], [20, 3.01], [30, 2.91], [40, 2.828]],  # +1.00% at step 40
            "fp8-g64": None}  # an older record: none
    src = tmp_path / "records"
    src.mkdir()
    for name in held:
        settings = dataclasses.asdict(dataclasses.replace(conv.arm_settings(conv.parse_arm(name), run_args),
                                                          device="cuda"))
        record = {"settings": settings, "world_size": 1, "losses": [x * (1.002 if name != "bf16" else 1) for x in base],
                  "grad_norms": [1.0] * steps, "step_times": [0.1], "params": 1000, "heldout_losses": held[name],
                  "bytes_sent_per_step": 1000 if name == "bf16" else 531, "plain_bytes_per_step": 1000}
        (src / f"arm_{name}.json").write_text(json.dumps(record))
    out = tmp_path / "out"
    assert conv.main(["--from-arms", str(src), "--arms", "bf16,int8-g64,fp8-g64", "--last", "10",
                      "--out", str(out)]) == 0
    study = json.loads((out / "convergence.json").read_text())
    assert (study["arms"]["int8-g64"]["heldout_losses"] == held["int8-g64"]
            and study["arms"]["fp8-g64"]["heldout_losses"] is None)
    assert study["heldout_summary"]["step"] == 40
    assert study["heldout_summary"]["arms"]["int8-g64"]["diff_pct"] == pytest.approx(1.0)
    md = (out / "convergence.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| ")]
    assert "| paired SE of Δ | held-out loss (final, after step 40) | Δ held-out vs bf16 % | gather bytes" in rows[0]
    assert rows[1].endswith("| — | 2.8000 | — | 1.000 |")
    assert rows[2].endswith("| 2.8280 | +1.00% | 0.531 |")
    assert rows[3].endswith("| — | — | 0.531 |")  # FP8: no held-out loss
    assert "INT8 g64 vs bf16: +0.20% — within the 0.5% target (mean of the last 10 steps); held-out loss +1.00% " \
           "(after step 40)." in md
    assert "FP8 g64 vs bf16: +0.20% — within the 0.5% target (mean of the last 10 steps)." in md
    assert "7 fixed windows of 513 tokens of the last 0.1 of the data" in md
    assert (out / "convergence.png").read_bytes()[:4] == b"\x89PNG"
    # an arm that measured fewer steps: the final is the last step all of them measured
    partial = {"a": {"heldout_losses": [[10, 1.0], [20, 0.9]]}, "b": {"heldout_losses": [[10, 1.1]]}}
    assert conv.final_heldout(partial, "a") == {"step": 10, "reference": "a", "arms": {
        "a": {"loss": 1.0, "diff_pct": 0.0}, "b": {"loss": 1.1, "diff_pct": pytest.approx(10.0)}}}
    assert conv.final_heldout({"a": {"heldout_losses": None}}, "a") is None


def test_committed_records_without_heldout_losses_still_render(tmp_path):
    """Two arms of a GPU world-1 study's records (from before the held-out loss; their per-step lists
    rounded to keep them small) rebuild and render: no held-out columns, no held-out verdicts."""
    conv = load_script()
    results = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "convergence_world1")
    arms = "bf16,int8-g64"
    assert all(os.path.exists(os.path.join(results, f"arm_{a}.json")) for a in arms.split(","))
    out = tmp_path / "out"
    assert conv.main(["--from-arms", results, "--arms", arms, "--out", str(out)]) == 0
    study = json.loads((out / "convergence.json").read_text())
    assert study["heldout_summary"] is None and all(a["heldout_losses"] is None for a in study["arms"].values())
    md = (out / "convergence.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| ")]
    assert len(rows) == 3 and "held-out" not in md.lower() and rows[0].endswith("| gather bytes vs plain |")
    assert (out / "convergence.png").read_bytes()[:4] == b"\x89PNG"


def test_the_shared_gpu_note_names_the_arms_world_size():
    conv = bench_scripts.load("convergence")
    assert "at world size 4," in conv.world_note(4, shared=True)
    assert ("at world size 2," in conv.world_note(2, shared=True)
            and "world size 2," not in conv.world_note(4, shared=True))
