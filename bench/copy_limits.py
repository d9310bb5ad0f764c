"""What a copy head could reach on the target's own replies: the figures behind the copy head's design
(docs/results/recipe.md: "Why the copy head still missed", "What a copy head could reach" and "Where the 12
points go").

Reads a `wingspan replay references` file (the target's greedy replies with its aux features) and the target's
embeddings; no draft is involved. At every reply position where prompt lookup (vLLM's rule, n = 2..4) proposes,
it prints how often the next token is the one after an earlier occurrence of the context's end, by rule:
- lookup itself, and the last token alone (the most recent occurrence, and a vote over all occurrences);
- an ideal planted head: softmax attention over codes of exact embeddings (a random `--rank`-dim code of each
  token, as the copy head's), matching the last token alone or the last two (the two codes added), whose
  attention weights vote for the tokens that followed.
With `--draft DIR` (repeatable) it sets each draft's first token (step 0 of its unroll) beside the vote at the
same positions: how often both, either or neither is right, and where only the vote is, whether the draft's
vocab holds the token and how the draft ranks it; a draft that followed its copy head there would be right.
For each draft's vocab, and each `--vocab FILE` (a `wingspan vocab` output), it prints the share of the reply
tokens, per set, that the vocab does not hold: tokens no draft with that vocab can propose.
It then prints how well a ridge probe of each aux layer names a position's current and previous token (through
the whole hidden state and through a `--rank`-dim code), fitted on the first three quarters of the replies.

    python bench/copy_limits.py --references runs/refs-20-l4.safetensors [--draft runs/qs/run/draft] \
        [--vocab runs/abl/vocab-16384.safetensors]
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch

from wingspan.data.vocab import DraftVocab
from wingspan.decode.lookup import lookup_drafts
from wingspan.eval.replay import References, layer_columns
from wingspan.eval.runner import load_draft
from wingspan.models.draft import Eagle3Draft
from wingspan.models.target import TargetModel
from wingspan.train.copy_head import fit_probe
from wingspan.train.ttt import unroll

NGRAM_SIZES = (2, 4)
SHARPNESS = 20.0  # the ideal head's score scale over a code's squared norm: a match outweighs all else
# (the draft's first token right, the vote right) -> the row it counts in
OUTCOMES = {
    (True, True): "both right",
    (True, False): "the draft only",
    (False, True): "the vote only",
    (False, False): "neither",
}
OUT_OF_VOCAB = "the vote only: not in the draft's vocab"
RANKED_2_TO_5 = "the vote only: the draft ranks it 2nd-5th"


def normed_embeddings(target: TargetModel) -> torch.Tensor:
    embed = target.embed_weight().float()
    return embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True) + 1e-6)


def random_code(rows: int, columns: int, seed: int) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(columns, rows, generator=torch.Generator().manual_seed(seed)))[0].T


@torch.no_grad()
def first_token_scores(draft: Eagle3Draft, tokens: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """[T, V] the draft's step-0 logits over the target's vocab (-inf outside its own) at the T positions `aux`
    covers: origin i proposes tokens[i + 2]."""
    length = aux.shape[0]
    hidden = next(
        unroll(draft, aux[None].to(draft.fc.weight.dtype), tokens[None, :length], torch.arange(length)[None], 1)
    )
    logits = draft.logits(hidden[0]).float()
    scores = torch.full((length, draft.config.vocab_size), float("-inf"))
    scores[:, draft.draft_to_target(torch.arange(draft.config.draft_vocab_size))] = logits
    return scores


def rule_hits(
    tokens: list[int],
    prompt_length: int,
    codes: dict[str, torch.Tensor],
    drafts: dict[str, torch.Tensor] | None = None,
) -> Counter:
    """For each reply position whose context lookup matches: which rules name the next token; for each draft
    (its `first_token_scores`), its first token against the vote's."""
    hits: Counter = Counter()
    for end in range(prompt_length, len(tokens) - 1):  # the context is tokens[: end + 1], the truth tokens[end + 1]
        context, truth = tokens[: end + 1], tokens[end + 1]
        lookup = lookup_drafts(context, 1, *NGRAM_SIZES)
        if not lookup:
            continue
        hits["positions"] += 1
        hits["lookup (n = 2..4, vLLM's rule)"] += lookup[0] == truth
        followers = [context[m + 1] for m in range(end) if context[m] == context[end]]
        vote = Counter(followers).most_common(1)[0][0] if followers else None
        if followers:
            hits["last token, most recent occurrence"] += followers[-1] == truth
            hits["last token, vote over occurrences"] += vote == truth
        for name, draft_scores in (drafts or {}).items():
            here = draft_scores[end - 1]
            drafted, voted = int(here.argmax()) == truth, vote == truth
            hits[(name, OUTCOMES[drafted, voted])] += 1
            if voted and not drafted:
                hits[(name, OUT_OF_VOCAB)] += bool(here[truth] == float("-inf"))
                hits[(name, RANKED_2_TO_5)] += int((here > here[truth]).sum()) < 5
        for name, code in codes.items():
            scores = code[:end] @ code[end] * (SHARPNESS / float(code[end].pow(2).sum()))
            votes = torch.zeros(int(max(tokens)) + 1).index_add_(0, torch.tensor(context[1:]), scores.softmax(0))
            hits[name] += int(votes.argmax()) == truth
    return hits


def probe_accuracies(features: torch.Tensor, tokens: torch.Tensor, embeddings: torch.Tensor, rank: int) -> list[float]:
    """How often a ridge probe of `features` [N, H] names `tokens` [N] among the tokens seen, fitted on the first
    three quarters: through the whole hidden state, then through a `rank`-dim code."""
    fitted = int(0.75 * len(tokens))
    probe = fit_probe(features[:fitted], embeddings[tokens[:fitted]])
    read = features[fitted:] @ probe
    seen = tokens.unique()
    accuracies = []
    for code in (torch.eye(embeddings.shape[1]), random_code(rank, embeddings.shape[1], seed=3)):
        named = torch.nn.functional.normalize(embeddings[seen] @ code.T, dim=-1)
        guessed = seen[(torch.nn.functional.normalize(read @ code.T, dim=-1) @ named.T).argmax(-1)]
        accuracies.append(float((guessed == tokens[fitted:]).float().mean()))
    return accuracies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--references", required=True, help="a `wingspan replay references` file")
    parser.add_argument("--rank", type=int, default=20, help="the code's dims (the copy head's: about 20)")
    parser.add_argument("--draft", action="append", default=[], help="a draft to set beside the vote (repeatable)")
    parser.add_argument("--vocab", action="append", default=[], help="a draft vocab file to check (repeatable)")
    args = parser.parse_args()

    references = References.load(args.references)
    target = TargetModel.load(references.target, dtype="float32", device="cpu")
    embeddings = normed_embeddings(target)
    drafts = {name: load_draft(name, target) for name in args.draft}
    columns = {name: layer_columns(draft.config.aux_layer_ids, references, name) for name, draft in drafts.items()}
    one, two = (random_code(args.rank, embeddings.shape[1], seed) for seed in (1, 2))

    hits: Counter = Counter()
    for item in references.items:
        tokens = item.tokens.tolist()
        coded = embeddings[item.tokens]
        last = coded @ one.T
        pair = last.clone()
        pair[1:] += coded[:-1] @ two.T
        codes = {"ideal head, last token": last, "ideal head, last two tokens": pair}
        scores = {
            name: first_token_scores(draft, item.tokens, item.aux[:, columns[name]]) for name, draft in drafts.items()
        }
        hits += rule_hits(tokens, item.prompt_length, codes, scores)
    positions = hits.pop("positions")
    print(f"{len(references.items)} replies, {positions} reply positions where lookup proposes; the next token is")
    for name, count in hits.items():
        if isinstance(name, str):
            print(f"  {name:<40} {count / positions:6.1%}")
    for name in drafts:
        print(f"{name}: its first token against the vote over 1-token matches, at the same positions")
        for outcome in [*OUTCOMES.values(), OUT_OF_VOCAB, RANKED_2_TO_5]:
            print(f"  {outcome:<45} {hits[name, outcome] / positions:6.1%}")

    vocabs = {name: draft.t2d.cpu() for name, draft in drafts.items()}
    vocabs |= {name: DraftVocab.load(name).t2d for name in args.vocab}
    replies = {
        name: torch.cat([item.tokens[item.prompt_length :] for item in references.items if item.set_name == name])
        for name in references.set_names()
    }
    replies["all"] = torch.cat(list(replies.values()))
    if vocabs:
        print("reply tokens outside the draft vocab: " + " / ".join(replies))
    for name, held in vocabs.items():
        outside = [1 - float(held[tokens].float().mean()) for tokens in replies.values()]
        print(f"  {name} ({int(held.sum())} tokens): " + " / ".join(f"{share:.1%}" for share in outside))

    hidden = embeddings.shape[1]
    # positions 1 .. len - 2: each has a previous token, and features (a reply's stop token may have none)
    features = torch.cat([item.aux[1 : len(item.tokens) - 1] for item in references.items])
    current = torch.cat([item.tokens[1:-1] for item in references.items])
    previous = torch.cat([item.tokens[:-2] for item in references.items])
    print(f"ridge probes of the aux layers: token named (whole hidden state / a {args.rank}-dim code)")
    for slot, layer in enumerate(references.aux_layer_ids):
        layer_features = features[:, slot * hidden : (slot + 1) * hidden].float()
        now = probe_accuracies(layer_features, current, embeddings, args.rank)
        before = probe_accuracies(layer_features, previous, embeddings, args.rank)
        print(
            f"  layer {layer:>2}: current {now[0]:6.1%} / {now[1]:6.1%}   previous {before[0]:6.1%} / {before[1]:6.1%}"
        )


if __name__ == "__main__":
    main()
