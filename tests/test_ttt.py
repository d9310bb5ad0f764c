"""The TTT unroll must compute exactly what the inference-time draft computes with its KV cache."""

import pytest
import torch

from wingspan.config import DraftConfig
from wingspan.models.draft import Eagle3Draft, new_kv_caches
from wingspan.train.ttt import TTTBatch, simulated_acceptance_length, step_masks, ttt_forward, unroll


def tiny_config(layers: int, injection: str = "first", **overrides) -> DraftConfig:
    fields = dict(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        target_hidden_size=24, vocab_size=97, draft_vocab_size=97, aux_layer_ids=[1, 2, 3],
        num_hidden_layers=layers, embed_injection=injection,
    )
    fields.update(overrides)
    return DraftConfig(**fields)


def chain_logits(draft: Eagle3Draft, aux: torch.Tensor, ids: torch.Tensor, origin: int, steps: int) -> list[torch.Tensor]:
    """Inference: prefill positions 0..origin from target features, then feed the draft its own hidden state."""
    caches = new_kv_caches(draft)
    positions = torch.arange(origin + 1)[None]
    hidden = draft(draft.project_aux(aux[:, : origin + 1]), ids[:, 1 : origin + 2], positions, caches)[:, -1:]
    out = [draft.logits(hidden)[:, -1]]
    for j in range(1, steps):
        position = torch.tensor([[origin + j]])
        hidden = draft(hidden, ids[:, origin + j + 1 : origin + j + 2], position, caches)
        out.append(draft.logits(hidden)[:, -1])
    return out


@pytest.mark.parametrize("layers", [1, 2, 3])
@pytest.mark.parametrize("injection", ["first", "all"])
def test_training_logits_equal_inference_logits(layers, injection):
    torch.manual_seed(layers)
    draft = Eagle3Draft(tiny_config(layers, injection)).double()
    length, steps = 12, 4
    ids = torch.randint(0, 97, (1, length))
    aux = torch.randn(1, length, 72, dtype=torch.double)
    trained = [draft.logits(hidden).detach() for hidden in unroll(draft, aux, ids, steps)]
    for origin in range(length - steps - 1):
        inferred = chain_logits(draft, aux, ids, origin, steps)
        for j in range(steps):
            torch.testing.assert_close(trained[j][:, origin], inferred[j], rtol=1e-9, atol=1e-9)


def test_batched_unroll_matches_single_sequences():
    torch.manual_seed(0)
    draft = Eagle3Draft(tiny_config(2)).double()
    ids = torch.randint(0, 97, (3, 10))
    aux = torch.randn(3, 10, 72, dtype=torch.double)
    batched = [draft.logits(h) for h in unroll(draft, aux, ids, 3)]
    for b in range(3):
        single = [draft.logits(h) for h in unroll(draft, aux[b : b + 1], ids[b : b + 1], 3)]
        for j in range(3):
            torch.testing.assert_close(batched[j][b], single[j][0])


def test_step_masks_count_predicted_tokens():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0]])
    masks = step_masks(mask, 2)
    # step 0 at origin i predicts x_{i+2}: origins 0,1,2 predict tokens 2,3,4
    assert masks[0].tolist() == [[1, 1, 1, 0, 0, 0]]
    assert masks[1].tolist() == [[1, 1, 0, 0, 0, 0]]


def test_loss_is_soft_cross_entropy_against_restricted_target():
    torch.manual_seed(0)
    config = tiny_config(1, draft_vocab_size=40)
    draft = Eagle3Draft(config)
    draft.d2t.copy_(torch.arange(40) * 2 - torch.arange(40))  # draft id i -> target id 2i
    ids = torch.randint(0, 97, (2, 9))
    full = torch.randn(2, 9, 97)  # the target's logits over its whole vocab; the batch holds the draft vocab's
    batch = TTTBatch(ids, torch.ones(2, 9), torch.randn(2, 9, 72), full[..., ::2][..., :40], full.max(dim=-1).indices)
    result = ttt_forward(draft, batch, steps=1, step_weights=[1.0])
    logits = draft.logits(next(unroll(draft, batch.aux_hidden, ids, 1)))
    target = torch.softmax(full[:, 1:8, ::2][..., :40], dim=-1)
    expected = -(target * torch.log_softmax(logits[:, :7], dim=-1)).sum(-1).mean()
    torch.testing.assert_close(result.loss, expected, rtol=1e-5, atol=1e-5)
    assert result.count.tolist() == [14.0]


def test_simulated_acceptance_length():
    assert simulated_acceptance_length([1.0, 1.0, 1.0], 3) == 4.0
    assert simulated_acceptance_length([0.5, 0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert simulated_acceptance_length([0.0, 1.0], 2) == 1.0
