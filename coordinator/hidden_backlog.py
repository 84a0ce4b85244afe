"""The target hidden states a session's feature draft has not been sent yet.

Every verify reply carries the hidden rows of the positions it committed; they wait here until the
next draft call takes them all. While a session runs target-only (k = 0 under load, a draft outage)
nothing takes them, and the backlog grows a row or so a round. Joining the bytes on every round
would copy the whole backlog each time, so the copying would grow with the square of the stretch:
a round appends its rows as they came, and they are joined once, when sent.
"""

from __future__ import annotations

from coordinator.replicas import HiddenChunk


class HiddenBacklog:
    """Hidden rows in position order from ``start``, kept as the byte chunks they arrived in.

    Rows that continue or overlap the held ones join them (newer rows win); after a gap only the
    newer rows are kept, and the draft starts afresh from them. Past ``max_rows`` the oldest go, so a
    long draft outage never grows a message without bound. The bytes are passed on undecoded.
    """

    def __init__(self, first: HiddenChunk | None = None, max_rows: int = 2048) -> None:
        self._max_rows = max_rows
        self._chunks: list[bytes] = []
        self._start = 0
        self._dim = 0
        self._rows = 0
        self._joined: HiddenChunk | None = None
        self.add(first)

    def __len__(self) -> int:
        """Rows held."""
        return self._rows

    def add(self, new: HiddenChunk | None) -> None:
        """Takes in a reply's rows (None or empty: nothing)."""
        if new is None or not new.fp16:
            return
        row = 2 * new.dim
        end = self._start + self._rows
        if not self._rows or new.dim != self._dim or not self._start <= new.start <= end:
            self._chunks, self._start, self._dim, self._rows = [], new.start, new.dim, 0
        elif new.start < end:
            self._cut(new.start - self._start)
        self._chunks.append(new.fp16)
        self._rows += len(new.fp16) // row
        if self._rows > self._max_rows:
            self._drop_front(self._rows - self._max_rows)
        self._joined = None

    def message(self) -> HiddenChunk | None:
        """Every held row as one message (None when none is held); joined once until the next add."""
        if not self._rows:
            return None
        if self._joined is None:
            self._joined = HiddenChunk(self._start, self._dim, b"".join(self._chunks))
        return self._joined

    def clear(self) -> None:
        """Forgets every row: the draft has them."""
        self._chunks, self._rows, self._joined = [], 0, None

    def drop_before(self, position: int) -> None:
        """Forgets the rows of positions before ``position``: the draft holds them already (a fork's copy)."""
        drop = min(self._rows, position - self._start)
        if drop > 0:
            self._drop_front(drop)
            self._joined = None

    def _cut(self, keep: int) -> None:
        """Keeps the first ``keep`` rows."""
        row, kept, held = 2 * self._dim, [], 0
        for chunk in self._chunks:
            rows = len(chunk) // row
            if held + rows > keep:
                if keep > held:
                    kept.append(chunk[: (keep - held) * row])
                break
            kept.append(chunk)
            held += rows
        self._chunks, self._rows = kept, keep

    def _drop_front(self, drop: int) -> None:
        """Forgets the oldest ``drop`` rows."""
        row = 2 * self._dim
        self._start += drop
        self._rows -= drop
        while drop:
            rows = len(self._chunks[0]) // row
            if rows > drop:
                self._chunks[0] = self._chunks[0][drop * row :]
                break
            self._chunks.pop(0)
            drop -= rows
