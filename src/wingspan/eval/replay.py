"""A chain draft's acceptance replayed on the target's greedy outputs, without decoding.

Greedy speculative decoding emits the target's greedy output whatever the draft, and a chain's round from
origin i proposes exactly what the TTT unroll computes at origin i (`wingspan.train.ttt`: step j at i sees
the step-0 keys at positions <= i and its own earlier steps' keys, as the decoder's cropped caches do), fed
with the output's own tokens, which are the drafts as long as they are accepted. So the target's greedy
outputs and its aux features over them, computed once and kept in a references file, give every round of
`speculative_generate` for any draft that reads those aux layers: one draft forward per step over each
sequence, seconds where decoding takes many minutes, and every draft is scored on the same outputs (a
paired comparison).

What it does not give: wall-clock speed, trees (which nodes survive the pruning depends on branches off the
greedy path), sampling, and the very last round of an output that ended on its stop token (a draft past the
stop token counts as rejected; the decoder may have accepted it).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from wingspan.decode.batched import plain_generate_batch
from wingspan.decode.lookup import lookup_drafts
from wingspan.errors import ConfigError
from wingspan.eval.metrics import acceptance_length, acceptance_per_position
from wingspan.eval.prompts import EvalPrompt
from wingspan.eval.runner import run_conversations
from wingspan.files import atomic_file
from wingspan.models.draft import Eagle3Draft
from wingspan.models.target import TargetModel
from wingspan.study.fit import bootstrap_interval, prompts_tau
from wingspan.train.ttt import shift_left, unroll

FORMAT = "wingspan-replay-references/1"


@dataclass
class Reference:
    """One turn: the prompt the target was asked and its greedy reply, with the target's aux features."""

    set_name: str
    prompt_id: str
    turn: int
    prompt_length: int
    reply_length: int  # new tokens, the stop token included when the reply ended on one
    stopped: bool
    tokens: torch.Tensor  # [prompt_length + reply_length] int64
    aux: torch.Tensor  # [prompt_length + reply_length, num_aux * H] the target's aux features over `tokens`


@dataclass
class References:
    target: str
    dtype: str
    aux_layer_ids: list[int]
    max_new_tokens: int
    first_turns: bool
    items: list[Reference]

    def save(self, path: str | Path) -> None:
        tensors, rows = {}, []
        for index, item in enumerate(self.items):
            tensors[f"tokens.{index}"] = item.tokens.contiguous()
            tensors[f"aux.{index}"] = item.aux.contiguous()
            row = asdict(item)
            del row["tokens"], row["aux"]
            rows.append(row)
        header = {
            "format": FORMAT,
            "target": self.target,
            "dtype": self.dtype,
            "aux_layer_ids": self.aux_layer_ids,
            "max_new_tokens": self.max_new_tokens,
            "first_turns": self.first_turns,
            "items": rows,
        }
        with atomic_file(path) as temporary:
            save_file(tensors, str(temporary), metadata={"references": json.dumps(header)})

    @classmethod
    def load(cls, path: str | Path) -> References:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: no such references file (make one with `wingspan replay references`)")
        try:
            with safe_open(str(path), framework="pt") as handle:
                header = json.loads((handle.metadata() or {}).get("references", "null"))
                if not isinstance(header, dict) or header.get("format") != FORMAT:
                    raise ConfigError(f"{path}: not a wingspan references file ({FORMAT})")
                items = [
                    Reference(**row, tokens=handle.get_tensor(f"tokens.{i}"), aux=handle.get_tensor(f"aux.{i}"))
                    for i, row in enumerate(header["items"])
                ]
            fields = {k: header[k] for k in ("target", "dtype", "aux_layer_ids", "max_new_tokens", "first_turns")}
        except (OSError, SafetensorError, ValueError, KeyError, TypeError) as error:
            raise ConfigError(f"{path}: not a readable references file ({type(error).__name__}: {error})") from None
        if not items:
            raise ConfigError(f"{path}: the references hold no reply")
        return cls(**fields, items=items)

    def set_names(self) -> list[str]:
        return list(dict.fromkeys(item.set_name for item in self.items))


def build_references(
    target: TargetModel,
    target_name: str,
    dtype: str,
    prompt_sets: dict[str, list[EvalPrompt]],
    max_new_tokens: int,
    first_turns: bool,
    batch_size: int = 8,
) -> References:
    """Greedy replies to every prompt (`batch_size` prompts per batched decoding call; each turn after the
    target's own previous reply), then one target forward over each turn for its aux features. A reply that
    ended on a stop token gets that token back: of the target's stop ids, the one it ranks first after the
    reply (the same forward's logits)."""

    def plain(prompts, new_tokens, generator):
        return plain_generate_batch(target, prompts, new_tokens)

    items = []
    total = sum(len(prompts) for prompts in prompt_sets.values())
    progress = tqdm(total=total, desc="references", unit="prompt", dynamic_ncols=True)
    for name, prompts in prompt_sets.items():
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            conversations = [p.turns[:1] if first_turns else p.turns for p in batch]
            for prompt, turns in zip(batch, run_conversations(target, plain, conversations, max_new_tokens, None)):
                for number, turn in enumerate(turns):
                    ids = torch.tensor([turn.prompt_ids + turn.result.tokens])
                    out = target.forward(ids)
                    tokens = ids[0]
                    if turn.result.stopped:  # the stop id the target ranks first after the reply
                        stops = target.eos_token_ids
                        stop = stops[int(out.logits[0, -1, stops].argmax())]
                        tokens = torch.cat([tokens, tokens.new_tensor([stop])])
                    items.append(
                        Reference(
                            set_name=name,
                            prompt_id=prompt.id,
                            turn=number,
                            prompt_length=len(turn.prompt_ids),
                            reply_length=len(turn.result.tokens) + int(turn.result.stopped),
                            stopped=turn.result.stopped,
                            tokens=tokens.cpu(),
                            aux=out.aux_hidden[0].cpu(),
                        )
                    )
            progress.update(len(batch))
    progress.close()
    return References(target_name, dtype, list(target.aux_layer_ids), max_new_tokens, first_turns, items)


@torch.no_grad()
def draft_hits(draft: Eagle3Draft, tokens: torch.Tensor, aux: torch.Tensor, steps: int) -> torch.Tensor:
    """[steps, T] bool over the T positions `aux` covers: step j of the round from origin i proposes
    tokens[i + j + 2] (a chain fed tokens[i + 1..], a parallel draft's mask slots). `tokens` may hold one more,
    a stop token with no features."""
    device, dtype = draft.fc.weight.device, draft.fc.weight.dtype
    length = aux.shape[0]
    every = tokens[None].to(device)
    positions = torch.arange(length, device=device)[None]
    hits = []
    for j, hidden in enumerate(unroll(draft, aux[None].to(device, dtype), every[:, :length], positions, steps)):
        proposed = draft.draft_to_target(draft.logits(hidden[0]).argmax(dim=-1))
        hits.append(proposed == shift_left(every, j + 2, fill=-1)[0, :length])
    return torch.stack(hits).cpu()


def replay_rounds(
    hits: torch.Tensor, prompt_length: int, reply_length: int, max_new_tokens: int, num_draft_tokens: int
) -> tuple[list[int], list[int]]:
    """(accepted, drafted) per round of `speculative_generate` with a chain of `num_draft_tokens`: the prefill
    gives the first new token; each round drafts from the last verified position (fewer drafts near
    max_new_tokens, as the decoder does), accepts the leading hits and adds the target's own token."""
    accepted_per_round, drafted_per_round = [], []
    produced = 1
    while produced < reply_length:
        depth = min(num_draft_tokens, max_new_tokens - produced - 1)
        origin = prompt_length + produced - 2
        accepted = 0
        while accepted < depth and bool(hits[accepted, origin]):
            accepted += 1
        accepted_per_round.append(accepted)
        drafted_per_round.append(depth)
        produced += accepted + 1
    return accepted_per_round, drafted_per_round


@dataclass
class ReplayedPrompt:
    id: str
    accepted_per_round: list[int]  # over all its turns
    drafted_per_round: list[int]
    # per round: whether prompt lookup would have proposed drafts there (the context ends in an n-gram seen
    # earlier in it, `wingspan.decode.lookup`), to split the draft's rounds as `wingspan eval` does
    lookup_matched: list[bool]
    # per reply position a draft proposes at (every position, not only the rounds' starts, so that every draft
    # is split on the same positions): whether its first token is the target's, and whether lookup's first
    # token is (None: lookup proposes nothing there)
    first_tokens: list[tuple[bool, bool | None]]

    @property
    def rounds(self) -> int:
        return len(self.accepted_per_round)

    @property
    def accepted(self) -> int:
        return sum(self.accepted_per_round)


@dataclass
class ReplayedSet:
    name: str
    num_prompts: int
    rounds: int
    acceptance_length: float | None
    acceptance_per_position: list[float]
    prompts: list[ReplayedPrompt]


def first_token_hits(
    hits: torch.Tensor, tokens: list[int], prompt_length: int, reply_length: int, sizes
) -> list[tuple[bool, bool | None]]:
    """(the draft's first token is right, lookup's first token is right or None) at every reply position after
    the prefill's token: from origin i, both propose tokens[i + 2] from the context tokens[: i + 2]."""
    outcomes = []
    for origin in range(prompt_length - 1, prompt_length + reply_length - 2):
        lookup = lookup_drafts(tokens[: origin + 2], 1, *sizes)
        outcomes.append((bool(hits[0, origin]), lookup[0] == tokens[origin + 2] if lookup else None))
    return outcomes


def lookup_matches(
    first_tokens: list[tuple[bool, bool | None]], accepted_per_round: list[int], drafted_per_round: list[int]
) -> list[bool]:
    """Whether prompt lookup proposes drafts at the start of each round that drafted, read off the reply's
    positions (`first_token_hits`: a round after `produced` tokens starts at position produced - 1)."""
    produced, matched = 1, []
    for accepted, drafted in zip(accepted_per_round, drafted_per_round, strict=True):
        matched.append(bool(drafted) and first_tokens[produced - 1][1] is not None)
        produced += accepted + 1
    return matched


def layer_columns(aux_layer_ids: list[int], references: References, draft: str | Path = "the draft") -> torch.Tensor:
    """The columns of the references' aux features that a draft reading `aux_layer_ids` takes, in its order: the
    references may hold more layers than the draft reads, so that drafts reading different layers are scored on
    the same replies."""
    missing = [layer for layer in aux_layer_ids if layer not in references.aux_layer_ids]
    if missing:
        raise ConfigError(
            f"{draft} reads aux layers {list(aux_layer_ids)}; the references hold {references.aux_layer_ids} "
            "(build references with the draft's layers, or more: --aux-layer-ids)"
        )
    hidden = references.items[0].aux.shape[1] // len(references.aux_layer_ids)
    slots = [references.aux_layer_ids.index(layer) for layer in aux_layer_ids]
    return torch.cat([torch.arange(slot * hidden, (slot + 1) * hidden) for slot in slots])


def replay(
    draft: Eagle3Draft, references: References, num_draft_tokens: int, ngram_sizes: tuple[int, int] = (2, 4)
) -> list[ReplayedSet]:
    """Every reference's rounds for `draft` (a chain, or a parallel draft's one forward a round), gathered per
    prompt (its turns together) and per set, with where prompt lookup of `ngram_sizes` would have proposed."""
    columns = layer_columns(draft.config.aux_layer_ids, references)
    per_prompt: dict[tuple[str, str], ReplayedPrompt] = {}
    for item in references.items:
        hits = draft_hits(draft, item.tokens, item.aux[:, columns], num_draft_tokens)
        accepted, drafted = replay_rounds(
            hits, item.prompt_length, item.reply_length, references.max_new_tokens, num_draft_tokens
        )
        key = (item.set_name, item.prompt_id)
        row = per_prompt.setdefault(key, ReplayedPrompt(item.prompt_id, [], [], [], []))
        first_tokens = first_token_hits(hits, item.tokens.tolist(), item.prompt_length, item.reply_length, ngram_sizes)
        row.lookup_matched += lookup_matches(first_tokens, accepted, drafted)
        row.first_tokens += first_tokens
        row.accepted_per_round += accepted
        row.drafted_per_round += drafted
    sets = []
    for name in references.set_names():
        rows = [row for (set_name, _), row in per_prompt.items() if set_name == name]
        accepted = [a for row in rows for a in row.accepted_per_round]
        drafted = [d for row in rows for d in row.drafted_per_round]
        sets.append(
            ReplayedSet(
                name=name,
                num_prompts=len(rows),
                rounds=len(accepted),
                acceptance_length=acceptance_length(len(accepted), sum(accepted)),
                acceptance_per_position=acceptance_per_position(accepted, drafted),
                prompts=rows,
            )
        )
    return sets


# ------------------------------------------------------------------------------------------------- report


def mean(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def pooled(sets: list[ReplayedSet]) -> list[list[tuple[int, int]]]:
    """(rounds, accepted) per prompt, one stratum per set: what the bootstrap resamples."""
    return [[(row.rounds, row.accepted) for row in result.prompts] for result in sets if result.prompts]


def comparison(drafts: dict[str, list[ReplayedSet]]) -> list[dict]:
    """Per draft: tau per set, pooled tau with its 95% prompt-bootstrap interval and, from the second draft
    on, the paired 95% interval of its difference from the first (the same prompts drawn for both)."""
    rows, baseline, baseline_tau = [], None, None
    for label, sets in drafts.items():
        strata = pooled(sets)
        row = {
            "draft": label,
            "sets": {result.name: result.acceptance_length for result in sets},
            "tau": prompts_tau([p for stratum in strata for p in stratum]),
            "tau_interval": None,
            "difference": None,
            "difference_interval": None,
            # (prompt id, rounds, accepted drafts) per prompt: what a paired comparison of runs resamples
            "prompts": {result.name: [[p.id, p.rounds, p.accepted] for p in result.prompts] for result in sets},
        }
        accepted = [a for result in sets for p in result.prompts for a in p.accepted_per_round]
        drafted = [d for result in sets for p in result.prompts for d in p.drafted_per_round]
        row["acceptance_per_position"] = acceptance_per_position(accepted, drafted)
        rounds = [
            (a, m) for result in sets for p in result.prompts for a, m in zip(p.accepted_per_round, p.lookup_matched)
        ]
        matched = [a for a, m in rounds if m]
        row["rounds_with_match"] = len(matched) / len(rounds) if rounds else None
        row["tau_with_match"] = acceptance_length(len(matched), sum(matched))
        unmatched = [a for a, m in rounds if not m]
        row["tau_without_match"] = acceptance_length(len(unmatched), sum(unmatched))
        firsts = [f for result in sets for p in result.prompts for f in p.first_tokens]
        with_match = [(draft, lookup) for draft, lookup in firsts if lookup is not None]
        without = [draft for draft, lookup in firsts if lookup is None]
        row["positions_with_match"] = len(with_match) / len(firsts) if firsts else None
        row["first_with_match"] = mean([draft for draft, _ in with_match])
        row["lookup_first_with_match"] = mean([lookup for _, lookup in with_match])
        row["first_without_match"] = mean(without)
        if row["tau"] is not None:
            row["tau_interval"] = bootstrap_interval(strata, prompts_tau)
        if baseline is None:
            baseline, baseline_tau = strata, row["tau"]
        elif row["tau"] is not None and baseline_tau is not None:
            # item k of stratum s: prompt k of set s, for this draft and the first alike
            pairs = [list(zip(a, b, strict=True)) for a, b in zip(strata, baseline, strict=True)]
            row["difference"] = row["tau"] - baseline_tau
            row["difference_interval"] = bootstrap_interval(
                pairs, lambda items: prompts_tau([a for a, _ in items]) - prompts_tau([b for _, b in items])
            )
        rows.append(row)
    return rows


def markdown(rows: list[dict], references: References, path: str, num_draft_tokens: int) -> str:
    names = list(rows[0]["sets"]) if rows else []

    def number(value: float | None, digits: int = 3) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    def share(value: float | None) -> str:
        return "-" if value is None else f"{value:.0%}"

    def interval(value: tuple[float, float] | None) -> str:
        return "" if value is None else f" [{value[0]:.3f}, {value[1]:.3f}]"

    turns = "first turns" if references.first_turns else "all turns"
    lines = [
        f"Chain of {num_draft_tokens}, replayed on {path}: {references.target} ({references.dtype}), greedy, "
        f"up to {references.max_new_tokens} new tokens, {turns}, aux layers {references.aux_layer_ids}.",
        "",
        "| draft | " + " | ".join(names) + " | pooled tau [95%] | vs the first [paired 95%] | acceptance per position"
        " | tau where lookup matches / elsewhere | first token where lookup matches (lookup's own) / elsewhere |",
        "|---|" + "---:|" * len(names) + "---:|---:|---|---:|---:|",
    ]
    for row in rows:
        difference = (
            "" if row["difference"] is None else f"{row['difference']:+.3f}" + interval(row["difference_interval"])
        )
        lines.append(
            f"| {row['draft']} | "
            + " | ".join(number(row["sets"][name]) for name in names)
            + f" | {number(row['tau'])}{interval(row['tau_interval'])} | {difference} | "
            + " / ".join(f"{rate:.2f}" for rate in row["acceptance_per_position"])
            + f" | {number(row['tau_with_match'])} ({share(row['rounds_with_match'])} of rounds)"
            + f" / {number(row['tau_without_match'])}"
            + f" | {number(row['first_with_match'], 2)} ({number(row['lookup_first_with_match'], 2)};"
            + f" {share(row['positions_with_match'])} of positions) / {number(row['first_without_match'], 2)} |"
        )
    return "\n".join(lines) + "\n"
