"""Training's speed in a process that synthesized conversations first, against a fresh process.

`wingspan quickstart` synthesizes, dumps and trains in one process, and its training has run well below the
rate its probe measured before the synthesis (docs/results/recipe.md, "The text fit removed"). This trains
`--steps` steps from the dump of `--config` (a quickstart's train_config.json) once per mode, each in a fresh
subprocess, one after another, and prints non-pad tokens/s (over all of metrics.jsonl's windows) with its ratio
to the first mode:
- `fresh`: load the target, train;
- `after`: load the target, synthesize `--synthesize` conversations with it, train;
- `after-trim`: the same, handing freed pages back to the system (glibc's malloc_trim) before training.

    python bench/train_after_synthesis.py --config runs/budget-30m-nofit/train_config.json \
        --vocab runs/budget-30m-nofit/run/vocab.safetensors --steps 60 --synthesize 48
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from wingspan.train.trainer import read_metrics, training_rate

ONE_MODE = """
import json, sys
from pathlib import Path
from wingspan.config import TrainConfig, from_dict
from wingspan.data.synth import synthesize
from wingspan.devices import release_freed_memory
from wingspan.pipeline import load_target, run_training

mode, config_path, vocab, steps, conversations, out = sys.argv[1:]
fields = json.loads(Path(config_path).read_text())
fields |= {"output_dir": str(Path(out) / "run"), "max_steps": int(steps), "save_every": 10**9, "vocab": vocab}
config = from_dict(TrainConfig, fields)
target = load_target(config)
if mode != "fresh":
    synthesize(target, int(conversations), Path(out) / "synth.jsonl", batch_size=16, max_new_tokens=256, seed=0)
    if mode == "after-trim":
        release_freed_memory()
run_training(config, target=target)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a train_config.json whose from_dump names a dump")
    parser.add_argument("--vocab", required=True, help="the draft vocab to train with (the run's, not rebuilt)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--synthesize", type=int, default=48, help="conversations synthesized before training")
    parser.add_argument("--modes", default="fresh,after,after-trim")
    args = parser.parse_args()

    rates = {}
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory() as out:
            command = [sys.executable, "-c", ONE_MODE, mode, args.config, args.vocab, str(args.steps)]
            subprocess.run([*command, str(args.synthesize), out], check=True, stdout=subprocess.DEVNULL)
            rates[mode] = training_rate(read_metrics(Path(out) / "run"))
        first = next(iter(rates.values()))
        print(f"{mode:>10}: {rates[mode]:,.0f} non-pad tokens/s ({rates[mode] / first:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
