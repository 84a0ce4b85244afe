"""What a long prompt costs the sessions already running: their worst wait, chunked or not.

Two sessions stream 96 tokens each; once both stream, a third client sends a prompt of about 1,500
tokens (Python standard-library docstrings, so nothing is downloaded) and asks for 8 tokens. The
report gives, per target ``--prefill-chunk`` setting (one local stack each, in the order given, so
``128,0,0,128`` runs A B B A):

- ``max_gap_s``: the longest wait between two of the running streams' chunks while the long request
  was in flight (without chunking, its whole prefill);
- ``median_gap_during_s`` / ``median_gap_all_s``: their typical wait then, and over their whole run;
- ``long_ttft_s``: the long prompt's own time to first token.

``--running 0`` sends the long prompt alone (after a quiet second), for its first token only.

    python -m bench.long_prompt --chunks 128,0,0,128 --out reports/long-prompt.json   # or: make bench-long-prompt
"""

from __future__ import annotations

import argparse
import email
import json
import logging
import statistics
import textwrap
import threading
import time
from pathlib import Path

from specdec import Client
from specdec.stack import LocalStack, StackConfig
from specdec.vocab import load_tokenizer, resolve_model_path

RUNNING = [
    [{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
    [{"role": "user", "content": "Explain how a bicycle gear works."}],
]


def long_prompt(cache_dir: Path, tokens: int) -> list[dict[str, str]]:
    """A summarisation request over ``tokens`` tokens of standard-library docstrings."""
    tokenizer = load_tokenizer(resolve_model_path("default", cache_dir))
    text = "\n\n".join(m.__doc__ for m in (argparse, logging, textwrap, email, json) if m.__doc__)
    passage = tokenizer.decode(tokenizer.encode(text)[:tokens])
    return [{"role": "user", "content": "Summarise these notes in two sentences.\n\n" + passage}]


def trial(client: Client, prompt: list[dict[str, str]], running: int) -> dict[str, float]:
    """One long request sent while ``running`` sessions stream; the gaps they saw meanwhile."""
    arrivals: list[list[float]] = [[] for _ in range(running)]
    streaming = threading.Barrier(running + 1)

    def run(i: int) -> None:
        for n, _ in enumerate(client.stream(RUNNING[i % len(RUNNING)], max_new_tokens=96)):
            arrivals[i].append(time.perf_counter())
            if n == 6:
                streaming.wait(120)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(running)]
    for t in threads:
        t.start()
    if running:
        streaming.wait(120)
    else:
        time.sleep(1.5)  # nothing ran in the last second: the target sees no session running
    t0 = time.perf_counter()
    first = None
    for chunk in client.stream(prompt, max_new_tokens=8):
        if first is None and chunk.token_ids:
            first = time.perf_counter() - t0
    t1 = time.perf_counter()
    for t in threads:
        t.join()
    gaps = [(b - a, a, b) for times in arrivals for a, b in zip(times, times[1:])]
    during = [g for g, a, b in gaps if b > t0 and a < t1]
    out = {"long_ttft_s": round(first or 0.0, 3)}
    if during:
        out |= {
            "max_gap_s": round(max(during), 3),
            "median_gap_during_s": round(statistics.median(during), 3),
            "median_gap_all_s": round(statistics.median(g for g, _, _ in gaps), 3),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", default="128,0,0,128", help="target --prefill-chunk settings, one stack each")
    parser.add_argument("--tokens", type=int, default=1500, help="tokens of the long prompt's passage")
    parser.add_argument("--trials", type=int, default=3, help="long requests per stack")
    parser.add_argument("--running", type=int, default=2, help="sessions streaming while the long prompt arrives")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "specdec")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    prompt = long_prompt(args.cache_dir, args.tokens)
    runs = []
    for chunk in (int(c) for c in args.chunks.split(",")):
        with (
            # Each trial sends the same prompt, so none may copy an earlier trial's cache.
            LocalStack(StackConfig(prefill_chunk=chunk, cache_dir=args.cache_dir, prefix_reuse=0)) as stack,
            Client(stack.address, timeout=600) as client,
        ):
            client.complete(RUNNING[0], max_new_tokens=4)  # the first request pays one-time costs
            trials = [trial(client, prompt, args.running) for _ in range(args.trials)]
        runs.append({"prefill_chunk": chunk, "trials": trials})
        print(json.dumps(runs[-1]), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {"config": vars(args) | {"cache_dir": str(args.cache_dir), "out": str(args.out)}, "runs": runs},
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
