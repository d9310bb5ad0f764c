"""The command line of a `wingspan train` run in a fresh Python process that first runs `patch` (code that
replaces a constant or function of wingspan's, reading its own setting from sys.argv[1]): what the CPU
benches compare, one patched variant per run."""

from __future__ import annotations

import sys
from pathlib import Path

# the patch's own setting is sys.argv[1]; the rest is `wingspan train`'s command line
RUN_WINGSPAN = "\nfrom wingspan.cli import main\n\nsys.argv = ['wingspan', *sys.argv[2:]]\nsys.exit(main())\n"


def patched_train_command(
    patch: str, setting: str, config: str, out: Path, steps: int, overrides: list[str]
) -> list[str]:
    """`wingspan train -c config output_dir=out/run max_steps=steps save_every=steps *overrides` in a child
    that runs `patch` (which must import sys) first, with `setting` as its sys.argv[1]."""
    return [
        sys.executable,
        "-c",
        patch + RUN_WINGSPAN,
        setting,
        "train",
        "-c",
        config,
        f"output_dir={out / 'run'}",
        f"max_steps={steps}",
        f"save_every={steps}",
        *overrides,
    ]
