"""How fast the target writes replies: the rate `wingspan data synth` and `wingspan data regenerate` turn CPU
time into training data at.

The same prompts (first turns of a prompt set, as chat prompts) are answered greedily at each batch size twice,
side by side: by the product's own call (`TargetModel.generate`: rows that are done leave the batch) and by
transformers' `generate` on the same left-padded batch (every row runs until the batch's longest reply ends);
the two alternate order over `--repeats` passes. It prints, per batch size, the reply tokens written per second
by each, their ratio, the share of transformers' decode slots that held a live reply, and how many replies the
two wrote alike (bf16 numerics depend on the batch's shape, so some greedy replies part on a near-tie).

    python bench/generate_throughput.py --batch-sizes 16,32,64 --prompts 64
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import GenerationConfig

from wingspan.data.template import chat_prompt
from wingspan.eval.prompts import load_prompt_set
from wingspan.models.target import TargetModel


def transformers_generate(target: TargetModel, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy replies of transformers' `generate` to one left-padded batch, cut before the first stop token."""
    stops = target.eos_token_ids
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else stops[0]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stops, pad_token_id=pad)
    with torch.inference_mode():
        out = target.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    replies = []
    for row in out[:, width:].tolist():
        end = next((i for i, token in enumerate(row) if token in stops), len(row))
        replies.append(row[:end])
    return replies


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
    ways = {
        "wingspan": lambda batch: [g.tokens for g in target.generate(batch, args.max_new_tokens)],
        "transformers": lambda batch: transformers_generate(target, batch, args.max_new_tokens),
    }
    seconds = {(way, b): 0.0 for way in ways for b in sizes}
    replies: dict[tuple[str, int], list[list[int]]] = {}
    slots = {b: 0 for b in sizes}
    for repeat in range(args.repeats):
        for b in sizes:
            for way in list(ways) if repeat % 2 == 0 else list(ways)[::-1]:
                out = []
                started = time.perf_counter()
                for i in range(0, len(chats), b):
                    batch = ways[way](chats[i : i + b])
                    out += batch
                    if way == "transformers" and repeat == 0:
                        slots[b] += len(batch) * max(len(t) for t in batch)
                seconds[way, b] += time.perf_counter() - started
                replies[way, b] = out
    print(f"{len(chats)} prompts, up to {args.max_new_tokens} new tokens, greedy, {args.repeats} pass(es)")
    print(
        "| batch size | wingspan tokens/s | transformers tokens/s | ratio | transformers' live slots | replies alike |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for b in sizes:
        written = {way: sum(len(t) for t in replies[way, b]) for way in ways}  # per pass
        rate = {way: written[way] * args.repeats / seconds[way, b] for way in ways}
        alike = sum(x == y for x, y in zip(replies["wingspan", b], replies["transformers", b]))
        live = written["transformers"] / slots[b]
        ratio = rate["wingspan"] / rate["transformers"]
        print(
            f"| {b} | {rate['wingspan']:.0f} | {rate['transformers']:.0f} | {ratio:.2f}x | {live:.0%} | "
            f"{alike}/{len(chats)} |"
        )


if __name__ == "__main__":
    main()
