"""Training conversations written by the target itself, so the draft learns the target's own distribution.

- `synthesize` needs no dataset: the target writes the user turn too, by continuing its own chat
  template's user-turn prefix (sampled, for variety), then answers it (greedy by default, as evaluation is).
- `regenerate` keeps the user turns of existing conversations and replaces every assistant turn by the
  target's reply, turn by turn, each reply conditioned on the target's own earlier replies.

Both append to a JSONL file ({"id", "conversations": [{"role", "content"}]}) after every batch and resume
from it, and a resumed run writes the same file an uninterrupted one would: batches are fixed in advance
and each is seeded on its own.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from pathlib import Path

from tqdm import tqdm

from wingspan.config import require_range
from wingspan.data.conversations import (
    Conversation,
    Message,
    Regeneration,
    RegenerationReport,
    append_conversations_jsonl,
    open_output,
    read_finished,
    start_output,
    write_conversations_jsonl,
)
from wingspan.data.template import chat_prompt, end_of_turn_id, special_ids, user_turn_prefix
from wingspan.errors import DataError
from wingspan.models.target import Generation, TargetModel

MIN_USER_CHARS = 10  # shorter sampled user turns are greetings or fragments ("Hi", "What?")
MAX_STUCK_BATCHES = 20  # synthesize gives up when this many batches in a row yield nothing usable


def generator_identity(target: TargetModel) -> dict:
    """What the replies depend on besides the settings: the target (by fingerprint, so that a moved checkpoint
    is the same target), its dtype, and its chat template with any fixed variables."""
    from wingspan.data.hidden_states import target_fingerprint, template_fingerprint

    return dict(
        target=target_fingerprint(target),
        dtype=str(target.dtype).removeprefix("torch."),
        chat_template=template_fingerprint(target.tokenizer),
    )


def decode(target: TargetModel, generation: Generation) -> str:
    return target.tokenizer.decode(generation.tokens)


# ------------------------------------------------------------------------------------------------------


def synthesize(
    target: TargetModel,
    num_conversations: int,
    out_path: str | Path,
    *,
    batch_size: int = 16,
    max_new_tokens: int = 256,
    max_user_tokens: int = 128,
    user_temperature: float = 1.0,
    reply_temperature: float = 0.0,
    seed: int = 0,
    resume: bool = False,
) -> int:
    """Write `num_conversations` single-turn conversations, user and assistant both by the target.

    A user turn is dropped when it does not end within max_user_tokens, is shorter than MIN_USER_CHARS,
    holds a special token, or repeats an earlier one; a conversation with an empty reply is dropped too.
    Replies that hit max_new_tokens are kept, cut. Ids are synth-{seed}-{batch}-{index}. With `resume` an
    earlier run into `out_path` with the same settings is continued (or extended to a larger
    `num_conversations`). Returns the number of conversations in `out_path`.
    """
    require_range("user_temperature", user_temperature, above=0)  # greedy user turns would all be the same
    require_range("reply_temperature", reply_temperature, at_least=0)
    out_path = Path(out_path)
    settings = dict(
        **generator_identity(target),
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        max_user_tokens=max_user_tokens,
        user_temperature=user_temperature,
        reply_temperature=reply_temperature,
        seed=seed,
    )

    def synthesized(finished: list[Conversation]) -> None:
        for conversation in finished:
            synth_batch_index(conversation.id, seed, out_path)

    done = read_finished(out_path) if open_output(out_path, resume, settings, synthesized) else []
    if len(done) >= num_conversations:
        return len(done)
    batch = 0
    if done:
        # The last batch may have been cut short: drop it and generate it again, identically.
        batch = synth_batch_index(done[-1].id, seed, out_path)
        done = [c for c in done if synth_batch_index(c.id, seed, out_path) < batch]
    write_conversations_jsonl(done, out_path)

    prefix = user_turn_prefix(target.tokenizer)
    # A user turn ends with the template's end-of-user-turn token ([/INST] for Mistral), or any eos.
    user_end = end_of_turn_id(target.tokenizer, "user")
    user_stops = sorted(set(target.eos_token_ids) | ({user_end} if user_end is not None else set()))
    specials = special_ids(target.tokenizer)
    seen = {c.messages[0].content for c in done}
    rejected: Counter = Counter()
    count, stuck = len(done), 0
    with tqdm(total=num_conversations, initial=count, desc="synthesize", unit="conv") as bar:
        while count < num_conversations:
            rng = random.Random(f"synth/{seed}/{batch}")
            users = []
            sampled = target.generate(
                [prefix] * batch_size, max_user_tokens, user_temperature, stop_ids=user_stops, seed=rng.getrandbits(63)
            )
            for generation in sampled:
                text = decode(target, generation).strip()
                reason = reject_user_turn(generation, text, specials, seen | set(users))
                if reason:
                    rejected[reason] += 1
                else:
                    users.append(text)
            reply_seed = rng.getrandbits(63)
            prompts = [chat_prompt(target.tokenizer, [{"role": "user", "content": u}]) for u in users]
            replies = target.generate(prompts, max_new_tokens, reply_temperature, seed=reply_seed) if users else []
            new = []
            for user, reply in zip(users, replies):
                if not reply.tokens:
                    rejected["empty reply"] += 1
                    continue
                # Only kept turns count as seen: a resumed run knows no more than what the file holds.
                seen.add(user)
                messages = [Message("user", user), Message("assistant", decode(target, reply))]
                new.append(Conversation(messages, id=f"synth-{seed}-{batch}-{len(new)}", source=str(out_path)))
            new = new[: num_conversations - count]
            append_conversations_jsonl(new, out_path)
            count += len(new)
            bar.update(len(new))
            bar.set_postfix(dict(rejected.most_common(3)))
            stuck = 0 if new else stuck + 1
            if stuck >= MAX_STUCK_BATCHES:
                raise DataError(
                    f"{target.name}: {stuck} batches in a row gave no usable conversation (rejected: "
                    f"{dict(rejected)}); is it an instruction-tuned model with a chat template?"
                )
            batch += 1
    return count


def reject_user_turn(generation: Generation, text: str, specials: set[int], seen: set[str]) -> str | None:
    """Why a sampled user turn is unusable, or None."""
    if not generation.stopped:
        return "too long"
    if len(text) < MIN_USER_CHARS:
        return "too short"
    if specials.intersection(generation.tokens):
        return "special token"
    if text in seen:
        return "duplicate"
    return None


def synth_batch_index(conversation_id: str, seed: int, path: Path) -> int:
    match = re.fullmatch(rf"synth-{seed}-(\d+)-\d+", conversation_id)
    if not match:
        raise DataError(
            f"{path}: id {conversation_id!r} is not from a synthesize run with seed {seed}; use another output file"
        )
    return int(match.group(1))


# ------------------------------------------------------------------------------------------------------


def regenerate(
    target: TargetModel,
    conversations: list[Conversation],
    out_path: str | Path,
    *,
    temperature: float = 0.0,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    max_length: int = 2048,
    seed: int = 0,
    resume: bool = False,
) -> RegenerationReport:
    """Replace every assistant turn by the target's own reply; add one after each user turn that has none.

    System and user messages are kept as they are, in order, and so are the ids. A conversation stops at
    the first user turn whose prompt plus max_new_tokens would exceed max_length (its earlier turns are
    kept; with none left it is dropped, and counted). Batches are built from conversations sorted by prompt
    length (less padding). With resume, conversations whose id is already in `out_path` are not redone (see
    `start_output`).
    """
    require_range("temperature", temperature, at_least=0)
    out_path = Path(out_path)
    settings = dict(
        **generator_identity(target),
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        max_length=max_length,
        seed=seed,
    )
    done = start_output(conversations, out_path, resume, settings)
    finished = {c.id for c in done}

    first_prompt_length = {}
    for conversation in conversations:
        turns = conversation.as_dicts()
        first_user = next(i for i, m in enumerate(turns) if m["role"] == "user")
        first_prompt_length[conversation.id] = len(chat_prompt(target.tokenizer, turns[: first_user + 1]))
    ordered = sorted(conversations, key=lambda c: first_prompt_length[c.id])
    batches = [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]

    report = RegenerationReport(out_path, written=len(done))
    with tqdm(total=len(conversations), desc="regenerate", unit="conv") as bar:
        for number, batch in enumerate(batches):
            todo = [c for c in batch if c.id not in finished]
            bar.update(len(batch) - len(todo))
            if not todo:
                continue
            # The whole batch is generated even when part of it was written before an interruption:
            # padding, and so the numerics, must be those of the uninterrupted run.
            replied = regenerate_batch(target, batch, temperature, max_new_tokens, max_length, f"{seed}/{number}")
            new = [report.add(r) for r in replied if r.original.id not in finished]
            append_conversations_jsonl([c for c in new if c is not None], out_path)
            bar.update(len(todo))
            if report.dropped:
                bar.set_postfix(dropped=sum(report.dropped.values()))
    return report


def regenerate_batch(
    target: TargetModel,
    batch: list[Conversation],
    temperature: float,
    max_new_tokens: int,
    max_length: int,
    seed: str,
) -> list[Regeneration]:
    """Regenerate every conversation of `batch`, one round per turn, each round one batched generate."""
    rng = random.Random(f"regenerate/{seed}")
    regenerations = [Regeneration(c) for c in batch]
    while active := [r for r in regenerations if not r.done]:
        prompts, waiting = [], []
        for regeneration in active:
            prompt = chat_prompt(target.tokenizer, regeneration.next_prompt())
            if len(prompt) + max_new_tokens > max_length:
                regeneration.answer(None)
                continue
            prompts.append(prompt)
            waiting.append(regeneration)
        if waiting:
            replies = target.generate(prompts, max_new_tokens, temperature=temperature, seed=rng.getrandbits(63))
            for regeneration, reply in zip(waiting, replies):
                regeneration.answer(decode(target, reply))
    return regenerations
