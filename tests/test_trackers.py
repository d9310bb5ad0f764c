"""Trackers: a training run logs the same figures to metrics.jsonl, TensorBoard and W&B (offline, read back from
the files each writes), and a resumed run continues its W&B run."""

import json
from pathlib import Path

import pytest
from conftest import interrupted_copy
from test_trainer import config, identity_vocab, sequences, tiny_target  # noqa: F401 (a fixture)

from wingspan.config import TrainConfig, from_dict
from wingspan.errors import ConfigError
from wingspan.train.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")


def wandb_records(path: Path):
    """The records of a W&B run file (`run-ID.wandb`): a ':W&B' header, then LevelDB log blocks of 32 KiB whose
    records (4-byte checksum, 2-byte length, 1-byte type: full, first, middle, last) carry protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    data, block, position, pending = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        length, kind = int.from_bytes(data[position + 4 : position + 6], "little"), data[position + 6]
        payload = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending + payload)
            pending = b""
            yield record
        elif kind in (2, 3):
            pending += payload
        else:
            break  # zeros: the unwritten end


def wandb_history(run_dir: Path, run_id: str = "*") -> tuple[dict[int, dict[str, float]], dict]:
    """{step: {key: value}} of the W&B run files under `run_dir` (of one run, or all), and the config recorded."""
    history, recorded = {}, {}
    for path in sorted(run_dir.glob(f"wandb/*-run-*/run-{run_id}.wandb")):
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "history":
                step = record.history.step.num
                history.setdefault(step, {}).update(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
            elif record.WhichOneof("record_type") in ("run", "config"):  # the config: in the run record, updates after
                updates = record.run.config.update if record.HasField("run") else record.config.update
                recorded |= {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in updates}
    return history, recorded


def test_training_logs_to_tensorboard_and_wandb(tiny_target, tmp_path, monkeypatch):  # noqa: F811
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    d2t, t2d = identity_vocab()
    run = tmp_path / "run"
    fields = dict(max_steps=8, log_every=4, save_every=4, tracker=["tensorboard", "wandb"])
    train(config(tmp_path, **fields), tiny_target, sequences(8, 11), d2t, t2d)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [4, 8]

    history, recorded = wandb_history(run)
    for record in metrics:
        logged = history[record["step"]]
        for key in ("loss_0", "acc_2", "sim_accept_len", "lr", "grad_norm", "tokens_per_s", "tokens"):
            assert logged[key] == pytest.approx(record[key], rel=1e-9), key
    assert recorded["lr"] == 3e-3 and recorded["tracker"] == ["tensorboard", "wandb"]

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss_0")] == [4, 8]
    assert [e.value for e in events.Scalars("acc_1")] == pytest.approx([m["acc_1"] for m in metrics], rel=1e-6)

    # Killed after it logged step 8 and resumed from its step-4 checkpoint: W&B would ignore step 8 logged again
    # in the same run, so the rewound run logs to a new one, which holds it.
    rewound = interrupted_copy(run, tmp_path / "rewound" / "run", at=4)
    again = config(tmp_path / "rewound", **fields)
    train(again, tiny_target, sequences(8, 11), d2t, t2d, resume=True)
    new_id = (rewound / "wandb_run_id").read_text().strip()
    assert new_id != (run / "wandb_run_id").read_text().strip()
    new_history = wandb_history(rewound, run_id=new_id)[0]
    assert new_history[8]["loss_0"] == pytest.approx(metrics[1]["loss_0"], rel=1e-9)  # the same step, run again

    # A longer run resumed from it logs into the same W&B run.
    run_id = (run / "wandb_run_id").read_text().strip()
    train(config(tmp_path, **(fields | {"max_steps": 12})), tiny_target, sequences(8, 11), d2t, t2d, resume=True)
    assert (run / "wandb_run_id").read_text().strip() == run_id
    assert {path.name for path in run.glob("wandb/*-run-*/run-*.wandb")} == {f"run-{run_id}.wandb"}
    assert 12 in wandb_history(run)[0]


def test_unknown_tracker_is_refused():
    with pytest.raises(ConfigError, match=r"tracker\[0\]: 'mlflow' is not one of \['tensorboard', 'wandb'\]"):
        from_dict(TrainConfig, {"tracker": ["mlflow"]})


def test_a_config_from_before_trackers_reads_as_it_meant():
    assert from_dict(TrainConfig, {"tensorboard": True}).tracker == ["tensorboard"]
    assert from_dict(TrainConfig, {"tensorboard": False}).tracker == []
