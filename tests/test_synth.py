"""Target-generated data: resumable and deterministic on a tiny random model; English on the real SmolLM2 (slow)."""

import json
import re
import shutil

import pytest
import torch

from wingspan.data.conversations import Conversation, Message, settings_path
from wingspan.data.synth import regenerate, synthesize
from wingspan.data.template import chat_prompt, user_turn_prefix
from wingspan.models.target import TargetModel

SYNTH = dict(batch_size=4, max_new_tokens=6, max_user_tokens=24, seed=3)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return TargetModel.load(str(tiny_llama_dir), dtype="float32", aux_layer_ids=[1, 2])


@pytest.fixture(scope="module")
def chatty(tiny_llama_dir):
    """The tiny model with a bias towards <|im_end|>, so that its random turns end now and then
    (about one token in twenty when sampling) instead of never."""
    target = TargetModel.load(str(tiny_llama_dir), dtype="float32", aux_layer_ids=[1, 2])
    head = torch.nn.Linear(32, target.vocab_size)
    with torch.no_grad():
        head.weight.copy_(target.model.lm_head.weight * 27)  # logits of std ~3 instead of ~0.1
        head.bias.zero_()
        head.bias[target.eos_token_ids[0]] = 12.0
    target.model.lm_head = head
    return target


class Interrupted(Exception):
    """Stands for a process killed in the middle of a run."""


def interrupt_after(target: TargetModel, calls: int, monkeypatch) -> None:
    """Make target.generate fail after `calls` calls, as a killed run would stop."""
    generate, count = target.generate, [0]

    def flaky(*args, **kwargs):
        count[0] += 1
        if count[0] > calls:
            raise Interrupted
        return generate(*args, **kwargs)

    monkeypatch.setattr(target, "generate", flaky)


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------------------------------ synthesize


def test_synthesize_writes_single_turn_conversations(chatty, tmp_path):
    out = tmp_path / "synth.jsonl"
    assert synthesize(chatty, 6, out, **SYNTH) == 6
    rows = records(out)
    assert len(rows) == 6 and len({r["id"] for r in rows}) == 6
    assert all(re.fullmatch(r"synth-3-\d+-\d+", r["id"]) for r in rows)
    assert all([m["role"] for m in r["conversations"]] == ["user", "assistant"] for r in rows)
    users = [r["conversations"][0]["content"] for r in rows]
    assert len(set(users)) == 6 and all(len(u) >= 10 and u == u.strip() for u in users)
    assert all(r["conversations"][1]["content"] for r in rows)
    finished = synthesize(chatty, 6, out, **SYNTH, resume=True)
    assert finished == 6 and records(out) == rows  # nothing to do


def test_synthesize_resumes_to_the_same_file(chatty, tmp_path, monkeypatch):
    whole = tmp_path / "whole.jsonl"
    synthesize(chatty, 6, whole, **SYNTH)

    killed = tmp_path / "killed.jsonl"
    with monkeypatch.context() as patch:
        interrupt_after(chatty, 3, patch)  # batch 0 (user turns, replies), then dies in batch 1
        with pytest.raises(Interrupted):
            synthesize(chatty, 6, killed, **SYNTH)
    assert 0 < len(records(killed)) < 6
    with pytest.raises(FileExistsError, match="--resume"):
        synthesize(chatty, 6, killed, **SYNTH)
    synthesize(chatty, 6, killed, **SYNTH, resume=True)
    assert killed.read_bytes() == whole.read_bytes()

    cut = tmp_path / "cut.jsonl"  # a write cut off in the middle of a line
    text = whole.read_bytes()
    cut.write_bytes(text[: text.index(b"\n", len(text) // 2) - 5])
    shutil.copy(settings_path(whole), settings_path(cut))
    synthesize(chatty, 6, cut, **SYNTH, resume=True)
    assert cut.read_bytes() == whole.read_bytes()


def test_synthesize_refuses_greedy_user_turns_and_other_seeds(chatty, tmp_path):
    with pytest.raises(ValueError, match="user_temperature"):
        synthesize(chatty, 2, tmp_path / "a.jsonl", user_temperature=0.0)
    out = tmp_path / "b.jsonl"
    synthesize(chatty, 2, out, **SYNTH)
    with pytest.raises(ValueError, match=r"seed: 3 -> 4"):
        synthesize(chatty, 4, out, **{**SYNTH, "seed": 4}, resume=True)
    assert synthesize(chatty, 4, out, **SYNTH, resume=True) == 4  # a larger --num extends it


def test_user_turn_prefix_is_what_the_template_writes_before_the_content(tiny):
    text = tiny.tokenizer.decode(user_turn_prefix(tiny.tokenizer))
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>user\n")


# ------------------------------------------------------------------------------------------ regenerate


def conversation(id: str, *turns: tuple[str, str]) -> Conversation:
    return Conversation([Message(role, content) for role, content in turns], id=id, source="test")


CONVERSATIONS = [
    conversation(
        "multi",
        ("system", "Be brief."),
        ("user", "Hello there"),
        ("assistant", "old 1"),
        ("user", "And then?"),
        ("assistant", "old 2"),
    ),
    conversation("prompts", ("user", "First question"), ("user", "Second question")),
    conversation("single", ("user", "A single question, a bit longer than the others are."), ("assistant", "old")),
    conversation("short", ("user", "Hi"), ("assistant", "old")),
    conversation("two", ("user", "One"), ("assistant", "old"), ("user", "Two")),
]


def test_regenerate_keeps_ids_system_and_user_turns(tiny, tmp_path):
    out = tmp_path / "regen.jsonl"
    assert regenerate(tiny, CONVERSATIONS, out, max_new_tokens=4, batch_size=2).written == 5
    rows = {r["id"]: r["conversations"] for r in records(out)}
    assert set(rows) == {c.id for c in CONVERSATIONS}
    for c in CONVERSATIONS:
        got = rows[c.id]
        assert [m for m in got if m["role"] != "assistant"] == [m.__dict__ for m in c.messages if m.role != "assistant"]
        users = [i for i, m in enumerate(got) if m["role"] == "user"]
        assert [got[i + 1]["role"] for i in users] == ["assistant"] * len(users)  # a reply after every user turn
        assert not any(m["content"].startswith("old") for m in got)


def test_each_reply_is_conditioned_on_the_targets_own_earlier_replies(tiny, tmp_path):
    out = tmp_path / "regen.jsonl"
    regenerate(tiny, CONVERSATIONS[:1], out, max_new_tokens=4, batch_size=1)
    got = records(out)[0]["conversations"]
    prompt = chat_prompt(tiny.tokenizer, got[:4])  # system, user, the target's own reply 1, user
    (expected,) = tiny.generate([prompt], max_new_tokens=4)
    assert got[4] == {"role": "assistant", "content": tiny.tokenizer.decode(expected.tokens)}


def test_regenerate_resumes_to_the_same_file(tiny, tmp_path, monkeypatch):
    whole = tmp_path / "whole.jsonl"
    regenerate(tiny, CONVERSATIONS, whole, max_new_tokens=4, batch_size=2)
    killed = tmp_path / "killed.jsonl"
    with monkeypatch.context() as patch:
        interrupt_after(tiny, 2, patch)
        with pytest.raises(Interrupted):
            regenerate(tiny, CONVERSATIONS, killed, max_new_tokens=4, batch_size=2)
    assert 0 < len(records(killed)) < 5
    with pytest.raises(FileExistsError, match="--resume"):
        regenerate(tiny, CONVERSATIONS, killed, max_new_tokens=4, batch_size=2)
    regenerate(tiny, CONVERSATIONS, killed, max_new_tokens=4, batch_size=2, resume=True)
    assert killed.read_bytes() == whole.read_bytes()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(conversations=CONVERSATIONS[:4]), "the input conversations"),
        (dict(max_new_tokens=5), "max_new_tokens: 4 -> 5"),
        (dict(temperature=0.5), "temperature: 0.0 -> 0.5"),
    ],
)
def test_regenerate_resumes_only_what_it_started(tiny, tmp_path, change, message):
    """--resume into an output made from other conversations or settings is refused, naming what changed, and
    leaves the output as it was."""
    out = tmp_path / "regen.jsonl"
    regenerate(tiny, CONVERSATIONS[:2], out, max_new_tokens=4, batch_size=2)
    before = out.read_bytes()
    arguments = dict(conversations=CONVERSATIONS[:2], max_new_tokens=4, temperature=0.0) | change
    conversations = arguments.pop("conversations")
    with pytest.raises(ValueError, match=message):
        regenerate(tiny, conversations, out, batch_size=2, resume=True, **arguments)
    assert out.read_bytes() == before


def test_an_unrelated_file_is_never_taken_for_an_earlier_run(tiny, tmp_path):
    out = tmp_path / "notes.jsonl"
    out.write_text('{"id": "single", "conversations": [{"role": "user", "content": "mine"}]}\n')
    with pytest.raises(FileExistsError):
        regenerate(tiny, CONVERSATIONS, out, max_new_tokens=4)
    with pytest.raises(ValueError, match="was not regenerated from this input"):
        regenerate(tiny, CONVERSATIONS, out, max_new_tokens=4, resume=True)
    assert "mine" in out.read_text()


def test_regenerate_stops_conversations_at_max_length(tiny, tmp_path):
    long_second = conversation("long", ("user", "Short one"), ("user", "word " * 200))
    too_long = conversation("too-long", ("user", "word " * 200))
    out = tmp_path / "regen.jsonl"
    report = regenerate(tiny, [long_second, too_long], out, max_new_tokens=4, max_length=100)
    assert report.written == 1
    assert report.dropped == {"the next prompt no longer fits the context": 1}
    assert report.shortened == {"the next prompt no longer fits the context": 1}
    assert "dropped: 1 (1 because the next prompt no longer fits the context)" in report.summary()
    (row,) = records(out)
    assert row["id"] == "long" and [m["role"] for m in row["conversations"]] == ["user", "assistant"]


def test_regenerate_needs_unique_ids(tiny, tmp_path):
    with pytest.raises(ValueError, match="unique"):
        regenerate(tiny, [CONVERSATIONS[2], CONVERSATIONS[2]], tmp_path / "x.jsonl")


# ---------------------------------------------------------------------------------------- real SmolLM2


@pytest.mark.slow
def test_smollm2_synthesizes_english_conversations(tmp_path):
    target = TargetModel.load("smollm2-135m-instruct")
    out = tmp_path / "synth.jsonl"
    synthesize(target, 4, out, batch_size=4, max_new_tokens=64, seed=0)
    rows = records(out)
    assert len(rows) == 4
    texts = [m["content"] for row in rows for m in row["conversations"]]
    # English prose, not token soup, judged over all the texts: the 135M target's greedy reply to one prompt may
    # be a quirk of its own (on one CPU's bf16 kernels, "SANE, please! 🍹🍹"), which says nothing of the rest
    letters = sum(ch.isascii() and (ch.isalpha() or ch.isspace()) for text in texts for ch in text)
    assert letters / sum(len(text) for text in texts) > 0.8, texts
    assert all(len(text.split()) >= 3 for text in texts), texts
    replies = [row["conversations"][1]["content"] for row in rows]
    assert sum(bool(re.search(r"\b(the|a|is|to|of|and|you|I|in)\b", reply)) for reply in replies) >= 3, replies


def test_an_output_without_its_settings_resumes_only_when_it_was_made_from_this_input(tiny, tmp_path, capsys):
    """An older wingspan wrote no settings file: its output is continued when every conversation in it has an
    id of the input with the same user turns, and refused otherwise; a damaged settings file is one line."""
    whole = tmp_path / "whole.jsonl"
    regenerate(tiny, CONVERSATIONS, whole, max_new_tokens=4, batch_size=2)
    older = tmp_path / "older.jsonl"
    older.write_text("".join(whole.read_text().splitlines(keepends=True)[:2]))
    regenerate(tiny, CONVERSATIONS, older, max_new_tokens=4, batch_size=2, resume=True)
    assert "its settings are not checked" in capsys.readouterr().out
    assert older.read_bytes() == whole.read_bytes()

    other = tmp_path / "other.jsonl"
    other.write_text(whole.read_text().replace("Hello there", "Goodbye", 1))
    with pytest.raises(ValueError, match="was not regenerated from this input"):
        regenerate(tiny, CONVERSATIONS, other, max_new_tokens=4, batch_size=2, resume=True)

    settings_path(whole).write_text('{"target": "x", ')
    with pytest.raises(ValueError, match=r"whole.jsonl.settings.json: not valid JSON"):
        regenerate(tiny, CONVERSATIONS, whole, max_new_tokens=4, batch_size=2, resume=True)
