"""The draft vocabulary: the target tokens the assistant says most often, and the maps between the two vocabs.

EAGLE-3 drafts predict over a smaller vocabulary than the target's. Draft id i stands for target id
i + d2t[i] (d2t holds offsets, as vLLM and SGLang load them); t2d[t] says whether target id t has a draft id.
Draft ids are ordered by ascending target id.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from wingspan.data.template import TokenizedConversation
from wingspan.errors import ConfigError, DataError
from wingspan.files import atomic_file


@dataclass
class DraftVocab:
    d2t: torch.Tensor  # int64 [draft_vocab_size]: target id = i + d2t[i]
    t2d: torch.Tensor  # bool [target_vocab_size]: True where the target id has a draft id
    coverage: float  # share of the counted loss-masked tokens that the draft vocab covers

    @property
    def draft_vocab_size(self) -> int:
        return self.d2t.numel()

    @property
    def target_vocab_size(self) -> int:
        return self.t2d.numel()

    def save(self, path: str | Path) -> None:
        """safetensors (d2t, t2d) with sizes and coverage as JSON metadata; atomic."""
        metadata = {
            "draft_vocab": json.dumps(
                {
                    "target_vocab_size": self.target_vocab_size,
                    "draft_vocab_size": self.draft_vocab_size,
                    "coverage": self.coverage,
                }
            )
        }
        tensors = {"d2t": self.d2t, "t2d": self.t2d}
        with atomic_file(path) as tmp:
            save_file({name: t.contiguous() for name, t in tensors.items()}, str(tmp), metadata=metadata)

    @classmethod
    def load(cls, path: str | Path) -> DraftVocab:
        """Load and check a saved vocab: shapes, dtypes, and that d2t and t2d name the same target ids."""
        path = Path(path)
        if not path.exists():
            raise DataError(f"{path}: draft vocab file not found")
        try:
            with safe_open(str(path), "pt") as f:
                tensors = {name: f.get_tensor(name) for name in f.keys()}
                metadata = json.loads((f.metadata() or {}).get("draft_vocab", "{}"))
        except (SafetensorError, OSError, json.JSONDecodeError) as error:
            raise DataError(f"{path}: not a readable draft vocab ({error})") from None
        missing = sorted({"d2t", "t2d"} - set(tensors))
        if missing:
            raise DataError(f"{path}: missing tensor(s) {missing}")
        if "coverage" not in metadata:
            raise DataError(f"{path}: metadata lacks 'draft_vocab' (target_vocab_size, coverage)")
        vocab = cls(tensors["d2t"], tensors["t2d"], float(metadata["coverage"]))
        vocab._validate(path, metadata)
        return vocab

    def _validate(self, path: Path, metadata: dict) -> None:
        d2t, t2d = self.d2t, self.t2d
        if d2t.dtype != torch.int64 or d2t.dim() != 1:
            raise DataError(f"{path}: d2t must be a 1-D int64 tensor, got {d2t.dtype} {list(d2t.shape)}")
        if t2d.dtype != torch.bool or t2d.dim() != 1:
            raise DataError(f"{path}: t2d must be a 1-D bool tensor, got {t2d.dtype} {list(t2d.shape)}")
        if metadata.get("target_vocab_size", t2d.numel()) != t2d.numel():
            said = metadata["target_vocab_size"]
            raise DataError(f"{path}: t2d has {t2d.numel()} entries but metadata says target_vocab_size {said}")
        target_ids = draft_to_target_ids(d2t)
        if not torch.equal(target_ids, t2d.nonzero().flatten()):
            raise DataError(f"{path}: d2t and t2d disagree on which target ids the draft vocab holds")


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """Target id of every draft id: i + d2t[i]."""
    return torch.arange(d2t.numel(), dtype=torch.long, device=d2t.device) + d2t


def count_assistant_tokens(records: Iterable[TokenizedConversation], target_vocab_size: int) -> np.ndarray:
    """How often each target id occurs under the loss mask, as an int64 array [target_vocab_size]."""
    ids = [np.asarray(r.input_ids, dtype=np.int64)[np.asarray(r.loss_mask, dtype=bool)] for r in records]
    masked = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    if masked.size and (masked.min() < 0 or masked.max() >= target_vocab_size):
        raise DataError(f"token id {int(masked.max())} is outside the target vocabulary of {target_vocab_size}")
    return np.bincount(masked, minlength=target_vocab_size).astype(np.int64)


def build_draft_vocab(
    records: Iterable[TokenizedConversation],
    target_vocab_size: int,
    draft_vocab_size: int,
    always_include: Iterable[int] = (),
) -> DraftVocab:
    """Keep the draft_vocab_size most frequent loss-masked tokens (ties to the lower id), plus `always_include`.

    `always_include` is for tokens the draft must be able to propose however rare they are in the data, such
    as EOS and the end-of-turn marker. When fewer distinct tokens were seen, the lowest unused ids fill the
    vocab up to its exact size, so the draft's shapes never depend on the data.
    """
    if not 0 < draft_vocab_size <= target_vocab_size:
        raise ConfigError(f"draft_vocab_size must be in 1..{target_vocab_size}, got {draft_vocab_size}")
    forced = sorted(set(always_include))
    if any(not 0 <= i < target_vocab_size for i in forced):
        raise ConfigError(f"always_include ids must be in 0..{target_vocab_size - 1}, got {forced}")
    if len(forced) > draft_vocab_size:
        raise ConfigError(f"always_include has {len(forced)} ids, more than draft_vocab_size {draft_vocab_size}")

    counts = count_assistant_tokens(records, target_vocab_size)
    total = int(counts.sum())
    if total == 0:
        raise DataError("no assistant token to count: the records have an empty loss mask")
    # Forced ids first, then by descending count; the stable sort breaks ties (and orders unseen ids) by id.
    priority = -counts.astype(np.float64)
    priority[forced] = -np.inf
    chosen = np.sort(np.argsort(priority, kind="stable")[:draft_vocab_size])

    coverage = float(counts[chosen].sum()) / total
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[torch.from_numpy(chosen)] = True
    d2t = torch.from_numpy(chosen.astype(np.int64) - np.arange(draft_vocab_size, dtype=np.int64))
    return DraftVocab(d2t=d2t, t2d=t2d, coverage=coverage)
