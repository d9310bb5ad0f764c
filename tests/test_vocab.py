"""Draft vocab: frequency selection under the loss mask, offsets, forced ids, and a checked file format."""

import json

import pytest
import torch
from safetensors.torch import save_file

from wingspan.data.template import TokenizedConversation
from wingspan.data.vocab import DraftVocab, build_draft_vocab, count_assistant_tokens, draft_to_target_ids
from wingspan.errors import DataError


def record(ids: list[int], mask: list[int]) -> TokenizedConversation:
    return TokenizedConversation(input_ids=ids, loss_mask=mask)


# Under the mask: 7 x5, 3 x3, 9 x2, 1 x1. Token 5 is frequent but only in unmasked (prompt) positions.
RECORDS = [
    record([5, 5, 5, 5, 7, 7, 7, 3, 9], [0, 0, 0, 0, 1, 1, 1, 1, 1]),
    record([5, 5, 7, 7, 3, 3, 9, 1], [0, 0, 1, 1, 1, 1, 1, 1]),
]


def test_counts_only_masked_tokens():
    counts = count_assistant_tokens(RECORDS, 12)
    assert counts.tolist() == [0, 1, 0, 3, 0, 0, 0, 5, 0, 2, 0, 0]


def test_top_tokens_sorted_by_target_id_with_offsets():
    vocab = build_draft_vocab(RECORDS, target_vocab_size=12, draft_vocab_size=3)
    assert draft_to_target_ids(vocab.d2t).tolist() == [3, 7, 9]
    assert vocab.d2t.tolist() == [3, 6, 7]  # target id = i + d2t[i]
    assert vocab.d2t.dtype == torch.int64 and vocab.t2d.dtype == torch.bool
    assert vocab.t2d.nonzero().flatten().tolist() == [3, 7, 9]
    assert vocab.coverage == pytest.approx(10 / 11)
    assert (vocab.draft_vocab_size, vocab.target_vocab_size) == (3, 12)


def test_always_include_wins_over_frequent_tokens():
    vocab = build_draft_vocab(RECORDS, target_vocab_size=12, draft_vocab_size=3, always_include=[11, 0])
    assert draft_to_target_ids(vocab.d2t).tolist() == [0, 7, 11]
    assert vocab.coverage == pytest.approx(5 / 11)


def test_fills_with_lowest_unused_ids_when_data_is_short():
    vocab = build_draft_vocab(RECORDS, target_vocab_size=12, draft_vocab_size=7, always_include=[10])
    # Seen: 1, 3, 7, 9; forced: 10; then the lowest unseen ids 0 and 2.
    assert draft_to_target_ids(vocab.d2t).tolist() == [0, 1, 2, 3, 7, 9, 10]
    assert vocab.coverage == 1.0 and vocab.t2d.sum() == 7


def test_ties_go_to_the_lower_id():
    tied = [record([4, 2, 8, 6], [1, 1, 1, 1])]
    assert draft_to_target_ids(build_draft_vocab(tied, 10, 2).d2t).tolist() == [2, 4]


def test_full_size_vocab_is_the_identity():
    vocab = build_draft_vocab(RECORDS, target_vocab_size=12, draft_vocab_size=12)
    assert vocab.d2t.tolist() == [0] * 12 and bool(vocab.t2d.all())


def test_draft_to_target_ids():
    assert draft_to_target_ids(torch.tensor([2, 2, 5])).tolist() == [2, 3, 7]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(draft_vocab_size=0), "draft_vocab_size must be in 1..12"),
        (dict(draft_vocab_size=13), "draft_vocab_size must be in 1..12"),
        (dict(draft_vocab_size=2, always_include=[1, 2, 3]), "more than draft_vocab_size"),
        (dict(draft_vocab_size=2, always_include=[12]), "always_include ids must be in 0..11"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_draft_vocab(RECORDS, target_vocab_size=12, **kwargs)


def test_token_outside_target_vocab_and_empty_mask_are_errors():
    with pytest.raises(ValueError, match="token id 50 is outside the target vocabulary of 12"):
        build_draft_vocab([record([50], [1])], 12, 2)
    with pytest.raises(ValueError, match="no assistant token"):
        build_draft_vocab([record([1, 2], [0, 0])], 12, 2)


def test_save_load_round_trip(tmp_path):
    vocab = build_draft_vocab(RECORDS, target_vocab_size=12, draft_vocab_size=4, always_include=[0])
    path = tmp_path / "vocab" / "vocab.safetensors"
    vocab.save(path)
    assert [p.name for p in path.parent.iterdir()] == ["vocab.safetensors"]
    back = DraftVocab.load(path)
    assert torch.equal(back.d2t, vocab.d2t) and torch.equal(back.t2d, vocab.t2d)
    assert back.coverage == vocab.coverage


def test_vocab_from_real_tokenized_conversations(smollm2_tokenizer):
    from wingspan.data.conversations import Conversation, Message
    from wingspan.data.template import tokenize_conversations

    texts = ["The answer is 4.", "The answer is 5, not 4.", "Yes."]
    conversations = [
        Conversation([Message("user", "Q?"), Message("assistant", t)], str(i), "x") for i, t in enumerate(texts)
    ]
    records, _ = tokenize_conversations(smollm2_tokenizer, conversations, max_length=256)
    end_of_turn = smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    vocab = build_draft_vocab(records, len(smollm2_tokenizer), 32, always_include=[smollm2_tokenizer.eos_token_id])
    chosen = set(draft_to_target_ids(vocab.d2t).tolist())
    assistant_tokens = {t for r in records for t, m in zip(r.input_ids, r.loss_mask) if m}
    assert end_of_turn in assistant_tokens and vocab.coverage == 1.0
    # Every reply token, then the lowest unused ids as filler; no other (prompt) token.
    needed = assistant_tokens | {smollm2_tokenizer.eos_token_id}
    filler = sorted(set(range(100)) - needed)[: 32 - len(needed)]
    assert chosen == needed | set(filler)


def write_vocab(path, tensors, target_vocab_size=12, coverage=1.0):
    save_file(
        tensors,
        str(path),
        metadata={"draft_vocab": json.dumps({"target_vocab_size": target_vocab_size, "coverage": coverage})},
    )
    return path


def good_tensors():
    t2d = torch.zeros(12, dtype=torch.bool)
    t2d[[1, 4]] = True
    return {"d2t": torch.tensor([1, 3]), "t2d": t2d}


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda t: t.pop("t2d"), r"missing tensor\(s\) \['t2d'\]"),
        (lambda t: t.update(d2t=torch.tensor([1, 4])), "d2t and t2d disagree"),
        (lambda t: t.update(d2t=torch.tensor([[1, 3]])), "d2t must be a 1-D int64 tensor"),
        (lambda t: t.update(t2d=t["t2d"].long()), "t2d must be a 1-D bool tensor"),
    ],
)
def test_load_rejects_inconsistent_files_naming_them(tmp_path, change, message):
    tensors = good_tensors()
    change(tensors)
    path = write_vocab(tmp_path / "bad.safetensors", tensors)
    with pytest.raises(DataError, match=message) as error:
        DraftVocab.load(path)
    assert str(error.value).startswith(str(path))


def test_load_checks_metadata_and_file(tmp_path):
    path = write_vocab(tmp_path / "v.safetensors", good_tensors(), target_vocab_size=13)
    with pytest.raises(DataError, match="metadata says target_vocab_size 13"):
        DraftVocab.load(path)
    save_file(good_tensors(), str(tmp_path / "nometa.safetensors"))
    with pytest.raises(DataError, match="nometa.safetensors: metadata lacks"):
        DraftVocab.load(tmp_path / "nometa.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(DataError, match="junk.safetensors: not a readable draft vocab"):
        DraftVocab.load(tmp_path / "junk.safetensors")
    with pytest.raises(DataError, match="missing.safetensors: draft vocab file not found"):
        DraftVocab.load(tmp_path / "missing.safetensors")
    ok = DraftVocab.load(write_vocab(tmp_path / "ok.safetensors", good_tensors()))
    assert draft_to_target_ids(ok.d2t).tolist() == [1, 4]
    # Files written before the vocab stopped storing per-token counts still load.
    old = DraftVocab.load(
        write_vocab(tmp_path / "old.safetensors", {**good_tensors(), "selected_counts": torch.ones(2)})
    )
    assert draft_to_target_ids(old.d2t).tolist() == [1, 4]
