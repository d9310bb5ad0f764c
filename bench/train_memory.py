"""Resident memory of a CPU training run as it goes, with and without handing freed pages back to the system.

A CPU training step allocates tensors of a different size each time (batch widths vary); glibc keeps the
freed ones resident, so a run grows step after step unless the trainer calls `release_freed_memory` (every
`RELEASE_MEMORY_EVERY` steps). This runs the same `wingspan train -c CONFIG output_dir=TMP max_steps=N ...` once
per cadence in `--every` (0: never, glibc's behaviour alone), each in a fresh subprocess, one after another, and
prints for each: the peak resident memory (VmHWM), the anonymous resident memory (RssAnon: the heap, not the
dump's mapped pages) at each quarter of the run, and the training throughput (non-pad tokens/s, the mean of
metrics.jsonl's windows after the first) with its ratio to never releasing, measured side by side.

    python bench/train_memory.py --config runs/2h-text/train_config.json --steps 200 --every 0,10,1,0 \
        num_hidden_layers=1
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NEVER = 10**9
CHILD = (
    "import sys; import wingspan.train.trainer as trainer; trainer.RELEASE_MEMORY_EVERY = int(sys.argv[1]); "
    "from wingspan.cli import main; sys.argv = ['wingspan', *sys.argv[2:]]; sys.exit(main())"
)


def status_kib(pid: int, fields: tuple[str, ...]) -> dict[str, int]:
    values = {}
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                name, _, rest = line.partition(":")
                if name in fields:
                    values[name] = int(rest.split()[0])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return values


def run(config: str, steps: int, every: int, overrides: list[str], work: Path) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"every-{every}-", dir=work))
    command = [
        sys.executable,
        "-c",
        CHILD,
        str(every or NEVER),
        "train",
        "-c",
        config,
        f"output_dir={out / 'run'}",
        f"max_steps={steps}",
        f"save_every={steps}",
        *overrides,
    ]
    samples: list[tuple[float, int]] = []  # (seconds, RssAnon KiB)
    peak = 0
    started = time.perf_counter()
    with open(out / "train.log", "w") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        while child.poll() is None:
            values = status_kib(child.pid, ("VmHWM", "RssAnon"))
            if "RssAnon" in values:
                samples.append((time.perf_counter() - started, values["RssAnon"]))
                peak = max(peak, values["VmHWM"])
            time.sleep(1.0)
    if child.returncode:
        sys.exit(f"every {every}: wingspan train failed (rc {child.returncode}); see {out / 'train.log'}")
    windows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    rates = [w["tokens_per_s"] for w in windows[1:]] or [w["tokens_per_s"] for w in windows]
    end = samples[-1][0]
    quarters = [next(kib for t, kib in samples if t >= q * end) for q in (0.25, 0.5, 0.75, 1.0)]
    return {
        "every": every,
        "peak_gb": peak / 2**20,
        "anon_gb": [q / 2**20 for q in quarters],
        "tokens_per_s": sum(rates) / len(rates),
        "loss_0": windows[-1]["loss_0"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a train_config.json (a dump's, to leave the target out)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--every",
        default="0,10,1,0",
        help="release cadences in steps (0: never; the first 0 is the base)",
    )
    parser.add_argument("overrides", nargs="*", help="key=value training fields for every run")
    args = parser.parse_args()
    cadences = [int(e) for e in args.every.split(",")]
    with tempfile.TemporaryDirectory(prefix="train-memory-") as work:
        results = []
        for every in cadences:
            print(f"every {every or 'never'}: {args.steps} steps ...", flush=True)
            results.append(run(args.config, args.steps, every, args.overrides, Path(work)))
    base = next((r for r in results if r["every"] == 0), results[0])
    print(f"\n{args.steps} steps of `wingspan train -c {args.config} {' '.join(args.overrides)}`")
    print(
        "| release every | peak resident GB | heap (RssAnon) GB at 1/4, 1/2, 3/4, end | tokens/s | vs never | loss_0 |"
    )
    print("|---|---:|---|---:|---:|---:|")
    for r in results:
        anon = " / ".join(f"{gb:.2f}" for gb in r["anon_gb"])
        print(
            f"| {r['every'] or 'never'} | {r['peak_gb']:.2f} | {anon} | {r['tokens_per_s']:.0f} | "
            f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x | {r['loss_0']:.4f} |"
        )


if __name__ == "__main__":
    main()
