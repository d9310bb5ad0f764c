"""Resident memory of a CPU training run as it goes, with and without handing freed pages back to the system.

A CPU training step allocates tensors of a different size each time (batch widths vary); glibc keeps the
freed ones resident, so a run grows step after step unless the trainer calls `release_freed_memory` (every
`RELEASE_MEMORY_EVERY` steps). This runs the same `wingspan train -c CONFIG output_dir=TMP max_steps=N ...` once
per policy in `--every`, each in a fresh subprocess, one after another:
- `0`: never release (glibc's behaviour alone);
- `N`: release every N steps (the trainer's cadence, patched);
- `gX`: a candidate policy, not the trainer's: release whenever the heap (RssAnon) has grown to X times its
  size just after the previous release (checked every step).
For each it prints the peak resident memory (VmHWM), the anonymous resident memory (RssAnon: the heap, not the
dump's mapped pages) at each quarter of the run, the number of releases, and the training throughput (non-pad
tokens/s, the mean of metrics.jsonl's windows after the first) with its ratio to the first `0`.

    python bench/train_memory.py --config runs/2h-text/train_config.json --steps 120 --every 0,10,g1.3,g1.6
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from patched_train import patched_train_command

RELEASE_POLICY = """
import sys
import wingspan.train.trainer as trainer

policy, released = sys.argv[1], [0]
release = trainer.release_freed_memory


def counted_release():
    release()
    released[0] += 1


def heap_kib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssAnon:"))


if policy.startswith("g"):
    growth, since = float(policy[1:]), [None]

    def release_when_grown():
        heap = heap_kib()
        if since[0] is None:
            since[0] = heap
        elif heap > growth * since[0]:
            counted_release()
            since[0] = heap_kib()

    trainer.release_freed_memory, trainer.RELEASE_MEMORY_EVERY = release_when_grown, 1
else:
    trainer.release_freed_memory, trainer.RELEASE_MEMORY_EVERY = counted_release, int(policy) or 10**9
import atexit

atexit.register(lambda: print(f"releases: {released[0]}", flush=True))
"""


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


def run(config: str, steps: int, policy: str, overrides: list[str], work: Path) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"policy-{policy}-", dir=work))
    command = patched_train_command(RELEASE_POLICY, policy, config, out, steps, overrides)
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
        sys.exit(f"{policy}: wingspan train failed (rc {child.returncode}); see {out / 'train.log'}")
    windows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    rates = [w["tokens_per_s"] for w in windows[1:]] or [w["tokens_per_s"] for w in windows]
    end = samples[-1][0]
    quarters = [next(kib for t, kib in samples if t >= q * end) for q in (0.25, 0.5, 0.75, 1.0)]
    releases = (out / "train.log").read_text().rsplit("releases: ", 1)[1].split()[0]
    return {
        "policy": policy,
        "releases": int(releases),
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
        help="release policies: 0 never, N every N steps, gX when the heap has grown X-fold (the first is the base)",
    )
    parser.add_argument("overrides", nargs="*", help="key=value training fields for every run")
    args = parser.parse_args()
    policies = [p.strip() for p in args.every.split(",")]
    with tempfile.TemporaryDirectory(prefix="train-memory-") as work:
        results = []
        for policy in policies:
            print(f"{describe(policy)}: {args.steps} steps ...", flush=True)
            results.append(run(args.config, args.steps, policy, args.overrides, Path(work)))
    base = results[0]
    print(f"\n{args.steps} steps of `wingspan train -c {args.config} {' '.join(args.overrides)}`")
    print(
        "| release | releases | peak resident GB | heap (RssAnon) GB at 1/4, 1/2, 3/4, end | tokens/s | "
        f"vs {describe(base['policy'])} | loss_0 |"
    )
    print("|---|---:|---:|---|---:|---:|---:|")
    for r in results:
        anon = " / ".join(f"{gb:.2f}" for gb in r["anon_gb"])
        print(
            f"| {describe(r['policy'])} | {r['releases']} | {r['peak_gb']:.2f} | {anon} | {r['tokens_per_s']:.0f} | "
            f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x | {r['loss_0']:.4f} |"
        )


def describe(policy: str) -> str:
    if policy.startswith("g"):
        return f"heap grown {policy[1:]}x"
    return "never" if policy == "0" else f"every {policy} steps"


if __name__ == "__main__":
    main()
