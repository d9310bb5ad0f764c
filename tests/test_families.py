"""Every target family wingspan supports, on tiny random models built from the fields of real configs (sizes
shrunk, windows shortened to 8 tokens so that they bite): aux capture, packed features under sliding windows,
the draft's RoPE and norm conventions, training logits equal chain logits, speculative decoding equal to greedy,
export, and refusals."""

import dataclasses

import pytest
import torch
from conftest import hf_greedy
from test_speculative import sharpen
from test_target import check_packed_rows

from wingspan.config import TrainConfig
from wingspan.data.batching import block_causal_mask
from wingspan.data.template import TokenizedConversation
from wingspan.data.vocab import build_draft_vocab
from wingspan.decode.batched import plain_generate_batch, speculative_generate_batch
from wingspan.decode.primitives import TreeShape
from wingspan.decode.speculative import speculative_generate
from wingspan.errors import ConfigError, ExportError, ModelError
from wingspan.export import ExportSettings, export_draft, read_export
from wingspan.export.core import draft_logits
from wingspan.models.draft import new_kv_caches
from wingspan.models.families import FAMILIES, LLAMA_CONVENTIONS, family_of
from wingspan.models.target import TargetModel
from wingspan.train.trainer import build_draft
from wingspan.train.ttt import unroll

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(
    hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512
)
CONFIGS = {
    # meta-llama/Llama-3.2-1B-Instruct
    "llama3": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        num_hidden_layers=4,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),
    # Qwen/Qwen2.5-0.5B-Instruct
    "qwen2": dict(
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        num_hidden_layers=4,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        use_sliding_window=False,
        sliding_window=32768,
        max_window_layers=21,
        hidden_act="silu",
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
    ),
    # Qwen/Qwen3-0.6B
    "qwen3": dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        num_hidden_layers=4,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        attention_bias=False,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=28,
        hidden_act="silu",
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
    ),
    # Qwen/Qwen3-30B-A3B
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        num_hidden_layers=4,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        use_sliding_window=False,
        sliding_window=None,
        hidden_act="silu",
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
    ),
    # google/gemma-3-270m (text): 5 sliding layers then a full one
    "gemma3": dict(
        model_type="gemma3_text",
        architectures=["Gemma3ForCausalLM"],
        num_hidden_layers=6,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        sliding_window=8,
        query_pre_attn_scalar=16,
        hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        rope_parameters={
            "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
            "full_attention": dict(rope_type="default", rope_theta=1000000.0),
        },
    ),
    # mistralai/Mistral-7B-v0.1 (sliding window 4096)
    "mistral": dict(
        model_type="mistral",
        architectures=["MistralForCausalLM"],
        num_hidden_layers=4,
        rms_norm_eps=1e-5,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        sliding_window=8,
        hidden_act="silu",
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    ),
    # openai/gpt-oss-20b
    "gpt_oss": dict(
        model_type="gpt_oss",
        architectures=["GptOssForCausalLM"],
        num_hidden_layers=4,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        attention_bias=True,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_local_experts=4,
        num_experts_per_tok=2,
        swiglu_limit=7.0,
        hidden_act="silu",
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=150000.0,
            factor=32.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=4096,
        ),
    ),
}
SLIDING = ("gemma3", "mistral", "gpt_oss")
VOCAB = SMALL["vocab_size"]


def family_model(name: str, **changes):
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {**CONFIGS[name], **changes}
    config = AutoConfig.for_model(fields.pop("model_type"), **SMALL, **fields)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    sharpen(model)
    for module in model.modules():  # non-trivial final and layer norms, so a convention mix-up shows
        if "RMSNorm" in type(module).__name__:
            module.weight.data.uniform_(-0.5, 0.5)
    return model.eval()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family(request, smollm2_tokenizer):
    """(name, target): a tiny random target of the family, with the SmolLM2 tokenizer for its stop ids."""
    name = request.param
    return name, TargetModel(family_model(name), smollm2_tokenizer, name, aux_layer_ids=[0, 2, 3])


def random_records(lengths: list[int], seed: int = 1) -> list[TokenizedConversation]:
    generator = torch.Generator().manual_seed(seed)
    return [
        TokenizedConversation(torch.randint(3, VOCAB, (n,), generator=generator).tolist(), [1] * n) for n in lengths
    ]


def test_the_table_knows_every_family_tested_here():
    assert {CONFIGS[name]["model_type"] for name in CONFIGS} == set(FAMILIES)


def test_aux_capture_equals_output_hidden_states(family):
    name, target = family
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    out = target.forward(ids)
    reference = target.model(ids, output_hidden_states=True)
    expected = torch.cat([reference.hidden_states[i] for i in target.aux_layer_ids], dim=-1)
    torch.testing.assert_close(out.aux_hidden, expected, rtol=0, atol=0)
    torch.testing.assert_close(out.logits, reference.logits, rtol=0, atol=0)


def test_packed_rows_give_each_conversation_its_own_features(family):
    """Conversations longer than the 8-token windows, packed back to back, give what each gives alone; the
    block-causal mask without the windows would not, for the sliding families."""
    name, target = family
    micro = check_packed_rows(target, random_records([13, 5, 11, 9]), [[0, 1, 2], [3]])
    packed = target.forward(micro.input_ids, micro.target_attention_mask(), position_ids=micro.positions)
    windowless = target.model(
        micro.input_ids,
        attention_mask=target._attention_form(block_causal_mask(micro.positions)),
        position_ids=micro.positions,
    ).logits
    assert torch.allclose(windowless, packed.logits, atol=1e-4) == (name not in SLIDING)


def draft_for(target: TargetModel, layers: int = 2):
    records = random_records([40, 30])
    vocab = build_draft_vocab(records, target.vocab_size, 300, always_include=target.eos_token_ids)
    config = TrainConfig(num_hidden_layers=layers, draft_vocab_size=300)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        draft = build_draft(target, config, vocab.d2t, vocab.t2d)
    sharpen(draft)
    return draft.eval()


def test_the_draft_takes_the_targets_rope_and_final_norm(family):
    name, target = family
    draft = draft_for(target)
    rotary = target.model.model.rotary_emb
    prefix = "full_attention_" if name == "gemma3" else ""  # Gemma3 keeps one RoPE per layer type
    torch.testing.assert_close(draft.inverse_frequencies, getattr(rotary, f"{prefix}inv_freq"), rtol=1e-6, atol=0)
    assert draft.rope_scale == pytest.approx(getattr(rotary, f"{prefix}attention_scaling"))
    assert (draft.config.rope_scaling is not None) == (name in ("llama3", "gpt_oss"))
    x = torch.randn(3, SMALL["hidden_size"])
    torch.testing.assert_close(draft.norm(x), target.model.model.norm(x), rtol=1e-5, atol=1e-6)


def test_training_logits_equal_chain_logits(family):
    """The TTT unroll over the target's own features gives, at every origin and step, the logits that chain
    drafting computes with its KV caches (the RoPE of each family's draft included)."""
    name, target = family
    draft = draft_for(target, layers=2)
    ids = torch.tensor([random_records([14])[0].input_ids])
    aux = target.forward(ids).aux_hidden
    steps = 3
    with torch.no_grad():
        trained = [draft.logits(h) for h in unroll(draft, aux, ids, torch.arange(14)[None], steps)]
        for origin in (0, 5, 9):
            caches = new_kv_caches(draft)
            hidden = draft(
                draft.project_aux(aux[:, : origin + 1]), ids[:, 1 : origin + 2], torch.arange(origin + 1)[None], caches
            )
            hidden = hidden[:, -1:]
            for j in range(steps):
                if j:
                    hidden = draft(
                        hidden, ids[:, origin + j + 1 : origin + j + 2], torch.tensor([[origin + j]]), caches
                    )
                torch.testing.assert_close(draft.logits(hidden)[:, -1], trained[j][:, origin], rtol=1e-5, atol=1e-5)


def test_draft_layers_start_as_the_targets_last_layers_or_are_refused(family):
    """init_layers_from_target: a 1-layer draft over the input of the target's last layer, started as that layer
    (its embedding half at zero) with the target's final norm and lm_head rows, computes the target's own logits
    over the draft vocab. Targets whose layers are not Llama layers are refused by name."""
    name, target = family
    records = random_records([40, 30])
    vocab = build_draft_vocab(records, target.vocab_size, 300, always_include=target.eos_token_ids)
    config = TrainConfig(num_hidden_layers=1, draft_vocab_size=300, init_layers_from_target=True)
    if name not in ("llama3", "mistral"):
        with pytest.raises(ConfigError, match="are not Llama layers"):
            build_draft(target, config, vocab.d2t, vocab.t2d)
        return
    draft = build_draft(target, config, vocab.d2t, vocab.t2d).eval()
    ids = torch.tensor([random_records([8])[0].input_ids])  # within the sliding families' 8-token window
    with torch.no_grad():
        out = target.forward(ids)
        hidden = draft(draft.project_aux(out.aux_hidden), ids, torch.arange(8)[None], new_kv_caches(draft))
        expected = out.logits[..., draft.draft_to_target(torch.arange(300))]
        torch.testing.assert_close(draft.logits(hidden), expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(ConfigError, match="2 draft layers from target layer 3 .* pass the target's 4 layers"):
        build_draft(target, dataclasses.replace(config, num_hidden_layers=2), vocab.d2t, vocab.t2d)


def test_speculative_decoding_gives_the_greedy_tokens(family):
    """Chains and trees at batch 1, chains at batch 3 (left-padded, uneven lengths), all past the 8-token
    windows: the ready-made masks of trees and batches apply each layer's window as the model would."""
    name, target = family
    draft = draft_for(target)
    prompts = [[5, 17, 300, 41], list(range(100, 111)), [9, 8, 7, 6, 5, 4, 3]]
    expected = [hf_greedy(target, prompt, 14, []) for prompt in prompts]
    tree = TreeShape(depth=3, top_k=2, total_tokens=6)
    for prompt, tokens in zip(prompts, expected):
        for k in (1, 3):
            assert speculative_generate(target, draft, prompt, 14, num_draft_tokens=k, stop_ids=[]).tokens == tokens
        assert speculative_generate(target, draft, prompt, 14, stop_ids=[], tree=tree).tokens == tokens
    assert [r.tokens for r in plain_generate_batch(target, prompts, 14, stop_ids=[])] == expected
    batch = speculative_generate_batch(target, draft, prompts, 14, num_draft_tokens=3, stop_ids=[])
    assert [r.tokens for r in batch] == expected


def test_export_round_trip_or_a_clear_refusal(family, tmp_path):
    name, target = family
    draft = draft_for(target)
    if "vllm" not in FAMILIES[target.config.model_type].engines:
        with pytest.raises(ExportError, match="serves no EAGLE-3 draft"):
            export_draft(draft, tmp_path / "vllm")
        return
    out = export_draft(draft, tmp_path / "vllm", "vllm", ExportSettings(dtype="float32"))
    loaded = read_export(out, draft.embed_tokens.weight)
    assert loaded.config == draft.config
    torch.testing.assert_close(draft_logits(loaded, length=20), draft_logits(draft, length=20), rtol=0, atol=0)


def test_multimodal_wrappers_are_refused_and_unlisted_types_warned(capsys):
    from transformers import Gemma3Config, PhiConfig

    with pytest.raises(ModelError, match="multimodal wrapper"):
        family_of(Gemma3Config(), "gemma-3-4b-it")
    assert family_of(PhiConfig(), "phi-2") is LLAMA_CONVENTIONS
    assert "not a tested family" in capsys.readouterr().err


def test_a_soft_capped_target_cannot_be_dumped(smollm2_tokenizer, tmp_path):
    from wingspan.data.hidden_states import dump_identity, write_dump
    from wingspan.errors import ConfigError

    model = family_model("gemma3", final_logit_softcapping=0.5)
    target = TargetModel(model, smollm2_tokenizer, "capped", aux_layer_ids=[0, 2, 3])
    identity = dump_identity(TrainConfig(target="capped", target_dtype="float32"), target)
    with pytest.raises(ConfigError, match="soft-capping"):
        write_dump(target, random_records([12, 9]), identity, tmp_path / "dump", batch_tokens=64)
