"""The target's pass cost by sessions and draft length, timed in process (``specdec pass-grid``).

Speculation under load pays only if a pass over C sessions with k draft tokens each costs less than
E(k) passes without them. ``measure_pass_grid`` times the target engine alone (no gRPC, no draft):
pass_ms[C][k] for C sessions each verifying k draft tokens plus its pending one.
``coordinator.adaptive.speculation_ceiling`` turns that grid into the most any draft could gain.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from specdec.sampling import Sampling
from target_service.engine import TargetEngine, VerifyCall


def measure_pass_grid(
    engine: TargetEngine,
    prompts: list[list[int]],
    levels: list[int],
    k_max: int,
    repeats: int = 3,
    between: Callable[[int], None] | None = None,
) -> dict[int, list[float]]:
    """Median ms of one verify pass, by sessions C (``levels``) and draft tokens k = 0..k_max per session.

    Each level prefills C of ``prompts`` (cycled), then times ``repeats`` sweeps over k = 0..k_max
    after one warm-up sweep. The k take turns within a sweep, so a shared machine's drift falls on
    all of them alike. The caches grow by the committed tokens, a few per pass, as a decode's would.
    ``between(sweep)``, when given, runs after each sweep: a measurement to compare with the passes
    takes turns with them, so drift falls on both alike.
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
            if between is not None:
                between(sweep)
        grid[sessions] = [statistics.median(ms) for ms in times]
        for cache_id, _ in caches:
            engine.release(cache_id)
    return grid
