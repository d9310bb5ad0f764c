"""Where a speculative decoding round's time goes, at batch 1: target forwards, draft forwards, and the
engine's own overhead (tree building, masks, cache bookkeeping, Python), beside plain decoding of the same
prompts, run side by side (alternating which goes first).

It prints, per decoder, tau, tokens/s and the split of wall time, then two speedups over plain decoding:
- achieved: measured tokens/s ratio;
- ideal bound: the same tokens if the engine's overhead were zero, i.e. tokens / (target + draft forward
  time), from the forward costs measured in this run.
The goal is overhead < 10% of a round.

    python bench/decode_overhead.py --draft runs/quickstart/run/draft --tree 4,4,16
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from wingspan.data.template import chat_prompt
from wingspan.decode.primitives import SpecResult, TreeShape
from wingspan.decode.speculative import plain_generate, speculative_generate
from wingspan.eval.prompts import load_prompt_set
from wingspan.eval.runner import load_models

SHARED = Path(__file__).resolve().parents[2] / "shared"
OVERHEAD_GOAL = 0.10


@dataclass
class Totals:
    tokens: int = 0
    rounds: int = 0
    accepted: int = 0
    target_s: float = 0.0
    draft_s: float = 0.0
    total_s: float = 0.0

    def add(self, result: SpecResult) -> None:
        self.tokens += len(result.tokens)
        self.rounds += len(result.accepted_per_round)
        self.accepted += sum(result.accepted_per_round)
        self.target_s += result.target_s
        self.draft_s += result.draft_s
        self.total_s += result.total_s

    @property
    def overhead_s(self) -> float:
        return self.total_s - self.target_s - self.draft_s


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", required=True, help="a wingspan draft directory or a vLLM export")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument(
        "--prompts",
        default=f"mt_bench={SHARED / 'data/eval/mt_bench.jsonl'}",
        help="a prompt set spec, as `wingspan eval --sets` takes (first turns are used)",
    )
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-draft-tokens", type=int, default=3, help="the chain's drafts per round")
    parser.add_argument("--tree", help="also an EAGLE-2 tree: DEPTH,TOPK,TOTAL")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    target, draft = load_models(args.target, args.draft, args.dtype)
    _, prompts = load_prompt_set(args.prompts, args.num_prompts)
    prompt_ids = [chat_prompt(target.tokenizer, [{"role": "user", "content": p.turns[0]}]) for p in prompts]

    decoders = {"plain": lambda ids, n: plain_generate(target, ids, n)}
    decoders[f"chain K={args.num_draft_tokens}"] = lambda ids, n: speculative_generate(
        target, draft, ids, n, args.num_draft_tokens
    )
    if args.tree:
        shape = TreeShape(*(int(x) for x in args.tree.split(",")))
        decoders[f"tree {args.tree}"] = lambda ids, n: speculative_generate(target, draft, ids, n, tree=shape)

    for decode in decoders.values():  # warm-up: kernels and allocations for every shape a round uses
        decode(prompt_ids[0], 16)
    totals = {name: Totals() for name in decoders}
    for index, ids in enumerate(tqdm(prompt_ids, desc="prompts", unit="prompt")):
        names = list(decoders) if index % 2 == 0 else list(reversed(decoders))
        for name in names:
            totals[name].add(decoders[name](ids, args.max_new_tokens))

    plain = totals["plain"]
    plain_rate = plain.tokens / plain.total_s
    rows = {}
    print(
        f"\n{args.target} ({args.dtype}, {args.threads} threads), draft {args.draft}, "
        f"{len(prompt_ids)} prompts x {args.max_new_tokens} new tokens, batch 1\n"
    )
    print(
        f"{'decoder':<16}{'tau':>6}{'tok/s':>8}{'ms/round':>10}{'target':>8}{'draft':>8}{'overhead':>10}"
        f"{'achieved':>10}{'ideal':>8}"
    )
    for name, t in totals.items():
        rounds = t.rounds or t.tokens  # plain decoding: one forward per token
        tau = (t.rounds + t.accepted) / t.rounds if t.rounds else 1.0
        rate = t.tokens / t.total_s
        ideal_rate = t.tokens / (t.target_s + t.draft_s)
        rows[name] = {
            "tau": tau,
            "tokens": t.tokens,
            "tokens_per_s": rate,
            "ms_per_round": 1e3 * t.total_s / rounds,
            "target_share": t.target_s / t.total_s,
            "draft_share": t.draft_s / t.total_s,
            "overhead_share": t.overhead_s / t.total_s,
            "achieved_speedup": rate / plain_rate,
            "ideal_speedup": ideal_rate / plain_rate,
        }
        r = rows[name]
        print(
            f"{name:<16}{tau:>6.3f}{rate:>8.1f}{r['ms_per_round']:>10.1f}{r['target_share']:>8.1%}"
            f"{r['draft_share']:>8.1%}{r['overhead_share']:>10.1%}{r['achieved_speedup']:>9.2f}x"
            f"{r['ideal_speedup']:>7.2f}x"
        )
    worst = max(r["overhead_share"] for name, r in rows.items() if name != "plain")
    verdict = "meets" if worst < OVERHEAD_GOAL else "MISSES"
    print(
        f"\nengine overhead: at most {worst:.1%} of a round ({verdict} the < {OVERHEAD_GOAL:.0%} goal). "
        "ideal = tokens / (target + draft forward time): the speedup with a free engine."
    )
    if args.json:
        args.json.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "decoders": rows}, indent=2)
        )


if __name__ == "__main__":
    main(sys.argv[1:])
