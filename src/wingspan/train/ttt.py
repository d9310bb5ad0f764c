"""Training-time test (TTT): the draft unrolled over its own outputs, as inference runs it.

Step 0 at position i reads (f_i, x_{i+1}) and predicts p_{i+1}, the target's distribution for x_{i+2}.
Step j reads the draft's own step j-1 output at i and x_{i+j+1}, at RoPE position i+j, and predicts
p_{i+j+1}. In every layer's cache a step-j query at i sees the step-0 keys at positions <= i and the keys
of steps 1..j at i itself: what a chain draft has in its KV cache after j steps from origin i.

A parallel draft (P-EAGLE) unrolls the same way, except that step j >= 1 reads the mask slot's inputs
(fc(mask_hidden), the mask token) instead of the previous step's output and x_{i+j+1}: vLLM's mask slot j
of a round from origin i, which sees the context up to i and the slots before it, and predicts p_{i+j+1}.

A row may hold several conversations back to back (packing, `wingspan.data.batching`): positions then
restart at 0 at each one, attention stops at its start, and a step counts only when the token it predicts
lies in the same conversation, so each conversation computes exactly what it computes alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from wingspan.config import LossName
from wingspan.data.batching import block_causal_mask, document_ids, is_packed
from wingspan.models.draft import Eagle3Draft


class TTTCache:
    """One layer's keys across the unroll, attended without a [T, T * steps] score matrix.

    Step 0 is plain causal attention. At step j each query also sees j "diagonal" keys (its own position
    in steps 1..j). Those are folded into a single causal SDPA call over the step-0 keys: j sink keys are
    put in front whose score for query i is exactly the diagonal score q_i . k_s[i] (carried in j extra
    query dimensions), and whose values are one-hot in j extra value channels. SDPA then returns the causal
    part already normalised by the full softmax denominator, plus the diagonal attention weights, from
    which the diagonal values are mixed in. j dummy queries in front shift the causal diagonal so that
    every real query sees all sinks: no mask tensor, and SDPA's fused kernel skips the upper triangle and
    never stores scores, so memory stays linear in T.

    Packed rows need a mask (attention must stop at each conversation's start): `mask` is `sink_mask`'s
    block-causal [B, 1, S + T, S + T] bool with S >= j sink rows and columns in front, and step j reads its
    bottom-right corner of size j + T. SDPA's fused CPU kernel takes it at about the causal path's cost.
    """

    def __init__(self, mask: torch.Tensor | None = None) -> None:
        self.mask = mask
        self.k0: torch.Tensor | None = None
        self.v0: torch.Tensor | None = None
        self.diagonal_k: list[torch.Tensor] = []
        self.diagonal_v: list[torch.Tensor] = []

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.k0 is None:
            self.k0, self.v0 = k, v
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **self._causal(0))
        self.diagonal_k.append(k)
        self.diagonal_v.append(v)
        batch, heads, _, head_dim = q.shape
        kv_heads = k.shape[1]
        group = heads // kv_heads
        sinks = len(self.diagonal_k)
        diag_k = torch.stack(self.diagonal_k, dim=-2).repeat_interleave(group, dim=1)  # [B, h, T, j, d]
        diag_v = torch.stack(self.diagonal_v, dim=-2).repeat_interleave(group, dim=1)
        diag_scores = torch.einsum("bhtd,bhtsd->bhts", q, diag_k)  # unscaled: SDPA applies `scale`
        q_ext = F.pad(torch.cat([q, diag_scores], dim=-1), (0, 0, sinks, 0))  # dummy queries in front
        eye = torch.eye(sinks, dtype=q.dtype, device=q.device)
        sink_rows = torch.cat([eye.new_zeros(sinks, head_dim), eye], dim=-1).expand(batch, kv_heads, -1, -1)
        k_ext = torch.cat([sink_rows, F.pad(self.k0, (0, sinks))], dim=2)
        v_ext = torch.cat([sink_rows, F.pad(self.v0, (0, sinks))], dim=2)
        out = F.scaled_dot_product_attention(
            q_ext, k_ext, v_ext, scale=head_dim**-0.5, enable_gqa=True, **self._causal(sinks)
        )[:, :, sinks:]
        causal_part, diag_weights = out[..., :head_dim], out[..., head_dim:]
        return causal_part + torch.einsum("bhts,bhtsd->bhtd", diag_weights, diag_v)

    def _causal(self, sinks: int) -> dict:
        """SDPA's causality argument with `sinks` sinks in front: the plain causal flag, or the mask's corner."""
        if self.mask is None:
            return {"is_causal": True}
        skip = self.mask.shape[-1] - self.k0.shape[2] - sinks
        return {"attn_mask": self.mask[..., skip:, skip:]}


def sink_mask(positions: torch.Tensor, sinks: int) -> torch.Tensor:
    """`block_causal_mask(positions)` with `sinks` rows and columns in front, all True: every query sees the
    sinks, and the dummy queries (whose outputs are dropped) see everything, so no row is all-masked."""
    return F.pad(block_causal_mask(positions), (sinks, 0, sinks, 0), value=True)


@dataclass
class TTTBatch:
    """One micro-batch: rows of conversations (`wingspan.data.batching`) and what the target said about them."""

    input_ids: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T], 1 on the tokens in the loss (0 on padding)
    positions: torch.Tensor  # [B, T] position inside its conversation (0 starts one)
    aux_hidden: torch.Tensor  # [B, T, num_aux * H_target]
    target_logits: torch.Tensor  # [B, T, draft_vocab]: the target's logits of the draft vocab's tokens
    target_argmax: torch.Tensor  # [B, T]: the target's top token over its whole vocab (a target id)


@dataclass
class TTTResult:
    loss: torch.Tensor  # scalar: sum over steps of weight_j * loss_sum_j / normaliser_j
    loss_sum: torch.Tensor  # [steps] the objective summed over counted positions (detached)
    correct: torch.Tensor  # [steps] positions where draft argmax == target argmax
    count: torch.Tensor  # [steps] counted positions


# added to the acceptance rate under the LK loss's log: a draft with no mass on the target's tokens gets a finite
# loss, and a gradient that still points towards them
ACCEPTANCE_FLOOR = 1e-6


def shift_left(x: torch.Tensor, by: int, fill: float | int = 0) -> torch.Tensor:
    """x[:, i] <- x[:, i + by] along dim 1, filling the end (all of it when `by` reaches past it)."""
    if by == 0:
        return x
    pad = x.new_full((x.shape[0], min(by, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat([x[:, by:], pad], dim=1)


def step_masks(loss_mask: torch.Tensor, positions: torch.Tensor, steps: int) -> torch.Tensor:
    """[steps, B, T]: step j at origin i is counted when x_{i+j+2} (the token it predicts) is in the loss mask
    and in origin i's conversation."""
    documents = document_ids(positions)
    return torch.stack(
        [shift_left(loss_mask, j + 2) * (shift_left(documents, j + 2, fill=-1) == documents) for j in range(steps)]
    )


def repeated_bigrams(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: token t and the one before it occurred as a pair earlier in t's conversation, so that
    prompt lookup would propose the token after their earlier occurrence. Vectorised; on a GPU `torch.unique`
    reads its output size back (one host sync per call, only with a repeat_weight)."""
    batch, length = input_ids.shape
    seen = torch.zeros_like(input_ids, dtype=torch.bool)
    if length < 2:
        return seen
    rows = torch.arange(batch, device=input_ids.device)[:, None].expand(batch, length - 1)
    order = torch.arange(batch * (length - 1), device=input_ids.device)
    inside = positions[:, 1:] > 0  # the pair's first token is in its second token's conversation
    # a pair that straddles two conversations gets a conversation of its own, so that it matches nothing
    documents = torch.where(inside, document_ids(positions)[:, 1:], -1 - order.view(batch, length - 1))
    pairs = torch.stack([rows, documents, input_ids[:, :-1], input_ids[:, 1:]], dim=-1).reshape(-1, 4)
    _, pair_id = torch.unique(pairs, dim=0, return_inverse=True)
    first = torch.full_like(order, order.numel()).scatter_reduce(0, pair_id, order, reduce="amin")
    # row-major order: an earlier index of the same (row, conversation, pair) is an earlier position
    repeated = (first[pair_id] < order).view(batch, length - 1)
    seen[:, 1:] = repeated
    return seen


def step_weights_of(
    loss_mask: torch.Tensor, positions: torch.Tensor, input_ids: torch.Tensor, steps: int, repeat_weight: float
) -> torch.Tensor:
    """[steps, B, T] float: `step_masks`, with `repeat_weight` where the context of step j at origin i (up to
    x_{i+j+1}) ends in a repeated bigram (`repeated_bigrams`): what prompt lookup would copy."""
    masks = step_masks(loss_mask, positions, steps).float()
    if repeat_weight == 1.0:
        return masks
    repeated = repeated_bigrams(input_ids, positions)
    scale = torch.stack([1 + (repeat_weight - 1) * shift_left(repeated, j + 1).float() for j in range(steps)])
    return masks * scale


def unroll(
    draft: Eagle3Draft, aux_hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, steps: int
) -> Iterator[torch.Tensor]:
    """Yield the draft's pre-norm hidden states [B, T, H] of steps 0..steps-1 (index i = origin i).

    positions [B, T]: each token's position inside its conversation. Rows of one conversation each take
    SDPA's causal path; packed rows share one block-causal mask, built here once for all layers and steps.
    """
    mask = sink_mask(positions, steps - 1) if is_packed(positions) else None
    caches = [TTTCache(mask) for _ in draft.layers]
    hidden = draft.project_aux(aux_hidden.to(draft.fc.weight.dtype))
    parallel = draft.config.draft_mode == "parallel"
    for j in range(steps):
        if parallel and j > 0:
            slot_hidden, slot_ids = draft.mask_slots(*input_ids.shape)
            yield draft(slot_hidden, slot_ids, positions + j, caches)
        else:
            hidden = draft(hidden, shift_left(input_ids, j + 1), positions + j, caches)
            yield hidden


def ttt_forward(
    draft: Eagle3Draft,
    batch: TTTBatch,
    steps: int,
    step_weights: list[float],
    normaliser: torch.Tensor | None = None,
    repeat_weight: float = 1.0,
    objective: LossName = "kl",
    topk: tuple[float, int] = (0.0, 10),
) -> TTTResult:
    """Unroll the draft `steps` times and score each step against the target.

    The target distribution is restricted to the draft vocab and renormalised. `objective` "kl": the soft
    cross-entropy (forward KL up to a constant); "lk": the negative log of the acceptance rate that sampling
    from the draft would have, -log sum_v min(p_v, q_v) (the LK^alpha loss of Samarin et al. 2026, which
    scores acceptance instead of the whole distribution). `topk` (weight, K) adds HASS's top-K term with that
    weight: -sum over the target's K most likely tokens v of p_v log q_v. Only counted rows (loss-masked tokens
    whose prediction lies inside their conversation) go through the vocab projection. `repeat_weight` weighs
    the positions where prompt lookup would propose (`step_weights_of`); `normaliser` [steps] divides each
    step's weighted loss sum: by default this micro-batch's weights, but a trainer passes those of the whole
    optimizer step so that accumulation and data parallelism weight every token alike. The loss sums returned
    are not weighted by position (comparable across weightings).
    """
    input_ids, loss_mask = batch.input_ids, batch.loss_mask
    target_p = torch.softmax(batch.target_logits.float(), dim=-1)
    target_argmax = batch.target_argmax
    weights = step_weights_of(loss_mask, batch.positions, input_ids, steps, repeat_weight)
    masks = weights > 0
    counts = masks.sum(dim=(1, 2)).float()
    if normaliser is None:
        normaliser = weights.sum(dim=(1, 2)).clamp(min=1)

    topk_weight, k = topk
    loss = torch.zeros((), device=input_ids.device)
    loss_sums, correct = [], []
    for j, hidden in enumerate(unroll(draft, batch.aux_hidden, input_ids, batch.positions, steps)):
        # Origin i predicts the target's distribution at position i + j + 1; origins past T - j - 2
        # predict beyond the row and are never counted, so slices replace shifted copies.
        valid = max(0, input_ids.shape[1] - (j + 1))
        rows = masks[j][:, :valid]
        logp = torch.log_softmax(draft.logits(hidden[:, :valid][rows]).float(), dim=-1)
        p = target_p[:, j + 1 :][rows]
        if objective == "lk":
            per_position = -torch.log(torch.minimum(p, logp.exp()).sum(dim=-1) + ACCEPTANCE_FLOOR)
        else:
            per_position = -(p * logp).sum(dim=-1)
        if topk_weight:
            top = p.topk(k, dim=-1)
            per_position = per_position - topk_weight * (top.values * logp.gather(-1, top.indices)).sum(dim=-1)
        loss_sum = per_position.sum()
        weighted = loss_sum if repeat_weight == 1.0 else (per_position * weights[j][:, :valid][rows]).sum()
        loss = loss + step_weights[j] * weighted / normaliser[j]
        hits = draft.draft_to_target(logp.detach().max(dim=-1).indices) == target_argmax[:, j + 1 :][rows]
        loss_sums.append(loss_sum.detach())
        correct.append(hits.sum().float())
    return TTTResult(loss, torch.stack(loss_sums), torch.stack(correct), counts)


class TTTLoss(torch.nn.Module):
    """`ttt_forward` of `draft` as a module's forward: the call DDP and FSDP hook to synchronise gradients
    and gather sharded weights, which they do for a module's forward only, not for `draft.logits` or
    `draft.project_aux` called from outside it."""

    def __init__(
        self,
        draft: Eagle3Draft,
        steps: int,
        step_weights: list[float],
        repeat_weight: float = 1.0,
        objective: LossName = "kl",
        topk: tuple[float, int] = (0.0, 10),
    ) -> None:
        super().__init__()
        self.draft = draft
        self.steps = steps
        self.step_weights = step_weights
        self.repeat_weight = repeat_weight
        self.objective = objective
        self.topk = topk

    def forward(self, batch: TTTBatch, normaliser: torch.Tensor | None = None) -> TTTResult:
        return ttt_forward(
            self.draft, batch, self.steps, self.step_weights, normaliser, self.repeat_weight, self.objective, self.topk
        )


def simulated_acceptance_length(step_accuracy: list[float], num_draft_tokens: int) -> float:
    """1 + sum_k prod_{j<=k} acc_j: the expected tokens per target forward if step j were accepted with
    probability acc_j given steps < j were. TTT accuracies are measured on teacher tokens, so this is an
    optimistic estimate; `wingspan eval` measures the real figure."""
    tau, survive = 1.0, 1.0
    for acc in step_accuracy[:num_draft_tokens]:
        survive *= acc
        tau += survive
    return tau
