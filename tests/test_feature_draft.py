"""The feature-level draft: its session cache drafts exactly what a full recompute drafts, features
arriving round by round, rolled back, or with gaps; training lowers its loss; evaluation replays rounds."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from draft_service.distill.collect import Sample
from draft_service.distill.evaluate import evaluate_feature
from draft_service.distill.feature_train import feature_batcher, feature_loss, make_feature_examples, rollout_steps
from draft_service.distill.features import extract_features, sample_features
from draft_service.distill.train import TrainConfig, train
from draft_service.feature_draft import (
    FeatureDraftArch,
    FeatureSession,
    build_feature_draft,
    load_feature_draft,
    save_feature_draft,
    source_head_ids,
    warm_start,
)
from draft_service.token_draft import CARD_FILE, WEIGHTS_FILE, target_weights_hash
from specdec.config import shipped_draft
from specdec.kvcache import HiddenRows
from specdec.sampling import Sampling


@pytest.fixture(scope="module")
def draft(tiny_target):
    torch.manual_seed(0)
    # Head ids out of order, as a head lists them by frequency: picks read them in id order.
    ids = torch.arange(4, 28)[torch.randperm(24, generator=torch.Generator().manual_seed(1))]
    d = build_feature_draft(tiny_target.model, ids, FeatureDraftArch(head_size=24))
    with torch.no_grad():  # move off the pass-through start so every input matters
        for p in d.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    return d.eval()


def _greedy(logits):
    return int(logits[0].argmax()), None


@torch.no_grad()
def _reference(draft, committed: list[int], window: int, feats: torch.Tensor, k: int) -> list[int]:
    """What the draft proposes, computed from scratch: one pass over every pair, then k rollout steps."""
    seq_feats = feats[window : len(committed) - 1].unsqueeze(0)  # [1, m, D]
    toks = torch.tensor([committed[window + 1 :]])  # [1, m]
    positions = torch.arange(window, len(committed) - 1).unsqueeze(0)
    predicted = draft.predict(seq_feats, toks, position_ids=positions)[:, -1:]  # [1, 1, D]
    out = []
    all_feats, all_toks = seq_feats, toks
    for _ in range(k):
        token = int(draft.full_logits(predicted[0])[0].argmax())
        out.append(token)
        all_feats = torch.cat([all_feats, predicted], dim=1)
        all_toks = torch.cat([all_toks, torch.tensor([[token]])], dim=1)
        pos = torch.arange(window, window + all_toks.shape[1]).unsqueeze(0)
        predicted = draft.predict(all_feats, all_toks, position_ids=pos)[:, -1:]
    return out


def test_session_matches_full_recompute(draft, tiny_target):
    r = random.Random(0)
    tokens = [r.randrange(4, 30) for _ in range(60)]
    feats = sample_features(tiny_target.model, [tokens])[0].float()  # [60, D]
    n = 12
    session = FeatureSession(committed=tokens[:n])
    session.add_features(0, feats[: n - 1])
    while n + 5 < len(tokens):
        proposal, _ = session.propose(draft, 4, _greedy)
        assert proposal == _reference(draft, tokens[:n], 0, feats, 4)
        assert session.propose(draft, 4, _greedy)[0] == proposal  # asked again (a retried round)
        accepted = r.randrange(0, 5)
        session.sync(n, tokens[n : n + accepted + 1])
        session.add_features(n - 1, feats[n - 1 : n + accepted])
        n += accepted + 1
    # A rollback: the caller crops to fewer committed tokens; features past them go too.
    n -= 7
    session.sync(n, [])
    assert session.ready()
    assert session.propose(draft, 3, _greedy)[0] == _reference(draft, tokens[:n], 0, feats, 3)


def test_features_grow_in_place_and_a_fork_keeps_its_own():
    """A round's features are written after the kept ones, without copying them; a rewrite after a
    rollback and a new window read what was sent; a fork's features are its own."""
    rows = torch.arange(160 * 3, dtype=torch.float32).reshape(160, 3)
    session = FeatureSession(committed=list(range(161)))
    session.add_features(0, rows[:30])
    start = session.features.data_ptr()
    session.add_features(30, rows[30:32])
    assert session.features.data_ptr() == start and torch.equal(session.features, rows[:32])
    fork = session.fork(list(range(161)))
    session.sync(20, [])  # a rollback: features past the committed tokens go
    session.sync(20, list(range(20, 161)))
    session.add_features(19, -rows[19:25])  # the target's rows for the new path
    assert torch.equal(session.features, torch.cat([rows[:19], -rows[19:25]]))
    assert torch.equal(fork.features, rows[:32])
    session.add_features(35, rows[35:38])  # past a gap: a new window
    assert session.window == 35 and torch.equal(session.features, rows[35:38])
    for end in range(38, 159):  # a row a round, through the store's growth
        session.add_features(end, rows[end : end + 1])
    assert torch.equal(session.features, rows[35:159])


def test_session_gap_starts_a_window(draft, tiny_target):
    r = random.Random(1)
    tokens = [r.randrange(4, 30) for _ in range(40)]
    feats = sample_features(tiny_target.model, [tokens])[0].float()
    session = FeatureSession(committed=tokens[:10])
    session.add_features(0, feats[:9])
    session.propose(draft, 2, _greedy)
    session.sync(10, tokens[10:20])  # a new turn the target has not fed: no features for 9..18
    assert not session.ready()
    session.add_features(15, feats[15:19])  # the target fed only some of it: a new window at 15
    assert session.ready() and session.window == 15
    assert session.propose(draft, 3, _greedy)[0] == _reference(draft, tokens[:20], 15, feats, 3)


def test_training_lowers_loss_and_evaluation_replays(tiny_target, tmp_path):
    torch.manual_seed(0)
    r = random.Random(2)
    head = torch.arange(4, 30)
    draft = build_feature_draft(tiny_target.model, head, FeatureDraftArch(head_size=len(head)))
    samples = []
    for _ in range(24):  # greedy continuations of the tiny target: its own trajectory
        prompt = [r.randrange(4, 30) for _ in range(6)]
        out = tiny_target.model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, min_new_tokens=16)[
            0
        ].tolist()
        with torch.no_grad():
            logits = tiny_target.model(torch.tensor([out])).logits[0]
        argmax = logits.argmax(-1).tolist()
        samples.append(Sample(out, 6, argmax[5:-1], 0.0, argmax[:5]))
    feats = [sample_features(tiny_target.model, [s.tokens])[0] for s in samples]
    examples = make_feature_examples(samples, feats, draft.vocab_to_head, 64, prompt_weight=1.0)
    batcher = feature_batcher(examples, 512)
    before = evaluate_feature(draft, samples[:6], feats[:6], k=3)
    with torch.no_grad():
        first = float(feature_loss(draft, batcher(random.Random(0))[0], noise=0)[0])
    config = TrainConfig(lr=3e-3, epochs=40, batch_tokens=512, warmup_steps=5)
    train(draft, batcher, feature_loss, config, tmp_path / "ckpt.pt", None, False)
    with torch.no_grad():
        last = float(feature_loss(draft, batcher(random.Random(0))[0], noise=0)[0])
    after = evaluate_feature(draft, samples[:6], feats[:6], k=3)
    assert last < 0.5 * first
    assert after["top1_agreement"] > before["top1_agreement"]
    assert after["top1_agreement"] > 0.6
    assert after["mean_accepted_length"] > before["mean_accepted_length"]
    assert after["rounds"] > 0 and len(after["acceptance_by_position"]) == 3


@torch.no_grad()
def test_training_rolls_out_as_the_service_drafts(draft, tiny_target):
    """The training's first step is ``predict`` over the pairs, and its rollout steps at every position
    are what a served session's second and third draft steps compute there once the target accepted
    the draft tokens before them (true features in the cache, the draft's own predicted features last)."""
    model = tiny_target.model
    tokens = torch.randint(4, 28, (14,), generator=torch.Generator().manual_seed(7)).tolist()
    feats = sample_features(model, [tokens])[0].float()  # [T, D]
    first, second, third = rollout_steps(draft, feats[None, :-1], torch.tensor([tokens[1:]]), steps=3)
    torch.testing.assert_close(first, draft.predict(feats[None, :-1], torch.tensor([tokens[1:]])))
    assert (first.shape[1], second.shape[1], third.shape[1]) == (13, 12, 11)
    for n in range(3, len(tokens) - 1):
        session = FeatureSession(committed=tokens[:n])
        session.add_features(0, feats[: n - 1])
        seen = []

        def pick(logits, n=n, seen=seen):  # the target's own tokens, as a round whose draft tokens passed
            seen.append(logits)
            return (tokens[n + len(seen) - 1] if len(seen) < 3 else 4), None

        session.propose(draft, 3, pick)
        torch.testing.assert_close(seen[1], draft.full_logits(second[0, n - 2 : n - 1]), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(seen[2], draft.full_logits(third[0, n - 2 : n - 1]), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(second, first[:, 1:], atol=1e-3)  # the rollout reads something else
    assert not torch.allclose(third, second[:, 1:], atol=1e-3)


def test_feature_shards_resume_when_more_samples_arrive(tiny_target, tmp_path):
    """A collection resumed with more data extends the last feature shard rather than misaligning it."""
    r = random.Random(5)
    samples = [Sample([r.randrange(4, 30) for _ in range(r.randint(4, 12))], 2, [], 0.0) for _ in range(7)]
    first = extract_features(tiny_target.model, samples[:5], tmp_path, shard_samples=3)  # shards of 3 and 2
    stamp = (tmp_path / "features-00000.pt").stat().st_mtime_ns
    grown = extract_features(tiny_target.model, samples, tmp_path, shard_samples=3)  # shards of 3, 3 and 1
    fresh = [sample_features(tiny_target.model, [s.tokens])[0] for s in samples]
    assert len(first) == 5 and len(grown) == 7
    assert (tmp_path / "features-00000.pt").stat().st_mtime_ns == stamp  # a full shard is reused
    for got, want, s in zip(grown, fresh, samples):
        assert got.shape == (len(s.tokens), want.shape[-1])
        torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2e-3)


def test_target_returns_hidden_states_of_committed_positions(tiny_target):
    from specdec.sampling import Sampling
    from target_service.engine import TargetEngine

    engine = TargetEngine(tiny_target, 4)
    prompt = [5, 9, 12, 7, 20]
    cache_id, committed, hidden = engine.prefill(prompt, with_hidden=True)
    assert hidden.start == 0 and len(hidden.rows) == len(prompt) - 1
    tokens = list(prompt)
    rows = [hidden.rows]
    for draft in ([3, 4], [], [8, 8, 8]):
        outcome = engine.verify(cache_id, committed, [], draft, [], Sampling(), 0, with_hidden=True)
        assert outcome.hidden.start == len(tokens) - 1
        tokens += outcome.tokens
        committed = outcome.committed
        assert outcome.hidden.start + len(outcome.hidden.rows) == len(tokens) - 1
        rows.append(outcome.hidden.rows)
    expected = sample_features(tiny_target.model, [tokens])[0].float()[:-1]  # [T - 1, D]
    assert torch.allclose(torch.cat(rows), expected, atol=2e-2)  # fp16 storage on one side


def test_hidden_backlog_joins_overlaps_and_restarts_after_gaps():
    from coordinator.hidden_backlog import HiddenBacklog
    from coordinator.replicas import HiddenChunk

    def h(start, rows):
        return HiddenChunk(start, 1, bytes(range(start * 2, (start + rows) * 2)))

    def merged(*parts, max_rows=2048):
        backlog = HiddenBacklog(max_rows=max_rows)
        for part in parts:
            backlog.add(part)
        return backlog.message()

    assert merged(None) is None and merged(h(0, 0)) is None
    assert merged(None, h(0, 3)) == h(0, 3)
    assert merged(h(0, 3), None) == h(0, 3)
    assert merged(h(0, 3), h(3, 2)) == h(0, 5)  # contiguous
    assert merged(h(0, 3), h(2, 2)) == h(0, 4)  # overlapping: newer rows win
    assert merged(h(0, 3), h(5, 1)) == h(5, 1)  # a gap keeps only the newer rows
    assert merged(h(0, 3), h(3, 2), max_rows=4) == h(1, 4)  # the oldest rows go past the cap
    # Round by round, as a session running target-only gathers them: a cut and a drop may each
    # cross several of the chunks the rows arrived in.
    assert merged(h(0, 2), h(2, 1), h(3, 1), h(4, 1), h(1, 2)) == h(0, 3)
    assert merged(h(0, 2), h(2, 1), h(3, 1), h(4, 1), max_rows=2) == h(3, 2)
    assert merged(h(0, 2), h(2, 1), h(3, 1), h(4, 3), max_rows=3) == h(4, 3)
    backlog = HiddenBacklog(h(0, 2))
    backlog.add(h(2, 1))
    assert len(backlog) == 3 and backlog.message() == h(0, 3)
    backlog.clear()
    assert len(backlog) == 0 and backlog.message() is None
    backlog.add(h(7, 1))  # after the draft took them, the next round's rows start a new backlog
    assert backlog.message() == h(7, 1)


SHIPPED = shipped_draft("smollm2-135m-feature")
MAX_BYTES = 25 * 1024 * 1024


def test_shipped_feature_draft_artifact():
    size = sum(f.stat().st_size for f in SHIPPED.rglob("*") if f.is_file())
    assert size < MAX_BYTES
    card = json.loads((SHIPPED / CARD_FILE).read_text())
    assert card["kind"] == "feature"
    assert "--kind feature" in card["recipe"]["command"] and card["recipe"]["seed"] == 0
    assert card["recipe"]["data"]["train_generated_tokens"] > 100_000
    held = card["metrics"]["held_out"]
    assert held["k"] == 4 and len(held["acceptance_by_position"]) == 4
    with safe_open(str(SHIPPED / WEIGHTS_FILE), "pt") as f:
        for name in f.keys():
            assert 49152 not in f.get_slice(name).get_shape(), f"{name} looks like target vocabulary weights"


def test_shipped_feature_draft_agrees_with_the_real_target(default_model):
    """Teacher-forced and in replayed rounds, on text the target writes itself; an untrained draft of
    this shape agrees on well under 5% of tokens."""
    draft = load_feature_draft(SHIPPED, default_model.model, target_weights_hash(default_model.model))
    prompts = [
        'def is_even(n):\n    """Return True when n is even."""\n',
        "<|im_start|>user\nName three colours of the rainbow.<|im_end|>\n<|im_start|>assistant\n",
    ]
    references = []
    for text in prompts:
        ids = default_model.tokenizer.encode(text, add_special_tokens=False)
        with torch.inference_mode():
            out = default_model.model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False)[0].tolist()
        references.append(Sample(out, len(ids), [], 0.0))
    feats = [sample_features(default_model.model, [s.tokens], draft.arch.side_layers)[0] for s in references]
    metrics = evaluate_feature(draft, references, feats, k=4)
    assert metrics["top1_agreement"] > 0.3, metrics
    assert metrics["mean_accepted_length"] > 1.3, metrics


def test_int8_head_keeps_the_contract(draft, tiny_target):
    import copy

    quantized = copy.deepcopy(draft).quantize_head_int8()
    r = random.Random(4)
    tokens = [r.randrange(4, 30) for _ in range(20)]
    feats = sample_features(tiny_target.model, [tokens])[0].float()
    with torch.no_grad():
        predicted = draft.predict(feats[None, :-1], torch.tensor([tokens[1:]]))[0]  # [T-1, D]
        a, b = draft.full_logits(predicted), quantized.full_logits(predicted)  # [T-1, V]
    assert torch.equal(torch.isinf(a), torch.isinf(b))  # q stays zero outside the head
    assert (a[torch.isfinite(a)] - b[torch.isfinite(b)]).abs().max() < 0.25


def test_a_draft_packed_for_the_cpu_predicts_what_the_plain_one_does(draft, tiny_target):
    """pack_for_cpu swaps the layer's, fc's and the head's kernels, not what they compute (to rounding)."""
    import copy

    from specdec.packed_linear import ProjectionSlice

    packed = copy.deepcopy(draft).pack_for_cpu()
    assert isinstance(packed.layer.self_attn.q_proj, ProjectionSlice) and packed._head_kernel is not None
    r = random.Random(5)
    tokens = [r.randrange(4, 30) for _ in range(20)]
    feats = sample_features(tiny_target.model, [tokens])[0].float()
    with torch.no_grad():
        a = draft.full_logits(draft.predict(feats[None, :-1], torch.tensor([tokens[1:]]))[0])  # [T-1, V]
        b = packed.full_logits(packed.predict(feats[None, :-1], torch.tensor([tokens[1:]]))[0])
    assert torch.equal(torch.isinf(a), torch.isinf(b))  # q stays zero outside the head
    torch.testing.assert_close(a[torch.isfinite(a)], b[torch.isfinite(b)], atol=1e-4, rtol=1e-4)


def test_prompt_lookup_goes_first_when_it_finds_a_whole_continuation(draft, tiny_target):
    from draft_service.engine import FeatureDrafter
    from specdec.sampling import Sampling

    context = [5, 6, 7, 8, 9, 10, 11, 5, 6]  # "5 6" occurred before, followed by 7 8 9 10
    with_lookup = FeatureDrafter(draft, tiny_target.facts("target"), 4, 64)
    without = FeatureDrafter(draft, tiny_target.facts("target"), 4, 64, lookup_min=0)
    for engine in (with_lookup, without):
        cache_id, committed = engine.prefill(context)
        proposal = engine.propose(cache_id, committed, [], 3, Sampling(), 0)
        # no hidden states were sent: the model cannot draft
        assert proposal.tokens == ([7, 8, 9] if engine is with_lookup else [])
        assert proposal.looked_up == (engine is with_lookup)  # its cost is no model draft's
    lookup_id, _ = with_lookup.prefill(context)
    sampled = with_lookup.propose(lookup_id, committed, [], 3, Sampling(1.0, seed=1), 0)
    assert sampled.tokens == [7, 8, 9] and sampled.q == [([7], [1.0]), ([8], [1.0]), ([9], [1.0])]
    assert sampled.looked_up
    feats = sample_features(tiny_target.model, [context])[0].float()
    drafted = without.propose(without.prefill(context)[0], committed, [], 3, Sampling(), 0, HiddenRows(0, feats[:-1]))
    assert len(drafted.tokens) == 3 and not drafted.looked_up


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(1.0, seed=5)], ids=["greedy", "sampled"])
def test_proposals_drafted_together_equal_proposals_drafted_alone(draft, tiny_target, sampling):
    """Sessions of different lengths, windows, k and confidence cut-offs, over several rounds with
    partial acceptance: one batched call per round proposes what each session proposes on its own
    (tokens and q), drafted by ``FeatureSession.propose`` through transformers' own layer call."""
    from draft_service.engine import FeatureDrafter, ProposeCall

    class OneAtATime(FeatureDrafter):
        def _draft_many(self, jobs):
            return [(*cache.propose(self._draft_model, k, pick), False) for cache, k, pick in jobs]

    r = random.Random(3)
    facts = tiny_target.facts("target")
    together = FeatureDrafter(draft, facts, 16, 64, lookup_min=0)
    alone = OneAtATime(draft, facts, 16, 64, lookup_min=0)
    streams = [[r.randrange(4, 30) for _ in range(40)] for _ in range(4)]
    feats = [sample_features(tiny_target.model, [s])[0].float() for s in streams]
    lengths = [6, 11, 9, 17]
    ids = [(together.prefill(s[:n])[0], alone.prefill(s[:n])[0]) for s, n in zip(streams, lengths)]
    sent = [0, 0, 5, 0]  # the third session gets features from position 5 on: a window not at 0
    cutoffs = [0.0, 0.02, 0.008, 0.0]
    lengths_seen = set()
    for round_index in range(5):
        calls = []
        for s, stream in enumerate(streams):
            # The coordinator committed a few more tokens (a partially accepted round) since last time.
            grown = min(len(stream) - 1, lengths[s] + (r.randrange(0, 4) if round_index else 0))
            hidden = HiddenRows(sent[s], feats[s][sent[s] : grown - 1])
            k = [4, 1, 3, 2][(s + round_index) % 4]
            calls.append(
                (
                    s,
                    ProposeCall(
                        ids[s][0],
                        lengths[s],
                        stream[lengths[s] : grown],
                        k,
                        sampling,
                        round_index,
                        hidden,
                        min_confidence=cutoffs[s],
                    ),
                )
            )
            lengths[s], sent[s] = grown, grown - 1
        got = together.propose_batch([call for _, call in calls])
        for (s, call), proposal in zip(calls, got):
            want = alone.propose(
                ids[s][1], call.start, call.new_tokens, call.k, sampling, round_index, call.hidden, call.min_confidence
            )
            assert proposal.tokens == want.tokens
            assert len(proposal.tokens) == call.k or call.min_confidence > 0
            lengths_seen.add((call.min_confidence > 0, len(proposal.tokens) < call.k))
            assert [t for t, _ in proposal.q] == [t for t, _ in want.q]
            for (_, p), (_, w) in zip(proposal.q, want.q):
                assert p == pytest.approx(w, abs=1e-5)
    # The cut-off ended some proposals early, and left others their whole k.
    assert (True, True) in lengths_seen and (True, False) in lengths_seen


@pytest.mark.parametrize("cutoff", [0.0, 0.02], ids=["whole-k", "cut-off"])
def test_drafting_ahead_serves_the_guessed_path_and_only_it(draft, tiny_target, cutoff):
    """Drafting ahead continues the chain the proposal left off: once the proposal and the draft's
    guess of the target's token are committed, the next proposal is the one drafted ahead, exactly
    the tokens a longer greedy proposal would have held there. On any other committed path the next
    proposal is what a cache with the same history that drafted nothing ahead proposes."""
    from draft_service.engine import FeatureDrafter, ProposeCall

    engine = FeatureDrafter(draft, tiny_target.facts("target"), 16, 64, lookup_min=0)
    r = random.Random(7)
    prompt = [r.randrange(4, 30) for _ in range(14)]
    hidden = HiddenRows(0, sample_features(tiny_target.model, [prompt])[0].float()[:-1])

    def first_round(ahead: int) -> tuple[ProposeCall, list[int]]:
        call = ProposeCall(
            engine.prefill(prompt)[0], len(prompt), [], 3, Sampling(), 0, hidden, min_confidence=cutoff, ahead=ahead
        )
        return call, engine.propose_batch([call])[0].tokens

    def next_round(cache_id: str, committed_path: list[int], k: int):
        path = prompt + committed_path
        feats = sample_features(tiny_target.model, [path])[0].float()
        rows = HiddenRows(len(prompt) - 1, feats[len(prompt) - 1 : len(path) - 1])
        return engine.propose(cache_id, len(prompt), committed_path, k, Sampling(), 1, rows)

    # The reference: one proposal of 9 tokens with no cut-off and nothing drafted ahead.
    chain = engine.propose(engine.prefill(prompt)[0], len(prompt), [], 9, Sampling(), 0, hidden).tokens
    call, proposal = first_round(ahead=4)
    j = len(proposal)
    assert proposal == chain[:j] and (j == 3 or cutoff > 0)
    drafted = engine.draft_ahead(call)
    assert 0 < drafted <= 4
    served = next_round(call.cache_id, chain[: j + 1], 4)
    assert served.from_ahead and len(served.tokens) == drafted
    assert served.tokens == chain[j + 1 : j + 1 + drafted]

    # The target committed another token than the guess: the tokens ahead are dropped.
    other = next(t for t in range(4, 28) if t != chain[j])
    for path in (chain[:j] + [other], chain[: j + 1]):
        (missed, _), (control, _) = first_round(ahead=4), first_round(ahead=0)
        assert engine.draft_ahead(missed) == drafted and engine.draft_ahead(control) == 0
        if path[-1] == chain[j]:
            next_round(missed.cache_id, path, 4)  # served from ahead: the same path again is not
        got, want = next_round(missed.cache_id, path, 3), next_round(control.cache_id, path, 3)
        assert not got.from_ahead and got.tokens == want.tokens


def test_drafting_ahead_of_a_sampled_proposal_reports_its_q(draft, tiny_target):
    from draft_service.engine import FeatureDrafter, ProposeCall

    engine = FeatureDrafter(draft, tiny_target.facts("target"), 16, 64, lookup_min=0)
    prompt = [5, 9, 13, 4, 22, 7, 11, 19]
    hidden = HiddenRows(0, sample_features(tiny_target.model, [prompt])[0].float()[:-1])
    sampling = Sampling(1.0, seed=11)
    call = ProposeCall(engine.prefill(prompt)[0], len(prompt), [], 2, sampling, 0, hidden, ahead=3)
    proposal = engine.propose_batch([call])[0]
    assert engine.draft_ahead(call) == 3
    guess = engine.caches.get(call.cache_id).ahead.path[-1]
    path = prompt + proposal.tokens + [guess]
    feats = sample_features(tiny_target.model, [path])[0].float()
    served = engine.propose(
        call.cache_id,
        len(prompt),
        path[len(prompt) :],
        3,
        sampling,
        1,
        HiddenRows(len(prompt) - 1, feats[len(prompt) - 1 : -1]),
    )
    assert served.from_ahead and len(served.tokens) == len(served.q) == 3
    for token, (ids, probs) in zip(served.tokens, served.q):
        assert token in ids and sum(probs) == pytest.approx(1.0, abs=1e-4)


def test_held_out_rounds_with_lookup_replay_the_served_rule(draft, tiny_target):
    """``evaluate_feature(lookup_min=...)`` proposes a whole looked-up continuation before the model,
    as the draft service does: on text that repeats itself the rounds get longer; top-1 agreement,
    the model's own, does not move."""
    ids = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6]
    with torch.inference_mode():
        out = tiny_target.model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)[0].tolist()
    # A continuation that repeats the prompt's cycle, so lookup finds it (the tiny target's own may not).
    tokens = ids + [7, 8, 9, 10, 5, 6] * 6
    references = [Sample(out, len(ids), [], 0.0), Sample(tokens, len(ids), [], 0.0)]
    feats = [sample_features(tiny_target.model, [s.tokens])[0] for s in references]
    alone = evaluate_feature(draft, references, feats, k=4)
    served = evaluate_feature(draft, references, feats, k=4, lookup_min=2)
    assert served["top1_agreement"] == alone["top1_agreement"]
    assert served["mean_accepted_length"] > alone["mean_accepted_length"]
    assert served["mean_accepted_length"] > 2.5  # the repeating reference is drafted by lookup


def _saved_draft(folder: Path, draft, model) -> Path:
    save_feature_draft(draft, folder)
    card = {
        "kind": "feature",
        "target": {"name": "tiny", "weights_sha256": target_weights_hash(model)},
        "architecture": draft.arch.to_json(),
        "recipe": {"command": "specdec distill ...", "seed": 3},
    }
    (folder / CARD_FILE).write_text(json.dumps(card))
    return folder


def test_a_warm_start_proposes_what_its_source_proposes_and_reads_new_side_layers_from_zero(
    draft, tiny_target, tmp_path
):
    """A draft started from a distilled one (``specdec distill --init-draft``) predicts exactly what the
    source predicts, whatever its new side layers hold, until training moves it; wrong sources are refused."""
    model = tiny_target.model
    source = _saved_draft(tmp_path / "source", draft, model)
    grown = build_feature_draft(model, source_head_ids(source), FeatureDraftArch(head_size=24, side_layers=(0,)))
    identity = warm_start(grown, source, target_weights_hash(model))
    assert identity["seed"] == 3 and identity["side_layers"] == [] and len(identity["weights_sha256"]) == 64
    tokens = torch.randint(4, 28, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    feats = sample_features(model, [tokens], (0,))[0].float()  # [T, 2D]: f, then layer 0's output
    dim = model.config.hidden_size
    with torch.no_grad():
        expected = load_feature_draft(source, model).predict(feats[None, :, :dim], torch.tensor([tokens]))
        torch.testing.assert_close(grown.predict(feats[None], torch.tensor([tokens])), expected, atol=1e-3, rtol=1e-3)
        assert grown.fc.weight[:, 2 * dim :].abs().sum() == 0  # the side block starts unread, and trains

    bare = tmp_path / "bare"  # a hand-made card without a recipe still names its source
    _saved_draft(bare, draft, model)
    card = json.loads((bare / CARD_FILE).read_text())
    del card["recipe"]
    (bare / CARD_FILE).write_text(json.dumps(card))
    assert warm_start(grown, bare, target_weights_hash(model))["command"] is None
    with pytest.raises(ValueError, match="sha256"):
        warm_start(grown, source, "0" * 64)
    with pytest.raises(ValueError, match="another head"):
        warm_start(
            build_feature_draft(model, torch.arange(5, 29), FeatureDraftArch(head_size=24)),
            source,
            target_weights_hash(model),
        )
    sided = _saved_draft(tmp_path / "sided", grown, model)
    with pytest.raises(ValueError, match="must start with them"):
        warm_start(
            build_feature_draft(model, source_head_ids(source), FeatureDraftArch(head_size=24)),
            sided,
            target_weights_hash(model),
        )
