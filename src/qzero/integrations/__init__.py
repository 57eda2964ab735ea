"""Adapters that put qzero's quantized post-step weight gather into other trainers.

* :mod:`qzero.integrations.deepspeed` — DeepSpeed ZeRO-1/2 (``initialize``, ``enable``).
* :mod:`qzero.integrations.hf` — a ``transformers`` ``TrainerCallback`` for the HF Trainer.

Neither DeepSpeed nor ``transformers`` is imported here: install ``qzero[deepspeed]``
and import the submodule you need.
"""
