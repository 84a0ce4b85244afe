"""What the sampled-speculation tests share (tests/test_penalties.py, tests/test_grammar_sampling.py):
fixed synthetic logits over a tiny vocabulary, the target engine's own verdict, the exact joint
distribution of a turn's first tokens, and Pearson's chi-square against it."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch

from target_service.engine import TargetEngine, VerifyCall


@cache
def prefix_logits(prefix: tuple[int, ...], salt: int, vocab: int) -> torch.Tensor:
    """Fixed logits ``[vocab]`` after ``prefix`` (of the generated tokens): a different function per salt."""
    g = torch.Generator().manual_seed(salt * 100_003 + sum((t + 1) * 7**i for i, t in enumerate(prefix)))
    return torch.randn(vocab, generator=g) * 1.2


def engine_verdict(call: VerifyCall, logits: torch.Tensor, committed: list[int], *grammar):
    """The target engine's own acceptance decision (it reads no engine state), under ``grammar`` if given."""
    return TargetEngine._verdict(TargetEngine.__new__(TargetEngine), call, logits, committed, *grammar)


def exact_joint(next_probs: Callable[[tuple[int, ...]], list[float]], vocab: int, positions: int) -> torch.Tensor:
    """``[vocab] * positions``: the joint distribution of the first ``positions`` tokens, enumerated
    from ``next_probs(prefix)``, the next token's distribution after the generated ``prefix``."""
    joint = torch.zeros((vocab,) * positions, dtype=torch.float64)
    for index in torch.cartesian_prod(*[torch.arange(vocab)] * positions).tolist():
        mass = 1.0
        for i in range(positions):
            mass *= next_probs(tuple(index[:i]))[index[i]]
        joint[tuple(index)] = mass
    return joint


def chi_square(counts: torch.Tensor, joint: torch.Tensor) -> tuple[float, float, float]:
    """Pearson's chi-square of ``counts`` against ``joint`` (cells expecting under 5 pooled), its 0.999
    quantile (Wilson-Hilferty), and the count in cells ``joint`` gives no mass."""
    expected = (joint * counts.sum()).flatten()
    observed = counts.flatten().double()
    impossible = float(observed[expected == 0].sum())
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big & (expected > 0)].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    chi2 = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return chi2, dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3, impossible
