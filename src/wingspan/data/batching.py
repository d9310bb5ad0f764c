"""Micro-batches: which conversations train together, and how they are laid out in rows.

A plan is a list of micro-batches, a micro-batch a list of rows, a row a list of record indices laid back
to back. Two planners, both deterministic in (seed, epoch), shuffled per epoch, covering every record once:

- `plan_padded`: one conversation per row, rows right-padded to the longest of the micro-batch, at most
  `batch_tokens` padded tokens (lengths sorted in windows, so that padding stays small).
- `plan_packed`: rows of at most `row_tokens` (= max_length) holding whole conversations back to back, at most
  `batch_tokens // row_tokens` rows: nearly no padding. Positions restart at 0 at each conversation and
  attention never crosses one (`block_causal_mask`), so a packed conversation computes what it computes alone.

`positions` carry the document structure: a conversation starts wherever a position is 0.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from wingspan.config import TrainConfig
from wingspan.data.template import TokenizedConversation

Plan = list[list[list[int]]]  # micro-batches -> rows -> record indices
SORT_WINDOW = 64  # plan_padded sorts lengths within windows this large: little padding, order still shuffled
PACK_WINDOW = 256  # plan_packed packs windows this large: fuller rows the larger, at O(window * rows) cost


@dataclass
class MicroBatch:
    """Rows of records laid back to back (`rows`), right-padded to the longest row."""

    rows: list[list[int]]
    input_ids: torch.Tensor  # [R, T]
    loss_mask: torch.Tensor  # [R, T] float, 0 on padding
    positions: torch.Tensor  # [R, T] position inside its conversation; padding continues the row's last one
    attention_mask: torch.Tensor  # [R, T] long, 1 on real tokens

    def target_attention_mask(self) -> torch.Tensor | None:
        """The attention mask `TargetModel.forward` takes with `positions`: the [R, T] padding mask when every
        row is one conversation, else None: the target then builds the block-causal mask from the positions,
        which restart at 0 (padding continues the last one), with its layers' sliding windows."""
        return None if is_packed(self.positions) else self.attention_mask


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """[B, T]: which conversation of its row each token belongs to (1, 2, ...): a new one starts at position 0."""
    return (positions == 0).cumsum(dim=-1)


def is_packed(positions: torch.Tensor) -> bool:
    """Whether some row holds more than one conversation."""
    return bool((positions[:, 1:] == 0).any())


def block_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool, True where query t may attend key s: s <= t inside the same conversation. Every
    query sees itself, so no row is all-masked (a NaN softmax)."""
    documents = document_ids(positions)
    length = positions.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=positions.device).tril()
    return ((documents[:, :, None] == documents[:, None, :]) & causal)[:, None]


def collate(records: list[TokenizedConversation], rows: list[list[int]], pad_id: int) -> MicroBatch:
    """The micro-batch of `rows` (record indices each), every row's records back to back."""
    width = max(sum(len(records[i].input_ids) for i in row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(len(rows), width)
    positions = torch.zeros(len(rows), width, dtype=torch.long)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for index in row:
            record = records[index]
            n = len(record.input_ids)
            ids[r, at : at + n] = torch.tensor(record.input_ids)
            loss_mask[r, at : at + n] = torch.tensor(record.loss_mask, dtype=torch.float)
            positions[r, at : at + n] = torch.arange(n)
            attention[r, at : at + n] = 1
            at += n
        # Padding continues the last conversation's positions: it stays in that conversation's block (never
        # a block of its own), and an unpacked row's positions are plain 0..T-1.
        positions[r, at:] = torch.arange(n, n + width - at)
    return MicroBatch([list(row) for row in rows], ids, loss_mask, positions, attention)


def plan_padded(lengths: list[int], batch_tokens: int, seed: int, epoch: int, shuffle: bool) -> Plan:
    """One record per row, at most `batch_tokens` padded tokens per micro-batch.

    Records are sorted by length inside windows of SORT_WINDOW so that padding stays small while the order
    still changes every epoch; the micro-batches themselves are shuffled too.
    """
    rng = random.Random(seed * 100_003 + epoch)
    order = list(range(len(lengths)))
    if shuffle:
        rng.shuffle(order)
    order = [
        i
        for start in range(0, len(order), SORT_WINDOW)
        for i in sorted(order[start : start + SORT_WINDOW], key=lengths.__getitem__)
    ]
    batches: Plan = []
    current: list[list[int]] = []
    longest = 0
    for index in order:
        if current and max(longest, lengths[index]) * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append([index])
        longest = max(longest, lengths[index])
    if current:
        batches.append(current)
    if shuffle:
        rng.shuffle(batches)
    return batches


def plan_packed(lengths: list[int], row_tokens: int, batch_tokens: int, seed: int, epoch: int, shuffle: bool) -> Plan:
    """Whole records packed into rows of at most `row_tokens`, `batch_tokens // row_tokens` rows per micro-batch.

    The (shuffled) order is cut into windows of PACK_WINDOW records, each packed first-fit decreasing (longest
    first, into the first row with room), which leaves rows nearly full; consecutive rows form the
    micro-batches, which are shuffled.
    """
    if row_tokens > batch_tokens:
        raise ValueError(f"a packed row ({row_tokens} tokens) does not fit a micro-batch of {batch_tokens} tokens")
    too_long = [i for i, n in enumerate(lengths) if n > row_tokens]
    if too_long:
        raise ValueError(
            f"{len(too_long)} records are longer than a packed row ({row_tokens} tokens, max_length), "
            f"e.g. record {too_long[0]} with {lengths[too_long[0]]} tokens"
        )
    rng = random.Random(seed * 100_003 + epoch)
    order = list(range(len(lengths)))
    if shuffle:
        rng.shuffle(order)
    rows: list[list[int]] = []
    for start in range(0, len(order), PACK_WINDOW):
        rows += pack_rows(order[start : start + PACK_WINDOW], lengths, row_tokens)
    per_batch = batch_tokens // row_tokens
    batches = [rows[k : k + per_batch] for k in range(0, len(rows), per_batch)]
    if shuffle:
        rng.shuffle(batches)
    return batches


def pack_rows(indices: list[int], lengths: list[int], row_tokens: int) -> list[list[int]]:
    """First-fit decreasing: each record, longest first, goes into the first row it fits in."""
    rows: list[list[int]] = []
    room: list[int] = []
    for index in sorted(indices, key=lambda i: (-lengths[i], i)):
        row = next((r for r, free in enumerate(room) if free >= lengths[index]), len(rows))
        if row == len(rows):
            rows.append([])
            room.append(row_tokens)
        rows[row].append(index)
        room[row] -= lengths[index]
    return rows


def plan_epoch(lengths: list[int], config: TrainConfig, epoch: int, shuffle: bool) -> Plan:
    """The run's plan for `epoch`: packed (`config.pack`) or padded."""
    if config.pack:
        return plan_packed(lengths, config.max_length, config.batch_tokens, config.seed, epoch, shuffle)
    return plan_padded(lengths, config.batch_tokens, config.seed, epoch, shuffle)


def padding_fraction(plan: Plan, lengths: list[int]) -> float:
    """The share of a plan's micro-batch slots (rows x longest row) that are padding."""
    real = sum(lengths[i] for batch in plan for row in batch for i in row)
    slots = sum(len(batch) * max(sum(lengths[i] for i in row) for row in batch) for batch in plan)
    return 1 - real / slots
