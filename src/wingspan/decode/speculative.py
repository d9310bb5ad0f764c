"""Speculative decoding at batch size 1 (gpt-fast style): chain, EAGLE-2 tree or parallel (P-EAGLE) drafts,
greedy or sampled.

One round, with `origin` the position of the last token whose target aux features the draft has seen:
  1. the draft proposes a tree (a chain is a tree with one child per node): step 0 at `origin` reads the
     target's features and gives the children of the root; a node at depth j reads its parent's pre-norm
     hidden state and its own token at RoPE position origin + j, and attends to the verified prefix and its
     ancestors only (exactly the TTT semantics of `tests/test_ttt.py::chain_logits` along every path);
  2. one target forward over [last token, tree nodes] with a tree attention mask verifies every node:
     greedily (follow the child equal to the target's argmax) or by rejection sampling; the target's own
     next token is always added (the "bonus" token);
     A parallel draft's chain comes from one forward instead: the first token from step 0, the others from
     mask slots at origin + 1.. (`_draft_parallel`);
  3. the target cache keeps the accepted path only; the draft caches are cropped to the step-0 keys
     (positions <= origin), then the draft reads the target's aux features of the newly verified positions p
     (with token p + 1) as step-0 inputs, which moves `origin` to the new last verified position.

Greedy output is the target's greedy decoding, token for token (exactly so in float32). Sampled output
follows the target's distribution at that temperature exactly: a chain's drafts are sampled from the draft
and accepted with probability min(1, p/q), else the next token comes from norm(max(p - q, 0)); a tree's
children are the draft's top-k, i.e. proposals with q = 1, tried in turn, each rejection removing that
token from p (EAGLE's rule). Either way every emitted token is a sample of the target's p.
"""

from __future__ import annotations

import time

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
    keep_rows,
    pick_token,
    run_target,
    verify,
)
from wingspan.models.draft import Eagle3Draft, KVCache, MaskedAttend, new_kv_caches
from wingspan.models.target import TargetModel


def _tree_attention(tree: DraftTree, past: int, target: TargetModel) -> dict[str, torch.Tensor]:
    """Target forward arguments for [root, nodes] after `past` cached positions: each row sees the cache, the
    root and its ancestors; node positions are past + depth. Empty for a chain (the causal default)."""
    if all(depth == i + 1 for i, depth in enumerate(tree.depths)):
        return {}
    device, rows = target.device, len(tree.tokens) + 1
    mask = torch.ones(rows, past + rows, dtype=torch.bool, device=device)
    mask[:, past:] = tree.ancestry_mask().to(device)
    positions = torch.tensor([[past] + [past + d for d in tree.depths]], device=device)
    keys = torch.cat([torch.arange(past, device=device)[None], positions], dim=1)
    return {"attention_mask": target.model_mask(mask[None, None], positions, keys), "position_ids": positions}


@torch.no_grad()
def _target_step(
    target: TargetModel, ids: list[int], cache: DynamicCache, attention: dict[str, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the target over `ids` after what `cache` holds: (logits [T, V], aux [T, num_aux * H]).
    `attention`: a tree's mask and positions (`_tree_attention`)."""
    with target.capture_aux() as captured:  # the same hooks as TargetModel.forward, around a cached call
        out = run_target(target, torch.tensor([ids]), cache, **(attention or {}))
    return out.logits[0], target.aux_features(captured)[0]


@torch.no_grad()
def plain_generate(
    target: TargetModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_ids: list[int] | None = None,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> SpecResult:
    """The baseline: one KV-cached target forward per token (greedy, or sampled at temperature > 0)."""
    started = time.perf_counter()
    stops = set(target.eos_token_ids if stop_ids is None else stop_ids)
    if max_new_tokens <= 0:
        return SpecResult([], 0)
    clock, cache = Clock(), DynamicCache()
    with clock("target"):
        out = run_target(target, torch.tensor([prompt_ids]), cache, last_only=True)
    tokens, forwards = [pick_token(out.logits[0, -1], temperature, generator)], 1
    while True:
        result, done, stopped = finish(tokens, max_new_tokens, stops)
        if done:
            elapsed = time.perf_counter() - started
            return SpecResult(result, forwards, stopped=stopped, target_s=clock.seconds["target"], total_s=elapsed)
        with clock("target"):
            out = run_target(target, torch.tensor([tokens[-1:]]), cache)
        tokens.append(pick_token(out.logits[0, -1], temperature, generator))
        forwards += 1


def _draft_tree(
    draft: Eagle3Draft,
    root_hidden: torch.Tensor,
    origin: int,
    caches: list[KVCache],
    shape: TreeShape,
    temperature: float,
    generator: torch.Generator | None,
    clock: Clock | None = None,
) -> DraftTree:
    """Grow the EAGLE-2 tree from the step-0 hidden state at `origin` ([1, 1, H]).

    Every drafted node is a candidate; the final rerank keeps the `total_tokens` best by cumulative draft
    log-probability. A child's score is at most its parent's, and a stable sort over nodes in creation
    order puts a parent before an equal-scoring child, so every kept node's ancestors are kept too.
    Sampling (temperature > 0) is for chains only: the single child is drawn from the draft's distribution.
    """
    device = root_hidden.device
    clock = clock or Clock()
    prefix = caches[0].length  # step-0 keys, positions 0..origin
    tree = DraftTree()
    scores: list[float] = []
    slot_of: dict[int, int] = {}  # draft cache slot of each expanded node's keys

    def add_children(hidden: torch.Tensor, parents: list[int]) -> list[int]:
        """Children of `parents` from their hidden states [len(parents), H]; returns the new node ids."""
        with clock("draft"):
            logits = draft.logits(hidden)
        children, logp, q = choose_children(draft, logits, shape.top_k, temperature, generator)
        proposals = [None] * len(parents) if q is None else list(q)
        new = []
        for parent, tokens, token_logp, proposal in zip(
            parents, children.tolist(), logp.tolist(), proposals, strict=True
        ):
            base = scores[parent] if parent >= 0 else 0.0
            depth = tree.depths[parent] + 1 if parent >= 0 else 1
            for token, child_logp in zip(tokens, token_logp, strict=True):
                tree.tokens.append(token)
                tree.parents.append(parent)
                tree.depths.append(depth)
                tree.proposals.append(proposal)
                scores.append(base + child_logp)
                new.append(len(tree.tokens) - 1)
        return new

    frontier = add_children(root_hidden[0, -1:], [-1])
    hidden_of: dict[int, torch.Tensor] = {}
    for _ in range(shape.depth - 1):
        # Keep the top_k frontier nodes by score, then run them: each reads its parent's hidden state.
        frontier = sorted(frontier, key=lambda i: -scores[i])[: shape.top_k]
        parent_hidden = torch.stack(
            [hidden_of[tree.parents[i]] if tree.parents[i] >= 0 else root_hidden[0, -1] for i in frontier]
        )
        ids = torch.tensor([[tree.tokens[i] for i in frontier]], device=device)
        positions = torch.tensor([[origin + tree.depths[i] for i in frontier]], device=device)
        past = caches[0].length
        mask = torch.zeros(len(frontier), past + len(frontier), dtype=torch.bool, device=device)
        mask[:, :prefix] = True
        for row, node in enumerate(frontier):
            slot_of[node] = past + row
            ancestor = node
            while ancestor >= 0:
                mask[row, slot_of[ancestor]] = True
                ancestor = tree.parents[ancestor]
        with clock("draft"):
            hidden = draft(parent_hidden[None], ids, positions, [MaskedAttend(c, mask) for c in caches])[0]
        for row, node in enumerate(frontier):
            hidden_of[node] = hidden[row]
        frontier = add_children(hidden, frontier)

    keep = sorted(sorted(range(len(scores)), key=lambda i: -scores[i])[: shape.total_tokens])
    renumber = {old: new for new, old in enumerate(keep)}
    kept = DraftTree()
    for old in keep:
        kept.tokens.append(tree.tokens[old])
        kept.parents.append(renumber[tree.parents[old]] if tree.parents[old] >= 0 else -1)
        kept.depths.append(tree.depths[old])
        kept.proposals.append(tree.proposals[old])
    return kept


def _draft_parallel(
    draft: Eagle3Draft, hidden: torch.Tensor, temperature: float, generator: torch.Generator | None, clock: Clock
) -> DraftTree:
    """A parallel draft's chain from the round's one forward: `hidden` [depth, H] holds the step-0 hidden state at
    the origin (the first token) and the mask slots' at origin + 1.. (the others), which attended causally among
    themselves after the verified prefix, exactly as vLLM's parallel drafting and `wingspan.train.ttt` compute."""
    with clock("draft"):
        logits = draft.logits(hidden)
    tokens, _, proposals = choose_children(draft, logits, 1, temperature, generator)
    depth = hidden.shape[0]
    return DraftTree(
        tokens=tokens[:, 0].tolist(),
        parents=list(range(-1, depth - 1)),
        depths=list(range(1, depth + 1)),
        proposals=[None] * depth if proposals is None else list(proposals),
    )


@torch.no_grad()
def speculative_generate(
    target: TargetModel,
    draft: Eagle3Draft,
    prompt_ids: list[int],
    max_new_tokens: int,
    num_draft_tokens: int = 3,
    stop_ids: list[int] | None = None,
    *,
    tree: TreeShape | None = None,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> SpecResult:
    """Speculative decoding of one prompt: a chain of `num_draft_tokens` drafts per round, or an EAGLE-2
    `tree`. At temperature 0 the output is the target's greedy decoding; above it, a sample of the target's
    distribution at that temperature (drawn with `generator`).

    Stops at the first stop id (default: the target's eos ids; the stop token is not returned) or after
    max_new_tokens. Near the end the draft depth shrinks, so that no round overshoots max_new_tokens.
    """
    started = time.perf_counter()
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens: must be >= 1, got {num_draft_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature: must be >= 0, got {temperature}")
    if not prompt_ids:
        raise ValueError("prompt_ids: at least one token is needed")
    check_compatible(target, draft)
    parallel = draft.config.draft_mode == "parallel"
    if parallel and tree is not None:
        raise ValueError("tree: a parallel draft drafts a chain (its mask slots), not a tree")
    shape = tree or TreeShape(num_draft_tokens, 1, num_draft_tokens)
    stops = set(target.eos_token_ids if stop_ids is None else stop_ids)
    if max_new_tokens <= 0:
        return SpecResult([], 0)
    device, dtype = draft.fc.weight.device, draft.fc.weight.dtype
    clock = Clock()
    sample_drafts = temperature if shape.top_k == 1 else 0.0  # trees propose top-k children, chains sample

    # Prefill: the target over the prompt gives the first new token and aux features f_0..f_{P-1}.
    target_cache = DynamicCache()
    with clock("target"):
        logits, aux = _target_step(target, prompt_ids, target_cache)
    sequence = list(prompt_ids) + [pick_token(logits[-1], temperature, generator)]
    result = SpecResult([], 1)
    draft_caches: list[KVCache] = new_kv_caches(draft)
    # f_p for positions origin+1.. not yet read by the draft, which start at `first_unread`.
    pending_aux, first_unread = aux, 0

    while True:
        new_tokens, done, result.stopped = finish(sequence[len(prompt_ids) :], max_new_tokens, stops)
        if done:
            return result.ended(new_tokens, clock, started)
        # Verified positions are 0..len(sequence)-2 (the last token has no target pass yet).
        depth = min(shape.depth, max_new_tokens - len(new_tokens) - 1)
        drafts = DraftTree()
        if depth > 0:
            # Step 0 over the newly verified positions p: (f_p, token p + 1) at RoPE position p.
            count = pending_aux.shape[0]
            origin = first_unread + count - 1
            # A parallel draft's mask slots (positions origin + 1..) join this forward: one per round, as vLLM.
            slots = depth - 1 if parallel else 0
            positions = torch.arange(first_unread, origin + 1 + slots, device=device)[None]
            ids = torch.tensor([sequence[first_unread + 1 : first_unread + 1 + count]], device=device)
            with clock("draft"):
                projected = draft.project_aux(pending_aux[None].to(device, dtype))
                if slots:
                    slot_hidden, slot_ids = draft.mask_slots(1, slots)
                    projected, ids = torch.cat([projected, slot_hidden], dim=1), torch.cat([ids, slot_ids], dim=1)
                hidden = draft(projected, ids, positions, draft_caches)[:, count - 1 :]
            root_hidden = hidden[:, :1]
            if parallel:
                drafts = _draft_parallel(draft, hidden[0], temperature, generator, clock)
            else:
                drafts = _draft_tree(
                    draft, root_hidden, origin, draft_caches, shape.shortened(depth), sample_drafts, generator, clock
                )
            for cache in draft_caches:  # keep the step-0 keys only (positions 0..origin)
                cache.crop(origin + 1)

        # Verify [last token, tree nodes] in one target forward.
        verified = len(sequence) - 1  # the target cache holds positions 0..verified-1
        attention = _tree_attention(drafts, verified, target)
        with clock("target"):
            logits, aux = _target_step(target, [sequence[-1]] + drafts.tokens, target_cache, attention)
        result.target_forwards += 1
        path, next_token = verify(drafts, logits, temperature, generator)
        result.accepted_per_round.append(len(path))
        result.drafted_per_round.append(max(drafts.depths, default=0))
        sequence += [drafts.tokens[node] for node in path] + [next_token]
        # Positions verified, verified + 1.. are now the root and the accepted path; the rest were rejected.
        rows = [0] + [node + 1 for node in path]
        keep_rows(target_cache, verified, rows)
        if depth > 0:
            pending_aux, first_unread = aux[rows], verified
        else:  # the draft did not run this round: its unread features carry over
            pending_aux = torch.cat([pending_aux, aux[:1]])
