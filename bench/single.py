"""The single-stream benchmark (``specdec bench``): tokens/s of specdec against what a user would
otherwise run, side by side.

Modes take turns prompt by prompt (see ``run_interleaved``):

- ``hf-target``: transformers ``generate`` on the target alone, in process (the baseline);
- ``hf-assisted``: transformers assisted generation with the same draft (prompt lookup for the
  n-gram draft, ``assistant_model`` for a model draft);
- ``specdec-k0``: the specdec stack with speculation off;
- ``specdec``: the specdec stack with speculation, each round a token tree or a chain as the
  coordinator's cost model picks;
- ``specdec-chain``: the same stack with chains only (the request's ``tree_nodes`` 0), so trees
  and chains are compared in one run, on the same processes;
- ``specdec-tree:NxD``: the same stack with one fixed tree of N nodes at most D deep every round
  (``--trees``, default ``FIXED_TREES``), whether or not it pays: what verifying a tree of that size
  does to tokens per target pass and to speed, apart from the policy's choice;
- ``specdec-http``: the same stack through its OpenAI-compatible HTTP API, streamed as server-sent
  events; its ``overhead_ms_per_token_vs_specdec`` is what the HTTP path adds per token over the
  gRPC SDK's ``specdec``, measured in the same run.

The report gives tokens/s and speedup per mode, acceptance, per-round time split, the speedup the
formula (1 - a^(k+1)) / (1 - a) predicts from the measured acceptance and costs, and, for greedy
runs, how many outputs are token-identical to ``hf-target``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

MODES = ("hf-target", "hf-assisted", "specdec-k0", "specdec-chain", "specdec", "specdec-tree", "specdec-http")
# The fixed trees ``specdec-tree`` runs by default, (nodes, depth): the shape that committed the most
# tokens per second on the 2-core development CPU, and a larger one that commits more tokens per target
# pass but, on that CPU, pays for each of its extra verify rows.
FIXED_TREES = ((5, 3), (15, 6))
TREE_MODE = "specdec-tree"


def tree_mode(nodes: int, depth: int) -> str:
    """The mode name of the fixed tree of ``nodes`` nodes at most ``depth`` deep."""
    return f"{TREE_MODE}:{nodes}x{depth}"


def stack_variant(mode: str) -> tuple[int | None, int | None] | None:
    """The fixed request setting ``(k, tree_nodes)`` of a stack mode that has one (None: the stack's
    own choice). Such modes run on the first stack only."""
    if mode == "specdec-k0":
        return 0, None
    if mode == "specdec-chain":
        return None, 0
    if mode.startswith(TREE_MODE + ":"):
        nodes, depth = (int(n) for n in mode.split(":", 1)[1].split("x"))
        return depth, nodes
    return None


# The shipped prompt set (package data of ``bench``): one JSON object a line, see ``load_prompts``.
PROMPTS = Path(str(files("bench") / "prompts.jsonl"))


@dataclass(frozen=True)
class BenchPrompt:
    """One prompt of the set: plain text (no template) or chat messages."""

    id: str
    prompt: str | list[dict[str, str]]

    def token_ids(self, tokenizer) -> list[int]:
        """The tokens a fresh session sees for this prompt, as the coordinator builds them."""
        from coordinator.prompts import build_turn

        text, messages = (self.prompt, None) if isinstance(self.prompt, str) else (None, self.prompt)
        return build_turn(tokenizer, [], None, text, messages).tokens


@dataclass
class ModeResult:
    """What one mode produced over all prompts."""

    tokens: int = 0
    seconds: float = 0.0
    outputs: dict[str, list[int]] = field(default_factory=dict)
    rounds: int = 0
    # Rounds whose proposal the draft had drafted ahead (``--draft-ahead``).
    ahead_rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    # Draft tokens the target judged (up to each round's first rejection).
    judged: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    other_ms: float = 0.0
    prefill_ms: float = 0.0
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    round_overheads_ms: list[float] = field(default_factory=list)
    # Token trees: rounds, nodes verified, depths summed, accepted paths by depth, accepted nodes by rank.
    tree_rounds: int = 0
    tree_nodes: int = 0
    tree_depths: int = 0
    accepted_at_depth: list[int] = field(default_factory=list)
    accepted_at_rank: list[int] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def load_prompts(path: Path, n: int | None) -> list[BenchPrompt]:
    """Reads a JSONL prompt file: ``{"prompt": ...}`` or ``{"messages": [...]}``, optional ``"id"``."""
    prompts = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        obj = json.loads(line)
        prompt = obj["prompt"] if "prompt" in obj else obj["messages"]
        prompts.append(BenchPrompt(str(obj.get("id", i)), prompt))
    return prompts[:n] if n else prompts


def _progress(done: int, total: int, results: dict[str, ModeResult]) -> None:
    rates = "  ".join(f"{mode} {r.tokens_per_s:5.1f}" for mode, r in results.items())
    sys.stderr.write(f"\rprompt {done}/{total}  tok/s: {rates}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


# Runs one prompt (its index, the prompt) in one mode and adds what it produced to the mode's result.
PromptRunner = Callable[[int, BenchPrompt, ModeResult], None]


def run_interleaved(
    runners: dict[str, PromptRunner], prompts: list[BenchPrompt], progress: bool = True
) -> dict[str, ModeResult]:
    """Every mode on prompt 1, then every mode on prompt 2, and so on, the order reversed on every
    other prompt (A B B A ...).

    On a shared machine a burst of other load lasts seconds to minutes. Run mode after mode, such a
    burst lands on one mode and skews the ratios between modes; taking turns spreads it over all.
    """
    results = {mode: ModeResult() for mode in runners}
    order = list(runners)
    for i, prompt in enumerate(prompts):
        for mode in order if i % 2 == 0 else reversed(order):
            runners[mode](i, prompt, results[mode])
        if progress:
            _progress(i + 1, len(prompts), results)
    return results


def hf_runner(mode: str, loaded, draft, max_new_tokens: int, temperature: float, k: int | None) -> PromptRunner:
    """Runs transformers ``generate`` in process, alone or assisted by the draft."""
    import torch

    options: dict = {"max_new_tokens": max_new_tokens, "do_sample": temperature > 0}
    if temperature > 0:
        options["temperature"] = temperature
    if mode == "hf-assisted":
        if draft is None:
            options["prompt_lookup_num_tokens"] = k or 10  # transformers' documented default
        else:
            options["assistant_model"] = draft

    def run(index: int, p: BenchPrompt, result: ModeResult) -> None:
        ids = p.token_ids(loaded.tokenizer)
        start = time.perf_counter()
        with torch.inference_mode():
            out = loaded.model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), **options
            )
        result.seconds += time.perf_counter() - start
        generated = out[0, len(ids) :].tolist()
        result.tokens += len(generated)
        result.outputs[p.id] = generated

    return run


def specdec_runner(
    mode: str,
    client,
    max_new_tokens: int,
    temperature: float,
    k: int | None,
    response_format: dict | None = None,
    seeded: bool = True,
) -> PromptRunner:
    """Runs each prompt through a specdec coordinator (``client``, a ``specdec.client.Client``), under
    ``response_format`` (OpenAI's object) when given, seeded by the prompt's index unless not ``seeded``."""
    from coordinator.adaptive import add_counts

    fixed_k, tree_nodes = stack_variant(mode) or (None, None)
    k = k if fixed_k is None else fixed_k

    def run(index: int, p: BenchPrompt, result: ModeResult) -> None:
        start = time.perf_counter()
        reply = client.complete(
            p.prompt,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=index if seeded else None,
            k=k,
            tree_nodes=tree_nodes,
            response_format=response_format,
        )
        result.seconds += time.perf_counter() - start
        s = reply.stats
        result.tokens += len(reply.token_ids)
        result.outputs[p.id] = reply.token_ids
        result.rounds += s.rounds
        result.ahead_rounds += s.ahead_rounds
        result.drafted += s.drafted_tokens
        result.accepted += s.accepted_tokens
        result.judged += s.judged_tokens
        result.draft_ms += s.draft_ms
        result.verify_ms += s.verify_ms
        result.other_ms += s.other_ms
        result.prefill_ms += s.prefill_ms
        add_counts(result.drafted_at, s.drafted_at_position)
        add_counts(result.accepted_at, s.accepted_at_position)
        result.tree_rounds += s.tree_rounds
        result.tree_nodes += s.tree_nodes
        result.tree_depths += s.tree_depths
        add_counts(result.accepted_at_depth, s.accepted_at_depth)
        add_counts(result.accepted_at_rank, s.accepted_at_rank)
        if s.rounds:
            result.round_overheads_ms.append(s.other_ms / s.rounds)

    return run


def http_runner(address: str, max_new_tokens: int, temperature: float, seeded: bool = True) -> PromptRunner:
    """Runs each prompt through the coordinator's OpenAI API at ``address`` (host:port), streamed as
    server-sent events with their token ids, over one kept-alive connection (stdlib http.client); each
    request seeded by its prompt's index unless not ``seeded``."""
    import http.client

    host, _, port = address.rpartition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=600)
    connection.request("GET", "/v1/models")
    model = json.loads(connection.getresponse().read())["data"][0]["id"]

    def run(index: int, p: BenchPrompt, result: ModeResult) -> None:
        chat = not isinstance(p.prompt, str)
        body = {
            "model": model,
            "messages" if chat else "prompt": p.prompt,
            "max_tokens": max_new_tokens,
            "temperature": temperature,
            **({"seed": index} if seeded else {}),
            "stream": True,
            "return_token_ids": True,
        }
        ids: list[int] = []
        start = time.perf_counter()
        connection.request(
            "POST",
            "/v1/chat/completions" if chat else "/v1/completions",
            json.dumps(body),
            {"Content-Type": "application/json"},
        )
        reply = connection.getresponse()
        for line in reply:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[len(b"data: ") :])
            if "error" in event:
                raise RuntimeError(f"specdec-http: {event['error']['message']}")
            ids += event["choices"][0]["token_ids"] if event["choices"] else []
        result.seconds += time.perf_counter() - start
        result.tokens += len(ids)
        result.outputs[p.id] = ids

    return run


def expected_tokens_per_round(alpha: float, k: float) -> float:
    """(1 - a^(k+1)) / (1 - a): tokens a round commits when each draft token passes with rate a."""
    if alpha >= 1.0:
        return k + 1
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def is_speculative(mode: str) -> bool:
    """Whether a mode drafts through the stack: ``specdec``, ``specdec-chain``, ``specdec-tree:NxD`` or
    ``specdec:<draft kind>``."""
    return mode in ("specdec", "specdec-chain") or mode.startswith(("specdec:", TREE_MODE + ":"))


def summarize(results: dict[str, ModeResult], greedy: bool) -> dict:
    """The JSON report: per-mode figures, speedups, predicted speedup and exactness."""
    base = results.get("hf-target")
    k0 = results.get("specdec-k0")
    report: dict = {}
    for mode, r in results.items():
        entry: dict = {"tokens": r.tokens, "seconds": round(r.seconds, 3), "tokens_per_s": round(r.tokens_per_s, 2)}
        if base is not None and base.tokens_per_s:
            entry["speedup_vs_hf_target"] = round(r.tokens_per_s / base.tokens_per_s, 3)
        if r.rounds:
            entry["rounds"] = r.rounds
            entry["per_round_ms"] = {
                "draft": round(r.draft_ms / r.rounds, 2),
                "verify": round(r.verify_ms / r.rounds, 2),
                "other": round(r.other_ms / r.rounds, 2),
                "prefill_per_request": round(r.prefill_ms / len(r.outputs), 1),
                "median_other": round(statistics.median(r.round_overheads_ms), 2) if r.round_overheads_ms else 0.0,
            }
        if is_speculative(mode) and r.rounds:
            alpha = r.accepted / r.drafted if r.drafted else 0.0
            # A tree's depth plays a chain's k: the rounds the formula counts are levels, not nodes.
            mean_k = (r.drafted - r.tree_nodes + r.tree_depths) / r.rounds
            entry["acceptance_rate"] = round(alpha, 4)
            entry["mean_k"] = round(mean_k, 3)
            if r.ahead_rounds:
                entry["ahead_rounds"] = r.ahead_rounds
            entry["mean_accepted_length"] = round((r.accepted + r.rounds) / r.rounds, 3)
            entry["tokens_per_target_pass"] = round(r.tokens / r.rounds, 3)
            if r.tree_rounds:
                entry["tree_rounds"] = r.tree_rounds
                entry["mean_tree_nodes"] = round(r.tree_nodes / r.tree_rounds, 2)
                entry["mean_tree_depth"] = round(r.tree_depths / r.tree_rounds, 2)
                entry["tree_accepted_by_depth"] = [round(n / r.tree_rounds, 4) for n in r.accepted_at_depth]
                entry["tree_accepted_by_rank"] = list(r.accepted_at_rank)
            entry["acceptance_by_position"] = [
                round(a / d, 4) if d else 0.0 for a, d in zip(r.accepted_at, r.drafted_at)
            ]
            if k0 is not None and k0.rounds:
                # The formula's a is a token's chance to pass given the ones before it passed: accepted
                # over judged tokens. Over drafted tokens it would count the tokens after a rejection,
                # which the target never judged, as failures. Extended to trees, a is a level's chance
                # that some child passes (a tree round judges levels down to its first miss) and k is
                # the tree's depth.
                per_token = r.accepted / r.judged if r.judged else 0.0
                entry["per_token_acceptance"] = round(per_token, 4)
                # One k0 round is one target step through the same stack: the cost unit of the formula.
                step_ms = (k0.draft_ms + k0.verify_ms + k0.other_ms) / k0.rounds
                round_ms = (r.draft_ms + r.verify_ms + r.other_ms) / r.rounds
                # Each mode's prompt prefill is added on both sides, as the measured times include it.
                k0_ms = k0.prefill_ms + r.tokens * step_ms
                spec_ms = r.prefill_ms + r.tokens / expected_tokens_per_round(per_token, mean_k) * round_ms
                predicted = k0_ms / spec_ms
                measured = r.tokens_per_s / k0.tokens_per_s if k0.tokens_per_s else 0.0
                entry["predicted_speedup_vs_k0"] = round(predicted, 3)
                entry["measured_speedup_vs_k0"] = round(measured, 3)
                entry["efficiency"] = round(measured / predicted, 3) if predicted else 0.0
        chains = results.get("specdec-chain")
        if (mode == "specdec" or mode.startswith(TREE_MODE)) and chains is not None and chains.tokens_per_s:
            entry["speedup_vs_chains"] = round(r.tokens_per_s / chains.tokens_per_s, 3)
        grpc = results.get("specdec")
        if mode == "specdec-http" and grpc is not None and grpc.tokens and r.tokens:
            # Same stack, same prompts, taking turns: the difference is the HTTP path's.
            overhead_s = r.seconds / r.tokens - grpc.seconds / grpc.tokens
            entry["overhead_ms_per_token_vs_specdec"] = round(1000 * overhead_s, 3)
        if greedy and base is not None and mode != "hf-target":
            same = sum(1 for pid, out in r.outputs.items() if base.outputs.get(pid) == out)
            entry["exact"] = f"{same}/{len(r.outputs)}"
        k0 = results.get("specdec-k0")
        if greedy and k0 is not None and mode.startswith("specdec") and mode != "specdec-k0":
            # The stack's own target-only answers: speculation must change none of them.
            same = sum(1 for pid, out in r.outputs.items() if k0.outputs.get(pid) == out)
            entry["exact_vs_k0"] = f"{same}/{len(r.outputs)}"
        report[mode] = entry
    return report


def plot(report: dict, path: Path) -> None:
    """Tokens/s per mode and acceptance by draft position, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    modes = list(report)
    left.bar(modes, [report[m]["tokens_per_s"] for m in modes], color="tab:blue")
    left.tick_params(axis="x", rotation=30)
    left.set_ylabel("tokens/s")
    left.set_title("throughput, batch size 1")
    spec = [m for m in modes if "acceptance_by_position" in report[m]]
    width = 0.8 / max(1, len(spec))
    for j, mode in enumerate(spec):
        by_pos = report[mode]["acceptance_by_position"]
        right.bar([i + 1 + j * width for i in range(len(by_pos))], by_pos, width=width, label=mode)
    if spec:
        right.legend()
    right.set_xlabel("draft position")
    right.set_ylabel("acceptance")
    right.set_ylim(0, 1)
    right.set_title("acceptance by position")
    fig.tight_layout()
    fig.savefig(path)
