"""Conversation readers: every dataset shape we ship reads, normalisation is as documented, bad input is named."""

import gzip
import json
from pathlib import Path

import pytest

from wingspan.data.conversations import (
    Conversation,
    DataError,
    Message,
    Regeneration,
    append_conversations_jsonl,
    read_conversations,
    write_conversations_jsonl,
)

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"  # excerpts of the real datasets (tests/data/README.md)
BUNDLED = ROOT / "src" / "wingspan" / "eval" / "data"  # EAGLE's question files, shipped in the package


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def roles(conversation: Conversation) -> list[str]:
    return [m.role for m in conversation.messages]


# (file under the repository, conversations kept, whether they carry assistant replies): a few records of every
# dataset shape we use, and the question files the package ships whole.
SHIPPED = [
    ("tests/data/sharegpt500_smollm2_regen_excerpt.jsonl", 3, True),
    ("tests/data/sharegpt_1000_head5.json", 5, False),
    ("tests/data/sharegpt_first_turns_excerpt.json", 4, False),
    ("tests/data/gpteacher_codegen_head4.json", 4, True),
    ("tests/data/gpteacher_roleplay_head3.json", 3, True),
    ("tests/data/gsm8k_test_head5.jsonl", 5, True),
    ("tests/data/self_instruct_seed_tasks_head3.jsonl", 3, True),
    ("tests/data/HumanEval_head3.jsonl.gz", 3, True),
    ("src/wingspan/eval/data/mt_bench.jsonl", 80, False),
    ("src/wingspan/eval/data/gsm8k_80.jsonl", 80, False),
    ("src/wingspan/eval/data/humaneval_80.jsonl", 80, False),
]


@pytest.mark.parametrize("name,expected,has_replies", SHIPPED)
def test_every_shipped_dataset_reads(name, expected, has_replies):
    path = ROOT / name
    conversations, report = read_conversations(path)
    assert len(conversations) == expected
    for c in conversations:
        assert c.messages and c.messages[0].role in ("system", "user")
        assert all(isinstance(m.content, str) and m.content.strip() for m in c.messages)
        assert c.source.startswith(str(path))
    assert all(c.has_assistant_turn() for c in conversations) == has_replies
    if has_replies:  # training data: nothing is lost to require_assistant
        assert len(read_conversations(path, require_assistant=True)[0]) == expected
    else:
        with pytest.raises(DataError, match="no usable conversation"):
            read_conversations(path, require_assistant=True)
    assert report.total - report.skipped == expected


def test_shipped_first_turn_set_skips_records_without_a_user_turn():
    conversations, report = read_conversations(DATA / "sharegpt_first_turns_excerpt.json")
    # 2 system-only, 3 assistant-only records and one whose only user turn is empty
    assert report.counts == {"no user turn": 6} and report.total == 10
    assert "sharegpt_first_turns_excerpt.json[" in report.examples[0]
    assert [c.id for c in conversations] == ["n68MgDA", "Lcfs0UQ", "jQpHizF", "z5v7xKJ"]


def test_sharegpt_normalisation(tmp_path):
    path = write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {
                "id": "a",
                "conversations": [
                    {"from": "gpt", "value": "leading reply, dropped"},
                    {"from": "system", "value": "be brief"},
                    {"from": "chatgpt", "value": "another leading reply"},
                    {"from": "human", "value": "part 1"},
                    {"from": "user", "value": "part 2"},
                    {"from": "gpt", "value": "   "},
                    {"from": "bard", "value": "answer 1"},
                    {"from": "model", "value": "answer 2"},
                    {"from": "Human", "value": "thanks"},
                ],
            }
        ],
    )
    [c], report = read_conversations(path)
    assert (c.id, c.source) == ("a", f"{path}:1")
    assert roles(c) == ["system", "user", "assistant", "user"]
    assert c.messages[1].content == "part 1\n\npart 2"
    assert c.messages[2].content == "answer 1\n\nanswer 2"
    assert report.skipped == 0 and report.total == 1


def test_openai_and_role_content_sharegpt(tmp_path):
    path = write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
            {"id": 7, "conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
        ],
    )
    conversations, _ = read_conversations(path, require_assistant=True)
    assert [roles(c) for c in conversations] == [["user", "assistant"]] * 2
    assert conversations[0].id == "chat-0" and conversations[1].id == "7"


def test_record_formats_in_a_json_array(tmp_path):
    records = [
        {"instruction": "Add", "input": "2 and 3", "response": "5"},
        {"instruction": "Greet", "input": "", "output": "Hello"},
        {"question": "1+1?", "answer": "2"},
        {"question_id": 81, "turns": ["first", "second"]},
        {"id": "t", "instruction": "Pick", "instances": [{"input": "", "output": "x"}, {"input": "y", "output": "z"}]},
        {"task_id": "HumanEval/0", "prompt": "def f():\n", "canonical_solution": "    return 1\n"},
    ]
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps(records))
    conversations, _ = read_conversations(path)
    by_id = {c.id: c for c in conversations}
    assert by_id["mixed-0"].messages == [Message("user", "Add\n\n2 and 3"), Message("assistant", "5")]
    assert by_id["mixed-1"].messages == [Message("user", "Greet"), Message("assistant", "Hello")]
    assert by_id["mixed-2"].messages == [Message("user", "1+1?"), Message("assistant", "2")]
    # A prompt set keeps one user message per turn: the model answers each before the next is asked.
    assert by_id["81"].messages == [Message("user", "first"), Message("user", "second")]
    assert by_id["t-0"].messages[0].content == "Pick" and by_id["t-1"].messages[0].content == "Pick\n\ny"
    assert by_id["HumanEval/0"].messages[1] == Message("assistant", "    return 1\n")
    assert by_id["81"].source == f"{path}[3]"


def test_gzipped_jsonl(tmp_path):
    path = tmp_path / "chat.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"turns": ["hello"]}) + "\n")
    [c], _ = read_conversations(path)
    assert c.messages == [Message("user", "hello")] and c.source == f"{path}:1"


BAD_LINES = [
    ('{"conversations": [', "malformed JSON", "not valid JSON"),
    ({"conversations": [{"from": "tool", "value": "x"}]}, "unknown role", "conversations[0].from: unknown role 'tool'"),
    ({"conversations": [{"from": "human"}]}, "missing field", "conversations[0]: missing field 'value'"),
    (
        {"messages": [{"role": "user", "content": ["a"]}]},
        "non-string content",
        "messages[0].content: expected a string, got list",
    ),
    (
        {"messages": [{"role": "user", "content": None}]},
        "non-string content",
        "messages[0].content: expected a string, got null",
    ),
    ({"instruction": "x"}, "missing field", "missing field 'response' (or 'output')"),
    ({"text": "plain"}, "unknown format", "unknown record format (keys: text)"),
    ([1, 2], "not a JSON object", "expected a JSON object, got list"),
]


@pytest.mark.parametrize("bad,reason,detail", BAD_LINES)
def test_bad_record_strict_names_file_line_and_field(tmp_path, bad, reason, detail):
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    path = write_jsonl(tmp_path / "data.jsonl", [good, "", bad, good])
    with pytest.raises(DataError) as error:
        read_conversations(path, strict=True)
    assert str(error.value).startswith(f"{path}:3: ")  # blank lines still count in line numbers
    assert detail in str(error.value)


@pytest.mark.parametrize("bad,reason,detail", BAD_LINES)
def test_bad_record_lenient_is_skipped_and_counted(tmp_path, bad, reason, detail):
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    path = write_jsonl(tmp_path / "data.jsonl", [good, bad, good])
    conversations, report = read_conversations(path)
    assert len(conversations) == 2
    assert report.counts == {reason: 1} and report.total == 3
    assert report.examples[0].startswith(f"{path}:2: ") and detail in report.examples[0]
    assert f"skipped 1 of 3 ({reason}: 1)" in report.summary() and f"{path}:2" in report.summary()


def test_skip_report_keeps_only_the_first_examples(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", ["{broken"] * 9 + [{"turns": ["ok"]}])
    _, report = read_conversations(path)
    assert report.counts == {"malformed JSON": 9}
    assert len(report.examples) == report.max_examples and report.examples[0].startswith(f"{path}:1:")


def test_json_array_with_bad_element_names_index(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps([{"turns": ["ok"]}, {"turns": ["ok", 3]}]))
    with pytest.raises(DataError, match=r"data\.json\[1\]: turns\[1\]: expected a string, got int"):
        read_conversations(path, strict=True)


def test_json_array_that_does_not_parse_names_file_and_line(tmp_path):
    path = tmp_path / "data.json"
    path.write_text('[\n{"turns": ["ok"]},\n{"turns": ["ok"\n]')
    with pytest.raises(DataError, match=rf"{path}:4: not valid JSON"):
        read_conversations(path)


@pytest.mark.parametrize("content", ["", "\n\n", "[]"])
def test_empty_file_is_an_error(tmp_path, content):
    path = tmp_path / ("data.json" if content == "[]" else "data.jsonl")
    path.write_text(content)
    with pytest.raises(DataError, match=rf"{path}: empty file"):
        read_conversations(path)


def test_file_with_nothing_usable_is_an_error_even_when_lenient(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", ["{bad", {"conversations": [{"from": "gpt", "value": "only a reply"}]}])
    with pytest.raises(DataError, match="no usable conversation") as error:
        read_conversations(path)
    assert "malformed JSON: 1" in str(error.value) and "no user turn: 1" in str(error.value)


def test_missing_file_and_unknown_extension(tmp_path):
    with pytest.raises(DataError, match=rf"{tmp_path / 'nope.jsonl'}: file not found"):
        read_conversations(tmp_path / "nope.jsonl")
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="data.csv: unsupported file type"):
        read_conversations(tmp_path / "data.csv")


def test_require_assistant_counts_prompt_only_conversations(tmp_path):
    path = write_jsonl(
        tmp_path / "data.jsonl",
        [
            {"turns": ["just a prompt"]},
            {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
        ],
    )
    conversations, report = read_conversations(path, strict=True, require_assistant=True)
    assert len(conversations) == 1 and report.counts == {"no assistant turn": 1}
    assert report.examples == [f"{path}:1: no assistant message to train on"]


def test_write_then_read_round_trip(tmp_path):
    conversations = [
        Conversation([Message("system", "s"), Message("user", "é ünïcode"), Message("assistant", "a\nb")], "x1", "src"),
        Conversation([Message("user", "q")], "x2", "src"),
    ]
    path = tmp_path / "out" / "conv.jsonl"
    write_conversations_jsonl(conversations, path)
    assert [p.name for p in path.parent.iterdir()] == ["conv.jsonl"]  # the temp file was renamed away
    assert json.loads(path.read_text().splitlines()[0]) == {
        "id": "x1",
        "conversations": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "é ünïcode"},
            {"role": "assistant", "content": "a\nb"},
        ],
    }
    back, _ = read_conversations(path)
    assert [(c.id, c.messages) for c in back] == [(c.id, c.messages) for c in conversations]


def test_line_separators_inside_a_jsonl_record_are_text(tmp_path):
    # wingspan writes JSON with U+2028, U+2029 and U+0085 unescaped (GSM8K's training set has a U+2028).
    content = "Clive opens a box.\u2028It holds 6 blue balls.\u2029And 4 red.\x85How many?"
    path = tmp_path / "conv.jsonl"
    write_conversations_jsonl([Conversation([Message("user", content), Message("assistant", "16")], "x", "")], path)
    assert path.read_text(encoding="utf-8").count("\n") == 1 and "\u2028" in path.read_text(encoding="utf-8")
    back, report = read_conversations(path, strict=True)
    assert [m.content for m in back[0].messages] == [content, "16"] and not report.skipped


def test_append_after_a_line_cut_short_starts_a_new_line(tmp_path):
    path = tmp_path / "conv.jsonl"
    first = Conversation([Message("user", "q1"), Message("assistant", "a1")], "1", "")
    second = Conversation([Message("user", "q2"), Message("assistant", "a2")], "2", "")
    append_conversations_jsonl([first], path)
    with open(path, "a") as f:
        f.write('{"id": "crashed", "conv')  # a write interrupted mid-line
    append_conversations_jsonl([second], path)
    back, report = read_conversations(path)
    assert [c.id for c in back] == ["1", "2"]
    assert report.counts == {"malformed JSON": 1} and report.examples[0].startswith(f"{path}:2:")


def test_regeneration_asks_each_user_turn_after_its_own_replies():
    source = Conversation(
        [
            Message("system", "Be brief."),
            Message("user", "q1"),
            Message("assistant", "old a1"),
            Message("user", "q2"),
            Message("user", "q2, continued"),
            Message("assistant", "old a2"),
            Message("user", "q3"),
        ],
        id="c",
        source="x:1",
    )
    regeneration, asked = Regeneration(source), []
    while not regeneration.done:
        prompt = regeneration.next_prompt()
        asked.append(prompt)
        regeneration.answer(f"new {len(asked)}" if len(asked) < 3 else None)  # the third no longer fits
    # Every user message is a turn of its own, asked after the reply to the one before.
    assert [m["content"] for m in asked[0]] == ["Be brief.", "q1"]
    assert [m["content"] for m in asked[1]] == ["Be brief.", "q1", "new 1", "q2"]
    assert [m["content"] for m in asked[2]] == ["Be brief.", "q1", "new 1", "q2", "new 2", "q2, continued"]
    assert len(asked) == 3  # None ends the conversation with its previous reply: q3 is never asked
    result = regeneration.conversation()
    assert (result.id, result.source) == ("c", "x:1")
    assert [(m.role, m.content) for m in result.messages] == [
        ("system", "Be brief."),
        ("user", "q1"),
        ("assistant", "new 1"),
        ("user", "q2"),
        ("assistant", "new 2"),
    ]


# --------------------------------------------------------------------------------------------------
# dataset sources: parquet, arrow, saved datasets and the hub (a local copy of a repository, the hub switched off)


@pytest.fixture
def offline_datasets(monkeypatch, tmp_path):
    """`datasets` with its cache in tmp_path and the hub switched off: a read that reached for the network fails."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return datasets


def hub_repository(directory: Path, splits: dict[str, list[dict]]) -> Path:
    """A dataset repository as the hub serves it: parquet files per split, named by a README's `configs`."""
    import datasets

    (directory / "data").mkdir(parents=True)
    for split, rows in splits.items():
        datasets.Dataset.from_list(rows).to_parquet(str(directory / "data" / f"{split}-00000-of-00001.parquet"))
    listed = "".join(f"  - split: {split}\n    path: data/{split}-*\n" for split in splits)
    (directory / "README.md").write_text(f"---\nconfigs:\n- config_name: default\n  data_files:\n{listed}---\n")
    return directory


def summary(conversations: list[Conversation]) -> list[tuple[str, list[tuple[str, str]]]]:
    return [(c.id, [(m.role, m.content) for m in c.messages]) for c in conversations]


def test_dataset_sources_read_as_their_jsonl(offline_datasets, tmp_path):
    jsonl = DATA / "sharegpt500_smollm2_regen_excerpt.jsonl"
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    expected = summary(read_conversations(jsonl)[0])
    dataset = offline_datasets.Dataset.from_list(rows)
    dataset.to_parquet(str(tmp_path / "chats.parquet"))
    dataset.save_to_disk(str(tmp_path / "saved"))
    offline_datasets.DatasetDict({"train": dataset, "test": dataset.select([0])}).save_to_disk(str(tmp_path / "dict"))
    repository = hub_repository(tmp_path / "repo", {"train": rows, "test": rows[:1]})
    arrow = next((tmp_path / "saved").glob("*.arrow"))

    for source in [tmp_path / "chats.parquet", arrow, tmp_path / "saved", f"hub:{repository}"]:
        conversations, report = read_conversations(source)
        assert summary(conversations) == expected, source
        assert report.summary() == f"kept all {len(rows)}"
    assert conversations[1].source == f"hub:{repository}:train[row 1]"
    assert summary(read_conversations(f"hub:{repository}", limit=2)[0]) == expected[:2]
    assert summary(read_conversations(f"hub:{repository}:test")[0]) == expected[:1]
    assert summary(read_conversations(f"{tmp_path / 'dict'}?split=test")[0]) == expected[:1]
    with pytest.raises(DataError, match=r"a dataset of splits \['train', 'test'\]; choose one with .*\?split=NAME"):
        read_conversations(tmp_path / "dict")

    # A column of another name is read under the field the formats expect.
    renamed = [{"id": r["id"], "dialog": r["conversations"]} for r in rows]
    renamed_repository = hub_repository(tmp_path / "renamed", {"train": renamed})
    assert summary(read_conversations(f"hub:{renamed_repository}?conversations=dialog")[0]) == expected
    with pytest.raises(DataError, match=r"\[row 0\]: unknown record format \(keys: dialog, id\)"):
        read_conversations(f"hub:{renamed_repository}", strict=True)
    with pytest.raises(DataError, match=r"no column\(s\) \['talk'\] to read as \['conversations'\]; it has"):
        read_conversations(f"hub:{renamed_repository}?conversations=talk")


def test_dataset_sources_name_the_row_and_what_is_missing(offline_datasets, tmp_path):
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}] * 2
    rows.append({"messages": [{"role": "narrator", "content": "once"}]})
    repository = hub_repository(tmp_path / "repo", {"train": rows})
    with pytest.raises(DataError, match=rf"^hub:{repository}:train\[row 2\]: messages\[0\].role: unknown role"):
        read_conversations(f"hub:{repository}", strict=True)
    conversations, report = read_conversations(f"hub:{repository}")
    assert len(conversations) == 2 and report.counts == {"unknown role": 1}

    with pytest.raises(DataError, match=rf"hub:{repository}:validation: cannot load it"):
        read_conversations(f"hub:{repository}:validation")
    with pytest.raises(DataError, match="hub:no-such/dataset: cannot load it"):
        read_conversations("hub:no-such/dataset")  # the hub is off here, as on a machine without network
    with pytest.raises(DataError, match="no dataset id after 'hub:'"):
        read_conversations("hub:")
    with pytest.raises(DataError, match=rf"{tmp_path / 'nope.parquet'}: file not found"):
        read_conversations(tmp_path / "nope.parquet")
    with pytest.raises(DataError, match=r"two splits, 'train' after ':' and 'test' after '\?'; give one"):
        read_conversations(f"hub:{repository}:train?split=test")
    assert len(read_conversations(f"hub:{repository}:train?split=train")[0]) == 2
    with pytest.raises(DataError, match="config= names a configuration of a hub dataset; .* has none"):
        read_conversations(f"{tmp_path / 'nope.parquet'}?config=default")
    with pytest.raises(DataError, match="split= chooses a split of a hub dataset or a saved dataset; .* is one file"):
        read_conversations(f"{tmp_path / 'nope.parquet'}?split=test")


def test_a_dataset_sources_fingerprint_is_what_it_reads(offline_datasets, tmp_path):
    from wingspan.data.conversations import source_sha256

    rows = [{"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    other = [{"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "no"}]}]
    repository = hub_repository(tmp_path / "repo", {"train": rows, "test": other})
    copy = hub_repository(tmp_path / "copy", {"train": rows, "test": other})
    assert source_sha256(f"hub:{repository}") == source_sha256(f"hub:{repository}:train")
    assert source_sha256(f"hub:{repository}") != source_sha256(f"hub:{repository}:test")
    assert source_sha256(f"hub:{repository}") != source_sha256(f"hub:{repository}?conversations=messages")
    assert source_sha256(f"hub:{copy}:test") == source_sha256(f"hub:{repository}:test")  # the rows, not the path


def test_a_dataset_read_to_its_end_is_not_streamed_again_for_its_fingerprint(offline_datasets, tmp_path, monkeypatch):
    from wingspan.data import conversations
    from wingspan.data.conversations import source_sha256

    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    repository = hub_repository(tmp_path / "repo", {"train": [{"id": str(i), "messages": turns} for i in range(3)]})
    streamed = []
    load_dataset = offline_datasets.load_dataset
    monkeypatch.setattr(offline_datasets, "load_dataset", lambda *a, **kw: streamed.append(a) or load_dataset(*a, **kw))
    read_conversations(f"hub:{repository}", limit=2)
    assert len(streamed) == 1
    read_conversations(f"hub:{repository}")
    assert len(streamed) == 2
    digest = source_sha256(f"hub:{repository}")
    assert len(streamed) == 2  # the fingerprint was taken while the rows were read
    monkeypatch.setattr(conversations, "_READ_DIGESTS", {})
    assert source_sha256(f"hub:{repository}") == digest and len(streamed) == 3


def test_a_dataset_file_that_breaks_while_read_is_a_data_error(offline_datasets, tmp_path):
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1" + b"\0" * 64)  # a parquet header and nothing readable after it
    with pytest.raises(DataError, match=rf"^{broken}(\[row 0\])?: cannot (load|read) it \("):
        read_conversations(broken)
