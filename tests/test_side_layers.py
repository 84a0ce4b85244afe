"""Side layers (the EAGLE-3 idea): the target's residual stream after chosen layers, sent beside its
final-norm hidden states to a feature draft. Every producer lays the rows out alike, the draft reads
them only where the target sent them, and bad requests are refused."""

from __future__ import annotations

import pytest
import torch

from coordinator.server import IncompatibleReplicas, check_same_side_layers
from draft_service.distill.feature_train import FeatureExample, _pad, feature_loss
from draft_service.distill.features import sample_features
from draft_service.feature_draft import FeatureDraftArch, build_feature_draft
from specdec.kvcache import SessionCache
from specdec.ragged import RaggedItem, ragged_forward
from specdec.side_layers import check_side_layers
from specdec.vocab import ModelFacts


def _layer_outputs(model, tokens: list[int]) -> list[torch.Tensor]:
    """transformers' own per-layer outputs ``[T, D]`` (hidden_states[j + 1] is layer j's output)."""
    with torch.inference_mode():
        out = model.get_decoder()(input_ids=torch.tensor([tokens]), output_hidden_states=True, use_cache=False)
    return [h[0] for h in out.hidden_states[1:-1]]


@pytest.mark.parametrize("which", ["tiny", "default"])
def test_every_producer_sends_final_hidden_then_the_side_layers_outputs(which, tiny_target, default_model):
    """The target's ragged pass, its plain forward, its prefill and the distillation's feature
    extraction all give rows [final-norm hidden; output of each side layer], in the order asked."""
    model = (tiny_target if which == "tiny" else default_model).model
    layers = model.config.num_hidden_layers
    sides = (layers - 2, 0)  # out of order on purpose: the rows follow the order asked
    dim = model.config.hidden_size
    tokens = torch.randint(2, model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    per_layer = _layer_outputs(model, tokens)
    plain_final = sample_features(model, [tokens])[0].float()  # [T, D], no side layers

    extracted = sample_features(model, [tokens], sides)[0].float()  # [T, 3D]
    assert extracted.shape == (len(tokens), 3 * dim)
    torch.testing.assert_close(extracted[:, :dim], plain_final)
    for i, j in enumerate(sides):
        torch.testing.assert_close(extracted[:, dim * (i + 1) : dim * (i + 2)], per_layer[j].half().float())

    prefilled = SessionCache(committed=tokens[:8])
    rows = prefilled.prefill(model, True, sides).rows  # positions 0..6
    _, forward_rows = prefilled.forward_with_hidden(model, tokens[8:10], 3, sides)  # positions 7..9
    ragged_cache = SessionCache(committed=tokens[:8])
    ragged_cache.prefill(model)
    _, ragged_rows = ragged_forward(
        model, [RaggedItem(ragged_cache.kv, ragged_cache.pending() + tokens[8:10], 3, sides)]
    )
    served = torch.cat([rows, forward_rows.rows]).float()  # [10, 3D]
    torch.testing.assert_close(served, extracted[:10], atol=2e-2, rtol=1e-2)  # fp16 storage on one side
    torch.testing.assert_close(ragged_rows[0].float(), forward_rows.rows.float(), atol=1e-4, rtol=1e-4)


def test_side_layers_that_are_no_layer_of_the_target_are_refused():
    assert check_side_layers([3, 0], 30) == (3, 0)
    for bad in ([30], [-1], [2, 2], [0, 1, 2, 3, 4]):
        with pytest.raises(ValueError, match="hidden_side_layers"):
            check_side_layers(bad, 30)


def test_the_draft_reads_side_layers_where_the_target_sent_them_and_zeros_after(tiny_target):
    """Training reaches the side block of ``fc`` through the target's rows, and a step that reads the
    draft's own predicted feature (no side layers) predicts as if the side outputs were zero."""
    model = tiny_target.model
    dim = model.config.hidden_size
    torch.manual_seed(0)
    draft = build_feature_draft(model, torch.arange(4, 30), FeatureDraftArch(head_size=26, side_layers=(0,)))
    tokens = torch.randint(4, 30, (10,)).tolist()
    feats = sample_features(model, [tokens], (0,))[0]  # [T, 2D]
    labels = torch.tensor(tokens[1:] + [4]) - 4  # any labels in head coordinates will do
    batch = _pad([FeatureExample(torch.tensor(tokens), feats, labels, torch.ones(len(tokens)))])
    loss, _, _ = feature_loss(draft, batch, noise=0.0)
    loss.backward()
    side_grad = draft.fc.weight.grad[:, 2 * dim :]
    assert side_grad.abs().sum() > 0  # the side outputs reach the loss

    with torch.no_grad():
        draft.fc.weight.normal_(0, 0.1)
        own = draft.predict(feats[None, :, :dim].float(), torch.tensor([tokens]))  # [1, T, D]: a predicted f
        zero_sides = torch.cat([feats[None, :, :dim].float(), torch.zeros(1, len(tokens), dim)], dim=-1)
        sent = draft.predict(feats[None].float(), torch.tensor([tokens]))  # the target's rows
        torch.testing.assert_close(own, draft.predict(zero_sides, torch.tensor([tokens])))
        assert not torch.allclose(own, sent)


def test_feature_drafts_reading_other_side_layers_are_refused():
    facts = ModelFacts("d", "feature", 49152, 2048, (2,), "f", side_layers=(2, 15))
    check_same_side_layers(facts, facts, "a:1")
    with pytest.raises(IncompatibleReplicas, match=r"reads target layers \[\]"):
        check_same_side_layers(facts, ModelFacts("d", "feature", 49152, 2048, (2,), "f"), "b:1")
