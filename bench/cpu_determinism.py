"""Run to run: the same CPU training command, started again and again, with and without `start_vector_math`.

Each run is `wingspan train -c CONFIG output_dir=TMP max_steps=N log_every=1 ...` in a fresh process, one
after another, the two arms alternating (which goes first swaps from pair to pair); the runs of one arm are
identical commands, so every run should log the same losses bit for bit. The arm "without" replaces
`start_vector_math` (`TargetModel.load` calls it) with a no-op in the child, so the process's first
vector-math call is whatever the run makes first (the RoPE's cos of the first step). For each arm it prints
how many runs there were, each distinct (step-1 loss_0, last-step loss_0) with its count, and the training
rate (non-pad tokens/s of the steps after the first, the median over runs), since the first call might change
the speed as well as the numbers.

    python bench/cpu_determinism.py --config runs/2h-text/train_config.json --runs 8 --steps 3 \
        num_hidden_layers=1
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from patched_train import patched_train_command

WITHOUT_FIRST_CALL = (
    "import sys; import wingspan.models.target as target\n"
    "target.start_vector_math = (lambda: None) if sys.argv[1] == 'without' else target.start_vector_math"
)


def run(arm: str, config: str, steps: int, overrides: list[str], work: Path) -> tuple[tuple[str, str], float]:
    out = Path(tempfile.mkdtemp(prefix=f"{arm}-", dir=work))
    command = patched_train_command(WITHOUT_FIRST_CALL, arm, config, out, steps, ["log_every=1", *overrides])
    with open(out / "train.log", "w") as log:
        if subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode:
            sys.exit(f"{arm}: wingspan train failed; see {out / 'train.log'}")
    windows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    rate = statistics.median(window["tokens_per_s"] for window in windows[1:] or windows)
    return (repr(windows[0]["loss_0"]), repr(windows[-1]["loss_0"])), rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a train_config.json (or yaml)")
    parser.add_argument("--runs", type=int, default=8, help="runs per arm")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="more key=value settings for every run")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cpu-determinism-"))
    arms = ("with", "without")
    outcomes = {arm: collections.Counter() for arm in arms}
    rates = {arm: [] for arm in arms}
    for index in range(args.runs):
        for arm in arms if index % 2 == 0 else arms[::-1]:
            outcome, rate = run(arm, args.config, args.steps, args.overrides, work)
            outcomes[arm][outcome] += 1
            rates[arm].append(rate)
        print(f"pair {index + 1}/{args.runs} done", file=sys.stderr, flush=True)
    for arm in arms:
        print(f"{arm} start_vector_math: {args.runs} runs, {len(outcomes[arm])} distinct outcome(s)")
        for (first, last), count in outcomes[arm].most_common():
            print(f"  {count} x  step 1 loss_0 {first}, step {args.steps} loss_0 {last}")
        low, high = min(rates[arm]), max(rates[arm])
        print(f"  training rate: {statistics.median(rates[arm]):.0f} tokens/s (runs {low:.0f}-{high:.0f})")
    ratio = statistics.median(rates["with"]) / statistics.median(rates["without"])
    print(f"rate with / without: {ratio:.3f}")
    print(f"(runs in {work})")


if __name__ == "__main__":
    main()
