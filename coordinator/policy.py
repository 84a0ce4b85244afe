"""The speculation policy: what each round drafts, and what the coordinator learns from it.

``SpeculationPolicy.plan`` decides a round before it runs: how many tokens to ask of the draft
service (k, the request's own or the adaptive choice of ``coordinator.adaptive``), whether the
coordinator's own prompt lookup proposes instead, the draft's confidence cut-off and how far the
draft drafts ahead. ``observe`` folds the finished round into what steers later plans: measured
draft and verify costs, each target's latest batched pass, the fleet's acceptance and the turn's
target-only streak.

Greedy requests follow measured costs, and so do coupled ones (seeded sampled requests), whose
tokens depend on their seed and positions alone, whatever k each round drafts. Other sampled requests
follow a fixed prior cost curve and never draft ahead, so their k sequence, and hence their random
draws, never depend on timing or load: a resumed one replays what its client saw.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from coordinator.adaptive import AcceptanceTracker, CostModel, FleetAcceptance, expected_tokens
from coordinator.replicas import DraftResult, VerifyResult
from coordinator.tree_choice import TreeAcceptance, TreeDraftCosts, best_tree, spine_tokens
from coordinator.turns import Turn
from specdec.batching import PassLoad
from specdec.config import MAX_TREE_NODES
from specdec.ngram import LOOKUP_MAX_N, propose_ngram
from specdec.trees import TreeShape, ranks

# Rounds of target-only decoding after which an adaptive session tries k = 1 again.
PROBE_EVERY = 8
# Seconds a target's load report stays current for choosing k.
LOAD_FRESH_S = 1.0
# How much more a tree must promise, in tokens per millisecond, than the best chain. Its estimates
# run optimistic: on the 2-core development CPU, at a 3% margin the stack with trees allowed ran
# 0.94 to 0.96 times as fast as chains only, and the tree ceiling there (``make tree-ceiling``) puts
# trees' best over chains at 1.06 times, whatever the draft's cost. A tree must promise a gain that
# survives such an error.
TREE_MIN_GAIN = 1.10


@dataclass(frozen=True)
class SpeculationConfig:
    """How the coordinator speculates (see ``specdec.config.CoordinatorConfig`` for each field)."""

    # Draft length when a request does not choose one; None picks k each round.
    default_k: int | None = None
    # Largest k the adaptive choice considers.
    max_auto_k: int = 8
    # The draft computes on the target's cores: under load a draft call slows the shared pass too.
    draft_colocated: bool = False
    # Shortest context suffix the coordinator's own prompt lookup matches (0: no lookup).
    free_lookup_min: int = 0
    # With k adaptive, the draft stops where its confidence no longer pays (CostModel.min_confidence).
    confidence_cutoff: bool = False
    # Tokens the draft drafts ahead while a lone session's round is verified (0: none).
    draft_ahead: int = 0
    # Most nodes of a round's token tree (0: chains only); the tree's size and shape are chosen per round.
    tree_nodes: int = 0


@dataclass(frozen=True)
class RoundPlan:
    """What one round drafts. ``k`` tokens are asked of the draft service (0: no draft call);
    ``lookup``, when set, is the coordinator's own proposal, verified in place of a draft."""

    k: int
    lookup: list[int] | None = None
    min_confidence: float = 0.0
    ahead: int = 0
    # A token tree to ask of the draft instead of a chain (``k`` is then its depth).
    tree: TreeShape | None = None
    # ``lookup`` holds the tokens the request's grammar forces (``Turn.forced_tokens``), not a lookup's.
    forced: bool = False
    # Whether the round asks the target for the hidden states it feeds, which a feature draft drafts
    # from in a later round (``SpeculationPolicy.wants_features``).
    features: bool = True

    def local_draft(self) -> DraftResult | None:
        """The lookup as a draft to verify. It leaves the draft's cache as it was (``committed`` 0)."""
        return None if self.lookup is None else DraftResult(list(self.lookup), [], 0)


@dataclass(frozen=True)
class RoundOutcome:
    """A finished round: the proposal verified (None: target-only), the verdict and their costs."""

    plan: RoundPlan
    draft: DraftResult | None
    verdict: VerifyResult
    # The replica that verified it.
    target: str
    draft_ms: float
    verify_ms: float
    # Committed tokens the draft's cache took in before drafting (None: it prefilled the session).
    caught_up: int | None = None

    @property
    def drafted(self) -> int:
        """Tokens verified beside the target's own one."""
        return len(self.draft.tokens) if self.draft is not None else 0

    @cached_property
    def accepted_ranks(self) -> tuple[int, ...] | None:
        """For a tree round: each accepted node's rank among its siblings, root to leaf; None for a chain."""
        if self.draft is None or self.verdict.path is None:
            return None
        node_ranks = ranks(self.draft.parents)
        return tuple(node_ranks[node] for node in self.verdict.path)

    @property
    def model_drafted(self) -> int:
        """Tokens the draft service's model proposed (a lookup's do not count)."""
        return self.drafted if self.plan.lookup is None else 0


class LoadTable:
    """Each target replica's latest batched pass and when it was seen."""

    def __init__(self, live: Callable[[], int], fresh_s: float = LOAD_FRESH_S) -> None:
        self._live = live
        self._fresh_s = fresh_s
        self.seen: dict[str, tuple[float, PassLoad]] = {}

    def note(self, address: str, load: PassLoad) -> None:
        """Keeps the replica's latest pass; forgets stale ones once replicas that left (discovered pods
        come and go under new addresses) could make the table grow past the live set."""
        now = time.monotonic()
        self.seen[address] = (now, load)
        if len(self.seen) > 2 * self._live() + 1:
            self.seen = {a: seen for a, seen in self.seen.items() if now - seen[0] <= self._fresh_s}

    def fresh(self, address: str) -> PassLoad | None:
        """The replica's latest pass, unless it is too old to say what the load is now."""
        seen = self.seen.get(address)
        if seen is None or time.monotonic() - seen[0] > self._fresh_s:
            return None
        return seen[1]


class SpeculationPolicy:
    """Plans rounds and learns from them, for every turn of one coordinator."""

    def __init__(self, config: SpeculationConfig, live_targets: Callable[[], int] = lambda: 1) -> None:
        self.config = config
        # Measured costs steer greedy turns; the fixed prior curve steers sampled ones.
        self.costs = CostModel(k_max=config.max_auto_k, colocated=config.draft_colocated)
        self.prior_costs = CostModel(k_max=config.max_auto_k)
        self.fleet = FleetAcceptance()
        # Greedy sessions' acceptance by tree depth and sibling rank (``coordinator.tree_choice``).
        self.trees = TreeAcceptance()
        # What tree draft calls cost, by shape (a level feeds several nodes: dearer than a chain's step).
        self.tree_draft_ms = TreeDraftCosts()
        self.loads = LoadTable(live_targets)
        # Whether the targets report their passes (a target that does not batch reports none).
        self.batching_targets = True

    def start(self, turn: Turn) -> None:
        """Seeds the turn's acceptance estimate: a greedy turn starts from the fleet's, a sampled one
        from the fixed prior (its draws must not depend on other sessions); a resumed turn keeps the
        counts it had."""
        state = turn.state
        if turn.sampling.greedy:
            tracker = self.fleet.session_tracker(self.costs.k_max, state.drafted, state.accepted, state.tried)
        else:
            tracker = AcceptanceTracker(
                drafted=list(state.drafted), accepted=list(state.accepted), tried=list(state.tried)
            )
        turn.stats.positions = tracker

    def fixed_k(self, turn: Turn) -> int | None:
        """The turn's fixed draft length, or None when k is chosen each round."""
        return self.config.default_k if turn.request.k is None else turn.request.k

    def plan(self, turn: Turn, room: int) -> RoundPlan:
        """The next round's plan, for a turn that may commit at most ``room`` more tokens."""
        fixed = self.fixed_k(turn)
        costs = self._costs_for(turn)
        load = self._load(turn)
        k = max(0, min(self._choose_k(turn, fixed, costs, load), room - 1))
        features = self.wants_features(fixed, costs, load)
        lookup = None
        if fixed is None and turn.sampling.greedy:
            # Tokens the grammar allows alone cost no draft call and pass whole: a round proposes them
            # by themselves (JSON keys and punctuation between a schema's values).
            forced = turn.forced_tokens(min(costs.k_max, room - 1))
            if forced:
                return RoundPlan(0, forced, forced=True, features=features)
            lookup = self._free_lookup(turn, costs, room - 1, k)
            if lookup is not None:
                return RoundPlan(0, lookup, features=features)
        tree = self._tree(turn, fixed, costs, room, k, load)
        if tree is not None:
            return RoundPlan(tree.depth, tree=tree)
        cutoff = costs.min_confidence() if self.config.confidence_cutoff and fixed is None and k else 0.0
        return RoundPlan(k, None, cutoff, self._ahead(turn, k, load), features=features)

    @staticmethod
    def wants_features(fixed: int | None, costs: CostModel, load: PassLoad | None) -> bool:
        """Whether the round should bring the target's hidden states back for a later draft call.

        Not while no round of the turn drafts: a fixed k of 0, or k chosen here beside a load no
        draft may join (``CostModel.drafts_beside``). The rows would only pile up, and carrying them
        costs the target and this coordinator work on every round. When the session drafts again,
        the feature draft starts a new window from the rows it gets from then on: fewer accepted
        tokens for a few rounds, never other tokens.
        """
        return fixed > 0 if fixed is not None else costs.drafts_beside(load)

    def observe(self, turn: Turn, outcome: RoundOutcome) -> None:
        """Learns from a finished round: its costs, the target's load, the draft's acceptance."""
        if self._prices_drafting(outcome):
            if outcome.plan.tree is None:
                self.costs.record_draft(outcome.draft_ms, outcome.drafted)
            else:
                self.tree_draft_ms.record(outcome.plan.tree, outcome.draft_ms)
        load = outcome.verdict.load
        self.costs.record_verify(outcome.verify_ms, outcome.drafted + 1, load)
        if load is not None:
            self.loads.note(outcome.target, load)
        else:
            self.batching_targets = False
        state = turn.state
        state.rounds_without_draft = 0 if outcome.model_drafted else state.rounds_without_draft + 1
        path = outcome.verdict.path
        if path is not None and outcome.draft is not None:
            if turn.sampling.greedy:
                self.trees.record(outcome.draft.parents, path)
        elif outcome.model_drafted and turn.sampling.greedy:
            self.fleet.record(outcome.drafted, outcome.verdict.accepted)

    def observe_probe(self, probed: CostModel, outcome: RoundOutcome) -> None:
        """Learns from a round of the start-up probe (``coordinator.rounds.RoundLoop.probe``): its
        costs into ``probed``, which then seeds the measured costs' priors (``CostModel.seed``), and
        its acceptance into the fleet's, as any greedy round's. The load it saw is not kept: a
        request's first round measures the load it meets.

        The fixed prior costs of sampled requests stay as they are: their k, and so their draws, must
        not depend on what a probe happened to time.
        """
        if self._prices_drafting(outcome) and outcome.plan.tree is None:
            probed.record_draft(outcome.draft_ms, outcome.drafted)
        probed.record_verify(outcome.verify_ms, outcome.drafted + 1, outcome.verdict.load)
        if outcome.model_drafted and outcome.verdict.path is None:
            self.fleet.record(outcome.drafted, outcome.verdict.accepted)

    def _prices_drafting(self, outcome: RoundOutcome) -> bool:
        """Whether the round's draft call prices a draft of its length: only the model drafting on the
        spot, in a routine call that took in no more tokens than one round commits.

        A call answered ahead or by the draft service's lookup says nothing of the next one the model
        drafts; nor does one that first took in a whole prompt (a session's first, or one placed
        anew), which can cost ten times a round's call and, priced as a draft of its k, would keep that
        k and every longer one from being tried again.
        """
        draft = outcome.draft
        if draft is None or outcome.plan.lookup is not None or draft.from_ahead or draft.looked_up:
            return False
        return outcome.caught_up is not None and outcome.caught_up <= self.costs.k_max + 1

    def _tree(
        self, turn: Turn, fixed: int | None, costs: CostModel, room: int, k: int, load: PassLoad | None
    ) -> TreeShape | None:
        """The round's token tree, where one promises more tokens per millisecond than the best chain
        (``k``) and target-only; None otherwise (``coordinator.tree_choice``).

        Greedy turns read the fleet's acceptance by depth and rank, sampled ones their own (their
        draws must not depend on other sessions), each starting from the chain's rates by depth.
        """
        asked = turn.request.tree_nodes
        most = self.config.tree_nodes if asked is None or not self.config.tree_nodes else min(asked, MAX_TREE_NODES)
        if not most or room < 2 or turn.target is None:
            return None
        if fixed is not None:
            return self._fixed_tree(turn, fixed, asked, room)
        greedy = turn.sampling.greedy
        if greedy and load is None and self.batching_targets:
            return None  # the load is unknown: the round measures it target-only (``_choose_k``)
        if not costs.drafts_beside(load):
            return None
        verify, others = costs.pass_curve(load)
        draft = costs.draft_curve()
        chain_rates = turn.stats.positions.rates(costs.k_max)
        gain = 1.05 if load is not None and load.curve_ms and load.sessions > 1 else 1.0001

        def per_ms(tokens: float, drafting: float, nodes: int) -> float:
            return (others + tokens) / (drafting + verify[nodes + 1])

        # A tree must beat the best chain by a margin as well: its estimates (sibling acceptance, the
        # cost of rows past the chain's) are the least measured, and a tie is worth nothing.
        best = per_ms(expected_tokens(chain_rates, k), draft[k], k) * TREE_MIN_GAIN
        acceptance = self.trees if greedy else turn.stats.trees

        def rate(depth: int, rank: int) -> float:
            return acceptance.rate(depth, rank, chain_rates)

        max_nodes = min(most, len(verify) - 2)
        max_depth = min(costs.k_max, room - 1)
        if greedy or turn.sampling.coupled:
            candidates = best_tree(rate, max_nodes, max_depth)
        else:
            candidates = [
                (spine_tokens(rate, depth, width), TreeShape(depth * width, depth, width))
                for depth in range(1, max_depth + 1)
                for width in (2, 3)
                if depth * width <= max_nodes
            ]
        choice = None
        for tokens, shape in candidates:
            if shape.width < 2:
                continue  # a chain: ``k`` is the best of those
            drafting = self.tree_draft_ms.estimate(shape, draft[min(shape.depth, costs.k_max)])
            value = per_ms(tokens, drafting, shape.nodes)
            if value > best * gain:
                best, choice = value, shape
        return choice

    def _fixed_tree(self, turn: Turn, k: int, nodes: int | None, room: int) -> TreeShape | None:
        """A request's fixed tree: ``nodes`` nodes at most ``k`` deep every round (a fixed k alone is a
        chain), shaped best first from the acceptance seen so far; a sampled one is ``k`` levels of
        ``nodes // k`` siblings."""
        depth = min(k, room - 1)
        if not nodes or depth <= 0:
            return None
        if not turn.sampling.greedy and not turn.sampling.coupled:
            width = max(1, nodes // depth)
            return TreeShape(depth * width, depth, width) if width > 1 else None
        chain_rates = turn.stats.positions.rates(max(depth, 1))
        acceptance = self.trees if turn.sampling.greedy else turn.stats.trees
        shapes = best_tree(lambda d, r: acceptance.rate(d, r, chain_rates), nodes, depth)
        shape = shapes[-1][1]
        return shape if shape.width > 1 else None

    def _costs_for(self, turn: Turn) -> CostModel:
        # A coupled draw depends on no k, so measured costs may steer it: the fixed prior (a slow
        # target beside a cheap draft) kept sampled requests drafting where a fast target pass made
        # target-only faster.
        return self.costs if turn.sampling.greedy or turn.sampling.coupled else self.prior_costs

    def _load(self, turn: Turn) -> PassLoad | None:
        """The load that steers a greedy turn's rounds: its target's latest pass, while fresh. Sampled
        turns read none (their draws must not depend on other sessions)."""
        return self.loads.fresh(turn.target.address) if turn.sampling.greedy and turn.target is not None else None

    def _choose_k(self, turn: Turn, fixed: int | None, costs: CostModel, load: PassLoad | None) -> int:
        """This round's draft length: the request's fixed k, or the adaptive choice."""
        if fixed is not None:
            return fixed
        greedy = turn.sampling.greedy
        if greedy and load is None and self.batching_targets:
            # No recent pass seen on this replica: its load is unknown (a burst may just have
            # arrived), so this round runs target-only and measures it rather than drafting into a
            # busy batch.
            return 0
        tracker = turn.stats.positions
        k = costs.choose(tracker, load)
        # Probe now and then, so a session whose draft improves can win it back; but only when its
        # acceptance, not the target's load, holds k at 0, and a good draft would be used.
        probe = k == 0 and turn.state.rounds_without_draft >= PROBE_EVERY
        if probe and costs.choose_unloaded(tracker, load) == 0 and costs.worth_probing(load):
            return 1
        return k

    def _ahead(self, turn: Turn, k: int, load: PassLoad | None) -> int:
        """Tokens the draft should draft ahead after this round's proposal: the configured number for a
        session that drafts and verifies alone, else 0.

        Alone, the draft idles while the target verifies, so drafting ahead costs no one time on
        separate hosts. Beside other sessions it would delay their proposals. Sampled requests never
        draft ahead: whether they did hangs on the load, and so would their tokens.
        """
        if not self.config.draft_ahead or k <= 0 or not turn.sampling.greedy or turn.target is None:
            return 0
        return self.config.draft_ahead if load is None or load.sessions <= 1 else 0

    def _free_lookup(self, turn: Turn, costs: CostModel, room: int, model_k: int) -> list[int] | None:
        """A prompt-lookup proposal the coordinator makes itself for a greedy round: as many of the
        looked-up tokens as pay for the verify rows they add, or None. For a round the draft service
        would draft (``model_k`` > 0), only where the lookup promises at least as many tokens per
        millisecond as that draft call (``CostModel.prefers_free``)."""
        if not self.config.free_lookup_min or room <= 0 or turn.target is None:
            return None
        load = self.loads.fresh(turn.target.address)
        if load is None and self.batching_targets:
            return None  # the target's load is unknown: measure it first (as ``_choose_k`` does)
        # The scan is linear in the context: only after the cheap checks, once per round.
        tokens = propose_ngram(turn.committed, min(costs.k_max, room), LOOKUP_MAX_N, self.config.free_lookup_min)
        if not tokens:
            return None
        stats = turn.stats
        k = costs.choose_free(stats.lookup, load, len(tokens))
        if k <= 0 or (model_k > 0 and not costs.prefers_free(stats.lookup, k, stats.positions, model_k, load)):
            return None
        return tokens[:k]
