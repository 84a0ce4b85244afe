"""``specdec serve-coordinator``: the coordinator's flags, and the config they make.

Registered with the ``specdec`` command through the ``specdec.commands`` entry point group. The
coordinator never imports torch (``tests/test_cli.py`` checks it), nor does anything here.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from specdec.cli import add_server, client_tls, env, extra_installed, k_arg, path_env, server_config
from specdec.config import AdmissionLimits, CoordinatorConfig, ModelConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``serve-coordinator`` (with the server extra installed)."""
    if not extra_installed("server"):
        return
    p = subparsers.add_parser("serve-coordinator", help="run the coordinator")
    add_server(p, 50050)
    p.add_argument(
        "--draft",
        action="append",
        default=[],
        help="draft replica host:port (repeatable), or all of them found through dns:///host:port "
        "(a headless Service) or k8s:///namespace/service:port (the Kubernetes API)",
    )
    p.add_argument(
        "--target",
        action="append",
        default=[],
        help="target replica host:port (repeatable), or dns:///host:port or k8s:///namespace/service:port",
    )
    p.add_argument(
        "--discovery-interval",
        type=float,
        default=10.0,
        help="seconds between DNS lookups of dns:/// replicas; the longest pause before a failed "
        "k8s:/// watch is retried",
    )
    p.add_argument(
        "--tokenizer",
        default=env("TARGET_MODEL", "default"),
        help="model whose tokenizer to use (env SPECDEC_TARGET_MODEL)",
    )
    p.add_argument(
        "--chat-template",
        default=env("CHAT_TEMPLATE", None),
        help="render chat with this template instead of the tokenizer's own (needed by a model that has "
        "none): chatml, gemma, or a Jinja file (env SPECDEC_CHAT_TEMPLATE)",
    )
    p.add_argument(
        "--redis-url",
        default=env("REDIS_URL", "redis://127.0.0.1:6379/0"),
        help="session store; rediss:// for TLS (env SPECDEC_REDIS_URL). The password comes from env "
        "SPECDEC_REDIS_PASSWORD, never a flag",
    )
    p.add_argument(
        "--redis-ca",
        type=Path,
        default=path_env("REDIS_CA"),
        help="PEM CA bundle of a rediss:// server's certificate (env SPECDEC_REDIS_CA)",
    )
    p.add_argument("--session-ttl", type=int, default=3600, help="seconds an idle session lives")
    p.add_argument("--default-k", type=k_arg, default=None, help="draft length when a request sets none: N or auto")
    p.add_argument("--max-auto-k", type=int, default=8, help="largest k the adaptive choice tries")
    p.add_argument("--rpc-timeout", type=float, default=30.0, help="deadline of each call to a target")
    p.add_argument(
        "--draft-timeout",
        type=float,
        default=5.0,
        help="deadline of each call to a draft: short, as a late draft only costs its round the speculation",
    )
    p.add_argument("--max-active", type=int, default=32, help="requests running at once; more wait in a queue")
    p.add_argument(
        "--max-queued",
        type=int,
        default=128,
        help="requests waiting for a slot; past it requests get RESOURCE_EXHAUSTED with a retry hint",
    )
    p.add_argument(
        "--max-per-client", type=int, default=0, help="requests one client may hold, running or waiting (0: no limit)"
    )
    p.add_argument(
        "--max-sessions-per-client",
        type=int,
        default=0,
        help="sessions one client may keep alive at once; a new one past it gets RESOURCE_EXHAUSTED (0: no limit)",
    )
    p.add_argument(
        "--draft-colocated",
        action="store_true",
        help="draft and target share one machine's cores: under load, drafting also slows the target",
    )
    p.add_argument(
        "--free-lookup-min",
        type=int,
        default=3,
        help="when the draft service is not worth its cost, propose by prompt lookup in the coordinator "
        "from context suffixes of this many tokens up (greedy requests; 0: off)",
    )
    p.add_argument(
        "--no-confidence-cutoff",
        dest="confidence_cutoff",
        action="store_false",
        help="with k auto, draft all k tokens instead of stopping where the draft's confidence no "
        "longer pays for the tokens it adds",
    )
    p.add_argument(
        "--draft-ahead",
        type=int,
        default=0,
        help="a feature draft drafts up to this many tokens ahead while the target verifies a lone "
        "session's round, on the guess that all of it passes (0: off; pays where the draft has "
        "cores of its own)",
    )
    p.add_argument(
        "--tree-nodes",
        type=int,
        default=15,
        help="most nodes of a round's token tree; with k auto each round picks a tree or a chain (0: chains only)",
    )
    p.add_argument(
        "--http-port",
        type=int,
        default=env("HTTP_PORT", None) or None,
        help="also serve the OpenAI-compatible HTTP API (/v1/chat/completions ...) on this port, with the "
        "gRPC port's TLS and API keys; 0 picks a free one (env SPECDEC_HTTP_PORT); unset: none",
    )
    p.add_argument(
        "--served-model-name",
        action="append",
        default=[],
        metavar="NAME",
        help="another name the HTTP API accepts for the served model and lists in /v1/models "
        "(repeatable, or comma-separated); answers still name the model's own id",
    )
    p.add_argument(
        "--allowed-origins",
        action="append",
        default=[],
        metavar="ORIGINS",
        help="browser origins the HTTP API answers CORS for, comma-separated (https://app.example.com; "
        "* for any); unset: no CORS headers",
    )
    p.add_argument(
        "--checkpoint-interval",
        type=float,
        default=0.25,
        help="least seconds between two checkpoints of a running turn to Redis (0: every round); a "
        "resume after a coordinator's loss replays at most this much",
    )
    p.add_argument(
        "--api-keys-file",
        type=Path,
        default=path_env("API_KEYS_FILE"),
        help="require an API key: one key, or one sha256:<hex> digest of a key, per line "
        "(env SPECDEC_API_KEYS_FILE; env SPECDEC_API_KEYS adds comma-separated keys)",
    )
    p.add_argument(
        "--tls-ca",
        type=Path,
        default=path_env("TLS_CA"),
        help="PEM CA bundle the draft and target certificates chain to: speak TLS to them (env SPECDEC_TLS_CA)",
    )
    p.add_argument(
        "--tls-client-cert",
        type=Path,
        default=path_env("TLS_CLIENT_CERT"),
        help="PEM certificate shown to draft and target for mutual TLS (env SPECDEC_TLS_CLIENT_CERT)",
    )
    p.add_argument(
        "--tls-client-key",
        type=Path,
        default=path_env("TLS_CLIENT_KEY"),
        help="PEM private key of --tls-client-cert (env SPECDEC_TLS_CLIENT_KEY)",
    )
    p.set_defaults(run=serve)


def name_list(values: list[str], flag: str) -> tuple[str, ...]:
    """The names of a repeatable, comma-separated flag, each once, in order; an empty one is an error."""
    names = [name.strip() for value in values for name in value.split(",")]
    if any(not name for name in names):
        raise ValueError(f"{flag}: an empty name in {values!r}")
    return tuple(dict.fromkeys(names))


def coordinator_config(args: argparse.Namespace) -> CoordinatorConfig:
    """The coordinator's config from its flags; API keys are read (and hashed) here, once."""
    from coordinator.auth import read_api_key_hashes
    from coordinator.discovery import parse_replicas
    from specdec.chat_templates import resolve_chat_template

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
        chat_template = None if args.chat_template is None else resolve_chat_template(args.chat_template)
        served_model_names = name_list(args.served_model_name, "--served-model-name")
        allowed_origins = name_list(args.allowed_origins, "--allowed-origins")
        for origin in allowed_origins:
            # A browser sends scheme://host[:port], nothing more: a path or a trailing / never matches.
            if origin != "*" and not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*://[^/\s]+", origin):
                raise ValueError(f"--allowed-origins: {origin!r} is not an origin like https://app.example.com, or *")
    except ValueError as exc:
        raise SystemExit(f"specdec: {exc}") from None
    return CoordinatorConfig(
        server=server_config(args),
        draft_addresses=draft_addresses,
        target_addresses=target_addresses,
        draft_discovery=draft_discovery,
        target_discovery=target_discovery,
        discovery_interval_s=args.discovery_interval,
        tokenizer=ModelConfig(model=args.tokenizer, cache_dir=args.cache_dir),
        chat_template=chat_template,
        redis_url=args.redis_url,
        redis_password=os.environ.get("SPECDEC_REDIS_PASSWORD") or None,
        redis_ca=args.redis_ca,
        session_ttl_s=args.session_ttl,
        default_k=args.default_k,
        max_auto_k=args.max_auto_k,
        rpc_timeout_s=args.rpc_timeout,
        draft_timeout_s=args.draft_timeout,
        api_key_hashes=api_key_hashes,
        backend_tls=client_tls(args.tls_ca, args.tls_client_cert, args.tls_client_key),
        admission=AdmissionLimits(args.max_active, args.max_queued, args.max_per_client, args.max_sessions_per_client),
        draft_colocated=args.draft_colocated,
        free_lookup_min=args.free_lookup_min,
        confidence_cutoff=args.confidence_cutoff,
        draft_ahead=args.draft_ahead,
        tree_nodes=args.tree_nodes,
        checkpoint_interval_s=args.checkpoint_interval,
        http_port=args.http_port,
        served_model_names=served_model_names,
        allowed_origins=allowed_origins,
    )


def serve(args: argparse.Namespace) -> None:
    """Runs the coordinator."""
    from coordinator.server import main

    main(coordinator_config(args))
