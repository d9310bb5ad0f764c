"""Atomic, pickle-free training checkpoints: safetensors for tensors, JSON for everything else.

Layout of `<run>/checkpoints/step-<N>/`: draft weights (`model.safetensors`, `draft_config.json`: the draft
directory of `write_draft`), `optimizer.safetensors` + `trainer_state.json` (optimizer param groups, step, data
position, RNG, the run's record from `wingspan.train.resume`, and the size and sha256 of each other file). A
checkpoint is written into a temp directory and renamed, so a crash never leaves a half checkpoint; `latest`
names the newest, for readers. Resuming reads the step directories themselves, newest first, and passes over
one whose files no longer match their record (a disk fault, a truncated copy), saying so.

The functions take and return whole state dicts, never modules: under FSDP the full weights exist only as
the copy gathered on rank 0 (`wingspan.train.distributed`), so the same files come from any number of
processes and resume on any number.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from wingspan.config import DraftConfig
from wingspan.errors import CheckpointError
from wingspan.files import atomic_directory, inside, sha256_of, write_text_atomically
from wingspan.models.draft import CONFIG, WEIGHTS, write_draft

OPTIMIZER = "optimizer.safetensors"
STATE = "trainer_state.json"
FILES = (WEIGHTS, CONFIG, OPTIMIZER)  # each recorded in the trainer state with its size and sha256
STEP_DIRECTORY = re.compile(r"step-(\d+)")


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
        save_file(tensors, str(tmp / OPTIMIZER))
        files = {name: {"bytes": (tmp / name).stat().st_size, "sha256": sha256_of(tmp / name)} for name in FILES}
        state = dict(trainer_state, optimizer=meta, torch_rng_state=torch.get_rng_state().tolist(), files=files)
        (tmp / STATE).write_text(json.dumps(dict(state, sha256=state_sha256(state))) + "\n")
    write_text_atomically(checkpoints / "latest", final.name + "\n")
    for old in checkpoint_directories(run_dir)[keep:]:
        shutil.rmtree(old)
    return final


def state_sha256(state: dict) -> str:
    """sha256 of a trainer state (its own `sha256` field left out): a changed digit that keeps the JSON valid
    (a step, a data position) is found too."""
    canonical = json.dumps({k: v for k, v in state.items() if k != "sha256"}, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def checkpoint_directories(run_dir: Path) -> list[Path]:
    """The run's checkpoint directories, newest first (temporary ones of an interrupted write are not)."""
    found = [p for p in (run_dir / "checkpoints").glob("step-*") if STEP_DIRECTORY.fullmatch(p.name)]
    return sorted(found, key=lambda p: int(p.name.removeprefix("step-")), reverse=True)


@dataclass
class Checkpoint:
    path: Path
    weights: dict[str, torch.Tensor]  # the draft's trainable state
    optimizer_state: dict  # an `optimizer.state_dict()`
    rng_state: torch.Tensor  # torch's CPU generator when the checkpoint was written
    trainer_state: dict  # step and data position (epoch, batch_index)


def read_checkpoint(path: Path) -> Checkpoint:
    """The checkpoint in `path`; CheckpointError naming the file when one is missing, truncated or damaged."""
    state_file = path / STATE
    try:
        trainer_state = json.loads(state_file.read_text(encoding="utf-8"))
        if "sha256" in trainer_state and trainer_state.pop("sha256") != state_sha256(trainer_state):
            raise CheckpointError(f"{state_file}: its contents changed since it was written (sha256 differs)")
        recorded = trainer_state.pop("files", {})
        for name, record in recorded.items():
            file = inside(path, name, str(state_file))
            if not file.is_file():
                raise CheckpointError(f"{file}: missing")
            if file.stat().st_size != record["bytes"]:
                raise CheckpointError(f"{file}: {file.stat().st_size} bytes, {record['bytes']} when written")
            if sha256_of(file) != record["sha256"]:
                raise CheckpointError(f"{file}: its contents changed since it was written (sha256 differs)")
        optimizer_meta = trainer_state.pop("optimizer")
        rng_state = torch.tensor(trainer_state.pop("torch_rng_state"), dtype=torch.uint8)
        if rng_state.shape != torch.get_rng_state().shape:
            raise CheckpointError(
                f"{state_file}: torch_rng_state has {rng_state.numel()} bytes, not {torch.get_rng_state().numel()}"
            )
        for key in ("step", "epoch", "batch_index"):
            if not isinstance(trainer_state.get(key), int):
                raise CheckpointError(f"{state_file}: no integer {key!r}")
    except CheckpointError:
        raise
    except OSError as error:
        raise CheckpointError(f"{state_file}: cannot read ({error.strerror})") from None
    except (ValueError, KeyError, TypeError, RuntimeError, OverflowError) as error:  # JSON/Unicode errors: ValueError
        raise CheckpointError(f"{state_file}: not a complete trainer state ({type(error).__name__}: {error})") from None
    tensors = {}
    for name in (OPTIMIZER, WEIGHTS):
        try:
            tensors[name] = load_file(str(path / name))
        except (SafetensorError, OSError) as error:
            raise CheckpointError(f"{path / name}: not a readable safetensors file ({error})") from None
    optimizer_state = optimizer_from_tensors(tensors[OPTIMIZER], optimizer_meta)
    return Checkpoint(path, tensors[WEIGHTS], optimizer_state, rng_state, trainer_state)


def resume_point(run_dir: Path) -> Checkpoint | None:
    """The newest checkpoint of `run_dir` that reads back whole (None when it has none); a damaged newer one is
    reported by file and passed over. When every checkpoint is damaged, CheckpointError names them all."""
    from wingspan.train.distributed import print0

    damaged = []
    for path in checkpoint_directories(run_dir):
        try:
            checkpoint = read_checkpoint(path)
        except CheckpointError as error:
            damaged.append(str(error))
            continue
        for problem in damaged:
            print0(f"warning: {problem}: resuming from the previous complete checkpoint, {path.name}")
        return checkpoint
    if damaged:
        raise CheckpointError(f"{run_dir}: no complete checkpoint to resume: {'; '.join(damaged)}")
    return None
