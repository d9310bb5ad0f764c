"""Where the target's side of a micro-batch comes from: the target run on it now, or a dump read from disk.

The trainer collates the records of a micro-batch and hands them to a feature source chosen once per run;
the source returns the `TTTBatch` the loss reads. `OnlineFeatures` runs the target here; the offline source,
`wingspan.data.hidden_states.DumpFeatures`, reads what `wingspan dump` stored. Both give the same tensors,
so the training loop is one loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from wingspan.data.template import TokenizedConversation
from wingspan.data.vocab import draft_to_target_ids
from wingspan.train.ttt import TTTBatch


@dataclass
class MicroBatch:
    """Records `indices`, right-padded to the longest."""

    indices: list[int]
    input_ids: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T] float, 0 on padding
    attention_mask: torch.Tensor  # [B, T] long, 1 on real tokens


FeatureSource = Callable[[MicroBatch], TTTBatch]


def collate(records: list[TokenizedConversation], indices: list[int], pad_id: int) -> MicroBatch:
    sequences = [records[i] for i in indices]
    length = max(len(s.input_ids) for s in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(len(sequences), length)
    attention = torch.zeros(len(sequences), length, dtype=torch.long)
    for row, s in enumerate(sequences):
        ids[row, : len(s.input_ids)] = torch.tensor(s.input_ids)
        loss_mask[row, : len(s.loss_mask)] = torch.tensor(s.loss_mask, dtype=torch.float)
        attention[row, : len(s.input_ids)] = 1
    return MicroBatch(list(indices), ids, loss_mask, attention)


class OnlineFeatures:
    """The target runs on every micro-batch; its logits are cut to the draft vocab here, once."""

    def __init__(self, target, d2t: torch.Tensor) -> None:
        self.target = target
        self.draft_vocab_ids = draft_to_target_ids(d2t)

    def __call__(self, micro: MicroBatch) -> TTTBatch:
        out = self.target.forward(micro.input_ids, micro.attention_mask)
        logits = out.logits
        # max().indices, not argmax(): the latter has no fast bf16 kernel on CPU (5x slower here).
        return TTTBatch(micro.input_ids, micro.loss_mask, out.aux_hidden,
                        logits[..., self.draft_vocab_ids.to(logits.device)], logits.max(dim=-1).indices)
