"""``specdec distill``: train a draft for a target from the target's own continuations.

    specdec distill --target default --out drafts/smollm2-135m-token [--kind token] [--minutes 15]
                    [--tokens 80000] [--seed 0] [--resume] [--prompts-file FILE] [--device cuda]

Builds a prompt set (templates and standard-library docstrings, or the user's own prompts file),
collects the target's greedy and sampled continuations, trains the draft, evaluates it on held-out
prompts and writes the draft with its card. Data and checkpoints live in ``--work`` so ``--resume``
continues a stopped run.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path

from draft_service.distill import data_cli
from draft_service.distill.config import DEVICES, DTYPES, DistillConfig
from specdec.cli import extra_installed
from specdec.config import default_cache_dir


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``specdec distill`` and ``specdec distill-data`` to the ``specdec`` command (entry point group
    ``specdec.commands``), with the server and train extras installed."""
    if not extra_installed("server", "train"):
        return
    p = subparsers.add_parser(
        "distill", help="train a draft for a target (specdec distill --help)", description=__doc__.splitlines()[0]
    )
    add_arguments(p)
    # The recipe on the card records the flags as given, after the subcommand's name.
    p.set_defaults(run=lambda args: _run(_config(args, args.argv[1:])))
    data_cli.register(subparsers)


def parser() -> argparse.ArgumentParser:
    """The ``specdec distill`` argument parser, on its own."""
    p = argparse.ArgumentParser(prog="specdec distill", description=__doc__.splitlines()[0])
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``specdec distill``, with the defaults of ``DistillConfig``."""
    d = DistillConfig(target="", out=Path(), work=Path(), cache_dir=Path(), command="")
    p.add_argument("--target", required=True, help="'default', a HF folder or a .gguf file")
    p.add_argument("--out", type=Path, required=True, help="folder to write the draft and its card to")
    p.add_argument(
        "--kind",
        choices=["token", "feature"],
        default=d.kind,
        help="token: a small LM over the target embedding; feature: EAGLE-style, reads the target hidden states",
    )
    p.add_argument("--minutes", type=float, default=d.minutes, help="compute budget for collection + training")
    p.add_argument("--tokens", type=int, default=d.tokens, help="generated target tokens to collect for training")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the prompt set, sampling and training")
    p.add_argument("--resume", action="store_true", help="continue from the data and checkpoint in --work")
    p.add_argument(
        "--work", type=Path, default=None, help="data and checkpoints (default: <cache-dir>/distill/<out folder name>)"
    )
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir(), help="converted model cache")
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads")
    p.add_argument("--device", choices=DEVICES, default=d.device, help="where the target and training compute")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default=d.dtype,
        help="target dtype and training autocast; auto: the target in bfloat16 where the device computes it "
        "natively (a GPU, a CPU with AVX-512 BF16 or AMX), else float32, and bf16 training on a GPU only",
    )
    p.add_argument(
        "--no-progress", action="store_true", help="no progress bars (they are drawn only when stderr is a terminal)"
    )
    p.add_argument(
        "--collect-only", action="store_true", help="stop after collecting the data (train later with --resume)"
    )
    g = p.add_argument_group("data")
    g.add_argument(
        "--data",
        type=Path,
        default=None,
        help="a `specdec distill-data` folder: train on up to --tokens of its answers, evaluate on its held-out "
        "requests by category; nothing is collected",
    )
    g.add_argument(
        "--prompts-file",
        type=Path,
        default=None,
        help="your own prompts instead of the built-in set: OpenAI-style JSONL ({'messages': [...]} or "
        "{'prompt': ...} a line) or ShareGPT JSON; one prompt per user turn, held out per 'category'",
    )
    g.add_argument(
        "--held-out-share",
        type=float,
        default=d.held_out_share,
        help="with --prompts-file: share of each category's conversations held out",
    )
    g.add_argument(
        "--held-out-cap",
        type=int,
        default=d.held_out_cap,
        help="with --prompts-file: at most this many conversations held out per category",
    )
    g.add_argument(
        "--prompts", type=int, default=d.prompts, help="built-in set: prompts to build (used in seeded order)"
    )
    g.add_argument("--held-out", type=int, default=d.held_out, help="built-in set: prompts held out for evaluation")
    g.add_argument(
        "--prompt-offset",
        type=int,
        default=d.prompt_offset,
        help="skip this many training prompts (those an --init-draft was trained on); held-out ones stay",
    )
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="prompts continued together")
    g.add_argument("--max-new", type=int, default=d.max_new, help="tokens generated per training prompt")
    g.add_argument("--eval-max-new", type=int, default=d.eval_max_new, help="tokens generated per held-out prompt")
    g.add_argument("--temperatures", type=_floats, default=d.temperatures, help="cycled per batch, 0 = greedy")
    g.add_argument("--collect-share", type=float, default=d.collect_share, help="share of --minutes for collection")
    g.add_argument(
        "--extra-eval",
        type=Path,
        action="append",
        default=[],
        help="JSONL prompts to evaluate on as well (never trained on)",
    )
    g = p.add_argument_group("draft")
    g.add_argument("--layers", type=int, default=d.layers, help="decoder layers")
    g.add_argument("--init-from", type=_ints, default=d.init_from, help="target layers to initialise them from")
    g.add_argument("--head-size", type=int, default=d.head_size, help="reduced vocabulary size N")
    g.add_argument(
        "--side-layers",
        type=_ints,
        default=d.side_layers,
        help="feature draft: target layers (0-based) whose outputs it also reads, e.g. 2,15",
    )
    g.add_argument(
        "--init-draft",
        type=Path,
        default=None,
        help="feature draft: start from this distilled draft (same target and head; its side layers "
        "a prefix of --side-layers) instead of the target's last layer",
    )
    g = p.add_argument_group("training")
    g.add_argument("--lr", type=float, default=d.lr)
    g.add_argument("--epochs", type=float, default=d.epochs, help="at most this many passes over the data")
    g.add_argument("--batch-tokens", type=int, default=d.batch_tokens, help="padded tokens per training batch")
    g.add_argument("--max-len", type=int, default=d.max_len, help="training sequence length cap")
    g.add_argument(
        "--soft-weight", type=float, default=d.soft_weight, help="weight of top-16 distribution distillation"
    )
    g.add_argument("--prompt-weight", type=float, default=d.prompt_weight, help="loss weight of prompt positions")
    g.add_argument(
        "--rollout-steps",
        type=int,
        default=d.rollout_steps,
        help="feature draft: draft steps trained at every position (the service drafts up to k)",
    )


def config_from_args(argv: list[str]) -> DistillConfig:
    """Parses ``argv`` (without the program and subcommand names) into a config."""
    return _config(parser().parse_args(argv), argv)


def _config(args: argparse.Namespace, argv: list[str]) -> DistillConfig:
    """The config of parsed flags; ``argv``, the flags as given, goes into the card's recipe."""
    if len(args.init_from) != args.layers:
        raise SystemExit(f"--init-from names {len(args.init_from)} layers, --layers is {args.layers}")
    if args.side_layers and args.kind != "feature":
        raise SystemExit("--side-layers is for --kind feature")
    if args.init_draft and args.kind != "feature":
        raise SystemExit("--init-draft is for --kind feature")
    if args.prompts_file is not None and not args.prompts_file.is_file():
        raise SystemExit(f"--prompts-file {args.prompts_file}: no such file")
    if args.data is not None and not (args.data / "held-out.jsonl.gz").is_file():
        raise SystemExit(f"--data {args.data}: not a `specdec distill-data` folder (no held-out.jsonl.gz)")
    if args.rollout_steps < 1:
        raise SystemExit(f"--rollout-steps must be at least 1, not {args.rollout_steps}")
    if args.data is not None and args.prompt_weight > 0:
        raise SystemExit("--prompt-weight: a data folder stores no argmax over prompts; train with --prompt-weight 0")
    if args.data is not None and args.prompts_file is not None:
        raise SystemExit("--data and --prompts-file: pick one")
    if not 0.0 <= args.held_out_share < 1.0:
        raise SystemExit(f"--held-out-share must lie in [0, 1), not {args.held_out_share}")
    # torch loads here only to ask for CUDA, and only when a GPU is asked for.
    if args.device != "cpu":
        from draft_service.distill.placement import DeviceUnavailable, require_device

        try:
            require_device(args.device)
        except DeviceUnavailable as e:
            raise SystemExit(f"specdec distill: {e}") from None
    work = args.work or args.cache_dir / "distill" / args.out.resolve().name
    return DistillConfig(
        target=args.target,
        out=args.out,
        work=work,
        cache_dir=args.cache_dir,
        command="specdec distill " + shlex.join(argv),
        kind=args.kind,
        minutes=args.minutes,
        tokens=args.tokens,
        seed=args.seed,
        resume=args.resume,
        threads=args.threads,
        device=args.device,
        dtype=args.dtype,
        # Bars redrawn into a log file are noise: only on a terminal.
        progress=sys.stderr.isatty() and not args.no_progress,
        rollout_steps=args.rollout_steps,
        prompts_file=args.prompts_file,
        data=args.data,
        held_out_share=args.held_out_share,
        held_out_cap=args.held_out_cap,
        prompts=args.prompts,
        held_out=args.held_out,
        prompt_offset=args.prompt_offset,
        batch_size=args.batch_size,
        max_new=args.max_new,
        eval_max_new=args.eval_max_new,
        temperatures=args.temperatures,
        collect_share=args.collect_share,
        layers=args.layers,
        init_from=args.init_from,
        head_size=args.head_size,
        side_layers=args.side_layers,
        init_draft=args.init_draft,
        lr=args.lr,
        epochs=args.epochs,
        batch_tokens=args.batch_tokens,
        max_len=args.max_len,
        soft_weight=args.soft_weight,
        prompt_weight=args.prompt_weight,
        extra_eval=tuple(args.extra_eval),
        collect_only=args.collect_only,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``specdec distill``; returns the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return _run(config_from_args(list(sys.argv[1:] if argv is None else argv)))


def _run(config: DistillConfig) -> int:
    """Runs one distillation; returns the exit status."""
    # torch and transformers load only once the flags parse
    from draft_service.distill.pipeline import DistillError, run

    try:
        card = run(config)
    except DistillError as e:
        print(f"specdec distill: {e}", file=sys.stderr)
        return 1
    if card is None:
        print(f"data collected in {config.work}; train with the same command plus --resume")
        return 0
    held = card["metrics"]["held_out"]
    print(
        f"draft written to {config.out}: top-1 agreement {held['top1_agreement']}, "
        f"mean accepted length at k={held['k']} {held['mean_accepted_length']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
