"""What a target forward pass costs as a function of how many token rows it feeds.

The target measures every pass and keeps a moving average per row count. Sessions use the curve to
choose their draft length under load (``coordinator.adaptive``): a draft token is worth verifying
only while what it is expected to add outweighs what its row adds to a pass every session in the
batch waits for.
"""

from __future__ import annotations

import bisect


class PassCosts:
    """Moving averages of pass milliseconds by rows fed, interpolated between measured sizes."""

    def __init__(self, smoothing: float = 0.2) -> None:
        self._smoothing = smoothing
        self._ms: dict[int, float] = {}
        self._sizes: list[int] = []  # measured row counts, sorted
        self._warmup: PassCosts | None = None  # warm-up's figures, until serving measures a pass

    def record(self, rows: int, ms: float, warmup: bool = False) -> None:
        """Folds in one pass over ``rows`` rows that took ``ms`` milliseconds (``warmup``: measured
        before serving, see the module's docstring)."""
        if rows <= 0:
            return
        if warmup:
            self._warmup = self._warmup or PassCosts(self._smoothing)
            self._warmup.record(rows, ms)
            return
        if rows not in self._ms:
            self._ms[rows] = ms
            bisect.insort(self._sizes, rows)
        else:
            self._ms[rows] += self._smoothing * (ms - self._ms[rows])

    def predict(self, rows: int) -> float | None:
        """Expected milliseconds of a pass over ``rows`` rows; None before any measurement.

        Between measured sizes the cost is interpolated; past the largest it grows along the slope of
        the two largest (never downwards); below the smallest it is the smallest's cost.
        """
        sizes = self._sizes
        if not sizes:
            return self._warmup.predict(rows) if self._warmup is not None else None
        if rows in self._ms:
            return self._ms[rows]
        at = bisect.bisect_left(sizes, rows)
        if at == 0:
            return self._ms[sizes[0]]
        if at == len(sizes):
            if len(sizes) == 1:
                return self._ms[sizes[-1]]
            lo, hi = sizes[-2], sizes[-1]
            slope = max(0.0, (self._ms[hi] - self._ms[lo]) / (hi - lo))
            return self._ms[hi] + slope * (rows - hi)
        lo, hi = sizes[at - 1], sizes[at]
        weight = (rows - lo) / (hi - lo)
        return self._ms[lo] + weight * (self._ms[hi] - self._ms[lo])

    def curve(self, other_rows: int, own_rows: int) -> list[float]:
        """Predicted pass ms when this session feeds 1 .. ``own_rows`` rows beside ``other_rows``.

        Never decreasing: a row more never makes a pass cheaper, whatever noise the averages hold.
        """
        out: list[float] = []
        for n in range(1, own_rows + 1):
            ms = self.predict(other_rows + n)
            if ms is None:
                return []
            out.append(max(ms, out[-1]) if out else ms)
        return out
