"""A cluster on one GPU: rank 0 of a fake world of ``n`` x ``L`` ranks does its real work, and
every collective holds the cluster's two links for what the cluster cost model charges the
whole group.

[Note: emulated cluster]
The one-link emulator (``benchmarks/scripts/emulated_link.py``, [Note: emulated link]: world,
delivery, transfer, hold) charges rank 0's own bytes on one link. Here the world is a cluster
(:class:`qzero.plan.Cluster`: ``n`` nodes of ``L`` GPUs, an intra-node link and NICs, shared
or one per rail) and its link a :class:`ClusterLink`:

* **charge**: each collective is charged by
  :class:`qzero.app.benchmarks.two_tier.TwoTierCharge` ([Note: two-tier charge]) for its
  group's global ranks (``torch.distributed.get_process_group_ranks``): a group of every rank,
  one rail or one node is charged as every group of that scope running it at once, as the
  plan charges it; ring collectives from rank 0's byte counts, an all-to-all from rank 0's
  splits (:func:`qzero.app.benchmarks.two_tier.splits_from_rank0`). Charges are cached by
  call (a step repeats its sizes), so the host pays the cost model once per distinct call.
* **two resources**: a charged collective holds the intra-node link, the NICs or both
  (:func:`qzero.app.benchmarks.two_tier.resources_of`): on the host clock (CPU tensors) it is
  placed on a :class:`qzero.app.benchmarks.two_tier.TwoTierTimeline` and the host sleeps to
  its placed end where the one-link world would; on CUDA each resource is a device link
  (``benchmarks/scripts/link_kernels.py``: a stream and the hold kernel), and a collective
  runs on the first of its resources' streams after the others' (and they wait for its
  end): the same timeline, kept by the device. So the node stage of one bucket and the rail
  stage of another overlap as they would on the cluster, and a world ring waits for both.
* **contention and time scale**: the link's :class:`emulated_link.LinkModel` is regime
  ``none`` with the keys of its resident CTAs and time scale (``none:ctas=8,time_scale=1.2``):
  its rate and latency are the cluster's; a charge lasts ``1/time_scale`` of its modelled
  time, as on one link.
* **nodes in the fake world**: ``DeviceMesh`` and ``new_group`` work under the fake process
  group (torch 2.13), so qzero's two-level groups are made as on a cluster. The host exchange
  of ``ZeroOptimizer`` is an all-gather delivered as rank 0's for every rank: every rank on
  one host, so declared nodes (``ZeroConfig.ranks_per_node = L``) are pseudo-nodes and
  accepted; with ``ranks_per_node = 0`` one host holds the whole world, one node. The
  emulated matrix sets ``ranks_per_node = L`` for every arm that does not set it (with
  ``hierarchical_collectives='auto'``, qzero's default, that is the two-level mode, as a
  cluster's detected hosts give it; flat arms set ``hierarchical_collectives=false``).

Every time here is the cost model's projection of the cluster held on this host, not a
measurement of a cluster.

    python3 benchmarks/scripts/emulated_cluster.py --check [--device cuda]   # the holds, on the CPU or one GPU
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch
import torch.distributed as dist

from qzero.app.benchmarks.two_tier import TwoTierCharge, TwoTierTimeline, resources_of
from qzero.plan import Cluster

from emulated_link import EmulatedWorld, Issued, Link, LinkModel, Transfer, Wire, init_emulated_world, parse_link

#: Distinct calls whose charge is kept (a training step repeats a few dozen).
CACHE = 4096


class ClusterLink(Link):
    """The two links of a cluster, charged for whole groups (see the note). ``model``: the
    contention and time scale (regime ``none`` with keys)."""

    def __init__(self, cluster: Cluster, model: LinkModel | str = "none", clock=time.perf_counter, sleep=time.sleep,
                 keep: int = 4096):
        model = parse_link(model) if isinstance(model, str) else model
        if not math.isinf(model.rate) or model.latency:
            raise ValueError(f"a cluster's link takes its rates and latencies from the cluster: give regime none with "
                             f"contention and time-scale keys (none:ctas=8,time_scale=1.2), got {model.name}")
        super().__init__(model, clock=clock, sleep=sleep, keep=keep)
        self.cluster = cluster
        self.two_tier = TwoTierCharge(cluster)
        self.timeline = TwoTierTimeline(self.two_tier, keep=keep)
        self._groups: dict[int, tuple[object, tuple[int, ...]]] = {}
        self._costs: dict[tuple, object] = {}
        self._lanes: dict[str, object] = {}

    def set_cluster(self, cluster: Cluster) -> None:
        """Charge the next collectives on ``cluster``'s fabric (rates, latencies, NICs); its
        nodes and GPUs per node are this link's (the fake world's size). Synchronize first, as
        for :meth:`emulated_link.EmulatedWorld.set_link`."""
        if (cluster.nodes, cluster.gpus_per_node) != (self.cluster.nodes, self.cluster.gpus_per_node):
            raise ValueError(f"a cluster of {cluster.nodes} x {cluster.gpus_per_node} GPUs on a world of "
                             f"{self.cluster.nodes} x {self.cluster.gpus_per_node}: only the fabric can change")
        self.cluster = cluster
        self.two_tier = TwoTierCharge(cluster)
        self.timeline = TwoTierTimeline(self.two_tier, keep=self.timeline.placed.maxlen)
        self._costs.clear()

    def ranks_of(self, group) -> tuple[int, ...]:
        """The global ranks of ``group`` (None or the default group: every rank), in group order."""
        if group is None or group is dist.group.WORLD:
            return tuple(range(self.cluster.world))
        kept = self._groups.get(id(group))
        if kept is None or kept[0] is not group:
            kept = self._groups[id(group)] = (group, tuple(dist.get_process_group_ranks(group)))
        return kept[1]

    def cost(self, issued: Issued):
        """The cluster's charge for one call (a :class:`qzero.plan.Cost`), cached by call."""
        ranks = self.ranks_of(issued.group)
        key = (issued.op, ranks, issued.nbytes, issued.send, issued.recv)
        cost = self._costs.get(key)
        if cost is None:
            if len(self._costs) >= CACHE:
                self._costs.clear()
            order = sorted(range(len(ranks)), key=ranks.__getitem__)  # the charge reads sorted groups
            send = [issued.send[i] for i in order] if issued.send is not None else None
            recv = [issued.recv[i] for i in order] if issued.recv is not None else None
            cost = self._costs[key] = self.two_tier.collective(issued.op, [ranks[i] for i in order], issued.nbytes,
                                                               send, recv)
        return cost

    # -- what the one link does otherwise
    def charge(self, t: Transfer, wire: Wire, issued: Issued | None) -> float:
        if issued is None:
            raise ValueError(f"a cluster's link charges a collective from its call (group and sizes); {t.op} came "
                             "without one")
        t.charge = self.cost(issued)
        return t.charge.seconds / self.model.time_scale

    def resources(self, t: Transfer) -> tuple[str, ...]:
        return resources_of(t.charge)

    def schedule(self, t: Transfer, issued: float) -> tuple[float, float]:
        placed = self.timeline.place(t.op, dataclasses.replace(t.charge, seconds=t.seconds), issued)
        return placed.start, placed.end

    def lanes(self, t: Transfer, device: torch.device) -> list:
        import link_kernels

        uses = self.resources(t)
        for r in uses:
            if r not in self._lanes:
                self._lanes[r] = link_kernels.DeviceLink(device)
        return [self._lanes[r] for r in uses]

    def device_log(self) -> list[tuple[int, int, int]]:
        return sorted(row for lane in self._lanes.values() for row in lane.log())

    @property
    def holds(self) -> bool:
        return True

    def describe(self) -> str:
        text = f"cluster of {self.cluster.describe()}"
        if self.model.ctas:
            text += f"; {self.model.ctas} resident CTAs x {self.model.warps} warps per transfer"
        if self.model.time_scale != 1.0:
            text += f"; time scale {self.model.time_scale:.4g}"
        return text


def init_cluster_world(cluster: Cluster, model: LinkModel | str = "none", clock=time.perf_counter,
                       sleep=time.sleep) -> EmulatedWorld:
    """Make this process rank 0 of the cluster's ``n * L`` ranks (torch's fake process group)
    with collectives held on a :class:`ClusterLink`; undo with ``emulated_link.close_emulated_world``."""
    return init_emulated_world(cluster.world, ClusterLink(cluster, model, clock=clock, sleep=sleep))


# ---------------------------------------------------------------------- the command line

#: The cluster's flags, named as ``qzero plan`` names them, and their defaults (``qzero plan``'s).
DEFAULTS = {"gpus_per_node": 8, "intra_gbps": 25.2, "inter_gbps": 12.5, "intra_latency_us": 20.0,
            "inter_latency_us": 50.0, "nic": "shared"}


def add_cluster_arguments(parser) -> None:
    """``--nodes`` (no cluster without it) and the rest of ``qzero plan``'s cluster flags."""
    from qzero.plan import NICS

    c = parser.add_argument_group("emulated cluster (every rank's collectives charged by the cluster cost model)")
    c.add_argument("--nodes", type=int, default=None, help="nodes of the emulated cluster (default: no cluster, "
                   "one link); the world is --nodes x --gpus-per-node")
    c.add_argument("--gpus-per-node", type=int, default=DEFAULTS["gpus_per_node"])
    c.add_argument("--intra-gbps", type=float, default=DEFAULTS["intra_gbps"],
                   help="GB/s per direction of a GPU's link inside a node (default 25.2: PCIe-class; NVLink ~290)")
    c.add_argument("--inter-gbps", type=float, default=DEFAULTS["inter_gbps"],
                   help="GB/s per direction of a NIC (default 12.5: 100 GbE)")
    c.add_argument("--intra-latency-us", type=float, default=DEFAULTS["intra_latency_us"])
    c.add_argument("--inter-latency-us", type=float, default=DEFAULTS["inter_latency_us"])
    c.add_argument("--nic", choices=NICS, default=DEFAULTS["nic"], help="one NIC per node (shared) or per GPU (rail)")


def cluster_from_args(args) -> Cluster | None:
    """The cluster of :func:`add_cluster_arguments`' flags (None without ``--nodes``); a
    ValueError naming the flag. A cluster's flags without ``--nodes`` are refused."""
    if args.nodes is None:
        given = [f"--{k.replace('_', '-')}" for k, v in DEFAULTS.items() if getattr(args, k) != v]
        if given:
            raise ValueError(f"{', '.join(given)} describe a cluster: give --nodes too")
        return None
    for flag, value in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node)):
        if value < 1:
            raise ValueError(f"{flag} must be a positive integer, got {value}")
    for flag, value in (("--intra-gbps", args.intra_gbps), ("--inter-gbps", args.inter_gbps)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag} must be a positive number, got {value}")
    for flag, value in (("--intra-latency-us", args.intra_latency_us), ("--inter-latency-us", args.inter_latency_us)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{flag} must be a number >= 0, got {value}")
    return Cluster(args.nodes, args.gpus_per_node, args.intra_gbps * 1e9, args.inter_gbps * 1e9,
                   args.intra_latency_us * 1e-6, args.inter_latency_us * 1e-6, args.nic)


#: The keys a cluster's link entry may carry to change the fabric of the command line's cluster
#: (units as the flags'): one arm's process then measures several fabrics of one world.
FABRIC_KEYS = ("intra_gbps", "inter_gbps", "intra_latency_us", "inter_latency_us", "nic")


def fabric_of(link: str, cluster: Cluster) -> tuple[Cluster, str]:
    """A cluster's link entry -> the cluster it runs on and its link text for
    :func:`emulated_link.parse_link`: ``none:ctas=8,time_scale=1.2,intra_gbps=290,inter_gbps=25,nic=rail``
    is ``cluster`` with NVLink-class links inside, one 25 GB/s NIC per GPU, and
    ``none:ctas=8,time_scale=1.2``. A ValueError names a bad key or value."""
    name, _, rest = link.strip().partition(":")
    keep, fabric = [], {}
    for pair in filter(None, (p.strip() for p in rest.replace(";", ",").split(","))):
        key, _, value = pair.partition("=")
        if key.strip() not in FABRIC_KEYS:
            keep.append(pair)
            continue
        key, value = key.strip(), value.strip()
        if key == "nic":
            from qzero.plan import NICS

            if value not in NICS:
                raise ValueError(f"link {link!r}: nic must be one of {', '.join(NICS)}, got {value!r}")
            fabric["nic"] = value
            continue
        try:
            x = float(value)
        except ValueError:
            x = float("nan")
        if not math.isfinite(x) or x < 0 or (x == 0 and key.endswith("gbps")):
            raise ValueError(f"link {link!r}: {key} must be a {'positive' if key.endswith('gbps') else '>= 0'} "
                             f"number, got {value!r}")
        field = {"intra_gbps": "intra_rate", "inter_gbps": "inter_rate", "intra_latency_us": "intra_latency",
                 "inter_latency_us": "inter_latency"}[key]
        fabric[field] = x * (1e9 if key.endswith("gbps") else 1e-6)
    text = name + (":" + ",".join(keep) if keep else "")
    return (dataclasses.replace(cluster, **fabric) if fabric else cluster), text


def cluster_label(cluster: Cluster) -> str:
    """A folder-safe name of a cluster (``2x4_shared_intra25.2_inter12.5``)."""
    return (f"{cluster.nodes}x{cluster.gpus_per_node}_{cluster.nic}_intra{cluster.intra_rate / 1e9:g}_"
            f"inter{cluster.inter_rate / 1e9:g}")


# ---------------------------------------------------------------------- check


def _check(device: str, nodes: int = 2, gpus: int = 2) -> int:
    """On ``device``: one collective of each kind on the world, a rail and a node, each held
    for its charge; then a node reduce-scatter and a rail all-to-all issued back to back
    overlap (their resources differ) and a world all-gather after them waits for both. On
    the CPU the rates are 20 times lower, so that the charges are long beside the host's own
    deliveries."""
    slow = 20 if device == "cpu" else 1
    cluster = Cluster(nodes, gpus, 25e9 / slow, 12.5e9 / slow, 20e-6, 50e-6)
    w = init_cluster_world(cluster)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh(dev.type, torch.arange(cluster.world).view(nodes, gpus), mesh_dim_names=("node", "local"))
    groups = {"world": None, "rail": mesh.get_group("node"), "node": mesh.get_group("local")}
    failures = []
    m = 1 << 20
    for scope, g in groups.items():
        size = cluster.world if g is None else g.size()
        for op in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
            x = torch.ones(m if op == "all_gather" else size * m, device=dev, dtype=torch.bfloat16)
            out = torch.empty(m if op == "reduce_scatter" else size * m, device=dev, dtype=torch.bfloat16)
            first = w.link.count
            t0 = time.perf_counter()
            if op == "all_gather":
                dist.all_gather_into_tensor(out, x, group=g)
            elif op == "reduce_scatter":
                dist.reduce_scatter_tensor(out, x, group=g)
            elif op == "all_reduce":
                dist.all_reduce(x, group=g)
            else:
                dist.all_to_all_single(out, x, group=g)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            held = _held(w.link, first, time.perf_counter() - t0)
            t = w.link.transfers[-1]
            ok = abs(held - t.seconds) <= 0.02 * t.seconds + (10e-6 if dev.type == "cuda" else 2e-3)
            print(f"{'PASS' if ok else 'FAIL'} {op} on the {scope}: charged {1e3 * t.seconds:.3f} ms "
                  f"({t.charge.busiest or 'latency'}-bound), held {1e3 * held:.3f} ms", flush=True)
            failures += [] if ok else [f"{op} {scope}"]
    failures += _check_overlap(w, groups, dev, m)
    from emulated_link import close_emulated_world

    close_emulated_world()
    print("ALL PASS" if not failures else f"FAILED: {failures}", flush=True)
    return 1 if failures else 0


def _held(link: Link, first: int, host_seconds: float) -> float:
    """How long the transfers since ``first`` held their links: the device's log on CUDA, the
    host's wait on the CPU."""
    log = [row for row in link.device_log() if row[0] >= first]
    return sum(b - a for _, a, b in log) / 1e9 if log else host_seconds


def _check_overlap(w: EmulatedWorld, groups: dict, dev: torch.device, m: int) -> list[str]:
    link = w.link
    n, L = link.cluster.nodes, link.cluster.gpus_per_node
    node_in = torch.ones(L * 8 * m, device=dev, dtype=torch.bfloat16)
    node_out = torch.empty(8 * m, device=dev, dtype=torch.bfloat16)
    rail = torch.ones(n * 8 * m, device=dev, dtype=torch.bfloat16)
    rail_out = torch.empty_like(rail)
    first = link.count
    t0 = time.perf_counter()
    works = [dist.reduce_scatter_tensor(node_out, node_in, group=groups["node"], async_op=True),
             dist.all_to_all_single(rail_out, rail, group=groups["rail"], async_op=True),
             dist.all_gather_into_tensor(torch.empty(link.cluster.world * m, device=dev, dtype=torch.bfloat16),
                                         torch.ones(m, device=dev, dtype=torch.bfloat16), async_op=True)]
    for wk in works:
        wk.wait()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    a, b, c = (t for t in link.transfers if t.index >= first)
    span = time.perf_counter() - t0
    log = {i: (s / 1e9, e / 1e9) for i, s, e in link.device_log() if i >= first}
    if log:
        (sa, ea), (sb, eb), (sc, _) = log[a.index], log[b.index], log[c.index]
    else:
        (sa, ea), (sb, eb), (sc, _) = (a.start, a.end), (b.start, b.end), (c.start, c.end)
    tol = 0.02 * max(a.seconds, b.seconds) + (0 if log else 2e-3)
    overlap = sb < ea and (abs(sb - sa) <= tol or not log)  # on the CPU the first's delivery delays the second
    after = sc >= max(ea, eb) - tol
    whole = max(a.seconds, b.seconds) + c.seconds
    print(f"{'PASS' if overlap else 'FAIL'} a node reduce-scatter ({1e3 * a.seconds:.3f} ms) and a rail all-to-all "
          f"({1e3 * b.seconds:.3f} ms) overlap (the second starts {1e3 * (sb - sa):.3f} ms after the first)",
          flush=True)
    print(f"{'PASS' if after else 'FAIL'} a world all-gather after them waits for both (starts "
          f"{1e3 * (sc - max(ea, eb)):.3f} ms after the later end); all three in {1e3 * span:.3f} ms, "
          f"the timeline's {1e3 * whole:.3f} ms", flush=True)
    return ([] if overlap else ["overlap"]) + ([] if after else ["world after both"])


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="check the holds of every scope and their overlap")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    a = ap.parse_args()
    if a.check:
        raise SystemExit(_check(a.device))
    ap.print_help()
