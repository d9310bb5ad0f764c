"""docs/how-to-8b.md is true: every `wingspan` and `torchrun` command in it runs, as written, in the order written,
on a tiny random Llama in place of the 8B target (slow). The substitutions are the ones the page names."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import write_counting_conversations

ROOT = Path(__file__).resolve().parents[1]
HOWTO = ROOT / "docs" / "how-to-8b.md"
TARGET = "meta-llama/Llama-3.1-8B-Instruct"

pytestmark = pytest.mark.slow


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def commands(script: str) -> list[str]:
    """The script's commands: continuation lines joined, comments and trailing `&` dropped."""
    joined = re.sub(r"\\\n\s*", " ", script)
    lines = [line.split(" #")[0].strip().removesuffix("&").strip() for line in joined.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def substituted(command: str, target: str) -> list[str]:
    command = command.replace(TARGET, target).replace("/scratch/dumps/", "dumps/")
    command = command.replace("--nproc-per-node 8", "--nproc-per-node 2")
    args = shlex.split(command)
    if args[:2] == ["wingspan", "eval"]:
        args += ["--limit", "2", "--max-new-tokens", "16"]
    if args[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *args[1:]]
    return [sys.executable, "-m", *args]


def test_every_command_of_the_8b_how_to_runs(tiny_llama_dir, tmp_path):
    text = HOWTO.read_text()
    (config,) = [block for block in blocks(text, "yaml") if block.startswith("# llama8b.yaml")]
    (tmp_path / "llama8b.yaml").write_text(config.replace(TARGET, str(tiny_llama_dir)))
    write_counting_conversations(tmp_path / "regen.jsonl")

    ran = []
    for script in blocks(text, "bash"):
        for command in commands(script):
            if command.startswith("vllm serve") or "--server" in command:
                continue  # a real serving engine: tests/test_server.py runs the --server path
            assert command.startswith(("wingspan ", "torchrun ")), command
            result = subprocess.run(
                substituted(command, str(tiny_llama_dir)), cwd=tmp_path, capture_output=True, text=True, timeout=1200
            )
            assert result.returncode == 0, f"{command}\n{result.stderr[-3000:]}"
            ran.append(command.split()[0:4])
    assert len(ran) == 7, ran  # vocab, train, resume, dump, train from the dump, eval, export
    for run in ("llama8b-d3", "llama8b-d3-offline"):
        assert (tmp_path / "runs" / run / "draft" / "model.safetensors").is_file()
    assert (
        json.loads((tmp_path / "runs" / "llama8b-d3" / "vllm-draft" / "config.json").read_text())["num_hidden_layers"]
        == 3
    )
    assert (tmp_path / "runs" / "llama8b-d3" / "eval" / "results.json").is_file()
