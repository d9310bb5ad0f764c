"""The pieces every decoder here is built from: the draft's shape (TreeShape), a round's drafts (DraftTree) and
their verification (verify), token choice (choose_children, pick_token), the end of an output (finish), the
cached target call (run_target), the per-part clock and the result (SpecResult). `speculative` decodes one
prompt with them, `batched` many at once.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from wingspan.errors import ConfigError, ModelError
from wingspan.models.draft import Eagle3Draft
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
            raise ConfigError(f"tree shape: depth, top_k and total_tokens must be >= 1, got {self}")
        most = self.nodes_drafted(self.depth)
        if self.total_tokens > most:
            raise ConfigError(f"tree shape {self}: total_tokens can be at most top_k + (depth - 1) * top_k^2 = {most}")

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

    def ended(self, tokens: list[int], clock: Clock, started: float) -> SpecResult:
        """This result with its final tokens and the clock's times, for a call that began at `started`."""
        self.tokens = tokens
        self.target_s, self.draft_s = clock.seconds["target"], clock.seconds["draft"]
        self.total_s = time.perf_counter() - started
        return self


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


class Clock:
    """Wall time per part of a round, `with clock("target"):`. Only the model calls are timed: everything
    else (tree building, masks, cache bookkeeping, Python) is the engine's overhead."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {"target": 0.0, "draft": 0.0}
        self.part = ""

    def __call__(self, part: str) -> Clock:
        self.part = part
        return self

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.seconds[self.part] += time.perf_counter() - self.start


def run_target(target: TargetModel, input_ids: torch.Tensor, cache: DynamicCache, last_only: bool = False, **extra):
    """One cached target forward over input_ids [B, T]. The cache argument is `cache` in recent
    transformers, where `past_key_values` is deprecated, and `past_key_values` in older ones."""
    model = target.model
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    if last_only:
        extra["logits_to_keep"] = 1
    return model(input_ids=input_ids.to(target.device), use_cache=True, **{name: cache}, **extra)


def keep_rows(cache: DynamicCache, start: int, rows: list[int]) -> None:
    """Keep cache positions start + rows (ascending), moved to start, start + 1, ...; drop the rest."""
    if rows != list(range(len(rows))):
        index = torch.tensor([start + r for r in rows])
        for layer in cache.layers:
            layer.keys[..., start : start + len(rows), :] = layer.keys[..., index, :]
            layer.values[..., start : start + len(rows), :] = layer.values[..., index, :]
    excess = cache.get_seq_length() - start - len(rows)
    if excess:  # a negative crop removes that many positions, in old and new transformers alike
        cache.crop(-excess)


def choose_children(
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


def pick_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def finish(tokens: list[int], max_new_tokens: int, stops: set[int]) -> tuple[list[int], bool, bool]:
    """Truncate at the first stop token and at max_new_tokens: (tokens, done, stopped)."""
    tokens = tokens[:max_new_tokens]
    end = next((i for i, t in enumerate(tokens) if t in stops), None)
    if end is not None:
        return tokens[:end], True, True
    return tokens, len(tokens) >= max_new_tokens, False


def check_compatible(target: TargetModel, draft: Eagle3Draft) -> None:
    config = draft.config
    if list(config.aux_layer_ids) != list(target.aux_layer_ids):
        raise ModelError(f"draft aux_layer_ids {config.aux_layer_ids} != target aux_layer_ids {target.aux_layer_ids}")
    if config.target_hidden_size != target.hidden_size or config.vocab_size != target.vocab_size:
        raise ModelError(
            f"draft (target_hidden_size {config.target_hidden_size}, vocab {config.vocab_size}) does not fit the "
            f"target (hidden {target.hidden_size}, vocab {target.vocab_size})"
        )


def verify(
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
