"""`wingspan quickstart --budget`: size the main job's data to a wall-clock budget on the machine at hand.

Before anything is generated, a short probe times each stage on the loaded target: one synthesis batch, plain
decoding at batch 1, a small dump of the target's features and a few training steps from it (all in a scratch
folder, removed after). The plan then takes the most conversations whose predicted total fits the budget, with
--text drawn in the 2-hour recipe's proportion, and is kept in `budget.json` beside the run, so that a rerun
after an interruption continues the same plan instead of measuring again.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from wingspan.config import TrainConfig
from wingspan.errors import ConfigError

if TYPE_CHECKING:
    from wingspan.data.conversations import Conversation
    from wingspan.models.target import TargetModel

# The 2-hour recipe's 1,400 conversations by the target beside 4,500 of text (docs/results/recipe.md): more
# tokens paid at every size measured, so a budget scales both, in that proportion.
TEXT_PER_CONVERSATION = 4500 / 1400
# Rates measured over a minute or two drift by a few percent over hours (other work, a warmer machine).
MARGIN = 0.95
PROBE_TOKENS = 16384  # dumped and trained on by the probe: 8 training steps at the recipe's 2,048 a step
PROBE_STEPS = 8
PROBE_WARMUP_STEPS = 2  # not timed: the first steps allocate and warm caches
PROBE_DECODE_TOKENS = 64

PLAN_FILE = "budget.json"


def parse_budget(text: str) -> float:
    """Seconds in a duration such as 2h, 90m, 1h30m or 45s."""
    match = re.fullmatch(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?", text.strip())
    if not text.strip() or not match or not any(match.groups()):
        raise ConfigError(f"--budget: expected a duration such as 2h, 90m or 1h30m, got {text!r}")
    hours, minutes, seconds = (float(g or 0) for g in match.groups())
    total = 3600 * hours + 60 * minutes + seconds
    if total <= 0:
        raise ConfigError(f"--budget: expected a positive duration, got {text!r}")
    return total


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.3g}"


@dataclasses.dataclass(frozen=True)
class Rates:
    """This machine's speed at each stage, as the probe measured it on the loaded target."""

    seconds_per_conversation: float  # the target writing one conversation (batched, as the quickstart runs it)
    tokens_per_conversation: float  # training tokens in one of them
    decode_tokens_per_s: float  # plain greedy decoding at batch 1 (the closing measurement)
    dump_tokens_per_s: float  # the target's features, written to disk
    train_tokens_per_s: float  # training from the dump (tokens in the loss windows, padding excluded)


@dataclasses.dataclass(frozen=True)
class Plan:
    budget_s: float
    request: dict  # the quickstart's other options: a rerun with others gets another plan, in another --out
    rates: Rates
    conversations: int  # the target writes these
    text_conversations: int  # of --text, drawn at random
    tokens: int
    predicted_s: dict[str, float]  # per stage, the probe and loading included ("so far")

    @property
    def predicted_total_s(self) -> float:
        return sum(self.predicted_s.values())

    def summary(self) -> str:
        stages = ", ".join(f"{name} {seconds / 60:.1f}" for name, seconds in self.predicted_s.items())
        return (
            f"--budget {minutes(self.budget_s)} min: {self.conversations} conversations by the target and "
            f"{self.text_conversations} of --text, {self.tokens} tokens, {self.request['epochs']:g} passes; "
            f"predicted {self.predicted_total_s / 60:.1f} min ({stages})"
        )


def predicted_seconds(
    rates: Rates, conversations: int, text_tokens: int, epochs: float, closing_tokens: int, so_far: float
) -> dict[str, float]:
    tokens = conversations * rates.tokens_per_conversation + text_tokens
    return {
        "so far": so_far,
        "the target's conversations": conversations * rates.seconds_per_conversation,
        "features": tokens / rates.dump_tokens_per_s,
        "training": epochs * tokens / rates.train_tokens_per_s,
        # plain decoding for each of its runs; a drafted run takes about as long as a plain one or less
        "closing measurement": closing_tokens / rates.decode_tokens_per_s,
    }


def plan_sizes(
    budget_s: float,
    request: dict,
    rates: Rates,
    text_lengths: list[int],
    closing_tokens: int,
    so_far: float,
    max_tokens: float = math.inf,
) -> Plan:
    """The most conversations (and text in the recipe's proportion, all of it at most) whose predicted total
    fits MARGIN of the budget and whose tokens `max_tokens` (the dump's room on disk). `text_lengths`: the tokens
    of each --text conversation in the order they are drawn; `request["generate"]` False: text only
    (--conversations 0). A budget too small for one conversation is refused."""
    cumulative = [0]
    for length in text_lengths:
        cumulative.append(cumulative[-1] + length)
    epochs, generate = request["epochs"], request["generate"]

    def sizes(n: int) -> tuple[int, int]:  # n counts conversations by the target, or of text when only text
        if not generate:
            return 0, min(n, len(text_lengths))
        return n, min(round(n * TEXT_PER_CONVERSATION), len(text_lengths))

    def total(n: int) -> float:
        conversations, texts = sizes(n)
        if conversations * rates.tokens_per_conversation + cumulative[texts] > max_tokens:
            return math.inf
        return sum(predicted_seconds(rates, conversations, cumulative[texts], epochs, closing_tokens, so_far).values())

    limit = MARGIN * budget_s
    if total(1) > limit:
        raise ConfigError(
            f"--budget {minutes(budget_s)} min: too small on this machine; one conversation and the closing "
            f"measurement alone would take about {minutes(total(1))} min"
            if math.isfinite(total(1))
            else f"--budget: no room on disk for the features of even one conversation ({max_tokens:.0f} tokens)"
        )
    high = 2
    while total(high) <= limit and (generate or high <= len(text_lengths)):
        high *= 2
    low = 1  # total(low) fits, total(high) does not (or high is past all the text)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if total(middle) <= limit else (low, middle)
    conversations, texts = sizes(low)
    predicted = predicted_seconds(rates, conversations, cumulative[texts], epochs, closing_tokens, so_far)
    tokens = round(conversations * rates.tokens_per_conversation) + cumulative[texts]
    return Plan(budget_s, request, rates, conversations, texts, tokens, predicted)


def against_plan(plan: Plan, spent: dict[str, float]) -> str:
    """Minutes `spent` on each of the plan's stages (this process's share, on a rerun), beside its prediction."""
    return ", ".join(
        f"{stage} {spent[stage] / 60:.1f} min (predicted {plan.predicted_s[stage] / 60:.1f})" for stage in spent
    )


def save_plan(plan: Plan, out: Path) -> None:
    (out / PLAN_FILE).write_text(json.dumps(dataclasses.asdict(plan), indent=2) + "\n")


def saved_plan(out: Path, budget_s: float, request: dict) -> Plan | None:
    """The plan an earlier run of this --out made, if any; one made for another budget or other options is
    refused (its data is already on disk)."""
    path = out / PLAN_FILE
    if not path.exists():
        return None
    try:
        raw = json.loads(path.read_text())
        plan = Plan(**{**raw, "rates": Rates(**raw["rates"])})
    except (ValueError, TypeError, KeyError) as error:
        raise ConfigError(f"{path}: not a budget plan ({error}); remove it to measure again") from None
    if plan.budget_s != budget_s or plan.request != request:
        raise ConfigError(
            f"{path}: the plan for --budget {minutes(plan.budget_s)} min and {plan.request}; give a changed setting "
            "its own --out"
        )
    return plan


def synthesized_per_batch(conversations: list[Conversation], seed: int, path: Path) -> float:
    """How many batches' worth of conversations a synthesis run made: its batches are generated whole, but a user
    turn that is too long or repeated is dropped (about one in five for SmolLM2), and the last batch is cut at
    the count asked for, so the conversations per batch come from the batches before the last."""
    from wingspan.data.synth import synth_batch_index

    batches = [synth_batch_index(c.id, seed, path) for c in conversations]
    last = max(batches)
    kept_per_batch = sum(b < last for b in batches) / last if last else len(batches)
    return (last + 1) * kept_per_batch


def typical_batch(
    tokenizer, prompts: list[Conversation], batch_size: int, longest: int
) -> tuple[list[Conversation], float]:
    """The `batch_size` of `prompts` that make a batch of average cost, and the share of `prompts` that fit: a
    regeneration drops a prompt longer than `longest` tokens unanswered, and batches the rest sorted by length,
    each batch padded to its longest, so a batch drawn at random (padded to its one long prompt) would overstate
    the cost. The batch is the run of neighbours in that order whose mean length is nearest the mean of those
    that fit."""
    from wingspan.data.template import chat_prompt

    lengths = {c.id: len(chat_prompt(tokenizer, c.as_dicts())) for c in prompts}
    fitting = sorted((c for c in prompts if lengths[c.id] <= longest), key=lambda c: lengths[c.id])
    fits = len(fitting) / len(prompts) if prompts else 0.0
    if len(fitting) <= batch_size:
        return fitting, fits
    mean = sum(lengths[c.id] for c in fitting) / len(fitting)

    def distance(start: int) -> float:
        return abs(sum(lengths[c.id] for c in fitting[start : start + batch_size]) / batch_size - mean)

    start = min(range(len(fitting) - batch_size + 1), key=distance)
    return fitting[start : start + batch_size], fits


def measure_rates(
    target: TargetModel,
    config: TrainConfig,
    probe_dir: Path,
    synth: dict,
    prompts: list[Conversation],
    answered_share: float,
    text: list[Conversation],
    text_lengths: list[int],
) -> Rates:
    """Time each stage on `target` in `probe_dir` (removed after): one batch of `synth` settings of each kind of
    conversation the run will have (answers to a `typical_batch` of `prompts`, all the run may draw, for
    `answered_share` of the conversations; invented ones for the rest), plain decoding at batch 1, then about
    PROBE_TOKENS of those conversations and of `text` (`text_lengths` tokens each) dumped and trained on for
    PROBE_STEPS steps with `config`'s recipe."""
    from wingspan.data.conversations import read_conversations, write_conversations_jsonl
    from wingspan.data.synth import regenerate, synthesize
    from wingspan.data.template import chat_prompt, tokenize_conversations
    from wingspan.pipeline import run_dump, run_training

    def tokens_in(conversations: list[Conversation]) -> int:
        tokenized, _ = tokenize_conversations(
            target.tokenizer, conversations, config.max_length, config.learn_reasoning, config.learn_prompts
        )
        return sum(len(r.input_ids) for r in tokenized)

    shutil.rmtree(probe_dir, ignore_errors=True)
    probe_dir.mkdir(parents=True)
    try:
        # per kind: its share of the conversations, and seconds and tokens per conversation asked for
        kinds: list[tuple[float, float, float]] = []
        data, written, generated_tokens = [], [], 0
        longest = config.max_length - synth["max_new_tokens"]
        batch, fits = typical_batch(target.tokenizer, prompts, synth["batch_size"], longest)
        if answered_share and batch:
            path = probe_dir / "replies.jsonl"
            started = time.perf_counter()
            regenerate(
                target,
                batch,
                path,
                max_new_tokens=synth["max_new_tokens"],
                batch_size=synth["batch_size"],
                max_length=config.max_length,
                seed=config.seed,
            )
            elapsed = time.perf_counter() - started
            replies, _ = read_conversations(path, require_assistant=True)
            tokens = tokens_in(replies)
            # a prompt too long to answer costs nothing and adds nothing, but counts as asked for
            kinds.append((answered_share, fits * elapsed / len(batch), fits * tokens / len(batch)))
            data.append(str(path))
            written += replies
            generated_tokens += tokens
        if answered_share < 1:
            path = probe_dir / "synth.jsonl"
            started = time.perf_counter()
            synthesize(
                target,
                synth["batch_size"],
                path,
                batch_size=synth["batch_size"],
                max_new_tokens=synth["max_new_tokens"],
                seed=config.seed,
            )
            elapsed = time.perf_counter() - started
            invented, _ = read_conversations(path, require_assistant=True)
            made = synthesized_per_batch(invented, config.seed, path)
            tokens = tokens_in(invented)
            kinds.append((1 - answered_share, elapsed / made, tokens / len(invented)))
            data.append(str(path))
            written += invented
            generated_tokens += tokens
        if not written:
            raise ConfigError(
                f"--prompts: no prompt is short enough to answer (at most {longest} tokens, for max_length "
                f"{config.max_length} with a {synth['max_new_tokens']}-token reply)"
            )
        per_conversation = sum(share * seconds for share, seconds, _ in kinds)
        tokens_per_conversation = sum(share * tokens for share, _, tokens in kinds)

        first_user = next(m.content for m in written[0].messages if m.role == "user")
        started = time.perf_counter()
        asked = chat_prompt(target.tokenizer, [{"role": "user", "content": first_user}])
        decoded = target.generate([asked], PROBE_DECODE_TOKENS)
        decode_rate = max(1, len(decoded[0].tokens)) / (time.perf_counter() - started)

        sample, tokens = [], generated_tokens
        for conversation, length in zip(text, text_lengths):
            if tokens >= PROBE_TOKENS:
                break
            if length:
                sample.append(conversation)
                tokens += length
        if sample:
            write_conversations_jsonl(sample, probe_dir / "text.jsonl")
            data.append(str(probe_dir / "text.jsonl"))
        probe = dataclasses.replace(
            config,
            data=data,
            from_dump=str(probe_dir / "dump"),
            output_dir=str(probe_dir / "run"),
            max_steps=PROBE_STEPS,
            log_every=1,
            save_every=PROBE_STEPS,
            tracker=[],
        )
        started = time.perf_counter()
        manifest = run_dump(probe, probe_dir / "dump", target=target)
        dump_rate = manifest.num_tokens / (time.perf_counter() - started)
        run_training(probe, target=target)
        steps = [json.loads(line) for line in (probe_dir / "run" / "metrics.jsonl").read_text().splitlines()]
        timed = steps[PROBE_WARMUP_STEPS:]
        train_rate = sum(s["tokens"] for s in timed) / sum(s["tokens"] / s["tokens_per_s"] for s in timed)
    finally:
        shutil.rmtree(probe_dir, ignore_errors=True)
    return Rates(
        seconds_per_conversation=per_conversation,
        tokens_per_conversation=tokens_per_conversation,
        decode_tokens_per_s=decode_rate,
        dump_tokens_per_s=dump_rate,
        train_tokens_per_s=train_rate,
    )
