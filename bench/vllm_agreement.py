"""The referee check: wingspan's chain acceptance length against vLLM's, same draft, same K,
same prompt tokens, greedy; with vLLM's throughput with and without the draft and wingspan's (HF) beside.

vLLM runs in its own venv (`make vllm-venv`); the draft must be a vLLM export (`wingspan export`).
Exit status 1 when the two acceptance lengths differ by more than 10%.

    python bench/vllm_agreement.py --draft runs/quickstart/vllm-draft --num-prompts 80
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from wingspan.eval.referee import AGREEMENT_TOLERANCE, agreement, run_vllm_referee
from wingspan.eval.runner import load_models
from wingspan.models.registry import resolve_target

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", required=True, help="a vLLM export of the draft")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument(
        "--prompts",
        default=str(ROOT.parent / "shared/data/eval/mt_bench.jsonl"),
        help="EAGLE question JSONL (first turns) or plain text, one prompt a line",
    )
    parser.add_argument("--num-prompts", type=int, default=80)
    parser.add_argument("--num-spec-tokens", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2, help="torch threads for wingspan's decoding")
    parser.add_argument("--no-baseline", action="store_true", help="skip vLLM's run without the draft")
    parser.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm/bin/python")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)

    target_dir = resolve_target(args.target)
    with tempfile.TemporaryDirectory() as tmp:
        vllm = run_vllm_referee(
            args.vllm_python,
            target_dir,
            args.draft,
            args.prompts,
            Path(tmp) / "vllm.json",
            num_spec_tokens=args.num_spec_tokens,
            max_tokens=args.max_tokens,
            num_prompts=args.num_prompts,
            dtype=args.dtype,
            baseline=not args.no_baseline,
        )
    torch.set_num_threads(args.threads)
    target, draft = load_models(target_dir, args.draft, args.dtype)
    result = agreement(vllm, target, draft)

    def rates(values: list[float]) -> str:
        return " / ".join(f"{v:.3f}" for v in values)

    print(
        f"\n{result.prompts} prompts, K={result.num_spec_tokens}, {result.max_tokens} new tokens, {args.dtype}, greedy"
    )
    print(f"{'':<10}{'tau':>7}  {'per position':<24}{'tok/s':>8}")
    print(f"{'vLLM':<10}{result.vllm_tau:>7.3f}  {rates(result.vllm_per_position):<24}{result.vllm_tokens_per_s:>8.1f}")
    print(
        f"{'wingspan':<10}{result.wingspan_tau:>7.3f}  {rates(result.wingspan_per_position):<24}"
        f"{result.wingspan_tokens_per_s:>8.1f}"
    )
    if result.vllm_baseline_tokens_per_s:
        print(
            f"vLLM without the draft: {result.vllm_baseline_tokens_per_s:.1f} tok/s "
            f"(speedup {result.vllm_tokens_per_s / result.vllm_baseline_tokens_per_s:.2f}x); "
            f"outputs differing with vs without the draft: {vllm['outputs_differ']}"
        )
    verdict = "agree" if result.agrees else "DISAGREE"
    print(f"wingspan / vLLM tau: {result.relative_difference:+.1%} ({verdict}, tolerance {AGREEMENT_TOLERANCE:.0%})")
    if args.json:
        args.json.write_text(json.dumps(asdict(result), indent=2) + "\n")
    return 0 if result.agrees else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
