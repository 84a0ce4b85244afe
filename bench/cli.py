"""``specdec bench``, ``pass-grid`` and ``tree-ceiling``: their flags, and the runs that fill their reports.

Registered with the ``specdec`` command through the ``specdec.commands`` entry point group. The
parts each run is made of live beside it: ``bench.single`` (one stream, ``specdec bench``),
``bench.load`` (concurrent sessions, ``specdec bench --concurrency``), ``bench.pass_grid``
(``specdec pass-grid``) and ``bench.tree_ceiling`` (``specdec tree-ceiling``). Each run writes a
JSON report (``--out``), and ``--plot`` a PNG.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench.single import PROMPTS
from specdec.cli import add_cache_dir, add_stack, draft_model_arg, env, extra_installed, k_arg, stack_config
from specdec.config import DRAFT_KINDS, MAX_TREE_NODES, MODEL_DTYPES, default_draft_model


def levels_arg(value: str) -> list[int]:
    """A comma-separated list of concurrency levels, such as 1,2,4,8,16."""
    levels = [int(v) for v in value.split(",") if v]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("--concurrency takes positive integers, for example 1,2,4,8,16")
    return levels


def shown_path(path: Path) -> str:
    """``path`` as a report records it: relative to the working directory when inside it, so reports
    made from a checkout do not name the machine's folders."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def trees_arg(value: str) -> list[tuple[int, int]]:
    """``--trees``: NODESxDEPTH shapes, comma-separated (``5x3,15x6``), each a tree a round may verify."""
    shapes = []
    for part in value.split(","):
        try:
            nodes, depth = (int(n) for n in part.split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not NODESxDEPTH, such as 5x3") from None
        if not 1 <= depth <= nodes <= MAX_TREE_NODES:
            raise argparse.ArgumentTypeError(f"{part!r}: need 1 <= depth <= nodes <= {MAX_TREE_NODES}")
        shapes.append((nodes, depth))
    return shapes


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``bench``, ``pass-grid`` and ``tree-ceiling`` (with the server extra installed)."""
    if not extra_installed("server"):
        return
    p = subparsers.add_parser(
        "bench", help="tokens/s of transformers generate and of the specdec stack's modes, side by side"
    )
    p.add_argument("--prompts", type=Path, default=PROMPTS, help="JSONL prompt file")
    p.add_argument("--n", type=int, help="use the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--unseeded",
        action="store_true",
        help="send sampled requests without a seed, as most API clients do: fresh draws each round rather "
        "than coupled sampling's seeded noise (default: each prompt seeded by its index)",
    )
    p.add_argument("--k", type=k_arg, default=None, help="draft length of the specdec mode: N or auto (default)")
    p.add_argument(
        "--trees",
        type=trees_arg,
        default=None,
        help="the fixed trees of the specdec-tree mode, NODESxDEPTH comma-separated (default: 5x3,15x6)",
    )
    p.add_argument(
        "--modes",
        help="comma-separated modes (default: hf-target,hf-assisted,specdec-k0,specdec-chain,specdec,"
        "specdec-tree,specdec-http; with --concurrency: hf-batched,specdec-k0,specdec-chain,specdec)",
    )
    p.add_argument(
        "--concurrency",
        type=levels_arg,
        help="closed-loop load levels, for example 1,2,4,8,16: throughput and latency per level",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="with --concurrency: runs of each specdec mode per level, in A B B A order, summed",
    )
    p.add_argument(
        "--response-format",
        type=Path,
        help="a JSON file holding an OpenAI response_format object: the specdec modes generate under it "
        "(structured output; transformers modes have no grammar and are refused)",
    )
    p.add_argument("--address", help="use a running coordinator instead of starting a local stack")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the in-process HF modes")
    add_out(p, "bench")
    p.add_argument("--plot", type=Path, help="write a PNG of the report")
    add_stack(p)
    # Steady figures: the stack's target builds its compiled pass before the first request is timed.
    p.set_defaults(run=run_bench, compile=env("COMPILE", "wait"))

    p = subparsers.add_parser(
        "pass-grid",
        help="the target's pass cost by sessions and draft length, in process, "
        "and the most speculation could gain from it",
    )
    add_target(p)
    p.add_argument("--prompts", type=Path, default=PROMPTS, help="JSONL prompt file")
    p.add_argument("--levels", type=levels_arg, default=[1, 2, 4, 8, 16], help="sessions per pass, e.g. 1,2,4")
    p.add_argument("--k-max", type=int, default=4)
    p.add_argument(
        "--accept", type=float, default=0.48, help="the draft's conditional acceptance per position, for the ceiling"
    )
    p.add_argument("--repeats", type=int, default=3, help="timed passes per cell (median)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the target")
    add_out(p, "pass-grid")
    p.set_defaults(run=run_pass_grid)

    p = subparsers.add_parser(
        "pass-curve",
        help="the target's pass cost by rows in float32 and bfloat16, side by side in process, "
        "and whether each pass kept a row's bits",
    )
    add_target(p)
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated dtypes to compare")
    p.add_argument(
        "--compiled",
        action="store_true",
        help="also time each dtype's compiled pass (specdec.compiled), built first: minutes cold",
    )
    p.add_argument(
        "--python-wrapper",
        action="store_true",
        help="with --compiled, also time each compiled pass with inductor's Python wrapper (the served pass's is C++)",
    )
    p.add_argument("--context", type=int, default=200, help="tokens in the session's cache")
    p.add_argument("--repeats", type=int, default=9, help="timed sweeps (median)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the target")
    add_out(p, "pass-curve")
    p.set_defaults(run=run_pass_curve)

    p = subparsers.add_parser(
        "tree-ceiling",
        help="the most token trees could gain over chains with the shipped draft on this machine, in process",
    )
    add_cache_dir(p)
    p.add_argument("--prompts", type=Path, default=PROMPTS, help="JSONL prompt file")
    p.add_argument("--n", type=int, default=12, help="use the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--goal-tokens", type=float, default=2.3, help="tokens per pass the report looks for")
    p.add_argument("--repeats", type=int, default=15, help="timed passes per row count (median; at least one a prompt)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument(
        "--dtype", choices=MODEL_DTYPES, default="auto", help="what the target computes in (as serve-target --dtype)"
    )
    p.add_argument(
        "--compiled",
        action="store_true",
        help="time the target's compiled pass (specdec.compiled), as the target service serves: minutes cold",
    )
    add_out(p, "tree-ceiling")
    p.set_defaults(run=run_tree_ceiling)


def add_target(p: argparse.ArgumentParser) -> None:
    """``--cache-dir`` and ``--target-model`` of the in-process measurements."""
    add_cache_dir(p)
    p.add_argument(
        "--target-model", default=env("TARGET_MODEL", "default"), help="target model (env SPECDEC_TARGET_MODEL)"
    )


def add_out(p: argparse.ArgumentParser, name: str) -> None:
    """``--out``: where the JSON report goes; by default a new file named by ``name`` and the time, so
    a run never overwrites a report (the committed ones under reports/ are written by the Makefile)."""
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"JSON report path (default: ./specdec-{name}-<date>-<time>.json, a new file)",
    )


def report_path(out: Path | None, name: str) -> Path:
    """``--out`` as given, else a new file in the working directory named by ``name`` and the time."""
    return out if out is not None else Path(f"specdec-{name}-{time.strftime('%Y%m%d-%H%M%S')}.json")


def _write(report: dict, out: Path | None, name: str = "bench") -> None:
    out = report_path(out, name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}", file=sys.stderr)


def reference_model(args: argparse.Namespace):
    """The target in transformers on the target service's dtype and kernels, rendering chat with the
    coordinator's template: its greedy answers are the exact reference."""
    from specdec.chat_templates import resolve_chat_template
    from specdec.models import load_model

    loaded = load_model(args.target_model, args.cache_dir, dtype=args.dtype or "auto", pack=True)
    if args.chat_template is not None:
        loaded.tokenizer.chat_template = resolve_chat_template(args.chat_template)
    return loaded


def run_bench(args: argparse.Namespace) -> None:
    """``specdec bench``: the modes side by side on one stream, or, with ``--concurrency``, under load."""
    import torch

    from bench.single import (
        FIXED_TREES,
        MODES,
        TREE_MODE,
        hf_runner,
        http_runner,
        load_prompts,
        plot,
        run_interleaved,
        specdec_runner,
        stack_variant,
        summarize,
        tree_mode,
    )
    from specdec.client import Client
    from specdec.models import load_model
    from specdec.stack import LocalStack
    from specdec.vocab import resolve_model_path

    if args.concurrency:
        run_load(args)
        return
    modes = [m for m in (args.modes or ",".join(MODES)).split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    # specdec-tree stands for one mode per fixed tree.
    trees = [tree_mode(nodes, depth) for nodes, depth in (args.trees or FIXED_TREES)]
    modes = [expanded for m in modes for expanded in (trees if m == TREE_MODE else [m])]
    k = args.k
    prompts = load_prompts(args.prompts, args.n)
    torch.set_num_threads(args.threads)
    loaded = reference_model(args)
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

        path = resolve_model_path(draft_model_arg(args, "model"), args.cache_dir)
        if not (path / CARD_FILE).is_file():
            draft = load_model(str(path), args.cache_dir).model
    if args.address is not None and len(kinds) > 1:
        raise SystemExit("--address reaches one running stack: give one --draft-kind with it")
    response_format = json.loads(args.response_format.read_text()) if args.response_format else None
    if response_format is not None and any(not m.startswith("specdec") or m == "specdec-http" for m in modes):
        raise SystemExit("--response-format runs the specdec gRPC modes only (--modes specdec-k0,specdec,...)")
    if "specdec-http" in modes and (args.address is not None or k is not None):
        raise SystemExit("specdec-http runs on a local stack, with the coordinator's k (--default-k, not --k)")
    runners = {
        mode: hf_runner(mode, loaded, draft, args.max_new_tokens, args.temperature, k)
        for mode in modes
        if mode.startswith("hf")
    }
    spec_modes = [m for m in modes if m.startswith("specdec")]
    stacks, clients = [], []
    ready_s: dict[str, float] = {}  # each local stack's start, until every service is ready
    try:
        # Every stack is up before the first prompt, so the modes can take turns prompt by prompt.
        for i, kind in enumerate(kinds if spec_modes else []):
            address = args.address
            if address is None:
                config = replace(stack_config(args, 0, kind), prefix_reuse=0)  # the modes repeat each prompt
                if i == 0 and "specdec-http" in modes:
                    config = replace(config, http_port=0)
                started = time.perf_counter()
                stacks.append(LocalStack(config).start())
                ready_s[kind] = round(time.perf_counter() - started, 1)
                address = stacks[-1].address
            clients.append(Client(address, timeout=600))
            # The fixed variants (specdec-k0, specdec-chain, specdec-tree:NxD) run on the first stack only.
            for mode in (m for m in spec_modes if m == "specdec" or (stack_variant(m) is not None and i == 0)):
                name = mode if mode != "specdec" or len(kinds) == 1 else f"specdec:{kind}"
                runners[name] = specdec_runner(
                    name, clients[-1], args.max_new_tokens, args.temperature, k, response_format, not args.unseeded
                )
            if i == 0 and "specdec-http" in modes:
                runners["specdec-http"] = http_runner(
                    stacks[0].http_address, args.max_new_tokens, args.temperature, not args.unseeded
                )
        results = run_interleaved(runners, prompts)
    finally:
        for client in clients:
            client.close()
        for stack in stacks:
            stack.close()
    report = {
        "config": {
            "prompts": shown_path(args.prompts),
            "n": len(prompts),
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "seeded": not args.unseeded,
            "k": "auto" if k is None else k,
            "draft_kinds": kinds,
            "hf_assisted": "assistant_model" if draft is not None else "prompt_lookup_num_tokens",
            "target_model": args.target_model,
            "response_format": response_format,
            "dtype": args.dtype or "auto",
            "chat_template": args.chat_template,
            "target_threads": args.target_threads,
            "draft_threads": args.draft_threads,
        },
        "stack_ready_s": ready_s,
        "modes": summarize(results, greedy=args.temperature == 0),
    }
    _write(report, args.out)
    print(json.dumps(report, indent=2))
    if args.plot:
        plot(report["modes"], args.plot)


def run_load(args: argparse.Namespace) -> None:
    """``specdec bench --concurrency``: throughput and latency at each level of concurrent sessions."""
    import torch

    from bench.load import LOAD_MODES, level_prompts, plot_load, run_hf_batched_level, run_specdec_level, summarize_load
    from bench.single import load_prompts
    from specdec.stack import LocalStack

    modes = [m for m in (args.modes or ",".join(LOAD_MODES)).split(",") if m]
    if set(modes) - set(LOAD_MODES):
        raise SystemExit(f"with --concurrency the modes are {LOAD_MODES}")
    if args.temperature != 0:
        raise SystemExit("--concurrency runs greedy (its exactness check compares with target-only output)")
    if args.repeats < 1:
        raise SystemExit("--repeats: at least 1")
    every = load_prompts(args.prompts, None)
    n = min(args.n or len(every), len(every))
    prompts = {level: level_prompts(every, n, level) for level in args.concurrency}
    torch.set_num_threads(args.threads)
    loaded = reference_model(args)
    results: dict = {}
    # Target-only reference: HF generate one prompt at a time (hf-batched at level 1 is exactly that),
    # then the prompts only the levels rounded up reach, for their exactness check.
    reference_level = run_hf_batched_level(loaded, every[:n], 1, args.max_new_tokens)
    longest = max(len(p) for p in prompts.values())
    reference = dict(reference_level.outputs)
    if longest > n:
        reference.update(run_hf_batched_level(loaded, every[n:longest], 1, args.max_new_tokens).outputs)
    if "hf-batched" in modes:
        results["hf-batched"] = {1: reference_level} if 1 in args.concurrency else {}
        for level in args.concurrency:
            if level != 1:
                results["hf-batched"][level] = run_hf_batched_level(loaded, prompts[level], level, args.max_new_tokens)
    del loaded  # the stack needs the cores and the memory now
    spec_modes = [m for m in modes if m.startswith("specdec")]
    if spec_modes:
        stack = None
        address = args.address
        if address is None:
            config = stack_config(args, 0, args.draft_kind.split(",")[0])
            stack = LocalStack(replace(config, prefix_reuse=0)).start()  # the modes and levels repeat each prompt
            address = stack.address
        try:
            for level in args.concurrency:
                # The modes take turns at each level, in mirrored order on every second repeat (A B B A):
                # a shared machine's speed drifts by tens of percent over minutes, and a drift that is
                # steady across the level then falls on both modes alike.
                for repeat in range(args.repeats):
                    for mode in spec_modes if repeat % 2 == 0 else spec_modes[::-1]:
                        run = run_specdec_level(mode, address, prompts[level], level, args.max_new_tokens, args.k)
                        if repeat == 0:
                            results.setdefault(mode, {})[level] = run
                        else:
                            results[mode][level].absorb(run)
        finally:
            if stack is not None:
                stack.close()
    report = {
        "config": {
            "prompts": shown_path(args.prompts),
            "n": n,
            "max_new_tokens": args.max_new_tokens,
            "requests_per_level": {str(level): len(p) for level, p in prompts.items()},
            "concurrency": args.concurrency,
            "k": "auto" if args.k is None else args.k,
            "draft_kind": args.draft_kind.split(",")[0],
            "target_threads": args.target_threads,
            "draft_threads": args.draft_threads,
            "hf_threads": args.threads,
            "repeats": args.repeats,
        },
        **summarize_load(results, reference),
    }
    _write(report, args.out, "bench-load")
    print(json.dumps(report, indent=2))
    if args.plot:
        plot_load(report, args.plot)


def run_pass_grid(args: argparse.Namespace) -> None:
    """``specdec pass-grid``: the target's pass cost by sessions and draft length, and its ceiling."""
    import torch

    from bench.pass_grid import measure_pass_grid
    from bench.single import load_prompts
    from coordinator.adaptive import speculation_ceiling
    from specdec.models import load_model
    from specdec.packed_linear import pack_linears
    from target_service.engine import TargetEngine

    torch.set_num_threads(args.threads)
    loaded = load_model(args.target_model, args.cache_dir)
    pack_linears(loaded.model)  # as the target service runs it
    prompts = [p.token_ids(loaded.tokenizer) for p in load_prompts(args.prompts, None)]
    grid = measure_pass_grid(TargetEngine(loaded, max(args.levels)), prompts, args.levels, args.k_max, args.repeats)
    ceiling = speculation_ceiling(grid, args.accept)
    for sessions, row in grid.items():
        gain, k = ceiling[sessions]
        relative = " ".join(f"k{k}={ms / row[0]:.2f}x" for k, ms in enumerate(row))
        print(f"C={sessions:<3} pass {row[0]:6.1f} ms  {relative}  ceiling {gain:.2f}x at k={k}")
    report = {
        "config": {
            "target_model": args.target_model,
            "prompts": shown_path(args.prompts),
            "threads": args.threads,
            "repeats": args.repeats,
            "accept": args.accept,
        },
        "pass_ms": {str(c): [round(ms, 1) for ms in row] for c, row in grid.items()},
        "ceiling": {str(c): {"gain": round(g, 3), "k": k} for c, (g, k) in ceiling.items()},
    }
    _write(report, args.out, "pass-grid")


def run_pass_curve(args: argparse.Namespace) -> None:
    """``specdec pass-curve``: one pass's cost by rows per dtype (``bench.pass_curve``)."""
    import torch

    from bench.pass_curve import measure_pass_curve, pass_products
    from bench.single import load_prompts
    from specdec.compiled import build_compiled
    from specdec.models import load_model
    from specdec.packed_linear import pack_linears
    from target_service.engine import TargetEngine

    torch.set_num_threads(args.threads)
    engines = {}
    compile_s = {}
    products = {}  # the compiled engines' weight products, timed alone beside their passes
    for dtype in args.dtypes.split(","):
        loaded = load_model(args.target_model, args.cache_dir, dtype=dtype)
        pack_linears(loaded.model)  # as the target service runs it
        engines[dtype] = TargetEngine(loaded, 16)
        if args.compiled:
            runner = build_compiled(loaded.model, args.cache_dir)
            compile_s[f"{dtype}-compiled"] = round(runner.compile_s or 0.0, 1)
            engines[f"{dtype}-compiled"] = TargetEngine(loaded, 16, compiled=runner)
            products[f"{dtype}-compiled"] = pass_products(loaded.model, runner.products)
        if args.compiled and args.python_wrapper:
            runner = build_compiled(loaded.model, args.cache_dir, cpp_wrapper=False)
            engines[f"{dtype}-compiled-python-wrapper"] = TargetEngine(loaded, 16, compiled=runner)
    # The bench prompts' tokens one after another, cut to the context: real text, a fixed length.
    prompt = [t for p in load_prompts(PROMPTS, None) for t in p.token_ids(loaded.tokenizer)][: args.context]
    curves = measure_pass_curve(engines, prompt, args.repeats, products)
    names = [name for name in curves if not name.endswith("-python-wrapper")]  # the engines as served
    for name, curve in curves.items():
        ms = curve["pass_ms"]
        print(f"{name:>9}: " + "  ".join(f"{rows}:{value:.1f}" for rows, value in ms.items()))  # type: ignore[union-attr]
    report = {
        "config": {
            "target_model": args.target_model,
            "context": len(prompt),
            "threads": args.threads,
            "repeats": args.repeats,
        },
        "engines": curves,
    }
    if compile_s:
        report["compile_s"] = compile_s
    pairs = [(names[0], names[-1])] if len(names) > 1 else []
    pairs += [(name.removesuffix("-compiled"), name) for name in compile_s]
    pairs += [(name, name.removesuffix("-python-wrapper")) for name in curves if name.endswith("-python-wrapper")]
    ratios = {}
    for slow, fast in dict.fromkeys(pairs):
        for rows in ("1", "8"):
            ms_slow, ms_fast = curves[slow]["pass_ms"][rows], curves[fast]["pass_ms"][rows]  # type: ignore[index]
            ratios[f"{slow}_over_{fast}_{rows}row{'s' if rows != '1' else ''}"] = round(ms_slow / ms_fast, 3)
    if ratios:
        report["ratios"] = ratios
    _write(report, args.out, "pass-curve")


def run_tree_ceiling(args: argparse.Namespace) -> None:
    """``specdec tree-ceiling``: acceptance by depth and rank, pass costs by rows, and the ceilings
    they imply for chains and trees (``bench.tree_ceiling``), for the default target and its draft."""
    import torch

    from bench.single import load_prompts
    from bench.tree_ceiling import MEASURED_DEPTH, MEASURED_NODES, measure_tree_rounds, passes_and_generate, report
    from draft_service.server import build_drafter
    from specdec.compiled import build_compiled
    from specdec.config import DraftConfig, ModelConfig
    from specdec.models import load_model
    from specdec.packed_linear import pack_linears

    torch.set_num_threads(args.threads)
    prompts = load_prompts(args.prompts, args.n)
    plain = load_model("default", args.cache_dir)  # transformers generate's, as the bench's hf-target
    target = load_model("default", args.cache_dir, dtype=args.dtype)
    pack_linears(target.model)  # as the target service runs it
    compiled = build_compiled(target.model, args.cache_dir) if args.compiled else None
    pass_ms, generate_tps = passes_and_generate(
        target, plain, prompts, args.max_new_tokens, MEASURED_NODES + 1, args.repeats, compiled
    )
    draft = DraftConfig(
        kind="feature", model=ModelConfig(model=str(default_draft_model("feature")), cache_dir=args.cache_dir)
    )
    run = measure_tree_rounds(
        target, build_drafter(draft), prompts, args.max_new_tokens, MEASURED_NODES, MEASURED_DEPTH
    )
    config = {"prompts": shown_path(args.prompts), "n": len(prompts), "max_new_tokens": args.max_new_tokens}
    config |= {"threads": args.threads, "repeats": args.repeats, "dtype": str(target.dtype).removeprefix("torch.")}
    config |= {"compiled": compiled is not None}
    out = report(run, pass_ms, generate_tps, args.goal_tokens, config)
    for name in ("free_draft", "at_measured_draft"):
        c = out[name]
        print(
            f"{name:18s} chain {c['best_chain']['tokens_per_s']:6.2f} tok/s  tree {c['best_tree']['tokens_per_s']:6.2f}"
            f"  tree/chain {c['tree_vs_chain']:.3f}x  tree/generate {c['best_tree']['vs_generate']:.3f}x"
        )
    most = out["most_over_draft_costs"]
    print(f"most tree/chain over draft costs: {most['tree_vs_chain']:.3f}x at {most['draft_ms_per_level']} ms/level")
    _write(out, args.out, "tree-ceiling")
