"""Models and gradients shared by the two-level collective tests (tests/test_two_level*.py)."""

from __future__ import annotations

import torch

#: Parameter shapes of :class:`Chosen`: matrices that split across partitions, and parameters of at
#: most ``SMALL`` elements that travel exactly.
SHAPES = [(40, 24), (7,), (24, 36), (5,), (3, 50), (300,), (6,), (48, 20)]
SMALL = 40
GS = 16


class Chosen(torch.nn.Module):
    """``loss = sum(p * c)``: every parameter's gradient is its coefficient ``c``."""

    def __init__(self):
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s, dtype=torch.bfloat16)) for s in SHAPES])

    def forward(self, coeffs):
        return sum((p.float() * c).sum() for p, c in zip(self.ps, coeffs))


def coeffs(rank: int, micro: int) -> list[torch.Tensor]:
    """Rank ``rank``'s gradients of micro-batch ``micro``: bf16 values, exact in fp32 sums."""
    g = torch.Generator().manual_seed(7919 * rank + 104729 * micro + 1)
    return [(torch.randint(-127, 128, s, generator=g).float() * torch.pow(2.0, torch.randint(-6, 1, s, generator=g)))
            .to(torch.bfloat16).float() for s in SHAPES]


def flat_of(res, per_param) -> torch.Tensor:
    """``per_param`` placed in a flat fp64 buffer at ``res["slots"]`` (``(start, numel, ...)``)."""
    f = torch.zeros(res["numel"], dtype=torch.float64)
    for (start, n, *_), c in zip(res["slots"], per_param):
        f[start:start + n] = c.reshape(-1).double()
    return f


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 40),
                               torch.nn.LayerNorm(40), torch.nn.Linear(40, 8)).to(torch.bfloat16)
