"""Where a speculative round's time goes in vLLM on this machine: the target's forward and logits, the draft's
forwards, its token choice and its set-up, verification and bookkeeping, the scheduler; per engine step, for
each proposer asked, side by side in one run.

Runs in the vLLM venv (`make vllm-venv`). Proposers are bench/vllm_proposers.py's (`none`, `ngram:K`,
`eagle3:DIR:K`). Each gets its own process, with the engine core in that process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so that cProfile sees it; after one untimed request (compiling, unless
--eager), each prompt is generated on its own (greedy, batch 1) under cProfile, and the time of vLLM 0.32's
functions is read from the profile: the names below are that version's, and a part whose functions are not
found stops the run. cProfile slows Python more than the kernels, so the parts are for comparing proposers
with each other, not absolute; bench/vllm_proposers.py measures the speeds.

    .venv-vllm/bin/python bench/vllm_round_costs.py --target ~/.cache/wingspan/models/smollm2-135m-instruct \
        --prompts src/wingspan/eval/data/mt_bench.jsonl --limit 5 \
        --proposer none --proposer eagle3:runs/budget-2h/vllm-draft:2

Printed per proposer: engine steps, output tokens a step, milliseconds a step by part, and a step's cost in
steps of the first proposer (`none` first gives the cost of a round in target steps).
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import json
import os
import pstats
import sys
from pathlib import Path

PROPOSERS_PATH = Path(__file__).resolve().parent / "vllm_proposers.py"
_spec = importlib.util.spec_from_file_location("vllm_proposers", PROPOSERS_PATH)
proposers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(proposers)

# (file suffix, function name) of vLLM 0.32's functions
STEP = ("v1/engine/core.py", "step")
EXECUTE = ("v1/worker/gpu_model_runner.py", "execute_model")
TARGET_FORWARD = ("v1/worker/gpu_model_runner.py", "_model_forward")
SAMPLE = ("v1/worker/gpu_model_runner.py", "sample_tokens")
PROPOSE_ALL = ("v1/worker/gpu_model_runner.py", "propose_draft_token_ids")
EAGLE_PROPOSE = ("v1/spec_decode/llm_base_proposer.py", "propose")
DRAFT_CHOICE = "_sample_draft_tokens"
MODULE_CALL = "_wrapped_call_impl"  # torch.nn.Module.__call__


def matching(stats: dict, key: tuple[str, str]) -> list:
    return [f for f in stats if f[0].endswith(key[0]) and f[2] == key[1]]


def cumulative(stats: dict, key: tuple[str, str], required: bool = True) -> tuple[float, int]:
    """Cumulative seconds and calls of the outermost function of that name (the one with the most time)."""
    found = matching(stats, key)
    if not found:
        if required:
            raise SystemExit(f"no {key[1]} in {key[0]} in the profile: not vLLM 0.32?")
        return 0.0, 0
    best = max(found, key=lambda f: stats[f][3])
    return stats[best][3], stats[best][1]


def called_from(stats: dict, callee_name: str, callers: list) -> float:
    """Cumulative seconds of the functions named callee_name when called from any of callers."""
    total = 0.0
    for function, (_, _, _, _, from_callers) in stats.items():
        if function[2] != callee_name:
            continue
        for caller, (_, _, _, cum) in from_callers.items():
            if caller in callers:
                total += cum
    return total


def breakdown(stats: dict) -> dict:
    step_s, steps = cumulative(stats, STEP)
    execute_s, _ = cumulative(stats, EXECUTE)
    forward_s, _ = cumulative(stats, TARGET_FORWARD)
    logits_s = called_from(stats, "compute_logits", matching(stats, EXECUTE))
    sample_s, _ = cumulative(stats, SAMPLE)
    propose_s, _ = cumulative(stats, PROPOSE_ALL, required=False)
    eagle = matching(stats, EAGLE_PROPOSE)
    draft_forward_s = called_from(stats, MODULE_CALL, eagle)
    choice_s = called_from(stats, DRAFT_CHOICE, eagle)
    parts = {
        "target forward": forward_s,
        "target logits": logits_s,
        "draft forwards": draft_forward_s,
        "draft token choice": choice_s,
        "draft set-up": propose_s - draft_forward_s - choice_s,
        "verify, bookkeeping": (execute_s - forward_s - logits_s) + (sample_s - propose_s),
        "scheduler, rest": step_s - execute_s - sample_s,
    }
    return {
        "steps": steps,
        "step_ms": 1000 * step_s / steps,
        "parts_ms": {k: 1000 * v / steps for k, v in parts.items()},
    }


def choose_in_draft_vocab() -> None:
    """vLLM 0.32 chooses a greedy EAGLE-3 draft token by scattering the draft's logits into a row of the
    target's whole vocabulary and taking its argmax; the argmax of the draft's own logits, mapped through d2t
    (`draft_id_to_target_id`, an offset), is the same token without that row."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    vllms_choice = SpecDecodeBaseProposer._greedy_sample

    def greedy_sample(self, hidden_states):
        offsets = getattr(self.model, "draft_id_to_target_id", None)
        if offsets is None or self.use_local_argmax_reduction or self.use_heterogeneous_vocab:
            return vllms_choice(self, hidden_states)
        draft_ids = self.model.logits_processor(self.model.lm_head, hidden_states).argmax(dim=-1)
        return draft_ids + offsets[draft_ids]

    SpecDecodeBaseProposer._greedy_sample = greedy_sample


def worker(args: argparse.Namespace) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    if args.choose_in_draft_vocab:
        choose_in_draft_vocab()

    proposer = proposers.parse_proposer(args.proposer[args.worker])
    llm = LLM(
        model=args.target,
        speculative_config=proposers.speculative_config(proposer, tuple(args.prompt_lookup)),
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=1,
        enforce_eager=args.eager,
        seed=0,
    )
    prompts = proposers.chat_prompts(llm.get_tokenizer(), Path(args.prompts), args.limit)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    profile = cProfile.Profile()
    token_ids = []
    for prompt in prompts:
        profile.enable()
        output = llm.generate([prompt], params, use_tqdm=False)[0]
        profile.disable()
        token_ids.append(list(output.outputs[0].token_ids))
    result = breakdown(pstats.Stats(profile).stats)
    result.update(proposer=proposer["name"], output_tokens=sum(map(len, token_ids)), token_ids=token_ids)
    Path(args.worker_out).write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="target checkpoint directory")
    parser.add_argument("--prompts", required=True, help="EAGLE question JSONL or one prompt a line")
    parser.add_argument("--proposer", action="append", required=True, help="none, ngram:K or eagle3:DIR:K; repeat")
    parser.add_argument("--limit", type=int, default=5, help="the first N prompts")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--prompt-lookup", type=int, nargs=2, default=[2, 4], metavar=("MIN", "MAX"))
    parser.add_argument("--eager", action="store_true", help="vLLM's eager mode (default: compiled)")
    parser.add_argument(
        "--choose-in-draft-vocab",
        action="store_true",
        help="patch vLLM (in these processes) to choose a greedy EAGLE-3 draft token by the argmax of the draft's "
        "own logits mapped through d2t (the same token), to measure what that change would save",
    )
    parser.add_argument("--out", help="the figures as JSON")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for text in args.proposer:
        proposers.parse_proposer(text)
    if args.worker is not None:
        worker(args)
        return
    runs = [proposers.run_one(index, sys.argv[1:], __file__) for index in range(len(args.proposer))]
    first = runs[0]["step_ms"]
    parts = list(runs[0]["parts_ms"])
    print("| proposer | steps | tokens a step | ms a step | in steps of the first | " + " | ".join(parts) + " |")
    print("|---|" + "---:|" * (4 + len(parts)))
    for run in runs:
        cells = [
            run["proposer"],
            str(run["steps"]),
            f"{run['output_tokens'] / run['steps']:.2f}",
            f"{run['step_ms']:.1f}",
            f"{run['step_ms'] / first:.2f}",
            *(f"{run['parts_ms'][part]:.2f}" for part in parts),
        ]
        print("| " + " | ".join(cells) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": vars(args), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
