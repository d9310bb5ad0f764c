"""Atomic, pickle-free training checkpoints: safetensors for tensors, JSON for everything else.

Layout of `<run>/checkpoints/step-<N>/`: draft weights (`model.safetensors`, `draft_config.json`: the draft
directory of `write_draft`), `optimizer.safetensors` + `trainer_state.json` (optimizer param groups, step, data
position, RNG). A checkpoint is written into a temp directory and renamed, so a crash never leaves a half
checkpoint; `latest` names the newest complete one.

The functions take and return whole state dicts, never modules: under FSDP the full weights exist only as
the copy gathered on rank 0 (`wingspan.train.distributed`), so the same files come from any number of
processes and resume on any number.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from wingspan.config import DraftConfig
from wingspan.errors import CheckpointError
from wingspan.files import atomic_directory, write_text_atomically
from wingspan.models.draft import WEIGHTS, write_draft


def optimizer_to_tensors(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """An `optimizer.state_dict()` as safetensors tensors plus JSON-able param groups."""
    tensors = {
        f"state.{index}.{key}": value.detach().contiguous().cpu()
        for index, entry in state["state"].items()
        for key, value in entry.items()
    }
    return tensors, {"param_groups": state["param_groups"]}


def optimizer_from_tensors(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        _, index, key = name.split(".", 2)
        state.setdefault(int(index), {})[key] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(
    run_dir: Path,
    step: int,
    weights: dict[str, torch.Tensor],
    config: DraftConfig,
    optimizer_state: dict,
    trainer_state: dict,
    keep: int,
) -> Path:
    """Write checkpoint `step` (weights: the draft's trainable state; optimizer_state: an
    `optimizer.state_dict()` of those parameters) and keep the newest `keep`."""
    checkpoints = run_dir / "checkpoints"
    final = checkpoints / f"step-{step}"
    with atomic_directory(final) as tmp:
        write_draft(tmp, weights, config)
        tensors, meta = optimizer_to_tensors(optimizer_state)
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        state = dict(trainer_state, optimizer=meta, torch_rng_state=torch.get_rng_state().tolist())
        (tmp / "trainer_state.json").write_text(json.dumps(state) + "\n")
    write_text_atomically(checkpoints / "latest", final.name + "\n")
    for old in sorted(checkpoints.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))[:-keep]:
        shutil.rmtree(old)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.exists():
        return None
    path = run_dir / "checkpoints" / pointer.read_text().strip()
    if not (path / "trainer_state.json").exists():
        raise CheckpointError(f"{pointer} names {path}, which is not a complete checkpoint")
    return path


@dataclass
class Checkpoint:
    path: Path
    weights: dict[str, torch.Tensor]  # the draft's trainable state
    optimizer_state: dict  # an `optimizer.state_dict()`
    rng_state: torch.Tensor  # torch's CPU generator when the checkpoint was written
    trainer_state: dict  # step and data position (epoch, batch_index)


def read_checkpoint(path: Path) -> Checkpoint:
    trainer_state = json.loads((path / "trainer_state.json").read_text())
    optimizer_tensors = load_file(str(path / "optimizer.safetensors"))
    optimizer_state = optimizer_from_tensors(optimizer_tensors, trainer_state.pop("optimizer"))
    rng_state = torch.tensor(trainer_state.pop("torch_rng_state"), dtype=torch.uint8)
    return Checkpoint(path, load_file(str(path / WEIGHTS)), optimizer_state, rng_state, trainer_state)
