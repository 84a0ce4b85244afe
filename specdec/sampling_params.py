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

    @property
    def greedy(self) -> bool:
        """True when tokens are argmax picks rather than draws."""
        return self.temperature == 0.0


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
