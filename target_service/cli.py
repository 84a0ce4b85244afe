"""``specdec serve-target``: the target service's flags, and the config they make; and ``specdec
convert``, which converts a model for every command to load.

Registered with the ``specdec`` command through the ``specdec.commands`` entry point group; nothing
here imports torch, which loads only once the target starts.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace

from specdec.cli import (
    STREAM_WEIGHTS,
    add_cache_dir,
    add_cache_limits,
    add_device,
    add_server,
    env,
    extra_installed,
    model_config,
    server_config,
)
from specdec.config import COMPILE_MODES, TargetConfig, TensorParallelConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``serve-target`` and ``convert`` (with the server extra installed)."""
    if not extra_installed("server"):
        return
    p = subparsers.add_parser(
        "convert",
        help="convert a GGUF model into a safetensors folder under the cache directory, once; every "
        "command that is given the .gguf file then loads that folder",
    )
    p.add_argument("model", help="'default', a .gguf file, or a HF folder (checked, already loadable)")
    add_cache_dir(p)
    p.set_defaults(run=convert)
    p = subparsers.add_parser("serve-target", help="run the target service")
    add_server(p, 50052)
    p.add_argument(
        "--model",
        default=env("TARGET_MODEL", "default"),
        help="'default', a HF folder or a .gguf file (env SPECDEC_TARGET_MODEL)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    add_device(p, "DEVICE")
    p.add_argument("--max-sessions", type=int, default=64, help="session caches held before LRU eviction")
    add_cache_limits(p)
    p.add_argument("--no-pack", action="store_true", help="keep plain linear layers (no oneDNN prepacking)")
    p.add_argument(
        "--stream-weights",
        choices=list(STREAM_WEIGHTS),
        default=env("STREAM_WEIGHTS", "auto"),
        help="read the weights with the non-temporal hint, sparing the last-level cache; auto: when they "
        "outgrow it (env SPECDEC_STREAM_WEIGHTS)",
    )
    p.add_argument(
        "--max-batch-rows",
        type=int,
        default=256,
        help="most token rows one batched verify pass feeds (all sessions together)",
    )
    p.add_argument(
        "--no-fold-prefills",
        dest="fold_prefills",
        action="store_false",
        help="give every prompt a pass of its own, even while other sessions' passes run",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=128,
        help="feed a longer prompt this many tokens a pass, in passes shared with running sessions "
        "(0: in one pass of its own, which they all wait for); with none running, up to "
        "--max-batch-rows - 1 a pass",
    )
    p.add_argument(
        "--compile",
        choices=COMPILE_MODES,
        default=env("COMPILE", "background"),
        help="compile the pass (torch.compile): background serves at once and switches when the graphs are "
        "built, minutes cold and seconds from the cache; wait builds them before reporting ready (env "
        "SPECDEC_COMPILE)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=int(env("TENSOR_PARALLEL", "1")),
        help="shard the target over N processes (tensor parallelism; env SPECDEC_TENSOR_PARALLEL); this process "
        "serves and starts the others unless torchrun did (RANK / WORLD_SIZE set)",
    )
    p.set_defaults(run=serve)


def convert(args: argparse.Namespace) -> None:
    """Converts ``args.model`` (unless it already was) and prints the folder every command loads."""
    import time

    from specdec.models import load_config
    from specdec.vocab import resolve_model_path

    started = time.perf_counter()
    try:
        folder = resolve_model_path(args.model, args.cache_dir)
        config = load_config(folder)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"specdec convert: {exc}") from None
    print(
        f"{folder}\n({config.model_type}, {config.num_hidden_layers} layers, "
        f"ready in {time.perf_counter() - started:.1f}s)"
    )


def tensor_parallel(args: argparse.Namespace) -> TensorParallelConfig:
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
                world_size=world_size,
                rank=int(os.environ.get("RANK", "0")),
                master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                master_port=int(os.environ.get("MASTER_PORT", "0")),
                launched=True,
                launcher_pid=int(launcher) if launcher else None,
            )
        return TensorParallelConfig(world_size=args.tp)
    except ValueError as exc:
        raise SystemExit(f"specdec: tensor parallel: {exc}") from None


def serve(args: argparse.Namespace) -> None:
    """Runs the target service; with ``--tp`` above 1 and no launcher, starts the other ranks first."""
    from target_service.server import main

    try:
        config = TargetConfig(
            server=server_config(args),
            model=model_config(args, args.model),
            max_batch_rows=args.max_batch_rows,
            fold_prefills=args.fold_prefills,
            prefill_chunk=args.prefill_chunk,
            tp=tensor_parallel(args),
            compile=args.compile,
        )
    except ValueError as exc:  # --device, alone or with --tp
        raise SystemExit(f"specdec: {exc}") from None
    if config.tp.world_size > 1 and not config.tp.launched:
        from target_service.tensor_parallel import free_port, launch_followers, watch_followers

        config = replace(config, tp=replace(config.tp, master_port=config.tp.master_port or free_port("127.0.0.1")))
        watch_followers(launch_followers(config.tp, args.argv))
    main(config)
