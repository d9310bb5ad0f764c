"""Real weights of the second and third embedded targets, end to end (slow): Qwen2.5-Coder-0.5B-Instruct (Qwen2,
ChatML) trained, exported and served by vLLM with greedy outputs unchanged; Gemma3-270M (a base model with no
chat template, sliding windows, Gemma's norm) trained with a given template and evaluated by `wingspan eval`,
its vLLM export refused with a clear error. One converted checkpoint per family, shared by the tests."""

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import NEEDS_VLLM, VLLM_PYTHON

from wingspan.config import TrainConfig
from wingspan.data.conversations import read_conversations
from wingspan.data.template import chat_prompt, tokenize_conversations
from wingspan.decode.speculative import plain_generate, speculative_generate
from wingspan.eval.referee import run_vllm_referee
from wingspan.eval.runner import load_models
from wingspan.export import ExportSettings, export_draft
from wingspan.models.draft import Eagle3Draft
from wingspan.models.registry import EMBEDDED, resolve_target
from wingspan.models.target import TargetVocabulary
from wingspan.pipeline import load_target, run_training

ROOT = Path(__file__).resolve().parents[1]
MT_BENCH = ROOT / "src" / "wingspan" / "eval" / "data" / "mt_bench.jsonl"
GEMMA_TEMPLATE = ROOT / "examples" / "chat_templates" / "gemma3.jinja"
QWEN, GEMMA = "qwen2.5-coder-0.5b-instruct", "gemma3-270m"


def installed(name: str):
    entry = EMBEDDED[name]
    return pytest.mark.skipif(entry.locate() is None, reason=f"{name} is not installed: {entry.install}")


pytestmark = pytest.mark.slow


def wingspan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wingspan", *args], capture_output=True, text=True, timeout=1800)


@pytest.fixture(scope="module")
def conversations(tmp_path_factory) -> Path:
    """Short coding conversations (the answers are what a coder model writes for them)."""
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    rows = []
    for i, (name, op) in enumerate([("add", "+"), ("subtract", "-"), ("multiply", "*"), ("divide", "/")] * 3):
        answer = (
            f"Here is a Python function that returns the result of `a {op} b`:\n\n```python\n"
            f"def {name}(a, b):\n    return a {op} b\n```\n\nFor example, `{name}({i + 2}, 2)` returns "
            f"`{eval(f'{i + 2} {op} 2')}`."
        )
        rows.append(
            {
                "id": f"c{i}",
                "conversations": [
                    {"role": "user", "content": f"Write a Python function `{name}(a, b)` ({i})."},
                    {"role": "assistant", "content": answer},
                ],
            }
        )
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def short_run(name: str, data: Path, out: Path, **fields) -> TrainConfig:
    return TrainConfig(
        target=name,
        data=[str(data)],
        output_dir=str(out),
        device="cpu",
        target_dtype="float32",
        num_hidden_layers=1,
        draft_vocab_size=4096,
        max_length=256,
        batch_tokens=512,
        ttt_steps=3,
        lr=1e-3,
        max_steps=4,
        save_every=1000,
        log_every=2,
        **fields,
    )


@pytest.fixture(scope="module")
def qwen_export(conversations, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("qwen")
    config = short_run(QWEN, conversations, out / "run")
    target = load_target(config)
    draft_dir = run_training(config, target=target)
    draft = Eagle3Draft.load(draft_dir, embed_weight=target.embed_weight())
    return export_draft(draft, out / "vllm", "vllm", ExportSettings(dtype="float32"))


def masked_texts(tokenizer, record) -> list[str]:
    runs = itertools.groupby(zip(record.input_ids, record.loss_mask), key=lambda pair: pair[1])
    return [tokenizer.decode([token for token, _ in run]) for masked, run in runs if masked]


@installed(QWEN)
@installed(GEMMA)
def test_the_loss_mask_under_the_shipped_tokenizers(conversations):
    """Each reply plus its end-of-turn token, under Qwen's own ChatML template (which adds a default system
    prompt) and under Gemma3's template given to its base model."""
    first = read_conversations(conversations)[0][0]
    reply = first.messages[1].content
    for name, template, end in ((QWEN, None, "<|im_end|>"), (GEMMA, str(GEMMA_TEMPLATE), "<end_of_turn>")):
        tokenizer = TargetVocabulary.load(name, chat_template=template).tokenizer
        (record,), _ = tokenize_conversations(tokenizer, [first], 512)
        assert masked_texts(tokenizer, record) == [reply + end], name


@installed(QWEN)
def test_qwen_draft_decodes_the_greedy_tokens(qwen_export):
    target, draft = load_models(QWEN, qwen_export, "float32", "cpu")
    assert target.family.name == "Qwen2" and draft.config.target.model_type == "qwen2"
    accepted = 0
    for question in ("Write a Python function `power(a, b)`.", "What does `len([1, 2])` return?"):
        prompt = chat_prompt(target.tokenizer, [{"role": "user", "content": question}])
        expected = plain_generate(target, prompt, 40).tokens
        result = speculative_generate(target, draft, prompt, 40, num_draft_tokens=3)
        assert result.tokens == expected
        accepted += sum(result.accepted_per_round)
    print(f"Qwen2.5-Coder-0.5B, 4-step draft: {accepted} draft tokens accepted")


def needs_vllm(test):
    for mark in NEEDS_VLLM:
        test = mark(test)
    return test


@installed(QWEN)
@needs_vllm
def test_vllm_serves_the_qwen_draft(qwen_export, tmp_path):
    result = run_vllm_referee(
        VLLM_PYTHON,
        resolve_target(QWEN),
        qwen_export,
        MT_BENCH,
        tmp_path / "referee.json",
        num_prompts=4,
        max_tokens=48,
        dtype="float32",
        timeout=1800,
    )
    assert result["outputs_differ"] == 0, f"first differing prompt: {result['first_differing_prompt']}"
    assert result["accepted_tokens"] > 0


@pytest.fixture(scope="module")
def gemma_draft(conversations, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gemma")
    return run_training(short_run(GEMMA, conversations, out / "run", chat_template=str(GEMMA_TEMPLATE)))


@installed(GEMMA)
def test_gemma_without_a_template_is_one_clear_error(conversations, tmp_path):
    result = wingspan("vocab", str(conversations), "--out", str(tmp_path / "v.safetensors"), "--target", GEMMA)
    assert result.returncode == 2
    assert "has no chat template (a base model?)" in result.stderr and "Traceback" not in result.stderr


@installed(GEMMA)
def test_gemma_trains_evaluates_and_refuses_a_vllm_export(gemma_draft, tmp_path):
    config = json.loads((gemma_draft / "draft_config.json").read_text())
    assert config["target"]["model_type"] == "gemma3_text" and config["rope_theta"] == 1_000_000.0
    out = tmp_path / "eval"
    result = wingspan(
        "eval",
        "--draft",
        str(gemma_draft),
        "--out",
        str(out),
        "--target",
        GEMMA,
        "--sets",
        "mt_bench",
        "--limit",
        "2",
        "--max-new-tokens",
        "24",
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--chat-template",
        str(GEMMA_TEMPLATE),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (mt_bench,) = json.loads((out / "results.json").read_text())["sets"]
    assert mt_bench["num_prompts"] == 2 and mt_bench["outputs_differing"] == 0 and mt_bench["rounds"] > 0
    exported = wingspan("export", str(gemma_draft), "--out", str(tmp_path / "vllm"))
    assert exported.returncode == 2 and not (tmp_path / "vllm").exists()
    assert "vLLM 0.32 serves no EAGLE-3 draft for Gemma3 targets" in exported.stderr
