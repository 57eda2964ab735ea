"""``qzero train``: train the embedded workload with ZeroOptimizer and record what happened.

:func:`launch` runs :func:`train_worker` on every rank, either in processes it
starts itself (gloo on CPU, NCCL with one GPU per rank) or, under torchrun, in the
current process. Rank 0 writes a JSON record of the run: per-step losses, global
gradient norms and step times, a sample of the final weights (values and hash),
whether all replicas hold bit-identical weights, peak memory and bytes gathered, and
(with ``heldout``) the held-out loss over the run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import resource
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..config import ZeroConfig
from ..layout.flat_layout import DEFAULT_SMALL_PARAM_NUMEL
from ..vocabulary import BACKENDS, PRECISIONS, RENAMED_SETTINGS, ZERO_ALIASES, refuse_renamed

SAMPLE_SIZE = 4096


@refuse_renamed(**RENAMED_SETTINGS)
@dataclass
class TrainSettings:
    """Everything that defines one training run (one arm of ``qzero qualify``): the workload,
    and in ``zero`` every setting of the ZeroOptimizer (or of a peer backend's counterpart).
    The settings of earlier releases (``engine``) are refused, naming the new one."""

    backend: str = "qzero"  # qzero | deepspeed | fsdp2 (peers, for side-by-side arms)
    preset: str = "tiny"
    model_config: str | None = None
    data: str | None = None
    world_size: int = 2
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "bf16"  # bf16 | fp16
    zero: ZeroConfig | dict = field(default_factory=dict)
    """A :class:`qzero.ZeroConfig`, used as it is, or a dict of its fields by name: the fields
    not named take ZeroConfig's defaults, except ``small_param_numel``, which takes the
    preset's own threshold (``qzero.app.workload.PRESETS``; 65,536 with ``model_config``).
    Always a ZeroConfig after construction (which validates it)."""
    reshard_after_forward: bool = False  # fsdp2 only: free unsharded layers after forward (gather again in backward)
    fsdp_quantize: str = "parameter"
    """fsdp2 with ``quantized`` only: how FSDP2's weight all-gather is quantized. ``parameter``:
    each parameter's fp32 master shard through FSDP2's per-parameter extension
    (:func:`qzero.fsdp.quantize_weight_gathers`); ``group``: each ``fully_shard`` module's whole
    all-gather buffer (the bf16/fp16 copies) through qzero's gather engine, one call per module
    (:func:`qzero.fsdp.quantize_group_gathers`, less host time per gather)."""
    # deepspeed only: none | cpu | cpu_pinned (DeepSpeedCPUAdam, fp32 state on the host)
    offload_optimizer: str = "none"
    seq_len: int = 64
    micro_batch: int = 4
    grad_accum: int = 1
    steps: int = 20
    warmup: int = 2
    lr: float = 1e-3
    lr_warmup: int = 0
    """Steps of linear learning-rate warmup: step k (counted from 1) trains at
    ``lr * k / lr_warmup`` while k <= lr_warmup, at ``lr`` after (0: ``lr`` from the first step).
    Not ``warmup``, which only leaves steps out of the timing. 0 <= lr_warmup <= steps."""
    seed: int = 0
    deterministic: bool = True  # CUDA: deterministic kernels, so arms of one setting reproduce exactly
    heldout: float = 0.0
    """The fraction of the data held out, its last bytes ([Note: held-out text] in
    :mod:`qzero.app.workload`): training batches are drawn from the rest only, and the held-out
    loss is measured on ``eval_sequences`` fixed windows of it. 0: nothing held out, the batches
    those of a run without this setting. 0 <= heldout < 1."""
    eval_every: int = 0
    """With ``heldout`` > 0: measure the held-out loss after every ``eval_every`` steps, and after
    the last step always (0: after the last step only). A step followed by a measurement is left
    out of ``step_times`` (its time would include it)."""
    eval_sequences: int = 32
    """The held-out windows (of ``seq_len + 1`` tokens each) the held-out loss is measured on,
    spread over the ranks (any count and world size)."""

    def __post_init__(self) -> None:
        if isinstance(self.zero, dict):
            self.zero = _zero_config(self.zero, self.preset, self.model_config)
        elif not isinstance(self.zero, ZeroConfig):
            raise TypeError(f"zero must be a ZeroConfig or a dict of its fields, got {type(self.zero).__name__}")


#: TrainSettings' own fields (the workload) and ZeroConfig's: the names :func:`settings_from` takes.
WORKLOAD_FIELDS = tuple(f.name for f in dataclasses.fields(TrainSettings) if f.name != "zero")
ZERO_FIELDS = tuple(f.name for f in dataclasses.fields(ZeroConfig))


def _zero_config(given: dict, preset: str, model_config: str | None) -> ZeroConfig:
    from .workload import PRESETS

    unknown = sorted(set(given) - set(ZERO_FIELDS))
    if unknown:
        raise ValueError(f"unknown ZeroConfig field(s) {', '.join(map(repr, unknown))}; "
                         f"known: {', '.join(ZERO_FIELDS)}")
    if "small_param_numel" not in given:  # the preset's threshold, unless set
        given = dict(given, small_param_numel=(
            PRESETS[preset].small_param_numel if preset in PRESETS and not model_config else DEFAULT_SMALL_PARAM_NUMEL
        ))
    return ZeroConfig(**given)


def setting_name(key: str) -> str | None:
    """The field a ``KEY=VALUE`` key names: a TrainSettings field, a ZeroConfig field, or the
    ZeroConfig field behind a short name (:data:`ZERO_ALIASES`); ``-`` reads as ``_``; None
    when it names none of them. A setting of an earlier release (:data:`RENAMED_SETTINGS`)
    raises ``ValueError`` naming the new one."""
    key = key.strip().replace("-", "_")
    if key in RENAMED_SETTINGS:
        new = RENAMED_SETTINGS[key]
        raise ValueError(f"setting {key!r} is now {new!r} ({new}: {', '.join(BACKENDS)}); did you mean {new}?")
    key = ZERO_ALIASES.get(key, key)
    return key if key in WORKLOAD_FIELDS or key in ZERO_FIELDS else None


def settings_from(given: dict) -> TrainSettings:
    """TrainSettings from one flat dict: its own fields and ZeroConfig's, by name or short
    name (:data:`ZERO_ALIASES`). A setting named twice (by both names) is refused."""
    own, zero = {}, {}
    for key, value in given.items():
        name = setting_name(key)
        if name is None:
            raise ValueError(f"unknown setting {key!r}; settings are {', '.join(WORKLOAD_FIELDS)}, ZeroConfig's fields "
                             f"({', '.join(ZERO_FIELDS)}) and their short names {', '.join(ZERO_ALIASES)}")
        target = own if name in WORKLOAD_FIELDS else zero
        if name in target:
            raise ValueError(f"setting {name!r} is given twice")
        target[name] = value
    return TrainSettings(**own, zero=zero)


def flat_settings(settings: TrainSettings | dict) -> dict:
    """Settings as one flat dict: TrainSettings' own fields and ZeroConfig's, by name. Takes a
    TrainSettings, or a record's ``settings`` (``dataclasses.asdict``): today's, with ZeroConfig
    nested under ``zero``, or an older one's, with the ZeRO settings under their short names
    beside the others, the remaining ZeroConfig fields under ``extra_config``, and settings of
    their release's names (:data:`RENAMED_SETTINGS`: ``engine``, read as ``backend``)."""
    d = dataclasses.asdict(settings) if isinstance(settings, TrainSettings) else dict(settings)
    zero = d.pop("zero", None) or {}
    extra = d.pop("extra_config", None) or {}
    out = {}
    for key, value in d.items():
        out[RENAMED_SETTINGS.get(key, ZERO_ALIASES.get(key, key))] = value
    out.update(extra)
    out.update(zero)
    if out.get("overlap_param_gather", False) is None:  # older records: not resolved yet
        out["overlap_param_gather"] = out.get("zero_quantized_weights") is True
    return out


def resolve_device(settings: TrainSettings) -> str:
    if settings.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return settings.device


#: DeepSpeed optimizer offload of the deepspeed backend (``cpu_pinned``: page-locked host buffers).
OFFLOAD_OPTIMIZER = ("none", "cpu", "cpu_pinned")
#: How the fsdp2 backend quantizes its weight all-gather (TrainSettings.fsdp_quantize).
FSDP_QUANTIZE = ("parameter", "group")


def validate(settings: TrainSettings) -> None:
    """Check what can be checked before any process starts (raises WorkloadError)."""
    from .workload import WorkloadError, check_corpus, load_corpus, model_config

    _check_sizes(settings)  # first: the other checks read them
    model_config(settings.preset, settings.model_config)
    corpus = load_corpus(settings.data)
    check_corpus(corpus, settings.seq_len)
    device = resolve_device(settings)
    if device == "cuda":
        if not torch.cuda.is_available():
            raise WorkloadError("--device cuda was asked for, but no CUDA device is visible")
        if settings.world_size > torch.cuda.device_count() and "RANK" not in os.environ:
            raise WorkloadError(
                f"world size {settings.world_size} is larger than the {torch.cuda.device_count()} visible GPU(s)"
            )

    _check_device_settings(settings, device)
    if settings.backend not in BACKENDS:
        raise WorkloadError(f"backend must be one of {', '.join(BACKENDS)}, got {settings.backend!r}")
    if settings.reshard_after_forward and settings.backend != "fsdp2":
        raise WorkloadError(f"reshard_after_forward is a setting of the fsdp2 backend, not of {settings.backend!r}")
    if settings.fsdp_quantize not in FSDP_QUANTIZE:
        raise WorkloadError(f"fsdp_quantize must be one of {', '.join(FSDP_QUANTIZE)}, got {settings.fsdp_quantize!r}")
    if settings.fsdp_quantize != "parameter" and (settings.backend != "fsdp2"
                                                  or not settings.zero.zero_quantized_weights):
        raise WorkloadError(f"fsdp_quantize={settings.fsdp_quantize} is a setting of the fsdp2 backend with "
                            f"quantized=true, not of backend {settings.backend!r} with quantized="
                            f"{str(settings.zero.zero_quantized_weights).lower()}")
    if settings.zero.zero_quantized_gradients and settings.backend == "deepspeed" and settings.zero.stage != 2:
        raise WorkloadError(f"zero_quantized_gradients with the deepspeed backend needs ZeRO stage 2, got stage "
                            f"{settings.zero.stage}: qzero's adapter quantizes DeepSpeed's partitioned gradient "
                            "reduction, which stage 1 does not run")
    if settings.zero.zero_quantized_gradients_error_feedback and settings.backend != "qzero":
        raise WorkloadError(f"zero_quantized_gradients_error_feedback is a setting of the qzero backend: its residuals "
                            f"are ZeroOptimizer state, which the {settings.backend} backend does not have")
    if settings.zero.zero_quantized_gradients_intra_node != "none" and settings.backend != "qzero":
        raise WorkloadError(f"zero_quantized_gradients_intra_node is a setting of the qzero backend: the "
                            f"{settings.backend} backend's gradient reduction has no quantized node stage")
    if settings.zero.zero_quantized_weights_delta and settings.backend != "qzero":
        raise WorkloadError(f"zero_quantized_weights_delta is a setting of the qzero backend: the {settings.backend} "
                            "backend's weight gather does not send delta payloads, so it would change nothing")
    if settings.zero.copy_engine_collectives and settings.backend != "qzero":
        raise WorkloadError(f"copy_engine_collectives is a setting of the qzero backend: it moves ZeroOptimizer's own "
                            f"gather and all-to-all, which the {settings.backend} backend does not run")
    if settings.zero.reduce_buckets_in_flight != ZeroConfig.reduce_buckets_in_flight and settings.backend != "qzero":
        raise WorkloadError(f"reduce_buckets_in_flight is a setting of the qzero backend: it bounds "
                            f"ZeroOptimizer's own gradient reductions, which the {settings.backend} backend "
                            "does not run")
    if settings.offload_optimizer not in OFFLOAD_OPTIMIZER:
        raise WorkloadError(f"offload_optimizer must be one of {', '.join(OFFLOAD_OPTIMIZER)}, "
                            f"got {settings.offload_optimizer!r}")
    if settings.offload_optimizer != "none" and settings.backend != "deepspeed":
        raise WorkloadError(f"offload_optimizer is a setting of the deepspeed backend, not of {settings.backend!r}")
    if settings.precision not in PRECISIONS:
        raise WorkloadError(f"precision must be one of {', '.join(PRECISIONS)}, got {settings.precision!r}")
    lr = settings.lr
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
        raise WorkloadError(f"lr must be a finite number >= 0, got {lr!r}")
    warm = settings.lr_warmup
    if isinstance(warm, bool) or not isinstance(warm, int) or not 0 <= warm <= settings.steps:
        raise WorkloadError(f"lr_warmup must be a whole number of steps from 0 to steps ({settings.steps}), "
                            f"got {warm!r}")
    if settings.steps < 2:
        raise WorkloadError(
            f"steps must be at least 2 (a step is timed up to the next one's start), got {settings.steps}"
        )
    if settings.warmup < 0 or settings.warmup > settings.steps - 2:
        raise WorkloadError(
            f"warmup {settings.warmup} leaves no timed step of {settings.steps} (a step is timed up to the next "
            f"one's start, so the last is never timed): use --warmup {max(0, settings.steps - 2)} or fewer, "
            f"or more --steps"
        )
    _check_heldout(settings, corpus)
    if not isinstance(settings.zero, ZeroConfig):  # set after construction
        raise WorkloadError(f"zero must be a ZeroConfig, got {type(settings.zero).__name__}")


#: The largest value of each count of the workload: far beyond a run of the embedded workload,
#: bounded so that nothing is sized or started from an absurd one.
SIZE_BOUNDS = {"world_size": 4096, "seq_len": 2**20, "micro_batch": 2**16, "grad_accum": 2**16, "steps": 10**8}


def _check_sizes(settings: TrainSettings) -> None:
    """Every count of the workload a whole number in its range, checked before anything derived from them."""
    from .workload import WorkloadError

    for name, most in SIZE_BOUNDS.items():
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
            raise WorkloadError(f"{name.replace('_', '-')} must be a whole number from 1 to {most:,}, got {value!r}")


def _check_device_settings(settings: TrainSettings, device: str) -> None:
    """ZeroConfig settings that need CUDA, refused on the CPU before any rank starts (the
    optimizer would refuse them inside every rank)."""
    from .workload import WorkloadError

    if device == "cuda":
        return
    if settings.zero.gather_schedule == "streams":
        raise WorkloadError("gather_schedule=streams needs CUDA (side streams ordered by events); on the CPU use "
                            "inline or auto")
    if settings.zero.copy_engine_collectives and settings.backend == "qzero":  # others: refused by backend
        raise WorkloadError("copy_engine_collectives=true needs CUDA and NCCL (the GPU's copy engines); on the CPU "
                            "leave it false")


def _check_heldout(settings: TrainSettings, corpus: torch.Tensor) -> None:
    """``heldout``, ``eval_every`` and ``eval_sequences``, and both parts of the split corpus."""
    from .workload import WorkloadError, split_corpus

    heldout = settings.heldout
    if isinstance(heldout, bool) or not isinstance(heldout, (int, float)) or not 0 <= heldout < 1:
        raise WorkloadError(f"heldout must be a fraction of the data, 0 <= heldout < 1, got {heldout!r}")
    for name, least in (("eval_every", 0), ("eval_sequences", 1)):
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise WorkloadError(f"{name} must be an integer >= {least}, got {value!r}")
    if settings.eval_every and not heldout:
        raise WorkloadError(f"eval_every {settings.eval_every} measures the held-out loss, but heldout is 0 (nothing "
                            "held out): set heldout > 0, or drop eval_every")
    if heldout and not _timed_steps(settings):
        raise WorkloadError(f"eval_every {settings.eval_every} measures the held-out loss after every step from "
                            f"warmup {settings.warmup} on, which leaves no step of {settings.steps} timed (a step "
                            "followed by a measurement is not): raise eval_every or --steps")
    split_corpus(corpus, heldout, settings.seq_len)


def _evaluates_after(settings: TrainSettings, step: int) -> bool:
    """Whether the held-out loss is measured after ``step`` (0-based)."""
    if not settings.heldout:
        return False
    every = settings.eval_every
    return step == settings.steps - 1 or (every > 0 and (step + 1) % every == 0)


def _timed_steps(settings: TrainSettings) -> list[int]:
    """The steps (0-based) whose times ``step_times`` holds: from ``warmup`` on, the last one left
    out (nothing starts after it to end its time), and those followed by a held-out measurement
    (their time would include it)."""
    return [j for j in range(settings.warmup, settings.steps - 1) if not _evaluates_after(settings, j)]


#: Bytes each parameter needs at the least in any backend: its 16-bit weight on every rank, and
#: its fp32 master and AdamW's two fp32 moments once across the ranks (gradients, activations
#: and buffers come on top).
WEIGHT_BYTES, STATE_BYTES = 2, 12
#: What a CPU rank's process holds at the least besides the model (the interpreter and torch).
PROCESS_BYTES = 256 * 2**20


def check_fits(settings: TrainSettings) -> int:
    """Count the model's parameters from its config (built on the meta device: nothing is
    allocated) and refuse, naming the model, one whose weights and optimizer state alone
    cannot fit: :data:`WEIGHT_BYTES` a parameter on every rank plus :data:`STATE_BYTES` split
    over the ranks, against one GPU's memory per rank, or against the host's memory for all
    the ranks this host runs on the CPU. Returns the count. (Run once, before the ranks start:
    it is not part of :func:`validate`, which every arm and every torchrun rank repeats.)"""
    from .workload import WorkloadError, count_parameters, model_config

    where = f"--model-config {settings.model_config}" if settings.model_config else f"--preset {settings.preset}"
    config = model_config(settings.preset, settings.model_config, max_positions=max(4096, settings.seq_len))
    positions = getattr(config, "max_position_embeddings", None)
    if settings.model_config and positions is not None and positions < settings.seq_len:
        raise WorkloadError(f"{where}: max_position_embeddings {positions} is shorter than "
                            f"--seq-len {settings.seq_len}")
    params = count_parameters(config, where)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun else settings.world_size
    per_rank = params * (WEIGHT_BYTES + STATE_BYTES / world)
    if resolve_device(settings) != "cuda":
        per_rank += PROCESS_BYTES  # each CPU rank is a process of its own on this host
    if resolve_device(settings) == "cuda":
        have, ranks, what = torch.cuda.get_device_properties(0).total_memory, 1, "one GPU has {}"
    else:
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if under_torchrun else world
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        what = "this host has {} of memory" + (f" for its {ranks} ranks" if ranks > 1 else "")
    if per_rank * ranks > have:
        need = f"{_size(per_rank)} a rank" + (f", {_size(per_rank * ranks)} in all" if ranks > 1 else "")
        raise WorkloadError(
            f"{where}: {params:,} parameters need at least {need} ({WEIGHT_BYTES} bytes a parameter on every rank, "
            f"{STATE_BYTES} split over {world} rank(s)"
            + (f", and {_size(PROCESS_BYTES)} for each rank's process" if resolve_device(settings) != "cuda" else "")
            + f"); {what.format(_size(have))}"
        )
    return params


def _size(n: float) -> str:
    for unit, size in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"


# ---------------------------------------------------------------------- one rank


def lr_at(settings: TrainSettings, step: int) -> float:
    """The learning rate of step ``step`` (counted from 0): ``settings.lr`` after a linear warmup
    over the first ``settings.lr_warmup`` steps."""
    if step < settings.lr_warmup:
        return settings.lr * (step + 1) / settings.lr_warmup
    return settings.lr


def train_worker(settings: TrainSettings, out_path: str | None, show_progress: bool = True) -> dict | None:
    """Run the training loop on this rank (process group already initialised)."""
    from .heldout import heldout_loss
    from .workload import global_batch, heldout_windows, split_corpus

    rank, world = dist.get_rank(), dist.get_world_size()
    device_kind = resolve_device(settings)
    device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if device_kind == "cuda"
              else torch.device("cpu"))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    backend, corpus = build_backend(settings, device)
    corpus, held = split_corpus(corpus, settings.heldout, settings.seq_len)  # heldout 0: the whole corpus
    windows = heldout_windows(held, settings.eval_sequences, settings.seq_len) if settings.heldout else None
    heldout_losses, heldout_seconds = [], 0.0
    model = backend.model
    loss_sums, norms, marks, skipped, gathered = [], [], [], 0, []
    bar = _progress(settings.steps) if rank == 0 and show_progress else None
    per_step = world * settings.micro_batch * settings.grad_accum
    # A step's time runs from its start to the next step's start on the compute stream (CUDA
    # events; host clock on the CPU), with no synchronisation in between: a gather that runs
    # ahead into the next forward is then counted where it costs, as in real training (a
    # device-wide sync per step would serialise it back into its own step). Losses and norms
    # are read after the loop. The last step is not timed (nothing starts after it), nor is a
    # step followed by a held-out measurement (its time would include it: _timed_steps); the
    # wall time of the measured steps includes the measurements (heldout_seconds: their time).
    # The device-wide synchronisation before the measured steps is taken at the start of the
    # last warm-up step, not of the first measured one: a gather that runs ahead would finish
    # during it, and the first measured step's forward would then wait for nothing, shorter
    # than any step of a run. The wall time runs from the first measured step's mark to the
    # synchronisation after the last step (the last gather included).
    _sync(device)
    for step in range(settings.steps):
        if step == settings.warmup - 1:
            _sync(device)
        batch = global_batch(corpus, step, per_step, settings.seq_len, settings.seed)
        mine = batch.view(settings.grad_accum, world, settings.micro_batch, -1)[:, rank].to(device)
        marks.append(_mark(device))
        loss_sum = torch.zeros((), device=device, dtype=torch.float32)
        for m in range(settings.grad_accum):
            tokens = mine[m]
            logits = model(input_ids=tokens[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
            ) / settings.grad_accum
            backend.backward(loss)
            loss_sum += loss.detach()
        if settings.lr_warmup:
            for group in backend.param_groups():
                group["lr"] = lr_at(settings, step)
        took = backend.step()
        gathered.append(backend.gathered_bytes())
        backend.zero_grad()
        loss_sums.append(loss_sum)
        norm = backend.grad_norm()
        norms.append(norm.detach().clone() if torch.is_tensor(norm) else norm)
        skipped += not took
        if show_progress:  # the mean over ranks, as in the summary; waits for this step (arms run without it)
            mean = loss_sum.detach().clone()
            dist.all_reduce(mean)
            if bar is not None:
                sent, plain = backend.gathered_bytes()
                bar.update(mean.item() / world, _seconds(marks[-1], _mark(device)), plain - sent)
        if _evaluates_after(settings, step):  # between this step's mark and the next one's
            began = time.perf_counter()
            backend.finish()  # a gather running ahead lands first: the forward reads this step's weights
            heldout_losses.append([step + 1, heldout_loss(model, windows, settings.micro_batch, device)])
            backend.forward_only_done()
            heldout_seconds += time.perf_counter() - began  # the loss is read on the host: the measurement is done
    if bar is not None:
        bar.close()
    _sync(device)
    wall = _seconds(marks[settings.warmup], _mark(device))  # warmup <= steps - 2: its mark exists
    times = [_seconds(marks[j], marks[j + 1]) for j in _timed_steps(settings)]
    totals = torch.stack(loss_sums)
    dist.all_reduce(totals)
    losses = (totals / world).tolist()
    norms = [None if n is None else float(n) for n in norms]
    backend.finish()  # gather-ahead: the last step's gather may still be in flight
    result = _summary(settings, backend, losses, norms, times, skipped, device, gathered[settings.warmup :] or gathered)
    # steps [warmup, steps) back to back between two synchronisations, the last one's gather included
    result["wall_seconds"], result["wall_steps"] = wall, settings.steps - settings.warmup
    # [steps completed, loss] of every held-out measurement; None: nothing held out
    result["heldout_losses"] = heldout_losses if settings.heldout else None
    result["heldout_seconds"] = heldout_seconds if settings.heldout else None
    if rank == 0 and out_path:
        tmp = out_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, out_path)
    return result if rank == 0 else None


def build_backend(settings: TrainSettings, device: torch.device):
    """``(backend, corpus)`` of one rank: the device made current (and deterministic when
    ``settings.deterministic``), the model built from its config on ``device``, wrapped by
    ``settings.backend``."""
    from .backends import make_backend
    from .workload import build_model, load_corpus, model_config

    if device.type == "cuda":
        torch.cuda.set_device(device)
        if settings.deterministic:
            make_deterministic()
    dtype = torch.bfloat16 if settings.precision == "bf16" else torch.float16
    corpus = load_corpus(settings.data)
    config = model_config(settings.preset, settings.model_config, max_positions=max(4096, settings.seq_len))
    return make_backend(settings, lambda dt: build_model(config, dt, device, settings.seed), dtype, device), corpus


def make_deterministic() -> None:
    """Deterministic CUDA kernels (cuBLAS workspace, no atomics-based reductions) so that two
    runs of one setting produce the same bits; ops without such a kernel warn."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mark(device: torch.device):
    """A point on the compute stream's timeline (CUDA event) or the host clock (CPU)."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _seconds(a, b) -> float:
    """Seconds between two marks (waits for ``b`` on CUDA)."""
    if isinstance(a, float):
        return b - a
    b.synchronize()
    return a.elapsed_time(b) / 1e3


def replicas_identical(flats: list[torch.Tensor], chunk: int = 1 << 26) -> bool:
    """Compare every rank's flat buffers with rank 0's, bit for bit, a bounded chunk at a time."""
    same = torch.ones((), dtype=torch.int32, device=flats[0].device)
    for f in flats:
        bits = f.detach().view(torch.uint8)  # every backend broadcasts bytes
        bits = bits.view(torch.int32) if bits.numel() % 4 == 0 else bits
        for start in range(0, bits.numel(), chunk):
            piece = bits[start : start + chunk].clone()
            dist.broadcast(piece, src=0)
            same &= torch.equal(piece, bits[start : start + chunk])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item())


def sample_index(total: int, size: int = SAMPLE_SIZE) -> torch.Tensor:
    """The same ``size`` (sorted, distinct) indices into the parameters laid end to end, in every run."""
    return torch.randint(0, total, (size,), generator=torch.Generator().manual_seed(1234)).unique()


def _summary(settings, backend, losses, norms, times, skipped, device, gathered=None) -> dict:
    """``gathered``: ``(sent, plain)`` weight-gather bytes per rank of every measured step; their
    means are the per-step figures (a delta arm's exact resyncs send more than its other steps).
    None: the last step's."""
    params = [p for p in backend.model.parameters() if p.requires_grad]
    total = sum(p.numel() for p in params)
    sample = backend.sample(sample_index(total))
    flats = backend.flats()
    gathered = gathered or [backend.gathered_bytes()]
    sent, plain = (_mean([step[i] for step in gathered]) for i in (0, 1))
    grad_sent, grad_plain = backend.reduced_bytes()
    peak_alloc, peak_reserved, total_mem = _memory(device)
    return {
        "settings": dataclasses.asdict(settings),
        "world_size": dist.get_world_size(),
        "process_group_backend": dist.get_backend(),  # torch.distributed's; settings.backend is the training backend
        "losses": losses,
        "grad_norms": norms,
        "step_times": times,
        "skipped_steps": skipped,
        "sample": sample.tolist(),
        "sample_hash": hashlib.sha256(sample.numpy().tobytes()).hexdigest(),
        # None where the backend keeps no replicated weights (FSDP2): nothing to compare
        "replicas_identical": replicas_identical(flats) if flats else None,
        "peak_allocated_bytes": peak_alloc,
        "peak_reserved_bytes": peak_reserved,
        "device_memory_bytes": total_mem,
        "memory_kind": "cuda allocator" if device.type == "cuda" else "process peak RSS (CPU)",
        "bytes_sent_per_step": sent,
        "plain_bytes_per_step": plain,
        # every rank's weight-gather bytes over the model's parameters: bytes on the wire per parameter
        "weight_bytes_per_param": sent * dist.get_world_size() / total if total else None,
        "grad_bytes_sent_per_step": grad_sent,
        "grad_plain_bytes_per_step": grad_plain,
        # the qzero backend's topology and bits per parameter a node sent across the network
        "network": backend.network() if hasattr(backend, "network") else None,
        "params": total,
    }


def _mean(values: list) -> int | float:
    """The mean, as an integer when it is one (every step the same)."""
    m = sum(values) / len(values)
    return int(m) if m == int(m) else m


def _memory(device: torch.device) -> tuple[int, int, int]:
    if device.type == "cuda":
        return (
            torch.cuda.max_memory_allocated(device),
            torch.cuda.max_memory_reserved(device),
            torch.cuda.get_device_properties(device).total_memory,
        )
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return rss, rss, total


class _progress:
    """A one-line progress bar on stderr: loss, step time, bytes the gather saved."""

    def __init__(self, total: int):
        try:
            import threading

            from tqdm import tqdm

            # a thread lock, not tqdm's default multiprocessing one: a rank leaves with os._exit,
            # which would leave that lock's semaphore behind for the resource tracker to warn about
            tqdm.set_lock(threading.RLock())
            self._bar = tqdm(total=total, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            self._bar = None
        self._n, self._total = 0, total

    def update(self, loss: float, seconds: float, saved: int) -> None:
        self._n += 1
        text = f"loss {loss:.4f}  {1e3 * seconds:.0f} ms/step  saved {saved / 2**20:.2f} MiB/step"
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.update(1)
        else:
            print(f"\rstep {self._n}/{self._total}  {text}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        else:
            print(file=sys.stderr)


# ---------------------------------------------------------------------- launching


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(local_rank: int, settings: TrainSettings, port: int, out_path: str | None, show: bool,
             parent: int) -> None:
    from .launcher import forget_launcher
    from .orphans import die_with_parent

    die_with_parent(parent)  # a launcher killed outright (SIGKILL) takes its ranks with it
    forget_launcher()  # a rank of ours, not torchrun's ([Note: launcher variables] in launcher.py)
    device_kind = resolve_device(settings)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank), LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(settings.world_size),
    )
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if device_kind == "cuda" and settings.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS handle
    if device_kind == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // settings.world_size))
    else:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if device_kind == "cuda" else "gloo")
    try:
        train_worker(settings, out_path, show)
    finally:
        dist.destroy_process_group()
    # Done, record written: leave without the interpreter's finalization. Gloo's worker
    # threads can still hold tensors of finished collectives there, and freeing them while
    # the interpreter shuts down aborts the process now and then ("terminate called without
    # an active exception", SIGABRT), which would fail a run that succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(settings: TrainSettings, out_path: str | None = None, show_progress: bool = True) -> dict | None:
    """Run the training on ``settings.world_size`` ranks; return rank 0's record."""
    from .launcher import under_torchrun

    validate(settings)
    if under_torchrun():
        if not dist.is_initialized():
            kind = resolve_device(settings)
            if kind == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group("nccl" if kind == "cuda" else "gloo")
        settings = dataclasses.replace(settings, world_size=dist.get_world_size())
        return train_worker(settings, out_path, show_progress)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        path = out_path or os.path.join(tmp, "result.json")
        mp.start_processes(
            _spawned,
            args=(settings, _free_port(), path, show_progress, os.getpid()),
            nprocs=settings.world_size,
            start_method="spawn",
        )
        with open(path) as f:
            return json.load(f)
