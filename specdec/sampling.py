"""The sampling math every service shares: logits → probabilities, and the verification rule.

Vocabulary (after Leviathan et al., arXiv 2211.17192, and Chen et al., arXiv 2302.01318):

- *accepted* tokens are the leading draft tokens the target keeps;
- the *recovered* token replaces the first rejected draft token: under greedy decoding it is the
  target's argmax, under sampling it is drawn from normalize(max(p - q, 0));
- the *bonus* token is drawn from the target's distribution after the last draft token when every
  draft token was accepted.

Each round therefore commits ``accepted + 1`` tokens. With p and q computed after the same
temperature / top-k / top-p, and q exactly the distribution the draft sampled from, the committed
tokens are distributed exactly as tokens sampled from the target alone.

*Penalties and logit bias* (``penalize_logits``) transform the logits before any of that, at every
position from the tokens before it: the committed ones and, for a draft position, the draft tokens
on the path to it. The target's p must be penalised this way, row by row, for the output to be the
penalised target's; the draft penalises its q the same way so that q stays close to p (the rule is
exact for any q that is truly what the draft drew from, but accepts less the further q strays).

*Coupled* sampling (``Sampling.coupled``, for seeded requests) trades some acceptance for output
that no draft can change: the token at sequence position j is the Gumbel-max draw
argmax_v(log p_j(v) + g_j(v)) with noise g_j keyed by (seed, j) alone. The draft draws its proposal
with the same noise from its own q, and the target accepts a draft token exactly when it equals its
own draw there (Daliri, Musco and Suresh, "Coupling without Communication and Drafter-Invariant
Speculative Decoding", arXiv 2408.07978). Each token is still an exact sample of p, and the committed
tokens depend only on (seed, committed prefix): not on k, the draft, a draft outage or which
coordinator ran the round, so a resumed stream replays exactly what its client saw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# The settings and the logprob record come with the math that reads and makes them.
from specdec.sampling_params import MAX_TOP_LOGPROBS, Sampling, TokenLogprob  # noqa: F401


def draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One index drawn from ``weights [V]`` (non-negative, some positive; need not sum to one; on the
    CPU, where every caller draws) with ``generator``: the first index whose cumulative weight exceeds
    a uniform draw scaled to the total.

    An index of zero weight adds nothing to the cumulative sum, so it is never drawn. Exact as
    ``torch.multinomial`` is, and about 13x cheaper for one draw from the default target's 49k-token
    vocabulary on 2 CPU cores (0.08 against 1.0 ms): multinomial races an exponential variate for
    every entry, and a sampled round draws once at the target and once per draft token.
    """
    cdf = torch.cumsum(weights.double(), dim=-1)  # [V]
    uniform = torch.rand(1, generator=generator, dtype=torch.float64).to(cdf.device)
    index = int(torch.searchsorted(cdf, uniform * cdf[-1], right=True))
    if index >= cdf.shape[-1]:
        # A uniform below one scaled by the total stays below it in float64; were it ever to reach it,
        # the draw is the last index with weight, never one past the end or one of zero weight.
        index = int(torch.nonzero(weights > 0)[-1])
    return index


def round_generator(seed: int, round_index: int, stream: int) -> torch.Generator:
    """A CPU generator for one (seed, round, stream) triple, independent of global RNG state.

    ``stream`` separates the draft's draws (1) from the target's (2) within a round.
    """
    mixed = (seed * 0x9E3779B97F4A7C15 + round_index * 0xBF58476D1CE4E5B9 + stream) % (2**63 - 1)
    return torch.Generator(device="cpu").manual_seed(mixed)


def position_generator(seed: int, position: int) -> torch.Generator:
    """The generator of coupled sampling's noise at one sequence position (see the module docstring)."""
    return round_generator(seed, position, COUPLED_STREAM)


# The stream of coupled sampling's per-position noise, apart from the per-round streams 1 and 2.
COUPLED_STREAM = 3


def coupled_token(probs: torch.Tensor, seed: int, position: int) -> int:
    """The Gumbel-max draw from ``probs [V]`` with the noise of (seed, position): an exact sample of
    ``probs``, and the same token for every distribution whose mass ranks the noise alike.

    argmax_v log p(v) + Gumbel(v) equals argmax_v p(v) / E(v) with E(v) = -log U(v) exponential.
    """
    uniform = torch.rand(probs.shape[-1], generator=position_generator(seed, position), dtype=torch.float64)  # [V]
    exponential = -torch.log1p(-uniform)  # [V], > 0 almost surely
    return int((probs.double() / exponential).argmax())


def verify_coupled(p: torch.Tensor, draft_tokens: list[int], seed: int, position: int) -> Verdict:
    """Coupled verification: each draft token is accepted while it equals the target's own coupled
    draw at its position; the first that differs is replaced by that draw (recovered), and when all
    pass the draw after the last is the bonus.

    ``p`` is the target's ``[k + 1, V]`` after warping; ``position`` is the sequence position of the
    first draft token. The tokens committed are the target's coupled draws whatever the draft proposed.
    """
    k = len(draft_tokens)
    for i in range(k + 1):
        token = coupled_token(p[i], seed, position + i)
        if i == k or draft_tokens[i] != token:
            return Verdict(i, [*draft_tokens[:i], token])
    raise AssertionError("unreachable: the loop returns at i == k")


def penalize_logits(
    logits: torch.Tensor, sampling: Sampling, committed: Sequence[int], paths: Sequence[Sequence[int]] | None = None
) -> torch.Tensor:
    """The logits ``[n, V]`` after the request's logit bias and penalties (unchanged when it has none).

    Row i scores the token after ``committed`` then ``paths[i]`` (the draft tokens before it; None:
    every row follows ``committed`` alone). In order, as vLLM applies them:

    1. ``logit_bias[t]`` is added to logits[t];
    2. the repetition penalty r divides a positive logit by r and multiplies a negative one by r, for
       every token seen in the prompt or the output (committed or on the path);
    3. logits[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0), count[t] being
       how often t occurs in the turn's output (committed from ``sampling.output_start`` on, then the
       path): OpenAI's definition.

    Greedy decoding takes the argmax of the result, sampling warps it (``warp_probs``).
    """
    if not sampling.penalized:
        return logits
    n, vocab = logits.shape
    device = logits.device
    out = logits.float().clone()  # [n, V]
    if sampling.logit_bias:
        ids = torch.tensor([t for t, _ in sampling.logit_bias], dtype=torch.long, device=device)  # [B]
        out[:, ids] += torch.tensor([b for _, b in sampling.logit_bias], dtype=torch.float32, device=device)
    paths = paths if paths is not None else [()] * n
    if len(paths) != n:
        raise ValueError(f"penalize_logits: {len(paths)} paths for {n} rows")
    output = torch.tensor(list(committed[sampling.output_start :]), dtype=torch.long)  # [T]
    counts = torch.bincount(output, minlength=vocab)[:vocab].float().expand(n, vocab).clone()  # [n, V]
    rows = [i for i, path in enumerate(paths) for _ in path]
    if rows:
        cols = torch.tensor([t for path in paths for t in path], dtype=torch.long)
        counts.index_put_((torch.tensor(rows, dtype=torch.long), cols), torch.ones(len(rows)), accumulate=True)
    counts = counts.to(device)
    if sampling.repetition_penalty != 1.0:
        prompt = torch.tensor(list(committed[: sampling.output_start]), dtype=torch.long)  # [P]
        seen = (counts > 0) | (torch.bincount(prompt, minlength=vocab)[:vocab] > 0).to(device)  # [n, V]
        r = sampling.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
    return out - sampling.frequency_penalty * counts - sampling.presence_penalty * (counts > 0).float()


def chain_paths(draft_tokens: Sequence[int]) -> list[list[int]]:
    """The draft tokens before each of a chain's ``k + 1`` verified rows (row i follows the first i)."""
    return [list(draft_tokens[:i]) for i in range(len(draft_tokens) + 1)]


def warp_probs(logits: torch.Tensor, sampling: Sampling, extra_top_k: int = 0) -> torch.Tensor:
    """Turns logits ``[n, V]`` into the probabilities ``[n, V]`` a sampled request draws from.

    Applies temperature, then top-k, then top-p, then renormalizes. ``extra_top_k`` lets a drafter
    narrow its own support further (a sparse q is cheap to send and still exact).
    """
    logits = logits.float() / sampling.temperature  # [n, V]
    top_k = sampling.top_k
    if extra_top_k > 0:
        top_k = extra_top_k if top_k <= 0 else min(top_k, extra_top_k)
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [n, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # [n, V]
    if sampling.top_p < 1.0:
        # Stable: ties rank in index order, so a row restricted to some of its entries (a draft's
        # head, in increasing id order) keeps the same tokens at the cut-off as the whole row.
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # [n, V]
        # Drop a token when the mass strictly before it already reaches top_p; the first always stays.
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= sampling.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one round: ``tokens`` is the accepted prefix plus one target token."""

    accepted: int
    tokens: list[int]


def ranked_top(values: torch.Tensor, width: int) -> torch.Tensor:
    """Indices ``[..., width]`` of the ``width`` largest ``values [..., V]``, largest first, ties in
    index order: the greedy verifier's ``argmax`` takes the lowest index of a tie, so a draft that ranks
    its children this way proposes the target's choice first whenever the two compute the same numbers
    (bf16 logits tie often). ``torch.topk`` leaves the order of ties unspecified."""
    width = min(width, values.shape[-1])
    rows = values.reshape(-1, values.shape[-1])  # [R, V]
    kth = torch.topk(rows, width, dim=-1).values[:, -1]  # [R]
    picked = []
    for row, floor in zip(rows, kth):
        # Every value at or above the width-th (ties included), ranked stably: in index order within a tie.
        candidates = (row >= floor).nonzero().squeeze(-1)  # [C], ascending
        order = torch.sort(row[candidates], descending=True, stable=True).indices[:width]
        picked.append(candidates[order])
    return torch.stack(picked).reshape(*values.shape[:-1], width)


def verify_greedy(target_logits: torch.Tensor, draft_tokens: list[int]) -> Verdict:
    """Greedy verification: accept while each draft token equals the target's argmax.

    ``target_logits`` is ``[k + 1, V]``: row i scores the token after draft position i (row 0 the
    token after the last committed one).
    """
    target_tokens = target_logits.argmax(dim=-1).tolist()  # [k + 1]
    accepted = 0
    for draft, target in zip(draft_tokens, target_tokens):
        if draft != target:
            break
        accepted += 1
    return Verdict(accepted, target_tokens[: accepted + 1])


def verify_sampled(p: torch.Tensor, q: torch.Tensor, draft_tokens: list[int], generator: torch.Generator) -> Verdict:
    """Speculative sampling: accept draft token x with probability min(1, p(x) / q(x)).

    ``p`` is the target's ``[k + 1, V]`` and ``q`` the draft's ``[k, V]``, both after the same
    warping; ``q[i]`` must be exactly what the draft drew ``draft_tokens[i]`` from. On the first
    rejection the recovered token is drawn from normalize(max(p - q, 0)); when all k pass, the bonus
    token is drawn from ``p[k]``.
    """
    k = len(draft_tokens)
    uniforms = torch.rand(k, generator=generator, dtype=torch.float64)  # [k]
    for i, token in enumerate(draft_tokens):
        p_x = float(p[i, token])
        q_x = float(q[i, token])
        if q_x > 0 and uniforms[i].item() * q_x <= p_x:
            continue
        residual = torch.clamp(p[i] - q[i], min=0.0)  # [V]
        if float(residual.sum()) <= 0.0:
            # p <= q everywhere means p == q, where a rejection has probability zero; p is exact.
            residual = p[i]
        return Verdict(i, [*draft_tokens[:i], draw(residual, generator)])
    return Verdict(k, [*draft_tokens, draw(p[k], generator)])


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """Each token's log probability under the raw model distribution of its row of ``logits [n, V]``
    (the target's own, before penalties, bias, temperature, top-k and top-p, as vLLM reports by
    default) and the ``top`` likeliest tokens there. They are ranked on the logits themselves, as
    ``verify_greedy``'s argmax picks (a log-softmax can round two logits to one value), so without
    penalties or a bias the first alternative is the greedy token."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
    chosen = logp.gather(-1, torch.tensor(list(tokens), dtype=torch.long, device=logp.device)[:, None])[:, 0]  # [n]
    out = []
    best = ranked_top(logits.float(), top).cpu() if top > 0 else None  # [n, top]
    for i, token in enumerate(tokens):
        alternatives: tuple[tuple[int, float], ...] = ()
        if best is not None:
            ids = best[i].tolist()
            alternatives = tuple(zip(ids, logp[i, best[i].to(logp.device)].tolist()))
        out.append(TokenLogprob(int(token), float(chosen[i]), alternatives))
    return out


def sparse_to_dense(token_ids: list[int], probs: list[float], vocab_size: int) -> torch.Tensor:
    """Rebuilds a dense ``[V]`` distribution from its sparse wire form."""
    dense = torch.zeros(vocab_size, dtype=torch.float32)
    if token_ids:
        dense[torch.tensor(token_ids, dtype=torch.long)] = torch.tensor(probs, dtype=torch.float32)
    return dense


def dense_to_sparse(dist: torch.Tensor) -> tuple[list[int], list[float]]:
    """The support of a ``[V]`` distribution and its probabilities, for the wire."""
    ids = torch.nonzero(dist > 0, as_tuple=False).flatten()  # [S]
    return ids.tolist(), dist[ids].tolist()
