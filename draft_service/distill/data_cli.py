"""``specdec distill-data``: collect the broad corpus and the target's answers to it into a data folder.

Resumable: run it again (on this machine or another with a clone of the folder) and it continues
where the shards end. ``specdec distill --data FOLDER`` trains on what it holds.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import sys
from pathlib import Path

from draft_service.distill.config import DEVICES, DataConfig
from specdec.config import default_cache_dir
from specdec.host import tcmalloc


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``specdec distill-data`` to the ``specdec`` command (``distill``'s entry point registers it)."""
    p = subparsers.add_parser("distill-data", help="collect distillation data (specdec distill-data --help)")
    add_arguments(p)
    # The subcommand's name precedes its flags, so its first occurrence in argv is the name.
    p.set_defaults(run=lambda args: _run(config_from(args), sys.argv[sys.argv.index("distill-data") + 1 :]))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``specdec distill-data``, defaults from ``DataConfig``."""
    d = DataConfig(target="", data=Path(), cache_dir=Path())
    p.add_argument("--target", default="default", help="'default', a HF folder or a .gguf file")
    p.add_argument("--data", type=Path, required=True, help="the data folder (created, or continued)")
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir(), help="converted model cache")
    p.add_argument("--minutes", type=float, default=d.minutes, help="stop taking new prompts after this long")
    p.add_argument("--tokens", type=int, default=d.tokens, help="generated tokens to collect in all")
    p.add_argument("--composed", type=int, default=d.composed, help="composed requests in a new corpus")
    p.add_argument("--meta", type=int, default=d.meta, help="self-instruct requests to the target in a new corpus")
    p.add_argument("--max-new", type=int, default=d.max_new, help="longest answer, in tokens")
    p.add_argument("--width", type=int, default=d.width, help="sessions in one pass")
    p.add_argument("--dtype", default=d.dtype, help="the target's dtype (auto: as the target service serves it)")
    p.add_argument("--no-compile", action="store_true", help="run the eager pass, not the compiled one")
    p.add_argument(
        "--device", choices=DEVICES, default=d.device, help="cuda: answer in padded waves of --width prompts on a GPU"
    )
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads (1 where other jobs share the cores)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--no-progress", action="store_true", help="log lines instead of progress bars")


def config_from(args: argparse.Namespace) -> DataConfig:
    """The ``DataConfig`` the flags describe."""
    return DataConfig(
        target=args.target,
        data=args.data,
        cache_dir=args.cache_dir,
        composed=args.composed,
        meta=args.meta,
        max_new=args.max_new,
        width=args.width,
        minutes=args.minutes,
        tokens=args.tokens,
        dtype=args.dtype,
        compile=not args.no_compile,
        device=args.device,
        threads=args.threads,
        seed=args.seed,
        progress=not args.no_progress and sys.stderr.isatty(),
    )


def _preloaded_tcmalloc(flags: list[str]) -> None:
    """Runs this command again with tcmalloc preloaded when the host has it and it is not loaded yet.

    A pass over many sessions allocates and frees large blocks each time; glibc hands them back to
    the kernel and faults them in again (a 32-prompt pass measured 13.1 s against 2.5 s; the model services
    preload it for the same reason, ``specdec.host.tcmalloc``).
    """
    library = tcmalloc()
    if library is None or str(library) in os.environ.get("LD_PRELOAD", ""):
        return
    env = dict(os.environ, LD_PRELOAD=" ".join(filter(None, [os.environ.get("LD_PRELOAD"), str(library)])))
    os.execve(sys.executable, [sys.executable, "-m", "draft_service.distill.data_cli", *flags], env)


def _run(config: DataConfig, flags: list[str] | None) -> int:
    """Collects as ``config`` says. A command line's run passes its ``flags``: it first runs again
    with them under tcmalloc, and a SIGTERM stops it as Ctrl-C does."""
    if flags is not None:
        _preloaded_tcmalloc(flags)
        # A stop (kill, a pod's termination) writes the answers that finished before it, as Ctrl-C does.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    # torch and transformers load only once the flags parse
    import torch

    from draft_service.distill.data import run_data

    torch.set_num_threads(config.threads)
    loaded, answerer = _gpu_answerer(config) if config.device != "cpu" else _serving_answerer(config)
    made = run_data(config, answerer, loaded)
    print(" ".join(f"{stage}={tokens}" for stage, tokens in made.items()), "generated tokens in", config.data)
    return 0


def _serving_answerer(config: DataConfig):
    """The target loaded as the target service loads it (the serving dtype, the packed row-invariant
    linears) and its answerer: the compiled pass where it compiles, else the eager ragged one."""
    from draft_service.distill.stream_collect import answer
    from specdec.compiled import build_compiled, compile_unsupported
    from specdec.models import load_model
    from specdec.ragged import ragged_forward

    loaded = load_model(config.target, config.cache_dir, dtype=config.dtype, pack=True)
    if config.compile and compile_unsupported(loaded.model) is None:
        forward = build_compiled(loaded.model, config.cache_dir).forward
    else:
        model = loaded.model

        def forward(items):
            return ragged_forward(model, items)

    return loaded, functools.partial(answer, forward, **_answering(config, loaded))


def _gpu_answerer(config: DataConfig):
    """The target on the GPU in ``config.dtype`` with PyTorch's fused attention, and its wave answerer."""
    from draft_service.distill.placement import require_device
    from draft_service.distill.wave_collect import wave_answer
    from specdec.models import load_model

    require_device(config.device)
    loaded = load_model(config.target, config.cache_dir, dtype=config.dtype, device=config.device)
    # Left-padded waves need no batch invariance (each answer is its own wave row, once): the fused kernel.
    loaded.model.set_attn_implementation("sdpa")
    return loaded, functools.partial(wave_answer, loaded.model, pad_id=loaded.pad_id, **_answering(config, loaded))


def _answering(config: DataConfig, loaded) -> dict:
    """What every answerer takes besides its model: sessions at once, end tokens, seed, context."""
    return dict(width=config.width, eos_ids=loaded.eos_token_ids, seed=config.seed, max_context=loaded.max_context)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``specdec distill-data``; returns the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(prog="specdec distill-data", description=__doc__.splitlines()[0])
    add_arguments(p)
    return _run(config_from(p.parse_args(argv)), sys.argv[1:] if argv is None else None)


if __name__ == "__main__":
    raise SystemExit(main())
