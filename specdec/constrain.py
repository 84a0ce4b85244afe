"""Structured output in the services: a session's grammar state at its committed tokens, and the
masking of logits by it.

A constrained request (``Sampling.response_format``) has its grammar (``specdec.grammar``) applied
to the turn's output, the committed tokens from ``Sampling.output_start`` on. Both services keep a
``SessionGrammar`` with each session cache; ``grammar_at`` brings it to the committed tokens a call
names (advancing it with the new ones, or rebuilding it from the output when the committed tokens
were rewritten or the cache is new). ``mask_logits`` then sets the logits of disallowed tokens to
-inf after the penalties and before temperature, top-k and top-p, so that greedy's argmax, the
target's p (acceptance, residual, bonus, coupled draws) and the draft's q are all the constrained
ones.

Tokens committed after an end token lie outside the document (the coordinator ends the turn at the
end token, but a verify may commit draft tokens past it): the state takes them without advancing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from specdec.grammar import GrammarCompiler, GrammarMatcher, ResponseFormat
from specdec.sampling_params import Sampling


@dataclass
class SessionGrammar:
    """One session's grammar state: ``matcher`` after the output tokens ``seen``."""

    key: str
    output_start: int
    matcher: GrammarMatcher
    seen: list[int] = field(default_factory=list)

    def advance(self, tokens: Sequence[int]) -> None:
        """Takes committed output ``tokens``; ValueError naming the response format where the grammar
        refuses one (the state then holds the tokens before it)."""
        for token in tokens:
            if not self.matcher.ended:
                try:
                    self.matcher.advance(token)
                except ValueError:
                    raise ValueError(
                        f"sampling.response_format: committed token {token} at output position {len(self.seen)} "
                        "breaks the format"
                    ) from None
            self.seen.append(token)


def grammar_at(
    held: SessionGrammar | None, compiler: GrammarCompiler, sampling: Sampling, committed: Sequence[int]
) -> SessionGrammar:
    """The session's grammar state after ``committed``: ``held`` advanced by the tokens it has not
    seen when it is of this format and its tokens are a prefix of the output, else a fresh state built
    from the whole output (a new cache, a new turn, or committed tokens a sync rewrote).

    The compile is cached by the compiler; ValueError naming ``sampling.response_format`` when the
    format does not compile.
    """
    output = list(committed[sampling.output_start :])
    if (
        held is None
        or held.key != sampling.response_format
        or held.output_start != sampling.output_start
        or output[: len(held.seen)] != held.seen
    ):
        fmt = ResponseFormat.from_key(sampling.response_format)
        try:
            matcher = compiler.matcher(fmt)
        except ValueError as error:
            raise ValueError(f"sampling.response_format: {error}") from None
        held = SessionGrammar(sampling.response_format, sampling.output_start, matcher)
    held.advance(output[len(held.seen) :])
    return held


def mask_logits(logits: torch.Tensor, masks: np.ndarray) -> torch.Tensor:
    """``logits [n, V]`` with -inf where ``masks [n, >= V]`` (bool) is False.

    A row the grammar leaves all False follows a token it refuses (or an end token): no rule commits a
    token from it, since the refused token is rejected first, so it is left as it was rather than
    turned into a row of -inf whose softmax is NaN. Mask columns past ``V`` (a draft whose vocabulary
    is narrower than the grammar's) are ignored.
    """
    allowed = torch.from_numpy(masks[:, : logits.shape[-1]]).to(logits.device)  # [n, V]
    dead = ~allowed.any(dim=-1, keepdim=True)  # [n, 1]
    return logits.float().masked_fill(~(allowed | dead), float("-inf"))
