"""Data-parallel training (gloo, CPU, 2 processes): the same loss curve and weights as 1 process, for DDP
and FSDP2, from online and dumped features; checkpoints move between world sizes; torchrun runs the CLI.

Tolerances: fp32 throughout (target, draft, no autocast). The ranks' gradients are summed in another order
than one process accumulates them, so losses, accuracies and gradient norms agree up to rounding: measured
within 2e-7 relative, asserted within 1e-5. Final weights after 6 AdamW steps: measured within 7e-7,
asserted within 1e-5.
"""

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from conftest import interrupted_copy
from safetensors.torch import load_file

from wingspan.config import TrainConfig, to_dict
from wingspan.pipeline import run_dump, run_training
from wingspan.train.distributed import process_group

LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-5
STEPS = 6  # optimizer steps; a checkpoint at 3 and 6


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """tiny_llama_dir made confident (its final norm x10): a random one is near uniform over the draft
    vocab, and a draft matching it moves the loss too little to tell curves apart."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    path = tmp_path_factory.mktemp("confident-llama")
    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir)
    model.model.norm.weight.data *= 10
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def conversations(counting_chat) -> Path:
    return counting_chat(6, spread=5)


def config_for(run: Path, target_dir, conversations, **overrides) -> TrainConfig:
    # grad_accum=3 over 2 ranks: rank 1 runs one zero-weight micro-batch per step (the uneven case); the
    # 6 conversations fit in 2 micro-batches, so every step crosses an epoch boundary.
    fields = dict(
        target=str(target_dir),
        data=[str(conversations)],
        output_dir=str(run),
        target_dtype="float32",
        num_hidden_layers=2,
        draft_vocab_size=64,
        max_length=96,
        batch_tokens=192,
        ttt_steps=3,
        grad_accum=3,
        lr=3e-3,
        warmup_ratio=0.2,
        max_steps=STEPS,
        save_every=3,
        log_every=1,
        num_threads=1,
    )
    fields.update(overrides)
    return TrainConfig(**fields)


def _rank_main(rank: int, world_size: int, port: int, config: TrainConfig, resume: bool) -> None:
    """One rank, set up as torchrun would set it up."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    with process_group(torch.device("cpu")):
        run_training(config, resume=resume)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_on_two(config: TrainConfig, resume: bool = False) -> Path:
    mp.spawn(_rank_main, args=(2, free_port(), config, resume), nprocs=2)
    return Path(config.output_dir)


def curve(run: Path) -> torch.Tensor:
    """[steps, 7]: loss_0..2, acc_0..2 and the gradient norm per logged step (a step's latest record)."""
    records = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    keys = [f"{name}_{j}" for name in ("loss", "acc") for j in range(3)] + ["grad_norm"]
    return torch.tensor([[records[s][k] for k in keys] for s in sorted(records)], dtype=torch.float64)


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=0, atol=WEIGHT_ATOL, msg=key)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, target_dir, conversations) -> Path:
    """An uninterrupted run on 1 process (in this one), and the same on 2 with DDP and with FSDP2."""
    root = tmp_path_factory.mktemp("runs")
    run_training(config_for(root / "one", target_dir, conversations))
    for parallel in ("ddp", "fsdp"):
        train_on_two(config_for(root / parallel, target_dir, conversations, parallel=parallel))
    return root


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_follow_the_one_process_loss_curve(runs, parallel):
    one, two = curve(runs / "one"), curve(runs / parallel)
    assert one.shape == two.shape == (STEPS, 7)
    # The draft learns, so the curves could differ; the gradient norm (before clipping) would show a
    # gradient off by a factor, which AdamW's steps hardly would.
    assert all(one[1:, 0] < one[:-1, 0]) and one[-1, 0] < 0.9 * one[0, 0]
    torch.testing.assert_close(two, one, rtol=LOSS_RTOL, atol=0)
    assert_same_weights(runs / parallel / "draft", runs / "one" / "draft")
    assert checkpoint_layout(runs / parallel, STEPS) == checkpoint_layout(runs / "one", STEPS)


def checkpoint_layout(run: Path, step: int) -> dict:
    """Everything of a checkpoint but the values of its tensors: 2 processes (FSDP2 gathering its shards)
    must write what 1 process writes, data position included."""
    path = run / "checkpoints" / f"step-{step}"
    state = json.loads((path / "trainer_state.json").read_text())
    return {
        "model": {k: v.shape for k, v in weights(path).items()},
        "optimizer": {k: v.shape for k, v in load_file(str(path / "optimizer.safetensors")).items()},
        "param_groups": state["optimizer"]["param_groups"],
        "position": {k: state[k] for k in ("step", "epoch", "batch_index")},
        "draft_config": json.loads((path / "draft_config.json").read_text()),
    }


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_process_checkpoint_resumes_on_one(runs, target_dir, conversations, tmp_path, parallel):
    resumed = interrupted_copy(runs / parallel, tmp_path / "resumed", at=3)
    run_training(config_for(resumed, target_dir, conversations, parallel=parallel), resume=True)
    assert_same_weights(resumed / "draft", runs / "one" / "draft")
    torch.testing.assert_close(curve(resumed)[3:], curve(runs / "one")[3:], rtol=LOSS_RTOL, atol=0)


def test_one_process_checkpoint_resumes_on_two_fsdp(runs, target_dir, conversations, tmp_path):
    resumed = interrupted_copy(runs / "one", tmp_path / "resumed", at=3)
    train_on_two(config_for(resumed, target_dir, conversations, parallel="fsdp"), resume=True)
    assert_same_weights(resumed / "draft", runs / "one" / "draft")
    torch.testing.assert_close(curve(resumed)[3:], curve(runs / "one")[3:], rtol=LOSS_RTOL, atol=0)


def test_torchrun_trains_from_a_dump_like_one_process(target_dir, conversations, tmp_path):
    """The CLI under torchrun, offline: the same curve and weights as one process trained from the same dump."""
    dump = tmp_path / "dump"
    run_dump(config_for(tmp_path / "unused", target_dir, conversations), dump)
    one = run_training(config_for(tmp_path / "one", target_dir, conversations, from_dump=str(dump), max_steps=3)).parent

    config = config_for(tmp_path / "two", target_dir, conversations, max_steps=3, parallel="fsdp")
    overrides = [f"{k}={json.dumps(v)}" for k, v in to_dict(config).items() if v != getattr(TrainConfig(), k)]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "wingspan",
        "train",
        "--from-dump",
        str(dump),
        *overrides,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("draft: ") == 1  # rank 0 alone reports
    assert "some ranks run a zero-weight micro-batch" in result.stdout
    two = tmp_path / "two"
    # an unset init_copy_head is chosen when the run starts: off, this target's head dims all turn too fast
    recorded = dataclasses.replace(config, from_dump=str(dump), init_copy_head=False)
    assert json.loads((two / "config.json").read_text()) == to_dict(recorded)
    torch.testing.assert_close(curve(two), curve(one), rtol=LOSS_RTOL, atol=0)
    assert_same_weights(two / "draft", one / "draft")


def test_dump_refuses_torchrun(tmp_path):
    """N ranks would each write the same dump: `wingspan dump` says to run it in one process instead."""
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0")
    result = subprocess.run(
        [sys.executable, "-m", "wingspan", "dump", "--out", str(tmp_path / "dump")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 2 and "runs in one process" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "dump").exists()
