"""How a draft picks each proposed token, and when it stops proposing.

Greedy requests take the argmax; sampled ones draw from the warped distribution with the round's
draft stream, and hand back that distribution as q (sparse), exactly what the token was drawn from.
Coupled ones (``Sampling.coupled``) draw with the noise of the token's sequence position, the noise
the target draws its own token with, so the two agree as often as their distributions allow.

The confidence cut-off (llama.cpp's ``p_min``, EAGLE-2's use of draft confidence) ends a proposal
early: before position i the draft multiplies its *confidence* so far by the highest probability of
its distribution at i, and stops when the product falls below ``min_confidence``. On the default
feature draft that probability is well calibrated (held-out greedy rounds: drafts with top
probability 0.2-0.4 were accepted 30% of the time, 0.8-1.0 about 90%), so the product estimates the
chance that every token so far is accepted, and a cheap round no longer carries unlikely tokens
while a confident one runs on.

The cut-off ends a proposal from its second token on, never before the first. Whether a round drafts
at all is the policy's choice (``coordinator.adaptive``), and by the first pick the call is paid for;
the first token then adds one verify row, the cheapest there is (the compiled pass pads a lone row to
two). Only proposed tokens are priced and judged, so a call cut before its first token costs its
round the call and teaches the policy nothing, which then keeps making such calls: seeded sampled
requests (coupled draws, whose top probabilities run low) got mostly empty ones.

The decision at position i reads only the distribution there, which depends on the prefix the
draft already holds, never on the token about to be drawn. So a sampled proposal of any length is
still drawn token by token from exactly the q it reports, and verification stays exact. (Stopping
on the drawn token's own probability would not: it would propose low-probability draws less often
than q says.)

A penalised request's logits pass through ``specdec.sampling.penalize_logits`` first, counting the
committed tokens and the tokens this proposal picked before the position, as the target counts them
on its side, so q stays as close to p as the draft can make it. A constrained request's logits are
then masked by the grammar (``specdec.constrain.mask_logits``) at the position, from its own copy of
the session's grammar state advanced by the tokens picked: the draft proposes only legal tokens, and
the q it reports is the masked q it drew from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdec.constrain import mask_logits
from specdec.grammar import GrammarMatcher
from specdec.sampling import (
    Sampling,
    coupled_token,
    dense_to_sparse,
    draw,
    penalize_logits,
    round_generator,
    warp_probs,
)

DRAFT_STREAM = 1


@dataclass(frozen=True)
class HeadLogits:
    """A reduced head's logits: ``logits [B, N]`` score the tokens ``ids [N]``, in increasing id order;
    every other token of the ``vocab``-token vocabulary is -inf, so q is exactly zero there.

    In id order the head's entries keep the full row's relative order, so a pick reads them as it
    would the full row: the argmax takes the lowest id of a tie, a top-p sort breaks ties alike, and
    one uniform lands on the same token of the cumulative sum.

    A plain pick reads these directly: the full ``[B, V]`` row (``full``) costs a fill and a scatter of
    the whole vocabulary, and warping it a top-k, a softmax and a cumulative sum over all V entries,
    about 0.5 ms a sampled draft token for the default draft's 8192 of 49152 tokens on 2 CPU cores.
    """

    logits: torch.Tensor
    ids: torch.Tensor
    vocab: int

    def row(self, index: int) -> HeadLogits:
        """Row ``index`` alone, as ``[1, N]``."""
        return HeadLogits(self.logits[index : index + 1], self.ids, self.vocab)

    def argmax(self) -> int:
        """Row 0's likeliest token (the lowest id of a tie, as the full row's argmax)."""
        return int(self.ids[int(self.logits[0].argmax())])

    def full(self) -> torch.Tensor:
        """The full-vocabulary logits ``[B, V]``, -inf outside the head."""
        out = self.logits.new_full((self.logits.shape[0], self.vocab), float("-inf"))  # [B, V]
        out[:, self.ids] = self.logits
        return out


@dataclass
class TokenPicker:
    """Picks one session's draft tokens for one round; ``None`` from a call means stop here."""

    sampling: Sampling
    round_index: int
    sample_top_k: int = 0
    min_confidence: float = 0.0
    confidence: float = 1.0
    """Product of the top probabilities at the positions picked so far."""
    position: int = 0
    """Sequence position of the next token picked (coupled sampling's noise is keyed by it)."""
    committed: Sequence[int] = ()
    """The session's committed tokens, which a penalised request's penalties count."""
    grammar: GrammarMatcher | None = None
    """A constrained request's grammar state after the committed tokens: the picker's own copy, which
    it advances by each token it picks."""
    cut_first: bool = False
    """Whether the cut-off may stop before the first token: for drafting ahead, whose tokens no call of
    the policy's asked for (see the module docstring)."""
    _generator: torch.Generator | None = field(default=None, init=False, repr=False)
    _picked: list[int] = field(default_factory=list, init=False, repr=False)

    def __call__(self, logits: torch.Tensor | HeadLogits) -> tuple[int, tuple[list[int], list[float]] | None] | None:
        """The token for draft logits ``[1, V]`` (or a reduced head's ``[1, N]``) and its sparse q (None for
        greedy), or None to stop."""
        ids = None  # the token each entry of the row scores: None, the entry's own index
        if isinstance(logits, HeadLogits):
            logits, ids = (logits.logits, logits.ids) if self._reads_head else (logits.full(), None)
        logits = penalize_logits(logits, self.sampling, self.committed, [self._picked])
        if self.grammar is not None:
            logits = mask_logits(logits, self.grammar.allowed()[None])
        picked = self._pick(logits, ids)
        if picked is not None:
            self._picked.append(picked[0])
            if self.grammar is not None and not self.grammar.ended:
                if self.grammar.is_allowed(picked[0]):
                    self.grammar.advance(picked[0])
                else:
                    self.grammar = None  # a row the grammar left dead: nothing after it can be accepted
        return picked

    @property
    def _reads_head(self) -> bool:
        """Whether a reduced head's logits pick the same way as the full row: no penalty or grammar
        rewrites the row, and no coupled draw reads noise indexed by the whole vocabulary."""
        return not (self.sampling.penalized or self.grammar is not None or self.sampling.coupled)

    def _pick(
        self, logits: torch.Tensor, ids: torch.Tensor | None = None
    ) -> tuple[int, tuple[list[int], list[float]] | None] | None:
        """The pick over ``logits [1, R]``, whose entry i scores token ``ids[i]`` (a head's row, in
        increasing id order: it picks as the full row does, see ``HeadLogits``) or token i (``ids``
        None: the full row)."""

        def token(index: int) -> int:
            return index if ids is None else int(ids[index])

        if self.sampling.greedy:
            index = int(logits[0].argmax())
            if self.min_confidence > 0 and not self._confident(torch.softmax(logits[0].float(), -1)[index]):
                return None
            return token(index), None
        probs = warp_probs(logits, self.sampling, extra_top_k=self.sample_top_k)[0]  # [R]
        if self.min_confidence > 0 and not self._confident(probs.max()):
            return None
        support, mass = dense_to_sparse(probs)  # entries in increasing order, so ids too
        q = (support if ids is None else ids[support].tolist(), mass)
        if self.sampling.coupled:  # only on the full row (``_reads_head``)
            self.position += 1
            return coupled_token(probs, self.sampling.seed, self.position - 1), q
        if self._generator is None:
            self._generator = round_generator(self.sampling.seed, self.round_index, DRAFT_STREAM)
        return token(draw(probs, self._generator)), q

    def _confident(self, top: torch.Tensor) -> bool:
        self.confidence *= float(top)
        # The first token is never cut (see the module docstring): only proposed tokens are priced
        # and judged, so an empty call would cost its round the call and teach the policy nothing.
        return (not self._picked and not self.cut_first) or self.confidence >= self.min_confidence


def take_next(pick, logits: torch.Tensor | HeadLogits, tokens: list[int], qs: list) -> bool:
    """Appends the token ``pick`` chooses for ``logits [1, V]`` (or a reduced head's row) to ``tokens``
    and its q (if any) to ``qs``; False, appending nothing, where the proposal stops."""
    picked = pick(logits)
    if picked is None:
        return False
    token, q = picked
    tokens.append(token)
    if q is not None:
        qs.append(q)
    return True
