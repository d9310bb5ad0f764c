"""Speculative decoding at batch size 1 (gpt-fast style): chain or EAGLE-2 tree drafts, greedy or sampled.

One round, with `origin` the position of the last token whose target aux features the draft has seen:
  1. the draft proposes a tree (a chain is a tree with one child per node): step 0 at `origin` reads the
     target's features and gives the children of the root; a node at depth j reads its parent's pre-norm
     hidden state and its own token at RoPE position origin + j, and attends to the verified prefix and its
     ancestors only (exactly the TTT semantics of `tests/test_ttt.py::chain_logits` along every path);
  2. one target forward over [last token, tree nodes] with a tree attention mask verifies every node:
     greedily (follow the child equal to the target's argmax) or by rejection sampling; the target's own
     next token is always added (the "bonus" token);
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

import inspect
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from wingspan.models.draft import Eagle3Draft, KVCache, MaskedAttend, new_kv_caches
from wingspan.models.target import TargetModel


@dataclass(frozen=True)
class TreeShape:
    """EAGLE-2 dynamic tree: `depth` draft steps; each step expands the `top_k` best nodes (by cumulative
    draft log-probability) into their `top_k` best children; the best `total_tokens` of all nodes drafted
    are verified. A chain of K drafts is TreeShape(K, 1, K)."""

    depth: int
    top_k: int
    total_tokens: int

    def __post_init__(self) -> None:
        if min(self.depth, self.top_k, self.total_tokens) < 1:
            raise ValueError(f"tree shape: depth, top_k and total_tokens must be >= 1, got {self}")
        most = self.nodes_drafted(self.depth)
        if self.total_tokens > most:
            raise ValueError(f"tree shape {self}: total_tokens can be at most top_k + (depth - 1) * top_k^2 = {most}")

    def nodes_drafted(self, depth: int) -> int:
        """How many nodes `depth` steps draft: top_k children of the root, then top_k^2 per step."""
        return self.top_k + (depth - 1) * self.top_k**2

    def shortened(self, depth: int) -> TreeShape:
        """This shape cut to `depth` steps (near max_new_tokens), keeping at most what they draft."""
        return TreeShape(depth, self.top_k, min(self.total_tokens, self.nodes_drafted(depth)))


@dataclass
class SpecResult:
    tokens: list[int]  # the new tokens, without the stop token (as `TargetModel.generate`)
    target_forwards: int  # prefill included
    accepted_per_round: list[int] = field(default_factory=list)  # draft tokens accepted in each verification
    drafted_per_round: list[int] = field(default_factory=list)  # draft depth proposed in each round
    stopped: bool = False  # ended on a stop token (False: hit max_new_tokens)
    target_s: float = 0.0  # wall time in target forwards (prefill included)
    draft_s: float = 0.0  # wall time in draft forwards
    total_s: float = 0.0  # wall time of the whole call

    @property
    def acceptance_length(self) -> float:
        """Mean tokens per verification round (accepted drafts + the target's own token)."""
        rounds = self.accepted_per_round
        return 1.0 + sum(rounds) / len(rounds) if rounds else 1.0


@dataclass
class DraftTree:
    """Drafted nodes, parents before children; node i is row i + 1 of the verification (row 0 is the root,
    the last verified token)."""

    tokens: list[int] = field(default_factory=list)  # target vocab ids
    parents: list[int] = field(default_factory=list)  # -1: a child of the root
    depths: list[int] = field(default_factory=list)  # 1 for the root's children
    # The target-vocab distribution a token was sampled from; None: chosen deterministically (top-k).
    proposals: list[torch.Tensor | None] = field(default_factory=list)

    def children(self, node: int) -> list[int]:
        return [i for i, parent in enumerate(self.parents) if parent == node]

    def ancestry_mask(self) -> torch.Tensor:
        """[n + 1, n + 1] bool over [root, nodes]: each row sees the root, its ancestors and itself."""
        n = len(self.tokens)
        mask = torch.eye(n + 1, dtype=torch.bool)
        mask[:, 0] = True
        for i, parent in enumerate(self.parents):  # parents come first, so their rows are complete
            if parent >= 0:
                mask[i + 1] |= mask[parent + 1]
        return mask


class _Clock:
    """Wall time per part of a round, `with clock("target"):`. Only the model calls are timed: everything
    else (tree building, masks, cache bookkeeping, Python) is the engine's overhead."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {"target": 0.0, "draft": 0.0}
        self.part = ""

    def __call__(self, part: str) -> _Clock:
        self.part = part
        return self

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.seconds[self.part] += time.perf_counter() - self.start


def _run_target(target: TargetModel, input_ids: torch.Tensor, cache: DynamicCache, last_only: bool = False, **extra):
    """One cached target forward over input_ids [B, T]. The cache argument is `cache` in recent
    transformers, where `past_key_values` is deprecated, and `past_key_values` in older ones."""
    model = target.model
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    if last_only:
        extra["logits_to_keep"] = 1
    return model(input_ids=input_ids.to(target.device), use_cache=True, **{name: cache}, **extra)


def _choose(
    draft: Eagle3Draft, logits: torch.Tensor, top_k: int, temperature: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Children of each row of draft logits [n, draft_vocab]: (target ids [n, c], their draft log-probs
    [n, c], the target-vocab distributions [n, V] they were sampled from, or None when chosen greedily).
    Greedy: the top_k children. Sampling (chains): one child drawn from the draft; q is kept for verification."""
    logits = logits.float()
    if temperature > 0:
        q_draft = torch.softmax(logits / temperature, dim=-1)
        choice = torch.multinomial(q_draft, 1, generator=generator)
        q = torch.zeros(logits.shape[0], draft.config.vocab_size, device=logits.device)
        q[:, draft.draft_to_target(torch.arange(q_draft.shape[-1], device=logits.device))] = q_draft
        return draft.draft_to_target(choice), q_draft.gather(-1, choice).log(), q
    logp, choice = torch.log_softmax(logits, dim=-1).topk(top_k, dim=-1)
    return draft.draft_to_target(choice), logp, None


def _tree_attention(tree: DraftTree, past: int, target: TargetModel) -> dict[str, torch.Tensor]:
    """Target forward arguments for [root, nodes] after `past` cached positions: each row sees the cache, the
    root and its ancestors; node positions are past + depth. Empty for a chain (the causal default)."""
    if all(depth == i + 1 for i, depth in enumerate(tree.depths)):
        return {}
    device, rows = target.device, len(tree.tokens) + 1
    mask = torch.ones(rows, past + rows, dtype=torch.bool, device=device)
    mask[:, past:] = tree.ancestry_mask().to(device)
    positions = torch.tensor([[past] + [past + d for d in tree.depths]], device=device)
    return {"attention_mask": target.model_mask(mask[None, None]), "position_ids": positions}


@torch.no_grad()
def _target_step(
    target: TargetModel, ids: list[int], cache: DynamicCache, attention: dict[str, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the target over `ids` after what `cache` holds: (logits [T, V], aux [T, num_aux * H]).
    `attention`: a tree's mask and positions (`_tree_attention`)."""
    with target.capture_aux() as captured:  # the same hooks as TargetModel.forward, around a cached call
        out = _run_target(target, torch.tensor([ids]), cache, **(attention or {}))
    return out.logits[0], target.aux_features(captured)[0]


def _keep_rows(cache: DynamicCache, start: int, rows: list[int]) -> None:
    """Keep cache positions start + rows (ascending), moved to start, start + 1, ...; drop the rest."""
    if rows != list(range(len(rows))):
        index = torch.tensor([start + r for r in rows])
        for layer in cache.layers:
            layer.keys[..., start : start + len(rows), :] = layer.keys[..., index, :]
            layer.values[..., start : start + len(rows), :] = layer.values[..., index, :]
    excess = cache.get_seq_length() - start - len(rows)
    if excess:  # a negative crop removes that many positions, in old and new transformers alike
        cache.crop(-excess)


def _finish(tokens: list[int], max_new_tokens: int, stops: set[int]) -> tuple[list[int], bool, bool]:
    """Truncate at the first stop token and at max_new_tokens: (tokens, done, stopped)."""
    tokens = tokens[:max_new_tokens]
    end = next((i for i, t in enumerate(tokens) if t in stops), None)
    if end is not None:
        return tokens[:end], True, True
    return tokens, len(tokens) >= max_new_tokens, False


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


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
    clock, cache = _Clock(), DynamicCache()
    with clock("target"):
        out = _run_target(target, torch.tensor([prompt_ids]), cache, last_only=True)
    tokens, forwards = [_pick(out.logits[0, -1], temperature, generator)], 1
    while True:
        result, done, stopped = _finish(tokens, max_new_tokens, stops)
        if done:
            elapsed = time.perf_counter() - started
            return SpecResult(result, forwards, stopped=stopped, target_s=clock.seconds["target"], total_s=elapsed)
        with clock("target"):
            out = _run_target(target, torch.tensor([tokens[-1:]]), cache)
        tokens.append(_pick(out.logits[0, -1], temperature, generator))
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


def _draft_tree(
    draft: Eagle3Draft,
    root_hidden: torch.Tensor,
    origin: int,
    caches: list[KVCache],
    shape: TreeShape,
    temperature: float,
    generator: torch.Generator | None,
    clock: _Clock | None = None,
) -> DraftTree:
    """Grow the EAGLE-2 tree from the step-0 hidden state at `origin` ([1, 1, H]).

    Every drafted node is a candidate; the final rerank keeps the `total_tokens` best by cumulative draft
    log-probability. A child's score is at most its parent's, and a stable sort over nodes in creation
    order puts a parent before an equal-scoring child, so every kept node's ancestors are kept too.
    Sampling (temperature > 0) is for chains only: the single child is drawn from the draft's distribution.
    """
    device = root_hidden.device
    clock = clock or _Clock()
    prefix = caches[0].length  # step-0 keys, positions 0..origin
    tree = DraftTree()
    scores: list[float] = []
    slot_of: dict[int, int] = {}  # draft cache slot of each expanded node's keys

    def add_children(hidden: torch.Tensor, parents: list[int]) -> list[int]:
        """Children of `parents` from their hidden states [len(parents), H]; returns the new node ids."""
        with clock("draft"):
            logits = draft.logits(hidden)
        children, logp, q = _choose(draft, logits, shape.top_k, temperature, generator)
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


def _verify(
    tree: DraftTree, logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """Walk down from the root (row 0 of `logits`): the accepted node path and the target's next token."""
    path: list[int] = []
    node = -1
    while True:
        row = logits[node + 1]
        children = tree.children(node)
        if temperature == 0:
            token = int(row.argmax())
            node = next((c for c in children if tree.tokens[c] == token), None)
            if node is None:
                return path, token
        else:
            p = torch.softmax(row.float() / temperature, dim=-1)
            node = None
            for child in children:
                token, q = tree.tokens[child], tree.proposals[child]
                q_token = 1.0 if q is None else float(q[token])
                if float(torch.rand((), generator=generator)) * q_token < float(p[token]):
                    node = child
                    break
                if q is None:  # a deterministic proposal: the residual is p without that token
                    p[token] = 0.0
                else:
                    p = (p - q).clamp_min(0.0)
                p = p / p.sum()
            if node is None:
                return path, int(torch.multinomial(p, 1, generator=generator))
        path.append(node)


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
    _check_compatible(target, draft)
    shape = tree or TreeShape(num_draft_tokens, 1, num_draft_tokens)
    stops = set(target.eos_token_ids if stop_ids is None else stop_ids)
    if max_new_tokens <= 0:
        return SpecResult([], 0)
    device, dtype = draft.fc.weight.device, draft.fc.weight.dtype
    clock = _Clock()
    sample_drafts = temperature if shape.top_k == 1 else 0.0  # trees propose top-k children, chains sample

    # Prefill: the target over the prompt gives the first new token and aux features f_0..f_{P-1}.
    target_cache = DynamicCache()
    with clock("target"):
        logits, aux = _target_step(target, prompt_ids, target_cache)
    sequence = list(prompt_ids) + [_pick(logits[-1], temperature, generator)]
    result = SpecResult([], 1)
    draft_caches: list[KVCache] = new_kv_caches(draft)
    # f_p for positions origin+1.. not yet read by the draft, which start at `first_unread`.
    pending_aux, first_unread = aux, 0

    while True:
        new_tokens, done, result.stopped = _finish(sequence[len(prompt_ids) :], max_new_tokens, stops)
        if done:
            result.tokens = new_tokens
            result.target_s, result.draft_s = clock.seconds["target"], clock.seconds["draft"]
            result.total_s = time.perf_counter() - started
            return result
        # Verified positions are 0..len(sequence)-2 (the last token has no target pass yet).
        depth = min(shape.depth, max_new_tokens - len(new_tokens) - 1)
        drafts = DraftTree()
        if depth > 0:
            # Step 0 over the newly verified positions p: (f_p, token p + 1) at RoPE position p.
            count = pending_aux.shape[0]
            positions = torch.arange(first_unread, first_unread + count, device=device)[None]
            ids = torch.tensor([sequence[first_unread + 1 : first_unread + 1 + count]], device=device)
            with clock("draft"):
                projected = draft.project_aux(pending_aux[None].to(device, dtype))
                root_hidden = draft(projected, ids, positions, draft_caches)[:, -1:]
            origin = first_unread + count - 1
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
        path, next_token = _verify(drafts, logits, temperature, generator)
        result.accepted_per_round.append(len(path))
        result.drafted_per_round.append(max(drafts.depths, default=0))
        sequence += [drafts.tokens[node] for node in path] + [next_token]
        # Positions verified, verified + 1.. are now the root and the accepted path; the rest were rejected.
        rows = [0] + [node + 1 for node in path]
        _keep_rows(target_cache, verified, rows)
        if depth > 0:
            pending_aux, first_unread = aux[rows], verified
        else:  # the draft did not run this round: its unread features carry over
            pending_aux = torch.cat([pending_aux, aux[:1]])
