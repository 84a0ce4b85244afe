"""The target's pass cost by rows in each dtype, side by side in one process (``specdec pass-curve``).

Speculation rests on one premise: verifying k+1 rows costs about what one row costs. Whether it holds
depends on the engine: the dtype, the kernels, the pass's fixed costs. This times one verify pass of
one session over 1 to 33 rows (a chain of k draft tokens plus the pending one) and 8 sessions of one
row each, for every engine given, the engines taking turns within each sweep so a shared machine's
drift falls on all of them alike. It also counts the passes whose first row's logits equal that
row's logits verified alone (batch invariance, ``specdec.invariance``), bit for bit.

Beside a compiled engine's passes it times the pass's weight products alone (``time_products``) at one
and eight rows in every sweep, and the product kernel's rate over a weight held in cache
(``cached_rate``): one row is bound by reading the weights, so its time follows the machine's memory
rate, which drifts on a shared host; eight rows are bound by the dot-product instructions, which do
not. The report keeps each sweep's read rate beside its passes (``roofline``), so a ratio of passes
can be read against the memory rate it was measured at.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from specdec.ragged import RaggedItem
from specdec.sampling import Sampling
from target_service.engine import TargetEngine, VerifyCall

ROWS = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 24, 33)
"""Rows a pass feeds: the pending token plus k = 0 .. 32 draft tokens."""
SESSIONS = 8
"""Sessions of the batched pass (one row each)."""
PRODUCT_ROWS = (1, 8)
"""Rows the weight products are timed at alone (``time_products``)."""
CACHED_OUTPUTS = 8192
"""Outputs of the weight ``cached_rate`` multiplies by: ~9 MB in bf16 for a 576-wide model, which the
last-level cache holds, so the kernel's arithmetic sets the rate; a call is long enough (~0.2 ms on
the 2-core development CPU) that its fixed cost does not (a weight of 1024 outputs read 25% slower)."""


def pass_products(model: nn.Module, layer_products: list[nn.Module]) -> list[nn.Module]:
    """The weight products of one pass in the order it runs them: ``layer_products`` (each layer's, as
    ``specdec.compiled.CompiledPass.products`` lists them) and the LM head."""
    return [*layer_products, model.get_output_embeddings()]


def product_macs(products: list[nn.Module]) -> int:
    """Multiply-adds a row costs through ``products``: also the number of weights they read."""
    return sum(p.in_features * p.out_features for p in products)


def time_products(products: list[nn.Module], rows: int, dtype: torch.dtype) -> float:
    """Milliseconds to run ``rows`` random rows through every product once, in order, as a pass does,
    with nothing between them."""
    inputs = {width: torch.randn(rows, width, dtype=dtype) for width in {p.in_features for p in products}}
    started = time.perf_counter()
    for product in products:
        product(inputs[product.in_features])
    return (time.perf_counter() - started) * 1000


def cached_rate(kind: type[nn.Module], width: int, dtype: torch.dtype, rows: int = 8, repeats: int = 200) -> float:
    """Multiply-adds per second of a ``kind`` product (built from a weight, as ``RowProduct`` is) over
    ``rows`` rows and a weight of ``CACHED_OUTPUTS`` x ``width`` that stays in cache: the kernel's
    arithmetic rate, with no memory to wait for. The median of ``repeats`` calls after a warm-up."""
    product = kind(torch.randn(CACHED_OUTPUTS, width, dtype=dtype))
    x = torch.randn(rows, width, dtype=dtype)
    for _ in range(repeats // 4):
        product(x)
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        product(x)
        seconds.append(time.perf_counter() - started)
    return rows * CACHED_OUTPUTS * width / statistics.median(seconds)


def _timed(engine: TargetEngine, calls: list[VerifyCall]) -> tuple[float, list]:
    started = time.perf_counter()
    outcomes = engine.verify_batch(calls)
    ms = (time.perf_counter() - started) * 1000
    for outcome in outcomes:
        if isinstance(outcome, Exception):
            raise outcome
    return ms, outcomes


def measure_pass_curve(
    engines: dict[str, TargetEngine],
    prompt: list[int],
    repeats: int = 9,
    products: dict[str, list[nn.Module]] | None = None,
) -> dict[str, dict[str, object]]:
    """Per engine: median ms of a pass by rows (``ROWS``), of a pass of ``SESSIONS`` one-row sessions,
    and how many row counts gave the first row the bits it gets alone; for the engines ``products``
    names (their ``pass_products``), also their ``roofline``.

    Each sweep runs every row count on every engine in turn, after one warm-up sweep; the sessions'
    caches are cropped back after each pass, so every pass sees the same ``len(prompt)`` context.
    """
    products = products or {}
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
        for name, chosen in products.items():
            for rows in PRODUCT_ROWS:
                ms = time_products(chosen, rows, engines[name].model.dtype)
                if sweep:
                    times[name].setdefault(f"products-{rows}", []).append(ms)
    report: dict[str, dict[str, object]] = {}
    for name, engine in engines.items():
        medians = {
            key: round(statistics.median(ms), 2) for key, ms in times[name].items() if not key.startswith("products")
        }
        report[name] = {
            "pass_ms": medians,
            "rows8_over_rows1": round(medians["8"] / medians["1"], 3),
            "invariant_row_counts": sum(_invariant(engine, ids[name][0], start, rows) for rows in ROWS[1:]),
            "row_counts_checked": len(ROWS) - 1,
        }
        if name in products:
            report[name]["roofline"] = _roofline(products[name], times[name], engines[name].model.dtype)
        for i in ids[name]:
            engine.release(i)
    return report


def _roofline(products: list[nn.Module], times: dict[str, list[float]], dtype: torch.dtype) -> dict[str, object]:
    """What bounds the passes of one engine: the bytes its products read, their time alone at each of
    ``PRODUCT_ROWS``, the kernel's cached rate and the time eight rows' multiply-adds take at it, and
    per sweep the rate the one-row products read the weights at beside that sweep's 1- and 8-row
    passes."""
    macs = product_macs(products)
    weight_bytes = macs * torch.finfo(dtype).bits // 8
    rate = cached_rate(type(products[-1]), products[-1].in_features, dtype)
    sweeps = [
        [round(weight_bytes / ms / 1e6, 1), round(one, 2), round(eight, 2)]
        for ms, one, eight in zip(times["products-1"], times["1"], times["8"], strict=True)
    ]
    return {
        "weights_mb": round(weight_bytes / 1e6, 1),
        "products_ms": {str(rows): round(statistics.median(times[f"products-{rows}"]), 2) for rows in PRODUCT_ROWS},
        "read_gb_per_s": round(weight_bytes / statistics.median(times["products-1"]) / 1e6, 1),
        "cached_gmacs_per_s": round(rate / 1e9, 1),
        "rows8_at_cached_rate_ms": round(8 * macs / rate * 1000, 2),
        "sweeps": sorted(sweeps),
        "sweep_columns": ["read GB/s", "1-row pass ms", "8-row pass ms"],
    }


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
