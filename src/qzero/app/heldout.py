"""The held-out loss of ``qzero train``: the model's loss on text it never trains on.

The windows are fixed ([Note: held-out text] in :mod:`qzero.app.workload`); rank ``r`` of
``world`` evaluates the windows ``i`` with ``i % world == r``, in micro-batches, and one
all-reduce of ``(loss sum, token count)`` gives every rank the token-weighted mean over the
whole set, for any number of windows and ranks. Every rank runs the same number of forwards
(a rank with no window left runs one on a window it does not count): a sharded backend
(FSDP2) all-gathers its weights in each forward, so the ranks' forwards must pair up.

The forward is the training one (the backend's ``model`` as the training loop calls it; the
loop first finishes a weight gather that runs ahead, ``backend.finish()``, so the forward reads
the weights of the step just taken), under ``torch.no_grad()`` with the model in eval mode
(dropout off; the previous mode restored), the same cross-entropy on float logits. It draws no
random numbers: the training's generator is untouched.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def heldout_loss(model: torch.nn.Module, windows: torch.Tensor, micro_batch: int, device: torch.device) -> float:
    """The mean next-token cross-entropy over every predicted token of ``windows`` (``[n,
    seq_len + 1]``, the same on every rank), all ranks together; every rank gets it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = windows[rank::world]
    per_rank = -(-windows.shape[0] // world)
    forwards = max(1, -(-per_rank // micro_batch))
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, tokens
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for b in range(forwards):
                rows = mine[b * micro_batch : (b + 1) * micro_batch]
                counted = rows.shape[0] > 0
                tokens = (rows if counted else windows[:1]).to(device)
                logits = model(input_ids=tokens[:, :-1]).logits
                loss = torch.nn.functional.cross_entropy(
                    logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="sum"
                )
                if counted:
                    sums[0] += loss.double()
                    sums[1] += tokens[:, 1:].numel()
    finally:
        model.train(was_training)
    dist.all_reduce(sums)
    total, count = sums.tolist()
    return total / count
