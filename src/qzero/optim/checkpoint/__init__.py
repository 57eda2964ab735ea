"""Reshardable checkpoints of a ZeroOptimizer through torch.distributed.checkpoint.

What is saved, per parameter group, is world-size independent: the *logical* flat
buffer (the parameters back to back, without the tail padding) of the fp32 masters
and of every optimizer state tensor shaped like them, each rank writing the piece
its partition holds (a ShardedTensor). Scalar state (Adam's ``step``) is saved
replicated. A small JSON file beside it (``qzero.json``) records the parameter
names and shapes, the state's keys and the hyperparameters; it is checked before
anything is read, so a checkpoint of another model is refused by name.

A checkpoint directory is untrusted input. ``qzero.json`` is JSON, read bounded and checked
field by field (:mod:`qzero.optim.checkpoint.meta`), then against this optimizer: the optimizer
state it declares must be what the inner optimizer keeps ([Note: the state an optimizer
keeps]). DCP's index (``.metadata``, a pickle) is read once by
:mod:`qzero.optim.checkpoint.index`, which calls nothing while unpickling and rebuilds the
index from plain values; the tensors are read with ``torch.load(weights_only=True)`` from
the files and byte ranges that index names (:mod:`qzero.optim.checkpoint.reader`). A load puts
all of it in place on every rank, or nothing on any rank ([Note: all or nothing]); whatever the
checkpoint holds, a refusal is a ``ValueError`` that names the file and the field.

The package sits below the optimizer: ``optim/zero.py`` imports it, and it knows the optimizer
only as the protocols of :mod:`qzero.optim.checkpoint.protocol` ([Note: checkpoints know the
optimizer by its protocol]). Its modules, one role each:

* :mod:`~qzero.optim.checkpoint.protocol`: what checkpoint code uses of the optimizer, its flat
  groups and its residuals;
* :mod:`~qzero.optim.checkpoint.logical`: the logical buffer, and a partition's pieces of it as
  shards;
* :mod:`~qzero.optim.checkpoint.form`: the DCP state dict of a checkpoint, the replica of delta
  gathers ([Note: the replica in a checkpoint]);
* :mod:`~qzero.optim.checkpoint.residuals`: the error-feedback residuals' part of a checkpoint
  (saved, checked, loaded);
* :mod:`~qzero.optim.checkpoint.save`: writing one, aside then renamed into place, every rank
  hearing of rank 0's failure;
* :mod:`~qzero.optim.checkpoint.checks`: the refusals made before anything is read (another
  model, grouping or optimizer, [Note: the state an optimizer keeps], the index against both);
* :mod:`~qzero.optim.checkpoint.load`: the load ([Note: all or nothing]);
* :mod:`~qzero.optim.checkpoint.meta`, :mod:`~qzero.optim.checkpoint.index`,
  :mod:`~qzero.optim.checkpoint.reader`: ``qzero.json``, DCP's index and the tensor files,
  each read as untrusted input.
"""
