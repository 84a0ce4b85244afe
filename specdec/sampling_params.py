"""A request's sampling settings, apart from the sampling math so that the coordinator needs no torch."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

# The smallest temperature a request may sample at: below it the logits divided by it can overflow
# float32 and the distribution turns to NaN. Where a near-greedy answer is wanted, 0 asks for greedy.
MIN_TEMPERATURE = 1e-4
# The same bound as the wire's float32 carries it, so that a client sending exactly 1e-4 passes.
_MIN_TEMPERATURE_F32 = struct.unpack("f", struct.pack("f", MIN_TEMPERATURE))[0]
# OpenAI's bounds: presence and frequency penalties in [-2, 2], a logit bias in [-100, 100].
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
# Most tokens one request may bias (OpenAI's limit is 300): every row of every pass adds them.
MAX_LOGIT_BIAS_TOKENS = 300


@dataclass(frozen=True)
class Sampling:
    """Sampling settings of one request; ``temperature == 0`` means greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    # Draw each token with noise keyed by (seed, position), so that no draft can change the output
    # (``specdec.sampling.verify_coupled``); a seeded request's tokens then replay exactly anywhere.
    coupled: bool = False
    # OpenAI's penalties over the turn's output so far (``specdec.sampling.penalize_logits``):
    # logits[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's (and transformers') repetition penalty over prompt and output: a seen token's logit is
    # divided by it when positive, multiplied by it when not. 1 is off.
    repetition_penalty: float = 1.0
    # (token id, bias) pairs added to the logits before everything else, sorted by token id.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Committed position where the turn's output begins: the frequency and presence penalties count
    # the committed tokens from here on (and the draft tokens of the path being scored).
    output_start: int = 0
    # Structured output: ``specdec.grammar.ResponseFormat.key()`` ("" for none). Its grammar's mask
    # zeroes p and q outside the allowed tokens, after the penalties (``specdec.constrain``).
    response_format: str = ""

    @property
    def greedy(self) -> bool:
        """True when tokens are argmax picks rather than draws."""
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """True when penalties or a logit bias transform the logits (both sides, identically)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias
        )

    @property
    def constrained(self) -> bool:
        """True when a grammar masks the logits (both sides, identically)."""
        return bool(self.response_format)


# Most alternatives a logprobs request may ask for per token (OpenAI's limit for top_logprobs).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """A committed token's log probability under the target and its ``top`` alternatives
    ((token id, logprob) pairs, likeliest first, ties in index order)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def check_sampling(temperature: float, top_k: int, top_p: float, prefix: str = "") -> None:
    """Raises a ValueError naming the first setting (``prefix`` + field) that no exact sampling can use.

    ``temperature`` is 0 (greedy) or finite and at least MIN_TEMPERATURE; NaN and infinity are refused
    (infinity over a top-k's masked logits gives NaN too).
    """
    if not (temperature == 0.0 or _MIN_TEMPERATURE_F32 <= temperature < math.inf):
        raise ValueError(f"{prefix}temperature: must be 0 (greedy) or a finite value of at least {MIN_TEMPERATURE}")
    if top_k < 0:
        raise ValueError(f"{prefix}top_k: must be >= 0")
    if not 0 < top_p <= 1:
        raise ValueError(f"{prefix}top_p: must lie in (0, 1]")


def check_penalties(
    presence: float,
    frequency: float,
    repetition: float,
    logit_bias: dict[int, float] | tuple[tuple[int, float], ...],
    vocab_size: int | None,
    prefix: str = "",
) -> None:
    """Raises a ValueError naming the first penalty setting (``prefix`` + field) out of range.

    Presence and frequency penalties lie in [-2, 2] (OpenAI's range), the repetition penalty in
    (0, 2] (1 off), and each biased token id in [0, ``vocab_size``) (None: only >= 0) with a bias in
    [-100, 100].
    """
    for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise ValueError(f"{prefix}{name}: must lie in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")
    if not 0 < repetition <= MAX_PENALTY:
        raise ValueError(f"{prefix}repetition_penalty: must lie in (0, {MAX_PENALTY:g}]; 1 is off")
    pairs = logit_bias.items() if isinstance(logit_bias, dict) else logit_bias
    if len(pairs) > MAX_LOGIT_BIAS_TOKENS:
        raise ValueError(f"{prefix}logit_bias: at most {MAX_LOGIT_BIAS_TOKENS} tokens")
    for token, bias in pairs:
        if token < 0 or vocab_size is not None and token >= vocab_size:
            raise ValueError(f"{prefix}logit_bias: token id {token} is not in the vocabulary [0, {vocab_size})")
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise ValueError(f"{prefix}logit_bias: the bias of token {token} must lie in [-100, 100]")
