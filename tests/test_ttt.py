"""The TTT unroll must compute exactly what the inference-time draft computes with its KV cache, and a
packed row exactly what its conversations compute alone."""

import pytest
import torch
from conftest import tiny_draft_config

from wingspan.config import DraftConfig
from wingspan.data.batching import collate
from wingspan.data.template import TokenizedConversation
from wingspan.decode.lookup import lookup_drafts
from wingspan.models.draft import Eagle3Draft, new_kv_caches
from wingspan.train.ttt import (
    ACCEPTANCE_FLOOR,
    TTTBatch,
    repeated_bigrams,
    simulated_acceptance_length,
    step_masks,
    step_weights_of,
    ttt_forward,
    unroll,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_config(layers: int, injection: str = "first", **overrides) -> DraftConfig:
    fields = dict(
        target_hidden_size=24, vocab_size=97, draft_vocab_size=97, num_hidden_layers=layers, embed_injection=injection
    )
    return tiny_draft_config(**{**fields, **overrides})


def arange_positions(ids: torch.Tensor) -> torch.Tensor:
    """Positions of rows that are one conversation each."""
    return torch.arange(ids.shape[1]).expand_as(ids)


def chain_logits(
    draft: Eagle3Draft, aux: torch.Tensor, ids: torch.Tensor, origin: int, steps: int
) -> list[torch.Tensor]:
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


def assert_unroll_is_inference(draft: Eagle3Draft, inference, vocab: int, length: int = 12, steps: int = 4):
    """The unroll's step-j logits at every origin equal `inference(draft, aux, ids, origin, steps)[j]` (fp64) on
    random features and tokens below `vocab`; returns (aux, ids, the unroll's logits per step)."""
    ids = torch.randint(0, vocab, (1, length))
    aux = torch.randn(1, length, 72, dtype=torch.double)
    trained = [draft.logits(hidden).detach() for hidden in unroll(draft, aux, ids, arange_positions(ids), steps)]
    for origin in range(length - steps - 1):
        inferred = inference(draft, aux, ids, origin, steps)
        for j in range(steps):
            torch.testing.assert_close(trained[j][:, origin], inferred[j], rtol=1e-9, atol=1e-9)
    return aux, ids, trained


@pytest.mark.parametrize("layers", [1, 2, 3])
@pytest.mark.parametrize("injection", ["first", "all"])
def test_training_logits_equal_inference_logits(layers, injection):
    torch.manual_seed(layers)
    assert_unroll_is_inference(Eagle3Draft(tiny_config(layers, injection)).double(), chain_logits, vocab=97)


def parallel_logits(
    draft: Eagle3Draft, aux: torch.Tensor, ids: torch.Tensor, origin: int, tokens: int
) -> list[torch.Tensor]:
    """Inference of a parallel draft (vLLM's parallel drafting): prefill positions 0..origin from target
    features, then one forward of tokens - 1 mask slots at origin + 1.., causal among themselves."""
    caches = new_kv_caches(draft)
    positions = torch.arange(origin + 1)[None]
    hidden = draft(draft.project_aux(aux[:, : origin + 1]), ids[:, 1 : origin + 2], positions, caches)[:, -1:]
    slot_hidden, slot_ids = draft.mask_slots(1, tokens - 1)
    slots = draft(slot_hidden, slot_ids, torch.arange(origin + 1, origin + tokens)[None], caches)
    return [draft.logits(h) for h in torch.cat([hidden, slots], dim=1).unbind(1)]


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_parallel_training_logits_equal_inference_logits(layers):
    torch.manual_seed(layers)
    draft = Eagle3Draft(tiny_config(layers, draft_mode="parallel", mask_token_id=96)).double()
    tokens = 4
    aux, ids, trained = assert_unroll_is_inference(draft, parallel_logits, vocab=96, steps=tokens)
    # The slots read the mask, not the tokens after the origin nor the draft's own outputs: a chain's step
    # would differ.
    chain = Eagle3Draft(tiny_config(layers)).double()
    chain.load_state_dict({k: v for k, v in draft.state_dict().items() if k != "mask_hidden"})
    chained = [chain.logits(h).detach() for h in unroll(chain, aux, ids, arange_positions(ids), tokens)]
    torch.testing.assert_close(chained[0], trained[0])
    assert not torch.allclose(chained[1], trained[1])


def test_parallel_unroll_trains_the_mask_hidden_state():
    torch.manual_seed(0)
    draft = Eagle3Draft(tiny_config(2, draft_mode="parallel", mask_token_id=5, draft_vocab_size=SMALL_VOCAB)).double()
    data = conversations(torch.Generator().manual_seed(0))
    result = ttt_forward(draft, ttt_batch(data, ROWS), 3, [1.0, 0.8, 0.64])
    result.loss.backward()
    assert draft.mask_hidden.grad is not None and draft.mask_hidden.grad.abs().sum() > 0
    # Only the slots read it: a one-step unroll (step 0 alone) leaves it untouched.
    draft.zero_grad()
    ttt_forward(draft, ttt_batch(data, ROWS), 1, [1.0]).loss.backward()
    assert draft.mask_hidden.grad is None or not draft.mask_hidden.grad.any()


def test_batched_unroll_matches_single_sequences():
    torch.manual_seed(0)
    draft = Eagle3Draft(tiny_config(2)).double()
    ids = torch.randint(0, 97, (3, 10))
    aux = torch.randn(3, 10, 72, dtype=torch.double)
    batched = [draft.logits(h) for h in unroll(draft, aux, ids, arange_positions(ids), 3)]
    for b in range(3):
        single = [draft.logits(h) for h in unroll(draft, aux[b : b + 1], ids[b : b + 1], arange_positions(ids[:1]), 3)]
        for j in range(3):
            torch.testing.assert_close(batched[j][b], single[j][0])


def test_step_masks_count_predicted_tokens():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0]])
    masks = step_masks(mask, arange_positions(mask), 2)
    # step 0 at origin i predicts x_{i+2}: origins 0,1,2 predict tokens 2,3,4
    assert masks[0].tolist() == [[1, 1, 1, 0, 0, 0]]
    assert masks[1].tolist() == [[1, 1, 0, 0, 0, 0]]


def test_step_masks_never_predict_across_conversations():
    mask = torch.ones(1, 7, dtype=torch.long)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])  # two conversations in one row
    masks = step_masks(mask, positions, 2)
    assert masks[0].tolist() == [[1, 0, 0, 1, 1, 0, 0]]  # origin 1 would predict token 3, the next one's first
    assert masks[1].tolist() == [[0, 0, 0, 1, 0, 0, 0]]


LENGTHS = [5, 9, 7, 4, 6, 3, 5]  # conversation k has LENGTHS[k] tokens; 3 is shorter than the unroll
ROWS = [[0, 1, 2], [3, 4, 5, 6]]  # 21 and 18 tokens: the second row ends in padding
SMALL_VOCAB = 4  # a draft vocab this small makes the random draft hit the target's argmax often


def conversations(generator: torch.Generator) -> list[tuple[TokenizedConversation, torch.Tensor, torch.Tensor]]:
    """(record, aux features [n, 72], target logits [n, SMALL_VOCAB]) per conversation; the first two tokens
    are the prompt (outside the loss mask)."""
    out = []
    for n in LENGTHS:
        ids = torch.randint(0, 97, (n,), generator=generator).tolist()
        record = TokenizedConversation(ids, [0, 0] + [1] * (n - 2))
        aux = torch.randn(n, 72, generator=generator, dtype=torch.double)
        out.append((record, aux, torch.randn(n, SMALL_VOCAB, generator=generator, dtype=torch.double)))
    return out


def ttt_batch(data, rows: list[list[int]]) -> TTTBatch:
    """The micro-batch of `rows`, laid out by the trainer's collate, with the features laid out alike."""
    micro = collate([record for record, _, _ in data], rows, pad_id=0)
    aux = torch.zeros(*micro.input_ids.shape, 72, dtype=torch.double)
    logits = torch.zeros(*micro.input_ids.shape, SMALL_VOCAB, dtype=torch.double)
    for r, row in enumerate(rows):
        at = 0
        for index in row:
            _, features, target = data[index]
            aux[r, at : at + len(features)], logits[r, at : at + len(features)] = features, target
            at += len(features)
    return TTTBatch(micro.input_ids, micro.loss_mask, micro.positions, aux, logits, logits.max(dim=-1).indices)


@pytest.mark.parametrize(
    "layers, injection, mode",
    [(1, "first", "chain"), (1, "all", "chain"), (2, "first", "chain"), (2, "all", "chain"), (2, "first", "parallel")],
)
def test_packed_rows_score_like_their_conversations_alone(layers, injection, mode):
    """Loss sums, hits, counts and gradients of packed rows equal the sums over the same conversations,
    each its own unpadded sequence. The draft runs in fp64; ttt_forward sums the loss in fp32 whatever the
    input, so loss sums agree to fp32 rounding (2e-7 relative measured, 1e-6 asserted), gradients to fp64
    rounding (6e-16 of the largest measured, 1e-10 asserted)."""
    torch.manual_seed(layers)
    parallel = {"draft_mode": "parallel", "mask_token_id": 3} if mode == "parallel" else {}
    draft = Eagle3Draft(tiny_config(layers, injection, draft_vocab_size=SMALL_VOCAB, **parallel)).double()
    data = conversations(torch.Generator().manual_seed(layers))
    steps, weights = 4, [0.8**j for j in range(4)]
    ones = torch.ones(steps, dtype=torch.double)  # one normaliser for all, so that the losses add up

    packed = ttt_forward(draft, ttt_batch(data, ROWS), steps, weights, ones)
    packed.loss.backward()
    packed_grads = {name: p.grad.clone() for name, p in draft.named_parameters() if p.grad is not None}
    draft.zero_grad()
    alone = [ttt_forward(draft, ttt_batch(data, [[k]]), steps, weights, ones) for k in range(len(LENGTHS))]
    sum(r.loss for r in alone).backward()

    assert packed.count.tolist() == sum(r.count for r in alone).tolist()
    assert packed.count[0] > packed.count[-1] > 0  # later steps count fewer positions, and some still
    assert packed.correct.tolist() == sum(r.correct for r in alone).tolist() and packed.correct.sum() > 0
    torch.testing.assert_close(packed.loss_sum, sum(r.loss_sum for r in alone), rtol=1e-6, atol=1e-9)
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, dict(draft.named_parameters())[name].grad, rtol=1e-10, atol=1e-12)


def test_loss_is_soft_cross_entropy_against_restricted_target():
    torch.manual_seed(0)
    config = tiny_config(1, draft_vocab_size=40)
    draft = Eagle3Draft(config)
    draft.d2t.copy_(torch.arange(40) * 2 - torch.arange(40))  # draft id i -> target id 2i
    ids = torch.randint(0, 97, (2, 9))
    full = torch.randn(2, 9, 97)  # the target's logits over its whole vocab; the batch holds the draft vocab's
    batch = TTTBatch(
        ids,
        torch.ones(2, 9),
        arange_positions(ids),
        torch.randn(2, 9, 72),
        full[..., ::2][..., :40],
        full.max(dim=-1).indices,
    )
    result = ttt_forward(draft, batch, steps=1, step_weights=[1.0])
    logits = draft.logits(next(unroll(draft, batch.aux_hidden, ids, batch.positions, 1)))
    target = torch.softmax(full[:, 1:8, ::2][..., :40], dim=-1)
    expected = -(target * torch.log_softmax(logits[:, :7], dim=-1)).sum(-1).mean()
    torch.testing.assert_close(result.loss, expected, rtol=1e-5, atol=1e-5)
    assert result.count.tolist() == [14.0]


def test_repeated_bigrams_are_where_lookup_proposes():
    """Position t is marked exactly where prompt lookup with bigrams (min = max = 2) over t's conversation up to
    t proposes a draft; conversations packed in a row do not see each other."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4, (3, 40), generator=generator)
    lengths = [[40], [7, 20, 13], [1, 2, 37]]
    positions = torch.tensor([[p for n in row for p in range(n)] for row in lengths])
    marked = repeated_bigrams(ids, positions)
    for r, row in enumerate(lengths):
        start = 0
        for n in row:
            tokens = ids[r, start : start + n].tolist()
            expected = [bool(lookup_drafts(tokens[: t + 1], 1, 2, 2)) for t in range(n)]
            assert marked[r, start : start + n].tolist() == expected, (r, n)
            start += n
    assert marked.sum() > 20 and not marked.all()


def seeded_draft_and_batch(distinct_tokens: int = 97) -> tuple[Eagle3Draft, TTTBatch]:
    """A 1-layer tiny draft and a 2 x 12 batch of random ids (from the first `distinct_tokens`), target logits and
    aux features, the same on every call."""
    torch.manual_seed(0)
    draft = Eagle3Draft(tiny_config(1))
    ids = torch.randint(0, distinct_tokens, (2, 12))
    logits = torch.randn(2, 12, 97)
    return draft, TTTBatch(
        ids, torch.ones(2, 12), arange_positions(ids), torch.randn(2, 12, 72), logits, logits.argmax(-1)
    )


def test_repeat_weight_weighs_the_positions_lookup_would_copy():
    draft, batch = seeded_draft_and_batch(distinct_tokens=3)  # three tokens: many repeated bigrams
    ids, logits = batch.input_ids, batch.target_logits
    plain = ttt_forward(draft, batch, steps=1, step_weights=[1.0])
    weighted = ttt_forward(draft, batch, steps=1, step_weights=[1.0], repeat_weight=4.0)
    hidden = next(unroll(draft, batch.aux_hidden, ids, batch.positions, 1))
    target = torch.softmax(logits[:, 1:11], dim=-1)
    cross_entropy = -(target * torch.log_softmax(draft.logits(hidden[:, :10]), dim=-1)).sum(-1)
    # origin i predicts x_{i+2} from a context that ends at x_{i+1}
    weights = 1 + 3 * repeated_bigrams(ids, batch.positions)[:, 1:11].float()
    assert 0 < (weights > 1).sum() < weights.numel()
    torch.testing.assert_close(weighted.loss, (weights * cross_entropy).sum() / weights.sum(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(plain.loss, cross_entropy.mean(), rtol=1e-5, atol=1e-5)
    assert weighted.loss_sum.tolist() == plain.loss_sum.tolist()  # the logged loss stays unweighted
    assert weighted.count.tolist() == plain.count.tolist() == [20.0]
    # later steps: step j at origin i predicts x_{i+j+2} from a context that ends at x_{i+j+1}
    repeated, steps = repeated_bigrams(ids, batch.positions), 3
    weights = step_weights_of(batch.loss_mask, batch.positions, ids, steps, 4.0)
    for j in range(steps):
        for b in range(2):
            for i in range(12):
                counted = i + j + 2 < 12
                expected = (4.0 if repeated[b, i + j + 1] else 1.0) if counted else 0.0
                assert weights[j, b, i] == expected, (j, b, i)


def test_the_lk_loss_is_minus_log_the_acceptance_rate():
    draft, batch = seeded_draft_and_batch()
    ids, logits = batch.input_ids, batch.target_logits
    lk = ttt_forward(draft, batch, steps=2, step_weights=[1.0, 0.5], objective="lk")
    kl = ttt_forward(draft, batch, steps=2, step_weights=[1.0, 0.5])
    expected = []
    for j, hidden in enumerate(unroll(draft, batch.aux_hidden, ids, batch.positions, 2)):
        # origin i at step j predicts x_{i+j+2}, the target's distribution at i + j + 1, inside the row
        q = torch.softmax(draft.logits(hidden[:, : 10 - j]), dim=-1)
        p = torch.softmax(logits[:, j + 1 : 11], dim=-1)
        acceptance = torch.minimum(p, q).sum(-1)  # speculative sampling accepts with probability sum min(p, q)
        assert ((0 < acceptance) & (acceptance < 1)).all()
        expected.append(-torch.log(acceptance + ACCEPTANCE_FLOOR).sum())
    torch.testing.assert_close(lk.loss_sum, torch.stack(expected).detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lk.loss, expected[0] / 20 + 0.5 * expected[1] / 18, rtol=1e-5, atol=1e-5)
    assert lk.correct.tolist() == kl.correct.tolist() and lk.count.tolist() == kl.count.tolist()
    lk.loss.backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in draft.parameters())

    # A draft certain of a token the target never says: a finite loss, and a gradient towards the target's.
    p, q = torch.tensor([[0.0, 1.0]]), torch.tensor([[0.0, -40.0]], requires_grad=True)
    loss = -torch.log(torch.minimum(p, torch.softmax(q, -1)).sum(-1) + ACCEPTANCE_FLOOR)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and q.grad[0, 1] < 0


def test_the_topk_term_adds_the_cross_entropy_over_the_targets_top_tokens():
    """HASS's top-K term: -sum over the target's K most likely tokens of p log q, weighted, on top of the loss."""
    draft, batch = seeded_draft_and_batch()
    ids, logits = batch.input_ids, batch.target_logits
    plain = ttt_forward(draft, batch, steps=2, step_weights=[1.0, 0.5])
    hass = ttt_forward(draft, batch, steps=2, step_weights=[1.0, 0.5], topk=(0.5, 3))
    expected = []
    for j, hidden in enumerate(unroll(draft, batch.aux_hidden, ids, batch.positions, 2)):
        logq = torch.log_softmax(draft.logits(hidden[:, : 10 - j]), dim=-1)
        p = torch.softmax(logits[:, j + 1 : 11], dim=-1)
        top = p.argsort(dim=-1, descending=True)[..., :3]  # each position's own three, not one set for all
        assert not (top[0, 0] == top[1, 1]).all()
        topk_term = -(p.gather(-1, top) * logq.gather(-1, top)).sum()
        expected.append(-(p * logq).sum() + 0.5 * topk_term)
    torch.testing.assert_close(hass.loss_sum, torch.stack(expected).detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hass.loss, expected[0] / 20 + 0.5 * expected[1] / 18, rtol=1e-5, atol=1e-5)
    assert (hass.loss_sum > plain.loss_sum).all()
    assert hass.correct.tolist() == plain.correct.tolist()


def test_simulated_acceptance_length():
    assert simulated_acceptance_length([1.0, 1.0, 1.0], 3) == 4.0
    assert simulated_acceptance_length([0.5, 0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert simulated_acceptance_length([0.0, 1.0], 2) == 1.0
