"""``specdec serve-draft``: the draft service's flags, and the config they make.

Registered with the ``specdec`` command through the ``specdec.commands`` entry point group; nothing
here imports torch, which loads only once the draft starts. ``specdec distill`` registers apart, in
``draft_service.distill.cli``.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace

from specdec.cli import (
    add_cache_limits,
    add_device,
    add_server,
    env,
    extra_installed,
    model_config,
    server_config,
    threads_arg,
)
from specdec.config import DEFAULT_DRAFT_KIND, DRAFT_KINDS, DraftConfig, default_draft_model


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``serve-draft`` (with the server extra installed)."""
    if not extra_installed("server"):
        return
    p = subparsers.add_parser("serve-draft", help="run the draft service")
    add_server(p, 50051)
    p.add_argument(
        "--kind",
        choices=DRAFT_KINDS,
        default=env("DRAFT_KIND", DEFAULT_DRAFT_KIND),
        help="draft kind (env SPECDEC_DRAFT_KIND)",
    )
    p.add_argument(
        "--model",
        default=env("DRAFT_MODEL", None),
        help="draft model or distilled draft folder, or the model whose tokenizer n-gram drafting speaks "
        "(default: the draft shipped for the default target; env SPECDEC_DRAFT_MODEL)",
    )
    p.add_argument(
        "--threads",
        type=threads_arg,
        default=None,
        help="torch threads: N or auto (default; 1 for a draft under 200M parameters, else every core "
        "when OMP_WAIT_POLICY=PASSIVE makes idle threads sleep, half of them otherwise)",
    )
    add_device(p, "DRAFT_DEVICE")
    p.add_argument("--max-sessions", type=int, default=64, help="session caches held before LRU eviction")
    add_cache_limits(p)
    p.add_argument("--no-pack", action="store_true", help="keep plain linear layers (no oneDNN prepacking)")
    p.add_argument(
        "--target-model",
        default=env("TARGET_MODEL", "default"),
        help="the target a distilled draft was made for (it lends the draft its embedding; env SPECDEC_TARGET_MODEL)",
    )
    p.add_argument("--ngram-max", type=int, default=3)
    p.add_argument("--ngram-min", type=int, default=1)
    p.add_argument("--sample-top-k", type=int, default=64, help="a model draft samples among its top tokens only")
    p.add_argument("--fp32-head", action="store_true", help="keep a feature draft's head in fp32 (default: int8)")
    p.add_argument(
        "--lookup-min",
        type=int,
        default=2,
        help="a feature draft tries prompt lookup first, from suffixes of this many tokens up (0: off)",
    )
    p.add_argument(
        "--tree-beam",
        type=int,
        default=0,
        help="nodes each level of a draft tree expands (0: 4 for a feature draft, 1 for a model draft)",
    )
    p.set_defaults(run=serve)


def serve(args: argparse.Namespace) -> None:
    """Runs the draft service."""
    from draft_service.server import main

    try:
        draft_model = args.model or default_draft_model(args.kind, args.target_model)
    except ValueError as exc:
        raise SystemExit(f"specdec serve-draft: {exc}") from None
    auto = args.threads is None
    main(
        DraftConfig(
            server=server_config(args),
            kind=args.kind,
            model=replace(model_config(args, draft_model), threads=1) if auto else model_config(args, draft_model),
            target_model=args.target_model,
            ngram_max=args.ngram_max,
            ngram_min=args.ngram_min,
            sample_top_k=args.sample_top_k,
            int8_head=not args.fp32_head,
            lookup_min=args.lookup_min,
            tree_beam=args.tree_beam,
            auto_threads=auto,
            cores=len(os.sched_getaffinity(0)),
            passive_wait=os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE",
        )
    )
