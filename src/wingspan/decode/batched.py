"""Batched speculative decoding (chain drafts): many prompts in one batch, each row exactly as
`speculative_generate` decodes it alone.

Rows are ragged twice over: prompts differ in length, and every round each row accepts its own number of
drafts. Instead of moving cache entries around, both the target's HF `DynamicCache` and the draft's
`KVCache`s keep *holes* (the gpt-fast / vLLM-style padded batch):

  * every forward appends the same number of slots to every row; a per-row bool `valid` [B, slots] says
    which slots hold a real token of that row. Left padding of ragged inputs (the prompts, the draft's
    step-0 inputs) and the rejected drafts of a round stay in the cache, masked out for good;
  * each forward gets explicit per-row `position_ids` (RoPE positions are token positions, not slots) and
    a 4D bool mask [B, 1, new, slots] built from `valid` (`_attention_mask`), which transformers passes
    through as-is (`masking_utils._preprocess_mask_arguments`) and the draft hands to SDPA.

Holes cost attention and cache copying over dead slots: a round of K drafts appends K + 1 slots of which
accepted + 1 stay valid, and HF's DynamicCache concatenates (copies) the whole cache at every forward; with a
weak draft most verify slots are holes. So the holes are reclaimed, but only when the fullest row fits in half
the cache (`_compaction`): one gather per layer, amortised like a growing vector's reallocation, which bounds
the waste for long generations (docs/evaluation.md has the costs measured). Rows that are done (a stop token,
or max_new_tokens) leave the batch at the start of the next round (`batch_select_indices`), so they cost
nothing further and their results stop changing.

Limits: the explicit mask replaces the model's own, so sliding-window attention (Mistral, Gemma 2/3, ...)
is not applied; fine for Llama/SmolLM2/Qwen2-style full attention. The mask is bool for SDPA and additive
(0 / -inf) for other attention implementations (eager adds the mask to the scores).

A round, with D = the deepest draft any row proposes (a row's depth is min(K, max_new_tokens - produced - 1),
as at batch size 1; shallower rows' extra drafts are computed and ignored):
  1. draft step 0 over each row's newly verified positions (left-padded to a common width), then D - 1
     chain steps; the chain keys are cropped afterwards, as at batch size 1;
  2. one target forward over [last token, D drafts] per row; each row is verified on its own by
     `primitives.verify` on its chain (greedy, or rejection sampling with the same rule and RNG use);
  3. the row's rejected slots are marked invalid; its verified aux features feed the next step 0.

Trees are batch-1 only (`speculative_generate(..., tree=...)`): tree masks per row are possible but not
worth their complexity here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from wingspan.decode.primitives import (
    Clock,
    DraftTree,
    SpecResult,
    TreeShape,
    check_compatible,
    choose_children,
    finish,
    pick_token,
    run_target,
    verify,
)
from wingspan.models.draft import Eagle3Draft, KVCache, MaskedAttend, new_kv_caches
from wingspan.models.target import TargetModel


def _attention_mask(valid: torch.Tensor, new: int) -> torch.Tensor:
    """[B, 1, new, S] bool (True = attend) for `new` queries in the last slots of `valid` [B, S]: each query
    sees the valid slots up to itself, and always itself. Without the latter a padding query with nothing
    valid before it would have an all-masked row: its softmax is NaN, and NaN keys/values written to the
    cache poison later queries even where masked (0 * NaN)."""
    slots = valid.shape[1]
    past = slots - new
    causal = torch.ones(new, slots, dtype=torch.bool, device=valid.device).tril(diagonal=past)
    mask = valid[:, None, None, :] & causal
    queries = torch.arange(new, device=valid.device)
    mask[:, :, queries, past + queries] = True
    return mask


@torch.no_grad()
def _target_forward(
    target: TargetModel,
    ids: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    cache: DynamicCache,
    last_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One cached target forward over ids [B, T] (the last T slots of `valid`): (logits [B, T or 1, V],
    aux [B, T, num_aux * H])."""
    valid = valid.to(target.device)
    # A row's valid slots hold its tokens in order, so a slot's position is the count of valid slots before it.
    keys = valid.long().cumsum(-1) - 1
    mask = target.model_mask(_attention_mask(valid, ids.shape[1]), positions, keys)
    with target.capture_aux() as captured:
        out = run_target(target, ids, cache, last_only, position_ids=positions.to(target.device), attention_mask=mask)
    return out.logits, target.aux_features(captured)


_COMPACT_FACTOR = 2.0  # compact when the cache would shrink at least this many times (tests set 1: always)


def _compaction(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """When the fullest row's valid slots fit in 1 / _COMPACT_FACTOR of the slots: (index [B, W], valid
    [B, W]) that move each row's valid slots, in order, to the right end of W = that row's count (left
    padding); else None.

    Compacting copies every layer's cache, so it is done only when the cache would at least halve: each
    slot is then copied O(1) times on average (as a growing vector reallocates)."""
    counts = valid.sum(dim=1)
    width = int(counts.max())
    if width == valid.shape[1] or _COMPACT_FACTOR * width > valid.shape[1]:
        return None
    # A stable sort puts each row's holes first and its valid slots last, both in slot order.
    index = torch.sort(valid.to(torch.uint8), dim=1, stable=True).indices[:, -width:]
    return index, torch.arange(width, device=valid.device) >= (width - counts)[:, None]


def _gather_slots(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, heads, S, head_dim] -> [B, heads, W, head_dim], slots `index` [B, W] of each row. Keys keep the
    RoPE of their token's position, so moving them changes nothing but the slot."""
    index = index.to(x.device)[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3])
    return x.gather(2, index)


def _compact(valid: torch.Tensor, tensors: list[tuple[object, str, str]]) -> torch.Tensor:
    """Apply `_compaction` (if due) to the named [B, heads, S, head_dim] attributes of each object (a
    DynamicCache layer's keys/values, a KVCache's k/v); returns the new validity."""
    compact = _compaction(valid) if tensors else None
    if compact is None:
        return valid
    index, valid = compact
    for owner, *names in tensors:
        for name in names:
            setattr(owner, name, _gather_slots(getattr(owner, name), index))
    return valid


def _masked(caches: list[KVCache], mask: torch.Tensor) -> list[MaskedAttend]:
    return [MaskedAttend(cache, mask) for cache in caches]


def _draft_next(
    draft: Eagle3Draft, hidden: torch.Tensor, temperature: float, generator: torch.Generator | None, clock: Clock
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's next draft token (target ids [B]) from pre-norm hidden states [B, H], and the target-vocab
    distributions [B, V] they were sampled from (None when greedy), as `speculative._draft_tree` for a chain."""
    with clock("draft"):
        logits = draft.logits(hidden)
    tokens, _, q = choose_children(draft, logits, 1, temperature, generator)
    return tokens[:, 0], q


@dataclass
class _Row:
    prompt_len: int
    sequence: list[int]  # prompt + new tokens; the last one has not been through the target yet
    result: SpecResult
    pending: torch.Tensor | None = None  # aux features [n, A] of verified positions the draft has not read
    first_unread: int = 0  # the position of pending[0]

    @property
    def produced(self) -> int:
        return len(self.sequence) - self.prompt_len


def _check_prompts(prompts: list[list[int]]) -> None:
    empty = [i for i, prompt in enumerate(prompts) if not prompt]
    if empty:
        raise ValueError(f"prompts: at least one token is needed in each prompt (empty: {empty})")


def _prefill(
    target: TargetModel, prompts: list[list[int]], cache: DynamicCache, clock: Clock
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prompts, left-padded so that every row's last token is the last slot (logits_to_keep=1 works):
    (valid [B, width], last logits [B, V], aux [B, width, A])."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    valid = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts])
    positions = (valid.long().cumsum(-1) - 1).clamp_min(0)  # 0.. over each row's real tokens
    with clock("target"):
        logits, aux = _target_forward(target, ids, positions, valid, cache, last_only=True)
    return valid, logits[:, -1], aux


def _finish_rows(rows: list[_Row], max_new_tokens: int, stops: set[int]) -> list[int]:
    """Record the result of every row that is done; the batch indices of the others."""
    keep = []
    for b, row in enumerate(rows):
        tokens, done, stopped = finish(row.sequence[row.prompt_len :], max_new_tokens, stops)
        if done:
            row.result.tokens, row.result.stopped = tokens, stopped
        else:
            keep.append(b)
    return keep


def _stamp(results: list[SpecResult], clock: Clock, started: float) -> list[SpecResult]:
    """The batch's wall times, the same for every row (rows share every forward)."""
    total = time.perf_counter() - started
    for result in results:
        result.target_s, result.draft_s, result.total_s = clock.seconds["target"], clock.seconds["draft"], total
    return results


def _draft_chains(
    draft: Eagle3Draft,
    rows: list[_Row],
    caches: list[KVCache],
    valid: torch.Tensor,
    depth: int,
    temperature: float,
    generator: torch.Generator | None,
    clock: Clock,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor | None]]:
    """One round of drafting for every row: step 0 over the row's newly verified positions p, reading
    (f_p, token p + 1) at RoPE position p, then `depth` chain tokens. Returns the caches' new validity
    (step-0 keys only: the chain keys are cropped, as at batch size 1), the drafts [B, depth] (target ids)
    and, per chain step, the distributions they were sampled from ([B, V], or None when greedy). Only the
    model calls are clocked, as at batch size 1."""
    device, dtype = draft.fc.weight.device, draft.fc.weight.dtype
    batch, counts = len(rows), [row.pending.shape[0] for row in rows]
    # Left-padded to a common width, so that the last slot is every row's origin (last verified position).
    width = max(counts)
    features = torch.zeros(batch, width, rows[0].pending.shape[-1], dtype=dtype, device=device)
    ids = torch.zeros(batch, width, dtype=torch.long)
    positions = torch.zeros(batch, width, dtype=torch.long)
    new_valid = torch.zeros(batch, width, dtype=torch.bool)
    for b, (row, count) in enumerate(zip(rows, counts)):
        start = width - count
        features[b, start:] = row.pending.to(device, dtype)
        ids[b, start:] = torch.tensor(row.sequence[row.first_unread + 1 : row.first_unread + 1 + count])
        positions[b, start:] = torch.arange(row.first_unread, row.first_unread + count)
        new_valid[b, start:] = True
    valid = torch.cat([valid, new_valid.to(device)], dim=1)
    origins = positions[:, -1:].to(device)
    mask = _attention_mask(valid, width)
    with clock("draft"):
        hidden = draft(draft.project_aux(features), ids.to(device), positions.to(device), _masked(caches, mask))
    hidden = hidden[:, -1:]
    # Chain step j reads step j-1's hidden state and token at position origin + j, and sees the row's
    # step-0 keys and this round's chain keys (all its own).
    chain_valid, tokens, proposals = valid, [], []
    for step in range(1, depth + 1):
        token, q = _draft_next(draft, hidden[:, -1], temperature, generator, clock)
        tokens.append(token)
        proposals.append(q)
        if step < depth:
            chain_valid = torch.cat([chain_valid, torch.ones(batch, 1, dtype=torch.bool, device=device)], dim=1)
            mask = _attention_mask(chain_valid, 1)
            with clock("draft"):
                hidden = draft(hidden, token[:, None], origins + step, _masked(caches, mask))
    for cache in caches:
        cache.crop(valid.shape[1])
    return valid, torch.stack(tokens, dim=1), proposals


@torch.no_grad()
def plain_generate_batch(
    target: TargetModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_ids: list[int] | None = None,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[SpecResult]:
    """`plain_generate` for many prompts in one batch: one target forward per token for all unfinished rows.

    Each row's tokens and stopped flag are those of `plain_generate` on its own prompt (at temperature > 0,
    samples of the same distribution; rows draw from `generator` in row order). target_forwards counts the
    batched forwards a row took part in; target_s / total_s are the batch's wall times, the same for every row.
    """
    started, clock = time.perf_counter(), Clock()
    _check_prompts(prompts)
    stops = set(target.eos_token_ids if stop_ids is None else stop_ids)
    if max_new_tokens <= 0 or not prompts:
        return [SpecResult([], 0) for _ in prompts]
    cache = DynamicCache()
    valid, logits, _ = _prefill(target, prompts, cache, clock)
    rows = [
        _Row(len(p), list(p) + [pick_token(logits[b], temperature, generator)], SpecResult([], 1))
        for b, p in enumerate(prompts)
    ]
    results = [row.result for row in rows]
    while True:
        keep = _finish_rows(rows, max_new_tokens, stops)
        if not keep:
            return _stamp(results, clock, started)
        if len(keep) < len(rows):  # finished rows leave the batch
            rows, valid = [rows[b] for b in keep], valid[keep]
            cache.batch_select_indices(torch.tensor(keep, device=target.device))
        ids = torch.tensor([[row.sequence[-1]] for row in rows])
        positions = torch.tensor([[len(row.sequence) - 1] for row in rows])
        valid = torch.cat([valid, torch.ones(len(rows), 1, dtype=torch.bool)], dim=1)
        with clock("target"):
            logits, _ = _target_forward(target, ids, positions, valid, cache)
        for b, row in enumerate(rows):
            row.sequence.append(pick_token(logits[b, -1], temperature, generator))
            row.result.target_forwards += 1


@torch.no_grad()
def speculative_generate_batch(
    target: TargetModel,
    draft: Eagle3Draft,
    prompts: list[list[int]],
    max_new_tokens: int,
    num_draft_tokens: int = 3,
    stop_ids: list[int] | None = None,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[SpecResult]:
    """Chain speculative decoding of many prompts in one batch (trees are batch-1 only: use
    `speculative_generate(..., tree=...)` per prompt).

    Row i's result is what `speculative_generate(target, draft, prompts[i], ...)` returns: the same tokens,
    accepted_per_round, drafted_per_round and stopped flag; at temperature 0 the tokens are the target's
    greedy decoding of that prompt (exactly so in float32; in bfloat16 batched and single forwards round
    differently, so long outputs can part ways at a near-tie, as HF's batched generate does). At
    temperature > 0 each row is a sample of the target's distribution by the same rejection rule; rows draw
    from `generator` in row order, so only a batch of one reproduces batch-1's samples. target_forwards
    counts the batched forwards the row took part in (prefill included); target_s / draft_s / total_s are
    the whole batch's wall times (model calls only for the first two), the same numbers for every row.
    """
    started, clock = time.perf_counter(), Clock()
    if isinstance(num_draft_tokens, TreeShape):
        raise ValueError("tree drafting is batch-1 only: call speculative_generate(..., tree=...) per prompt")
    if not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens: must be an int >= 1, got {num_draft_tokens!r}")
    if temperature < 0:
        raise ValueError(f"temperature: must be >= 0, got {temperature}")
    _check_prompts(prompts)
    check_compatible(target, draft)
    stops = set(target.eos_token_ids if stop_ids is None else stop_ids)
    if max_new_tokens <= 0 or not prompts:
        return [SpecResult([], 0) for _ in prompts]
    device = draft.fc.weight.device

    # Prefill: each row's first new token, and the aux features of its prompt positions for draft step 0.
    target_cache = DynamicCache()
    target_valid, logits, aux = _prefill(target, prompts, target_cache, clock)
    width = target_valid.shape[1]
    rows = [
        _Row(
            len(p),
            list(p) + [pick_token(logits[b], temperature, generator)],
            SpecResult([], 1),
            aux[b, width - len(p) :],
        )
        for b, p in enumerate(prompts)
    ]
    results = [row.result for row in rows]
    draft_caches = new_kv_caches(draft)
    draft_valid = torch.zeros(len(rows), 0, dtype=torch.bool, device=device)  # over the draft caches' slots

    while True:
        keep = _finish_rows(rows, max_new_tokens, stops)
        if not keep:
            return _stamp(results, clock, started)
        if len(keep) < len(rows):  # finished rows leave the batch: no further compute, results frozen
            rows, target_valid, draft_valid = [rows[b] for b in keep], target_valid[keep], draft_valid[keep]
            target_cache.batch_select_indices(torch.tensor(keep, device=target.device))
            for cache in draft_caches:
                if cache.k is not None:
                    cache.k, cache.v = cache.k[keep], cache.v[keep]
        # Reclaim the holes once they are most of the cache (weak drafts leave ~K of every K + 1 verify slots).
        target_valid = _compact(target_valid, [(layer, "keys", "values") for layer in target_cache.layers])
        draft_valid = _compact(draft_valid, [(cache, "k", "v") for cache in draft_caches if cache.k is not None])
        batch = len(rows)
        depths = [min(num_draft_tokens, max_new_tokens - row.produced - 1) for row in rows]
        deepest = max(depths)  # shallower rows draft this deep too; their extra drafts are ignored

        drafts = torch.zeros(batch, 0, dtype=torch.long, device=device)
        proposals: list[torch.Tensor | None] = []  # per chain step, [B, V] (sampling) or None
        if deepest > 0:
            draft_valid, drafts, proposals = _draft_chains(
                draft, rows, draft_caches, draft_valid, deepest, temperature, generator, clock
            )

        # Verify [last token, D drafts] of every row in one target forward, at positions verified + 0..D.
        verified = torch.tensor([[len(row.sequence) - 1] for row in rows])
        ids = torch.cat([torch.tensor([[row.sequence[-1]] for row in rows]), drafts.cpu()], dim=1)
        block_start = target_valid.shape[1]
        target_valid = torch.cat([target_valid, torch.ones(batch, 1 + deepest, dtype=torch.bool)], dim=1)
        with clock("target"):
            logits, aux = _target_forward(target, ids, verified + torch.arange(1 + deepest), target_valid, target_cache)
        draft_lists = drafts.tolist()
        for b, row in enumerate(rows):
            depth = depths[b]
            chain = DraftTree(
                tokens=draft_lists[b][:depth],
                parents=list(range(-1, depth - 1)),
                depths=list(range(1, depth + 1)),
                proposals=[None if q is None else q[b] for q in proposals[:depth]],
            )
            path, next_token = verify(chain, logits[b, : depth + 1], temperature, generator)
            accepted = len(path)
            # The root and the accepted drafts stay; the rejected (and padding) drafts become holes.
            target_valid[b, block_start + 1 + accepted :] = False
            row.sequence += draft_lists[b][:accepted] + [next_token]
            row.result.target_forwards += 1
            row.result.accepted_per_round.append(accepted)
            row.result.drafted_per_round.append(depth)
            if deepest > 0:  # the draft read everything up to the root: next it reads root + accepted
                row.pending, row.first_unread = aux[b, : accepted + 1], int(verified[b])
            else:  # the draft did not run: its unread features carry over
                row.pending = torch.cat([row.pending, aux[b, :1]])
