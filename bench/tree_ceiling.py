"""The most token trees could gain over chains here, with this draft (``specdec tree-ceiling``).

A tree pays where a verify row is cheap next to a pass and a draft's second guesses often pass. Both
are measured in process, then every chain and tree is priced with them (``coordinator.tree_choice.
round_options``):

- a(d, r), the acceptance by depth and sibling rank, from rounds that each verify a fixed wide tree
  through the real round loop (the target and its shipped feature draft in this process, greedy);
- the target's pass cost by rows for one session (``bench.pass_grid``), made non-decreasing
  (``monotone_fit``): on a shared machine the medians by row count jitter by several milliseconds,
  enough to make a lucky row count look cheaper than a smaller one;
- the draft's cost per tree level in those rounds;
- transformers ``generate``'s tokens/s on the same prompts, the bench's baseline, a prompt between
  two sweeps of the pass timings.

The ceiling prices each round at its verify pass alone: a draft that cost nothing and a stack with no
overhead. A real stack only loses speed from it, so a speed it leaves below a goal no tuning of the
stack reaches. ``at_measured_draft`` repeats it with the draft's measured cost per level. The ratio of
trees over chains, though, moves with the draft's cost (a wide, shallow tree drafts fewer levels than
the chain it replaces), so ``most_over_draft_costs`` scans draft costs from nothing to twice the
measured one for the largest ratio any of them leaves.

The priced rounds are the draft's. A served coordinator also answers some rounds from its own prompt
lookup (a fixed tree takes none): the same chain with trees on or off, so they only bring the ratio
of trees over chains closer to 1, though they can raise both speeds over ``generate``.

    specdec tree-ceiling --out reports/tree-ceiling.json   # or: make tree-ceiling
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from coordinator.tree_choice import RoundOption, TreeAcceptance, best_tree, round_options

# The fixed tree whose rounds measure a(d, r): wide and deep enough to reach every depth and rank
# the priced trees use.
MEASURED_NODES = 32
MEASURED_DEPTH = 8


@dataclass
class TreeRun:
    """What the fixed-tree rounds measured."""

    acceptance: TreeAcceptance
    tokens: int = 0
    rounds: int = 0
    committed_in_rounds: int = 0
    draft_ms: float = 0.0
    tree_levels: int = 0

    @property
    def level_ms(self) -> float:
        """Draft milliseconds per tree level (catch-up on the accepted tokens included)."""
        return self.draft_ms / self.tree_levels if self.tree_levels else 0.0

    def rate(self, depth: int, rank: int) -> float:
        """a(depth, rank), measured, smoothed where few children were judged (``TreeAcceptance.rate``)
        towards the rank-0 rate by depth."""
        return self.acceptance.rate(depth, rank, self.chain_rates())

    def chain_rates(self) -> list[float]:
        """The first child's measured acceptance at depths 1, 2, ... as far as any was judged."""
        rates = []
        for depth in range(1, MEASURED_DEPTH + 1):
            judged = self.acceptance.judged.get((depth, 0), 0)
            if not judged:
                break
            rates.append(self.acceptance.accepted.get((depth, 0), 0) / judged)
        return rates


def measure_tree_rounds(target, drafter, prompts, max_new_tokens: int, nodes: int, depth: int) -> TreeRun:
    """Greedy requests that verify a fixed tree of ``nodes`` nodes, ``depth`` deep, every round, through
    the round loop with ``target`` (a loaded model) and ``drafter`` (a feature or model draft) in process."""
    from opentelemetry import trace

    from coordinator.policy import SpeculationConfig, SpeculationPolicy
    from coordinator.rounds import RoundLoop
    from coordinator.routing import Router
    from coordinator.sessions import MemorySessionStore
    from coordinator.turns import GenerationRequest, Turns
    from draft_service.inprocess import InProcessDraft
    from target_service.engine import TargetEngine
    from target_service.inprocess import InProcessTarget

    router = Router([InProcessDraft(drafter)], [InProcessTarget(TargetEngine(target, 1))])
    router.draft_joined(drafter.facts)  # a feature draft: the target sends its hidden states
    policy = SpeculationPolicy(SpeculationConfig(tree_nodes=nodes), live_targets=lambda: 1)
    facts = target.facts("target")
    turns = Turns(target.tokenizer, facts, MemorySessionStore(3600))
    loop = RoundLoop(target.tokenizer, facts, router, policy, turns, trace.NoOpTracer())
    run = TreeRun(policy.trees)

    async def generate_all() -> None:
        for p in prompts:
            text, messages = (p.prompt, None) if isinstance(p.prompt, str) else (None, p.prompt)
            request = GenerationRequest(text, messages, max_new_tokens, k=depth, tree_nodes=nodes)
            last = None
            async for chunk in loop.generate(request, lambda: None):
                run.tokens += len(chunk.token_ids)
                last = chunk
            stats = last.stats
            run.rounds += stats.rounds
            run.committed_in_rounds += stats.committed_in_rounds
            run.draft_ms += stats.draft_ms
            run.tree_levels += stats.tree_depths

    asyncio.run(generate_all())
    return run


def passes_and_generate(target, plain, prompts, max_new_tokens: int, rows: int, repeats: int, compiled=None):
    """The packed ``target``'s pass cost over 1 .. ``rows`` rows for one session (medians of
    ``repeats`` sweeps, ``bench.pass_grid``), through its ``compiled`` pass when given, and
    transformers ``generate``'s greedy tokens/s on the ``plain`` model (the bench's hf-target), one
    prompt after each sweep: the two take turns, so the ratio of their speeds sees the same machine."""
    from bench.pass_grid import measure_pass_grid
    from bench.single import ModeResult, hf_runner
    from target_service.engine import TargetEngine

    result = ModeResult()
    run = hf_runner("hf-target", plain, None, max_new_tokens, 0.0, None)

    def generate(sweep: int) -> None:
        if sweep < len(prompts):
            run(sweep, prompts[sweep], result)

    ids = [p.token_ids(target.tokenizer) for p in prompts]
    sweeps = max(repeats, len(prompts) - 1)
    engine = TargetEngine(target, 1, compiled=compiled)
    pass_ms = measure_pass_grid(engine, ids, [1], rows - 1, sweeps, between=generate)[1]
    return pass_ms, result.tokens_per_s


def monotone_fit(ms: list[float]) -> list[float]:
    """The closest non-decreasing sequence to ``ms`` in least squares (pool adjacent violators): a
    pass over more rows never costs less, whatever one median says."""
    blocks: list[list[float]] = []  # [mean, count] of pooled runs
    for y in ms:
        blocks.append([y, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [mean for mean, count in blocks for _ in range(int(count))]


def _option(option: RoundOption, generate_per_ms: float) -> dict:
    shape = option.shape
    return {
        "nodes": option.nodes,
        "depth": shape.depth if shape else 0,
        "width": shape.width if shape else 0,
        "tokens_per_pass": round(option.tokens, 3),
        "round_ms": round(option.ms, 2),
        "tokens_per_s": round(option.per_ms * 1000, 2),
        "vs_generate": round(option.per_ms / generate_per_ms, 3),
    }


def ceiling(run: TreeRun, pass_ms: list[float], level_ms: float, generate_tps: float, goal_tokens: float) -> dict:
    """The best chain (target-only included), the best tree, and the cheapest tree expecting
    ``goal_tokens`` per pass, priced with ``level_ms`` per draft level."""
    chains, trees = round_options(run.rate, pass_ms, level_ms, MEASURED_DEPTH)
    chain = max(chains, key=lambda o: o.per_ms)
    tree = max(trees, key=lambda o: o.per_ms)
    generate_per_ms = generate_tps / 1000
    reaching = [o for o in chains + trees if o.tokens >= goal_tokens]
    out = {
        "draft_ms_per_level": round(level_ms, 2),
        "best_chain": _option(chain, generate_per_ms),
        "best_tree": _option(tree, generate_per_ms),
        "tree_vs_chain": round(tree.per_ms / chain.per_ms, 3),
    }
    if reaching:
        fastest = max(reaching, key=lambda o: o.per_ms)
        out["reaching_goal"] = {
            **_option(fastest, generate_per_ms),
            "vs_chain": round(fastest.per_ms / chain.per_ms, 3),
        }
    return out


def most_over_draft_costs(run: TreeRun, pass_ms: list[float], step_ms: float = 0.25) -> dict:
    """The largest ratio of the best tree over the best chain for draft costs per level from 0 to twice
    the measured one, and the cost that gives it."""
    top = max(2 * run.level_ms, step_ms)
    best = (0.0, 0.0)
    for i in range(int(top / step_ms) + 1):
        chains, trees = round_options(run.rate, pass_ms, i * step_ms, MEASURED_DEPTH)
        ratio = max(o.per_ms for o in trees) / max(o.per_ms for o in chains)
        best = max(best, (ratio, i * step_ms))
    return {"tree_vs_chain": round(best[0], 3), "draft_ms_per_level": round(best[1], 2)}


def report(run: TreeRun, measured_ms: list[float], generate_tps: float, goal_tokens: float, config: dict) -> dict:
    """The whole report: what was measured, and the ceilings with a free and with the measured draft."""
    pass_ms = monotone_fit(measured_ms)
    acceptance = {
        f"{d},{r}": [run.acceptance.judged[(d, r)], run.acceptance.accepted.get((d, r), 0)]
        for d, r in sorted(run.acceptance.judged)
    }
    return {
        "config": {
            **config,
            "measured_tree": {"nodes": MEASURED_NODES, "depth": MEASURED_DEPTH},
            "goal_tokens": goal_tokens,
        },
        "measured": {
            "pass_ms_by_rows": [round(ms, 2) for ms in measured_ms],
            "pass_ms_priced": [round(ms, 2) for ms in pass_ms],
            "acceptance_judged_accepted": acceptance,
            "tree_rounds": run.rounds,
            "tokens_per_round": round(run.committed_in_rounds / run.rounds, 3) if run.rounds else 0.0,
            # What the priced model expects of the measured tree: how far a(d, r) alone explains it.
            "model_tokens_per_round": round(best_tree(run.rate, MEASURED_NODES, MEASURED_DEPTH)[-1][0], 3),
            "draft_ms_per_level": round(run.level_ms, 2),
            "generate_tokens_per_s": round(generate_tps, 2),
        },
        "free_draft": ceiling(run, pass_ms, 0.0, generate_tps, goal_tokens),
        "at_measured_draft": ceiling(run, pass_ms, run.level_ms, generate_tps, goal_tokens),
        "most_over_draft_costs": most_over_draft_costs(run, pass_ms),
    }
