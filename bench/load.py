"""The load benchmark (``specdec bench --concurrency``): throughput and latency as concurrent sessions grow.

Closed loop: at level C, C clients each send their next request as soon as the previous one ends,
until the level's prompts are done. A level takes the first N prompts rounded up to a multiple of C
(``level_prompts``), so every client sends as many requests: with 24 prompts at C = 16, the last 8
would otherwise run as a half-empty second wave, and the level would measure about 8 sessions at
once for half its time. Modes, one after another on the same prompts at every level:

- ``hf-batched``: transformers ``generate`` over batches of C prompts (left-padded), in process: the
  library's own way to serve C users at once;
- ``specdec-k0``: the specdec stack with speculation off;
- ``specdec-chain``: the stack with speculation by chains only (the request's ``tree_nodes`` 0);
- ``specdec``: the specdec stack with speculation (adaptive, load-aware k, trees where they pay).

For each level: aggregate tokens/s, p50/p95 time to first token, p50/p95 per-token latency after
the first, and, for greedy runs, how many specdec outputs equal target-only decoding (HF ``generate``
one prompt at a time, which is ``hf-batched`` at level 1).
"""

from __future__ import annotations

import queue
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.single import BenchPrompt

LOAD_MODES = ("hf-batched", "specdec-k0", "specdec-chain", "specdec")


@dataclass
class LevelResult:
    """One mode at one concurrency level."""

    tokens: int = 0
    seconds: float = 0.0
    ttft_ms: list[float] = field(default_factory=list)
    per_token_ms: list[float] = field(default_factory=list)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    # Rounds that verified a token tree, and their nodes.
    tree_rounds: int = 0
    tree_nodes: int = 0
    # Outputs of earlier runs of the same mode and level folded in by ``absorb``.
    earlier_outputs: list[dict[str, list[int]]] = field(default_factory=list)

    def absorb(self, other: LevelResult) -> None:
        """Folds another run of the same mode and level into this one: tokens over seconds summed."""
        self.tokens += other.tokens
        self.seconds += other.seconds
        self.ttft_ms += other.ttft_ms
        self.per_token_ms += other.per_token_ms
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.rounds += other.rounds
        self.tree_rounds += other.tree_rounds
        self.tree_nodes += other.tree_nodes
        self.earlier_outputs += [self.outputs, *other.earlier_outputs]
        self.outputs = other.outputs

    def summary(self, reference: dict[str, list[int]] | None) -> dict:
        """The level's figures for the JSON report."""
        entry = {
            "tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.tokens / self.seconds, 2) if self.seconds else 0.0,
            "ttft_ms": {"p50": _pct(self.ttft_ms, 50), "p95": _pct(self.ttft_ms, 95)},
            "per_token_ms": {"p50": _pct(self.per_token_ms, 50), "p95": _pct(self.per_token_ms, 95)},
        }
        if self.rounds:
            entry["mean_k"] = round(self.drafted / self.rounds, 3)
        if self.drafted:
            entry["acceptance_rate"] = round(self.accepted / self.drafted, 3)
        if self.tree_rounds:
            entry["tree_rounds"] = self.tree_rounds
            entry["mean_tree_nodes"] = round(self.tree_nodes / self.tree_rounds, 2)
        if reference is not None:
            runs = [*self.earlier_outputs, self.outputs]
            same = sum(1 for outputs in runs for pid, out in outputs.items() if reference.get(pid) == out)
            entry["exact"] = f"{same}/{sum(len(outputs) for outputs in runs)}"
        return entry


def level_prompts(prompts: list[BenchPrompt], n: int, level: int) -> list[BenchPrompt]:
    """The first ``n`` prompts rounded up to a multiple of ``level`` (as far as ``prompts`` reaches)."""
    return prompts[: -(-n // level) * level]


def _pct(values: list[float], q: int) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return round(values[0], 1)
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1], 1)


def _progress(mode: str, level: int, done: int, total: int) -> None:
    sys.stderr.write(f"\r{mode:11s} C={level:<3d} {done}/{total}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def run_specdec_level(
    mode: str, address: str, prompts: list[BenchPrompt], level: int, max_new_tokens: int, k: int | None
) -> LevelResult:
    """C client threads over one channel, each streaming its next prompt as soon as the last ends."""
    from specdec.client import Client

    result = LevelResult()
    todo: queue.Queue[int] = queue.Queue()
    for i in range(len(prompts)):
        todo.put(i)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(client: Client) -> None:
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            p = prompts[i]
            sent = time.perf_counter()
            first = None
            tokens: list[int] = []
            stats = None
            try:
                for chunk in client.stream(
                    p.prompt,
                    max_new_tokens=max_new_tokens,
                    seed=i,
                    k=0 if mode == "specdec-k0" else k,
                    tree_nodes=0 if mode == "specdec-chain" else None,
                ):
                    if chunk.token_ids and first is None:
                        first = time.perf_counter()
                    tokens += chunk.token_ids
                    stats = chunk.stats or stats
            except BaseException as exc:  # noqa: BLE001 - reported after the level
                with lock:
                    errors.append(exc)
                return
            end = time.perf_counter()
            with lock:
                result.tokens += len(tokens)
                result.outputs[p.id] = tokens
                if first is not None:
                    result.ttft_ms.append((first - sent) * 1000)
                    if len(tokens) > 1:
                        result.per_token_ms.append((end - first) * 1000 / (len(tokens) - 1))
                if stats is not None:
                    result.drafted += stats.drafted_tokens
                    result.accepted += stats.accepted_tokens
                    result.rounds += stats.rounds
                    result.tree_rounds += stats.tree_rounds
                    result.tree_nodes += stats.tree_nodes
                _progress(mode, level, len(result.outputs), len(prompts))

    with Client(address, timeout=900) as client:
        threads = [threading.Thread(target=worker, args=(client,)) for _ in range(level)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        result.seconds = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{mode} at concurrency {level}: {len(errors)} requests failed: {errors[0]!r}")
    return result


def run_hf_batched_level(loaded, prompts: list[BenchPrompt], level: int, max_new_tokens: int) -> LevelResult:
    """HF ``generate`` over consecutive batches of ``level`` prompts, left-padded, greedy."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class FirstStep(StoppingCriteria):
        """Notes when the first generated token exists; never stops anything."""

        def __init__(self) -> None:
            self.at: float | None = None

        def __call__(self, input_ids, scores, **kwargs):
            if self.at is None:
                self.at = time.perf_counter()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    tokenizer = loaded.tokenizer
    pad = loaded.pad_id
    eos = set(loaded.eos_token_ids)
    result = LevelResult()
    for lo in range(0, len(prompts), level):
        batch = prompts[lo : lo + level]
        ids = [p.token_ids(tokenizer) for p in batch]
        width = max(len(x) for x in ids)
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])  # [B, width], left-padded
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        first = FirstStep()
        start = time.perf_counter()
        with torch.inference_mode():
            out = loaded.model.generate(
                input_ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
                stopping_criteria=StoppingCriteriaList([first]),
            )
        end = time.perf_counter()
        result.seconds += end - start
        for p, row in zip(batch, out[:, width:].tolist()):
            stop = next((i for i, t in enumerate(row) if t in eos), None)
            tokens = row if stop is None else row[: stop + 1]
            result.tokens += len(tokens)
            result.outputs[p.id] = tokens
            first_at = first.at if first.at is not None else end
            result.ttft_ms.append((first_at - start) * 1000)
            if len(tokens) > 1:
                # Every row of a batch advances one token per step until the longest row ends.
                steps = out.shape[1] - width
                result.per_token_ms.append((end - first_at) * 1000 / max(1, steps - 1))
        _progress("hf-batched", level, min(lo + level, len(prompts)), len(prompts))
    return result


def summarize_load(results: dict[str, dict[int, LevelResult]], reference: dict[str, list[int]] | None) -> dict:
    """Per mode and level, the figures; and whether speculation kept up with k=0 at every level."""
    report: dict = {"modes": {}}
    for mode, levels in results.items():
        ref = reference if mode.startswith("specdec") else None
        report["modes"][mode] = {str(c): r.summary(ref) for c, r in levels.items()}
    spec = results.get("specdec")
    for other, key in (("specdec-k0", "specdec_vs_k0"), ("specdec-chain", "specdec_vs_chains")):
        base = results.get(other)
        if spec and base:
            report[key] = {
                str(c): round(spec[c].tokens / spec[c].seconds / (base[c].tokens / base[c].seconds), 3)
                for c in spec
                if c in base and spec[c].seconds and base[c].seconds
            }
    for mode, levels in results.items():
        if 1 in levels and levels[1].seconds:
            single = levels[1].tokens / levels[1].seconds
            report.setdefault("scaling_vs_single_session", {})[mode] = {
                str(c): round(r.tokens / r.seconds / single, 2) for c, r in levels.items() if r.seconds
            }
    return report


def plot_load(report: dict, path: Path) -> None:
    """Aggregate tokens/s against concurrency, one line per mode, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, levels in report["modes"].items():
        xs = sorted(int(c) for c in levels)
        ax.plot(xs, [levels[str(c)]["tokens_per_s"] for c in xs], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent sessions")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title("throughput vs concurrency (closed loop)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
