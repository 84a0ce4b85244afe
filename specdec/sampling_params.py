"""A request's sampling settings, apart from the sampling math so that the coordinator needs no torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sampling:
    """Sampling settings of one request; ``temperature == 0`` means greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        """True when tokens are argmax picks rather than draws."""
        return self.temperature == 0.0
