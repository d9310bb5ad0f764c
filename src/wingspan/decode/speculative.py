"""Greedy chain speculative decoding at batch size 1 (gpt-fast style), and the plain greedy baseline.

One round, with `origin` the position of the last token whose target aux features the draft has seen:
  1. the draft proposes d_1..d_K: step 0 at `origin` gives d_1, step j reads its own pre-norm hidden state
     and d_j at RoPE position origin + j (exactly `tests/test_ttt.py::chain_logits`, the TTT semantics);
  2. one target forward over [last token, d_1..d_K] with the HF KV cache; the longest prefix of drafts
     equal to the target's argmax is accepted, and the target's own next token is always added;
  3. the target cache is cropped to the accepted positions; the draft caches are cropped to the step-0
     keys (positions <= origin), then the draft reads the target's aux features of the newly verified
     positions p (with token p + 1) as step-0 inputs, which moves `origin` to the new last verified position.
The output is the target's greedy decoding, token for token (exactly so in float32).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from wingspan.models.draft import Eagle3Draft, KVCache, new_kv_caches
from wingspan.models.target import TargetModel


@dataclass
class SpecResult:
    tokens: list[int]  # the new tokens, without the stop token (as `TargetModel.generate`)
    target_forwards: int  # prefill included
    accepted_per_round: list[int] = field(default_factory=list)  # draft tokens accepted in each verification
    stopped: bool = False  # ended on a stop token (False: hit max_new_tokens)

    @property
    def acceptance_length(self) -> float:
        """Mean tokens per verification round (accepted drafts + the target's own token)."""
        rounds = self.accepted_per_round
        return 1.0 + sum(rounds) / len(rounds) if rounds else 1.0


def _run_target(target: TargetModel, ids: list[int], cache: DynamicCache, last_only: bool = False):
    """One cached target forward. The cache argument is `cache` in recent transformers, where
    `past_key_values` is deprecated, and `past_key_values` in older ones."""
    model = target.model
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    extra = {"logits_to_keep": 1} if last_only else {}
    input_ids = torch.tensor([ids], device=target.device)
    return model(input_ids=input_ids, use_cache=True, **{name: cache}, **extra)


@torch.no_grad()
def _target_step(target: TargetModel, ids: list[int], cache: DynamicCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the target over `ids` after what `cache` holds: (logits [T, V], aux [T, num_aux * H])."""
    with target.capture_aux() as captured:  # the same hooks as TargetModel.forward, around a cached call
        out = _run_target(target, ids, cache)
    aux = torch.cat([captured[i] for i in target.aux_layer_ids], dim=-1)
    return out.logits[0], aux[0]


def _finish(tokens: list[int], max_new_tokens: int, stops: set[int]) -> tuple[list[int], bool, bool]:
    """Truncate at the first stop token and at max_new_tokens: (tokens, done, stopped)."""
    tokens = tokens[:max_new_tokens]
    end = next((i for i, t in enumerate(tokens) if t in stops), None)
    if end is not None:
        return tokens[:end], True, True
    return tokens, len(tokens) >= max_new_tokens, False


@torch.no_grad()
def greedy_generate(
    target: TargetModel, prompt_ids: list[int], max_new_tokens: int, stop_ids: list[int] | None = None
) -> SpecResult:
    """The baseline: one KV-cached target forward per token."""
    stops = set(target.eos_token_ids if stop_ids is None else stop_ids)
    if max_new_tokens <= 0:
        return SpecResult([], 0)
    cache = DynamicCache()
    out = _run_target(target, prompt_ids, cache, last_only=True)
    tokens, forwards = [int(out.logits[0, -1].argmax())], 1
    while True:
        result, done, stopped = _finish(tokens, max_new_tokens, stops)
        if done:
            return SpecResult(result, forwards, stopped=stopped)
        out = _run_target(target, tokens[-1:], cache)
        tokens.append(int(out.logits[0, -1].argmax()))
        forwards += 1


def _check_compatible(target: TargetModel, draft: Eagle3Draft) -> None:
    config = draft.config
    if list(config.aux_layer_ids) != list(target.aux_layer_ids):
        raise ValueError(f"draft aux_layer_ids {config.aux_layer_ids} != target aux_layer_ids {target.aux_layer_ids}")
    if config.target_hidden_size != target.hidden_size or config.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft (target_hidden_size {config.target_hidden_size}, vocab {config.vocab_size}) does not fit the "
            f"target (hidden {target.hidden_size}, vocab {target.vocab_size})"
        )


@torch.no_grad()
def speculative_generate(
    target: TargetModel,
    draft: Eagle3Draft,
    prompt_ids: list[int],
    max_new_tokens: int,
    num_draft_tokens: int = 3,
    stop_ids: list[int] | None = None,
) -> SpecResult:
    """Greedy chain speculative decoding of one prompt; the same tokens as the target's greedy decoding.

    Stops at the first stop id (default: the target's eos ids; the stop token is not returned) or after
    max_new_tokens. Near the end fewer drafts are proposed, so that no round overshoots max_new_tokens.
    """
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens: must be >= 1, got {num_draft_tokens}")
    if not prompt_ids:
        raise ValueError("prompt_ids: at least one token is needed")
    _check_compatible(target, draft)
    stops = set(target.eos_token_ids if stop_ids is None else stop_ids)
    if max_new_tokens <= 0:
        return SpecResult([], 0)
    device, dtype = draft.fc.weight.device, draft.fc.weight.dtype

    # Prefill: the target over the prompt gives the first new token and aux features f_0..f_{P-1}.
    target_cache = DynamicCache()
    logits, aux = _target_step(target, prompt_ids, target_cache)
    sequence = list(prompt_ids) + [int(logits[-1].argmax())]
    forwards, accepted_per_round = 1, []
    draft_caches: list[KVCache] = new_kv_caches(draft)
    # f_p for positions origin+1.. not yet read by the draft, which start at `first_unread`.
    pending_aux, first_unread = aux, 0

    while True:
        new_tokens, done, stopped = _finish(sequence[len(prompt_ids) :], max_new_tokens, stops)
        if done:
            return SpecResult(new_tokens, forwards, accepted_per_round, stopped)
        # Verified positions are 0..len(sequence)-2 (the last token has no target pass yet).
        k = min(num_draft_tokens, max_new_tokens - len(new_tokens) - 1)
        drafts: list[int] = []
        if k > 0:
            # Step 0 over the newly verified positions p: (f_p, token p + 1) at RoPE position p.
            count = pending_aux.shape[0]
            positions = torch.arange(first_unread, first_unread + count, device=device)[None]
            ids = torch.tensor([sequence[first_unread + 1 : first_unread + 1 + count]], device=device)
            hidden = draft(draft.project_aux(pending_aux[None].to(device, dtype)), ids, positions, draft_caches)[:, -1:]
            origin = first_unread + count - 1
            for j in range(k):
                drafts.append(int(draft.draft_to_target(draft.logits(hidden)[0, -1].argmax())))
                if j + 1 < k:  # step j + 1 reads its own hidden state and d_{j+1} at position origin + j + 1
                    position = torch.tensor([[origin + j + 1]], device=device)
                    hidden = draft(hidden, torch.tensor([[drafts[-1]]], device=device), position, draft_caches)
            for cache in draft_caches:  # keep the step-0 keys only (positions 0..origin)
                cache.crop(origin + 1)

        # Verify [last token, d_1..d_k] in one target forward.
        verified = len(sequence) - 1  # the target cache holds positions 0..verified-1
        logits, aux = _target_step(target, [sequence[-1]] + drafts, target_cache)
        forwards += 1
        greedy = logits.argmax(dim=-1).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == greedy[accepted]:
            accepted += 1
        accepted_per_round.append(accepted)
        sequence += drafts[:accepted] + [greedy[accepted]]
        # Positions verified..verified+accepted are now final; the rest of the cache was rejected drafts.
        rejected = len(drafts) - accepted
        if rejected:  # a negative crop removes that many positions, in old and new transformers alike
            target_cache.crop(-rejected)
        if k > 0:
            pending_aux, first_unread = aux[: accepted + 1], verified
        else:  # the draft did not run this round: its unread features carry over
            pending_aux = torch.cat([pending_aux, aux[:1]])
