"""The quickstart's closing measurement, on a tiny target: one `wingspan eval` report per chain length (one
plain baseline for all), and the lines it prints name the fastest chain length and the command that measures
more."""

import json

import pytest
from test_eval_runner import draft, target  # noqa: F401

from wingspan.errors import ConfigError, DataError
from wingspan.export import ExportSettings, export_draft
from wingspan.quickstart import (
    fastest,
    held_out_keys,
    keep_text,
    measure_draft,
    measurement_lines,
    plan_conversations,
    prompt_sample,
    text_sample,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_closing_measurement_reports_each_chain_length(target, draft, tmp_path):  # noqa: F811
    export_draft(draft, tmp_path / "vllm-draft", "vllm", ExportSettings(dtype="float32"))
    check = dict(prompt_set="mt_bench", limit=2, max_new_tokens=8, chain_lengths=(1, 3))
    measured = measure_draft(target, tmp_path / "vllm-draft", tmp_path / "eval", "float32", **check)
    assert sorted(measured) == [1, 3]
    assert measured[1].greedy_tokens_per_s == measured[3].greedy_tokens_per_s  # one plain baseline for both
    for k, result in measured.items():
        saved = json.loads((tmp_path / "eval" / f"k{k}" / "results.json").read_text())
        assert saved["settings"]["num_draft_tokens"] == k and saved["sets"][0]["num_prompts"] == 2
        assert saved["settings"]["first_turns"] and [len(p["prompt_tokens"]) for p in saved["sets"][0]["prompts"]] == [
            1,
            1,
        ]
        assert saved["sets"][0]["acceptance_length"] == result.acceptance_length
        assert result.outputs_differing == 0 and len(result.acceptance_per_position) == k
    text = measurement_lines(measured, tmp_path / "vllm-draft", tmp_path / "eval", "float32", check)
    best = fastest(measured)
    assert measured[best].speedup == max(r.speedup for r in measured.values())
    assert f"fastest in wingspan's engine here: {best} per round" in text
    assert f"--num-draft-tokens {best} --first-turns --out {tmp_path / 'eval' / 'full'}" in text
    for k, result in measured.items():
        assert f"  {k} draft token(s) per round: tau {result.acceptance_length:.2f}" in text


def test_the_prompts_are_first_user_turns_drawn_from_all_files(tmp_path):
    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        "\n".join(
            json.dumps(
                {
                    "id": str(i),
                    "messages": [
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": f"chat question {i}"},
                        {"role": "assistant", "content": "an answer the target will replace"},
                        {"role": "user", "content": "a second turn"},
                    ],
                }
            )
            for i in range(6)
        )
        + "\n"
    )
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps({"id": str(i), "turns": [f"plain question {i}"]}) + "\n" for i in range(6)))

    sample = prompt_sample((str(chats), str(questions)), 8, seed=0)
    assert len(sample) == 8 and len({c.id for c in sample}) == 8
    assert {c.id.split("/")[0] for c in sample} == {"chats.jsonl", "questions.jsonl"}  # both files, ids kept apart
    for conversation in sample:
        roles = [m.role for m in conversation.messages]
        assert roles in (["system", "user"], ["user"]) and not conversation.has_assistant_turn()
        number = conversation.id.split("/")[1]
        assert conversation.messages[-1].content.endswith(f"question {number}")
    assert [c.id for c in prompt_sample((str(chats), str(questions)), 8, seed=0)] == [c.id for c in sample]
    assert [c.id for c in prompt_sample((str(chats), str(questions)), 8, seed=1)] != [c.id for c in sample]
    assert len(prompt_sample((str(chats), str(questions)), 50, seed=0)) == 12  # all there are
    assert [c.id for c in prompt_sample((str(chats),), 3, seed=0)][0].isdigit()  # one file: its own ids

    (tmp_path / "again").mkdir()
    same_name = tmp_path / "again" / "questions.jsonl"
    same_name.write_text(questions.read_text())
    with pytest.raises(DataError, match=r"--prompts: ids \['questions.jsonl/0'"):
        prompt_sample((str(questions), str(same_name)), 3, seed=0)

    answers_only = tmp_path / "answers.jsonl"
    answers_only.write_text(json.dumps({"messages": [{"role": "assistant", "content": "hello"}]}) + "\n")
    with pytest.raises(DataError, match="answers.jsonl: no usable conversation"):
        prompt_sample((str(answers_only),), 3, seed=0)


def test_prompts_and_invented_conversations_share_the_count(tmp_path, capsys):
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps({"id": str(i), "turns": [f"question {i}"]}) + "\n" for i in range(10)))
    files = (str(questions),)
    assert plan_conversations((), None, 7, seed=0) == ([], 7)  # no prompt files: all invented
    sample, invented = plan_conversations(files, None, 6, seed=0)
    assert [c.id for c in sample] == [c.id for c in prompt_sample(files, 6, seed=0)] and invented == 0
    sample, invented = plan_conversations(files, 0.25, 8, seed=0)
    assert len(sample) == 2 and invented == 6
    assert plan_conversations(files, 0.0, 8, seed=0) == ([], 8)
    sample, invented = plan_conversations(files, None, 25, seed=0)  # the file holds 10: invented ones make up 15
    assert len(sample) == 10 and invented == 15
    assert "10 prompts in" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="--prompt-share: needs --prompts"):
        plan_conversations((), 0.5, 8, seed=0)
    with pytest.raises(ConfigError, match="--prompt-share: expected a share from 0 to 1, got 1.5"):
        plan_conversations(files, 1.5, 8, seed=0)


def test_text_is_drawn_whole_from_all_files_with_replies_only(tmp_path):
    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        "".join(
            json.dumps(
                {
                    "id": str(i),
                    "messages": [
                        {"role": "user", "content": f"question {i}"},
                        {"role": "assistant", "content": f"answer {i}"},
                        {"role": "user", "content": "and then?"},
                        {"role": "assistant", "content": f"more on {i}"},
                    ],
                }
            )
            + "\n"
            for i in range(5)
        )
        + json.dumps({"id": "unanswered", "messages": [{"role": "user", "content": "no reply"}]})
        + "\n"
    )
    answers = tmp_path / "answers.jsonl"
    answers.write_text("".join(json.dumps({"question": f"sum {i}", "answer": f"it is {i}"}) + "\n" for i in range(4)))

    drawn = text_sample((str(chats), str(answers)), 6, seed=0)
    assert len(drawn) == 6 and {c.id.split("/")[0] for c in drawn} == {"chats.jsonl", "answers.jsonl"}
    for conversation in drawn:  # kept whole: every turn, replies included
        number = conversation.id.split("/")[1]
        roles = [m.role for m in conversation.messages]
        if conversation.id.startswith("chats"):
            assert roles == ["user", "assistant", "user", "assistant"]
            assert conversation.messages[-1].content == f"more on {number}"
        else:  # no ids in the file: each is named by its line
            asked = conversation.messages[0].content.removeprefix("sum ")
            assert roles == ["user", "assistant"] and conversation.messages[1].content == f"it is {asked}"
    everything = text_sample((str(chats), str(answers)), None, seed=0)
    assert len(everything) == 9 and "chats.jsonl/unanswered" not in {c.id for c in everything}
    assert [c.id for c in everything[:6]] == [c.id for c in drawn]  # a larger draw extends a smaller one
    assert [c.id for c in text_sample((str(chats), str(answers)), None, seed=1)] != [c.id for c in everything]
    assert text_sample((), None, seed=0) == []

    with pytest.raises(ConfigError, match="--text-conversations: needs --text"):
        text_sample((), 5, seed=0)
    with pytest.raises(ConfigError, match="--text-conversations: expected at least 1, got 0"):
        text_sample((str(chats),), 0, seed=0)
    prompts_only = tmp_path / "prompts.jsonl"
    prompts_only.write_text(json.dumps({"id": "q", "turns": ["a question"]}) + "\n")
    with pytest.raises(DataError, match="prompts.jsonl: no usable conversation"):
        text_sample((str(prompts_only),), None, seed=0)


def test_the_drawn_text_is_kept_and_a_different_draw_refused(tmp_path):
    from wingspan.data.conversations import read_conversations

    source = tmp_path / "answers.jsonl"
    source.write_text("".join(json.dumps({"question": f"sum {i}", "answer": f"it is {i}"}) + "\n" for i in range(6)))
    kept = tmp_path / "out" / "text.jsonl"
    drawn = text_sample((str(source),), 4, seed=0)
    keep_text(drawn, kept)
    assert [(c.id, c.as_dicts()) for c in read_conversations(kept)[0]] == [(c.id, c.as_dicts()) for c in drawn]
    before = kept.read_bytes()
    keep_text(text_sample((str(source),), 4, seed=0), kept)  # a rerun: the same draw, left as it is
    assert kept.read_bytes() == before
    with pytest.raises(ConfigError, match=r"text.jsonl: holds another draw of --text .* its own --out"):
        keep_text(text_sample((str(source),), 5, seed=0), kept)
    assert kept.read_bytes() == before

    from wingspan.quickstart import run_quickstart

    # the quickstart refuses it first, before it writes its config or loads the target
    with pytest.raises(ConfigError, match=r"text.jsonl: holds another draw of --text"):
        run_quickstart(kept.parent, device="cpu", text=(str(source),), text_conversations=5)
    assert kept.read_bytes() == before and not (kept.parent / "train_config.json").exists()


def test_a_rerun_asking_fewer_conversations_than_its_out_holds_is_refused(tmp_path):
    """The synthesis extends its file to a larger count, but would keep a larger file as it is and the draft train
    on all of it: the quickstart refuses that before it writes its config or loads the target."""
    from wingspan.data.conversations import Conversation, Message, write_conversations_jsonl
    from wingspan.quickstart import run_quickstart

    out = tmp_path / "q"
    out.mkdir()
    messages = [Message("user", "hi"), Message("assistant", "hello")]
    made = [Conversation(messages, id=f"synth-0-0-{i}", source="s") for i in range(5)]
    write_conversations_jsonl(made, out / "synth.jsonl")
    with pytest.raises(ConfigError, match=r"synth.jsonl: holds 5 conversations of an earlier run, more than the 3 "):
        run_quickstart(out, device="cpu", conversations=3)
    assert not (out / "train_config.json").exists()


def test_excluded_sets_are_never_drawn(tmp_path, capsys):
    """`--exclude`: the prompts and the text whose first user turn is a user turn of an excluded set or file are
    left out of the draw; the rest are drawn in the order they have without it."""
    answers = tmp_path / "answers.jsonl"
    answers.write_text("".join(json.dumps({"question": f"sum {i}", "answer": f"it is {i}"}) + "\n" for i in range(8)))
    held = tmp_path / "held.txt"  # one prompt a line; whitespace does not count, as in `wingspan eval --exclude`
    held.write_text("sum 2\n  sum  5\nnot in the file\n")
    files = (str(answers),)
    keys = held_out_keys((str(held),), files)
    assert len(keys) == 3

    everything = text_sample(files, None, seed=0)
    kept = text_sample(files, None, seed=0, held_out=keys)
    assert "--text: 2 of 8 conversations left out (in --exclude)" in capsys.readouterr().out
    assert [c.id for c in kept] == [c.id for c in everything if c.messages[0].content not in ("sum 2", "sum 5")]
    assert len(kept) == 6
    assert [c.id for c in text_sample(files, 4, seed=0, held_out=keys)] == [c.id for c in kept[:4]]

    prompts = prompt_sample(files, 8, seed=0, held_out=keys)  # as prompts: 6 left, fewer than asked
    assert len(prompts) == 6 and {c.messages[0].content for c in prompts}.isdisjoint({"sum 2", "sum 5"})
    sample, invented = plan_conversations(files, None, 8, seed=0, held_out=keys)
    assert len(sample) == 6 and invented == 2

    assert held_out_keys((), ()) == frozenset()
    with pytest.raises(ConfigError, match="--exclude: needs --prompts or --text"):
        held_out_keys((str(held),), ())
    with pytest.raises(DataError, match="missing.txt: file not found"):
        held_out_keys((str(tmp_path / "missing.txt"),), files)
