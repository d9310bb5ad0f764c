"""`kill -9` at random moments of train, dump and regenerate (the real commands, on a tiny random target):
started again with the same command and --resume, each ends with exactly what an uninterrupted run wrote.

The moments are drawn (seeded) over the uninterrupted run's own duration, so they fall in start-up, in
the middle of the work, inside checkpoint and shard writes, and at the end alike.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import write_counting_conversations
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

KILLS = 3  # interruptions per command


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "wingspan", *args]


def run(args: list[str]) -> float:
    """Run to the end; its duration in seconds."""
    started = time.monotonic()
    result = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return time.monotonic() - started


def killed_at(args: list[str], seconds: float) -> bool:
    """Start `args` and SIGKILL it after `seconds`; whether it was still running then."""
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        process.wait(seconds)
        return False
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return True


def interrupted_then_resumed(args: list[str], resume_args: list[str], duration: float, seed: str) -> int:
    """Kill `args` KILLS times at drawn moments (the first run fresh, later ones resuming), then resume it to
    the end; returns how many kills landed while it was still running."""
    rng = random.Random(seed)
    landed = 0
    for k in range(KILLS):
        landed += killed_at(args if k == 0 else resume_args, rng.uniform(0.2, 1.0) * duration)
    run(resume_args)
    return landed


@pytest.fixture
def data(tmp_path) -> Path:
    return write_counting_conversations(tmp_path / "chat.jsonl", count=24)


def train_args(tiny_llama_dir, data, run_dir) -> list[str]:
    return command(
        "train",
        f"target={tiny_llama_dir}",
        f"data=[{data}]",
        f"output_dir={run_dir}",
        "target_dtype=float32",
        "num_hidden_layers=2",
        "draft_vocab_size=64",
        "max_length=64",
        "batch_tokens=128",
        "ttt_steps=3",
        "max_steps=40",
        "save_every=4",
        "log_every=2",
        "num_threads=1",
    )


def test_train_killed_at_random_resumes_to_the_same_draft_and_metrics(tiny_llama_dir, data, tmp_path):
    whole = tmp_path / "whole"
    duration = run(train_args(tiny_llama_dir, data, whole))
    again = train_args(tiny_llama_dir, data, tmp_path / "killed")
    assert interrupted_then_resumed(again, again + ["--resume-or-start"], duration, "train") >= 1
    a, b = (load_file(str(d / "draft" / "model.safetensors")) for d in (whole, tmp_path / "killed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def logged(directory):
        rows = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in row.items() if k != "tokens_per_s"} for row in rows]

    assert logged(whole) == logged(tmp_path / "killed")  # every step once, with the same figures


def test_dump_killed_at_random_resumes_byte_identical(tiny_llama_dir, data, tmp_path):
    def dump_args(out):
        return command(
            "dump",
            "--out",
            str(out),
            "--shard-mb",
            "1",
            f"target={tiny_llama_dir}",
            f"data=[{data}]",
            "target_dtype=float32",
            "max_length=64",
            "batch_tokens=128",
            "num_threads=1",
        )

    duration = run(dump_args(tmp_path / "whole"))
    again = dump_args(tmp_path / "killed")
    assert interrupted_then_resumed(again, again + ["--resume"], duration, "dump") >= 1
    files = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "killed").iterdir() if not p.name.startswith("."))
    for name in files:
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "killed" / name).read_bytes(), name


def test_regenerate_killed_at_random_resumes_to_the_same_file(tiny_llama_dir, data, tmp_path):
    def regenerate_args(out):
        return command(
            "data",
            "regenerate",
            str(data),
            "--out",
            str(out),
            "--target",
            str(tiny_llama_dir),
            "--dtype",
            "float32",
            "--max-new-tokens",
            "24",
            "--batch-size",
            "2",
        )

    duration = run(regenerate_args(tmp_path / "whole.jsonl"))
    again = regenerate_args(tmp_path / "killed.jsonl")
    assert interrupted_then_resumed(again, again + ["--resume"], duration, "regenerate") >= 1
    assert (tmp_path / "killed.jsonl").read_bytes() == (tmp_path / "whole.jsonl").read_bytes()
