"""Prompt lookup drafting, vLLM's `"method": "ngram"`: no draft model, the drafts are the tokens that followed an
earlier occurrence of the context's last n tokens.

`lookup_drafts` is vLLM 0.32's rule (`v1/spec_decode/ngram_proposer.py`): the longest suffix of the context
whose length is in [min_n, max_n] that occurs earlier, at its earliest occurrence, and up to k of the tokens
after it (fewer where the context ends first). `lookup_generate` decodes with it, verifying each round's
drafts as a chain in one target forward; a round without a match is a plain target step. `lookup_outcomes`
asks, round by round of another decoder's output, what lookup would have proposed there and how much of it
the output accepts: where a draft falls short of lookup, it misses a repetition that the context shows.
`lookup_replay` decodes a known greedy output with lookup's drafts without the target: the rounds that
`lookup_generate` would run on it.
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from wingspan.decode.primitives import Clock, DraftTree, SpecResult, finish, keep_rows, pick_token, run_target, verify
from wingspan.models.target import TargetModel


def lookup_drafts(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the earliest earlier occurrence of the longest suffix of `tokens` of
    min_n..max_n tokens; [] when no such suffix occurs earlier."""
    if not 1 <= min_n <= max_n:
        raise ValueError(f"n-gram sizes: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        start = -1
        while True:  # occurrences that at least one token follows, earliest first; list.index scans in C
            try:
                start = tokens.index(suffix[0], start + 1, length - n)
            except ValueError:
                break
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def chain(tokens: list[int]) -> DraftTree:
    """Drafts as a chain of deterministic proposals (q = 1: verified by the same rule as a tree's top-k)."""
    n = len(tokens)
    return DraftTree(list(tokens), list(range(-1, n - 1)), list(range(1, n + 1)), [None] * n)


@torch.no_grad()
def lookup_generate(
    target: TargetModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    num_draft_tokens: int,
    min_n: int,
    max_n: int,
    stop_ids: list[int] | None = None,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> SpecResult:
    """Speculative decoding with prompt lookup drafts: at temperature 0 the target's greedy decoding, above it
    a sample of its distribution (each draft is a proposal with q = 1, as a tree's children are)."""
    started = time.perf_counter()
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens: must be >= 1, got {num_draft_tokens}")
    if not prompt_ids:
        raise ValueError("prompt_ids: at least one token is needed")
    stops = set(target.eos_token_ids if stop_ids is None else stop_ids)
    if max_new_tokens <= 0:
        return SpecResult([], 0)
    clock, cache = Clock(), DynamicCache()
    with clock("target"):
        out = run_target(target, torch.tensor([prompt_ids]), cache, last_only=True)
    sequence = list(prompt_ids) + [pick_token(out.logits[0, -1], temperature, generator)]
    result = SpecResult([], 1)
    while True:
        new_tokens, done, result.stopped = finish(sequence[len(prompt_ids) :], max_new_tokens, stops)
        if done:
            return result.ended(new_tokens, clock, started)
        depth = min(num_draft_tokens, max_new_tokens - len(new_tokens) - 1)
        with clock("draft"):
            drafts = chain(lookup_drafts(sequence, depth, min_n, max_n) if depth > 0 else [])
        verified = len(sequence) - 1  # the target cache holds positions 0..verified-1
        with clock("target"):
            out = run_target(target, torch.tensor([[sequence[-1]] + drafts.tokens]), cache)
        result.target_forwards += 1
        path, next_token = verify(drafts, out.logits[0], temperature, generator)
        result.accepted_per_round.append(len(path))
        result.drafted_per_round.append(len(drafts.tokens))
        sequence += [drafts.tokens[node] for node in path] + [next_token]
        keep_rows(cache, verified, list(range(1 + len(path))))  # a chain's accepted rows are its first ones


def agreeing(drafts: list[int], output: list[int]) -> int:
    """How many drafts, from the first, equal the output's tokens (as far as the output goes)."""
    return next((i for i, (a, b) in enumerate(zip(drafts, output)) if a != b), min(len(drafts), len(output)))


def lookup_outcomes(prompt_ids: list[int], result: SpecResult, min_n: int, max_n: int) -> list[int | None]:
    """For each round of `result` (a decoding of `prompt_ids`), the drafts lookup would have proposed there
    (as many as the round drafted) that the output accepts; None where lookup finds no match or the round
    drafted nothing. The output ends before its stop token, so a last round that accepted the stop token can
    count one token less for lookup than it would have had."""
    context = list(prompt_ids) + result.tokens
    position = len(prompt_ids) + 1  # the prefill's token is known before the first round
    outcomes: list[int | None] = []
    for accepted, drafted in zip(result.accepted_per_round, result.drafted_per_round, strict=True):
        drafts = lookup_drafts(context[:position], drafted, min_n, max_n) if drafted else []
        if drafts:
            outcomes.append(agreeing(drafts, context[position:]))
        else:
            outcomes.append(None)
        position += accepted + 1
    return outcomes


def lookup_replay(
    prompt_ids: list[int], tokens: list[int], num_draft_tokens: int, min_n: int, max_n: int
) -> tuple[list[int], list[int]]:
    """(accepted, drafted) per round of greedy lookup decoding whose output is `tokens`: any greedy decoder's
    output is the target's, so these are `lookup_generate`'s rounds, bar the last one of an output that ended
    on a stop token (which is not in `tokens`: lookup could have drafted it)."""
    context = list(prompt_ids) + tokens
    position = len(prompt_ids) + 1
    accepted_per_round, drafted_per_round = [], []
    while position < len(context):
        depth = min(num_draft_tokens, len(context) - position - 1)
        drafts = lookup_drafts(context[:position], depth, min_n, max_n) if depth > 0 else []
        accepted = agreeing(drafts, context[position:])
        accepted_per_round.append(accepted)
        drafted_per_round.append(len(drafts))
        position += accepted + 1
    return accepted_per_round, drafted_per_round
