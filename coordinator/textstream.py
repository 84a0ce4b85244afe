"""Turning committed token ids into streamed text, and stopping before any stop string.

Text is released only when it can no longer turn into a stop string and when it does not end in a
partial UTF-8 character, so a client never sees text that a later token retracts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Release:
    """What may be streamed now: new tokens and text, and whether a stop string ended generation."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    stopped: bool = False
    # Index in the output of the first of ``token_ids``.
    start: int = 0


class TextStream:
    """Incremental detokenizer with stop-string handling for one request's output."""

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self._tokenizer = tokenizer
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.tokens: list[int] = []
        self.text = ""
        self._sent_tokens = 0
        self._sent_text = 0

    def _decode(self, tokens: list[int]) -> str:
        return self._tokenizer.decode(tokens, skip_special_tokens=True)

    def push(self, tokens: list[int]) -> Release:
        """Adds committed tokens; returns what may be streamed (everything up to a stop string)."""
        self.tokens.extend(tokens)
        self.text = self._decode(self.tokens)
        if any(s in self.text for s in self._stop):
            return self._cut_at_stop(len(self.tokens) - len(tokens))
        safe = len(self.text) - self._hold
        if self.text.endswith("\ufffd"):
            safe = min(safe, len(self.text.rstrip("\ufffd")))
        return self._release(len(self.tokens), max(safe, self._sent_text))

    def skip(self, tokens: list[int], sent_tokens: int, sent_chars: int) -> None:
        """Restarts a stream a client lost: ``tokens`` were committed, and the client already holds
        the first ``sent_tokens`` of them (or of tokens still to come) and ``sent_chars`` characters
        of text, so nothing it holds is released again."""
        self.push(tokens)
        self._sent_tokens, self._sent_text = sent_tokens, sent_chars

    def finish(self) -> Release:
        """Releases whatever was held back (generation ended without a stop string)."""
        return self._release(len(self.tokens), len(self.text))

    def _cut_at_stop(self, first_new: int) -> Release:
        # Find the first token whose text completes a stop string, so output ends right there.
        for i in range(first_new, len(self.tokens)):
            text = self._decode(self.tokens[: i + 1])
            hits = [pos for pos in (text.find(s) for s in self._stop) if pos >= 0]
            if hits:
                del self.tokens[i + 1 :]
                self.text = text[: min(hits)]
                break
        return self._release(len(self.tokens), len(self.text), stopped=True)

    def _release(self, n_tokens: int, n_chars: int, stopped: bool = False) -> Release:
        out = Release(
            self.tokens[self._sent_tokens : n_tokens], self.text[self._sent_text : n_chars], stopped, self._sent_tokens
        )
        # max(): after a resume the client may hold more than has been committed again so far.
        self._sent_tokens, self._sent_text = max(n_tokens, self._sent_tokens), max(n_chars, self._sent_text)
        return out
