"""Token trees at the target: the tree pass, acceptance walks, cache compaction and bad trees."""

from __future__ import annotations

import pytest
import torch
from tiny import EOS_ID as EOS

from specdec.kvcache import SessionCache
from specdec.sampling import Sampling
from specdec.tree_verify import tree_mask, verify_tree_greedy
from specdec.trees import (
    TreeShape,
    chain_parents,
    check_parents,
    children,
    depths,
    path_to,
    ranks,
)
from target_service.engine import TargetEngine, VerifyCall

PROMPT = [3, 7, 2, 9, 4, 4, 11]
# root -> 5 -> (6 -> 8, 12), root -> 10 -> 13; listed parents first.
TOKENS = [5, 10, 6, 12, 13, 8]
PARENTS = [-1, -1, 0, 0, 1, 2]


def _fresh_logits(model, tokens: list[int]) -> torch.Tensor:
    """The target's logits ``[len, V]`` over ``tokens`` from scratch, no cache."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0].float()


def test_tree_helpers_describe_the_tree():
    assert depths(PARENTS) == [1, 1, 2, 2, 2, 3]
    assert ranks(PARENTS) == [0, 1, 0, 1, 0, 0]
    assert children(PARENTS) == {-1: [0, 1], 0: [2, 3], 1: [4], 2: [5]}
    assert path_to(PARENTS, 5) == [0, 2, 5]
    mask = tree_mask(PARENTS, lead=2)
    # Node 5 (row 7) sees both chain rows, its ancestors 0 and 2, and itself; not its uncle 1.
    assert mask[7].tolist() == [True, True, True, False, True, False, False, True]
    assert mask[0].tolist() == [True] + [False] * 7  # chain rows stay causal and never see nodes
    check_parents(chain_parents(4))


@pytest.mark.parametrize(
    "parents, message",
    [([0], "earlier node"), ([-1, 2, 0], "earlier node"), ([-1, -2], "earlier node"), ([-1] * 33, "at most")],
)
def test_bad_trees_are_refused(parents, message):
    with pytest.raises(ValueError, match=message):
        check_parents(parents)


def test_every_tree_row_scores_its_own_path(tiny_target):
    """Row i + 1 of a tree pass equals the logits after the path root -> node i, fed alone."""
    engine = TargetEngine(tiny_target, 4)
    cache_id, committed, _ = engine.prefill(PROMPT)
    cache = engine.caches.get(cache_id)
    from specdec.ragged import RaggedItem, ragged_forward

    fed = cache.pending() + TOKENS
    logits, _ = ragged_forward(tiny_target.model, [RaggedItem(cache.kv, fed, len(TOKENS) + 1, (), tuple(PARENTS))])
    model = tiny_target.model
    root = _fresh_logits(model, PROMPT)[-1]
    torch.testing.assert_close(logits[0][0], root, atol=1e-4, rtol=1e-4)
    for node in range(len(TOKENS)):
        path = [TOKENS[i] for i in path_to(PARENTS, node)]
        expected = _fresh_logits(model, PROMPT + path)[-1]
        torch.testing.assert_close(logits[0][node + 1], expected, atol=1e-4, rtol=1e-4)


def _argmax_path(model, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(_fresh_logits(model, tokens)[-1].argmax()))
    return tokens[len(prompt) :]


def test_greedy_tree_accepts_a_sibling_and_compacts_the_cache(tiny_target):
    """A tree whose first child is wrong but whose second starts the target's greedy path: the verdict
    takes the sibling's branch, and the cache then holds exactly the committed path (its next rounds
    score as a fresh cache would)."""
    model = tiny_target.model
    greedy = _argmax_path(model, PROMPT, 4)
    wrong = (greedy[0] + 1) % tiny_target.vocab_size
    tokens = [wrong, greedy[0], greedy[1], (greedy[1] + 3) % tiny_target.vocab_size, greedy[2]]
    parents = [-1, -1, 1, 1, 2]
    engine = TargetEngine(tiny_target, 4)
    cache_id, committed, _ = engine.prefill(PROMPT)
    call = VerifyCall(cache_id, committed, [], tokens, [], Sampling(), 0, draft_parents=tuple(parents))
    outcome = engine.verify_batch([call])[0]
    assert not isinstance(outcome, Exception)
    assert outcome.path == [1, 2, 4]
    assert outcome.tokens == greedy[:4]
    cache = engine.caches.get(cache_id)
    assert cache.kv_tokens == PROMPT + greedy[:3]
    assert cache.kv.get_seq_length() == len(cache.kv_tokens)
    # The next round (a chain) on the compacted cache scores what a fresh cache over the same tokens does.
    nxt = engine.verify(cache_id, outcome.committed, [], [], [], Sampling(), 1)
    assert nxt.tokens == _argmax_path(model, PROMPT + greedy[:4], 1)


def test_tree_hidden_rows_are_the_committed_positions(tiny_target):
    """With hidden states asked, a tree round returns the rows of the committed positions only, equal
    to those of a chain round that committed the same tokens."""
    model = tiny_target.model
    greedy = _argmax_path(model, PROMPT, 3)
    wrong = (greedy[0] + 5) % tiny_target.vocab_size
    tree_engine, chain_engine = TargetEngine(tiny_target, 4), TargetEngine(tiny_target, 4)
    tree_id, committed, _ = tree_engine.prefill(PROMPT)
    chain_id, _, _ = chain_engine.prefill(PROMPT)
    tree = VerifyCall(
        tree_id, committed, [], [wrong, greedy[0], greedy[1]], [], Sampling(), 0, True, draft_parents=(-1, -1, 1)
    )
    chain = VerifyCall(chain_id, committed, [], greedy[:2], [], Sampling(), 0, True)
    got, want = tree_engine.verify_batch([tree])[0], chain_engine.verify_batch([chain])[0]
    assert got.tokens == want.tokens and got.committed == want.committed
    assert got.hidden.start == want.hidden.start
    torch.testing.assert_close(got.hidden.rows, want.hidden.rows, atol=1e-5, rtol=1e-5)


def test_trees_and_chains_share_a_pass(tiny_target):
    """A batch mixing a tree round and chain rounds gives each the outcome it gets alone."""
    model = tiny_target.model
    prompts = [PROMPT, [1 + t % 20 for t in PROMPT[::-1]], [5, 6, 7, 8]]
    calls_alone, calls_batch = [], []
    batched, alone = TargetEngine(tiny_target, 8), TargetEngine(tiny_target, 8)
    for i, prompt in enumerate(prompts):
        greedy = _argmax_path(model, prompt, 2)
        tokens = [greedy[0], (greedy[0] + 1) % 32, greedy[1]] if i != 1 else greedy[:2]
        parents = (-1, -1, 0) if i != 1 else ()
        for engine, calls in ((batched, calls_batch), (alone, calls_alone)):
            cid, n, _ = engine.prefill(prompt)
            calls.append(VerifyCall(cid, n, [], tokens, [], Sampling(), 0, draft_parents=parents))
    together = batched.verify_batch(calls_batch)
    for call, got in zip(calls_alone, together):
        want = alone.verify_batch([call])[0]
        assert got.tokens == want.tokens and got.path == want.path


@pytest.mark.parametrize(
    "tokens, parents, message",
    [
        ([4, 5], (-1, 1), "earlier node"),
        ([4, 5], (0, -1), "earlier node"),
        ([4, 5, 6], (-1, 0), "one parent per draft token"),
        ([4] * 40, tuple(range(-1, 39)), "at most 32"),
    ],
)
def test_engine_refuses_bad_trees_and_keeps_serving(tiny_target, tokens, parents, message):
    engine = TargetEngine(tiny_target, 4)
    cache_id, committed, _ = engine.prefill(PROMPT)
    bad = VerifyCall(cache_id, committed, [], tokens, [], Sampling(), 0, draft_parents=parents)
    outcome = engine.verify_batch([bad])[0]
    assert isinstance(outcome, ValueError) and message in str(outcome)
    assert engine.verify(cache_id, committed, [], [], [], Sampling(), 0).committed == committed + 1


def test_a_tree_deeper_than_the_context_is_refused(tiny_target):
    engine = TargetEngine(tiny_target, 4)
    context = tiny_target.max_context
    prompt = [2] * (context - 3)
    cache_id, committed, _ = engine.prefill(prompt)
    deep = VerifyCall(cache_id, committed, [], [4, 5, 6, 7], [], Sampling(), 0, draft_parents=(-1, -1, 1, 2))
    outcome = engine.verify_batch([deep])[0]
    assert isinstance(outcome, ValueError) and "context" in str(outcome)
    # Its depth (3), not its node count (4), is what must fit: one level shallower passes.
    ok = VerifyCall(cache_id, committed, [], [4, 5, 6], [], Sampling(), 0, draft_parents=(-1, -1, 1))
    assert not isinstance(engine.verify_batch([ok])[0], Exception)


def test_walk_on_hand_made_logits():
    vocab = 16
    logits = torch.full((len(TOKENS) + 1, vocab), -5.0)
    # Root prefers 10 (node 1), node 1 prefers 13 (node 4), node 4 prefers 3 (not drafted).
    logits[0, 10] = logits[2, 13] = logits[5, 3] = 5.0
    verdict = verify_tree_greedy(logits, TOKENS, PARENTS)
    assert verdict.path == [1, 4] and verdict.tokens == [10, 13, 3]


def test_session_cache_keep_path_compacts_every_layer(tiny_target):
    cache = SessionCache(committed=list(PROMPT))
    cache.prefill(tiny_target.model)
    start = len(cache.kv_tokens)
    cache.forward(tiny_target.model, TOKENS, 1)
    full = [layer.keys.clone() for layer in cache.kv.layers]
    cache.keep_path(start, 1, [1, 4], [TOKENS[1], TOKENS[4]])
    assert cache.kv_tokens == PROMPT + [10, 13]
    for layer, before in zip(cache.kv.layers, full):
        assert layer.get_seq_length() == start + 3
        torch.testing.assert_close(layer.keys[:, :, : start + 1], before[:, :, : start + 1])
        torch.testing.assert_close(layer.keys[:, :, start + 1], before[:, :, start + 2])  # node 1
        torch.testing.assert_close(layer.keys[:, :, start + 2], before[:, :, start + 5])  # node 4


# --- sampled trees: the committed tokens follow the target over several positions -----------------

VOCAB = 5


def _target_p(prefix: tuple[int, ...]) -> torch.Tensor:
    """A target distribution ``[V]`` that depends on the whole path so far (fixed, sharp-ish)."""
    g = torch.Generator().manual_seed(1000 + hash(prefix) % 10_000)
    return torch.softmax(torch.randn(VOCAB, generator=g, dtype=torch.float64) * 1.5, -1)


def _draft_q(prefix: tuple[int, ...]) -> torch.Tensor:
    """A draft distribution that differs from the target's."""
    g = torch.Generator().manual_seed(5000 + hash(prefix) % 10_000)
    return torch.softmax(torch.randn(VOCAB, generator=g, dtype=torch.float64) * 1.5, -1)


def _sampled_tree(g: torch.Generator, width: int, depth: int, replace_rule: bool):
    """A fixed-shape tree (each depth: ``width`` siblings drawn without replacement, the first one
    expanded), its per-node q (exact, or the plain q when ``replace_rule`` is the wrong one)."""
    from specdec.tree_verify import without_replacement

    tokens, parents, qs, prefixes = [], [], [], {-1: ()}
    parent = -1
    for _ in range(depth):
        base = _draft_q(prefixes[parent])
        taken: list[int] = []
        first = None
        for _ in range(width):
            q = without_replacement(base, taken)
            x = int(torch.multinomial(q, 1, generator=g))
            tokens.append(x)
            parents.append(parent)
            qs.append(base if replace_rule else q)
            prefixes[len(tokens) - 1] = prefixes[parent] + (x,)
            taken.append(x)
            first = len(tokens) - 1 if first is None else first
        parent = first
    return tokens, parents, torch.stack(qs), prefixes


def _committed_prefixes(trials: int, wrong: bool, positions: int = 3) -> torch.Tensor:
    """Counts ``[V] * positions`` of the first ``positions`` committed tokens over many sampled tree
    rounds (depth ``positions``, two siblings a level); where a round commits fewer, target-only draws
    follow, as exact later rounds would give."""
    from specdec.tree_verify import verify_tree_sampled

    counts = torch.zeros((VOCAB,) * positions)
    g = torch.Generator().manual_seed(7)
    for _ in range(trials):
        tokens, parents, q, prefixes = _sampled_tree(g, width=2, depth=positions, replace_rule=wrong)
        p = torch.stack([_target_p(())] + [_target_p(prefixes[i]) for i in range(len(tokens))])
        out = list(verify_tree_sampled(p, q, tokens, parents, g).tokens[:positions])
        while len(out) < positions:
            out.append(int(torch.multinomial(_target_p(tuple(out)), 1, generator=g)))
        counts[tuple(out)] += 1
    return counts


def _target_joint(positions: int) -> torch.Tensor:
    """The target's own joint distribution ``[V] * positions`` of its first ``positions`` tokens."""
    joint = _target_p(())
    for depth in range(1, positions):
        shape = (VOCAB,) * depth
        step = torch.stack(
            [
                _target_p(tuple(int(t) for t in index))
                for index in torch.cartesian_prod(*[torch.arange(VOCAB)] * depth).view(-1, depth)
            ]
        ).view(*shape, VOCAB)  # p(next | prefix)
        joint = joint.unsqueeze(-1) * step
    return joint


def _chi2(counts: torch.Tensor) -> tuple[float, int]:
    """Pearson's chi-square of ``counts`` against the target's joint (cells expecting under 5 pooled)
    and its degrees of freedom."""
    expected = (_target_joint(counts.dim()) * counts.sum()).flatten().float()
    observed = counts.flatten()
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


def _p_001_bound(dof: int) -> float:
    """About the 0.999 quantile of chi-square with ``dof`` degrees of freedom (Wilson-Hilferty)."""
    return dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3


def test_sampled_trees_follow_the_target_over_three_positions():
    """Recursive rejection sampling over siblings drawn without replacement: the joint distribution of
    the first three committed tokens, from trees three levels deep, is the target's (p = 0.001)."""
    chi2, dof = _chi2(_committed_prefixes(20_000, wrong=False))
    assert dof > 50 and chi2 < _p_001_bound(dof), f"chi2={chi2:.1f} with {dof} degrees of freedom"


def test_the_wrong_residual_rule_fails_the_same_test():
    """Judging a later sibling against the plain q it was not drawn from (ignoring that the earlier
    siblings' tokens were removed) biases the output: the same test rejects it."""
    chi2, dof = _chi2(_committed_prefixes(20_000, wrong=True))
    assert chi2 > 3 * _p_001_bound(dof), f"chi2={chi2:.1f} with {dof} degrees of freedom"


# --- trees through the round loop (in process) --------------------------------------------------


class TreePolicy:
    """A policy that plans the same tree every round: the loop's plumbing, whatever the cost model."""

    def __new__(cls, shape, **config):
        from coordinator.policy import RoundPlan, SpeculationConfig, SpeculationPolicy

        class Always(SpeculationPolicy):
            def plan(self, turn, room):
                if room < 2:
                    return RoundPlan(0)
                return RoundPlan(
                    min(shape.depth, room - 1), tree=TreeShape(shape.nodes, min(shape.depth, room - 1), shape.width)
                )

        return Always(SpeculationConfig(**config), live_targets=lambda: 1)


def _tree_loop(target_model, drafter, shape):
    from opentelemetry import trace

    from coordinator.rounds import RoundLoop
    from coordinator.routing import Router
    from coordinator.sessions import MemorySessionStore
    from coordinator.turns import Turns
    from draft_service.inprocess import InProcessDraft
    from target_service.inprocess import InProcessTarget

    router = Router([InProcessDraft(drafter)], [InProcessTarget(TargetEngine(target_model, 8))])
    facts = target_model.facts("target")
    turns = Turns(target_model.tokenizer, facts, MemorySessionStore(3600))
    return RoundLoop(target_model.tokenizer, facts, router, TreePolicy(shape), turns, trace.NoOpTracer())


def _run(loop, **fields):
    import asyncio

    from coordinator.turns import GenerationRequest

    async def collect():
        chunks = [c async for c in loop.generate(GenerationRequest("w1 w2 w3", None, 20, **fields), lambda: None)]
        return [t for c in chunks for t in c.token_ids], chunks[-1].stats

    return asyncio.run(collect())


def _hf_greedy(loaded, prompt: str, n: int) -> list[int]:
    ids = loaded.tokenizer.encode(prompt, add_special_tokens=False)
    with torch.inference_mode():
        out = loaded.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("kind", ["model", "ngram"])
def test_tree_rounds_give_target_only_greedy_output(tiny_target, tiny_draft, kind):
    from draft_service.engine import ModelDrafter, NgramDrafter

    drafter = ModelDrafter(tiny_draft, 8, 0) if kind == "model" else NgramDrafter(tiny_target.facts("ngram"), 8, 3, 1)
    tokens, stats = _run(_tree_loop(tiny_target, drafter, TreeShape(6, 3, 2)))
    assert tokens == _hf_greedy(tiny_target, "w1 w2 w3", 20)
    assert stats.tree_rounds > 0 and stats.tree_nodes >= stats.tree_rounds
    assert sum(stats.accepted_at_rank) == sum(stats.accepted_at_depth) <= stats.accepted_tokens


def test_a_tree_from_the_target_itself_takes_its_first_path(tiny_target):
    """A draft equal to the target: no sibling is ever accepted, and the output is the target's."""
    from draft_service.engine import ModelDrafter

    tokens, stats = _run(_tree_loop(tiny_target, ModelDrafter(tiny_target, 8, 0), TreeShape(6, 3, 2)))
    assert tokens == _hf_greedy(tiny_target, "w1 w2 w3", 20)
    assert stats.tree_rounds > 0 and sum(stats.accepted_at_rank[1:]) == 0
    assert stats.mean_accepted_length > 2.5


def _spine(parents: tuple[int, ...]) -> list[int]:
    """The rank-0 path of a tree, root to leaf: each node's first child (siblings are listed by rank)."""
    kids, path, node = children(parents), [], -1
    while kids.get(node):
        node = kids[node][0]
        path.append(node)
    return path


@pytest.mark.parametrize("beam", [1, 4])
def test_the_target_as_its_own_draft_is_accepted_along_the_whole_first_path(tiny_target, beam):
    """A draft equal to the target, growing one path or EAGLE-2's dynamic tree: the verdict takes the
    tree's rank-0 path (the draft's greedy path) as deep as the tree holds it, then the bonus token."""
    from draft_service.engine import ModelDrafter, ProposeCall

    drafter = ModelDrafter(tiny_target, 8, 0)
    drafter.tree_beam = beam
    engine = TargetEngine(tiny_target, 4)
    target_id, n, _ = engine.prefill(PROMPT)
    draft_id, _ = drafter.prefill(PROMPT)
    start, new = n, []  # the draft learns each round's committed tokens with the next call
    for round_index in range(4):
        call = ProposeCall(draft_id, start, new, 0, Sampling(), round_index, tree=TreeShape(7, 4, 2))
        proposal = drafter.propose_batch([call])[0]
        assert not isinstance(proposal, Exception) and len(proposal.tokens) == 7
        verify = VerifyCall(target_id, n, [], proposal.tokens, [], Sampling(), 0, draft_parents=proposal.parents)
        outcome = engine.verify_batch([verify])[0]
        spine = _spine(proposal.parents)
        assert outcome.path == spine and len(outcome.tokens) == len(spine) + 1
        start, new, n = n, outcome.tokens, outcome.committed
        # The draft's cache holds committed tokens only once a tree is grown (a prefix of them).
        cache = drafter.caches.get(draft_id)
        assert cache.kv.get_seq_length() == len(cache.kv_tokens) < n


def _token_draft(tiny_target):
    """The tiny target's token draft (its own layers and reduced head), loaded as a service loads one."""
    from dataclasses import replace

    from draft_service.token_draft import TokenDraftArch, build_token_draft

    torch.manual_seed(5)
    head = torch.arange(2, tiny_target.vocab_size)
    draft = build_token_draft(tiny_target.model, head, TokenDraftArch(1, (1,), len(head))).eval()
    with torch.no_grad():
        for p in draft.layers.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return replace(tiny_target, model=draft.requires_grad_(False))


@pytest.mark.parametrize("kind", ["causal-lm", "token-draft"])
def test_model_tree_levels_see_only_their_ancestors(tiny_target, tiny_draft, kind):
    """A model draft grows every session's level in one ragged pass; each node's tree mask hides its
    cousins. So the draft's probabilities along its first-choice path equal those of growing one path
    (no cousins at all), to float precision, and two sessions grown together get what each gets alone."""
    from draft_service.engine import ModelDrafter, ProposeCall

    loaded = tiny_draft if kind == "causal-lm" else _token_draft(tiny_target)
    prompts = [PROMPT, [5, 1, 8, 8, 2]]

    def grow(beam: int, together: bool) -> list[list[tuple[int, float]]]:
        drafter = ModelDrafter(loaded, 8, 0)
        assert drafter._ragged_trees
        drafter.tree_beam = beam
        growers = []
        make = drafter._grower
        drafter._grower = lambda *args: growers.append(make(*args)) or growers[-1]
        calls = []
        for prompt in prompts:
            draft_id, n = drafter.prefill(prompt)
            calls.append(ProposeCall(draft_id, n, [], 0, Sampling(), 0, tree=TreeShape(12, 4, 3)))
        for batch in [calls] if together else [[c] for c in calls]:
            assert not any(isinstance(p, Exception) for p in drafter.propose_batch(batch))
        spines = []
        for grower in growers:
            nodes, out, node = grower.nodes, [], -1
            while kids := [i for i, x in enumerate(nodes) if x.parent == node]:
                node = kids[0]
                out.append((nodes[node].token, nodes[node].logp))
            spines.append(out)
        return spines

    wide, narrow, wide_alone = grow(4, True), grow(1, True), grow(4, False)
    for w, n, a in zip(wide, narrow, wide_alone):
        assert len(w) == 4
        assert [t for t, _ in w] == [t for t, _ in n] == [t for t, _ in a]
        assert [lp for _, lp in w] == pytest.approx([lp for _, lp in n], abs=1e-5)
        assert [lp for _, lp in w] == pytest.approx([lp for _, lp in a], abs=1e-5)


def test_model_draft_trees_give_target_only_greedy_output_and_expand_siblings(tiny_target):
    """The token draft's dynamic trees through the round loop: the target's greedy output, and trees
    that branch below the first level (a beam of one path never does)."""
    from draft_service.engine import ModelDrafter

    drafter = ModelDrafter(_token_draft(tiny_target), 8, 0, tree_beam=4)
    seen = []
    grow = drafter._draft_trees
    drafter._draft_trees = lambda jobs: [seen.append(r) or r for r in grow(jobs)]
    tokens, stats = _run(_tree_loop(tiny_target, drafter, TreeShape(10, 4, 3)))
    assert tokens == _hf_greedy(tiny_target, "w1 w2 w3", 20)
    assert stats.tree_rounds > 0
    # Some node off the first path has children of its own: the tree grew best first, not along one path.
    assert any(set(parents) - set(_spine(parents)) - {-1} for _, _, _, parents in seen)


def test_seeded_sampled_tree_output_equals_the_chain_and_no_draft(tiny_target, tiny_draft):
    """Coupled sampling with trees: the same tokens as chains or target-only (the draft changes speed only)."""
    from draft_service.engine import ModelDrafter

    sampled = dict(temperature=1.0, top_p=0.95, seed=11)
    tree, _ = _run(_tree_loop(tiny_target, ModelDrafter(tiny_draft, 8, 0), TreeShape(6, 3, 2)), **sampled)
    chain, _ = _run(_tree_loop(tiny_target, ModelDrafter(tiny_draft, 8, 0), TreeShape(3, 3, 1)), **sampled)
    assert tree == chain and len(tree) == 20


# --- drafting trees ------------------------------------------------------------------------------


def _feature_drafter(tiny_target, lookup_min=0):
    from draft_service.engine import FeatureDrafter
    from draft_service.feature_draft import FeatureDraftArch, build_feature_draft

    torch.manual_seed(3)
    draft = build_feature_draft(tiny_target.model, torch.arange(4, 30), FeatureDraftArch(head_size=26))
    with torch.no_grad():
        for p in draft.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    draft = draft.to(tiny_target.dtype).eval().requires_grad_(False)  # built in fp32 for training; served as its target
    return FeatureDrafter(draft, tiny_target.facts("target"), 8, 0, lookup_min=lookup_min)


def _feature_loop(tiny_target, drafter, shape):
    from opentelemetry import trace

    from coordinator.rounds import RoundLoop
    from coordinator.routing import Router
    from coordinator.sessions import MemorySessionStore
    from coordinator.turns import Turns
    from draft_service.inprocess import InProcessDraft
    from target_service.inprocess import InProcessTarget

    router = Router([InProcessDraft(drafter)], [InProcessTarget(TargetEngine(tiny_target, 8))], want_hidden=True)
    facts = tiny_target.facts("target")
    turns = Turns(tiny_target.tokenizer, facts, MemorySessionStore(3600))
    return RoundLoop(tiny_target.tokenizer, facts, router, TreePolicy(shape), turns, trace.NoOpTracer())


def test_feature_draft_trees_give_target_only_greedy_output(tiny_target):
    """The feature draft grows dynamic trees level by level (tree masks over its own KV): the output
    is the target's greedy output, and the trees it proposed were trees, not chains."""
    drafter = _feature_drafter(tiny_target)
    tokens, stats = _run(_feature_loop(tiny_target, drafter, TreeShape(8, 4, 3)))
    assert tokens == _hf_greedy(tiny_target, "w1 w2 w3", 20)
    assert stats.tree_rounds > 0 and stats.tree_nodes > 4 * stats.tree_rounds


def test_feature_tree_levels_see_only_their_ancestors(tiny_target):
    """A level feeds every frontier node of every session in one pass; each node's tree mask hides
    its cousins. So the draft's probabilities along its first-choice path equal those of a draft that
    feeds one node per level (no cousins at all), to float precision."""
    from draft_service.engine import ProposeCall
    from specdec.sampling import Sampling

    engine = TargetEngine(tiny_target, 4)
    _, n, hidden = engine.prefill(PROMPT, with_hidden=True)

    def spine(beam: int) -> list[tuple[int, float]]:
        drafter = _feature_drafter(tiny_target)
        drafter.tree_beam = beam
        growers = []
        make = drafter._grower
        drafter._grower = lambda *args: growers.append(make(*args)) or growers[-1]
        did, _ = drafter.prefill(PROMPT)
        call = ProposeCall(did, n, [], 0, Sampling(), 0, hidden, tree=TreeShape(12, 4, 3))
        assert not isinstance(drafter.propose_batch([call])[0], Exception)
        nodes, out, node = growers[0].nodes, [], -1
        while kids := [i for i, x in enumerate(nodes) if x.parent == node]:
            node = kids[0]  # rank 0: the draft's likeliest child
            out.append((nodes[node].token, nodes[node].logp))
        return out

    wide, narrow = spine(4), spine(1)
    assert len(wide) == 4
    assert [t for t, _ in wide] == [t for t, _ in narrow]
    assert [lp for _, lp in wide] == pytest.approx([lp for _, lp in narrow], abs=1e-5)


def test_sampled_trees_have_a_fixed_shape_and_exact_sibling_q():
    from draft_service.tree_draft import TreeGrower
    from specdec.sampling import Sampling

    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    for seed in range(5):
        grower = TreeGrower(TreeShape(6, 3, 2), Sampling(1.0, 0, 1.0, seed), 0, 10)
        grower.grow(-1, logits)
        while frontier := grower.frontier():
            assert len(frontier) == 1  # only the first drawn child expands: a shape no draw changes
            grower.grow(frontier[0], logits)
        tokens, parents, qs = grower.result()
        assert parents == (-1, -1, 0, 0, 2, 2)
        for first, second in ((0, 1), (2, 3), (4, 5)):
            ids, probs = qs[second]
            assert tokens[first] not in ids and tokens[first] != tokens[second]
            assert sum(probs) == pytest.approx(1.0)
            assert dict(zip(*qs[first]))[tokens[second]] / (1 - dict(zip(*qs[first]))[tokens[first]]) == pytest.approx(
                dict(zip(ids, probs))[tokens[second]]
            )


def test_lookup_trees_branch_at_every_continuation():
    from specdec.ngram import lookup_tree

    context = [1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3, 4, 8, 1, 2, 3]
    tokens, parents = lookup_tree(context, nodes=8, depth=2, width=3, max_n=3, min_n=2)
    kids = children(parents)
    assert [tokens[c] for c in kids[-1]] == [4, 5]  # 4 followed twice, 5 once
    four = kids[-1][0]
    assert sorted(tokens[c] for c in kids[four]) == [8, 9]
    assert lookup_tree([1, 2, 3], 8, 2, 3, 3, 2) == ([], ())


# --- bad trees over gRPC -----------------------------------------------------------------------------


def test_bad_trees_over_grpc_get_invalid_argument_and_the_services_stay_up(
    tiny_target, tiny_draft, tiny_dir, redis_url
):
    import grpc
    from harness import InProcessStack

    from draft_service.engine import ModelDrafter
    from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

    target, drafter = TargetEngine(tiny_target, 8), ModelDrafter(tiny_draft, 8, 0)
    stack = InProcessStack(target, drafter, tiny_dir / "target", redis_url)
    greedy = common_pb2.SamplingParams(temperature=0.0, top_p=1.0)
    try:
        verify = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(stack.add_target(target)))
        propose = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(stack.add_draft(drafter)))
        assert verify.GetModelInfo(common_pb2.ModelInfoRequest()).trees
        assert propose.GetModelInfo(common_pb2.ModelInfoRequest()).trees
        cache = verify.Prefill(common_pb2.PrefillRequest(tokens=PROMPT))
        bad = [
            ([4, 5], [-1, 1], "earlier node"),  # a parent after its child
            ([4, 5], [0, -1], "earlier node"),  # a node its own parent (a cycle)
            ([4, 5, 6], [-1, 0], "one parent per draft token"),
            ([4] * 33, list(range(-1, 32)), "at most 32"),
        ]
        for tokens, parents, message in bad:
            with pytest.raises(grpc.RpcError) as caught:
                verify.Verify(
                    target_pb2.VerifyRequest(
                        sync=common_pb2.CacheSync(cache_id=cache.cache_id, start=cache.committed),
                        draft_tokens=tokens,
                        draft_parents=parents,
                        sampling=greedy,
                    )
                )
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in caught.value.details()
        draft_cache = propose.Prefill(common_pb2.PrefillRequest(tokens=PROMPT))
        for shape, message in (
            (draft_pb2.TreeShape(nodes=40, depth=3, width=2), "tree.nodes"),
            (draft_pb2.TreeShape(nodes=4, depth=9, width=2), "tree.depth"),
        ):
            with pytest.raises(grpc.RpcError) as caught:
                propose.Propose(
                    draft_pb2.ProposeRequest(
                        sync=common_pb2.CacheSync(cache_id=draft_cache.cache_id, start=draft_cache.committed),
                        sampling=greedy,
                        tree=shape,
                    )
                )
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in caught.value.details()
        # Both still serve the same sessions: a good tree is proposed, verified and committed.
        sync = common_pb2.CacheSync(cache_id=draft_cache.cache_id, start=draft_cache.committed)
        tree = propose.Propose(
            draft_pb2.ProposeRequest(sync=sync, sampling=greedy, tree=draft_pb2.TreeShape(nodes=6, depth=3, width=2))
        )
        assert len(tree.tokens) == 6 and list(tree.parents) != list(range(-1, 5))
        reply = verify.Verify(
            target_pb2.VerifyRequest(
                sync=common_pb2.CacheSync(cache_id=cache.cache_id, start=cache.committed),
                draft_tokens=tree.tokens,
                draft_parents=tree.parents,
                sampling=greedy,
            )
        )
        assert reply.committed == cache.committed + len(reply.tokens) and len(reply.accepted_nodes) == reply.accepted
    finally:
        stack.close()


def test_unseeded_sampled_trees_through_the_loop_follow_the_target(tiny_target, tiny_draft):
    """Unseeded sampling (recursive rejection over siblings drawn without replacement) with a fixed
    tree every round, through the round loop: the first and the second committed tokens each follow
    the target's own distribution (chi-square over the tiny vocabulary, p = 0.001)."""
    from draft_service.engine import ModelDrafter
    from specdec.sampling import Sampling, warp_probs

    sampling = Sampling(1.0, 0, 1.0)
    ids = tiny_target.tokenizer.encode("w1 w2 w3", add_special_tokens=False)
    with torch.inference_mode():
        first = warp_probs(tiny_target.model(torch.tensor([ids])).logits[0, -1:], sampling)[0]  # [V]
        nexts = warp_probs(
            tiny_target.model(torch.tensor([ids + [t] for t in range(len(first))])).logits[:, -1], sampling
        )  # [V, V]
    # The second position, given the first was not EOS (which ends the request there).
    go_on = first.clone()
    go_on[EOS] = 0.0
    second = (go_on / go_on.sum()) @ nexts  # [V]
    loop = _tree_loop(tiny_target, ModelDrafter(tiny_draft, 8, 0), TreeShape(4, 2, 2))
    n, counts, trees = 1500, torch.zeros(2, len(first)), 0
    for _ in range(n):
        tokens, stats = _run_n(loop, 2, temperature=1.0)
        counts[0, tokens[0]] += 1
        if len(tokens) > 1:
            counts[1, tokens[1]] += 1
        trees += stats.tree_rounds
    assert trees > n // 2
    for observed, p in zip(counts, (first, second)):
        expected = p.float() * observed.sum()
        big = expected >= 5
        obs = torch.cat([observed[big], observed[~big].sum().view(1)])
        exp = torch.cat([expected[big], expected[~big].sum().view(1)])
        keep = exp > 0
        chi2 = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
        dof = int(keep.sum()) - 1
        assert chi2 < dof + 3.1 * (2 * dof) ** 0.5 + 5, f"chi2={chi2:.1f} with {dof} degrees of freedom"


def _run_n(loop, max_new_tokens: int, **fields):
    import asyncio

    from coordinator.turns import GenerationRequest

    async def collect():
        request = GenerationRequest("w1 w2 w3", None, max_new_tokens, **fields)
        chunks = [c async for c in loop.generate(request, lambda: None)]
        return [t for c in chunks for t in c.token_ids], chunks[-1].stats

    return asyncio.run(collect())
