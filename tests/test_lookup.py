# ruff: noqa: F811  (pytest fixtures imported from test_speculative are redefined as arguments)
"""Prompt lookup drafting: vLLM's rule exactly, greedy output equal to the target's greedy decoding, sampled
output that keeps the target's distribution, and the split of a draft's rounds by where lookup matches."""

import random

import pytest
import torch
from conftest import hf_greedy
from test_speculative import PROMPTS, chi_square_p_value, exact_distribution, predictable_target, small_target  # noqa: F401

from wingspan.decode.lookup import lookup_drafts, lookup_generate, lookup_outcomes, lookup_replay
from wingspan.decode.primitives import SpecResult

pytestmark = pytest.mark.usefixtures("one_thread")


def vllm_lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """vLLM 0.32's `_find_longest_matched_ngram_and_propose_tokens` (v1/spec_decode/ngram_proposer.py, Apache-2.0),
    line for line without numba and without the max_model_len cap: KMP over the reversed context."""
    total = len(tokens)
    if total < min_n:
        return []
    reversed_tokens = tokens[::-1]
    lps = [0] * max_n
    longest, position, prev_lps, i = 0, 0, 0, 1
    while i < total:
        if reversed_tokens[prev_lps] == reversed_tokens[i]:
            prev_lps += 1
            if prev_lps >= longest:
                longest, position = prev_lps, i
            if i < max_n:
                lps[i] = prev_lps
            if prev_lps == max_n:
                prev_lps = lps[max_n - 1]
            i += 1
        elif prev_lps != 0:
            prev_lps = lps[prev_lps - 1]
        else:
            i += 1
    if longest < min_n:
        return []
    start = total - 1 - position + longest
    return tokens[start : start + min(k, total - start)]


def test_lookup_drafts_follow_vllms_rule_on_random_contexts():
    rng = random.Random(0)
    for _ in range(4000):
        alphabet, length = rng.randint(2, 5), rng.randint(1, 40)
        tokens = [rng.randrange(alphabet) for _ in range(length)]
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        k = rng.randint(1, 5)
        assert lookup_drafts(tokens, k, min_n, max_n) == vllm_lookup(tokens, k, min_n, max_n), (tokens, k, min_n, max_n)


def test_lookup_drafts_by_hand():
    assert lookup_drafts([1, 2, 3, 1, 2], 3, 2, 4) == [3, 1, 2]
    assert lookup_drafts([1, 2, 9, 1, 2, 8, 1, 2], 2, 2, 4) == [9, 1]  # the earliest occurrence
    # the longest suffix wins: [3, 1, 2] at 4 (followed by 8), not [1, 2]'s earliest occurrence at 1 (then 7)
    assert lookup_drafts([5, 1, 2, 7, 3, 1, 2, 8, 3, 1, 2], 2, 2, 4) == [8, 3]
    assert lookup_drafts([1, 2, 3, 4], 3, 2, 4) == []  # no repeated suffix
    assert lookup_drafts([7, 7], 3, 2, 4) == []  # [7, 7] occurs only as the suffix itself
    assert lookup_drafts([7, 7, 7], 3, 2, 4) == [7]  # fewer than k where the context ends


@pytest.mark.parametrize("k", [1, 3, 5])
def test_lookup_decoding_gives_the_greedy_tokens(predictable_target, k):
    """The FAVOURED-heavy target repeats n-grams, so lookup's drafts are accepted, and rejected, often."""
    target = predictable_target
    accepted = rejected = 0
    for prompt in PROMPTS[:3] + [[5, 17, 300, 5, 17, 300, 5, 17]]:
        expected = hf_greedy(target, prompt, 40, [])
        result = lookup_generate(target, prompt, 40, k, 2, 4, stop_ids=[])
        assert result.tokens == expected
        assert result.target_forwards == 1 + len(result.accepted_per_round)
        assert all(0 <= a <= d <= k for a, d in zip(result.accepted_per_round, result.drafted_per_round))
        accepted += sum(result.accepted_per_round)
        rejected += sum(a < d for a, d in zip(result.accepted_per_round, result.drafted_per_round))
        # replayed on the output alone, without the target: the same rounds
        replayed = lookup_replay(prompt, result.tokens, k, 2, 4)
        assert replayed == (result.accepted_per_round, result.drafted_per_round)
    assert accepted > 5 and rejected > 5


def test_lookup_decoding_stops_and_never_overshoots(predictable_target):
    target = predictable_target
    prompt = [5, 17, 300, 5, 17, 300, 5, 17]
    expected = hf_greedy(target, prompt, 30, [])
    for max_new_tokens in (1, 2, 7):
        result = lookup_generate(target, prompt, max_new_tokens, 4, 2, 4, stop_ids=[])
        assert result.tokens == expected[:max_new_tokens]
    stop = expected[5]
    result = lookup_generate(target, prompt, 30, 4, 2, 4, stop_ids=[stop])
    assert result.stopped and result.tokens == expected[: expected.index(stop)]


def test_lookup_sampling_keeps_the_target_distribution(small_target):
    """Sampled with lookup drafts, 4 tokens, 1200 times: each token's marginal fits the target's exact
    distribution (chi-square, p > 1e-3). The prompt repeats itself and holds the target's own greedy loop
    (11, 2, 11, 2, ...), so lookup proposes in most rounds and the target accepts some of it."""
    prompt, temperature, runs = [3, 5, 7, 5, 11, 2, 11, 2, 11, 2, 5, 6, 0, 3, 5, 7], 0.5, 1200
    exact = exact_distribution(small_target, prompt, 4, temperature)
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros([12] * 4)
    accepted = drafted = 0
    for _ in range(runs):
        result = lookup_generate(
            small_target, prompt, 4, 2, 2, 4, stop_ids=[], temperature=temperature, generator=generator
        )
        counts[tuple(result.tokens)] += 1
        accepted += sum(result.accepted_per_round)
        drafted += sum(result.drafted_per_round)
    assert drafted > runs and 0.05 * drafted < accepted < 0.5 * drafted  # both branches of the rule
    for position in range(4):
        others = tuple(i for i in range(4) if i != position)
        assert chi_square_p_value(counts.sum(others), exact.sum(others)) > 1e-3, position


def test_lookup_outcomes_replay_a_decoders_rounds():
    """Prompt [1, 2, 3]; the output 1 | 2 3 1 | 9 | 2 3 came as the prefill's token, then rounds accepting 2, 0
    and 1 of 3 drafts. Each round's context is the prompt and the output before it."""
    prompt = [1, 2, 3]
    result = SpecResult([1, 2, 3, 1, 9, 2, 3], 4, accepted_per_round=[2, 0, 1], drafted_per_round=[3, 3, 3])
    # round 1, context [1, 2, 3, 1]: [3, 1] and [2, 3, 1] occur nowhere earlier
    # round 2, context [1, 2, 3, 1, 2, 3, 1]: [1, 2, 3, 1] occurs at 0, so lookup proposes [2, 3, 1]; the
    #   output goes on 9: 0 accepted
    # round 3, context [1, 2, 3, 1, 2, 3, 1, 9]: [1, 9] and [9] do not occur earlier: no match
    assert lookup_outcomes(prompt, result, 2, 4) == [None, 0, None]
    result = SpecResult([1, 2, 3, 1, 2, 3], 3, accepted_per_round=[0, 3], drafted_per_round=[2, 3])
    # round 1, context [1, 2, 3, 1]: none; round 2, context [1, 2, 3, 1, 2]: [1, 2] at 0 -> [3, 1, 2] = output
    assert lookup_outcomes(prompt, result, 2, 4) == [None, 3]
    # a round that drafted nothing (the last token before max_new_tokens) has no outcome either
    assert lookup_outcomes(prompt, SpecResult([1, 2], 2, [0], [0]), 2, 4) == [None]
