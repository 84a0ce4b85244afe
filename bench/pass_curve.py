"""The target's pass cost by rows in each dtype, side by side in one process (``specdec pass-curve``).

Speculation rests on one premise: verifying k+1 rows costs about what one row costs. Whether it holds
depends on the engine: the dtype, the kernels, the pass's fixed costs. This times one verify pass of
one session over 1 to 33 rows (a chain of k draft tokens plus the pending one) and 8 sessions of one
row each, for every engine given, the engines taking turns within each sweep so a shared machine's
drift falls on all of them alike. It also counts the passes whose first row's logits equal that
row's logits verified alone (batch invariance, ``specdec.invariance``), bit for bit.
"""

from __future__ import annotations

import statistics
import time

import torch

from specdec.ragged import RaggedItem
from specdec.sampling import Sampling
from target_service.engine import TargetEngine, VerifyCall

ROWS = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 24, 33)
"""Rows a pass feeds: the pending token plus k = 0 .. 32 draft tokens."""
SESSIONS = 8
"""Sessions of the batched pass (one row each)."""


def _timed(engine: TargetEngine, calls: list[VerifyCall]) -> tuple[float, list]:
    started = time.perf_counter()
    outcomes = engine.verify_batch(calls)
    ms = (time.perf_counter() - started) * 1000
    for outcome in outcomes:
        if isinstance(outcome, Exception):
            raise outcome
    return ms, outcomes


def measure_pass_curve(
    engines: dict[str, TargetEngine], prompt: list[int], repeats: int = 9
) -> dict[str, dict[str, object]]:
    """Per engine: median ms of a pass by rows (``ROWS``), of a pass of ``SESSIONS`` one-row sessions,
    and how many row counts gave the first row the bits it gets alone.

    Each sweep runs every row count on every engine in turn, after one warm-up sweep; the sessions'
    caches are cropped back after each pass, so every pass sees the same ``len(prompt)`` context.
    """
    ids = {name: [engine.prefill(prompt)[0] for _ in range(SESSIONS)] for name, engine in engines.items()}
    start = len(prompt)
    times: dict[str, dict[str, list[float]]] = {name: {} for name in engines}
    for sweep in range(repeats + 1):
        for rows in ROWS:
            for name, engine in engines.items():
                call = VerifyCall(ids[name][0], start, [], [0] * (rows - 1), [], Sampling(), sweep)
                ms, _ = _timed(engine, [call])
                _crop(engine, ids[name][:1], start)
                if sweep:
                    times[name].setdefault(str(rows), []).append(ms)
        for name, engine in engines.items():
            calls = [VerifyCall(i, start, [], [], [], Sampling(), sweep) for i in ids[name]]
            ms, _ = _timed(engine, calls)
            _crop(engine, ids[name], start)
            if sweep:
                times[name].setdefault(f"{SESSIONS}x1", []).append(ms)
    report: dict[str, dict[str, object]] = {}
    for name, engine in engines.items():
        medians = {key: round(statistics.median(ms), 2) for key, ms in times[name].items()}
        report[name] = {
            "pass_ms": medians,
            "rows8_over_rows1": round(medians["8"] / medians["1"], 3),
            "invariant_row_counts": sum(_invariant(engine, ids[name][0], start, rows) for rows in ROWS[1:]),
            "row_counts_checked": len(ROWS) - 1,
        }
        for i in ids[name]:
            engine.release(i)
    return report


def _crop(engine: TargetEngine, cache_ids: list[str], start: int) -> None:
    """Takes the tokens a timed pass committed back out of its sessions' caches."""
    for cache_id in cache_ids:
        cache = engine.caches.get(cache_id)
        del cache.committed[start:]
        cache.trim()


def _invariant(engine: TargetEngine, cache_id: str, start: int, rows: int) -> bool:
    """Whether the pending token's logits in a ragged pass of ``rows`` rows equal its logits alone,
    bit for bit."""
    kv = engine.caches.get(cache_id).kv
    pending = [engine.caches.get(cache_id).committed[start - 1]]

    def first_row(extra: int) -> torch.Tensor:
        logits, _ = engine.forward([RaggedItem(kv, pending + [0] * extra, extra + 1)])
        kv.crop(-(extra + 1))
        return logits[0][0]

    return torch.equal(first_row(0), first_row(rows - 1))
