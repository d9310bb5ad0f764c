"""vLLM's speculative proposers side by side at batch 1: no draft, prompt lookup (`"method": "ngram"`) and
EAGLE-3 drafts, each at the numbers of speculative tokens asked, on the same prompts, in one run.

Runs in the vLLM venv (`make vllm-venv`; vllm + stdlib only, as src/wingspan/eval/vllm_referee.py, whose
engine settings and prompt reader it shares). Every proposer gets its own process and engine; within it each
prompt set is generated on its own (greedy, batch 1), timed, and vLLM's spec-decode counters are read before
and after it; one short request before them is not timed (with torch.compile, vLLM's default and what
`vllm serve` runs, the first forwards compile the target and the draft; --eager turns it off). The run
without a draft is repeated last, so that drift of the machine's speed shows.

    .venv-vllm/bin/python bench/vllm_proposers.py --target ~/.cache/wingspan/models/smollm2-135m-instruct \
        --set mt_bench=src/wingspan/eval/data/mt_bench.jsonl --set gsm8k=src/wingspan/eval/data/gsm8k_80.jsonl \
        --limit 20 --proposer none --proposer ngram:3 --proposer eagle3:runs/quickstart/vllm-draft:1 \
        --out runs/proposers.json

A proposer is `none`, `ngram:K` (n-grams of --prompt-lookup MIN,MAX tokens) or `eagle3:DIR:K` (a parallel
draft, whose config.json has `mask_token_id`, runs with `"parallel_drafting": true`). Printed per
set and pooled: output tokens/s, the speedup over all runs without a draft taken together (their spread is
printed: this CPU's speed drifts by several percent within a run), vLLM's acceptance length
(1 + accepted / drafts: for ngram, over the steps that proposed) and acceptance per position, and how many
greedy outputs differ from the first run without a draft. Ask for `none` more than once, between the
others, where the drift matters.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REFEREE_PATH = Path(__file__).resolve().parents[1] / "src" / "wingspan" / "eval" / "vllm_referee.py"
_spec = importlib.util.spec_from_file_location("vllm_referee", REFEREE_PATH)
referee = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(referee)

COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def parse_proposer(text: str) -> dict:
    method, _, rest = text.partition(":")
    if method == "none" and not rest:
        return {"name": "none", "config": None}
    if method == "ngram" and rest.isdigit() and int(rest) >= 1:
        return {"name": f"ngram K={rest}", "method": "ngram", "k": int(rest)}
    if method == "eagle3":
        directory, _, k = rest.rpartition(":")
        if directory and k.isdigit() and int(k) >= 1:
            return {
                "name": f"{Path(directory).parent.name}/{Path(directory).name} K={k}",
                "method": "eagle3",
                "model": directory,
                "k": int(k),
            }
    raise SystemExit(f"--proposer {text!r}: expected none, ngram:K or eagle3:DIR:K")


def speculative_config(proposer: dict, lookup: tuple[int, int]) -> dict | None:
    if proposer["name"] == "none":
        return None
    if proposer["method"] == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": proposer["k"],
            "prompt_lookup_min": lookup[0],
            "prompt_lookup_max": lookup[1],
        }
    return referee.eagle3_config(proposer["model"], proposer["k"])


def counters(llm) -> dict:
    values = referee.metric_values(llm)
    return {name: values.get(name, 0) for name in COUNTERS} | {PER_POSITION: values.get(PER_POSITION, [])}


def chat_prompts(tokenizer, path: Path, limit: int | None) -> list:
    """The first `limit` prompts of `path` as vLLM token prompts, each a user turn in the target's chat template."""
    from vllm.inputs import TokensPrompt

    prompts = []
    for text in referee.read_prompts(path, limit):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        prompts.append(TokensPrompt(prompt_token_ids=tokenizer(rendered, add_special_tokens=False).input_ids))
    return prompts


def worker(args: argparse.Namespace) -> None:
    """One proposer, one engine: each set generated and timed on its own."""
    from vllm import LLM, SamplingParams

    proposer = parse_proposer(args.proposer[args.worker])
    llm = LLM(
        model=args.target,
        speculative_config=speculative_config(proposer, args.prompt_lookup),
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=1,
        enforce_eager=args.eager,
        disable_log_stats=False,
        seed=0,
    )
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    prompt_sets = {name: chat_prompts(tokenizer, Path(path), args.limit) for name, path in args.set}
    # untimed: unless --eager, the first forwards of the target and the draft compile them
    llm.generate(prompt_sets[args.set[0][0]][:1], SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    results = {}
    for name, prompts in prompt_sets.items():
        before = counters(llm)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        after = counters(llm)
        tokens = [list(output.outputs[0].token_ids) for output in outputs]
        per_position = after[PER_POSITION]
        per_position = [
            a - (before[PER_POSITION][i] if i < len(before[PER_POSITION]) else 0) for i, a in enumerate(per_position)
        ]
        results[name] = {
            "seconds": seconds,
            "output_tokens": sum(len(t) for t in tokens),
            "token_ids": tokens,
            "drafts": after[COUNTERS[0]] - before[COUNTERS[0]],
            "draft_tokens": after[COUNTERS[1]] - before[COUNTERS[1]],
            "accepted": after[COUNTERS[2]] - before[COUNTERS[2]],
            "accepted_per_position": per_position,
        }
    Path(args.worker_out).write_text(json.dumps({"proposer": proposer, "sets": results}))


def run_one(index: int, argv: list[str], script: str = __file__) -> dict:
    """`script`'s worker for the index-th proposer in a process of its own (an engine each); what it wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        subprocess.run([sys.executable, script, *argv, "--worker", str(index), "--worker-out", str(out)], check=True)
        return json.loads(out.read_text())


def pooled_runs(runs: list[dict], sets: list[str]) -> dict:
    """The runs as one: tokens and seconds summed per set (what a speedup over several baselines divides by)."""
    return {
        "sets": {
            s: {key: sum(run["sets"][s][key] for run in runs) for key in ("output_tokens", "seconds")} for s in sets
        }
    }


def summary(run: dict, baseline: dict, first_baseline: dict, sets: list[str]) -> dict:
    rows = {}
    for name in [*sets, "pooled"]:
        parts = sets if name == "pooled" else [name]
        tokens = sum(run["sets"][s]["output_tokens"] for s in parts)
        seconds = sum(run["sets"][s]["seconds"] for s in parts)
        base_tokens = sum(baseline["sets"][s]["output_tokens"] for s in parts)
        base_seconds = sum(baseline["sets"][s]["seconds"] for s in parts)
        drafts = sum(run["sets"][s]["drafts"] for s in parts)
        accepted = sum(run["sets"][s]["accepted"] for s in parts)
        positions = [sum(col) for col in zip(*(run["sets"][s]["accepted_per_position"] for s in parts))]
        differ = sum(
            a != b for s in parts for a, b in zip(run["sets"][s]["token_ids"], first_baseline["sets"][s]["token_ids"])
        )
        rows[name] = {
            "tokens_per_s": tokens / seconds,
            "speedup": (tokens / seconds) / (base_tokens / base_seconds),
            "tau": 1 + accepted / drafts if drafts else None,
            "acceptance_per_position": [n / drafts for n in positions] if drafts else None,
            "outputs_differ": differ,
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="target checkpoint directory")
    parser.add_argument(
        "--set",
        action="append",
        required=True,
        type=lambda s: tuple(s.split("=", 1)),
        help="NAME=FILE: EAGLE question JSONL (first turns) or plain text; repeat",
    )
    parser.add_argument("--proposer", action="append", required=True, help="none, ngram:K or eagle3:DIR:K; repeat")
    parser.add_argument("--limit", type=int, default=None, help="the first N prompts of each set")
    parser.add_argument(
        "--prompt-lookup",
        default="2,4",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        help="MIN,MAX n-gram lengths of ngram",
    )
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--eager",
        action="store_true",
        help="eager mode (enforce_eager) in place of vLLM's default torch.compile, which `vllm serve` uses",
    )
    parser.add_argument("--out", help="all figures and outputs as JSON")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for text in args.proposer:
        parse_proposer(text)
    if args.worker is not None:
        worker(args)
        return
    argv = sys.argv[1:]
    order = list(range(len(args.proposer)))
    nones = [i for i in order if args.proposer[i] == "none"]
    if not nones:
        raise SystemExit("--proposer none is needed: speedups are measured against it")
    runs = []
    for i in [*order, nones[0]]:  # no draft again, last: drift
        runs.append(run_one(i, argv))
        if args.out:  # after each engine: a run stopped later keeps what it measured
            Path(args.out).write_text(json.dumps({"settings": vars(args), "runs": runs}, indent=1))
    sets = [name for name, _ in args.set]
    plain = [run for run in runs if run["proposer"]["name"] == "none"]
    baseline = pooled_runs(plain, sets)
    table = [
        (run["proposer"]["name"] + (" (again)" if i == len(order) else ""), summary(run, baseline, plain[0], sets))
        for i, run in enumerate(runs)
    ]
    plain_speeds = [
        rows["pooled"]["tokens_per_s"] for run, (_, rows) in zip(runs, table) if run["proposer"]["name"] == "none"
    ]
    print(
        f"\nvLLM, batch 1, greedy, {args.dtype}, {'eager' if args.eager else 'compiled'}, "
        f"up to {args.max_tokens} new tokens, "
        f"{args.limit or 'all'} first turns a set; ngram sizes {args.prompt_lookup[0]}..{args.prompt_lookup[1]}; "
        f"speedups over the {len(plain)} runs without a draft together "
        f"({min(plain_speeds):.1f}-{max(plain_speeds):.1f} tokens/s pooled)"
    )
    print("| proposer | " + " | ".join(sets) + " | pooled | tau (pooled) | acceptance per position | differ |")
    print("|---|" + "---:|" * (len(sets) + 2) + "---|---:|")
    for name, rows in table:
        cells = [f"{rows[s]['tokens_per_s']:.1f} ({rows[s]['speedup']:.2f}x)" for s in [*sets, "pooled"]]
        pooled = rows["pooled"]
        tau = "" if pooled["tau"] is None else f"{pooled['tau']:.2f}"
        accept = " / ".join(f"{a:.2f}" for a in pooled["acceptance_per_position"] or [])
        print(f"| {name} | " + " | ".join(cells) + f" | {tau} | {accept} | {pooled['outputs_differ']} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": vars(args), "runs": runs, "table": table}, indent=1))


if __name__ == "__main__":
    main()
