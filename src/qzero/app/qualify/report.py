"""Write a qualification: report.json, report.md and PNG plots; and its one-line verdict."""

from __future__ import annotations

import json
import os


GPU_HINT = (
    "to measure where the link costs time, run on GPUs, e.g. qzero qualify --device cuda --world-size 2 "
    "--preset qwen3-1.7b --seq-len 2048 --micro-batch 2 (PCIe-class: NCCL_P2P_DISABLE=1; "
    "Ethernet-class: also NCCL_SHM_DISABLE=1)"
)


def verdict(r: dict) -> str:
    """One line: the speed finding (or why there is none), the bytes on the wire, the gates."""
    lo, hi = r["speedup_ci95"]
    speed = f"candidate {r['speedup']:.3f}x the baseline's speed (95% CI {lo:.3f}-{hi:.3f}{_ci_scope(r)})"
    noise = r.get("noise") or {}
    noisy = (f"TOO NOISY TO DECIDE: arms of one setting differ by {noise['within_setting']:.0%}, more than "
             f"the {noise['between_settings']:.0%} between the settings; ") if noise.get("too_noisy") else ""
    if r.get("device") == "cpu":
        speed = ("NOTHING TO SAVE ON CPU LOOPBACK: the link costs next to nothing here, so step times show "
                 "compute and noise only; " + noisy + speed)
    elif noisy:
        speed = noisy + speed
    elif lo > 1:
        speed = "FASTER: " + speed
    elif hi < 1:
        speed = "SLOWER: " + speed
    else:
        speed = "NO CLEAR DIFFERENCE: " + speed
    wire = (r.get("bytes_sent_per_step") or {}).get("ratio")
    if wire is not None and wire != 1:
        speed += f"; bytes on the wire per rank per step {wire:.2f}x the baseline's ({wire - 1:+.0%})"
    if r.get("device") == "cpu":  # bytes are what a CPU run can speak for: what they would cost on a cluster
        from .projection import projection

        projected = projection(r)
        speed += f"; {projected}" if projected else ""
    failed = [k for k, ok in r["gates"].items() if not ok]
    gates = "all gates pass" if not failed else "GATES FAILED: " + ", ".join(failed)
    return f"{speed}; {gates}"


def _ci_scope(r: dict) -> str:
    """What the interval spans, in two words (:func:`qzero.app.qualify.stats.interval_covers`)."""
    roles = [a["role"] for a in r.get("arms", [])]
    if not roles:
        return ""
    return " over arms and steps" if min(roles.count("baseline"), roles.count("candidate")) >= 2 else " over steps"


def _mib(n: int) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n} B"


def markdown(r: dict, plotted: bool = True) -> str:
    env, scope = r["environment"], r["scope"]
    lo, hi = r["speedup_ci95"]
    diff = ", ".join(f"`{k}`: {b} → {c}" for k, (b, c) in r["differing_settings"].items()) or "(none)"
    lines = [
        "# qzero qualify report",
        "",
        f"**Verdict:** {verdict(r)}",
        "",
        "## Scope",
        "",
        f"- model: {scope['model']} ({scope['params']:,} trainable parameters), {scope['precision']}, "
        f"ZeRO stage {scope['stage']}",
        f"- world size {scope['world_size']}, sequence {scope['seq_len']}, micro-batch {scope['micro_batch']} per rank",
        f"- {scope['steps']} steps per arm, the first {scope['warmup']} excluded from timing; arm order "
        f"`{r['order']}`, each arm a fresh process, same seed and data",
        f"- arms differ in: {diff}",
        f"- device: {env.get('device')} · link: {env['link_regime']} · "
        f"process group {env.get('process_group_backend', env.get('backend'))}",
        "",
        "## Speed",
        "",
        f"Speedup (median baseline step / median candidate step): **{r['speedup']:.3f}×**, "
        f"95% bootstrap interval {lo:.3f}–{hi:.3f}; medians {1e3 * r['baseline_median_s']:.1f} ms (baseline) and "
        f"{1e3 * r['candidate_median_s']:.1f} ms (candidate). The interval covers "
        f"{r.get('speedup_ci95_covers', 'step-to-step noise (steps of all arms resampled together)')}.",
        "",
        *_noise_lines(r),
        "| arm | role | median step | final loss | peak allocated | peak reserved | weights gathered/rank/step "
        "| gradients sent/rank/step | bits/parameter/step, weights + gradients | skipped |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for a in r["arms"]:
        lines.append(
            f"| {a['arm']} | {a['role']} | {1e3 * a['median_step_s']:.1f} ms | {a['losses'][-1]:.4f} | "
            f"{_mib(a['peak_allocated_bytes'])} | {_mib(a['peak_reserved_bytes'])} | "
            f"{_mib(a['bytes_sent_per_step'])} of {_mib(a['plain_bytes_per_step'])} plain | {_grad_bytes(a)} | "
            f"{_bits_per_param(r, a)} | {a['skipped_steps']} |"
        )
    t = r["thresholds"]
    per_param = [f"{a['arm']} {a['weight_bytes_per_param']:.3f}" for a in r["arms"]
                 if a.get("weight_bytes_per_param") is not None]
    if per_param:
        lines += ["", "Weight gather, bytes on the wire per parameter per step (mean over the measured steps): "
                  + ", ".join(per_param) + "."]
    lines += [
        "",
        "Bits per parameter: what a rank sends per element it sends (its partition's weights in the "
        "gather; the gradient elements other ranks own in the reduction), scales and the exact small "
        "parameters included; a plain bf16 collective is 16.",
        "",
        f"Memory figures are the {r['memory_kind']}. Each step is timed from its start to the next "
        "step's start on the compute stream, with no synchronisation between steps (the warm-up "
        "steps and the last step are not timed), so a weight gather that runs ahead into the next "
        "forward is counted where it costs, as in training.",
        "",
        "## Gates",
        "",
        "| gate | result | measured |",
        "|---|---|---|",
        f"| baseline arms reproduce each other exactly | {_ok(r['gates']['baseline_reproducible'])} | "
        "losses, grad norms, sampled weights |",
        f"| candidate arms reproduce each other exactly | {_ok(r['gates']['candidate_reproducible'])} | "
        "losses, grad norms, sampled weights |",
        f"| max \\|loss difference\\| ≤ {t['max_loss_diff']} | {_ok(r['gates']['max_loss_diff'])} | "
        f"{r['max_loss_diff']:.5f} |",
        f"| sampled weights within atol={t['atol']}, rtol={t['rtol']} | {_ok(r['gates']['param_tolerance'])} | "
        f"{r['tolerance_violations']} violations; relative L2 {r['param_rel_l2']:.2e}, "
        f"max abs {r['param_max_abs_diff']:.2e} |",
        f"| replicas bit-identical in every arm | {_ok(r['gates']['replicas_identical'])} | "
        "hash of every rank's flat buffers |",
        f"| peak allocated ≤ {t['max_allocated_fraction']:.0%} of device memory | "
        f"{_ok(r['gates']['peak_allocated_fraction'])} | |",
        f"| peak reserved ≤ {t['max_reserved_fraction']:.0%} of device memory | "
        f"{_ok(r['gates']['peak_reserved_fraction'])} | |",
        f"| candidate peak within {t['memory_vs_baseline']:.0%} of baseline | "
        f"{_ok(r['gates']['memory_vs_baseline'])} | "
        f"{'CPU: plus ' + _mib(t['cpu_memory_slack_bytes']) + ' RSS noise' if 'CPU' in r['memory_kind'] else ''} |",
        "",
        "## Plots",
        "",
        *(["![bytes per rank per step](bytes.png)", "", "![loss curves](loss.png)", "",
           "![step times](step_times.png)"] if plotted else
          ["Skipped: matplotlib is not installed (`pip install 'qzero[cli]'` adds it); the figures are in "
           "`report.json`."]),
        "",
        "## Environment",
        "",
    ]
    lines += [f"- {k}: `{v}`" for k, v in env.items()]
    lines += [
        "",
        "What this does not establish: behaviour beyond these steps, other models, world sizes or links.",
        "",
    ]
    return "\n".join(lines)


def _grad_bytes(a: dict) -> str:
    sent, plain = a.get("grad_bytes_sent_per_step"), a.get("grad_plain_bytes_per_step")
    if sent is None or plain is None:
        return "n/a"  # an arm recorded before gradient bytes were counted
    return f"{_mib(sent)} of {_mib(plain)} plain"


_ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def _bits_per_param(r: dict, a: dict) -> str:
    """``weights + gradients`` bits per element sent, from the bytes sent against the plain
    collectives' (which send every element in the model dtype, or the reduce dtype)."""
    from ..train import flat_settings

    settings = flat_settings(r["settings"])
    which = 0 if a["role"] == "baseline" else 1
    settings.update({k: v[which] for k, v in r.get("differing_settings", {}).items()})
    weight = _ELEMENT_BYTES.get(settings.get("precision"), 2)
    grad = _ELEMENT_BYTES.get(settings.get("reduce_dtype") or settings.get("precision"), 2)

    def bits(sent, plain, size):
        return "n/a" if not sent or not plain else f"{8 * size * sent / plain:.2f}"

    return (f"{bits(a['bytes_sent_per_step'], a['plain_bytes_per_step'], weight)} + "
            f"{bits(a.get('grad_bytes_sent_per_step'), a.get('grad_plain_bytes_per_step'), grad)}")


def _noise_lines(r: dict) -> list[str]:
    noise, lines = r.get("noise") or {}, []
    if r.get("device") == "cpu":
        wire = r.get("bytes_sent_per_step") or {}
        lines += [
            "**On a CPU there is nothing to save.** The ranks talk over loopback, where moving a byte costs "
            "next to nothing, so the step times above measure compute and noise, not the link. What carries "
            "over to real links is the traffic: each rank sends "
            + (f"**{wire['ratio']:.2f}×** the baseline's bytes per step ({wire['ratio'] - 1:+.0%}; "
               f"{_mib(wire['candidate'])} against {_mib(wire['baseline'])})" if wire.get("ratio") else
               "the bytes in the table below")
            + ". The saving pays where the link costs time: GPUs over PCIe or Ethernet. " + GPU_HINT[0].upper()
            + GPU_HINT[1:] + ".",
            "",
        ]
    if noise.get("within_setting") is not None:
        lines += [
            f"Arms of one setting differ by up to {noise['within_setting']:.1%} in median step time; the two "
            f"settings by {noise['between_settings']:.1%}."
            + (" **The run is too noisy to decide**: repeat it (`--repeats`), with more steps, on a quieter "
               "machine." if noise["too_noisy"] else ""),
            "",
        ]
    return lines


def _ok(flag: bool) -> str:
    return "pass" if flag else "**FAIL**"


#: One marker per arm, so that arms whose curves coincide (arms of one setting do, exactly)
#: still show each of them.
MARKERS = "osD^v<>ph*"


def plots(r: dict, out_dir: str) -> list[str]:
    """bytes.png, loss.png and step_times.png in ``out_dir``; their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name, figure in (("bytes.png", bytes_figure), ("loss.png", loss_figure), ("step_times.png", step_figure)):
        fig = figure(r, plt)
        paths.append(os.path.join(out_dir, name))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def _arm_style(r: dict, i: int, n_points: int) -> dict:
    """Line style of arm ``i``: solid for the baseline, dashed for the candidate; its own
    marker, placed at steps staggered from the other arms', and a line thinner than the
    arms' before it, so that coinciding curves each stay visible."""
    arms = r["arms"]
    every = max(1, n_points // 8)
    return dict(linestyle="-" if arms[i]["role"] == "baseline" else "--", marker=MARKERS[i % len(MARKERS)],
                markevery=(i * every // len(arms) % every, every), linewidth=max(0.8, 2.6 - 0.6 * i),
                markersize=max(3.0, 7.0 - i), alpha=0.85)


def _same_as(r: dict, i: int, key: str) -> str:
    """`` = B1`` when arm ``i``'s ``key`` curve equals an earlier arm's, else empty."""
    for earlier in r["arms"][:i]:
        if earlier[key] == r["arms"][i][key]:
            return f" = {earlier['arm']}"
    return ""


def loss_figure(r: dict, plt):
    """Loss per arm, and each arm's difference from the first baseline arm with the gate's
    limits (``±max_loss_diff``) drawn."""
    fig, (ax, dx) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    base = next(a for a in r["arms"] if a["role"] == "baseline")
    gate = r["thresholds"]["max_loss_diff"]
    for i, a in enumerate(r["arms"]):
        steps = range(1, len(a["losses"]) + 1)
        style = _arm_style(r, i, len(a["losses"]))
        ax.plot(steps, a["losses"], label=f"{a['arm']} ({a['role']}){_same_as(r, i, 'losses')}", **style)
        dx.plot(steps, [x - y for x, y in zip(a["losses"], base["losses"])], **style)
    ax.set_ylabel("training loss")
    ax.set_title(f"loss per arm; max |difference| {r['max_loss_diff']:.4f} (gate: at most {gate})")
    ax.legend()
    dx.axhline(0.0, color="grey", lw=0.5)
    for sign in (1, -1):
        dx.axhline(sign * gate, color="tab:red", linestyle=":", lw=1.2, label=f"gate ±{gate}" if sign > 0 else None)
    dx.legend(loc="upper left")
    dx.set_xlabel("step")
    dx.set_ylabel(f"loss - {base['arm']}")
    fig.tight_layout()
    return fig


def step_figure(r: dict, plt):
    """Measured step times per arm (box: quartiles, line: median)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    data = [[1e3 * t for t in a["step_times"]] for a in r["arms"]]
    ax.boxplot(data, showfliers=True)
    ax.set_xticks(range(1, len(data) + 1), [f"{a['arm']}\n{a['role']}" for a in r["arms"]])
    ax.set_ylabel("step time (ms)")
    ax.set_title("measured step times per arm (warm-up and last step excluded)")
    fig.tight_layout()
    return fig


def bytes_figure(r: dict, plt):
    """Bytes each rank sends per step, by arm: the weight gather (and what the plain gather
    would send) and the gradient reduction. The one figure a CPU run carries over to GPUs."""
    arms = r["arms"]
    bars = [("weights gathered", "bytes_sent_per_step"), ("weights, plain gather", "plain_bytes_per_step"),
            ("gradients sent", "grad_bytes_sent_per_step")]
    bars = [(label, key) for label, key in bars if all(a.get(key) is not None for a in arms)]
    top = max((a[key] for a in arms for _, key in bars), default=1) or 1
    unit, size = next(((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if top >= s), ("B", 1))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(bars))
    for j, (label, key) in enumerate(bars):
        xs = [i + (j - (len(bars) - 1) / 2) * width for i in range(len(arms))]
        ax.bar(xs, [a[key] / size for a in arms], width, label=label, hatch=["", "//", ".."][j])
    ax.set_xticks(range(len(arms)), [f"{a['arm']}\n{a['role']}" for a in arms])
    ax.set_ylabel(f"{unit} per rank per step")
    ax.set_title("bytes each rank sends per step, by arm")
    ax.set_ylim(0, 1.3 * top / size)  # room for the legend above the bars
    ax.legend(loc="upper center", ncol=len(bars))
    fig.tight_layout()
    return fig


def write(r: dict, out_dir: str) -> bool:
    """Write report.json, the plots and report.md; return whether the plots were drawn (they are
    skipped, and the report says so, when matplotlib is not installed)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(r, f, indent=1)
    try:
        plots(r, out_dir)
        plotted = True
    except ImportError:
        plotted = False
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(markdown(r, plotted))
    return plotted
