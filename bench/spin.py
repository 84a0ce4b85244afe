"""How long the target's idle OpenMP threads spin, measured in the whole local stack (``make bench-spin``).

libgomp's threads spin ``GOMP_SPINCOUNT`` times after a parallel region before they sleep (300,000
when ``OMP_WAIT_POLICY`` is unset). Within a pass that keeps them ready for the next op. Between passes
the target idles while the coordinator and the draft work, and where the three share cores a spinning
target thread takes one from them. So the setting is measured where it acts: this starts a local stack
(default settings) per setting, in the order A B C C B A, and reports tok/s at one stream (k auto, and
k = 0, whose passes follow each other most closely) and at 8 streams, and the target's CPU time per
token at one stream.

    python -m bench.spin --out reports/spin.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

from bench.alternating import alternate, chosen_settings, write_report
from bench.single import load_prompts
from specdec.client import Client
from specdec.host import tcmalloc
from specdec.stack import LocalStack, StackConfig

# The target's OpenMP environment per setting: libgomp's own default spin, the one a local stack's
# target runs with (``specdec.stack.TARGET_SPIN_COUNT``), a shorter one, and threads told to spin on.
VARIANTS = {
    "libgomp-default": {"GOMP_SPINCOUNT": "300000"},
    "10000": {"GOMP_SPINCOUNT": "10000"},
    "1000": {"GOMP_SPINCOUNT": "1000"},
    "active": {"OMP_WAIT_POLICY": "ACTIVE"},
}
# What a setting's environment replaces (restored after its stack).
KNOBS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
STREAMS = 8


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds process ``pid`` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_variant(target_env: dict[str, str], args: argparse.Namespace, prompts: list) -> dict[str, float]:
    """One stack with ``target_env`` in the target's environment: tok/s at one stream with k auto and
    with k = 0 (target-only rounds, whose passes follow each other most closely), and at ``STREAMS``,
    and the target's CPU milliseconds per token at one stream with k auto."""
    config = StackConfig(cache_dir=args.cache_dir, compile="wait", preload=tcmalloc())

    def answer(client: Client, prompt, **options) -> int:
        """Tokens of ``prompt``'s greedy answer."""
        reply = client.complete(prompt.prompt, max_new_tokens=args.max_new_tokens, temperature=0.0, **options)
        return len(reply.token_ids)

    def one_stream(client: Client, **options) -> tuple[float, float]:
        """tok/s over every prompt in turn, and the target's CPU ms per token meanwhile."""
        before, started = cpu_seconds(target), time.perf_counter()
        tokens = sum(answer(client, p, **options) for p in prompts)
        return tokens / (time.perf_counter() - started), (cpu_seconds(target) - before) / tokens * 1e3

    # The children inherit it; a local stack passes it to the target only (``specdec.stack.child_env``).
    saved = {knob: os.environ.pop(knob, None) for knob in KNOBS}
    os.environ.update(target_env)
    try:
        with LocalStack(config) as stack, Client(stack.address) as client:
            client.complete(prompts[0].prompt, max_new_tokens=8)  # every path warm before timing
            target = stack.process("target").popen.pid
            one_tok_s, target_ms = one_stream(client)
            k0_tok_s, _ = one_stream(client, k=0)
            with ExitStack() as clients_stack, ThreadPoolExecutor(STREAMS) as pool:
                clients = [clients_stack.enter_context(Client(stack.address)) for _ in range(STREAMS)]
                jobs = [(clients[i % STREAMS], p) for i, p in enumerate(prompts * 2)]
                started = time.perf_counter()
                many = sum(pool.map(lambda job: answer(*job), jobs))
                many_s = time.perf_counter() - started
    finally:
        for knob, value in saved.items():
            os.environ.pop(knob, None)
            if value is not None:
                os.environ[knob] = value
    return {
        "one_stream_tok_s": round(one_tok_s, 2),
        "one_stream_k0_tok_s": round(k0_tok_s, 2),
        "streams_tok_s": round(many / many_s, 2),
        "target_cpu_ms_per_token": round(target_ms, 2),
    }


def summarize(runs: dict[str, list[dict[str, float]]]) -> dict:
    """Per setting: the median of each figure over its runs, and its tok/s over libgomp's default's."""
    keys = ("one_stream_tok_s", "one_stream_k0_tok_s", "streams_tok_s", "target_cpu_ms_per_token")
    medians = {name: {key: statistics.median(r[key] for r in rs) for key in keys} for name, rs in runs.items()}
    base = medians["libgomp-default"]
    return {
        name: m
        | {
            "one_stream_vs_default": round(m["one_stream_tok_s"] / base["one_stream_tok_s"], 3),
            "one_stream_k0_vs_default": round(m["one_stream_k0_tok_s"] / base["one_stream_k0_tok_s"], 3),
            "streams_vs_default": round(m["streams_tok_s"] / base["streams_tok_s"], 3),
        }
        for name, m in medians.items()
    }


def main(argv: list[str] | None = None) -> None:
    """Runs every setting A B .. B A and writes the report."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=Path, default=Path("bench/prompts.jsonl"))
    p.add_argument("-n", type=int, default=12, help="prompts (one stream); 8 streams answer each twice")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="A B .. B A rounds: each setting runs twice a round")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated settings (libgomp-default first)")
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "specdec")
    p.add_argument("--out", type=Path, default=Path("specdec-spin.json"))
    args = p.parse_args(argv)
    prompts = load_prompts(args.prompts, args.n)
    variants = chosen_settings(VARIANTS, args.variants, "libgomp-default")
    runs = alternate(list(variants), args.rounds, lambda name, _: run_variant(variants[name], args, prompts))
    config = {
        "prompts": str(args.prompts),
        "n": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "streams": STREAMS,
        "rounds": args.rounds,
        "target_env": variants,
    }
    write_report(args.out, config, runs, summarize(runs))


if __name__ == "__main__":
    main()
