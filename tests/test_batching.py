"""Micro-batch plans (padded and packed) and the row layout that collate gives them."""

import pytest
import torch

from wingspan.config import TrainConfig
from wingspan.data.batching import (
    block_causal_mask,
    collate,
    document_ids,
    padding_fraction,
    plan_epoch,
    plan_packed,
    plan_padded,
)
from wingspan.data.template import TokenizedConversation

LENGTHS = [5, 30, 17, 8, 31, 2, 9, 16] * 40


def records_of(lengths: list[int]) -> list[TokenizedConversation]:
    return [TokenizedConversation(list(range(10 * k, 10 * k + n)), [0] + [1] * (n - 1)) for k, n in enumerate(lengths)]


def covered(plan) -> list[int]:
    return sorted(i for batch in plan for row in batch for i in row)


def test_plan_padded_respects_budget_and_is_deterministic():
    plan = plan_padded(LENGTHS, 64, seed=3, epoch=1, shuffle=True)
    assert plan == plan_padded(LENGTHS, 64, seed=3, epoch=1, shuffle=True)
    assert plan != plan_padded(LENGTHS, 64, seed=3, epoch=2, shuffle=True)
    assert covered(plan) == list(range(len(LENGTHS)))
    assert all(len(row) == 1 for batch in plan for row in batch)
    assert all(max(LENGTHS[row[0]] for row in b) * len(b) <= 64 for b in plan)


def test_plan_packed_fills_rows_with_whole_records():
    plan = plan_packed(LENGTHS, 32, 96, seed=3, epoch=1, shuffle=True)
    assert plan == plan_packed(LENGTHS, 32, 96, seed=3, epoch=1, shuffle=True)
    assert plan != plan_packed(LENGTHS, 32, 96, seed=3, epoch=2, shuffle=True)
    assert covered(plan) == list(range(len(LENGTHS)))
    assert all(len(batch) <= 3 for batch in plan)  # 96 // 32 rows
    assert all(sum(LENGTHS[i] for i in row) <= 32 for batch in plan for row in batch)
    assert any(len(row) >= 3 for batch in plan for row in batch)
    # 118 tokens per 8 records fill 32-token rows almost exactly; one record per row pads 8 % here
    padded = plan_padded(LENGTHS, 96, 3, 1, True)
    assert padding_fraction(plan, LENGTHS) < 0.02 and padding_fraction(padded, LENGTHS) > 0.05
    assert len(plan) < len(padded)


def test_plan_packed_refuses_records_longer_than_a_row():
    with pytest.raises(ValueError, match="record 1 with 30 tokens"):
        plan_packed([5, 30], 16, 32, seed=0, epoch=0, shuffle=False)
    with pytest.raises(ValueError, match="does not fit a micro-batch"):
        plan_packed([5], 64, 32, seed=0, epoch=0, shuffle=False)


def test_plan_epoch_follows_the_config():
    packed = TrainConfig(max_length=32, batch_tokens=96)
    padded = TrainConfig(max_length=32, batch_tokens=96, pack=False)
    assert plan_epoch(LENGTHS, packed, 2, True) == plan_packed(LENGTHS, 32, 96, 0, 2, True)
    assert plan_epoch(LENGTHS, padded, 2, True) == plan_padded(LENGTHS, 96, 0, 2, True)


def test_collate_lays_records_back_to_back_with_restarting_positions():
    records = records_of([3, 2, 4, 1])
    micro = collate(records, [[0, 1], [2]], pad_id=-1)
    assert micro.input_ids.tolist() == [[0, 1, 2, 10, 11], [20, 21, 22, 23, -1]]
    assert micro.loss_mask.tolist() == [[0, 1, 1, 0, 1], [0, 1, 1, 1, 0]]
    assert micro.positions.tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]  # padding continues its row
    assert micro.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert document_ids(micro.positions).tolist() == [[1, 1, 1, 2, 2], [1, 1, 1, 1, 1]]
    assert micro.target_attention_mask() is None  # the target builds its mask from the positions
    mask = block_causal_mask(micro.positions)
    assert mask.shape == (2, 1, 5, 5)
    two_blocks = [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]
    assert mask[0, 0].int().tolist() == two_blocks
    assert torch.equal(mask[1, 0], torch.ones(5, 5, dtype=torch.bool).tril())
    unpacked = collate(records, [[0], [3]], pad_id=-1)
    assert torch.equal(unpacked.target_attention_mask(), unpacked.attention_mask)  # the model's own causal path
