"""`wingspan quickstart --budget`: size the main job's data to a wall-clock budget on the machine at hand.

Before anything is generated, a short probe times each stage on the loaded target: the target's answers to a
batch of typical --prompts and to the longest batch (a batch's cost grows with its padded length), one synthesis
batch, plain decoding at batch 1, a small dump of the target's features and a few training steps from it (all in
a scratch folder, removed after). The plan then takes the most conversations whose predicted total fits the
budget, with --text drawn in the 2-hour recipe's proportion, and is kept in `budget.json` beside the run, so that
a rerun after an interruption continues the same plan instead of measuring again. The machine's speed drifts, so
training is fitted on the way: when it starts, its passes are fitted to the time left (`fitted_passes`): the
stages before may have run slower than the probe; and as it runs, its end is fitted to the clock at each
checkpoint (`Pace`). Time saved by stages that ran early is not spent: the run ends early (more text bought
with it trained no better draft, docs/results/recipe.md)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import time
from collections.abc import Callable
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
PACE_WINDOW_S = 300.0  # training's speed is taken over the last five minutes: steps vary, and the machine drifts

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

    invented_s: float  # the target inventing one conversation (batched, as the quickstart runs it)
    invented_tokens: float  # training tokens in one of them
    answer_batch_s: float  # a batch of the target's answers to --prompts costs this, and
    answer_prompt_token_s: float  # this for each prompt token of its rows, each padded to the batch's longest
    answer_reply_tokens: float  # training tokens in an answer beyond its prompt's
    decode_tokens_per_s: float  # plain greedy decoding at batch 1 (the closing measurement)
    dump_tokens_per_s: float  # the target's features, written to disk
    train_tokens_per_s: float  # training from the dump (tokens in the loss windows, padding excluded)


@dataclasses.dataclass(frozen=True)
class Prompts:
    """The --prompts a run may answer, as `plan_conversations` draws them and a regeneration runs them: `lengths`
    (chat-prompt tokens) in the order they are drawn, answered in `share` of the conversations, sorted by length
    into batches of `batch_size`, each padded to its longest; a prompt longer than `longest` is dropped unanswered."""

    lengths: list[int]
    share: float
    batch_size: int
    longest: int

    def asked(self, conversations: int) -> int:
        return min(round(self.share * conversations), len(self.lengths))

    def batches(self, asked: int) -> list[list[int]]:
        """The lengths of the prompts answered in each batch of a regeneration of the first `asked`, ascending."""
        ordered = sorted(self.lengths[:asked])
        batches = [ordered[i : i + self.batch_size] for i in range(0, len(ordered), self.batch_size)]
        return [fitting for batch in batches if (fitting := [n for n in batch if n <= self.longest])]


NO_PROMPTS = Prompts(lengths=[], share=0.0, batch_size=1, longest=0)


def answers_s(rates: Rates, rows: int, padded: int) -> float:
    """Seconds of one regeneration batch of `rows` prompts, each padded to `padded` tokens."""
    return rates.answer_batch_s + rates.answer_prompt_token_s * rows * padded


def by_the_target(rates: Rates, prompts: Prompts, conversations: int) -> tuple[float, float]:
    """Seconds and training tokens of `conversations` by the target: answers to `prompts`, each batch charged by
    its padded length (a batch of long prompts costs several of typical ones), and invented ones for the rest."""
    asked = prompts.asked(conversations)
    seconds = (conversations - asked) * rates.invented_s
    tokens = (conversations - asked) * rates.invented_tokens
    for batch in prompts.batches(asked):
        seconds += answers_s(rates, len(batch), batch[-1])
        tokens += sum(batch) + len(batch) * rates.answer_reply_tokens
    return seconds, tokens


@dataclasses.dataclass(frozen=True)
class Plan:
    budget_s: float
    request: dict  # the quickstart's other options: a rerun with others gets another plan, in another --out
    rates: Rates
    conversations: int  # the target writes these
    text_conversations: int  # of --text, drawn at random
    tokens: int
    predicted_s: dict[str, float]  # per stage, the probe and loading included ("so far")
    training_passes: float | None = None  # set when training starts (`fitted_passes`), kept for a rerun

    def seconds_left(self, spent_s: float) -> float:
        """What is left for features and training once `spent_s` have gone, so that the run ends within MARGIN of
        the budget after the closing measurement."""
        return MARGIN * self.budget_s - spent_s - self.predicted_s["closing measurement"]

    def predicted_through(self, stage: str) -> float:
        """Seconds predicted from the start to the end of `stage`."""
        names = list(self.predicted_s)
        return sum(self.predicted_s[name] for name in names[: names.index(stage) + 1])

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
    rates: Rates,
    prompts: Prompts,
    conversations: int,
    text_tokens: int,
    epochs: float,
    closing_tokens: int,
    so_far: float,
) -> dict[str, float]:
    seconds, tokens = by_the_target(rates, prompts, conversations)
    tokens += text_tokens
    return {
        "so far": so_far,
        "the target's conversations": seconds,
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
    prompts: Prompts = NO_PROMPTS,
) -> Plan:
    """The most conversations (and text in the recipe's proportion, all of it at most) whose predicted total
    fits MARGIN of the budget and whose tokens `max_tokens` (the dump's room on disk). `text_lengths`: the tokens
    of each --text conversation in the order they are drawn; `request["generate"]` False: text only
    (--conversations 0); `prompts`: those the target answers in its share of the conversations. A budget too
    small for one conversation is refused."""
    cumulative = [0]
    for length in text_lengths:
        cumulative.append(cumulative[-1] + length)
    epochs, generate = request["epochs"], request["generate"]

    def sizes(n: int) -> tuple[int, int]:  # n counts conversations by the target, or of text when only text
        if not generate:
            return 0, min(n, len(text_lengths))
        return n, min(round(n * TEXT_PER_CONVERSATION), len(text_lengths))

    def predicted(n: int) -> dict[str, float]:
        conversations, texts = sizes(n)
        return predicted_seconds(rates, prompts, conversations, cumulative[texts], epochs, closing_tokens, so_far)

    def tokens(n: int) -> int:
        conversations, texts = sizes(n)
        return round(by_the_target(rates, prompts, conversations)[1]) + cumulative[texts]

    def total(n: int) -> float:
        return sum(predicted(n).values()) if tokens(n) <= max_tokens else math.inf

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
    return Plan(budget_s, request, rates, *sizes(low), tokens(low), predicted(low))


def fitted_passes(plan: Plan, spent_s: float, tokens: int) -> float:
    """The passes over `tokens` (the dump's) that training can make once `spent_s` have gone, so that the run still
    ends within MARGIN of the budget after the closing measurement: the plan's passes, fewer when the stages before
    ran slower than predicted (the machine's speed drifts by 10-20% over an hour here), and never less than one."""
    left = plan.seconds_left(spent_s)
    return round(min(plan.request["epochs"], max(1.0, left * plan.rates.train_tokens_per_s / tokens)), 2)


@dataclasses.dataclass
class Pace:
    """Training's end fitted to the budget's clock as it runs (`train`'s `pace`): at each checkpoint, the steps that
    fit before `deadline` at the speed since the newest call at least PACE_WINDOW_S old (the first call while none
    is), at least one pass unless `max_passes` is less, and at most `max_passes`. The probe's few steps do not say
    how fast an hour of training goes here, and the speed drifts within the hour."""

    deadline: float  # `clock` time by which training ends
    max_passes: float
    clock: Callable[[], float] = time.perf_counter
    seen: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # (step, clock) at each call
    ends: list[int] = dataclasses.field(default_factory=list)  # each fitted end
    steps_per_epoch: int = 0

    def __call__(self, step: int, steps_per_epoch: int) -> int | None:
        now = self.clock()
        self.seen.append((step, now))
        self.steps_per_epoch = steps_per_epoch
        earlier = [(s, t) for s, t in self.seen[:-1] if now - t >= PACE_WINDOW_S]
        since_step, since = earlier[-1] if earlier else self.seen[0]
        if since_step == step:  # the first call: no speed measured yet
            return None
        seconds_a_step = (now - since) / (step - since_step)
        fits = step + math.floor((self.deadline - now) / seconds_a_step)
        end = max(step, min(math.ceil(self.max_passes * steps_per_epoch), max(fits, steps_per_epoch)))
        self.ends.append(end)
        return end

    def summary(self) -> str:
        if not self.ends:
            return ""
        return (
            f"training's end fitted to the clock at {len(self.ends)} checkpoints, from step {self.ends[0]} to "
            f"{self.ends[-1]} ({self.ends[-1] / self.steps_per_epoch:.2f} passes)"
        )


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


def probe_batches(prompts: Prompts) -> tuple[list[int], list[int]]:
    """The indices of two batches of `prompts` whose times give a regeneration's cost line: one of typical length
    and the longest (the same batch when all fit in one). A regeneration batches the prompts sorted by length, each
    padded to its longest, so a batch drawn at random (padded to its one long prompt) is neither. The typical batch
    is the run of neighbours in that order whose mean length is nearest the mean of those short enough to answer;
    none when no prompt is."""
    lengths, size = prompts.lengths, prompts.batch_size
    fitting = sorted((i for i, n in enumerate(lengths) if n <= prompts.longest), key=lambda i: lengths[i])
    if len(fitting) <= size:
        return fitting, fitting
    mean = sum(lengths[i] for i in fitting) / len(fitting)

    def distance(start: int) -> float:
        return abs(sum(lengths[i] for i in fitting[start : start + size]) / size - mean)

    start = min(range(len(fitting) - size + 1), key=distance)
    return fitting[start : start + size], fitting[-size:]


def measure_rates(
    target: TargetModel,
    config: TrainConfig,
    probe_dir: Path,
    synth: dict,
    prompts: list[Conversation],
    asked: Prompts,
    text: list[Conversation],
    text_lengths: list[int],
) -> Rates:
    """Time each stage on `target` in `probe_dir` (removed after): the target's answers to the two `probe_batches`
    of `prompts` (all the run may draw, `asked` their lengths and share) when the run answers any, one batch of
    `synth` settings of invented conversations when it invents any, plain decoding at batch 1, then about
    PROBE_TOKENS of those conversations and of `text` (`text_lengths` tokens each) dumped and trained on for
    PROBE_STEPS steps with `config`'s recipe."""
    from wingspan.data.conversations import read_conversations, write_conversations_jsonl
    from wingspan.data.synth import regenerate, synthesize
    from wingspan.data.template import chat_prompt, tokenize_conversations
    from wingspan.pipeline import run_dump, run_training
    from wingspan.train.trainer import read_metrics, training_rate

    def tokens_in(conversations: list[Conversation]) -> int:
        tokenized, _ = tokenize_conversations(
            target.tokenizer, conversations, config.max_length, config.learn_reasoning, config.learn_prompts
        )
        return sum(len(r.input_ids) for r in tokenized)

    shutil.rmtree(probe_dir, ignore_errors=True)
    probe_dir.mkdir(parents=True)
    try:
        data, written, generated_tokens = [], [], 0
        answer_batch_s = answer_prompt_token_s = answer_reply_tokens = invented_s = invented_tokens = 0.0
        typical, longest = probe_batches(asked) if asked.share else ([], [])
        if typical:
            batch_times = []  # (padded prompt tokens, seconds) of each batch
            reply_tokens = answers = 0
            batches = {"typical": typical} | ({"longest": longest} if longest != typical else {})
            for name, batch in batches.items():
                path = probe_dir / f"replies-{name}.jsonl"
                started = time.perf_counter()
                regenerate(
                    target,
                    [prompts[i] for i in batch],
                    path,
                    max_new_tokens=synth["max_new_tokens"],
                    batch_size=asked.batch_size,
                    max_length=config.max_length,
                    seed=config.seed,
                )
                batch_times.append((len(batch) * max(asked.lengths[i] for i in batch), time.perf_counter() - started))
                replies, _ = read_conversations(path, require_assistant=True)
                tokens = tokens_in(replies)
                reply_tokens += tokens - sum(asked.lengths[i] for i in batch)
                answers += len(replies)
                if name == "typical":  # the long batch only times: its many tokens would lengthen the dump's probe
                    data.append(str(path))
                    written += replies
                    generated_tokens += tokens
            (short_tokens, short_s), (long_tokens, long_s) = batch_times[0], batch_times[-1]
            if long_tokens > short_tokens:
                answer_prompt_token_s = max(0.0, (long_s - short_s) / (long_tokens - short_tokens))
            answer_batch_s = max(0.0, short_s - answer_prompt_token_s * short_tokens)
            answer_reply_tokens = reply_tokens / answers
        if asked.share < 1:
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
            tokens = tokens_in(invented)
            invented_s = elapsed / synthesized_per_batch(invented, config.seed, path)
            invented_tokens = tokens / len(invented)
            data.append(str(path))
            written += invented
            generated_tokens += tokens
        if not written:
            raise ConfigError(
                f"--prompts: no prompt is short enough to answer (at most {asked.longest} tokens, for max_length "
                f"{config.max_length} with a {synth['max_new_tokens']}-token reply)"
            )

        first_user = next(m.content for m in written[0].messages if m.role == "user")
        started = time.perf_counter()
        question = chat_prompt(target.tokenizer, [{"role": "user", "content": first_user}])
        decoded = target.generate([question], PROBE_DECODE_TOKENS)
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
        train_rate = training_rate(read_metrics(probe_dir / "run")[PROBE_WARMUP_STEPS:])
    finally:
        shutil.rmtree(probe_dir, ignore_errors=True)
    return Rates(
        invented_s=invented_s,
        invented_tokens=invented_tokens,
        answer_batch_s=answer_batch_s,
        answer_prompt_token_s=answer_prompt_token_s,
        answer_reply_tokens=answer_reply_tokens,
        decode_tokens_per_s=decode_rate,
        dump_tokens_per_s=dump_rate,
        train_tokens_per_s=train_rate,
    )
