"""Batched chain speculative decoding: every row is what batch-1 `speculative_generate` gives for its prompt."""

import functools

import pytest
import torch
from conftest import hf_greedy
from test_speculative import (
    FAVOURED,
    SMALL_VOCAB,
    chi_square_p_value,
    exact_distribution,
    make_draft,
    predictable_target,  # noqa: F401  (fixtures, shared with the batch-1 tests)
    sharpen,
    small_draft,
    small_target,  # noqa: F401
    target,  # noqa: F401
)

from wingspan.decode import batched, speculative
from wingspan.decode.batched import plain_generate_batch, speculative_generate_batch
from wingspan.decode.primitives import TreeShape
from wingspan.decode.speculative import plain_generate, speculative_generate
from wingspan.models.target import TargetModel

# Lengths 4, 12, 1, 3: every prefix of this list is a ragged batch.
PROMPTS = [[5, 17, 300, 4000], list(range(100, 112)), [7], [1, 2000, 42]]


pytestmark = pytest.mark.usefixtures("one_thread")


def greedy(target: TargetModel, prompt: list[int], max_new_tokens: int, stop_ids: list[int]) -> list[int]:
    return _greedy(target, tuple(prompt), max_new_tokens, tuple(stop_ids))


@functools.cache
def _greedy(target, prompt, max_new_tokens, stop_ids):
    if max_new_tokens == 0:  # generate refuses 0
        return []
    return hf_greedy(target, list(prompt), max_new_tokens, list(stop_ids))


def record_chains(monkeypatch) -> dict[str, list[tuple[int, ...]]]:
    """Every chain verified, in call order, by batch-1 (`alone`) and batched (`batch`) decoding."""
    calls = {"alone": [], "batch": []}
    for module, key in ((speculative, "alone"), (batched, "batch")):

        def recording(tree, logits, temperature, generator, verify=module.verify, key=key):
            calls[key].append(tuple(tree.tokens))
            return verify(tree, logits, temperature, generator)

        monkeypatch.setattr(module, "verify", recording)
    return calls


def check_rows(target, draft, prompts, max_new_tokens, k, stop_ids, chains):
    """The batch against batch-1 and the target's greedy decoding, row by row; returns the batch.

    Also every round's drafted chain: the same tokens at every depth (not only the accepted ones), so the
    draft's chain steps are checked even where the target rejects them."""
    chains["batch"].clear()
    batch = speculative_generate_batch(target, draft, prompts, max_new_tokens, num_draft_tokens=k, stop_ids=stop_ids)
    assert len(batch) == len(prompts)
    # Batched verification runs round by round over the rows still decoding, in prompt order.
    rounds = [len(r.accepted_per_round) for r in batch]
    order = [row for r in range(max(rounds, default=0)) for row in range(len(batch)) if rounds[row] > r]
    assert len(order) == len(chains["batch"])
    for row, (prompt, result) in enumerate(zip(prompts, batch, strict=True)):
        chains["alone"].clear()
        alone = speculative_generate(target, draft, prompt, max_new_tokens, num_draft_tokens=k, stop_ids=stop_ids)
        context = (len(prompt), max_new_tokens, k, stop_ids)
        assert result.tokens == alone.tokens == greedy(target, prompt, max_new_tokens, stop_ids), context
        assert result.accepted_per_round == alone.accepted_per_round, context
        assert result.drafted_per_round == alone.drafted_per_round, context
        assert (result.stopped, result.target_forwards) == (alone.stopped, alone.target_forwards), context
        assert [chain for who, chain in zip(order, chains["batch"]) if who == row] == chains["alone"], context
    assert len({(r.target_s, r.draft_s, r.total_s) for r in batch}) == 1  # the batch's times, on every row
    return batch


def mixed_depth_rounds(batch) -> bool:
    """Whether some round had rows proposing different numbers of drafts (rows are in step by round)."""
    rounds = max(len(r.drafted_per_round) for r in batch)
    return any(len({r.drafted_per_round[i] for r in batch if i < len(r.drafted_per_round)}) > 1 for i in range(rounds))


@pytest.mark.parametrize("layers", [1, 2, 3])
@pytest.mark.parametrize("k", [1, 3])
def test_rows_equal_batch_one_and_greedy(target, predictable_target, layers, k, monkeypatch):
    """B = 1..4 ragged prompts. A random draft (rare acceptances), and a draft biased towards FAVOURED on the
    predictable target, whose acceptances depend on its hidden states: equal accepted_per_round means the
    draft's batched caches, masks and positions compute what batch-1's do. Rows accept different numbers of
    drafts, so their caches fill with holes at different places."""
    chains = record_chains(monkeypatch)
    random_draft = make_draft(target, layers, seed=layers)
    biased_draft = make_draft(predictable_target, layers, seed=30 + layers, favour=15.0)
    accepted, diverged = 0, False
    for size in range(1, len(PROMPTS) + 1):
        check_rows(target, random_draft, PROMPTS[:size], 12, k, [], chains)
        batch = check_rows(predictable_target, biased_draft, PROMPTS[:size], 20, k, [], chains)
        accepted += sum(sum(r.accepted_per_round) for r in batch)
        diverged |= len({tuple(r.accepted_per_round) for r in batch}) > 1
    assert accepted > 0 and diverged


@pytest.mark.parametrize("k", [1, 3])
def test_compacting_every_round(predictable_target, k, monkeypatch):
    """The caches' holes are reclaimed when they are most of the cache; here after every round (target and
    draft caches alike), which must change nothing."""
    monkeypatch.setattr(batched, "_COMPACT_FACTOR", 1.0)
    chains = record_chains(monkeypatch)
    for layers in (1, 3):
        draft = make_draft(predictable_target, layers, seed=30 + layers, favour=15.0)
        check_rows(predictable_target, draft, PROMPTS, 20, k, [], chains)


@pytest.mark.parametrize("k", [1, 3])
def test_max_new_tokens_and_stop_edges(predictable_target, k, monkeypatch):
    """max_new_tokens 0, 1, 2, K+1 and more (rows near the end propose fewer drafts than others in the same
    round); stop tokens that end some rows (mid-round, on an accepted draft) and not others."""
    target = predictable_target
    draft = make_draft(target, 2, seed=0, favour=0)  # always proposes FAVOURED: accepted about 1/3 of the time
    chains = record_chains(monkeypatch)
    mixed = False
    for n in (0, 1, 2, k + 1, 16):
        batch = check_rows(target, draft, PROMPTS, n, k, [], chains)
        assert all(len(r.tokens) == n and not r.stopped for r in batch)
        mixed |= mixed_depth_rounds(batch)
    assert mixed
    full = [greedy(target, prompt, 16, []) for prompt in PROMPTS]
    # A stop id that ends row 0 early and never appears in row 1.
    stop = next(t for t in full[0][2:] if t not in full[1] and t not in full[0][:2])
    for n in (full[0].index(stop), full[0].index(stop) + 1, 16):
        batch = check_rows(target, draft, PROMPTS, n, k, [stop], chains)
    assert batch[0].stopped and not batch[1].stopped
    batch = check_rows(target, draft, PROMPTS, 16, k, [FAVOURED], chains)  # stops on an accepted draft token
    assert any(r.stopped for r in batch)
    # Row 2 stops on its first token.
    assert check_rows(target, draft, PROMPTS, 16, k, [full[2][0], stop], chains)[2].tokens == []


def test_finished_rows_leave_the_batch(predictable_target, monkeypatch):
    """Every target forward runs the unfinished rows only: the rows summed over forwards are the rows'
    target_forwards summed (a finished row costs nothing more)."""
    target = predictable_target
    draft = make_draft(target, 1, seed=0, favour=0)
    prompts = PROMPTS + PROMPTS[:2]
    stop = greedy(target, prompts[0], 16, [])[3]
    sizes = []
    forward = target.model.forward

    @functools.wraps(forward)  # keeps the signature (`cache` or `past_key_values`)
    def recording(*args, **kwargs):
        sizes.append(kwargs["input_ids"].shape[0])
        return forward(*args, **kwargs)

    monkeypatch.setattr(target.model, "forward", recording)
    batch = speculative_generate_batch(target, draft, prompts, 16, num_draft_tokens=3, stop_ids=[stop])
    assert sizes[0] == len(prompts) and sizes[-1] < len(prompts)
    assert sizes == sorted(sizes, reverse=True)
    assert sum(sizes) == sum(r.target_forwards for r in batch)


def test_eager_attention_target(tiny_llama_dir):
    """Eager attention adds the mask to the scores: the bool mask must become 0 / -inf for it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32, attn_implementation="eager")
    target = TargetModel(model, AutoTokenizer.from_pretrained(tiny_llama_dir), "eager llama", aux_layer_ids=[1, 2, 3])
    target.model.lm_head.weight.data[FAVOURED] *= 20
    sharpen(target.model)
    assert target.model.config._attn_implementation == "eager"
    draft = make_draft(target, 2, seed=32, favour=15.0)
    batch = speculative_generate_batch(target, draft, PROMPTS, 16, num_draft_tokens=3, stop_ids=[])
    assert [r.tokens for r in batch] == [greedy(target, prompt, 16, []) for prompt in PROMPTS]
    assert sum(sum(r.accepted_per_round) for r in batch) > 0
    assert [r.tokens for r in plain_generate_batch(target, PROMPTS, 16, [])] == [r.tokens for r in batch]


def test_plain_batch_equals_plain(predictable_target):
    target = predictable_target
    full = [greedy(target, prompt, 12, []) for prompt in PROMPTS]
    stop = next(t for t in full[0][2:] if t not in full[1] and t not in full[0][:2])
    for stops in ([], [stop]):
        for n in (0, 1, 2, 12):
            for size in (1, 4):
                batch = plain_generate_batch(target, PROMPTS[:size], n, stops)
                for prompt, row in zip(PROMPTS, batch):
                    alone = plain_generate(target, prompt, n, stops)
                    expected = (alone.tokens, alone.stopped, alone.target_forwards)
                    assert (row.tokens, row.stopped, row.target_forwards) == expected
                    assert row.tokens == greedy(target, prompt, n, stops)


def test_arguments_are_checked(target):
    draft = make_draft(target, 1, seed=0)
    with pytest.raises(ValueError, match="batch-1 only"):
        speculative_generate_batch(target, draft, PROMPTS, 4, TreeShape(3, 2, 5))
    with pytest.raises(ValueError, match="empty: \\[1\\]"):
        speculative_generate_batch(target, draft, [[1], []], 4)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        speculative_generate_batch(target, draft, PROMPTS, 4, 0)
    assert speculative_generate_batch(target, draft, [], 4) == [] == plain_generate_batch(target, [], 4)


def test_a_batch_of_one_samples_as_batch_one(small_target):
    """Same generator seed, same draws in the same order: the same samples and acceptances."""
    target, draft = small_target, small_draft(small_target)
    for seed in range(10):
        alone = speculative_generate(
            target,
            draft,
            [3, 5, 7],
            8,
            num_draft_tokens=2,
            stop_ids=[],
            temperature=0.9,
            generator=torch.Generator().manual_seed(seed),
        )
        [row] = speculative_generate_batch(
            target,
            draft,
            [[3, 5, 7]],
            8,
            num_draft_tokens=2,
            stop_ids=[],
            temperature=0.9,
            generator=torch.Generator().manual_seed(seed),
        )
        assert (row.tokens, row.accepted_per_round) == (alone.tokens, alone.accepted_per_round)
        plain = plain_generate(target, [3, 5, 7], 8, [], temperature=0.9, generator=torch.Generator().manual_seed(seed))
        [plain_row] = plain_generate_batch(
            target, [[3, 5, 7]], 8, [], temperature=0.9, generator=torch.Generator().manual_seed(seed)
        )
        assert plain_row.tokens == plain.tokens


def test_rejection_sampling_keeps_the_target_distribution(small_target):
    """1500 batches of two different prompts (lengths 3 and 2), 4 tokens each, up to 2 drafts a round (rows
    accept different numbers, so they run out of step): each row's empirical joint of tokens 2-4 and each
    token's marginal fit the target's exact distribution for its prompt, and the two rows are independent
    (the joint of their 4th tokens is the product of the marginals). Chi-square, p > 1e-3 each. Rows that
    swapped proposals or shared draft samples fail this (checked by breaking the code)."""
    target, draft = small_target, small_draft(small_target)
    prompts, temperature, batches = [[3, 5, 7], [2, 9]], 0.9, 1500
    exact = [exact_distribution(target, prompt, 4, temperature) for prompt in prompts]
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(2, *[SMALL_VOCAB] * 4)
    pairs = torch.zeros(SMALL_VOCAB, SMALL_VOCAB)
    accepted = rejected = out_of_step = 0
    for _ in range(batches):
        batch = speculative_generate_batch(
            target, draft, prompts, 4, num_draft_tokens=2, stop_ids=[], temperature=temperature, generator=generator
        )
        for row, result in enumerate(batch):
            assert len(result.tokens) == 4
            counts[row][tuple(result.tokens)] += 1
            accepted += result.accepted_per_round[0]
            rejected += result.accepted_per_round[0] < 2
        pairs[batch[0].tokens[3], batch[1].tokens[3]] += 1
        out_of_step += batch[0].accepted_per_round != batch[1].accepted_per_round
    assert accepted > 0.2 * 2 * batches and rejected > 0.2 * 2 * batches  # both branches of the rule
    assert out_of_step > 0.2 * batches
    for row in range(2):
        assert chi_square_p_value(counts[row].sum(0), exact[row].sum(0)) > 1e-3, row
        for position in range(4):
            others = tuple(i for i in range(4) if i != position)
            assert chi_square_p_value(counts[row].sum(others), exact[row].sum(others)) > 1e-3, (row, position)
    last = [e.sum((0, 1, 2)) for e in exact]
    assert chi_square_p_value(pairs, last[0][:, None] * last[1][None, :]) > 1e-3
