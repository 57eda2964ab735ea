"""Where a measured step's exposed communication goes over an emulated link: its compute phases
against the link's transfers (``benchmarks/scripts/emulated_matrix.py --timeline``), and a Gantt chart of one
step per (link, arm).

[Note: step timeline]
Vocabulary (the link, its transfers and holds: ``benchmarks/scripts/emulated_link.py``'s note):

* **stamps**: four per step, on the compute stream: the step's start, the forward's end (after
  the loss of the last micro-batch is computed, before its backward), the backward's end
  (before the optimizer's step) and the step's end (after ``zero_grad``). On CUDA each is a
  one-warp kernel writing the GPU's global timer (``link_kernels.DeviceStamps``, the clock of
  the link's device log), read once after the measured steps; on the CPU the link's host clock.
  Each stamp also notes the link's transfer count (the index the next transfer gets).
* **phases**: ``forward`` (start to forward's end), ``backward`` (to the backward's end) and
  ``step`` (to the step's end). With gradient accumulation the forward phase holds every
  micro-batch but the last one whole (forward and backward) and the last one's forward.
* **a step's transfers**: those issued between its start and end stamps (``issued`` names the
  phase, by transfer index), and those issued earlier that are still on the link inside the
  step (``issued: "earlier"``: a gather issued ahead by the previous step, say).
* **busy** (per phase, per collective): the time of the transfers' intervals clipped to the
  phase; **idle**: the phase's time with no transfer on the link.
* **tail** (per collective): link busy inside the step phase of transfers issued before the
  backward's end (the reduce-scatter of the last buckets, say: what the optimizer waits for);
  **after**: link busy after the step's end of transfers the step issued (into the next step).

* **host lead** (CUDA only, per stamp): how long after the host enqueued the stamp the GPU
  reached it (the GPU's timer against the host's clock, their offset taken by one stamp on an
  idle GPU after the measured steps; within its launch latency, some microseconds). Near 0: the
  GPU was waiting for the host there (the host bound the step); large: the host ran that far
  ahead (the GPU bound it).

Times are milliseconds from the step's start stamp; every figure is of an emulated link.

    python3 benchmarks/scripts/emulated_timeline.py OUT [--step K] [--out DIR]

draws, for each ``OUT/CELL/LINK/matrix.json`` and arm with a timeline (or a JSON list of run
records), one measured step (default: the one of median length) as ``timeline_ARM.png``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

PHASES = ("forward", "backward", "step")
#: The names of the stamps, in order.
POINTS = ("start", "forward_end", "backward_end", "step_end")
#: The stamps of a step, in order (``PHASES[k]`` runs from stamp ``k`` to stamp ``k + 1``).
START, FORWARD_END, BACKWARD_END, STEP_END = range(4)


# ---------------------------------------------------------------------- recording (inside the arm)


class StepStamps:
    """The stamps of ``steps`` steps on ``link`` (a ``emulated_link.Link``), and the transfers
    issued from its making on, kept as the link books them (``Link.transfers`` keeps only its
    newest; any that left it before being kept are counted in :attr:`missing`)."""

    def __init__(self, link, device, steps: int):
        self.link, self.cuda, self.steps = link, device.type == "cuda", steps
        self.counts = [[None] * 4 for _ in range(steps)]
        self.host = [[None] * 4 for _ in range(steps)]
        self.enqueued = [[None] * 4 for _ in range(steps)]  # CUDA: host ns when each stamp was enqueued
        self.kept: list = []
        self.missing = 0
        self._seen = link.count
        self._dev = None
        if self.cuda:
            from link_kernels import DeviceStamps

            self._dev = DeviceStamps(device, 4 * steps + 1)  # the last slot: the clocks' offset

    def mark(self, step: int, point: int) -> None:
        """Stamp ``point`` (:data:`START` ... :data:`STEP_END`) of ``step``."""
        self._keep()
        self.counts[step][point] = self.link.count
        if self._dev is not None:
            self.enqueued[step][point] = time.perf_counter_ns()
            self._dev.stamp(4 * step + point)
        else:
            self.host[step][point] = self.link.clock()

    def _keep(self) -> None:
        new = self.link.count - self._seen
        have = min(new, len(self.link.transfers))
        self.kept += list(itertools.islice(reversed(self.link.transfers), have))[::-1]
        self.missing += new - have
        self._seen = self.link.count

    def _host_lead(self, raw: list[int]) -> list[list[float]]:
        """Per step and stamp, ms from the host's enqueue to the GPU's reaching it (see the
        note): the clocks' offset from one more stamp enqueued on the now idle GPU."""
        cal = 4 * self.steps
        before = time.perf_counter_ns()
        self._dev.stamp(cal)
        offset = self._dev.read()[cal] - before
        return [[(raw[4 * k + p] - self.enqueued[k][p] - offset) * 1e-6 for p in range(4)] for k in range(self.steps)]

    def record(self, first: int) -> dict:
        """The timeline of steps ``first`` on (after the final synchronization): per step its
        phases, transfers and :func:`analyse_step`, and the medians (:func:`medians`)."""
        self._keep()
        if self.cuda:
            raw = self._dev.read()
            base = raw[0]  # integer nanoseconds from one origin first: no float rounding of the timer's 1e18
            stamps = [[(raw[4 * k + p] - base) * 1e-6 for p in range(4)] for k in range(self.steps)]  # ns -> ms
            lead = self._host_lead(raw)
            log = {i: ((a - base) * 1e-6, (b - base) * 1e-6) for i, a, b in self.link.device_log()}
            held = self.link.holds
        else:
            stamps = [[x * 1e3 for x in row] for row in self.host]  # s -> ms
            log, held, lead = {}, True, None
        spans, no_times = [], 0
        for t in self.kept:
            if self.cuda:
                span = log.get(t.index)
                if span is None and held and t.steps:
                    no_times += 1  # held, but its entry left the device log
            else:
                span = (t.start * 1e3, t.end * 1e3) if t.start is not None else None
            spans.append(span)
        steps = []
        for k in range(first, self.steps):
            c, s = self.counts[k], stamps[k]
            t0 = s[START]
            transfers = []
            for t, span in zip(self.kept, spans):
                if c[START] <= t.index < c[STEP_END]:
                    issued = PHASES[next(p for p in range(3) if t.index < c[p + 1])]
                elif t.index < c[START] and span is not None and span[1] > t0 and span[0] < s[STEP_END]:
                    issued = "earlier"
                else:
                    continue
                transfers.append({"index": t.index, "op": t.op, "sent": t.sent, "received": t.received,
                                  "issued": issued, "start_ms": None if span is None else span[0] - t0,
                                  "end_ms": None if span is None else span[1] - t0})
            phases = {name: (s[p] - t0, s[p + 1] - t0) for p, name in enumerate(PHASES)}
            steps.append({"step": k, "phases": {n: list(v) for n, v in phases.items()}, "transfers": transfers,
                          **analyse_step(phases, transfers),
                          **({"host_lead_ms": dict(zip(POINTS, lead[k]))} if lead is not None else {})})
        out = {"clock": "GPU global timer" if self.cuda else "host clock", "steps": steps,
               "median": medians(steps), "missing_transfers": self.missing, "missing_times": no_times}
        if self.missing or no_times:
            out["note"] = (f"{self.missing} transfer(s) left the link's record and {no_times} the device log before "
                           "they were read: the busy and idle times leave them out")
        return out


# ---------------------------------------------------------------------- the analysis (pure)


def _union(spans: list[tuple[float, float]]) -> float:
    """The length of the union of ``spans``."""
    total, end = 0.0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def _clipped(transfers, lo: float, hi: float, keep=lambda t: True) -> tuple[dict[str, float], list]:
    """Per collective, the time of ``transfers`` (those ``keep`` takes) inside ``[lo, hi]``; and
    the clipped spans."""
    busy, spans = {}, []
    for t in transfers:
        if t.get("start_ms") is None or not keep(t):
            continue
        a, b = max(t["start_ms"], lo), min(t["end_ms"], hi)
        if b > a:
            busy[t["op"]] = busy.get(t["op"], 0.0) + (b - a)
            spans.append((a, b))
    return busy, spans


def analyse_step(phases: dict[str, tuple[float, float]], transfers: list[dict]) -> dict:
    """One step's phases against its transfers (see the note): per phase its time, link busy per
    collective and link idle; the tail and the after per collective; the bytes each collective
    the step issued sent. ``phases``: name -> (start, end) in ms, in order (:data:`PHASES`);
    ``transfers``: dicts with ``op``, ``sent``, ``issued`` and ``start_ms``/``end_ms`` (None:
    never held, no time on the link)."""
    out = {}
    for name, (lo, hi) in phases.items():
        busy, spans = _clipped(transfers, lo, hi)
        out[name] = {"ms": hi - lo, "busy_ms": busy, "idle_ms": (hi - lo) - _union(spans)}
    names = list(phases)
    lo, hi = phases[names[-1]]
    before_backward_end = set(names[:-1]) | {"earlier"}
    tail, _ = _clipped(transfers, lo, hi, lambda t: t["issued"] in before_backward_end)
    after, _ = _clipped(transfers, hi, float("inf"), lambda t: t["issued"] != "earlier")
    sent = {}
    for t in transfers:
        if t["issued"] != "earlier":
            sent[t["op"]] = sent.get(t["op"], 0) + t["sent"]
    return {"by_phase": out, "tail_ms": tail, "after_ms": after, "sent": sent}


def medians(steps: list[dict]) -> dict:
    """The median over ``steps`` (:func:`analyse_step`'s results) of every figure; a collective
    missing from a step counts as 0 there."""
    if not steps:
        return {}

    def med(values):
        return statistics.median(values)

    def per_op(dicts):
        ops = sorted({op for d in dicts for op in d})
        return {op: med([d.get(op, 0.0) for d in dicts]) for op in ops}

    by_phase = {}
    for name in steps[0]["by_phase"]:
        rows = [s["by_phase"][name] for s in steps]
        by_phase[name] = {"ms": med([r["ms"] for r in rows]), "busy_ms": per_op([r["busy_ms"] for r in rows]),
                          "idle_ms": med([r["idle_ms"] for r in rows])}
    out = {"steps": len(steps), "by_phase": by_phase, "tail_ms": per_op([s["tail_ms"] for s in steps]),
           "after_ms": per_op([s["after_ms"] for s in steps])}
    if all("host_lead_ms" in s for s in steps):  # CUDA stamps
        out["host_lead_ms"] = {n: med([s["host_lead_ms"][n] for s in steps]) for n in POINTS}
    return out


def _ops(d: dict) -> str:
    return ", ".join(f"{op} {v:.1f}" for op, v in sorted(d.items()) if v > 0) or "—"


def table(med: dict) -> str:
    """A short per-phase table of :func:`medians` (text, for a log)."""
    if not med:
        return "timeline: no measured steps\n"
    lines = [f"timeline (emulated link; median of {med['steps']} step(s), ms): phase | time | link busy by "
             "collective | link idle"]
    for name, r in med["by_phase"].items():
        lines.append(f"  {name:8s} | {r['ms']:.1f} | {_ops(r['busy_ms'])} | {r['idle_ms']:.1f}")
    lines.append(f"  tail after the backward: {_ops(med['tail_ms'])}; after the step's end: {_ops(med['after_ms'])}")
    if med.get("host_lead_ms"):
        lines.append("  host lead (GPU behind the host) at "
                     + ", ".join(f"{n} {v:.1f}" for n, v in med["host_lead_ms"].items()))
    return "\n".join(lines) + "\n"


def _leads(med: dict) -> str:
    lead = med.get("host_lead_ms")
    return " / ".join(f"{lead[n]:.1f}" for n in POINTS[1:]) if lead else "—"


def markdown(rows: list[dict]) -> str:
    """One table row per (cell, link, arm) with a timeline (``emulated_matrix.summarize``'s rows)."""
    rows = [r for r in rows if r.get("timeline")]
    if not rows:
        return ""
    lines = ["", "## Step timeline (emulated link; medians over the measured steps, ms)", "",
             "| cell | link | arm | forward | backward | step | link busy in forward | in backward | in step | "
             "tail after backward | after step end | host lead at forward / backward / step end |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m, p = r["timeline"], r["timeline"]["by_phase"]
        lines.append(f"| {r['cell']} | {r['link']} | {r['arm']} | "
                     + " | ".join(f"{p[n]['ms']:.1f}" for n in PHASES) + " | "
                     + " | ".join(f"{_ops(p[n]['busy_ms'])} (idle {p[n]['idle_ms']:.1f})" for n in PHASES)
                     + f" | {_ops(m['tail_ms'])} | {_ops(m['after_ms'])} | {_leads(m)} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- the chart


def _records(path: str):
    """``(folder, title, arm, record)`` of every run record with a timeline under ``path`` (an
    emulated_matrix OUT folder, a ``matrix.json`` or a JSON list of run records)."""
    if os.path.isdir(path):
        for root, _, files in sorted(os.walk(path)):
            if "matrix.json" in files:
                yield from _records(os.path.join(root, "matrix.json"))
        return
    with open(path) as f:
        data = json.load(f)
    folder = os.path.dirname(os.path.abspath(path))
    if isinstance(data, dict) and "runs" in data:
        label = data.get("regime_label", "emulated link")
        for arm, runs in data["runs"].items():
            rec = next((r for r in runs if r.get("timeline")), None)
            if rec is not None:
                yield folder, label, arm, rec
    else:
        for k, rec in enumerate(data if isinstance(data, list) else [data]):
            if rec.get("timeline"):
                yield folder, f"emulated link {rec.get('link', '')}", rec.get("arm", f"run{k}"), rec


def plot(rec: dict, title: str, path: str, step: int | None = None) -> str:
    """A Gantt chart of one measured step of ``rec["timeline"]``: the compute phases in one row,
    the link's transfers coloured by collective in another."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = rec["timeline"]["steps"]
    if not steps:
        raise ValueError(f"{path}: the record has no measured step")
    if step is None:
        by_len = sorted(steps, key=lambda s: s["phases"]["step"][1])
        one = by_len[len(by_len) // 2]
    else:
        one = next((s for s in steps if s["step"] == step), None)
        if one is None:
            raise ValueError(f"step {step} is not a measured step (measured: {[s['step'] for s in steps]})")
    fig, ax = plt.subplots(figsize=(10, 2.6))
    colors = {"forward": "tab:blue", "backward": "tab:orange", "step": "tab:green"}
    for name, (a, b) in one["phases"].items():
        ax.broken_barh([(a, b - a)], (1.1, 0.8), color=colors[name], label=name)
    cmap = plt.get_cmap("tab10")
    ops = sorted({t["op"] for t in one["transfers"]})
    for i, op in enumerate(ops):
        bars = [(t["start_ms"], t["end_ms"] - t["start_ms"]) for t in one["transfers"]
                if t["op"] == op and t["start_ms"] is not None]
        ax.broken_barh(bars, (0.1, 0.8), color=cmap(3 + i % 7), label=op, edgecolor="black", linewidth=0.3)
    ax.set_yticks([0.5, 1.5], ["link", "compute"])
    ax.set_xlabel("ms from the step's start")
    ax.set_title(f"{title}: {rec.get('arm') or ''} step {one['step']} ({rec['timeline']['clock']})".replace("  ", " "),
                 fontsize=9)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=6, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="an emulated_matrix OUT folder, a matrix.json or a JSON list of run records")
    p.add_argument("--step", type=int, default=None, help="the measured step to draw (default: the median-length one)")
    p.add_argument("--out", default=None, help="folder for the PNGs (default: next to each matrix.json)")
    a = p.parse_args(argv)
    if not os.path.exists(a.source):
        p.error(f"{a.source}: no such file or folder")
    drawn = 0
    for folder, title, arm, rec in _records(a.source):
        where = a.out or folder
        os.makedirs(where, exist_ok=True)
        name = "".join(c if c.isalnum() or c in "._-" else "_" for c in arm)
        if a.out:
            name = "_".join(os.path.abspath(folder).split(os.sep)[-2:] + [name])
        try:
            print(plot(dict(rec, arm=arm), title, os.path.join(where, f"timeline_{name}.png"), a.step))
        except ValueError as e:
            p.error(str(e))
        drawn += 1
    if not drawn:
        p.error(f"{a.source}: no run record with a timeline "
                "(run benchmarks/scripts/emulated_matrix.py with --timeline)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
