"""Atomic, pickle-free training checkpoints: safetensors for tensors, JSON for everything else.

Layout of `<run>/checkpoints/step-<N>/`: draft weights (`model.safetensors`, `draft_config.json`),
`optimizer.safetensors` + `trainer_state.json` (optimizer param groups, step, data position, RNG).
A checkpoint is written into a temp directory and renamed, so a crash never leaves a half checkpoint;
`latest` names the newest complete one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from wingspan.models.draft import Eagle3Draft


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def optimizer_to_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    state = optimizer.state_dict()
    tensors = {
        f"state.{index}.{key}": value.detach().contiguous().cpu()
        for index, entry in state["state"].items()
        for key, value in entry.items()
    }
    return tensors, {"param_groups": state["param_groups"]}


def optimizer_from_tensors(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        _, index, key = name.split(".", 2)
        state.setdefault(int(index), {})[key] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def save_checkpoint(
    run_dir: Path, step: int, draft: Eagle3Draft, optimizer: torch.optim.Optimizer, trainer_state: dict, keep: int
) -> Path:
    checkpoints = run_dir / "checkpoints"
    final = checkpoints / f"step-{step}"
    tmp = checkpoints / f".step-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    draft.save(tmp)
    tensors, meta = optimizer_to_tensors(optimizer)
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    state = dict(trainer_state, optimizer=meta, torch_rng_state=torch.get_rng_state().tolist())
    (tmp / "trainer_state.json").write_text(json.dumps(state) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    _write_text_atomic(checkpoints / "latest", final.name + "\n")
    for old in sorted(checkpoints.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))[:-keep]:
        shutil.rmtree(old)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.exists():
        return None
    path = run_dir / "checkpoints" / pointer.read_text().strip()
    if not (path / "trainer_state.json").exists():
        raise FileNotFoundError(f"{pointer} names {path}, which is not a complete checkpoint")
    return path


def load_checkpoint(path: Path, draft: Eagle3Draft, optimizer: torch.optim.Optimizer) -> dict:
    """Restore draft weights, optimizer and RNG in place; return the trainer state (step, data position)."""
    draft.load_trainable_state(load_file(str(path / "model.safetensors")), source=str(path))
    trainer_state = json.loads((path / "trainer_state.json").read_text())
    optimizer_from_tensors(optimizer, load_file(str(path / "optimizer.safetensors")), trainer_state.pop("optimizer"))
    torch.set_rng_state(torch.tensor(trainer_state.pop("torch_rng_state"), dtype=torch.uint8))
    return trainer_state
