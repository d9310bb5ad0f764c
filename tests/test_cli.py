"""The `wingspan` command end to end on a tiny random target: train -> resume -> export, and clear errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import write_counting_conversations
from safetensors.torch import load_file


def wingspan(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "wingspan", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=600,
        env=None if env is None else {**os.environ, **env},
    )


@pytest.fixture
def conversations(tmp_path) -> Path:
    return write_counting_conversations(tmp_path / "chat.jsonl")


def test_every_command_has_help():
    for command in (
        ["--help"],
        ["train", "--help"],
        ["dump", "--help"],
        ["export", "--help"],
        ["import", "--help"],
        ["replay", "references", "--help"],
        ["replay", "score", "--help"],
        ["eval", "--help"],
        ["vocab", "--help"],
        ["quickstart", "--help"],
        ["models", "list", "--help"],
        ["models", "prepare", "--help"],
        ["data", "synth", "--help"],
        ["data", "regenerate", "--help"],
    ):
        result = wingspan(*command)
        assert result.returncode == 0, result.stderr
        assert "Usage" in result.stdout


def test_train_resume_and_export(tiny_llama_dir, conversations, tmp_path):
    run = tmp_path / "run"
    overrides = [
        f"target={tiny_llama_dir}",
        f"data=[{conversations}]",
        f"output_dir={run}",
        "target_dtype=float32",
        "num_hidden_layers=2",
        "draft_vocab_size=64",
        "max_steps=6",
        "save_every=3",
        "batch_tokens=1024",
        "ttt_steps=3",
        "log_every=3",
        "lr=1e-3",
        "tracker=[tensorboard]",
    ]
    first = wingspan("train", *overrides)
    assert first.returncode == 0, first.stderr[-3000:]
    config = json.loads((run / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["draft_vocab_size"] == 64
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [3, 6]
    assert (run / "checkpoints" / "step-6" / "optimizer.safetensors").is_file()
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))

    again = wingspan("train", *overrides)
    assert again.returncode == 2 and "--resume" in again.stderr

    resumed = wingspan("train", *overrides, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Count from 3.\nCount from 7.\n")
    evaluated = wingspan(
        "eval", "--draft", str(run / "draft"), "--sets", f"counting={prompts}", "--max-new-tokens", "8",
        "--target", str(tiny_llama_dir), "--dtype", "float32", "--warmup", "0", "--out", str(tmp_path / "eval"),
        "--tracker", "tensorboard,wandb", env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    # The eval's figures went to both trackers: W&B's scalars and table, TensorBoard's table as text.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from test_trackers import wandb_history

    results = json.loads((tmp_path / "eval" / "results.json").read_text())["sets"][0]
    logged = wandb_history(tmp_path / "eval")[0][0]
    assert logged["counting/acceptance_length"] == pytest.approx(results["acceptance_length"])
    assert logged["counting/speedup"] == pytest.approx(results["speedup"]) and logged["eval/_type"] == "table-file"
    events = EventAccumulator(str(tmp_path / "eval" / "tensorboard"))
    events.Reload()
    assert "| counting | 2 |" in events.Tensors("eval/text_summary")[0].tensor_proto.string_val[0].decode()
    exported = wingspan(
        "export", str(run / "draft"), "--format", "vllm", "--out", str(tmp_path / "vllm"),
        "--eval", str(tmp_path / "eval" / "results.json"),
    )  # fmt: skip
    assert exported.returncode == 0, exported.stderr[-3000:]
    vllm_config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert vllm_config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert vllm_config["num_hidden_layers"] == 2 and vllm_config["draft_vocab_size"] == 64
    serve = f'vllm serve {tiny_llama_dir} --speculative-config \'{{"method": "eagle3", "model": "{tmp_path / "vllm"}"'
    assert serve in exported.stdout
    # The model card: hub front matter, the architecture, the run's data, steps and tokens, the measured
    # figures of the eval given, and the serve command printed.
    card = (tmp_path / "vllm" / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["library_name"] == "wingspan" and "eagle3" in front["tags"]
    assert "base_model" not in front and "license" not in front  # a local target with no card of its own
    tokens = sum(json.loads(line)["tokens"] for line in (run / "metrics.jsonl").read_text().splitlines())
    assert f"- data: `{conversations}`" in card and f"- optimizer steps: 6, {tokens:,} tokens" in card
    assert "| decoder layers | 2 (token embeddings enter layer 0) |" in card and "`ttt_steps=3`" in card
    tau = json.loads((tmp_path / "eval" / "results.json").read_text())["sets"][0]["acceptance_length"]
    assert f"| counting | 2 | {tau:.2f} |" in card
    assert serve in card
    # A checkpoint's card: the run up to that step only.
    exported = wingspan("export", str(run / "checkpoints" / "step-3"), "--out", str(tmp_path / "step3"))
    assert exported.returncode == 0, exported.stderr[-3000:]
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert f"- optimizer steps: 3, {first['tokens']:,} tokens" in (tmp_path / "step3" / "README.md").read_text()

    # an import of that export starts a new run: its vocab and aux layers are the draft's, not rebuilt
    imported = wingspan("import", str(tmp_path / "vllm"), "--out", str(tmp_path / "imported"))
    assert imported.returncode == 0 and "as the vllm layout" in imported.stdout, imported.stderr[-3000:]
    start = [o for o in overrides if not o.startswith(("output_dir=", "draft_vocab_size="))]
    started = wingspan("train", *start, f"output_dir={tmp_path / 'next'}", f"init_from={tmp_path / 'imported'}")
    assert started.returncode == 0, started.stderr[-3000:]
    final = load_file(str(tmp_path / "next" / "draft" / "model.safetensors"))
    assert torch.equal(final["d2t"], load_file(str(run / "draft" / "model.safetensors"))["d2t"])
    assert json.loads((tmp_path / "next" / "draft" / "draft_config.json").read_text())["aux_layer_ids"] == [2, 2, 1]


def test_dump_then_train_from_it(tiny_llama_dir, tmp_path):
    conversations = tmp_path / "long.jsonl"  # ~9k tokens, 2 MB of features: two shards of --shard-mb 1
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"Count from {i}."},
                {"role": "assistant", "content": " ".join(str(n) for n in range(i, i + 60))},
            ]
        }
        for i in range(80)
    ]
    conversations.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [
        f"target={tiny_llama_dir}",
        f"data=[{conversations}]",
        "target_dtype=float32",
        "max_length=128",
        "batch_tokens=1024",
        "num_hidden_layers=1",
        "draft_vocab_size=64",
        "max_steps=2",
        "ttt_steps=2",
    ]
    dump_dir = tmp_path / "dump"
    first = wingspan("dump", *overrides, "--out", str(dump_dir), "--shard-mb", "1", "--max-shards", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "bytes/token" in first.stdout and "GB" in first.stdout
    unfinished = wingspan("train", *overrides, f"output_dir={tmp_path / 'early'}", "--from-dump", str(dump_dir))
    assert (
        unfinished.returncode == 2 and "unfinished dump" in unfinished.stderr and "Traceback" not in unfinished.stderr
    )
    again = wingspan("dump", *overrides, "--out", str(dump_dir), "--shard-mb", "1", "--resume")
    assert again.returncode == 0, again.stderr[-3000:]

    run = tmp_path / "run"
    trained = wingspan("train", *overrides, f"output_dir={run}", "--from-dump", str(dump_dir))
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert json.loads((run / "config.json").read_text())["from_dump"] == str(dump_dir)
    assert (run / "draft" / "model.safetensors").is_file()

    mismatch = wingspan(
        "train", *overrides, "max_length=256", f"output_dir={tmp_path / 'other'}", "--from-dump", str(dump_dir)
    )
    assert mismatch.returncode == 2
    assert "max_length: dump has 128, config has 256" in mismatch.stderr and "Traceback" not in mismatch.stderr


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("lr=fast", "lr: expected a finite number, got 'fast'"),
        ("grad_clip=-1", "grad_clip: must be > 0, got -1.0"),
        ("lr=inf", "lr: expected a finite number, got inf"),
        ("num_hidden_layers=0", "num_hidden_layers: must be >= 1"),
        ("embed_injection=middle", "embed_injection: 'middle' is not one of ['first', 'all']"),
        ("learning_rate=1e-3", "unknown field(s) ['learning_rate']"),
        ("lr", "expected key=value"),
    ],
)
def test_bad_config_is_a_clear_error(override, message):
    result = wingspan("train", override)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_data_names_file_and_line(tiny_llama_dir, tmp_path):
    data = tmp_path / "broken.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{not json\n')
    result = wingspan("train", f"target={tiny_llama_dir}", f"data=[{data}]", f"output_dir={tmp_path / 'run'}")
    assert result.returncode == 2
    assert str(data) in result.stderr
    assert "Traceback" not in result.stderr


def test_draft_and_export_errors_are_one_line(tmp_path):
    """ExportError, CheckpointError and OSError reach the user as one `error:` line with exit status 2."""
    from conftest import tiny_draft_config

    from wingspan.models.draft import Eagle3Draft, write_draft

    all_layers = Eagle3Draft(
        tiny_draft_config(vocab_size=50, draft_vocab_size=50, num_hidden_layers=2, embed_injection="all")
    )
    write_draft(tmp_path / "all", all_layers.trainable_state_dict(), all_layers.config)
    weights = {k: v for k, v in all_layers.trainable_state_dict().items() if k != "fc.weight"}
    write_draft(tmp_path / "incomplete", weights, all_layers.config)
    cases = [
        (tmp_path / "all", "embed_injection='all'"),
        (tmp_path / "incomplete", "draft weights do not match the config: missing ['fc.weight']"),
        (tmp_path / "missing", "missing: no such directory"),
    ]
    for draft, message in cases:
        result = wingspan("export", str(draft), "--out", str(tmp_path / "out"))
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("error: ") and message in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_vocab_reads_the_given_targets_tokenizer(tiny_llama_dir, conversations, tmp_path):
    from wingspan.data.vocab import DraftVocab

    out = tmp_path / "vocab.safetensors"
    result = wingspan("vocab", str(conversations), "--out", str(out), "--size", "40", "--target", str(tiny_llama_dir))
    assert result.returncode == 0, result.stderr
    vocab = DraftVocab.load(out)
    assert (vocab.draft_vocab_size, vocab.target_vocab_size) == (40, 49152)
    assert "device" not in result.stderr  # no model was loaded


def test_vocab_from_a_hub_dataset_is_the_vocab_from_its_file(tiny_llama_dir, conversations, tmp_path):
    pytest.importorskip("datasets")
    from test_conversations import hub_repository

    rows = [json.loads(line) for line in conversations.read_text().splitlines()]
    repository = hub_repository(tmp_path / "repo", {"train": rows})
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf-cache")}
    for source, out in [(str(conversations), "file.safetensors"), (f"hub:{repository}", "hub.safetensors")]:
        result = wingspan(
            "vocab", source, "--out", str(tmp_path / out), "--size", "40", "--target", str(tiny_llama_dir), env=offline
        )
        assert result.returncode == 0, result.stderr
    assert load_file(tmp_path / "file.safetensors").keys() == load_file(tmp_path / "hub.safetensors").keys()
    for name, tensor in load_file(tmp_path / "file.safetensors").items():
        assert torch.equal(tensor, load_file(tmp_path / "hub.safetensors")[name]), name
    result = wingspan(
        "vocab", "hub:no-such/set", "--out", str(tmp_path / "x"), "--target", str(tiny_llama_dir), env=offline
    )
    assert result.returncode == 2 and result.stderr.startswith("error: hub:no-such/set: cannot load it")
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", [["eval", "--draft", "d", "--out", "o"], ["data", "synth", "--out", "o"]])
def test_a_bad_device_is_refused_before_anything_loads(command):
    result = wingspan(*command, "--device", "tpu")
    assert result.returncode == 2
    assert "device 'tpu'" in result.stderr


def test_a_quickstart_with_no_conversations_needs_text(tmp_path):
    """`--conversations 0` trains on --text alone; with no --text there is nothing to train on: refused before
    anything is written or loaded."""
    result = wingspan("quickstart", "--conversations", "0", "--out", str(tmp_path / "q"))
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --conversations 0: needs --text (nothing else to train on)"
    assert not (tmp_path / "q").exists()


def test_a_quickstart_budget_that_is_not_a_duration_is_refused(tmp_path):
    result = wingspan("quickstart", "--budget", "two hours", "--out", str(tmp_path / "q"))
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --budget: expected a duration such as 2h, 90m or 1h30m, got 'two hours'"
    assert not (tmp_path / "q").exists()
