"""What a checkpoint records of its run, and the check that `--resume` continues that same run.

Every checkpoint's trainer state holds the run's resolved config and the fingerprints of what it trains on:
the data files (sha256), the tokenized sequences, the dump's manifest, the draft vocab and the target. A
resume compares them with the run being started before anything in the run directory is written, and
refuses every difference that would change what is trained, naming the field; settings that only change
logging, bookkeeping or where the run ends may change, and are printed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from wingspan.config import TrainConfig, to_dict
from wingspan.data.conversations import source_sha256
from wingspan.data.template import TokenizedConversation
from wingspan.errors import CheckpointError, ConfigError
from wingspan.files import write_text_atomically

# Fields a resumed run may change, and what changing them does.
MAY_CHANGE = {
    "max_steps": "the run ends at another step; the learning-rate schedule stretches to it",
    "epochs": "the run ends at another step; the learning-rate schedule stretches to it",
    "save_every": "checkpoints come at other steps",
    "keep_checkpoints": "older checkpoints are kept or removed by another count",
    "log_every": "metrics are logged at other steps",
    "tracker": "logging only",
    "tensorboard": "logging only (a run before `tracker` replaced it)",
    "num_threads": "CPU threads only",
    "output_dir": "the run was moved",
    "device": "the draft trains on another device (with autocast_bf16 unset, a GPU turns bf16 autocast on)",
    "parallel": "the ranks share the draft another way (checkpoints hold the full state)",
    "on_nonfinite": "only steps whose loss or gradient is not finite are handled otherwise",
}
# Fields that name inputs (or resolve against the target); their fingerprints, or the resolved values, are
# compared instead, so that a moved file may resume.
COMPARED_BY_CONTENT = ("target", "data", "from_dump", "vocab", "init_from", "chat_template", "aux_layer_ids")


def sequences_sha256(sequences: list[TokenizedConversation]) -> str:
    """sha256 of the tokenized training data (ids and loss masks, in order)."""
    digest = hashlib.sha256()
    for sequence in sequences:
        digest.update(len(sequence.input_ids).to_bytes(8, "little"))
        digest.update(np.asarray(sequence.input_ids, dtype=np.int64).tobytes())
        digest.update(np.asarray(sequence.loss_mask, dtype=np.uint8).tobytes())
    return digest.hexdigest()


def vocab_sha256(d2t: torch.Tensor, t2d: torch.Tensor) -> str:
    digest = hashlib.sha256()
    for tensor in (d2t, t2d):
        digest.update(tensor.detach().cpu().to(torch.int64).numpy().tobytes())
    return digest.hexdigest()


def describe_run(config: TrainConfig, target, sequences: list[TokenizedConversation], d2t, t2d) -> dict:
    """The record every checkpoint of this run carries (JSON)."""
    from wingspan.data.hidden_states import read_manifest, target_fingerprint

    inputs = {
        "target": {"name": config.target, "fingerprint": target_fingerprint(target)},
        "aux_layer_ids": list(target.aux_layer_ids),
        "data": [{"path": path, "sha256": source_sha256(path)} for path in config.data],
        "sequences": {"count": len(sequences), "sha256": sequences_sha256(sequences)},
        "vocab": {"draft_vocab_size": int(d2t.numel()), "sha256": vocab_sha256(d2t, t2d)},
    }
    if config.from_dump:
        # What the features are: the shards' contents (the records are compared as `sequences`), not the
        # manifest's bytes, which hold the paths the data was read from.
        shards = read_manifest(config.from_dump).shards
        inputs["dump"] = {"path": config.from_dump, "shards": [s.sha256 for s in shards]}
    return {"config": to_dict(config), "inputs": inputs}


def _short(digest: str) -> str:
    return digest[:12]


def input_differences(recorded: dict, current: dict) -> list[str]:
    differences = []
    old, new = recorded["target"], current["target"]
    if old["fingerprint"] != new["fingerprint"]:
        differences.append(
            f"target: the checkpoint's is {old['name']!r} (fingerprint {_short(old['fingerprint'])}), this run's "
            f"{new['name']!r} ({_short(new['fingerprint'])})"
        )
    if recorded.get("aux_layer_ids") != current["aux_layer_ids"]:
        differences.append(f"aux_layer_ids: {recorded.get('aux_layer_ids')} -> {current['aux_layer_ids']}")
    old_files, new_files = recorded["data"], current["data"]
    # From a dump the data files only name what the dump was made from; its shards and records are compared.
    dumped = "dump" in recorded and "dump" in current
    if not dumped and [f["sha256"] for f in old_files] != [f["sha256"] for f in new_files]:
        if len(old_files) != len(new_files):
            differences.append(
                f"data: the checkpoint was trained on {[f['path'] for f in old_files]}, this run reads "
                f"{[f['path'] for f in new_files]}"
            )
        for was, now in zip(old_files, new_files):
            if was["sha256"] != now["sha256"]:
                differences.append(
                    f"data: {now['path']} (sha256 {_short(now['sha256'])}) is not the checkpoint's {was['path']} "
                    f"(sha256 {_short(was['sha256'])})"
                )
    if ("dump" in recorded) != ("dump" in current) or (
        dumped and recorded["dump"]["shards"] != current["dump"]["shards"]
    ):
        was, now = recorded.get("dump", {}).get("path"), current.get("dump", {}).get("path")
        same = " (its shards have changed since)" if was == now else ""
        differences.append(f"from_dump: the checkpoint trained from dump {was!r}, this run from {now!r}{same}")
    if not differences and recorded["sequences"] != current["sequences"]:
        differences.append(
            f"tokenized data: {current['sequences']['count']} sequences (sha256 "
            f"{_short(current['sequences']['sha256'])}) are not the checkpoint's {recorded['sequences']['count']} "
            f"({_short(recorded['sequences']['sha256'])}): the chat template, the tokenizer or max_length changed"
        )
    if recorded["vocab"] != current["vocab"]:
        differences.append(
            f"vocab: the draft vocab (size {current['vocab']['draft_vocab_size']}, sha256 "
            f"{_short(current['vocab']['sha256'])}) is not the checkpoint's (size "
            f"{recorded['vocab']['draft_vocab_size']}, {_short(recorded['vocab']['sha256'])})"
        )
    return differences


def require_same_run(where: Path, trainer_state: dict, current: dict) -> list[str]:
    """Raise ConfigError naming every difference between the run of the checkpoint at `where` (its trainer
    state) and this one that changes what is trained; returns a note for each allowed change. A field the
    checkpoint does not record (added to TrainConfig since) counts as its default."""
    recorded = trainer_state.get("run")
    if recorded is None:  # written before runs were recorded: only the batch layout was
        planned_packed = trainer_state.get("pack", False)
        if planned_packed != current["config"]["pack"]:
            wanted = current["config"]["pack"]
            raise ConfigError(
                f"{where}: --resume with other settings than the run it continues: pack: {planned_packed!r} -> "
                f"{wanted!r}"
            )
        return [f"{where} records no run settings (written before they were recorded): they are not checked"]
    try:
        old = to_dict(TrainConfig()) | recorded["config"]
        new = current["config"]
        differences, notes = [], []
        for name in sorted(set(old) | set(new)):
            if name in COMPARED_BY_CONTENT or old.get(name) == new.get(name):
                continue
            change = f"{name}: {old.get(name)!r} -> {new.get(name)!r}"
            if name in MAY_CHANGE:
                notes.append(f"{change} ({MAY_CHANGE[name]})")
            else:
                differences.append(change)
        differences += input_differences(recorded["inputs"], current["inputs"])
    except (KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(
            f"{where}: its record of the run is malformed ({type(error).__name__}: {error})"
        ) from None
    if differences:
        raise ConfigError(
            f"{where}: --resume with other settings than the run it continues: {'; '.join(differences)}; "
            "put them back, or train into another output_dir"
        )
    return notes


def cut_metrics(path: Path, step: int) -> bool:
    """Keep the records of `metrics.jsonl` up to `step` (the checkpoint resumed; 0: none), so that the steps
    run again after a resume are not logged twice; a line cut short by the interruption goes too. Returns
    whether records after `step` were dropped (the run is rewound)."""
    if not path.exists():
        return False
    kept, dropped = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(line + "\n")
        else:
            dropped = True
    write_text_atomically(path, "".join(kept))
    return dropped
