"""The speculators package (0.9, in the referee venv) loads our speculators export with its own classes,
strictly, and its TTT forward gives our draft's logits at every step."""

import subprocess
from pathlib import Path

import pytest
import torch
from conftest import VLLM_PYTHON, tiny_draft_config
from safetensors.torch import load_file, save_file

from wingspan.config import TargetIdentity
from wingspan.export import ExportSettings, export_draft
from wingspan.models.draft import Eagle3Draft
from wingspan.train.ttt import unroll

SCRIPT = Path(__file__).parent / "engines" / "speculators_forward.py"


def speculators_installed() -> bool:
    if not VLLM_PYTHON.exists():
        return False
    return subprocess.run([str(VLLM_PYTHON), "-c", "import speculators"], capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(
    not speculators_installed(), reason=f"speculators is not installed in {VLLM_PYTHON} (`make vllm-venv`)"
)


@pytest.mark.parametrize(("layers", "draft_vocab_size"), [(1, 64), (3, 64), (2, None)])
def test_speculators_loads_the_export_and_computes_our_logits(tiny_llama_dir, tmp_path, layers, draft_vocab_size):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    vocab = target.config.vocab_size
    identity = TargetIdentity(str(tiny_llama_dir), model_type="llama", architectures=["LlamaForCausalLM"])
    torch.manual_seed(layers)
    draft = Eagle3Draft(
        tiny_draft_config(
            vocab_size=vocab, draft_vocab_size=draft_vocab_size or vocab, num_hidden_layers=layers, target=identity
        )
    )
    for module in draft.modules():  # non-trivial norms, so a norm loaded into the wrong slot shows
        if hasattr(module, "eps"):
            module.weight.data.uniform_(0.5, 1.5)
    draft.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight)
    if draft_vocab_size:
        ids = torch.randperm(vocab)[:draft_vocab_size].sort().values
        draft.d2t.copy_(ids - torch.arange(draft_vocab_size))
        draft.t2d[ids] = True
    else:
        draft.t2d.fill_(True)
    out = export_draft(draft, tmp_path / "export", "speculators", ExportSettings(dtype="float32"))

    steps, length = 3, 12
    aux = torch.randn(1, length, 3 * 32)
    tokens = torch.randint(0, vocab, (1, length))
    save_file(
        {
            "aux_hidden": aux[:, :-1].contiguous(),
            "input_ids": tokens[:, 1:].contiguous(),
            "embed_tokens": draft.embed_tokens.weight.data,
        },
        str(tmp_path / "inputs.safetensors"),
    )
    # speculators pairs features at i with the token after i; our unroll takes the sequence itself
    result = subprocess.run(
        [str(VLLM_PYTHON), str(SCRIPT), str(out), str(tmp_path / "inputs.safetensors"), str(tmp_path / "out"), "3"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    theirs = load_file(str(tmp_path / "out"))
    with torch.no_grad():
        ours = [draft.logits(h) for h in unroll(draft, aux, tokens, torch.arange(length)[None], steps)]
    assert len(theirs) == steps
    for j in range(steps):
        valid = length - 1 - j  # past that, both read padding tokens
        torch.testing.assert_close(theirs[f"logits_{j}"][:, :valid], ours[j][:, :valid], rtol=1e-4, atol=1e-4)
