"""Progress of distillation's long steps: a tqdm bar on a terminal, a log line now and then elsewhere.

Whether bars are drawn is decided once, at the edge (``DistillConfig.progress``: the CLI turns them on
when stderr is a terminal), because a bar redrawn into a log file or a CI console is noise.
"""

from __future__ import annotations

import logging
import time

from tqdm import tqdm

log = logging.getLogger(__name__)


class Progress:
    """Counts work done towards ``total`` (None: unknown). With ``bar`` it draws a tqdm bar; without,
    it logs a line with the count and the rate every ``log_every_s`` seconds and when closed."""

    def __init__(
        self, desc: str, unit: str, total: int | None, bar: bool, initial: int = 0, log_every_s: float = 30.0
    ) -> None:
        self.desc, self.unit, self.total = desc, unit, total
        self.count = initial
        self._initial = self._logged_count = initial
        self._started = self._logged = time.monotonic()
        self._log_every_s = log_every_s
        self._postfix: dict[str, str] = {}
        self._bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True) if bar else None

    def update(self, n: int) -> None:
        """Adds ``n`` units of work done."""
        self.count += n
        if self._bar is not None:
            self._bar.update(n)
        elif time.monotonic() - self._logged >= self._log_every_s:
            self._log()

    def set_total(self, total: int) -> None:
        """Changes the total (training fixes its step count after the first steps)."""
        self.total = total
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def set_postfix(self, **values: str) -> None:
        """Figures shown after the count (loss, agreement)."""
        self._postfix = dict(values)
        if self._bar is not None:
            self._bar.set_postfix(**values)

    def close(self) -> None:
        """Ends the bar, or logs the final count."""
        if self._bar is not None:
            self._bar.close()
        elif self.count > self._logged_count:  # the last count, unless a periodic line just said it
            self._log()

    def _log(self) -> None:
        self._logged, self._logged_count = time.monotonic(), self.count
        rate = (self.count - self._initial) / max(1e-9, self._logged - self._started)
        of = f"/{self.total}" if self.total else ""
        extra = "".join(f" {k}={v}" for k, v in self._postfix.items())
        log.info("%s: %d%s %s (%.1f %s/s)%s", self.desc, self.count, of, self.unit, rate, self.unit, extra)
