"""Choosing each round's draft length k from what the session's draft achieves and what rounds cost.

A round that drafts k tokens commits, in expectation,

    E(k) = 1 + a1 + a1*a2 + ... + a1*...*ak

tokens, where ai is the probability that draft token i is accepted given that tokens 1..i-1 were
(the bonus/recovered token is the leading 1). With i.i.d. acceptance a this is (1 - a^(k+1)) / (1 - a).
The round costs k draft steps plus one verify pass over k + 1 tokens, so the best k maximises

    E(k) / (k * draft_ms_per_token + verify_ms(k + 1)).

k = 0 (target-only) is always a candidate, so speculation switches itself off when it does not pay.

Under load the target verifies many sessions in one batched pass, and a session's extra draft tokens
make that pass slower for everyone in it. The target reports, with each verdict, how many tokens the
pass committed for the other sessions (R) and its cost curve: what the pass would have cost had this
session fed k + 1 rows beside the others. The choice then maximises the pass's throughput as a whole,

    (R + E(k)) / (k * draft_ms_per_token + overhead_ms + pass_ms(k + 1)),

which is the single-session rule when R = 0. With many sessions R dwarfs what one session's draft can
add while each extra row still costs its full share of a compute-bound pass, so k falls to 0 under
heavy load and climbs back when the load falls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specdec.batching import PassLoad


def add_counts(total: list[int], more: list[int]) -> None:
    """Adds per-position counts into ``total`` in place, growing it as needed."""
    total.extend([0] * (len(more) - len(total)))
    for i, n in enumerate(more):
        total[i] += n


def expected_tokens(accept: list[float], k: int) -> float:
    """E(k): tokens a round commits, bonus included, from conditional acceptance by position."""
    total, reach = 1.0, 1.0
    for i in range(k):
        reach *= accept[i] if i < len(accept) else (accept[-1] if accept else 0.0)
        total += reach
    return total


def choose_k(
    accept: list[float],
    draft_ms: float | list[float],
    verify_ms: list[float],
    k_max: int,
    others_committed: float = 0.0,
    min_gain: float = 1.0001,
) -> int:
    """The k in [0, k_max] with the most expected tokens per millisecond, counting the other sessions'.

    ``draft_ms`` is the cost of one draft token, or ``draft_ms[k]`` that of a whole call for k tokens
    (its round trip included); ``verify_ms[n]`` is the cost of verifying n tokens (index 0 unused), for
    a batched pass the whole pass's cost; ``accept[i]`` the conditional acceptance of draft position i + 1;
    ``others_committed`` the tokens the same pass commits for the other sessions in it. A longer k
    must beat the best shorter one by the factor ``min_gain``: ties go to fewer wasted draft steps.
    """
    best_k, best_rate = 0, 0.0
    for k in range(min(k_max, len(verify_ms) - 2) + 1):
        drafting = draft_ms[k] if isinstance(draft_ms, list) else k * draft_ms
        cost = drafting + verify_ms[k + 1]
        rate = (others_committed + expected_tokens(accept, k)) / cost
        if rate > best_rate * min_gain:
            best_k, best_rate = k, rate
    return best_k


def speculation_ceiling(pass_ms: dict[int, list[float]], accept: float) -> dict[int, tuple[float, int]]:
    """The most speculation could gain, by sessions per pass, with a draft that cost nothing.

    ``pass_ms[C][k]`` is a pass's cost with C sessions each verifying k draft tokens (see
    ``bench.pass_grid``); a draft token is accepted with probability ``accept`` given the ones
    before were. Returns, by C, the best E(k) * pass_ms[C][0] / pass_ms[C][k] over k, and that k: a
    real draft's time and the round trips of a stack only come off it.
    """
    out = {}
    for sessions, row in pass_ms.items():
        gains = [expected_tokens([accept], k) * row[0] / ms for k, ms in enumerate(row)]
        best = max(range(len(gains)), key=gains.__getitem__)
        out[sessions] = (gains[best], best)
    return out


@dataclass
class AcceptanceTracker:
    """Conditional acceptance by draft position, smoothed towards a prior (Beta pseudo-counts)."""

    prior: float = 0.5
    prior_weight: float = 2.0
    # Priors by position (``FleetAcceptance``); positions past them use the estimate before them.
    prior_rates: list[float] = field(default_factory=list)
    # By position: rounds that drafted it, rounds whose tokens up to it all passed, and rounds that
    # reached it (drafted it after every token before it passed). A position past the first rejection
    # was drafted but never judged; counting it as tried would read the share of rounds that get that
    # far, and multiplying those shares (``expected_tokens``) would count each rejection again.
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    tried: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        """Counts one round: positions 1..drafted were proposed, 1..accepted passed, and positions up
        to the first rejection were tried."""
        add_counts(self.drafted, [1] * drafted)
        add_counts(self.accepted, [1] * accepted)
        add_counts(self.tried, [1] * min(drafted, accepted + 1))

    def rates(self, k_max: int) -> list[float]:
        """Smoothed acceptance for positions 1..k_max, each given that the ones before it passed;
        untried positions inherit the last estimate."""
        out: list[float] = []
        for i in range(k_max):
            tried = self.tried[i] if i < len(self.tried) else 0
            passed = self.accepted[i] if i < len(self.accepted) else 0
            prior = self.prior_rates[i] if i < len(self.prior_rates) else out[-1] if out else self.prior
            out.append((passed + prior * self.prior_weight) / (tried + self.prior_weight))
        return out


@dataclass
class FleetAcceptance:
    """The draft's acceptance by position over every greedy session a coordinator ran: the prior each
    new session's own estimate starts from.

    A session alone knows nothing of its draft at first, and two or three early rejections pull a
    weak prior (0.5, weight 2) far enough down to switch drafting off until the next probe, even in
    sessions whose draft goes on to pass half its tokens. Starting from what the draft achieves across
    sessions, with the weight of a few rounds, a session's own evidence still moves it, but early
    noise does not. Sampled sessions keep the fixed prior: their draws must not depend on other
    sessions.
    """

    weight: float = 6.0
    """Pseudo-rounds a session's prior counts for."""
    horizon: int = 2000
    """Past this many judged first tokens the counts halve, so the estimate follows a changing draft."""
    counts: AcceptanceTracker = field(default_factory=AcceptanceTracker)

    def record(self, drafted: int, accepted: int) -> None:
        """Counts one greedy round the draft service proposed."""
        self.counts.record(drafted, accepted)
        if self.counts.tried and self.counts.tried[0] > self.horizon:
            for counts in (self.counts.drafted, self.counts.accepted, self.counts.tried):
                counts[:] = [n // 2 for n in counts]

    def session_tracker(
        self, k_max: int, drafted: Sequence[int] = (), accepted: Sequence[int] = (), tried: Sequence[int] = ()
    ) -> AcceptanceTracker:
        """A session's tracker (with its counts so far, for a resumed turn) starting from the fleet's
        acceptance by position."""
        return AcceptanceTracker(
            prior_weight=self.weight,
            prior_rates=self.counts.rates(k_max),
            drafted=list(drafted),
            accepted=list(accepted),
            tried=list(tried),
        )


@dataclass
class CostModel:
    """Moving averages of draft cost per token and verify cost by tokens verified.

    Unmeasured verify sizes are filled from the nearest measured smaller size, so a cheap
    measurement at n tokens is never extrapolated to claim n + 5 is as cheap unless measured.
    """

    k_max: int
    # Priors, in milliseconds, until measurements replace them: a CPU-sized target step and a cheap
    # draft. A coordinator replaces them at start-up with what it measured of its own draft and
    # target (``seed``, from ``coordinator.rounds.RoundLoop.probe``).
    draft_ms_per_token: float = 2.0
    step_ms: float = 100.0
    verify_ms: list[float] = field(default_factory=list)
    smoothing: float = 0.2
    # Assumed growth per extra verified token before it is measured (fraction of a one-token pass).
    growth: float = 0.08

    # Round-trip cost of a verify call beyond the target's pass (RPC, encoding), measured unloaded.
    overhead_ms: float = 3.0
    # Prior cost of a draft call's round trip, beyond its tokens.
    draft_call_ms: float = 3.0
    # The draft runs on the target's own cores (one machine, no accelerator): while other sessions'
    # pass runs, a draft call takes its compute from that pass as well as adding its own wait.
    colocated: bool = False

    def __post_init__(self) -> None:
        if not self.verify_ms:
            self.verify_ms = [0.0] * (self.k_max + 2)
        self._seen = [False] * (self.k_max + 2)
        # Whole draft calls by k: the round trip and any wait behind other sessions' drafts count,
        # which a per-token average would hide behind cheap calls (a prompt-lookup hit).
        self._draft_calls: dict[int, float] = {}
        self._draft_counts: dict[int, int] = {}
        self._probed = False  # the priors are measured ones (``seed``)

    def seed(self, probe: CostModel) -> None:
        """Takes what a start-up probe measured (the costs recorded into ``probe``) as this model's
        priors: the draft call's fixed part and per-token step, and the verify pass's cost at one
        token and its growth per extra token, each fitted through the sizes the probe saw. Anything
        the probe did not measure keeps its prior.

        They stay priors, not measurements: a round's own measurement of a draft length or verify
        size replaces them, as it replaces any prior, since calls at start-up (cold caches, a first
        call's allocations) are less like the rounds to come than those rounds are.
        """
        if probe._draft_calls:
            self.draft_ms_per_token = probe.draft_step_ms()
            self.draft_call_ms = max(0.0, probe.draft_curve()[1] - self.draft_ms_per_token)
            self._probed = True
        seen = [n for n in range(1, len(probe.verify_ms)) if probe._seen[n]]
        if seen:
            low, high = seen[0], seen[-1]
            ms = probe.verify_ms
            slope = max(0.0, (ms[high] - ms[low]) / (high - low)) if high > low else self.growth * ms[low]
            self.step_ms = max(ms[low] - slope * (low - 1), 1e-3)
            self.growth = slope / self.step_ms

    def record_draft(self, ms: float, tokens: int) -> None:
        """Folds in one draft call that proposed ``tokens`` tokens in ``ms`` end to end."""
        if tokens > 0:
            if not self._draft_calls and not self._probed:
                # The first measurement replaces an assumed prior, as a verify size's does: one 20
                # times too cheap (a model draft's, not a 2 ms/token one's) took a dozen calls to forget.
                self.draft_ms_per_token = ms / tokens
            self.draft_ms_per_token += self.smoothing * (ms / tokens - self.draft_ms_per_token)
            known = self._draft_calls.get(tokens)
            self._draft_calls[tokens] = ms if known is None else known + self.smoothing * (ms - known)
            self._draft_counts[tokens] = self._draft_counts.get(tokens, 0) + 1

    def draft_step_ms(self) -> float:
        """What one more token adds to a draft call: the least-squares slope of the measured call costs
        by k, each k weighted by how often it was measured and lengths seen fewer than 3 times left out
        while two others were not (a rare length's average is one call's, possibly stale), or the
        per-token average before two lengths are measured.

        A call's fixed part (its round trip, and the catch-up pass over the tokens just committed) is
        paid whatever it proposes; a longer proposal adds only its draft steps.
        """
        if len(self._draft_calls) < 2:
            return self.draft_ms_per_token
        weights = {k: min(n, 50) for k, n in self._draft_counts.items()}
        frequent = {k: w for k, w in weights.items() if w >= 3}
        weights = frequent if len(frequent) >= 2 else weights
        total = sum(weights.values())
        mean_k = sum(w * k for k, w in weights.items()) / total
        mean_ms = sum(w * self._draft_calls[k] for k, w in weights.items()) / total
        spread = sum(w * (k - mean_k) ** 2 for k, w in weights.items())
        slope = sum(w * (k - mean_k) * (self._draft_calls[k] - mean_ms) for k, w in weights.items()) / spread
        return max(0.0, slope)

    def draft_curve(self) -> list[float]:
        """Cost of a draft call by k (index 0: no call): measured where seen, else the nearest measured
        k plus a draft step (``draft_step_ms``) for each token of difference.

        The step, not the per-token average: that average carries the call's fixed cost, so a k one
        longer than any measured looked a whole call's share dearer than it is, and was never tried.
        """
        out = [0.0]
        step = self.draft_step_ms()
        for k in range(1, self.k_max + 1):
            if k in self._draft_calls:
                out.append(self._draft_calls[k])
            elif self._draft_calls:
                near = min(self._draft_calls, key=lambda m: abs(m - k))
                out.append(max(self._draft_calls[near] + (k - near) * step, 0.0))
            else:
                out.append(self.draft_call_ms + k * self.draft_ms_per_token)
        return out

    def record_verify(self, ms: float, tokens: int, load: PassLoad | None = None) -> None:
        """Folds in one verify call over ``tokens`` tokens (draft tokens + 1) that took ``ms`` end to end."""
        if load is not None:
            # What the call took beyond waiting at the target and its pass is the round trip.
            trip = max(0.0, ms - load.queue_ms - load.pass_ms)
            self.overhead_ms += self.smoothing * (trip - self.overhead_ms)
            if load.fed_rows > tokens:
                return  # the pass also fed this session's prompt: a prefill's cost, not a round's
        if tokens >= len(self.verify_ms):
            return
        if not self._seen[tokens]:
            self.verify_ms[tokens], self._seen[tokens] = ms, True
        else:
            self.verify_ms[tokens] += self.smoothing * (ms - self.verify_ms[tokens])

    def curve(self) -> list[float]:
        """verify_ms by tokens verified, gaps filled by the growth assumption."""
        out = list(self.verify_ms)
        base = next((out[n] for n in range(1, len(out)) if self._seen[n]), self.step_ms)
        for n in range(1, len(out)):
            if not self._seen[n]:
                previous = out[n - 1] if n > 1 else base
                out[n] = previous + self.growth * base if n > 1 else base
        return out

    def choose(self, tracker: AcceptanceTracker, load: PassLoad | None = None) -> int:
        """The best k for a session with this acceptance history, on a target with this load.

        Without a load report (a target that does not batch) the verify costs are the ones measured
        here, call by call.
        """
        if not self.drafts_beside(load):
            return 0
        return self._best(tracker.rates(self.k_max), self.draft_curve(), load, self.k_max)

    def drafts_beside(self, load: PassLoad | None) -> bool:
        """Whether a session in a pass with this load may draft at all.

        Not in a shared pass when the draft computes on the cores the pass needs: a session that
        drafts falls out of step with the batch, so the others' next pass runs without it. Neither
        shows in the cost curve, and on shared cores even a draft priced at twice its cost lost to
        target-only.
        """
        return not (self.colocated and load is not None and load.curve_ms and load.sessions > 1)

    def choose_free(self, tracker: AcceptanceTracker, load: PassLoad | None, available: int) -> int:
        """The best k for a proposal that costs nothing to make and delays no one (prompt lookup in
        the coordinator, ``available`` tokens long): only the verify rows it adds count against it.

        On shared cores this is what speculation can still win under load: the rows are cheap beside
        a pass that reads every weight anyway, and no draft computes on the cores the pass needs.
        """
        return self._best(tracker.rates(available), [0.0] * (available + 1), load, available)

    def prefers_free(
        self, free: AcceptanceTracker, free_k: int, drafted: AcceptanceTracker, k: int, load: PassLoad | None
    ) -> bool:
        """Whether a free proposal of ``free_k`` tokens (prompt lookup in the coordinator) promises at
        least as many tokens per millisecond as a draft call for ``k``, at this load.

        A lookup hit in copied text (a summary quoting its passage, an edited function) is accepted
        far more often than the model draft, costs no draft call, and may run longer than the k the
        model draft is held to.
        """
        verify, others = self.pass_curve(load)

        def rate(tracker: AcceptanceTracker, n: int, draft_ms: float) -> float:
            n = min(n, len(verify) - 2)
            return (others + expected_tokens(tracker.rates(max(n, 1)), n)) / (draft_ms + verify[n + 1])

        return rate(free, free_k, 0.0) >= rate(drafted, k, self.draft_curve()[min(k, self.k_max)])

    def pass_curve(self, load: PassLoad | None) -> tuple[list[float], float]:
        """A round's cost by tokens verified (index 0 unused) and the tokens the same pass commits for
        the other sessions: the target's reported pass curve, or the costs measured here without one
        (a target that does not batch)."""
        if load is None or not load.curve_ms:
            return self.curve(), 0.0
        return [0.0] + [self.overhead_ms + ms for ms in load.curve_ms], load.others_committed

    def _best(self, rates: list[float], draft: list[float], load: PassLoad | None, k_max: int) -> int:
        """``choose_k`` over this load's pass curve (``pass_curve``)."""
        verify, others = self.pass_curve(load)
        # In a shared pass the estimates carry other sessions' noise, a late draft delays them all, and
        # near compute-bound a row costs about its share of the pass: speculation, a free lookup too,
        # must promise a clear gain (5%) before it is worth the risk.
        gain = 1.05 if load is not None and load.curve_ms and load.sessions > 1 else 1.0001
        return choose_k(rates, draft, verify, k_max, others, gain)

    def min_confidence(self) -> float:
        """The draft-confidence cut-off that pays (see ``draft_service.picking``).

        The draft call is made once the round drafts at all, so one more proposed token costs only a
        draft step and a verify row. It is worth that while the chance that it and every token before
        it are accepted, which the draft's confidence estimates, covers the cost in units of a
        token's cost without speculation:

            min_confidence = (draft_step_ms + mean verify row ms) / verify_ms(1)

        with the row's cost averaged over the k_max rows a proposal may add (a CPU pass's cost jumps
        at the second row and then barely grows). Pricing every token at a whole call's per-token
        average and the first row's jump would overstate the cut-off several times over and cut
        proposals after about one token. Where verify rows are nearly free (an accelerator) it falls
        towards the draft's own share.
        """
        curve = self.curve()
        row_ms = max(0.0, (curve[self.k_max + 1] - curve[1]) / self.k_max)
        return min(1.0, (self.draft_step_ms() + row_ms) / max(curve[1], 1e-6))

    def worth_probing(self, load: PassLoad | None) -> bool:
        """Whether an excellent draft (every token accepted 9 times in 10) would be used under this
        load: if not, trying the draft now would only cost the batch."""
        excellent = AcceptanceTracker(prior=0.9, prior_weight=1e6)
        return self.choose(excellent, load) > 0

    def choose_unloaded(self, tracker: AcceptanceTracker, load: PassLoad | None = None) -> int:
        """The k this session would get were it alone on the target: > 0 means its draft is worth it,
        so a k of 0 under load is the load's doing, not the draft's."""
        if load is None or not load.alone_ms:
            return self.choose(tracker)
        return self.choose(tracker, PassLoad(1, 1, 0, load.alone_ms[0], load.alone_ms, load.alone_ms))
