"""Where the target's side of a micro-batch comes from: the target run on it now, or a dump read from disk.

The trainer collates the records of a micro-batch (`wingspan.data.batching`) and hands them to a feature
source chosen once per run; the source returns the `TTTBatch` the loss reads. `OnlineFeatures` runs the
target; `DumpFeatures` reads what `wingspan dump` stored per conversation and lays it out in the
micro-batch's rows. Both give the same tensors, so the training loop is one loop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from wingspan.data.batching import MicroBatch
from wingspan.data.hidden_states import HiddenStateDump
from wingspan.data.vocab import draft_to_target_ids
from wingspan.train.ttt import TTTBatch

FeatureSource = Callable[[MicroBatch], TTTBatch]


class OnlineFeatures:
    """The target runs on every micro-batch; its logits are cut to the draft vocab here, once."""

    def __init__(self, target, d2t: torch.Tensor) -> None:
        self.target = target
        self.draft_vocab_ids = draft_to_target_ids(d2t)

    def __call__(self, micro: MicroBatch) -> TTTBatch:
        # Packed rows: per-conversation positions, from which the target masks each conversation off, so that
        # each gets the features it gets alone.
        out = self.target.forward(micro.input_ids, micro.target_attention_mask(), position_ids=micro.positions)
        logits = out.logits
        # max().indices, not argmax(): the latter has no fast bf16 kernel on CPU.
        return TTTBatch(
            micro.input_ids,
            micro.loss_mask,
            micro.positions,
            out.aux_hidden,
            logits[..., self.draft_vocab_ids.to(logits.device)],
            logits.max(dim=-1).indices,
        )


class DumpFeatures:
    """The offline feature source: stored features, and the target's logits over the draft vocab
    recomputed from the stored final hidden state with the target's lm_head rows of that vocab."""

    def __init__(self, dump: HiddenStateDump, target, d2t: torch.Tensor) -> None:
        self.dump = dump
        self.lm_head_rows = target.lm_head_weight().detach()[draft_to_target_ids(d2t)]

    def __call__(self, micro: MicroBatch) -> TTTBatch:
        aux, last, argmax = self.dump.features(micro.rows, micro.input_ids.shape[1])
        # In the target's dtype, as the target's own lm_head computes them, where the target is (a GPU under
        # torchrun with NCCL); the trainer moves the rest of the batch there.
        logits = F.linear(last.to(self.lm_head_rows.device, self.lm_head_rows.dtype), self.lm_head_rows)
        return TTTBatch(micro.input_ids, micro.loss_mask, micro.positions, aux, logits, argmax)
