"""Read chat datasets of the common shapes into one `Conversation` type; bad input names its file and line.

Formats, detected per record (a file may mix them):

- ShareGPT      {"conversations": [{"from": "human", "value": ...}, ...]}  (items may also be {"role", "content"})
- OpenAI        {"messages": [{"role": "user", "content": ...}, ...]}
- EAGLE prompts {"question_id": ..., "turns": ["...", ...]}            -> user turns only (a prompt set)
- instruction   {"instruction", "input"?, "response" | "output"}       (Alpaca, GPTeacher)
                {"instruction", "instances": [{"input", "output"}]}     (self-instruct seed tasks; one per instance)
- Q&A           {"question", "answer"}                                  (GSM8K)
- HumanEval     {"task_id", "prompt", "canonical_solution"}

A source is a file, .jsonl (one record per line) or .json (an array of records), optionally gzipped
(.jsonl.gz), or a dataset read by the `datasets` package, whose rows are the records:
- a .parquet or .arrow file;
- a directory written by `datasets` (`save_to_disk`);
- `hub:ID[:SPLIT]`, a dataset on the Hugging Face hub (streamed; split `train` by default), or a local copy of
  its repository given as `hub:DIR[:SPLIT]`.
A dataset source takes options after `?`: `config=NAME`, `split=NAME`, and `FIELD=COLUMN` to read a column
under the name these formats expect (`hub:org/chats:train?conversations=dialog`). Errors name the source and
the row (`hub:org/chats:train[row 7]`).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qsl

from wingspan.config import read_mapping
from wingspan.errors import DataError, import_optional
from wingspan.files import sha256_of, write_text_atomically

Role = Literal["system", "user", "assistant"]

ROLE_NAMES: dict[str, Role] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
}


@dataclass
class Message:
    role: Role
    content: str


@dataclass
class Conversation:
    messages: list[Message]
    id: str
    source: str  # where it was read: "path:line" (.jsonl) or "path[index]" (.json)
    category: str | None = None  # the record's "category" (MT-bench: writing, math, ...), for per-category eval

    def has_assistant_turn(self) -> bool:
        return any(m.role == "assistant" for m in self.messages)

    def as_dicts(self) -> list[dict[str, str]]:
        """The messages as chat-template input: [{"role", "content"}, ...]."""
        return [{"role": m.role, "content": m.content} for m in self.messages]


@dataclass
class SkipReport:
    """What was dropped and why: counts per reason, plus the first few examples with their file:line."""

    total: int = 0  # records (or conversations) looked at
    counts: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    max_examples: int = 5

    @property
    def skipped(self) -> int:
        return sum(self.counts.values())

    def add(self, reason: str, example: str) -> None:
        self.counts[reason] += 1
        if len(self.examples) < self.max_examples:
            self.examples.append(example)

    def summary(self) -> str:
        if not self.counts:
            return f"kept all {self.total}"
        reasons = ", ".join(f"{reason}: {n}" for reason, n in self.counts.most_common())
        lines = [f"skipped {self.skipped} of {self.total} ({reasons})"]
        lines += [f"  e.g. {example}" for example in self.examples]
        return "\n".join(lines)


class _BadRecord(Exception):
    """A record that is malformed; `reason` is the short key counted in SkipReport."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass
class _Malformed:
    """Stands in for a .jsonl line that is not JSON, so the reader can report it like any other bad record."""

    error: str


# --------------------------------------------------------------------------------------------------
# reading


def read_conversations(
    path: str | Path, strict: bool = False, require_assistant: bool = False, limit: int | None = None
) -> tuple[list[Conversation], SkipReport]:
    """Read every conversation in `path` (a file or a dataset source: the module docstring), normalised so
    that any chat template accepts it.

    Bad records (not JSON, unknown format, missing field, unknown role, non-string content) raise DataError
    naming `file:line` (or `file[index]`) and the field when `strict`; otherwise they are skipped and counted.

    Normalisation of every record but EAGLE prompt sets, applied in this order:
    1. messages whose content is empty or whitespace are dropped (they carry nothing to learn or ask);
    2. assistant messages before the first user message are dropped (ShareGPT scrapes often start mid-chat,
       and templates expect the user to speak first; a system message is kept);
    3. consecutive messages of the same role are merged, joined by a blank line (ShareGPT splits long
       replies; most templates require alternating roles).
    A conversation with no user message left is skipped ("no user turn"); with `require_assistant` (training
    data), one without an assistant message is skipped too ("no assistant turn"). These are counted skips even
    when `strict`, because the records are well formed. EAGLE prompt sets keep their user turns as they are:
    each turn is asked after the model answered the previous one.

    A missing or empty source, or one with no usable conversation, is always a DataError. With `limit`, reading
    stops at that many conversations (a streamed hub dataset is not read further).
    """
    report = SkipReport()
    conversations: list[Conversation] = []
    stem = _stem(str(path))
    for number, (source, record) in enumerate(_records(str(path))):
        if limit is not None and len(conversations) >= limit:
            break
        report.total += 1
        try:
            parsed = _parse_record(record, source, default_id=f"{stem}-{number}")
        except _BadRecord as bad:
            if strict:
                raise DataError(f"{source}: {bad.detail}") from None
            report.add(bad.reason, f"{source}: {bad.detail}")
            continue
        for conversation in parsed:
            if not any(m.role == "user" for m in conversation.messages):
                report.add("no user turn", f"{source}: no user message")
            elif require_assistant and not conversation.has_assistant_turn():
                report.add("no assistant turn", f"{source}: no assistant message to train on")
            else:
                conversations.append(conversation)
    if report.total == 0:
        raise DataError(f"{path}: empty file (no records)")
    if not conversations:
        raise DataError(f"{path}: no usable conversation; {report.summary()}")
    return conversations[:limit], report


DATASET_FILE_TYPES = {".parquet": "parquet", ".arrow": "arrow"}  # suffix -> `datasets` builder
HUB_PREFIX = "hub:"


def is_dataset_source(spec: str) -> bool:
    """Whether `spec` is read through `datasets` (a hub id, a saved dataset directory, parquet or arrow)."""
    base = spec if Path(spec).exists() else spec.partition("?")[0]
    return base.startswith(HUB_PREFIX) or Path(base).is_dir() or Path(base).suffix in DATASET_FILE_TYPES


def _stem(spec: str) -> str:
    if spec.startswith(HUB_PREFIX):
        return spec.partition("?")[0].removeprefix(HUB_PREFIX).split(":")[0].rstrip("/").rsplit("/", 1)[-1]
    return Path(spec.partition("?")[0] if is_dataset_source(spec) else spec).name.removesuffix(".gz").split(".")[0]


def source_sha256(spec: str) -> str:
    """What a source holds, for fingerprints: a file's sha256; for a dataset source, the sha256 of its records
    as read (after the column options), so that another split, config or mapping is another source."""
    return _records_sha256(spec) if is_dataset_source(spec) else sha256_of(spec)


# spec -> the sha256 of its records, taken as they were read to the end (a hub dataset is then not streamed
# again for its fingerprint)
_READ_DIGESTS: dict[str, str] = {}


def _records_sha256(spec: str) -> str:
    if spec not in _READ_DIGESTS:
        for _ in _dataset_records(spec):
            pass
    return _READ_DIGESTS[spec]


def _records(spec: str) -> Iterator[tuple[str, Any]]:
    """Yield (source, record) for each record of a .jsonl or .json file (gzipped or not) or dataset source."""
    if is_dataset_source(spec):
        yield from _dataset_records(spec)
        return
    path = Path(spec)
    name = path.name.removesuffix(".gz")
    if not name.endswith((".jsonl", ".json")):
        raise DataError(
            f"{path}: unsupported file type; expected .jsonl or .json (optionally .gz), .parquet, .arrow, "
            "a dataset directory or hub:ID"
        )
    try:
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError, EOFError) as error:
        raise DataError(f"{path}: cannot read ({error})") from None

    if name.endswith(".jsonl"):
        # JSON Lines ends records at "\n" only: str.splitlines() would also cut a record at the U+2028, U+2029
        # or U+0085 that JSON keeps unescaped inside strings (scraped text has them).
        for line_number, line in enumerate(text.split("\n"), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                record = _Malformed(f"{error.msg} at column {error.colno}")
            yield f"{path}:{line_number}", record
        return
    try:
        records = json.loads(text) if text.strip() else []
    except json.JSONDecodeError as error:
        raise DataError(f"{path}:{error.lineno}: not valid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(records, list):
        raise DataError(f"{path}: a .json file must hold an array of records, got a {type(records).__name__}")
    for index, record in enumerate(records):
        yield f"{path}[{index}]", record


def _dataset_records(spec: str) -> Iterator[tuple[str, Any]]:
    """Yield (source, record) for each row of a dataset source (module docstring), its columns renamed."""
    base, _, query = spec.partition("?")
    if Path(spec).exists():
        base, query = spec, ""
    options = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=False))
    if query and not options:
        raise DataError(f"{spec}: cannot read the options after '?'; expected KEY=VALUE&KEY=VALUE")
    config, split = options.pop("config", None), options.pop("split", None)
    renames = options  # field -> column
    if config is not None and not base.startswith(HUB_PREFIX):
        raise DataError(f"{spec}: config= names a configuration of a hub dataset; {base} has none")
    if split is not None and not base.startswith(HUB_PREFIX) and not Path(base).is_dir():
        raise DataError(f"{spec}: split= chooses a split of a hub dataset or a saved dataset; {base} is one file")
    datasets = import_optional("datasets", "datasets", f"reading {base}")
    try:
        if base.startswith(HUB_PREFIX):
            dataset_id, _, named_split = base.removeprefix(HUB_PREFIX).partition(":")
            if not dataset_id:
                raise DataError(f"{spec}: no dataset id after {HUB_PREFIX!r}; expected hub:ID[:SPLIT]")
            if named_split and split is not None and named_split != split:
                raise DataError(f"{spec}: two splits, {named_split!r} after ':' and {split!r} after '?'; give one")
            split = named_split or split or "train"
            label = f"{HUB_PREFIX}{dataset_id}:{split}"
            rows = datasets.load_dataset(dataset_id, config, split=split, streaming=True)
        elif Path(base).is_dir():
            label = base
            rows = datasets.load_from_disk(base)
            if isinstance(rows, datasets.DatasetDict):
                if split is None and len(rows) != 1:
                    raise DataError(f"{base}: a dataset of splits {list(rows)}; choose one with {base}?split=NAME")
                label = f"{base}:{split or next(iter(rows))}"
                rows = rows[split or next(iter(rows))]
        else:
            if not Path(base).is_file():
                raise DataError(f"{base}: file not found")
            label = base
            rows = datasets.load_dataset(
                DATASET_FILE_TYPES[Path(base).suffix], data_files=base, split="train", streaming=True
            )
        columns = rows.column_names
    except DataError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as error:  # not found, offline, no such config or split
        raise DataError(f"{spec}: cannot load it ({_first_line(error)})") from None
    if columns is not None:
        missing = {field: column for field, column in renames.items() if column not in columns}
        if missing:
            raise DataError(
                f"{spec}: no column(s) {sorted(missing.values())} to read as {sorted(missing)}; it has {columns}"
            )
    iterator, index, digest = iter(rows), 0, hashlib.sha256()
    while True:
        try:
            row = next(iterator, None)
        except (OSError, ValueError, TypeError) as error:  # a stream cut off, a row the format cannot cast
            raise DataError(f"{label}[row {index}]: cannot read it ({_first_line(error)})") from None
        if row is None:
            _READ_DIGESTS[spec] = digest.hexdigest()
            return
        record = dict(row)
        for field_name, column in renames.items():
            if column not in record:
                raise DataError(f"{label}[row {index}]: no column {column!r} to read as {field_name!r}")
            record[field_name] = record.pop(column)
        digest.update(json.dumps(record, sort_keys=True, default=str).encode() + b"\n")
        yield f"{label}[row {index}]", record
        index += 1


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _parse_record(record: Any, source: str, default_id: str) -> list[Conversation]:
    if isinstance(record, _Malformed):
        raise _BadRecord("malformed JSON", f"not valid JSON: {record.error}")
    if not isinstance(record, dict):
        raise _BadRecord("not a JSON object", f"expected a JSON object, got {type(record).__name__}")
    record_id = record.get("id", record.get("question_id", record.get("task_id", default_id)))
    category = record["category"] if isinstance(record.get("category"), str) else None

    def conversation(messages: list[Message], suffix: str = "") -> Conversation:
        return Conversation(_normalise(messages), id=f"{record_id}{suffix}", source=source, category=category)

    if "conversations" in record or "messages" in record:
        key = "conversations" if "conversations" in record else "messages"
        return [conversation(_chat_messages(record[key], key))]
    if "turns" in record:
        turns = _list(record, "turns")
        messages = [Message("user", _string(turn, f"turns[{i}]")) for i, turn in enumerate(turns)]
        # Not merged: each turn is one prompt, asked after the model answered the previous one.
        return [Conversation(messages, id=str(record_id), source=source, category=category)]
    if "instruction" in record:
        instruction = _string(record["instruction"], "instruction")
        if "instances" in record:
            instances = _list(record, "instances")
            suffixes = [f"-{i}" for i in range(len(instances))] if len(instances) > 1 else [""]
            return [
                conversation(_instruction_messages(instruction, instance, f"instances[{i}]"), suffixes[i])
                for i, instance in enumerate(instances)
            ]
        return [conversation(_instruction_messages(instruction, record, ""))]
    if "question" in record:
        return [conversation(_exchange(record, "question", "answer"))]
    if "prompt" in record and "canonical_solution" in record:
        return [conversation(_exchange(record, "prompt", "canonical_solution"))]
    keys = ", ".join(sorted(record)[:8])
    raise _BadRecord(
        "unknown format",
        f"unknown record format (keys: {keys}); expected one of 'conversations', 'messages', 'turns', "
        "'instruction', 'question', or 'prompt' with 'canonical_solution'",
    )


def _chat_messages(items: Any, key: str) -> list[Message]:
    if not isinstance(items, list):
        raise _BadRecord("wrong type", f"{key}: expected a list of messages, got {type(items).__name__}")
    messages = []
    for i, item in enumerate(items):
        where = f"{key}[{i}]"
        if not isinstance(item, dict):
            raise _BadRecord("wrong type", f"{where}: expected an object, got {type(item).__name__}")
        # ShareGPT says {"from", "value"}, OpenAI {"role", "content"}; some ShareGPT files use the latter.
        role_key, content_key = ("from", "value") if "from" in item else ("role", "content")
        for needed in (role_key, content_key):
            if needed not in item:
                raise _BadRecord("missing field", f"{where}: missing field '{needed}'")
        role = item[role_key]
        if not isinstance(role, str) or role.lower() not in ROLE_NAMES:
            known = ", ".join(ROLE_NAMES)
            raise _BadRecord("unknown role", f"{where}.{role_key}: unknown role {role!r} (known: {known})")
        messages.append(Message(ROLE_NAMES[role.lower()], _string(item[content_key], f"{where}.{content_key}")))
    return messages


def _normalise(messages: list[Message]) -> list[Message]:
    """Drop empty and leading assistant messages, merge runs of one role (see read_conversations)."""
    normalised: list[Message] = []
    seen_user = False
    for message in messages:
        if not message.content.strip():
            continue
        if message.role == "assistant" and not seen_user:
            continue
        seen_user = seen_user or message.role == "user"
        if normalised and normalised[-1].role == message.role:
            normalised[-1] = Message(message.role, normalised[-1].content + "\n\n" + message.content)
        else:
            normalised.append(Message(message.role, message.content))
    return normalised


def _instruction_messages(instruction: str, fields: Any, where: str) -> list[Message]:
    prefix = f"{where}." if where else ""
    if not isinstance(fields, dict):
        raise _BadRecord("wrong type", f"{where}: expected an object, got {type(fields).__name__}")
    extra = _string(fields.get("input") or "", f"{prefix}input")
    prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    answer_key = "response" if "response" in fields else "output"
    if answer_key not in fields:
        raise _BadRecord("missing field", f"{where + ': ' if where else ''}missing field 'response' (or 'output')")
    return [Message("user", prompt), Message("assistant", _string(fields[answer_key], f"{prefix}{answer_key}"))]


def _exchange(record: dict, ask: str, answer: str) -> list[Message]:
    if answer not in record:
        raise _BadRecord("missing field", f"missing field '{answer}'")
    return [Message("user", _string(record[ask], ask)), Message("assistant", _string(record[answer], answer))]


def _list(record: dict, key: str) -> list:
    if not isinstance(record[key], list):
        raise _BadRecord("wrong type", f"{key}: expected a list, got {type(record[key]).__name__}")
    return record[key]


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        shown = "null" if value is None else type(value).__name__
        raise _BadRecord("non-string content", f"{where}: expected a string, got {shown}")
    return value


# --------------------------------------------------------------------------------------------------
# writing


def _lines(conversations: Iterable[Conversation]) -> str:
    return "".join(
        json.dumps({"id": c.id, "conversations": c.as_dicts()}, ensure_ascii=False) + "\n" for c in conversations
    )


def write_conversations_jsonl(conversations: Iterable[Conversation], path: str | Path) -> None:
    """Write {"id", "conversations": [{"role", "content"}]} per line, atomically."""
    write_text_atomically(path, _lines(conversations))


def append_conversations_jsonl(conversations: Iterable[Conversation], path: str | Path) -> None:
    """Append to a .jsonl file as results arrive (resumable generation); flushed to disk before returning.

    A line cut short by a crash reads back as one skipped malformed record; the next append starts a new line
    so that it does not glue itself onto that broken line.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        text = _lines(conversations)
        f.seek(0, os.SEEK_END)
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                text = "\n" + text
        f.write(text.encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())


def read_finished(path: Path) -> list[Conversation]:
    """The complete records of a previous run's output; a last line cut short by an interruption is dropped."""
    lines = path.read_text(encoding="utf-8").split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # no newline after it: the write was cut off
                break
            raise DataError(f"{path}:{number}: not valid JSON; is this file the output of an earlier run?") from None
        messages = [Message(m["role"], m["content"]) for m in record["conversations"]]
        records.append(Conversation(messages, id=record["id"], source=f"{path}:{number}"))
    return records


class Regeneration:
    """One conversation whose assistant turns are replaced, turn by turn, by the target's replies: its system
    and user messages are kept in order, and each user turn is asked after the target's own earlier replies.
    Both regenerators drive it: in process (many in lockstep, one batched generate per round) and through a
    server (one request at a time)."""

    CONTEXT_FULL = "the next prompt no longer fits the context"

    def __init__(self, conversation: Conversation) -> None:
        self.original = conversation
        self.history: list[Message] = []  # the regenerated conversation so far
        self.unasked = [m for m in conversation.messages if m.role != "assistant"]
        self.ended_early: str | None = None  # why it ended before its last user turn

    @property
    def done(self) -> bool:
        return not any(m.role == "user" for m in self.unasked)

    def _next_turn(self) -> list[Message]:
        """The messages up to and including the next user turn (a system message may lead)."""
        cut = next(k for k, m in enumerate(self.unasked) if m.role == "user") + 1
        return self.unasked[:cut]

    def next_prompt(self) -> list[dict[str, str]]:
        """The conversation to answer next, as chat-template input (call only while not `done`)."""
        return [{"role": m.role, "content": m.content} for m in self.history + self._next_turn()]

    def answer(self, reply: str | None, why_none: str = CONTEXT_FULL) -> None:
        """The target's reply to `next_prompt()`; None when there is none to keep (`why_none`): the
        conversation then ends with its previous reply."""
        if reply is None:
            self.unasked = []
            self.ended_early = why_none
            return
        turn = self._next_turn()
        self.history += turn + [Message("assistant", reply)]
        self.unasked = self.unasked[len(turn) :]

    def conversation(self) -> Conversation:
        return Conversation(self.history, id=self.original.id, source=self.original.source)


@dataclass
class RegenerationReport:
    """What a regeneration wrote, and what it dropped or cut, with the reasons."""

    out: Path
    written: int = 0  # conversations in the output, earlier runs' included
    dropped: Counter = field(default_factory=Counter)  # reason -> conversations left out (no reply at all)
    shortened: Counter = field(default_factory=Counter)  # reason -> conversations that lost their later turns

    def add(self, regeneration: Regeneration) -> Conversation | None:
        """Count `regeneration`'s outcome; its conversation when it is kept."""
        conversation = regeneration.conversation()
        if not conversation.has_assistant_turn():
            self.dropped[regeneration.ended_early or "no reply"] += 1
            return None
        if regeneration.ended_early:
            self.shortened[regeneration.ended_early] += 1
        self.written += 1
        return conversation

    def summary(self) -> str:
        parts = [f"wrote {self.out} ({self.written} conversations)"]
        for label, counts in (("dropped", self.dropped), ("ended early", self.shortened)):
            if counts:
                reasons = ", ".join(f"{n} because {reason}" for reason, n in counts.most_common())
                parts.append(f"{label}: {sum(counts.values())} ({reasons})")
        return "; ".join(parts)


def settings_path(out_path: Path) -> Path:
    """The file beside a regeneration's output that records what it was made from."""
    return out_path.with_name(out_path.name + ".settings.json")


def conversations_sha256(conversations: list[Conversation]) -> str:
    """sha256 of the conversations' ids and non-assistant messages: what a regeneration keeps of its input."""
    kept = [[c.id, [[m.role, m.content] for m in c.messages if m.role != "assistant"]] for c in conversations]
    return hashlib.sha256(json.dumps(kept).encode()).hexdigest()


def open_output(out_path: Path, resume: bool, settings: dict, unrecorded: Callable[[list[Conversation]], None]) -> bool:
    """Check a generated output against `resume` before anything is written: an existing output is refused
    without `resume`; with it, it must have been made with the same `settings` (recorded beside it,
    `settings_path`, which this then writes). An output from before settings were recorded is continued only
    when `unrecorded(its conversations)` (which raises DataError otherwise) finds them this run's. Returns
    whether there is an earlier run's output to continue."""
    recorded_path = settings_path(out_path)
    exists = out_path.exists() and out_path.stat().st_size > 0
    if exists and not resume:
        raise FileExistsError(f"{out_path}: exists; pass --resume to continue it, or choose another --out")
    if exists and not recorded_path.exists():
        unrecorded(read_finished(out_path))
        print(
            f"warning: {out_path}: no {recorded_path.name} (an older wingspan's output): its settings are not checked"
        )
    elif exists:
        recorded = read_mapping(recorded_path)
        differ = [k for k in settings if recorded.get(k) != settings[k]]
        if differ:
            changes = [f"{k}: {recorded.get(k)!r} -> {settings[k]!r}" for k in differ if k not in INPUT_KEYS]
            if set(differ) & set(INPUT_KEYS):
                changes.insert(0, "the input conversations (their ids or user turns, or --limit) changed")
            raise DataError(
                f"{out_path}: --resume with another input or settings than it was made with: {'; '.join(changes)}"
            )
    write_text_atomically(recorded_path, json.dumps(settings, indent=2) + "\n")
    return exists


INPUT_KEYS = ("conversations", "count")


def made_from(conversations: list[Conversation]) -> Callable[[list[Conversation]], None]:
    """A check that regenerated conversations were made from `conversations`: each id is there, with the
    same system and user turns (or the first of them, for one that ended early)."""
    asked = {c.id: [(m.role, m.content) for m in c.messages if m.role != "assistant"] for c in conversations}

    def check(finished: list[Conversation]) -> None:
        for conversation in finished:
            kept = [(m.role, m.content) for m in conversation.messages if m.role != "assistant"]
            if conversation.id not in asked or asked[conversation.id][: len(kept)] != kept:
                raise DataError(
                    f"{conversation.source}: conversation {conversation.id!r} was not regenerated from this input "
                    "(unknown id, or other user turns); use another --out"
                )

    return check


def start_output(conversations: list[Conversation], out_path: Path, resume: bool, settings: dict) -> list[Conversation]:
    """Start (or, with `resume`, continue: `open_output`) a regeneration's output, which is resumed by
    conversation id, from the same conversations (compared by `conversations_sha256`). The ids must be unique.
    Returns the conversations a previous run finished, after rewriting the file with just those, which drops a
    last line cut short by an interruption."""
    repeated = [i for i, n in Counter(c.id for c in conversations).items() if n > 1]
    if repeated:
        raise DataError(f"conversation ids must be unique to resume by id; repeated: {repeated[:5]}")
    record = dict(settings, conversations=conversations_sha256(conversations), count=len(conversations))
    done = read_finished(out_path) if open_output(out_path, resume, record, made_from(conversations)) else []
    write_conversations_jsonl(done, out_path)
    return done
