"""Experiment trackers: TensorBoard and Weights & Biases, behind one small interface.

`tracker: [tensorboard, wandb]` in a run config (or `--tracker` on eval and study) opens each named one;
every command that runs long logs to all of them the same way: scalars by step (training: the metrics.jsonl
record), the resolved config once, and tables (eval's and the study's results). TensorBoard writes event
files under `<dir>/tensorboard`; W&B runs through its own package, online or, with `WANDB_MODE=offline`, into
`<dir>/wandb` (synced later with `wandb sync`). A resumed training run continues its W&B run (its id is
kept in `<dir>/wandb_run_id`). Only the main process logs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from wingspan.errors import import_optional

TrackerName = Literal["tensorboard", "wandb"]
TRACKERS: tuple[TrackerName, ...] = ("tensorboard", "wandb")
WANDB_RUN_ID = "wandb_run_id"


class TensorBoard:
    def __init__(self, directory: Path, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(directory / "tensorboard"))
        self.writer.add_text("config", "```json\n" + json.dumps(config, indent=2, default=str) + "\n```", 0)

    def scalars(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
        self.writer.add_text(name, "\n".join(lines), 0)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandB:
    def __init__(self, directory: Path, config: dict[str, Any], name: str, job: str) -> None:
        wandb = import_optional("wandb", "wandb", "tracker: wandb")
        id_file = directory / WANDB_RUN_ID
        run_id = id_file.read_text().strip() if id_file.is_file() else None
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "wingspan"),
            name=name,
            job_type=job,
            dir=str(directory),
            config=config,
            id=run_id,
            resume="allow" if run_id else None,
        )
        if run_id is None:
            id_file.write_text(self.run.id + "\n")
        self.wandb = wandb

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        self.run.log({name: self.wandb.Table(columns=columns, data=rows)}, step=self.run.step)

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """The trackers a run asked for (none: every call does nothing)."""

    def __init__(
        self, names: list[TrackerName], directory: Path, config: dict[str, Any], job: str, enabled: bool = True
    ) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.backends: list[TensorBoard | WandB] = []
        if not enabled:
            return
        for name in dict.fromkeys(names):  # each once, in the order given
            if name == "tensorboard":
                self.backends.append(TensorBoard(directory, config))
            else:
                self.backends.append(WandB(directory, config, directory.name, job))

    def scalars(self, values: dict[str, Any], step: int) -> None:
        """Log the finite numbers of `values` (nulls and text are left out) at `step`."""
        numbers = {k: v for k, v in values.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        numbers = {k: v for k, v in numbers.items() if k != "step" and v == v and abs(v) != float("inf")}
        for backend in self.backends:
            backend.scalars(numbers, step)

    def table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        for backend in self.backends:
            backend.table(name, columns, rows)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()
        self.backends = []


def parse_trackers(text: str) -> list[TrackerName]:
    """`--tracker tensorboard,wandb`: the names, checked."""
    from wingspan.errors import ConfigError

    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in TRACKERS]
    if unknown:
        raise ConfigError(f"--tracker: unknown {unknown}; known: {', '.join(TRACKERS)}")
    return names  # type: ignore[return-value]
