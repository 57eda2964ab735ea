"""ZeroOptimizer: ZeRO stage 1/2 around any torch optimizer, with the (quantized) weight gather.

A step has three phases, the same at every world size (1 included)::

    reduce   gradients reach their owners as fp32 gradient shards
             (stage 2: already during backward; stage 1: now)
    update   unscale / overflow skip (fp16), clip by the global norm, inner optimizer
             steps the fp32 master shards
    gather   each master shard is written into its partition and the flat buffers
             are gathered, plainly or quantized

From the second step on, Adam and AdamW update *sliced* (:mod:`qzero.optim.update`):
chunk by chunk, as the gather asks for it, so the gather of the first chunks overlaps
the update of the rest. The bits are those of one whole update.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import warnings
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from ..wire.agreement import digest, optimizer_fields
from ..wire.comm import GatherStats, agree_or_raise, agreement_device, peer_failure, world_or_default
from ..config import ZeroConfig
from ..wire.copy_engine import CopyEngineComm, check_copy_engine_support
from ..wire.engine import DEPTH as OVERLAP_DEPTH
from ..wire.engine import CommContext
from ..wire.labels import STEP, UPDATE, label
from ..wire.overlap import GatherAhead
from .checkpoint.form import sharded_state_dict
from .checkpoint.load import load_checkpoint as load_from
from .checkpoint.save import save_checkpoint as save_to
from .error_feedback import ErrorFeedback
from ..quant.reference import NOT_REFUSED
from .delta import refusal_error
from .flat import FlatGroup
from .grads import ReduceStats, Stage1Grads, Stage2Grads, may_repeat_hooks
from ..wire.quantized_reduce import GradientQuantization
from . import update as sliced_update
from .guard import ModelGuard
from ..layout.topology import Topology, topology_from_hosts
from ..wire.two_level import TwoLevelGroups, exchange_hosts
from .scaler import LossScaler
from ..vocabulary import WEIGHT_FORMATS

_log = logging.getLogger("qzero")

FLAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class ZeroOptimizer:
    """Shard optimizer state and gradients (ZeRO-1/2) of ``model`` over ``process_group``.

    ``optimizer`` builds a ``torch.optim.Optimizer`` from parameter groups, e.g.
    ``functools.partial(torch.optim.AdamW, lr=3e-4)``. ``param_groups`` (optional)
    is a list of ``{"params": [...], **hyperparameters}`` over the model's trainable
    parameters; by default all of them form one group. Use as::

        loss = model(x).loss; opt.backward(loss); opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer],
        *,
        config: ZeroConfig | None = None,
        process_group: dist.ProcessGroup | None = None,
        param_groups: list[dict] | None = None,
    ):
        config = ZeroConfig() if config is None else config
        world, rank, agree_group, error = world_or_default(process_group)
        groups = names = inner = flat_groups = context = fields = details = topology = None
        # Every rank's host, before anything else can fail: the topology is decided from it alike on
        # every rank (qzero/wire/two_level.py).
        hosts = _exchange_hosts(model, agree_group, world, error)
        try:
            if error is not None:
                raise error
            _check_launched_world(world, process_group)
            if not isinstance(config, ZeroConfig):
                raise TypeError(f"config must be a qzero.ZeroConfig, got {type(config).__name__}")
            if not isinstance(model, torch.nn.Module):
                raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
            if not callable(optimizer):
                raise TypeError(f"optimizer must be a callable that builds a torch.optim.Optimizer, got {optimizer!r}")
            groups, names = _split_groups(model, param_groups)
            _check_flattenable(groups, names, config, world)
            topology = _topology(hosts, config)
            # The streams and kernels of every gather this optimizer runs.
            context = CommContext(groups[0][0][0].device, schedule=config.gather_schedule, kernels=config.quant_kernels,
                                  lookahead=config.gather_lookahead)
            if config.copy_engine_collectives:
                check_copy_engine_support(context.device, process_group)
            # Plan (pure) and build the inner optimizer on the empty master shards *before*
            # touching the model, so that its errors, too, leave everything as it was.
            flat_groups = [
                FlatGroup(params, [names[p] for p in params], config, world, rank, process_group, context, topology)
                for params, _ in groups
            ]
            inner = _build_inner(optimizer, [{**hp, "params": [g.master]} for g, (_, hp) in zip(flat_groups, groups)])
            if not isinstance(inner, torch.optim.Optimizer):
                raise TypeError(f"optimizer(...) must return a torch.optim.Optimizer, got {type(inner).__name__}")
            # What every rank must have alike ([Note: agreement] in qzero/wire/agreement.py): the delta
            # settings by name first (a mismatch is reported by them), the whole config, the
            # model, and the inner optimizer as built (class, every group's hyperparameters).
            # Later changes to param_groups (an LR scheduler's) are the caller's to keep alike.
            inner_fields, details = optimizer_fields(inner)
            # a config that differs is reported by the fields that differ
            details = {**(details or {}), "config": {k: repr(v) for k, v in config.to_dict().items()}}
            fields = {**_delta_fields(config), "config": config.digest(),
                      "model (parameter and buffer shapes)": _model_digest(model, groups),
                      "topology (nodes, ranks per node, two-level)": digest(repr(topology)), **inner_fields}
        except Exception as e:  # noqa: BLE001 - any local failure is agreed on, so no peer waits for this rank
            error, fields, details = e, None, None
        device = groups[0][0][0].device if groups else None
        agree_or_raise(agree_group, world, device, error, fields, "ZeroOptimizer", details)

        self.config = config
        self.process_group = process_group
        self.world_size, self.rank = world, rank
        self.model = model
        if config.copy_engine_collectives:  # every rank passed the check: create the group together
            context.copy_engine = CopyEngineComm(process_group, context.device)
        #: Nodes x ranks per node of the group, and whether the collectives are two-level.
        self.topology = topology
        if rank == 0 and world > 1:
            _log.info("qzero: ZeroOptimizer over %s", topology.describe())
        #: This rank's node and rail groups (two-level collectives), else None.
        self.two_level = TwoLevelGroups(topology, process_group, rank, context.device) if topology.two_level else None
        if self.two_level is not None:
            context.all_gather = self.two_level.all_gather
        self.context = context
        self.groups = flat_groups
        self.optimizer = inner
        src = dist.get_global_rank(process_group, 0) if process_group is not None and world > 1 else 0
        for g in self.groups:
            g.flatten()
            g.sync_from(src)
        _broadcast_module_state(model, src, process_group, world)
        quant = GradientQuantization.from_config(config)
        #: Per flat group, this rank's quantization residuals (error feedback; None without it,
        #: and at world size 1, where nothing is quantized): optimizer state.
        self.error_feedback: list[ErrorFeedback | None] = [
            ErrorFeedback(g) if config.zero_quantized_gradients_error_feedback and world > 1 else None
            for g in self.groups
        ]
        self.grads = [
            Stage1Grads(g, config.reduce_dtype, config.reduce_bucket_size, config.solo_reduce, quant, ef,
                        reduce_buckets_in_flight=config.reduce_buckets_in_flight, two_level=self.two_level)
            if config.stage == 1
            else Stage2Grads(
                g, config.reduce_dtype, config.reduce_bucket_size, config.overlap_comm, config.solo_reduce, quant, ef,
                reduce_buckets_in_flight=config.reduce_buckets_in_flight, two_level=self.two_level,
            )
            for g, ef in zip(self.groups, self.error_feedback)
        ]
        # Under gather-ahead every read of a weight through the model waits for its chunks
        # ([Note: reads wait] in qzero/wire/overlap.py).
        self.ahead = GatherAhead(model, self.groups) if config.overlap_param_gather else None
        self.scaler = LossScaler(config, enabled=self.groups[0].dtype == torch.float16)
        self.grad_norm: torch.Tensor | None = None
        self.last_step_skipped = False
        self.last_gather: list[GatherStats] = []
        #: Gradient traffic of the last step, per flat group (all its micro-batches).
        self.last_reduce: list[ReduceStats] = []
        self.steps_taken = 0
        # [Note: the model belongs to the optimizer] in guard.py; and the loop's order:
        # backward since the last zero_grad/step, step, zero_grad before the next backward.
        self.guard = ModelGuard(model, self.groups, inner, process_group, world,
                                agreement_device(process_group, context.device) if world > 1 else None)
        self._backward_ran = False
        self._stepped = False
        # what interrupted a backward of this step ([Note: an interrupted backward])
        self._interrupted: str | None = None

    # ------------------------------------------------------------------ the loop

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's parameter groups (learning rates live here)."""
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` (scaled for fp16); stage 2 reduces gradients as they appear.

        ``loss`` must be a floating-point tensor of one element that requires grad; anything
        else raises ``TypeError``/``ValueError`` naming what is wrong, before any work (a local
        check of the tensor's type, shape and flags: ranks running the same code raise alike)."""
        if not isinstance(loss, torch.Tensor):
            if loss is None:
                hint = (" (a Hugging Face model's output has loss=None when it is called without labels: pass "
                        "labels=..., or compute the loss from its logits)")
            elif isinstance(getattr(loss, "loss", None), torch.Tensor):
                hint = " (a model output: pass its .loss)"
            else:
                hint = ""
            raise TypeError(f"ZeroOptimizer.backward(loss): loss must be a torch.Tensor, got "
                            f"{type(loss).__name__}{hint}")
        if not loss.is_floating_point():
            raise TypeError(f"ZeroOptimizer.backward(loss): loss must be a floating-point tensor, "
                            f"got dtype {loss.dtype}")
        if loss.numel() != 1:
            raise ValueError(f"ZeroOptimizer.backward(loss): loss must be a scalar (one element), got shape "
                             f"{tuple(loss.shape)}; reduce it first (loss.mean() or loss.sum())")
        if not loss.requires_grad:
            raise ValueError("ZeroOptimizer.backward(loss): loss does not require grad (was it computed under "
                             "torch.no_grad() or torch.inference_mode(), detached, or from frozen parameters only?)")
        if self._stepped:
            raise RuntimeError(
                "qzero: ZeroOptimizer.backward() after step() without opt.zero_grad() in between: the last "
                "step's gradients would be added to this one's. Call opt.zero_grad() after step() "
                "(model.zero_grad() does not clear the optimizer's gradient buffers)")
        self._finish_gathers()
        # agreed at a step's first micro-batch
        self.guard.check(self.steps_taken, agree=not self._backward_ran, refusal=self._refusal())
        may_repeat = any(g.learning for g in self.grads) and may_repeat_hooks(loss)
        try:
            for grads in self.grads:
                grads.begin(may_repeat)
            (loss * self.scaler.scale if self.scaler.enabled else loss).backward()
            for grads in self.grads:
                grads.after_backward()
        except BaseException as e:
            # [Note: an interrupted backward] An exception inside backward (a bad batch, an
            # out-of-memory, a hook's error) leaves part of a step behind: stage 2 has staged,
            # launched and partly summed some buckets, stage 1 has part of a gradient in its
            # buffer. The reductions already launched are waited for (every rank that ran the
            # same backward launched them too) and the staging dropped, so no later collective
            # pairs with a stale one; what reached the gradient shard stays until zero_grad().
            # Until then backward() and step() refuse, on every rank (the model guard's
            # exchange), naming the error; zero_grad() makes the next step that of an optimizer
            # that never saw it. (An exception on some ranks only leaves the others waiting in
            # a reduction until the process group's timeout.)
            for grads in self.grads:
                grads.abandon()
            said = f"{type(e).__name__}: {e}"
            self._interrupted = said if len(said) <= 300 else said[:297] + "..."
            raise
        self._backward_ran = True

    def _refusal(self) -> RuntimeError | None:
        """Why this rank's gradients cannot make a step, or None: an interrupted backward,
        a gradient from a plain ``loss.backward()``, a gradient that arrived after its bucket
        was reduced. ``zero_grad()`` clears each."""
        if self._interrupted is not None:
            return RuntimeError(
                f"qzero: an opt.backward() of this step raised ({self._interrupted}) before it finished, so the "
                "step's gradients are incomplete. Call opt.zero_grad() to discard them, then run the step's "
                "backward(s) again")
        for grads in self.grads:
            problem = grads.problem()
            if problem is not None:
                return RuntimeError(problem)
        return None

    @torch.no_grad()
    def step(self) -> bool:
        """Reduce, update and gather. Returns False when the step was skipped (fp16 overflow).

        With ``overlap_param_gather`` the gather is started, not finished: the next
        forward's modules each wait for their own chunks.
        """
        with label(STEP):
            return self._step()

    def _step(self) -> bool:
        self._finish_gathers()
        # The refusal flags of the last delta gather are read at the step's first host
        # synchronisation, before the update ([Note: delta loop]); `refusals_read` says whether
        # that has happened yet.
        refusals_read = False
        if not self._backward_ran:
            raise RuntimeError(
                "qzero: ZeroOptimizer.step() without opt.backward(loss) since the last zero_grad() or step(): "
                "nothing to apply (a plain loss.backward() is not enough: the optimizer reduces, scales and "
                "checks the gradients in opt.backward)")
        # before stage 1's reductions start: the guard's exchange would otherwise wait behind them
        self.guard.check(self.steps_taken, refusal=self._refusal())
        for grads in self.grads:
            grads.before_step()
        self._backward_ran, self._stepped = False, True
        self.last_reduce = [grads.take_stats() for grads in self.grads]
        shards = [g.grad_shard() for g in self.groups]
        if self.scaler.enabled:
            for s in shards:
                s.mul_(1.0 / self.scaler.scale)
            overflow = self._any_rank(torch.stack([(~torch.isfinite(s)).any() for s in shards]).any())
            self._check_delta()  # right after a synchronisation: nothing is queued before the read
            refusals_read = True
            old_scale = self.scaler.scale
            self.scaler.update(overflow)
            for ef in self.error_feedback:
                if ef is not None:
                    ef.after_scale_update(old_scale, self.scaler.scale, overflow)
            if overflow:
                self.last_step_skipped = True
                return False  # no update and no gather: the weights did not change
        self.last_step_skipped = False
        masters = [g.master for g in self.groups]
        dtype = self.groups[0].dtype  # every group has the model's dtype
        slicing = self.config.sliced_update and sliced_update.sliceable(self.optimizer, masters)
        # Before a sliced update the masters are checked too: 0 where their extremes are within
        # half the model dtype's range, NaN otherwise (no full-size temporary), rides on the
        # norm's all-reduce ([Note: masters the model's dtype cannot hold]).
        watch = None
        if slicing and self.config.check_finite:
            extremes = torch.stack([torch.stack(torch.aminmax(m)) for m in masters])
            half = torch.finfo(dtype).max / 2
            watch = torch.where(extremes.abs() <= half, 0.0, float("nan")).sum()
        self.grad_norm, masters_check = self._global_norm(shards, watch)
        if self.config.gradient_clipping > 0:
            coef = torch.clamp(self.config.gradient_clipping / (self.grad_norm + 1e-6), max=1.0)
            torch._foreach_mul_(shards, coef)
        if slicing:
            # Update chunk by chunk as the gather asks for it. The update of Adam-family
            # optimizers is bounded, so checking the gradients and the masters first stands
            # in for checking the masters after (which would have to wait for the whole
            # update). The global norm is finite unless a gradient is not (or the sum of
            # squares overflows: then the check below finds nothing and returns), the masters'
            # check unless a master is not, or is beyond half the model dtype's range (then
            # the update runs whole and the masters are checked after it); one sync, on two
            # scalars.
            checks = torch.stack([self.grad_norm, masters_check]) if self.config.check_finite else None
            if checks is not None:
                ok = torch.isfinite(checks).all()
                refused = None if refusals_read else self._delta_refused()
                if not bool(ok if refused is None else ok & ~refused):  # the one synchronisation
                    if refused is not None:
                        self._check_delta()
                    self._check_finite(shards, "gradients", "the update was skipped: the weights are unchanged")
                    self._check_finite(masters, "weights", "the update was skipped and nothing was gathered, so "
                                       "no replica received them", dtype)
                    slicing = False  # a master near the end of the dtype's range: whole update, checked after
            elif not refusals_read:
                self._check_delta()
            refusals_read = True
        if slicing:
            sliced = sliced_update.SlicedUpdate(self.optimizer, masters)
            updates = [functools.partial(sliced.update, i) for i in range(len(self.groups))]
        else:
            if not refusals_read:
                self._check_delta()
            with label(UPDATE):
                self.optimizer.step()
            if self.config.check_finite:
                self._check_finite(masters, "weights", "nothing was gathered, so no replica received them", dtype)
            sliced, updates = None, [None] * len(self.groups)
        self.steps_taken += 1
        if self.ahead is None:
            self.last_gather = [g.gather(u) for g, u in zip(self.groups, updates)]
        else:
            for i, (g, u) in enumerate(zip(self.groups, updates)):
                self.ahead.start(i, g.start_gather(u, ahead=True))
            for g in self.groups:  # what the running gathers have not asked for yet
                g.prepare(g.hi - g.lo)
            self.last_gather = [p.stats for p in self.ahead.pending if p is not None]
        if sliced is not None:
            sliced.finish()
        if self.steps_taken == 1 and self.rank == 0 and self.topology.nodes > 1:
            _log.info("qzero: %s; %.2f bits per parameter per step cross the network per node (the first step's "
                      "reduce and gather)", self.topology.describe(), self.network_bits_per_param())
        return True

    def network_bits_per_param(self) -> float:
        """Bits per parameter that one node sent across the network in the last step (its
        gradient reduction and weight gather; 0 on one node). Gradients: what this rank counted
        (``ReduceStats.bytes_across_nodes``) times the ranks of a node. Weights: a payload of
        ``c`` bytes per rank crosses ``(n - 1) c`` per rank over a rail (two-level), or
        ``(P - 1) c`` through the one node-crossing edge of a flat ring."""
        t = self.topology
        if t.nodes == 1:
            return 0.0
        params = sum(g.layout.used_numel for g in self.groups)
        grads = sum(s.bytes_across_nodes for s in self.last_reduce) * t.ranks_per_node
        own = sum(s.bytes_sent for s in self.last_gather)
        weights = own * t.ranks_per_node * (t.nodes - 1) if t.two_level else own * (t.world - 1)
        return 8.0 * (grads + weights) / max(params, 1)

    def wait_for_weights(self) -> None:
        """Finish a gather still running under gather-ahead (a no-op otherwise). With delta
        gathers, also raise (on every rank) if the last gather refused non-finite differences."""
        self._finish_gathers()
        self._check_delta()

    def _finish_gathers(self) -> None:
        if self.ahead is not None:
            self.ahead.wait_all()

    def _delta_refused(self) -> torch.Tensor | None:
        """Whether a delta gather refused a group since the flags were last read: a bool on the
        device (no synchronisation), or None without delta gathers."""
        flags = [g.delta.refused for g in self.groups if g.delta is not None]
        return None if not flags else torch.cat(flags).min() != NOT_REFUSED

    def _check_delta(self) -> None:
        """One host synchronisation on the refusal flags of the delta gathers ([Note: delta loop]):
        raise on every rank, naming the parameters, if a group was refused."""
        refused = self._delta_refused()
        if refused is None or not bool(refused):
            return
        loops = [(gi, g) for gi, g in enumerate(self.groups) if g.delta is not None]
        culprits = []
        for gi, g in loops:
            at = g.delta.take_refusal()
            if at is not None:
                slot = next((s for s in g.layout.slots if s.start <= at < s.stop), None)
                name = g.names[slot.index] if slot is not None else f"padding at flat index {at}"
                culprits.append(f"{name!r} (group {gi}, flat index {at})")
        raise refusal_error(culprits, f"the weight gather of optimizer step {self.steps_taken}")

    def close(self) -> None:
        """Finish any running gather and take qzero's hooks off the model and its parameters
        (gradient reduction, gather-ahead). The parameters stay views into the flat buffers;
        the optimizer must not be used afterwards."""
        if self.ahead is not None:
            self.ahead.remove()
        for grads in self.grads:
            grads.remove()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients. ``set_to_none`` (the default, as in torch) frees the fp32 gradient
        shards until the next backward's first reduction (or its end, where sums wait in a
        landing shard: [Note: landing shard] in grads.py), so they do not add to the forward's
        memory peak; ``False`` zeroes them in place."""
        for grads in self.grads:
            grads.zero(set_to_none)
        self._backward_ran = self._stepped = False
        self._interrupted = None

    @torch.no_grad()
    def gather_exact_weights(self) -> None:
        """Make every replica's weights the exact bf16/fp16 rounding of the fp32 masters
        (for evaluation or export); the next ``step()`` gathers as configured again. With
        delta gathers this is an exact resync: the next differences are taken against it."""
        self.wait_for_weights()
        if self.config.check_finite:
            self._check_finite([g.master for g in self.groups], "weights", "nothing was gathered, so no replica "
                               "received them", self.groups[0].dtype)
        for g in self.groups:
            g.gather_exact()

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, path: str) -> None:
        """Save fp32 masters, optimizer state and loss scale with torch.distributed.checkpoint
        (reshardable: load at any world size). Collective: call on every rank."""
        self.wait_for_weights()
        save_to(self, path)

    def load_checkpoint(self, path: str) -> None:
        """Load a checkpoint written by :meth:`save_checkpoint` at any world size, then
        rebuild the flat buffers from the masters. Collective: call on every rank."""
        self.wait_for_weights()
        load_from(self, path)
        self.guard.snapshot()

    def state_dict(self) -> dict:
        """A torch.distributed.checkpoint state dict: sharded fp32 masters and optimizer state."""
        self.wait_for_weights()
        return sharded_state_dict(self)

    # ------------------------------------------------------------------ helpers

    def _any_rank(self, flag: torch.Tensor) -> bool:
        flag = flag.to(torch.float32).reshape(1)
        if self.world_size > 1:
            with peer_failure("the optimizer step's exchange of a flag"):
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)
        return bool(flag.item())

    # [Note: masters the model's dtype cannot hold] A master is fp32; the replicas hold its
    # rounding to the model's dtype, and a finite fp32 value above that dtype's largest (65,504
    # for fp16, about 3.39e38 for bf16) rounds to Inf. Every gather that converts the masters
    # (the plain one, INT8/INT4 and FP8 weights, a delta run's exact resync,
    # gather_exact_weights) is therefore preceded, with check_finite, by a check of the
    # masters' extremes rounded to the model's dtype, on the same single all-reduce as the
    # finite check: it raises on every rank, naming the parameter and the value, before
    # anything travels (delta gathers refuse such a difference on their own, [Note: delta loop]).
    # A sliced update (Adam/AdamW) is checked before it runs; there a master beyond half the
    # dtype's range makes the step update whole and check the masters after, so that an
    # update (about lr per step) cannot carry a master past the limit unseen.

    def _check_finite(self, shards: list[torch.Tensor], what: str, consequence: str,
                      dtype: torch.dtype | None = None) -> None:
        """Raise on every rank, naming the parameters, if any of ``shards`` (one per group,
        laid out like the master shards) holds NaN/Inf, or (``dtype``) a value whose rounding
        to ``dtype`` is not finite ([Note: masters the model's dtype cannot hold])."""
        # One pass per shard with no temporaries (min/max propagate NaN; Inf shows as an
        # extreme, and so does a value that overflows dtype) and one host sync for all groups;
        # names are looked up only on failure.
        extremes = torch.stack([torch.stack(torch.aminmax(s)) for s in shards])
        if dtype is not None:
            extremes = extremes.to(dtype)
        if not self._any_rank(~torch.isfinite(extremes).all()):
            return
        first_bad = []
        for g, s in zip(self.groups, shards):
            bad = (~torch.isfinite(s if dtype is None else s.to(dtype))).nonzero()
            at = bad[0, 0] if bad.numel() else None
            first_bad.append(torch.stack([(g.lo + at).double(), s[at].double()]) if at is not None
                             else torch.tensor([-1.0, 0.0], dtype=torch.float64, device=s.device))
        mine = torch.stack(first_bad)
        rows = [mine.clone() for _ in range(self.world_size)]
        if self.world_size > 1:
            with peer_failure("the optimizer step's exchange of non-finite values"):
                dist.all_gather(rows, mine, group=self.process_group)
        culprits, overflow = [], []
        for r, row in enumerate(rows):
            for gi, (idx, value) in enumerate(row.tolist()):
                if idx >= 0:
                    g = self.groups[gi]
                    idx = int(idx)
                    slot = next((s for s in g.layout.slots if s.start <= idx < s.stop), None)
                    name = g.names[slot.index] if slot is not None else f"padding at flat index {idx}"
                    culprits.append(f"{name!r} (group {gi}, rank {r}'s shard)")
                    if math.isfinite(value):
                        overflow.append(f"{name!r} (group {gi}, rank {r}'s shard: {value:g})")
        step = self.steps_taken + 1
        advice = ("Lower the learning rate, clip gradients (gradient_clipping) or use fp16 loss scaling, and resume "
                  "from a checkpoint.")
        if len(overflow) == len(culprits):  # finite in fp32, beyond what dtype holds
            raise FloatingPointError(
                f"qzero: {what} at optimizer step {step} overflow the model's dtype {dtype} (largest finite "
                f"{torch.finfo(dtype).max:g}) in {', '.join(overflow)}: they would arrive as Inf in every "
                f"replica; {consequence}. {advice}")
        raise FloatingPointError(
            f"qzero: non-finite {what} at optimizer step {step} in {', '.join(culprits)}; {consequence}. {advice}")

    def _global_norm(self, shards: list[torch.Tensor], also: torch.Tensor | None = None):
        """L2 norm of the whole gradient (every element lives in exactly one shard), and the sum
        over ranks of the scalar ``also`` (None without it), taken by the same all-reduce."""
        sq = torch.stack(torch._foreach_norm(shards)).pow(2).sum().reshape(1)  # no full-size temporaries
        if also is not None:
            sq = torch.cat([sq, also.reshape(1).to(sq.dtype)])
        if self.world_size > 1:
            with peer_failure("the optimizer step's gradient norm"):
                dist.all_reduce(sq, group=self.process_group)
        return sq[0].sqrt(), (sq[1] if also is not None else None)

    def __repr__(self) -> str:
        numel = sum(g.layout.used_numel for g in self.groups)
        return (
            f"ZeroOptimizer(stage={self.config.stage}, world_size={self.world_size}, params={numel:,}, "
            f"quantized={self.config.zero_quantized_weights}, delta={self.config.zero_quantized_weights_delta}, "
            f"inner={type(self.optimizer).__name__})"
        )


# ---------------------------------------------------------------------- construction checks


def _split_groups(model: torch.nn.Module, param_groups: Iterable[dict] | None):
    """``[(params, hyperparameters)]`` in model order, and a name for every parameter."""
    names = {}
    for n, p in model.named_parameters():
        names.setdefault(p, n)
    trainable = [p for p in names if p.requires_grad]
    if param_groups is None:
        groups = [(trainable, {})]
    else:
        groups, seen = [], set()
        for i, g in enumerate(param_groups):
            if not isinstance(g, dict) or "params" not in g:
                raise TypeError(f"param_groups[{i}] must be a dict with a 'params' entry, got {g!r}")
            params = list(g["params"])
            for p in params:
                if p not in names:
                    raise ValueError(f"param_groups[{i}] holds a tensor that is not a parameter of the model")
                if not p.requires_grad:
                    raise ValueError(f"param_groups[{i}] holds frozen parameter {names[p]!r}")
                if p in seen:
                    raise ValueError(f"parameter {names[p]!r} appears in more than one parameter group")
                seen.add(p)
            order = {p: k for k, p in enumerate(trainable)}
            groups.append((sorted(params, key=order.__getitem__), {k: v for k, v in g.items() if k != "params"}))
        missing = [names[p] for p in trainable if p not in seen]
        if missing:
            raise ValueError(f"trainable parameters missing from param_groups: {missing[:5]}")
    for i, (params, _) in enumerate(groups):
        if not params:
            raise ValueError(f"parameter group {i} has no trainable parameters")
    return groups, names


def _check_flattenable(groups, names, config: ZeroConfig, world: int) -> None:
    first = groups[0][0][0]
    for params, _ in groups:
        for p in params:
            if p.device != first.device:
                raise ValueError(
                    f"parameters live on several devices ({first.device} and {p.device} for {names[p]!r}); "
                    "qzero flattens them into one buffer per device and needs one device"
                )
            if p.dtype != first.dtype:
                raise ValueError(
                    f"parameters have several dtypes ({first.dtype} and {p.dtype} for {names[p]!r}); "
                    "cast the model to one dtype (bf16 or fp16) first"
                )
    if first.device.type == "meta":
        raise ValueError(f"parameter {names[first]!r} is on the meta device (it has no values to train): "
                         "materialize the model first (model.to_empty(device=...), then initialize or load it)")
    if first.dtype not in FLAT_DTYPES:
        raise ValueError(f"parameters of dtype {first.dtype} cannot be flattened; use bf16 or fp16")
    if config.zero_quantized_weights and first.dtype == torch.float32:
        raise ValueError(
            "zero_quantized_weights needs bf16 or fp16 parameters, got fp32: quantizing an fp32 gather "
            "gains nothing over casting to bf16 and loses precision"
        )
    depth = OVERLAP_DEPTH if config.overlap_param_gather else 1
    if config.allgather_bucket_size < depth * world * config.zero_quantized_weights_group_size:
        raise ValueError(
            f"allgather_bucket_size {config.allgather_bucket_size} is smaller than one group per rank "
            f"({world} x {config.zero_quantized_weights_group_size})"
            + (f" for each of the {depth} chunks gather-ahead keeps in flight" if depth > 1 else "")
        )


def _check_launched_world(world: int, process_group) -> None:
    """Refuse world size 1 where a launcher says the job has more ranks (``WORLD_SIZE`` > 1, as
    torchrun sets it) and no process group exists: each process would train a model of its own,
    silently, instead of sharding one."""
    declared = os.environ.get("WORLD_SIZE", "")
    if world == 1 and process_group is None and declared.isdigit() and int(declared) > 1:
        raise RuntimeError(
            f"WORLD_SIZE={declared} says this job has {declared} ranks, but no process group exists, so each "
            "process would train its own model at world size 1: call torch.distributed.init_process_group() "
            "before building the ZeroOptimizer (or pass process_group=)")


#: Hyperparameters a torch optimizer takes as numbers (a string there fails inside torch).
_NUMERIC_HYPERPARAMETERS = ("lr", "weight_decay", "eps", "momentum", "dampening", "alpha", "betas")


def _build_inner(optimizer: Callable[..., torch.optim.Optimizer], groups: list[dict]) -> torch.optim.Optimizer:
    """``optimizer(groups)``. A hyperparameter given as a string is refused by name; an error the
    factory raises is raised as a ``ValueError`` saying so, the factory's own error chained to it."""
    given = {**getattr(optimizer, "keywords", {}), **{k: v for g in groups for k, v in g.items() if k != "params"}}
    for key in _NUMERIC_HYPERPARAMETERS:
        value = given.get(key)
        if isinstance(value, str) or (isinstance(value, (tuple, list)) and any(isinstance(v, str) for v in value)):
            raise TypeError(f"the optimizer's {key}={value!r} is a string: give a number")
    try:
        return optimizer(groups)
    except Exception as e:
        name = getattr(optimizer, "__qualname__", None) or repr(optimizer)
        raise ValueError(f"the optimizer factory {name} raised {type(e).__name__} building the optimizer over the "
                         f"master shards: {e}") from e


def _delta_fields(config: ZeroConfig) -> dict[str, int]:
    """The delta settings as integers, by their ZeroConfig names (agreed on across ranks)."""
    return {
        "zero_quantized_weights_delta": int(config.zero_quantized_weights_delta),
        "zero_quantized_weights_format": 1 + sorted(WEIGHT_FORMATS).index(config.zero_quantized_weights_format),
        "zero_quantized_weights_group_size": config.zero_quantized_weights_group_size,
        "zero_quantized_weights_delta_resync_steps": config.zero_quantized_weights_delta_resync_steps,
    }


def _broadcast_module_state(model: torch.nn.Module, src: int, group, world: int) -> None:
    """Frozen parameters and buffers start equal everywhere too (as DDP does)."""
    if world == 1:
        return
    with torch.no_grad(), peer_failure("ZeroOptimizer: the broadcast of frozen parameters and buffers"):
        for p in model.parameters():
            if not p.requires_grad:
                dist.broadcast(p.data, src=src, group=group)
        for b in model.buffers():
            dist.broadcast(b, src=src, group=group)


def _model_digest(model: torch.nn.Module, groups) -> int:
    """Shapes and dtypes of the trainable groups, the frozen parameters and the buffers."""
    trainable = [[(tuple(p.shape), str(p.dtype)) for p in params] for params, _ in groups]
    frozen = [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters() if not p.requires_grad]
    buffers = [(n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers()]
    return digest(repr((trainable, frozen, buffers)))


def _exchange_hosts(model, group, world: int, error) -> list[tuple[int, int]] | None:
    """Every rank's host signature (None when this rank's group is unusable: the agreement then
    reports that error on every rank)."""
    if world == 1:
        return None
    try:
        first = next(iter(model.parameters()), None) if isinstance(model, torch.nn.Module) else None
        device = first.device if first is not None and first.device.type != "meta" else torch.device("cpu")
    except Exception:  # noqa: BLE001 - a broken model is reported by the checks that follow
        device = torch.device("cpu")
    return exchange_hosts(group, world, agreement_device(group, device))


def _topology(hosts, config: ZeroConfig) -> Topology:
    """The group's topology from the exchanged hosts and the settings (the same on every rank);
    refuses what two-level collectives cannot run, naming the setting to change."""
    if hosts is None:
        return Topology.flat(1)
    topology, warning = topology_from_hosts(hosts, config.ranks_per_node, config.hierarchical_collectives)
    if warning:
        warnings.warn(f"qzero: {warning}", stacklevel=4)
    if topology.two_level:
        where = f"two-level collectives ({topology.describe()}; hierarchical_collectives=false runs the flat ones)"
        if config.solo_reduce:
            raise ValueError(f"solo_reduce=true is not supported with {where}: set solo_reduce=false")
        if config.copy_engine_collectives:
            raise ValueError(f"copy_engine_collectives=true is not supported with {where}")
    elif config.zero_quantized_gradients_intra_node != "none" and topology.world > 1:
        raise ValueError(f"zero_quantized_gradients_intra_node={config.zero_quantized_gradients_intra_node!r} "
                         f"needs two-level collectives, and these are flat ({topology.describe()}): it quantizes "
                         "their node stage; set zero_quantized_gradients_intra_node='none'")
    return topology
