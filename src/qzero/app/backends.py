"""Training backends an arm of ``qzero train``/``qualify`` can use, behind one small interface.

* ``qzero`` — :class:`qzero.ZeroOptimizer` (plain or quantized gather, gather-ahead).
* ``deepspeed`` — DeepSpeed ZeRO-1/2 as users install it, unmodified (or, with
  ``zero_quantized_weights`` or, at stage 2, ``zero_quantized_gradients``, through
  :mod:`qzero.integrations.deepspeed`).
* ``fsdp2`` — PyTorch FSDP2, ``fully_shard`` per decoder layer and at the root with
  ``reshard_after_forward=False`` (its ZeRO-2-like mode; ``reshard_after_forward`` sets it),
  fp32 masters, bf16/fp16 compute; with ``zero_quantized_weights``, its weight all-gather carries
  qzero's INT8 groups, per parameter (:func:`qzero.fsdp.quantize_weight_gathers`) or, with
  ``fsdp_quantize="group"``, per ``fully_shard`` module through the gather engine
  (:func:`qzero.fsdp.quantize_group_gathers`); with ``zero_quantized_gradients``, its gradient
  reduce-scatter is quantized per ``fully_shard`` module (:func:`qzero.fsdp.quantize_group_reduces`).

Each backend builds the model itself (FSDP2 wants fp32 parameters, the others the
training dtype) and exposes ``model``, ``backward``, ``step`` (False when skipped),
``zero_grad``, ``grad_norm``, ``gathered_bytes`` and ``reduced_bytes`` (sent, plain: weight
gather and gradient reduction) of the last step,
``param_groups`` (the optimizer's, whose ``lr`` the training loop may set before a step),
``finish`` and ``flats`` (the replicated weight buffers whose bits must agree on every
rank; empty where nothing is replicated), ``sample(index)`` (weights at flat indices
into the parameters laid end to end, identical on every rank) and ``forward_only_done``
(after forwards with no backward, the held-out loss's: what a backward would have undone).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ..vocabulary import BACKENDS  # noqa: F401  (the names of the backends below; make_backend maps them)


class QZeroBackend:
    def __init__(self, settings, build, dtype, device):
        from ..optim import ZeroOptimizer

        self.model = build(dtype)
        # fused on CUDA, as the peers' arms use it (one kernel over each master shard)
        adamw = functools.partial(torch.optim.AdamW, lr=settings.lr, weight_decay=0.0, fused=device.type == "cuda")
        self.opt = ZeroOptimizer(self.model, adamw, config=settings.zero)

    def backward(self, loss):
        self.opt.backward(loss)

    def step(self) -> bool:
        return self.opt.step()

    def param_groups(self):
        return self.opt.param_groups

    def zero_grad(self):
        self.opt.zero_grad()

    def grad_norm(self):
        return self.opt.grad_norm  # a device tensor (read after the timed loop), or None

    def gathered_bytes(self):
        return sum(s.bytes_sent for s in self.opt.last_gather), sum(s.plain_bytes for s in self.opt.last_gather)

    def network(self) -> dict:
        """The topology the optimizer agreed on and what one node sent across the network in
        the last step, in bits per parameter (0 on one node)."""
        t = self.opt.topology
        return {"topology": t.describe(), "nodes": t.nodes, "ranks_per_node": t.ranks_per_node,
                "two_level": t.two_level, "bits_per_param_per_node_across_network": self.opt.network_bits_per_param()}

    def reduced_bytes(self):
        return sum(s.bytes_sent for s in self.opt.last_reduce), sum(s.plain_bytes for s in self.opt.last_reduce)

    def finish(self):
        self.opt.wait_for_weights()

    def forward_only_done(self):
        pass  # the forward changes nothing a backward resets

    def flats(self):
        return [g.flat for g in self.opt.groups]

    def sample(self, index):
        return _sample_params([p for p in self.model.parameters() if p.requires_grad], index, lambda p: p.detach())


#: The ZeroConfig fields the deepspeed backend passes into DeepSpeed's ``zero_optimization`` when
#: the weight gather / the gradient reduction is quantized (the adapter reads them by these names).
DS_WEIGHT_KEYS = ("zero_quantized_weights", "zero_quantized_weights_group_size", "zero_quantized_weights_format",
                  "small_param_numel", "overlap_param_gather", "gather_lookahead")
DS_GRADIENT_KEYS = ("zero_quantized_gradients", "zero_quantized_gradients_format",
                    "zero_quantized_gradients_group_size", "zero_quantized_gradients_rotation",
                    "zero_quantized_gradients_rotation_block", "small_param_numel")
#: Several nodes (qzero.ZeroConfig.ranks_per_node, .hierarchical_collectives): the DeepSpeed adapter's and
#: the qzero.fsdp group installers' too.
DS_TOPOLOGY_KEYS = ("ranks_per_node", "hierarchical_collectives")


class DeepSpeedBackend:
    def __init__(self, settings, build, dtype, device):
        import deepspeed

        from ..integrations import deepspeed as qds

        self.model = build(dtype)
        world = dist.get_world_size()
        zero = settings.zero
        config = {
            "train_micro_batch_size_per_gpu": settings.micro_batch,
            "gradient_accumulation_steps": settings.grad_accum,
            "train_batch_size": settings.micro_batch * settings.grad_accum * world,
            "bf16": {"enabled": dtype == torch.bfloat16},
            "fp16": {"enabled": dtype == torch.float16},
            "zero_optimization": {
                "stage": zero.stage,
                "allgather_bucket_size": zero.allgather_bucket_size,
                "reduce_bucket_size": zero.reduce_bucket_size,
                "overlap_comm": True,
                "contiguous_gradients": True,
            },
        }
        # qzero's keys in the DeepSpeed config are ZeroConfig's field names, with its values; gather-ahead
        # (overlap_param_gather) as for the qzero backend: on by default when quantized. Gradients: stage 2
        # only (checked by the settings), qzero.integrations.deepspeed_grads.
        for switch, names in ((zero.zero_quantized_weights, DS_WEIGHT_KEYS),
                              (zero.zero_quantized_gradients, DS_GRADIENT_KEYS)):
            if switch:
                config["zero_optimization"].update({name: getattr(zero, name) for name in names})
        if settings.offload_optimizer != "none":
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            config["zero_optimization"]["offload_optimizer"] = {
                "device": "cpu", "pin_memory": settings.offload_optimizer == "cpu_pinned"}
            # DeepSpeed's bf16/fp16 offload runs its own CPU Adam (AdamW with weight_decay=0 as below)
            inner = DeepSpeedCPUAdam(self.model.parameters(), lr=settings.lr, weight_decay=0.0, adamw_mode=True)
        else:
            fused = device.type == "cuda"
            inner = torch.optim.AdamW(self.model.parameters(), lr=settings.lr, weight_decay=0.0, fused=fused)
        init = qds.initialize if zero.zero_quantized_weights or zero.zero_quantized_gradients else deepspeed.initialize
        # several nodes: qzero's keys, checked by its initialize (DeepSpeed's own refuses them)
        if init is qds.initialize:
            config["zero_optimization"].update({name: getattr(zero, name) for name in DS_TOPOLOGY_KEYS})
        self.engine, self.opt, _, _ = init(model=self.model, optimizer=inner, config=config)
        self.grad_accum = settings.grad_accum
        self.stage = zero.stage

    def backward(self, loss):
        # DeepSpeed divides by the accumulation steps itself; the caller already did.
        self.engine.backward(loss * self.grad_accum)

    def step(self) -> bool:
        self.engine.step()
        return not getattr(self.opt, "overflow", False)

    def param_groups(self):
        return self.opt.param_groups  # DeepSpeed's ZeRO optimizer hands its inner optimizer's groups

    def zero_grad(self):
        pass  # engine.step() clears the gradients at the accumulation boundary

    def grad_norm(self):
        return self.engine.get_global_grad_norm()  # a tensor or a number (read after the timed loop), or None

    def gathered_bytes(self):
        stats = getattr(self.engine, "qzero_gather", None)
        last = getattr(stats, "last_stats", None) if stats is not None else None
        if last:
            return sum(s.bytes_sent for s in last), sum(s.plain_bytes for s in last)
        plain = sum(f.numel() * f.element_size() for f in self.opt.bit16_groups_flat) // dist.get_world_size()
        return plain, plain

    def reduced_bytes(self):
        # The elements other ranks own, in the gradient dtype (DeepSpeed reduces in the
        # parameters' dtype here), once per micro-batch at stage 2 and once per step at stage 1.
        n = sum(f.numel() * f.element_size() for f in self.opt.bit16_groups_flat)
        world = dist.get_world_size()
        plain = n * (world - 1) // world * (self.grad_accum if self.stage == 2 else 1)
        return plain, plain

    def finish(self):
        gather = getattr(self.engine, "qzero_gather", None)
        if gather is not None:
            gather.wait_for_weights()

    def forward_only_done(self):
        pass  # the forward changes nothing a backward resets

    def flats(self):
        return list(self.opt.bit16_groups_flat)

    def sample(self, index):
        return _sample_params([p for p in self.model.parameters() if p.requires_grad], index, lambda p: p.detach())


class FSDP2Backend:
    def __init__(self, settings, build, dtype, device):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.model = build(torch.float32)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        zero = settings.zero
        group = zero.zero_quantized_weights and settings.fsdp_quantize == "group"
        if zero.zero_quantized_weights and not group:
            from ..fsdp import quantize_weight_gathers

            quantize_weight_gathers(
                self.model,
                zero_quantized_weights_format=zero.zero_quantized_weights_format,
                zero_quantized_weights_group_size=zero.zero_quantized_weights_group_size,
                small_param_numel=zero.small_param_numel,
                mesh=mesh,
            )
        if not group:
            self._bytes = _fsdp2_gather_bytes(self.model, settings, mesh.size())
        reduce = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(zero.reduce_dtype, dtype)
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce)
        reshard = settings.reshard_after_forward
        for layer in getattr(getattr(self.model, "model", None), "layers", []):
            fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(self.model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        if group:
            from ..fsdp import quantize_group_gathers

            report = quantize_group_gathers(
                self.model,
                zero_quantized_weights_format=zero.zero_quantized_weights_format,
                zero_quantized_weights_group_size=zero.zero_quantized_weights_group_size,
                small_param_numel=zero.small_param_numel,
                quant_kernels=zero.quant_kernels,
                **{name: getattr(zero, name) for name in DS_TOPOLOGY_KEYS},
            )
            self._bytes = _group_gather_bytes(report, settings)
        self._reduce_comms = []
        if zero.zero_quantized_gradients:
            from ..fsdp import quantize_group_reduces

            quantize_group_reduces(
                self.model,
                zero_quantized_gradients_format=zero.zero_quantized_gradients_format,
                zero_quantized_gradients_group_size=zero.zero_quantized_gradients_group_size,
                zero_quantized_gradients_rotation=zero.zero_quantized_gradients_rotation,
                zero_quantized_gradients_rotation_block=zero.zero_quantized_gradients_rotation_block,
                small_param_numel=zero.small_param_numel,
                quant_kernels=zero.quant_kernels,
                **{name: getattr(zero, name) for name in DS_TOPOLOGY_KEYS},
            )
            self._reduce_comms = [m._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm
                                  for m in self.model.modules() if hasattr(m, "_get_fsdp_state")]
        self._reduce_seen = (0, 0)
        self._reduce_last = (0, 0)
        fused = device.type == "cuda"
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=settings.lr, weight_decay=0.0, fused=fused)
        self._norm = None
        self._reduce_bytes = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}[reduce]
        self._grad_accum = settings.grad_accum

    def backward(self, loss):
        loss.backward()

    def step(self) -> bool:
        # The norm from the local gradient shards and one scalar all-reduce (gathering full
        # gradients would add a whole extra collective to the peer's step); read after timing.
        local = [p.grad.to_local().float().pow(2).sum() for p in self.model.parameters() if p.grad is not None]
        if local:
            sq = torch.stack(local).sum()
            dist.all_reduce(sq)
            self._norm = sq.sqrt()
        if self._reduce_comms:  # what the quantized reduce-scatters sent in this step's backwards
            now = (sum(c.bytes_sent for c in self._reduce_comms), sum(c.plain_bytes for c in self._reduce_comms))
            self._reduce_last = (now[0] - self._reduce_seen[0], now[1] - self._reduce_seen[1])
            self._reduce_seen = now
        self.opt.step()
        return True

    def param_groups(self):
        return self.opt.param_groups

    def zero_grad(self):
        self.opt.zero_grad(set_to_none=True)

    def grad_norm(self):
        return self._norm

    def gathered_bytes(self):
        return self._bytes

    def reduced_bytes(self):
        if self._reduce_comms:  # quantize_group_reduces: counted by its reduce-scatters, last step
            return self._reduce_last
        # one reduce-scatter per micro-batch: the elements other ranks own, in the reduce dtype
        world = dist.get_world_size()
        n = sum(p.numel() for p in self.model.parameters()) * self._reduce_bytes
        plain = n * (world - 1) // world * self._grad_accum
        return plain, plain

    def finish(self):
        pass

    def forward_only_done(self):
        # With reshard_after_forward=False a forward leaves the weights unsharded for its
        # backward, which reshards them; with no backward they are resharded here (the next
        # forward gathers them again, as it would after a training step).
        from torch.distributed.fsdp import FSDPModule

        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def flats(self):
        return []  # sharded: no replicated weight buffer to compare

    def sample(self, index):
        params = [p for p in self.model.parameters() if p.requires_grad]
        return _sample_params(params, index, lambda p: p.detach().full_tensor())


def _fsdp2_gather_bytes(model, settings, world: int) -> tuple[int, int]:
    """(sent, plain) bytes one rank puts into FSDP2's weight all-gathers in a step: every
    parameter once in forward, the decoder layers' again in backward when they are resharded
    after forward; parameters marked for the quantized gather as qzero's payload, the others
    at 2 bytes an element (bf16/fp16)."""
    from ..fsdp.tensor import QuantizedGatherTensor, carries
    from ..layout.gather_planner import quantized_payload_layout

    zero = settings.zero
    layers = getattr(getattr(model, "model", None), "layers", [])
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    sent = plain = 0
    for p in {id(p): p for p in model.parameters()}.values():
        times = 2 if settings.reshard_after_forward and id(p) in in_layers else 1
        full = tuple(p.shape) or (1,)
        shard = -(-full[0] // world) * (p.numel() // full[0] if full[0] else 0)
        mine = shard * 2
        if isinstance(p, QuantizedGatherTensor) and carries(full, world):
            mine = quantized_payload_layout(shard, zero.zero_quantized_weights_group_size,
                                            zero.zero_quantized_weights_format).nbytes
        sent += times * mine
        plain += times * shard * 2
    return sent, plain


def _group_gather_bytes(report, settings) -> tuple[int, int]:
    """(sent, plain) bytes one rank puts into FSDP2's weight all-gathers in a step with
    :func:`qzero.fsdp.quantize_group_gathers`, counted as :func:`_fsdp2_gather_bytes` counts
    them: every group once in forward, the decoder layers' again in backward when they are
    resharded after forward."""
    sent = plain = 0
    for g in report.groups:
        times = 2 if settings.reshard_after_forward and g.module else 1
        sent += times * g.bytes_sent
        plain += times * g.plain_bytes
    return sent, plain


def _sample_params(params, index: torch.Tensor, materialise) -> torch.Tensor:
    """Elements at ``index`` of the parameters laid end to end, as fp32 on the CPU."""
    out, offset = [], 0
    for p in params:
        n = p.numel()
        mine = index[(index >= offset) & (index < offset + n)] - offset
        if mine.numel():
            out.append(materialise(p).reshape(-1)[mine.to(p.device)].float().cpu())
        offset += n
    return torch.cat(out) if out else torch.empty(0)


def make_backend(settings, build, dtype, device):
    kinds = {"qzero": QZeroBackend, "deepspeed": DeepSpeedBackend, "fsdp2": FSDP2Backend}
    return kinds[settings.backend](settings, build, dtype, device)
