"""The ``specdec`` command: run the services, a local stack, or a generation.

Flags are read once here (with SPECDEC_* environment variables as defaults) into the frozen configs
of ``specdec.config``, which are passed down; nothing below this module reads the environment.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path

from specdec.config import (
    DEFAULT_DRAFT_KIND,
    DRAFT_KINDS,
    AdmissionLimits,
    CoordinatorConfig,
    DraftConfig,
    ModelConfig,
    ServerConfig,
    TargetConfig,
    TensorParallelConfig,
    TlsClientConfig,
    default_draft_model,
)

DEMO_PROMPT = [{"role": "user", "content": "Write a Python function that checks whether a number is prime, then explain it briefly."}]


def _k_arg(value: str) -> int | None:
    """A draft length flag: an integer, or "auto" (None) for the adaptive choice."""
    return None if value == "auto" else int(value)


def _env(name: str, default: str | None) -> str | None:
    return os.environ.get(f"SPECDEC_{name}", default)


def _path_env(name: str) -> Path | None:
    value = _env(name, None)
    return Path(value) if value else None


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir", type=Path, default=Path(_env("CACHE_DIR", str(Path.home() / ".cache" / "specdec"))),
                   help="where converted models are cached (env SPECDEC_CACHE_DIR)")
    p.add_argument("--otlp-endpoint", default=_env("OTLP_ENDPOINT", None),
                   help="OTLP/gRPC trace endpoint such as localhost:4317 (env SPECDEC_OTLP_ENDPOINT); unset: no export")


def _add_server(p: argparse.ArgumentParser, port: int) -> None:
    p.add_argument("--host", default=_env("HOST", "127.0.0.1"), help="address to bind (env SPECDEC_HOST)")
    p.add_argument("--port", type=int, default=int(_env("PORT", str(port))), help="port to bind; 0 picks a free one")
    p.add_argument("--grace", type=float, default=5.0, help="seconds in-flight calls get after SIGTERM")
    p.add_argument("--tls-cert", type=Path, default=_path_env("TLS_CERT"),
                   help="PEM certificate chain: serve TLS (with --tls-key; env SPECDEC_TLS_CERT)")
    p.add_argument("--tls-key", type=Path, default=_path_env("TLS_KEY"),
                   help="PEM private key of --tls-cert (env SPECDEC_TLS_KEY)")
    p.add_argument("--tls-client-ca", type=Path, default=_path_env("TLS_CLIENT_CA"),
                   help="PEM CA bundle: demand client certificates chaining to it, i.e. mutual TLS "
                        "(env SPECDEC_TLS_CLIENT_CA)")
    # An empty variable (a chart that renders it unset) means no endpoint, like an absent one.
    p.add_argument("--health-port", type=int, default=_env("HEALTH_PORT", None) or None,
                   help="also serve gRPC health alone, in plaintext, on this port (for kubelet probes of a TLS "
                        "server; env SPECDEC_HEALTH_PORT)")
    p.add_argument("--metrics-port", type=int, default=_env("METRICS_PORT", None) or None,
                   help="serve Prometheus metrics over HTTP on this port, 0 picks a free one "
                        "(env SPECDEC_METRICS_PORT); unset: none")
    _add_common(p)


def _server(args) -> ServerConfig:
    try:
        return ServerConfig(host=args.host, port=args.port, grace_s=args.grace, otlp_endpoint=args.otlp_endpoint,
                            tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
                            metrics_port=args.metrics_port, health_port=args.health_port)
    except ValueError as exc:
        raise SystemExit(f"specdec: {exc} (--tls-cert, --tls-key, --tls-client-ca)") from None


def _client_tls(ca: Path | None, cert: Path | None = None, key: Path | None = None) -> TlsClientConfig | None:
    """TLS for outgoing channels when any of its files is named; None keeps them plaintext."""
    if ca is None and cert is None and key is None:
        return None
    try:
        return TlsClientConfig(ca=ca, cert=cert, key=key)
    except ValueError as exc:
        raise SystemExit(f"specdec: {exc} (--tls-client-cert, --tls-client-key)") from None


def _coordinator_config(args) -> CoordinatorConfig:
    """The coordinator's config from its flags; API keys are read (and hashed) here, once."""
    from coordinator.auth import read_api_key_hashes
    from coordinator.discovery import parse_replicas

    try:
        # Keys come from a file or the environment, never from a flag, which any local user could see in ps.
        api_key_hashes = read_api_key_hashes(args.api_keys_file, os.environ.get("SPECDEC_API_KEYS"))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"specdec: API keys: {exc}") from None
    try:
        draft_addresses, draft_discovery = parse_replicas(args.draft, "--draft")
        target_addresses, target_discovery = parse_replicas(args.target, "--target")
        if not args.discovery_interval > 0:
            raise ValueError(f"--discovery-interval: must be positive, not {args.discovery_interval}")
    except ValueError as exc:
        raise SystemExit(f"specdec: {exc}") from None
    return CoordinatorConfig(
        server=_server(args),
        draft_addresses=draft_addresses,
        target_addresses=target_addresses,
        draft_discovery=draft_discovery,
        target_discovery=target_discovery,
        discovery_interval_s=args.discovery_interval,
        tokenizer=ModelConfig(model=args.tokenizer, cache_dir=args.cache_dir),
        redis_url=args.redis_url,
        redis_password=os.environ.get("SPECDEC_REDIS_PASSWORD") or None,
        redis_ca=args.redis_ca,
        session_ttl_s=args.session_ttl,
        default_k=args.default_k,
        max_auto_k=args.max_auto_k,
        rpc_timeout_s=args.rpc_timeout,
        api_key_hashes=api_key_hashes,
        backend_tls=_client_tls(args.tls_ca, args.tls_client_cert, args.tls_client_key),
        admission=AdmissionLimits(args.max_active, args.max_queued, args.max_per_client,
                                  args.max_sessions_per_client),
        draft_colocated=args.draft_colocated,
        free_lookup_min=args.free_lookup_min,
    )


def _tensor_parallel(args) -> TensorParallelConfig:
    """The target's tensor-parallel place: rank 0 of ``--tp`` ranks that this process starts, or, when
    a launcher such as torchrun started every rank (WORLD_SIZE set), this rank of that group.

    torchrun's variables count only with ``--tp`` above 1, and must agree with it: a WORLD_SIZE left
    in the environment by some other job never turns a plain target into one rank of a group.
    """
    try:
        if args.tp > 1 and "WORLD_SIZE" in os.environ:
            world_size = int(os.environ["WORLD_SIZE"])
            if world_size != args.tp:
                raise ValueError(f"--tp {args.tp} but the launcher started {world_size} ranks (WORLD_SIZE)")
            launcher = os.environ.get("SPECDEC_TP_LAUNCHER_PID")
            return TensorParallelConfig(
                world_size=world_size, rank=int(os.environ.get("RANK", "0")),
                master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                master_port=int(os.environ.get("MASTER_PORT", "0")), launched=True,
                launcher_pid=int(launcher) if launcher else None,
            )
        return TensorParallelConfig(world_size=args.tp)
    except ValueError as exc:
        raise SystemExit(f"specdec: tensor parallel: {exc}") from None


def _add_cache_limits(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-budget-mb", type=int, default=0,
                   help="MiB of KV cache all sessions may take; past it idle caches are evicted, and a new session "
                        "gets RESOURCE_EXHAUSTED when only busy ones remain (0: no budget)")
    p.add_argument("--cache-idle", type=float, default=3600.0,
                   help="seconds after which an unused session cache is dropped (0: never)")


def _model(args, model: str) -> ModelConfig:
    return ModelConfig(model=model, cache_dir=args.cache_dir, threads=args.threads, max_sessions=args.max_sessions,
                       pack=not args.no_pack, kv_budget_mb=args.kv_budget_mb, cache_idle_s=args.cache_idle)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve-target", help="run the target service")
    _add_server(p, 50052)
    p.add_argument("--model", default=_env("TARGET_MODEL", "default"), help="'default', a HF folder or a .gguf file")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--max-sessions", type=int, default=64, help="session caches held before LRU eviction")
    _add_cache_limits(p)
    p.add_argument("--no-pack", action="store_true", help="keep plain linear layers (no oneDNN prepacking)")
    p.add_argument("--max-batch-rows", type=int, default=256,
                   help="most token rows one batched verify pass feeds (all sessions together)")
    p.add_argument("--tp", type=int, default=int(_env("TENSOR_PARALLEL", "1")),
                   help="shard the target over N processes (tensor parallelism; env SPECDEC_TENSOR_PARALLEL); this process "
                        "serves and starts the others unless torchrun did (RANK / WORLD_SIZE set)")

    p = sub.add_parser("serve-draft", help="run the draft service")
    _add_server(p, 50051)
    p.add_argument("--kind", choices=DRAFT_KINDS, default=_env("DRAFT_KIND", DEFAULT_DRAFT_KIND))
    p.add_argument("--model", default=_env("DRAFT_MODEL", None),
                   help="draft model or distilled draft folder, or the model whose tokenizer n-gram drafting speaks "
                        "(default: the draft shipped for the default target)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--max-sessions", type=int, default=64, help="session caches held before LRU eviction")
    _add_cache_limits(p)
    p.add_argument("--no-pack", action="store_true", help="keep plain linear layers (no oneDNN prepacking)")
    p.add_argument("--target-model", default=_env("TARGET_MODEL", "default"),
                   help="the target a distilled token draft was made for (it lends the draft its embedding)")
    p.add_argument("--ngram-max", type=int, default=3)
    p.add_argument("--ngram-min", type=int, default=1)
    p.add_argument("--sample-top-k", type=int, default=64, help="a model draft samples among its top tokens only")
    p.add_argument("--fp32-head", action="store_true", help="keep a feature draft's head in fp32 (default: int8)")
    p.add_argument("--lookup-min", type=int, default=2,
                   help="a feature draft tries prompt lookup first, from suffixes of this many tokens up (0: off)")

    p = sub.add_parser("serve-coordinator", help="run the coordinator")
    _add_server(p, 50050)
    p.add_argument("--draft", action="append", default=[],
                   help="draft replica host:port (repeatable), or all of them found through dns:///host:port "
                        "(a headless Service) or k8s:///namespace/service:port (the Kubernetes API)")
    p.add_argument("--target", action="append", default=[],
                   help="target replica host:port (repeatable), or dns:///host:port or k8s:///namespace/service:port")
    p.add_argument("--discovery-interval", type=float, default=10.0,
                   help="seconds between DNS lookups of dns:/// replicas; the longest pause before a failed "
                        "k8s:/// watch is retried")
    p.add_argument("--tokenizer", default=_env("TARGET_MODEL", "default"), help="model whose tokenizer to use")
    p.add_argument("--redis-url", default=_env("REDIS_URL", "redis://127.0.0.1:6379/0"),
                   help="session store; rediss:// for TLS (env SPECDEC_REDIS_URL). The password comes from env "
                        "SPECDEC_REDIS_PASSWORD, never a flag")
    p.add_argument("--redis-ca", type=Path, default=_path_env("REDIS_CA"),
                   help="PEM CA bundle of a rediss:// server's certificate (env SPECDEC_REDIS_CA)")
    p.add_argument("--session-ttl", type=int, default=3600, help="seconds an idle session lives")
    p.add_argument("--default-k", type=_k_arg, default=None, help="draft length when a request sets none: N or auto")
    p.add_argument("--max-auto-k", type=int, default=8, help="largest k the adaptive choice tries")
    p.add_argument("--rpc-timeout", type=float, default=30.0, help="deadline of each internal call")
    p.add_argument("--max-active", type=int, default=32, help="requests running at once; more wait in a queue")
    p.add_argument("--max-queued", type=int, default=128,
                   help="requests waiting for a slot; past it requests get RESOURCE_EXHAUSTED with a retry hint")
    p.add_argument("--max-per-client", type=int, default=0,
                   help="requests one client may hold, running or waiting (0: no limit)")
    p.add_argument("--max-sessions-per-client", type=int, default=0,
                   help="sessions one client may keep alive at once; a new one past it gets RESOURCE_EXHAUSTED "
                        "(0: no limit)")
    p.add_argument("--draft-colocated", action="store_true",
                   help="draft and target share one machine's cores: under load, drafting also slows the target")
    p.add_argument("--free-lookup-min", type=int, default=3,
                   help="when the draft service is not worth its cost, propose by prompt lookup in the coordinator "
                        "from context suffixes of this many tokens up (greedy requests; 0: off)")
    p.add_argument("--api-keys-file", type=Path, default=_path_env("API_KEYS_FILE"),
                   help="require an API key: one key, or one sha256:<hex> digest of a key, per line "
                        "(env SPECDEC_API_KEYS_FILE; env SPECDEC_API_KEYS adds comma-separated keys)")
    p.add_argument("--tls-ca", type=Path, default=_path_env("TLS_CA"),
                   help="PEM CA bundle the draft and target certificates chain to: speak TLS to them "
                        "(env SPECDEC_TLS_CA)")
    p.add_argument("--tls-client-cert", type=Path, default=_path_env("TLS_CLIENT_CERT"),
                   help="PEM certificate shown to draft and target for mutual TLS (env SPECDEC_TLS_CLIENT_CERT)")
    p.add_argument("--tls-client-key", type=Path, default=_path_env("TLS_CLIENT_KEY"),
                   help="PEM private key of --tls-client-cert (env SPECDEC_TLS_CLIENT_KEY)")

    p = sub.add_parser("up", help="start redis, draft, target and coordinator on loopback")
    p.add_argument("--port", type=int, default=50050, help="coordinator port")
    _add_stack(p)

    p = sub.add_parser("generate", help="stream an answer, then print the stats")
    p.add_argument("prompt", nargs="?", help="the prompt (sent as a chat user message unless --raw); default: a demo")
    p.add_argument("--address", default=_env("ADDRESS", "127.0.0.1:50050"), help="coordinator address")
    p.add_argument("--local", action="store_true", help="start a local stack for this one request")
    p.add_argument("--raw", action="store_true", help="send the prompt as plain text, no chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--k", type=int, help="draft length (0: target-only); default: the server's")
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--session-id")
    p.add_argument("--tls-ca", type=Path,
                   help="PEM CA bundle the coordinator's certificate chains to: speak TLS to it "
                        "(the API key, if any, comes from env SPECDEC_API_KEY)")
    _add_stack(p)

    sub.add_parser("distill", help="train a draft for a target (specdec distill --help)", add_help=False)

    p = sub.add_parser("bench", help="tokens/s of hf-target, hf-assisted, specdec-k0 and specdec, side by side")
    p.add_argument("--prompts", type=Path, default=Path("bench/prompts.jsonl"), help="JSONL prompt file")
    p.add_argument("--n", type=int, help="use the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--k", type=_k_arg, default=None, help="draft length of the specdec mode: N or auto (default)")
    p.add_argument("--modes", help="comma-separated modes (default: hf-target,hf-assisted,specdec-k0,specdec; "
                                    "with --concurrency: hf-batched,specdec-k0,specdec)")
    p.add_argument("--concurrency", type=_levels_arg,
                   help="closed-loop load levels, for example 1,2,4,8,16: throughput and latency per level")
    p.add_argument("--repeats", type=int, default=1,
                   help="with --concurrency: runs of each specdec mode per level, in A B B A order, summed")
    p.add_argument("--address", help="use a running coordinator instead of starting a local stack")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the in-process HF modes")
    p.add_argument("--out", type=Path, default=Path("reports/bench.json"))
    p.add_argument("--plot", type=Path, help="write a PNG of the report")
    _add_stack(p)
    return parser


def _add_stack(p: argparse.ArgumentParser) -> None:
    _add_common(p)
    p.add_argument("--target-model", default=_env("TARGET_MODEL", "default"))
    p.add_argument("--draft-kind", default=_env("DRAFT_KIND", DEFAULT_DRAFT_KIND),
                   help="ngram: prompt lookup; model: a causal LM or the distilled token draft; feature: the "
                        "distilled EAGLE-style draft (bench: a comma-separated list, one stack each)")
    p.add_argument("--draft-model", default=_env("DRAFT_MODEL", None),
                   help="draft model or distilled draft folder (default: the one shipped for the default target)")
    p.add_argument("--target-threads", type=int, default=2, help="torch threads of the target (of each shard)")
    p.add_argument("--target-tp", type=int, default=1, help="processes the target is sharded over (tensor parallelism)")
    p.add_argument("--draft-threads", type=int, default=1)
    p.add_argument("--default-k", type=_k_arg, default=None, help="server's draft length: N or auto (default)")


def _stack_config(args, port: int, draft_kind: str | None = None):
    from specdec.stack import StackConfig

    kind = draft_kind or args.draft_kind
    return StackConfig(
        target_model=args.target_model,
        draft_kind=kind,
        draft_model=args.draft_model or default_draft_model(kind),
        cache_dir=args.cache_dir,
        coordinator_port=port,
        target_threads=args.target_threads,
        target_tp=args.target_tp,
        draft_threads=args.draft_threads,
        default_k=args.default_k,
        otlp_endpoint=args.otlp_endpoint,
    )


def _up(args) -> None:
    from specdec.stack import LocalStack

    with LocalStack(_stack_config(args, args.port)) as stack:
        print(f"specdec is up: coordinator at {stack.address} (logs in {stack.log_dir}); Ctrl-C stops it", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass


def _generate(args) -> None:
    from specdec.client import Client

    prompt = args.prompt if args.raw else [{"role": "user", "content": args.prompt}] if args.prompt else DEMO_PROMPT
    if args.prompt is None:
        print(f"prompt: {DEMO_PROMPT[0]['content']}\n", flush=True)
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, stop=args.stop, session_id=args.session_id, k=args.k)

    def run(address: str, **connection) -> None:
        with Client(address, **connection) as client:
            for chunk in client.stream(prompt, **options):
                print(chunk.text, end="", flush=True)
                if chunk.stats is not None:
                    s = chunk.stats
                    print(f"\n\n[finish: {chunk.finish_reason}] {s.generated_tokens} tokens in {s.total_ms / 1000:.2f}s "
                          f"({s.tokens_per_second:.1f} tok/s); rounds {s.rounds}, acceptance {s.acceptance_rate:.2f}, "
                          f"mean accepted length {s.mean_accepted_length:.2f}; draft {s.draft_ms:.0f} ms, "
                          f"verify {s.verify_ms:.0f} ms, prefill {s.prefill_ms:.0f} ms, other {s.other_ms:.0f} ms; "
                          f"session {chunk.session_id}")

    if args.local:
        from specdec.stack import LocalStack

        with LocalStack(_stack_config(args, 0)) as stack:
            run(stack.address)
    else:
        run(args.address, api_key=os.environ.get("SPECDEC_API_KEY"), tls=_client_tls(args.tls_ca))


def _levels_arg(value: str) -> list[int]:
    levels = [int(v) for v in value.split(",") if v]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("--concurrency takes positive integers, for example 1,2,4,8,16")
    return levels


def _bench_load(args) -> None:
    import json

    import torch

    from specdec.bench import load_prompts
    from specdec.bench_load import LOAD_MODES, plot_load, run_hf_batched_level, run_specdec_level, summarize_load
    from specdec.models import load_model
    from specdec.stack import LocalStack

    modes = [m for m in (args.modes or ",".join(LOAD_MODES)).split(",") if m]
    if set(modes) - set(LOAD_MODES):
        raise SystemExit(f"with --concurrency the modes are {LOAD_MODES}")
    if args.temperature != 0:
        raise SystemExit("--concurrency runs greedy (its exactness check compares with target-only output)")
    if args.repeats < 1:
        raise SystemExit("--repeats: at least 1")
    prompts = load_prompts(args.prompts, args.n)
    torch.set_num_threads(args.threads)
    loaded = load_model(args.target_model, args.cache_dir)
    results: dict = {}
    # Target-only reference: HF generate one prompt at a time (hf-batched at level 1 is exactly that).
    reference_level = run_hf_batched_level(loaded, prompts, 1, args.max_new_tokens)
    if "hf-batched" in modes:
        results["hf-batched"] = {1: reference_level} if 1 in args.concurrency else {}
        for level in args.concurrency:
            if level != 1:
                results["hf-batched"][level] = run_hf_batched_level(loaded, prompts, level, args.max_new_tokens)
    del loaded  # the stack needs the cores and the memory now
    spec_modes = [m for m in modes if m.startswith("specdec")]
    if spec_modes:
        stack = None
        address = args.address
        if address is None:
            stack = LocalStack(_stack_config(args, 0, args.draft_kind.split(",")[0])).start()
            address = stack.address
        try:
            for level in args.concurrency:
                # The modes take turns at each level, in mirrored order on every second repeat (A B B A):
                # a shared machine's speed drifts by tens of percent over minutes, and a drift that is
                # steady across the level then falls on both modes alike.
                for repeat in range(args.repeats):
                    for mode in spec_modes if repeat % 2 == 0 else spec_modes[::-1]:
                        run = run_specdec_level(mode, address, prompts, level, args.max_new_tokens, args.k)
                        if repeat == 0:
                            results.setdefault(mode, {})[level] = run
                        else:
                            results[mode][level].absorb(run)
        finally:
            if stack is not None:
                stack.close()
    report = {
        "config": {"prompts": str(args.prompts), "n": len(prompts), "max_new_tokens": args.max_new_tokens,
                   "concurrency": args.concurrency, "k": "auto" if args.k is None else args.k,
                   "draft_kind": args.draft_kind.split(",")[0], "target_threads": args.target_threads,
                   "draft_threads": args.draft_threads, "hf_threads": args.threads, "repeats": args.repeats},
        **summarize_load(results, reference_level.outputs),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    if args.plot:
        plot_load(report, args.plot)


def _bench(args) -> None:
    import json

    import torch

    from specdec.bench import MODES, load_prompts, plot, run_hf, run_specdec, summarize
    from specdec.models import load_model, resolve_model_path
    from specdec.stack import LocalStack

    if args.concurrency:
        _bench_load(args)
        return
    modes = [m for m in (args.modes or "hf-target,hf-assisted,specdec-k0,specdec").split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    k = args.k
    prompts = load_prompts(args.prompts, args.n)
    torch.set_num_threads(args.threads)
    loaded = load_model(args.target_model, args.cache_dir)
    kinds = [kind for kind in args.draft_kind.split(",") if kind]
    if set(kinds) - set(DRAFT_KINDS) or not kinds:
        raise SystemExit(f"--draft-kind takes a comma-separated list of {DRAFT_KINDS}")
    if args.draft_model and len(kinds) > 1:
        raise SystemExit("--draft-model names one draft: give one --draft-kind with it")
    # Assisted generation is the nearest in-process peer: with a plain causal LM draft it drives that
    # model; distilled drafts are no transformers models, so it falls back to prompt lookup.
    draft = None
    if kinds[0] == "model":
        from draft_service.token_draft import CARD_FILE

        path = resolve_model_path(args.draft_model or default_draft_model("model"), args.cache_dir)
        if not (path / CARD_FILE).is_file():
            draft = load_model(str(path), args.cache_dir).model
    results = {}
    for mode in modes:
        if mode.startswith("hf"):
            results[mode] = run_hf(mode, loaded, draft, prompts, args.max_new_tokens, args.temperature, k)
    spec_modes = [m for m in modes if m.startswith("specdec")]
    for i, kind in enumerate(kinds if spec_modes else []):
        # specdec-k0 does not draft: it runs once, on the first stack.
        todo = [m for m in spec_modes if m == "specdec" or (m == "specdec-k0" and i == 0)]
        stack = None
        address = args.address
        if address is None:
            stack = LocalStack(_stack_config(args, 0, kind)).start()
            address = stack.address
        try:
            for mode in todo:
                name = mode if mode == "specdec-k0" or len(kinds) == 1 else f"specdec:{kind}"
                results[name] = run_specdec(name, address, prompts, args.max_new_tokens, args.temperature, k)
        finally:
            if stack is not None:
                stack.close()
    report = {
        "config": {"prompts": str(args.prompts), "n": len(prompts), "max_new_tokens": args.max_new_tokens,
                   "temperature": args.temperature, "k": "auto" if k is None else k, "draft_kinds": kinds,
                   "hf_assisted": "assistant_model" if draft is not None else "prompt_lookup_num_tokens",
                   "target_threads": args.target_threads, "draft_threads": args.draft_threads},
        "modes": summarize(results, greedy=args.temperature == 0),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    if args.plot:
        plot(report["modes"], args.plot)


def main(argv: list[str] | None = None) -> None:
    """Parses the command line and runs the chosen command."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["distill"]:
        from specdec.distill.cli import main as distill

        raise SystemExit(distill(argv[1:]))
    args = _parser().parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so a local stack this command started is always stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command == "serve-target":
        from target_service.server import main as serve

        config = TargetConfig(server=_server(args), model=_model(args, args.model), max_batch_rows=args.max_batch_rows,
                              tp=_tensor_parallel(args))
        if config.tp.world_size > 1 and not config.tp.launched:
            from target_service.tensor_parallel import free_port, launch_followers, watch_followers

            config = replace(config, tp=replace(config.tp, master_port=config.tp.master_port or free_port("127.0.0.1")))
            watch_followers(launch_followers(config.tp, argv))
        serve(config)
    elif args.command == "serve-draft":
        from draft_service.server import main as serve

        serve(DraftConfig(server=_server(args), kind=args.kind,
                          model=_model(args, args.model or default_draft_model(args.kind)), target_model=args.target_model,
                          ngram_max=args.ngram_max, ngram_min=args.ngram_min, sample_top_k=args.sample_top_k,
                          int8_head=not args.fp32_head, lookup_min=args.lookup_min))
    elif args.command == "serve-coordinator":
        from coordinator.server import main as serve

        serve(_coordinator_config(args))
    elif args.command == "up":
        _up(args)
    elif args.command == "generate":
        _generate(args)
    elif args.command == "bench":
        _bench(args)


if __name__ == "__main__":
    main()
