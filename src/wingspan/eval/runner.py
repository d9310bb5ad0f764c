"""Speculative decoding against the plain greedy baseline, prompt by prompt (or batch by batch), on the same
target.

Each prompt is decoded both ways in one process, one right after the other, and which goes first alternates
from prompt to prompt, so that slow drifts (clock speed, other load, cache state) weigh on both alike. A
prompt's turns are asked in order; each decoder answers the next turn after its *own* previous reply (the
conversation is re-rendered with the chat template from the decoded text, as a chat client would send it).
With `batch_size` N > 1, N prompts at a time go through both batched decoders (`wingspan.decode.batched`,
chains), turn t of each in one call: the speedup is then the throughput ratio at batch N, and each prompt
carries 1/N of every call's time.

Metrics (docs/evaluation.md has the full story):
- acceptance length tau: tokens per verification round, sum(accepted + 1) / rounds: the accepted drafts plus
  the target's own ("bonus") token. The prefill forward verifies nothing and its token is not counted, so tau
  is vLLM's `1 + accepted / drafts` for a draft model. For prompt lookup a round without a match counts (it
  is a target forward that yields one token); vLLM counts only the steps that drafted. Over a set: all
  tokens / all rounds, not a mean of per-prompt ratios;
- acceptance per draft position j: of the rounds that proposed at least j + 1 drafts, the share that
  accepted more than j of them;
- tokens/s of each decoder over the whole set (wall clock around each decoding call, prefill included), and
  the speedup = speculative tokens/s / greedy tokens/s;
- outputs differing from greedy: 0 in float32 by construction; in bf16 exact ties of the top two logits can
  break differently between a 1-token and a (k+1)-token forward.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from wingspan.config import DraftConfig, load, require_range
from wingspan.data.template import chat_prompt
from wingspan.decode.batched import plain_generate_batch, speculative_generate_batch
from wingspan.decode.lookup import lookup_generate, lookup_outcomes, lookup_replay
from wingspan.decode.primitives import SpecResult, TreeShape
from wingspan.decode.speculative import plain_generate, speculative_generate
from wingspan.errors import ConfigError
from wingspan.eval.metrics import acceptance_length, acceptance_per_position
from wingspan.eval.prompts import EvalPrompt
from wingspan.export import detect_format, export_config, no_export, read_export
from wingspan.models.draft import Eagle3Draft
from wingspan.models.target import TargetModel

WARMUP_TOKENS = 16  # enough to allocate caches and pick kernels for every shape a round uses

# (prompt ids of a batch, max_new_tokens, generator) -> one result per prompt: a decoder, everything else fixed.
Decoder = Callable[[list[list[int]], int, torch.Generator | None], list[SpecResult]]


@dataclass
class EvalSettings:
    """How `wingspan eval` decodes; saved in results.json."""

    num_draft_tokens: int = 3  # chain length (ignored with a tree: its depth is the drafts per round)
    tree_depth: int | None = None  # EAGLE-2 tree: all three set, or none for a chain
    tree_top_k: int | None = None
    tree_total_tokens: int | None = None
    max_new_tokens: int = 256  # per turn
    temperature: float = 0.0  # 0: greedy; above, both decoders sample (outputs are then not compared)
    seed: int = 0  # with the prompt id, seeds each prompt's sampling
    limit: int | None = None  # the first N prompts of each set
    exclude: list[str] = field(default_factory=list)  # sets or files whose prompts are left out (held-out sets)
    first_turns: bool = False  # ask only each prompt's first turn (as vLLM's referee and most published figures do)
    warmup_prompts: int = 1  # untimed runs of both decoders before measuring (batches of batch_size prompts)
    batch_size: int = 1  # prompts decoded together, by both decoders (chains only above 1)
    # n-gram lengths of prompt lookup: the drafts of `--ngram`, and the split of a draft's rounds by where
    # lookup would have proposed (vLLM's prompt_lookup_min / prompt_lookup_max)
    ngram_min: int = 2
    ngram_max: int = 4

    def __post_init__(self) -> None:
        tree = (self.tree_depth, self.tree_top_k, self.tree_total_tokens)
        if any(v is None for v in tree) and any(v is not None for v in tree):
            raise ConfigError(f"tree: give depth, top_k and total_tokens together, got {tree}")
        if self.tree_depth is not None:
            try:
                TreeShape(self.tree_depth, self.tree_top_k, self.tree_total_tokens)
            except ValueError as error:
                raise ConfigError(str(error)) from None
        if self.batch_size > 1 and self.tree_depth is not None:
            raise ConfigError("batch_size: trees are decoded one prompt at a time; batches need a chain")
        for name in ("num_draft_tokens", "max_new_tokens", "batch_size", "limit"):
            require_range(name, getattr(self, name), at_least=1)
        require_range("temperature", self.temperature, at_least=0)
        require_range("warmup_prompts", self.warmup_prompts, at_least=0)
        require_range("seed", self.seed, at_least=0)
        require_range("ngram_min", self.ngram_min, at_least=1)
        require_range("ngram_max", self.ngram_max, at_least=self.ngram_min)

    @property
    def tree(self) -> TreeShape | None:
        if self.tree_depth is None:
            return None
        return TreeShape(self.tree_depth, self.tree_top_k, self.tree_total_tokens)


@dataclass
class Turn:
    """One turn of one decoder's conversation."""

    prompt_ids: list[int]
    result: SpecResult
    seconds: float  # this turn's share of the wall clock around the decoding call
    reply: str  # the decoded tokens, which the next turn's prompt carries
    share: float = 1.0  # of the call's time (a batch of n: 1 / n each); the result's own times are the call's


@dataclass
class PromptResult:
    """A prompt (all its turns) decoded both ways. Rounds are the speculative decoder's verification forwards."""

    id: str
    category: str | None
    prompt_tokens: list[int]  # per turn (the speculative conversation's)
    new_tokens: int  # speculative, all turns
    greedy_new_tokens: int
    rounds: int
    acceptance_length: float | None  # None: no round at all (every turn ended on its first token)
    accepted_per_round: list[int]
    drafted_per_round: list[int]  # drafts proposed (chain length or tree depth; fewer near max_new_tokens)
    spec_s: float
    greedy_s: float
    spec_draft_s: float  # of spec_s, in draft forwards
    identical: bool | None  # same tokens as greedy in every turn; None when sampling (nothing to compare)
    # per round: the drafts prompt lookup would have proposed there that the output accepts, None where it finds
    # no match; None as a whole when sampling or when the drafts are lookup's own (`lookup_outcomes`)
    lookup_accepted_per_round: list[int | None] | None
    # greedy lookup decoding of the same outputs (`lookup_replay`), chains as long as the draft's; None as above
    lookup_replay_accepted_per_round: list[int] | None
    lookup_replay_drafted_per_round: list[int] | None
    replies: list[str]
    greedy_replies: list[str] | None  # kept only where the outputs differ


@dataclass
class LookupSplit:
    """A draft's rounds (those that drafted), split by whether prompt lookup would have proposed drafts there:
    how the draft does where the context holds a repetition, and how lookup itself would have done there."""

    rounds: int
    rounds_with_match: int
    tau_with_match: float | None  # the draft's, over the rounds where lookup has a match
    tau_without_match: float | None
    lookup_tau_with_match: float | None  # lookup's own, over the same rounds, as many drafts per round
    lookup_ahead: float | None  # of the rounds with a match: the share where lookup's drafts accept more
    draft_ahead: float | None  # ... where the draft's accept more
    acceptance_with_match: list[float]  # the draft's acceptance per position, rounds with a match
    acceptance_without_match: list[float]
    # greedy lookup decoding of the same outputs, every round (a round without a match is a plain step)
    lookup_tau: float | None
    lookup_acceptance: list[float]
    lookup_tau_where_proposed: float | None  # ... over the rounds that drafted, as vLLM counts its ngram steps


@dataclass
class SetResult:
    name: str
    num_prompts: int
    rounds: int
    acceptance_length: float | None  # all tokens of all rounds / all rounds
    acceptance_length_prompt_mean: float | None  # mean of per-prompt tau (short answers weigh as much as long)
    acceptance_per_position: list[float]
    mean_accepted_per_round: float | None  # accepted drafts per round (= tau - 1)
    new_tokens: int
    greedy_new_tokens: int
    spec_tokens_per_s: float | None
    greedy_tokens_per_s: float | None
    speedup: float | None  # spec tokens/s over greedy tokens/s
    draft_time_share: float | None  # of the speculative wall time, the share in draft forwards
    outputs_differing: int | None  # prompts whose tokens differ from greedy; None when sampling
    lookup: LookupSplit | None  # None when sampling or when the drafts are lookup's own
    prompts: list[PromptResult]


# ------------------------------------------------------------------------------------------------ metrics


def rate(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 else None


def prompt_result(
    prompt: EvalPrompt,
    spec: list[Turn],
    greedy: list[Turn],
    compare: bool,
    ngram_sizes: tuple[int, int] | None = None,
    chain_length: int = 1,
) -> PromptResult:
    """One prompt's row, from the turns of each decoder (`compare`: greedy decoding, outputs must agree;
    `ngram_sizes`: split the rounds by lookup's matches and replay lookup with chains of `chain_length`, the
    draft's drafts per round; None not to)."""
    accepted = [a for turn in spec for a in turn.result.accepted_per_round]
    identical = all(s.result.tokens == g.result.tokens for s, g in zip(spec, greedy)) if compare else None
    outcomes = replayed_accepted = replayed_drafted = None
    if ngram_sizes is not None:
        outcomes = [o for turn in spec for o in lookup_outcomes(turn.prompt_ids, turn.result, *ngram_sizes)]
        replays = [lookup_replay(turn.prompt_ids, turn.result.tokens, chain_length, *ngram_sizes) for turn in spec]
        replayed_accepted = [a for accepted, _ in replays for a in accepted]
        replayed_drafted = [d for _, drafted in replays for d in drafted]
    return PromptResult(
        id=prompt.id,
        category=prompt.category,
        prompt_tokens=[len(turn.prompt_ids) for turn in spec],
        new_tokens=sum(len(turn.result.tokens) for turn in spec),
        greedy_new_tokens=sum(len(turn.result.tokens) for turn in greedy),
        rounds=len(accepted),
        acceptance_length=acceptance_length(len(accepted), sum(accepted)),
        accepted_per_round=accepted,
        drafted_per_round=[d for turn in spec for d in turn.result.drafted_per_round],
        spec_s=sum(turn.seconds for turn in spec),
        greedy_s=sum(turn.seconds for turn in greedy),
        spec_draft_s=sum(turn.result.draft_s * turn.share for turn in spec),
        identical=identical,
        lookup_accepted_per_round=outcomes,
        lookup_replay_accepted_per_round=replayed_accepted,
        lookup_replay_drafted_per_round=replayed_drafted,
        replies=[turn.reply for turn in spec],
        greedy_replies=None if identical in (True, None) else [turn.reply for turn in greedy],
    )


def lookup_split(rows: list[PromptResult]) -> LookupSplit | None:
    if any(row.lookup_accepted_per_round is None for row in rows):
        return None
    rounds = [
        (accepted, drafted, lookup)
        for row in rows
        for accepted, drafted, lookup in zip(
            row.accepted_per_round, row.drafted_per_round, row.lookup_accepted_per_round, strict=True
        )
        if drafted
    ]
    matched = [r for r in rounds if r[2] is not None]
    unmatched = [r for r in rounds if r[2] is None]

    def share(count: int) -> float | None:
        return count / len(matched) if matched else None

    replayed_accepted = [a for row in rows for a in row.lookup_replay_accepted_per_round]
    replayed_drafted = [d for row in rows for d in row.lookup_replay_drafted_per_round]

    return LookupSplit(
        rounds=len(rounds),
        rounds_with_match=len(matched),
        tau_with_match=acceptance_length(len(matched), sum(r[0] for r in matched)),
        tau_without_match=acceptance_length(len(unmatched), sum(r[0] for r in unmatched)),
        lookup_tau_with_match=acceptance_length(len(matched), sum(r[2] for r in matched)),
        lookup_ahead=share(sum(r[2] > r[0] for r in matched)),
        draft_ahead=share(sum(r[0] > r[2] for r in matched)),
        acceptance_with_match=acceptance_per_position([r[0] for r in matched], [r[1] for r in matched]),
        acceptance_without_match=acceptance_per_position([r[0] for r in unmatched], [r[1] for r in unmatched]),
        lookup_tau=acceptance_length(len(replayed_accepted), sum(replayed_accepted)),
        lookup_tau_where_proposed=acceptance_length(
            sum(d > 0 for d in replayed_drafted), sum(a for a, d in zip(replayed_accepted, replayed_drafted) if d)
        ),
        lookup_acceptance=acceptance_per_position(replayed_accepted, replayed_drafted),
    )


def summarize(name: str, rows: list[PromptResult]) -> SetResult:
    accepted = [a for row in rows for a in row.accepted_per_round]
    drafted = [d for row in rows for d in row.drafted_per_round]
    per_prompt = [row.acceptance_length for row in rows if row.acceptance_length is not None]
    spec_s, greedy_s = sum(row.spec_s for row in rows), sum(row.greedy_s for row in rows)
    new_tokens, greedy_new_tokens = sum(row.new_tokens for row in rows), sum(row.greedy_new_tokens for row in rows)
    spec_rate, greedy_rate = rate(new_tokens, spec_s), rate(greedy_new_tokens, greedy_s)
    compared = [row.identical for row in rows if row.identical is not None]
    return SetResult(
        name=name,
        num_prompts=len(rows),
        rounds=len(accepted),
        acceptance_length=acceptance_length(len(accepted), sum(accepted)),
        acceptance_length_prompt_mean=sum(per_prompt) / len(per_prompt) if per_prompt else None,
        acceptance_per_position=acceptance_per_position(accepted, drafted),
        mean_accepted_per_round=sum(accepted) / len(accepted) if accepted else None,
        new_tokens=new_tokens,
        greedy_new_tokens=greedy_new_tokens,
        spec_tokens_per_s=spec_rate,
        greedy_tokens_per_s=greedy_rate,
        speedup=spec_rate / greedy_rate if spec_rate and greedy_rate else None,
        draft_time_share=sum(row.spec_draft_s for row in rows) / spec_s if spec_s > 0 else None,
        outputs_differing=compared.count(False) if compared else None,
        lookup=lookup_split(rows) if rows else None,
        prompts=rows,
    )


# ---------------------------------------------------------------------------------------------- decoding


def run_conversations(
    target: TargetModel,
    decode: Decoder,
    conversations: list[list[str]],
    max_new_tokens: int,
    generator: torch.Generator | None,
) -> list[list[Turn]]:
    """Ask the user turns of each conversation, each after the decoder's own reply to the previous one; turn t
    of every conversation that has one goes in one decoding call, whose wall time they share."""
    messages: list[list[dict[str, str]]] = [[] for _ in conversations]
    done: list[list[Turn]] = [[] for _ in conversations]
    for t in range(max(len(turns) for turns in conversations)):
        asking = [i for i, turns in enumerate(conversations) if t < len(turns)]
        prompts = []
        for i in asking:
            messages[i].append({"role": "user", "content": conversations[i][t]})
            prompts.append(chat_prompt(target.tokenizer, messages[i]))
        start = time.perf_counter()
        results = decode(prompts, max_new_tokens, generator)
        share = 1 / len(asking)
        seconds = (time.perf_counter() - start) * share
        for i, ids, result in zip(asking, prompts, results, strict=True):
            reply = target.tokenizer.decode(result.tokens)
            messages[i].append({"role": "assistant", "content": reply})
            done[i].append(Turn(ids, result, seconds, reply, share))
    return done


def decoders(target: TargetModel, draft: Eagle3Draft | None, settings: EvalSettings) -> tuple[Decoder, Decoder]:
    """(speculative, plain) for the settings: one prompt at a time (chain or tree), or batches of chains; with
    no draft, prompt lookup's chains. At temperature > 0 the plain baseline samples too, so that the speedup
    compares like with like."""
    k, tree, temperature = settings.num_draft_tokens, settings.tree, settings.temperature
    if draft is not None and draft.config.draft_mode == "parallel" and (tree is not None or settings.batch_size > 1):
        raise ConfigError("a parallel draft drafts a chain from one forward, one prompt at a time: no tree, batch 1")
    if draft is not None:
        draft.config.draft_tokens(k)  # warns when a parallel draft is asked for more tokens than it was trained for
    if settings.batch_size == 1:

        def speculative(prompts, max_new_tokens, generator):
            (ids,) = prompts
            if draft is None:
                sizes = (settings.ngram_min, settings.ngram_max)
                return [
                    lookup_generate(
                        target, ids, max_new_tokens, k, *sizes, temperature=temperature, generator=generator
                    )
                ]
            return [
                speculative_generate(
                    target, draft, ids, max_new_tokens, k, tree=tree, temperature=temperature, generator=generator
                )
            ]

        def plain(prompts, max_new_tokens, generator):
            (ids,) = prompts
            return [plain_generate(target, ids, max_new_tokens, temperature=temperature, generator=generator)]

        return speculative, plain

    def speculative_batch(prompts, max_new_tokens, generator):
        return speculative_generate_batch(
            target, draft, prompts, max_new_tokens, k, temperature=temperature, generator=generator
        )

    def plain_batch(prompts, max_new_tokens, generator):
        return plain_generate_batch(target, prompts, max_new_tokens, temperature=temperature, generator=generator)

    return speculative_batch, plain_batch


def require_lookup_settings(settings: EvalSettings) -> None:
    """Prompt lookup decodes chains, one prompt at a time."""
    if settings.batch_size > 1 or settings.tree is not None:
        raise ConfigError("prompt lookup drafts a chain, one prompt at a time: no tree, batch_size 1")


def evaluate(
    target: TargetModel,
    draft: Eagle3Draft | None,
    prompts: list[EvalPrompt],
    settings: EvalSettings,
    name: str = "prompts",
) -> SetResult:
    """Decode every prompt with the draft (None: prompt lookup) and without it, side by side,
    `settings.batch_size` prompts at a time, and measure (see the module docstring)."""
    (result,) = evaluate_side_by_side(target, [(draft, settings)], prompts, [name])
    return result


# A draft (None: prompt lookup) and how it drafts: the chain length or the tree.
Proposer = tuple[Eagle3Draft | None, EvalSettings]


def evaluate_side_by_side(
    target: TargetModel, proposers: list[Proposer], prompts: list[EvalPrompt], names: list[str]
) -> list[SetResult]:
    """`evaluate` for several proposers (drafts, prompt lookup, chain lengths, trees) against one plain
    baseline: each batch is decoded plainly once and once per proposer, the order rotating from batch to batch.
    Their settings may differ only in the chain length and the tree; every result carries the same plain runs."""
    settings = proposers[0][1]

    def shared(s: EvalSettings) -> EvalSettings:
        return replace(s, num_draft_tokens=1, tree_depth=None, tree_top_k=None, tree_total_tokens=None)

    if any(shared(s) != shared(settings) for _, s in proposers):
        raise ConfigError("proposers measured side by side may differ only in chain length and tree")
    sampling = settings.temperature > 0
    for draft, s in proposers:
        if draft is None:
            require_lookup_settings(s)
    pairs = [decoders(target, draft, s) for draft, s in proposers]  # (speculative, plain) each
    # the plain decoder last, so that one proposer alternates with it as (spec, plain), (plain, spec), ...
    everyone = [speculative for speculative, _ in pairs] + [pairs[0][1]]
    size = settings.batch_size
    batches = [prompts[i : i + size] for i in range(0, len(prompts), size)]

    def sampler(batch: list[EvalPrompt]) -> torch.Generator | None:
        """A generator seeded by the batch's first prompt id (a fresh one for each decoder), so that a sample
        does not depend on the prompts before it, nor on which decoder ran first."""
        if not sampling:
            return None
        seed = random.Random(f"eval/{settings.seed}/{batch[0].id}").getrandbits(63)
        return torch.Generator(device=target.device).manual_seed(seed)

    def row(proposer: Proposer, prompt: EvalPrompt, spec: list[Turn], greedy: list[Turn]) -> PromptResult:
        draft, s = proposer
        ngram_sizes = None if sampling or draft is None else (s.ngram_min, s.ngram_max)
        return prompt_result(
            prompt, spec, greedy, not sampling, ngram_sizes, s.tree.depth if s.tree else s.num_draft_tokens
        )

    for batch in batches[: settings.warmup_prompts]:
        for decode in everyone:
            run_conversations(target, decode, [p.turns[:1] for p in batch], WARMUP_TOKENS, sampler(batch))

    rows: list[list[PromptResult]] = [[] for _ in proposers]
    progress = tqdm(total=len(prompts), desc=" / ".join(dict.fromkeys(names)), unit="prompt", dynamic_ncols=True)
    for index, batch in enumerate(batches):
        turns = [p.turns[:1] if settings.first_turns else p.turns for p in batch]
        runs: dict[int, list[list[Turn]]] = {}
        for which in range(index, index + len(everyone)):
            which %= len(everyone)
            runs[which] = run_conversations(target, everyone[which], turns, settings.max_new_tokens, sampler(batch))
        for p, proposer in enumerate(proposers):
            for prompt, spec, greedy in zip(batch, runs[p], runs[len(proposers)]):
                rows[p].append(row(proposer, prompt, spec, greedy))
        so_far = [summarize(name, proposer_rows) for name, proposer_rows in zip(names, rows)]
        progress.update(len(batch))
        progress.set_postfix(
            tau="/".join(f"{r.acceptance_length or 0:.2f}" for r in so_far),
            speedup="/".join(f"{r.speedup or 0:.2f}" for r in so_far),
        )
    progress.close()
    return [summarize(name, proposer_rows) for name, proposer_rows in zip(names, rows)]


# ------------------------------------------------------------------------------------------------ models


def load_models(
    target: str,
    draft: str | Path,
    dtype: str = "bfloat16",
    device: str | torch.device = "auto",
    chat_template: str | None = None,
    chat_template_kwargs: dict | None = None,
) -> tuple[TargetModel, Eagle3Draft]:
    """The target, capturing the aux layers the draft was trained on, and the draft (a wingspan draft directory
    or an export of any format) on the target's device and in its dtype, as a serving engine runs it."""
    directory = Path(draft)
    config = read_draft_config(directory)
    model = TargetModel.load(
        target,
        dtype=dtype,
        aux_layer_ids=config.aux_layer_ids,
        device=device,
        chat_template=chat_template,
        chat_template_kwargs=chat_template_kwargs,
    )
    require_fit(config, directory, model, target)
    return model, load_draft(directory, model)


def another_draft(directory: Path, target: TargetModel, target_name: str, first: Path) -> Eagle3Draft:
    """A draft measured beside `first` on the target `load_models` loaded for that one: it must read the same
    target layers."""
    config = read_draft_config(directory)
    if list(config.aux_layer_ids) != list(target.aux_layer_ids):
        raise ConfigError(
            f"{directory}: trained on the target's layers {list(config.aux_layer_ids)}, {first} on "
            f"{list(target.aux_layer_ids)}; drafts measured side by side must read the same layers"
        )
    require_fit(config, directory, target, target_name)
    return load_draft(directory, target)


def read_draft_config(directory: Path) -> DraftConfig:
    """The config of a wingspan draft directory or of an export of any format (an error naming the directory
    when it is neither)."""
    if detect_format(directory) is not None:
        return export_config(directory)
    if (directory / "draft_config.json").is_file():
        return load(DraftConfig, directory / "draft_config.json")
    no_export(directory)


def require_fit(config: DraftConfig, directory: Path, target: TargetModel, target_name: str) -> None:
    """The draft was trained on a target of this one's hidden size and vocab."""
    if (config.target_hidden_size, config.vocab_size) != (target.hidden_size, target.vocab_size):
        raise ConfigError(
            f"{directory}: the draft was trained on a target with hidden size {config.target_hidden_size} and "
            f"vocab {config.vocab_size}; {target_name} has {target.hidden_size} and {target.vocab_size}"
        )


def load_draft(directory: Path, target: TargetModel) -> Eagle3Draft:
    """A wingspan draft directory or an export, with `target`'s embeddings, on its device and in its dtype."""
    embed = target.embed_weight()
    loaded = (
        read_export(directory, embed)
        if detect_format(directory) is not None
        else Eagle3Draft.load(directory, embed_weight=embed)
    )
    return loaded.to(target.device, target.dtype).eval()
