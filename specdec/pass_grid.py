"""The target's pass cost by sessions and draft length, and the most speculation could gain from it.

Speculation under load pays only if a pass over C sessions with k draft tokens each costs less than
E(k) passes without them. ``measure_pass_grid`` times the target engine in process (no gRPC, no
draft): pass_ms[C][k] for C sessions each verifying k draft tokens plus its pending one.
``speculation_ceiling`` then gives, for a draft with conditional acceptance a at every position, the
best gain any k could bring with a draft that cost nothing:

    ceiling(C) = max_k E(k) * pass_ms[C][0] / pass_ms[C][k]

A stack can only do worse: its draft takes time and shares the cores. ``specdec pass-grid`` prints
both and writes them as JSON.
"""

from __future__ import annotations

import statistics
import time

from coordinator.adaptive import expected_tokens
from specdec.sampling import Sampling
from target_service.engine import TargetEngine, VerifyCall


def measure_pass_grid(
    engine: TargetEngine, prompts: list[list[int]], levels: list[int], k_max: int, repeats: int = 3,
) -> dict[int, list[float]]:
    """Median ms of one verify pass, by sessions C (``levels``) and draft tokens k = 0..k_max per session.

    Each level prefills C of ``prompts`` (cycled), then times ``repeats`` sweeps over k = 0..k_max
    after one warm-up sweep. The k take turns within a sweep, so a shared machine's drift falls on
    all of them alike. The caches grow by the committed tokens, a few per pass, as a decode's would.
    """
    grid: dict[int, list[float]] = {}
    for sessions in levels:
        caches = [list(engine.prefill(prompts[i % len(prompts)])[:2]) for i in range(sessions)]
        times: list[list[float]] = [[] for _ in range(k_max + 1)]
        for sweep in range(repeats + 1):
            for k in range(k_max + 1):
                # Draft tokens that the target mostly rejects: a pass's cost does not depend on them.
                calls = [VerifyCall(cache_id, start, [], [0] * k, [], Sampling(), sweep) for cache_id, start in caches]
                started = time.perf_counter()
                outcomes = engine.verify_batch(calls)
                if sweep:
                    times[k].append((time.perf_counter() - started) * 1000)
                for cache, outcome in zip(caches, outcomes):
                    if isinstance(outcome, Exception):
                        raise outcome
                    cache[1] = outcome.committed
        grid[sessions] = [statistics.median(ms) for ms in times]
        for cache_id, _ in caches:
            engine.release(cache_id)
    return grid


def speculation_ceiling(grid: dict[int, list[float]], accept: float) -> dict[int, tuple[float, int]]:
    """By sessions C: the best E(k) * pass_ms[C][0] / pass_ms[C][k] over k, and that k (a free draft
    whose tokens are each accepted with probability ``accept`` given the ones before were)."""
    out = {}
    for sessions, row in grid.items():
        gains = [expected_tokens([accept], k) * row[0] / ms for k, ms in enumerate(row)]
        best = max(range(len(gains)), key=gains.__getitem__)
        out[sessions] = (gains[best], best)
    return out
