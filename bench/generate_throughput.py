"""How fast the target writes replies at each generation batch size: the rate `wingspan data synth` and
`wingspan data regenerate` turn CPU time into training data at.

The same prompts (first turns of a prompt set, as chat prompts) are answered greedily at each batch size, in
the product's own call (`TargetModel.generate`, left-padded batches); the batch sizes alternate order over
`--repeats` passes. It prints, per batch size, the reply tokens written per second and the share of the
decode steps' slots that held a live reply (a batch runs until its longest reply ends).

    python bench/generate_throughput.py --batch-sizes 16,32,64 --prompts 64
"""

from __future__ import annotations

import argparse
import time

import torch

from wingspan.data.template import chat_prompt
from wingspan.eval.prompts import load_prompt_set
from wingspan.models.target import TargetModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--set", default="mt_bench", help="prompt set whose first turns are answered")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--batch-sizes", default="16,32,64")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()

    target = TargetModel.load(args.target, dtype=args.dtype, device="cpu")
    print(f"target {args.target} ({args.dtype}), {torch.get_num_threads()} threads")
    _, prompts = load_prompt_set(args.set, args.prompts)
    chats = [chat_prompt(target.tokenizer, [{"role": "user", "content": p.turns[0]}]) for p in prompts]
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    seconds = {b: 0.0 for b in sizes}
    tokens = {b: 0 for b in sizes}
    slots = {b: 0 for b in sizes}
    replies: dict[int, list[list[int]]] = {}
    for repeat in range(args.repeats):
        for b in sizes if repeat % 2 == 0 else sizes[::-1]:
            out = []
            started = time.perf_counter()
            for i in range(0, len(chats), b):
                batch = target.generate(chats[i : i + b], args.max_new_tokens)
                out += [g.tokens for g in batch]
                slots[b] += len(batch) * max(len(g.tokens) for g in batch)
            seconds[b] += time.perf_counter() - started
            tokens[b] += sum(len(t) for t in out)
            replies[b] = out
    first = replies[sizes[0]]
    print(f"{len(chats)} prompts, up to {args.max_new_tokens} new tokens, greedy, {args.repeats} pass(es)")
    print(
        "| batch size | reply tokens/s | vs batch "
        + str(sizes[0])
        + " | live slots | replies equal to batch "
        + str(sizes[0])
        + "'s |"
    )
    print("|---:|---:|---:|---:|---:|")
    base = tokens[sizes[0]] / seconds[sizes[0]]
    for b in sizes:
        rate = tokens[b] / seconds[b]
        same = sum(x == y for x, y in zip(replies[b], first))
        print(f"| {b} | {rate:.0f} | {rate / base:.2f}x | {tokens[b] / slots[b]:.0%} | {same}/{len(first)} |")


if __name__ == "__main__":
    main()
