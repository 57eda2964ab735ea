"""The wire: everything that moves weights or gradients between ranks.

[Note: the wire]
One role per file; a name here means the same thing everywhere in qzero.

* ``chunks.py`` — the chunk unit: pack one rank's slice of a chunk into its payload, the
  all-gather of the payloads, unpack every rank's payload into the flat buffer. The only
  code that touches payload bytes; FSDP2's per-parameter shards use it too. A
  ``GatherCache`` keeps what running a plan derives, for the context that runs it.
* ``engine.py`` — the gather engine: ``start_gather(...) -> GatherHandle`` runs a
  :class:`~qzero.layout.GatherPlan` chunk by chunk, one loop whatever the schedule,
  ``finish_gather(handle)`` ends it (``[Note: the gather engine]``).
* ``comm.py`` — the public gathers (``qzero.all_gather``, ``qzero.quantized_all_gather``):
  argument checks, the rank agreement, then the engine; also ``agree_or_raise``, the one
  exchange every entry point runs before its first collective, and ``GatherStats``.
* ``overlap.py`` — gather-ahead: forward pre-hooks that wait on a :class:`GatherHandle`
  chunk by chunk (``[Note: reads wait]``).
* ``quantized_reduce.py`` — the quantized gradient exchange: one all-to-all of quantized
  pieces per bucket, summed by each piece's owner.
* ``agreement.py`` — what the ranks agree on, as fields and digests (``[Note: agreement]``).
* ``labels.py`` — the profiler labels every way in marks its work with (``[Note: profiler labels]``).
* ``copy_engine.py`` — the copy-engine (zero-SM) process group and symmetric buffers that
  the gather's chunks and the gradient all-to-all may run on.

What it may import: torch, :mod:`qzero.quant` (formats and kernels), :mod:`qzero.layout` and
:mod:`qzero.buckets` (the plans) and :mod:`qzero.config`; never :mod:`qzero.optim`, :mod:`qzero.fsdp`,
:mod:`qzero.integrations` or :mod:`qzero.app`, which sit above it (the layering rule is in
``docs/design.md`` and checked by ``tests/test_layering.py``).
"""
