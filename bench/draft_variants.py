"""A vLLM export reshaped without training, to price a draft's shape in vLLM and bound what the shape costs in
acceptance (docs/results/proposers.md, "What a draft's shape costs vLLM").

- `--intermediate-size N` larger than the draft's pads every MLP with zero rows and columns: the same function
  (silu(0) * 0 = 0), so the same drafts in vLLM, at a wider MLP's cost. Smaller keeps the first N: another
  function, for its cost only (train `intermediate_size` to know its acceptance).
- `--vocab FILE` (a `wingspan vocab` output whose tokens the draft's vocab holds; build it from the draft's own
  training data with a smaller `--size` to keep its most frequent tokens) keeps the trained lm_head rows of those
  tokens: a smaller draft vocab whose acceptance `wingspan replay score` measures.

    python bench/draft_variants.py runs/budget-2h/vllm-draft --out runs/var/mlp6144 --intermediate-size 6144
    python bench/draft_variants.py runs/budget-2h/vllm-draft --out runs/var/v4096 --vocab runs/var/vocab4096.safetensors
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from wingspan.data.vocab import DraftVocab, draft_to_target_ids


def resized_mlp(tensors: dict[str, torch.Tensor], size: int) -> dict[str, torch.Tensor]:
    out = dict(tensors)
    for name, weight in tensors.items():
        if ".mlp." not in name:
            continue
        dim = 1 if name.endswith("down_proj.weight") else 0
        have = weight.shape[dim]
        if size <= have:
            out[name] = weight.narrow(dim, 0, size)
        else:
            pad = list(weight.shape)
            pad[dim] = size - have
            out[name] = torch.cat([weight, weight.new_zeros(pad)], dim)
    return out


def cut_vocab(tensors: dict[str, torch.Tensor], vocab: DraftVocab) -> dict[str, torch.Tensor]:
    row_of = {int(token): row for row, token in enumerate(draft_to_target_ids(tensors["d2t"]))}
    kept = draft_to_target_ids(vocab.d2t)
    missing = [int(token) for token in kept if int(token) not in row_of]
    if missing:
        print(
            f"error: the draft's vocab lacks {len(missing)} of the --vocab tokens (first: {missing[0]})",
            file=sys.stderr,
        )
        sys.exit(2)
    rows = torch.tensor([row_of[int(token)] for token in kept])
    return dict(tensors, d2t=vocab.d2t, t2d=vocab.t2d, **{"lm_head.weight": tensors["lm_head.weight"][rows]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path, help="a `wingspan export --format vllm` directory")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--intermediate-size", type=int, help="every layer's MLP width")
    parser.add_argument("--vocab", type=Path, help="a smaller draft vocab within the draft's")
    args = parser.parse_args()
    config = json.loads((args.export / "config.json").read_text())
    tensors = load_file(args.export / "model.safetensors")
    if args.intermediate_size:
        tensors = resized_mlp(tensors, args.intermediate_size)
        config["intermediate_size"] = args.intermediate_size
    if args.vocab:
        vocab = DraftVocab.load(args.vocab)
        tensors = cut_vocab(tensors, vocab)
        config["draft_vocab_size"] = vocab.draft_vocab_size
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({name: weight.contiguous() for name, weight in tensors.items()}, args.out / "model.safetensors")
    print(f"{args.out}: intermediate_size {config['intermediate_size']}, draft vocab {config['draft_vocab_size']}")


if __name__ == "__main__":
    main()
