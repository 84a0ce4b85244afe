"""What sharing one prefill saves a request for several choices: prompt rows and wall time.

One local stack (the default target, its shipped feature draft, eager passes, target metrics on). A
chat prompt of ``--prompt-tokens`` tokens, sampled (temperature 0.7, seeded, so the choices differ),
``--max-new-tokens`` tokens a choice. Each round runs, in turn (A B C, then C B A, and so on):

- ``n4``: one request with n = 4: the choices share one prefill (fed once, forked three times);
- ``4x-concurrent``: four n = 1 requests at once, seeds s .. s + 3: four sessions side by side, each
  prefilling its own prompt;
- ``4x-sequential``: the same four requests one after another.

The report gives each mode's median wall seconds, time to first token and prefill milliseconds, the
target's prompt rows fed and KV rows forked per request (from its metrics endpoint), and whether the
n = 4 choices equal the four single requests token for token (they must).

    python -m bench.shared_prefill --rounds 5 --out reports/shared-prefill.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from specdec import Client
from specdec.stack import LocalStack, StackConfig, free_port
from specdec.vocab import load_tokenizer, resolve_model_path

MODES = ("n4", "4x-concurrent", "4x-sequential")
CHOICES = 4


def prompt_ids(cache_dir: Path, tokens: int) -> list[int]:
    """A summarisation chat of exactly ``tokens`` tokens (its template included), over standard-library
    docstrings, so nothing is downloaded."""
    tokenizer = load_tokenizer(resolve_model_path("default", cache_dir))
    text = "\n\n".join(m.__doc__ or "" for m in (argparse, json, statistics))
    words = tokenizer.encode(text)
    for keep in range(tokens, 0, -1):
        messages = [{"role": "user", "content": "Summarise these notes.\n\n" + tokenizer.decode(words[:keep])}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        if len(ids) <= tokens:
            return ids
    raise ValueError(f"no chat of {tokens} tokens")


def scrape(port: int) -> dict[str, float]:
    """The target's prompt rows so far: fed (a prefill's own pass, or folded / chunked) and forked."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    values = {
        (sample.name, sample.labels.get("kind", "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    fed = values[("specdec:target_prefill_rows_total", "")] + values[("specdec:target_pass_rows_total", "prompt")]
    return {"fed": fed, "forked": values[("specdec:target_forked_rows_total", "")]}


def run_mode(client: Client, mode: str, ids: list[int], options: dict, seed: int) -> tuple[float, list]:
    """One request of ``mode``: its wall seconds and its choices (Completions, in seed order)."""
    t0 = time.perf_counter()
    if mode == "n4":
        choices = client.complete(None, prompt_token_ids=ids, seed=seed, n=CHOICES, **options).choices
    elif mode == "4x-concurrent":
        with ThreadPoolExecutor(CHOICES) as pool:
            futures = [
                pool.submit(client.complete, None, prompt_token_ids=ids, seed=seed + i, **options)
                for i in range(CHOICES)
            ]
            choices = [f.result() for f in futures]
    else:
        choices = [client.complete(None, prompt_token_ids=ids, seed=seed + i, **options) for i in range(CHOICES)]
    return time.perf_counter() - t0, choices


def main(argv: list[str] | None = None) -> dict:
    """Runs every mode ``--rounds`` times on one local stack, alternating their order, and prints the
    report (module docstring) as JSON, also written to ``--out`` when given; returns it."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--target-threads", type=int, default=2, help="the target's torch threads")
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "specdec")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    ids = prompt_ids(args.cache_dir, args.prompt_tokens)
    metrics_port = free_port()
    config = StackConfig(
        cache_dir=args.cache_dir,
        compile="off",
        target_metrics_port=metrics_port,
        target_threads=args.target_threads,
        prefix_reuse=0,  # the modes repeat each prompt: only forks may share its prefill here
    )
    options = dict(max_new_tokens=args.max_new_tokens, temperature=0.7)
    results: dict[str, dict[str, list[float]]] = {m: {"wall_s": [], "ttft_ms": [], "prefill_ms": []} for m in MODES}
    rows: dict[str, dict[str, float]] = {}
    identical = 0
    with LocalStack(config) as stack, Client(stack.address, timeout=600) as client:
        run_mode(client, "n4", ids, options, 1)  # warm: the first request pays one-off costs
        for r in range(args.rounds):
            seed = 100 + 10 * r
            outputs = {}
            for mode in MODES if r % 2 == 0 else reversed(MODES):
                before = scrape(metrics_port)
                wall, choices = run_mode(client, mode, ids, options, seed)
                after = scrape(metrics_port)
                rows[mode] = {k: after[k] - before[k] for k in after}
                results[mode]["wall_s"].append(wall)
                results[mode]["ttft_ms"].append(statistics.mean(c.stats.time_to_first_token_ms for c in choices))
                results[mode]["prefill_ms"].append(sum(c.stats.prefill_ms for c in choices))
                outputs[mode] = [c.token_ids for c in choices]
            identical += outputs["n4"] == outputs["4x-concurrent"] == outputs["4x-sequential"]
    report = {
        "target_threads": args.target_threads,
        "prompt_tokens": len(ids),
        "max_new_tokens": args.max_new_tokens,
        "choices": CHOICES,
        "rounds": args.rounds,
        "identical_rounds": identical,
        "modes": {
            mode: {
                **{f"median_{k}": round(statistics.median(v), 3) for k, v in results[mode].items()},
                "target_prompt_rows_fed": rows[mode]["fed"],
                "target_kv_rows_forked": rows[mode]["forked"],
            }
            for mode in MODES
        },
    }
    n4 = report["modes"]["n4"]["median_wall_s"]
    for mode in MODES[1:]:
        report["modes"][mode]["wall_vs_n4"] = round(report["modes"][mode]["median_wall_s"] / n4, 2)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
