"""Golden tests: the draft's decoder math against two outside references, in float64 on random O(1) weights.

Every other test compares wingspan with itself; these compare it with
- transformers 5.x `LlamaDecoderLayer` and `LlamaRotaryEmbedding` (transformers/models/llama/modeling_llama.py),
  for the later layers (1..D-1, which read no embeddings);
- vLLM 0.32.0's EAGLE-3 Llama draft, transcribed below in plain torch from vllm/model_executor/models/llama_eagle3.py
  (LlamaDecoderLayer.forward with _norm_after_residual, LlamaModel.forward, Eagle3LlamaForCausalLM's
  combine_hidden_states and compute_logits), models/llama.py (LlamaAttention.forward, LlamaMLP with SiluAndMul),
  layers/layernorm.py with ir/ops/layernorm.py (RMSNorm: rms_norm, fused_add_rms_norm), and
  layers/rotary_embedding/base.py, common.py (RotaryEmbedding, neox ApplyRotaryEmb); the draft loop that feeds
  states back is v1/spec_decode/llm_base_proposer.py (SpecDecodeBaseProposer.propose).
The transcription is this file's own code: vllm is neither imported nor read when the tests run.
Checked by breaking the code (each made tests here fail): swapped cat order in layer 0, hidden_norm applied to the
residual, RoPE offset dropped, rope_theta or rms_norm_eps ignored, rotate-half sign flipped, normed state fed back,
cached keys hidden from new queries.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from wingspan.config import DraftConfig
from wingspan.models.draft import Eagle3Draft, KVCache, new_kv_caches

pytestmark = pytest.mark.usefixtures("one_thread")

BATCH, LENGTH = 2, 7
POSITIONS = torch.arange(LENGTH) + torch.tensor([[3], [5]])  # not starting at 0, and different per row
F64 = torch.float64


def random_draft(num_layers: int) -> Eagle3Draft:
    # q/k/v width 4 * 16 = 64 is neither hidden (48) nor target_hidden (40): a mixed-up size cannot broadcast.
    # eps and theta are far from their defaults so that ignoring either shows.
    config = DraftConfig(
        hidden_size=48,
        intermediate_size=80,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        target_hidden_size=40,
        vocab_size=64,
        draft_vocab_size=24,
        aux_layer_ids=[1, 3, 5],
        num_hidden_layers=num_layers,
        rms_norm_eps=0.05,
        rope_theta=500.0,
        max_position_embeddings=64,
    )
    torch.manual_seed(num_layers)
    draft = Eagle3Draft(config).double()  # RoPE angles stay float32, as both references take them
    with torch.no_grad():
        for name, param in draft.named_parameters():
            # O(1) activations: the default std 0.02 makes attention near-uniform, which hides mask and position
            # bugs; norm weights are random too, so that a swapped norm shows.
            fan_in = param.shape[1] if param.dim() == 2 and "embed" not in name else 1
            param.copy_(torch.randn_like(param) / math.sqrt(fan_in))
        targets = torch.randperm(config.vocab_size)[: config.draft_vocab_size].sort().values
        draft.d2t.copy_(targets - torch.arange(config.draft_vocab_size))
    return draft


def assert_golden(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to 1e-10 of the reference's largest magnitude: in float64 only rounding is left."""
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10 * expected.abs().max().item())


def test_later_layer_matches_transformers_llama_decoder_layer():
    draft = random_draft(num_layers=2)
    config = draft.config
    ours = draft.layers[1]
    hf_config = LlamaConfig(
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        max_position_embeddings=config.max_position_embeddings,
        attn_implementation="sdpa",  # "eager" takes its softmax in float32
    )
    theirs = LlamaDecoderLayer(hf_config, layer_idx=1).double()
    theirs.load_state_dict(ours.state_dict())  # strict: the parameter names are the same
    x = torch.randn(BATCH, LENGTH, config.hidden_size, dtype=F64)
    # an explicit mask (True = may attend) also sends HF down its repeat_kv GQA path, not sdpa's enable_gqa
    causal = torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril()[None, None]
    expected = theirs(x, attention_mask=causal, position_embeddings=LlamaRotaryEmbedding(hf_config)(x, POSITIONS))
    got = ours(x, None, *draft.rope(POSITIONS, F64), KVCache())  # later layers take no embeddings
    assert_golden(got, expected)


# --- vLLM 0.32.0 EAGLE-3 Llama draft, transcribed ---------------------------------------------------------------


def vllm_norm(x, weight, eps, residual=None):
    """RMSNorm.forward_native: rms_norm(x), or given a residual the fused (rms_norm(x + residual), x + residual).

    The statistic is taken in float32 and cast back as ir.ops.rms_norm does. fused_add_rms_norm also sums in
    float32, a gain for the bf16/fp16 vLLM serves but a loss for float64, so the sum stays in the input dtype.
    """
    if residual is not None:
        x = x + residual
    normed = x.to(torch.float32)
    normed = normed * torch.rsqrt(normed.pow(2).mean(dim=-1, keepdim=True) + eps)
    normed = (normed.to(weight.dtype) * weight).to(x.dtype)
    return normed if residual is None else (normed, x)


def vllm_rope(x, positions, config):
    """RotaryEmbedding: a float32 [cos | sin] cache over all positions (_compute_cos_sin_cache), cast to the model
    dtype, gathered by position and applied neox-style (ApplyRotaryEmb.forward_static). x: [B, T, heads, dim]."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    freqs = torch.einsum("i,j -> ij", torch.arange(config.max_position_embeddings, dtype=torch.float), inv_freq)
    cos, sin = (table.to(x.dtype)[positions].unsqueeze(-2) for table in (freqs.cos(), freqs.sin()))
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def vllm_attention(w, prefix, x, positions, config):
    """LlamaAttention.forward: qkv_proj, split, rope, causal attention scaled by head_dim**-0.5, o_proj."""
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    q, k, v = (x @ w[prefix + "qkv_proj.weight"].T).split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q = vllm_rope(q.unflatten(-1, (heads, dim)), positions, config)
    k = vllm_rope(k.unflatten(-1, (kv_heads, dim)), positions, config)
    # GQA: query head h reads kv head h // (heads / kv_heads)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=-2) for t in (k, v.unflatten(-1, (kv_heads, dim))))
    length = x.shape[1]
    mask = torch.zeros(length, length, dtype=x.dtype).masked_fill(~torch.ones(length, length).bool().tril(), -math.inf)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * dim**-0.5 + mask
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(dim=-1), v)
    return out.flatten(-2) @ w[prefix + "o_proj.weight"].T


def vllm_layer(w, i, positions, embeds, hidden, residual, config):
    """llama_eagle3.LlamaDecoderLayer.forward, norm_before_residual false. Returns (mlp output, residual): the
    MLP output is added by the next layer's input_layernorm (or the final norm), as vLLM carries it."""
    p, eps = f"layers.{i}.", config.rms_norm_eps
    if i == 0:
        embeds = vllm_norm(embeds, w[p + "input_layernorm.weight"], eps)
        residual = hidden  # _norm_after_residual: the residual is the hidden state before hidden_norm
        hidden = torch.cat([embeds, vllm_norm(hidden, w[p + "hidden_norm.weight"], eps)], dim=-1)
    else:
        hidden, residual = vllm_norm(hidden, w[p + "input_layernorm.weight"], eps, residual)
    hidden = vllm_attention(w, p + "self_attn.", hidden, positions, config)
    hidden, residual = vllm_norm(hidden, w[p + "post_attention_layernorm.weight"], eps, residual)
    gate, up = (hidden @ w[p + "mlp.gate_up_proj.weight"].T).chunk(2, dim=-1)  # SiluAndMul
    return (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T, residual


def vllm_model(w, input_ids, positions, hidden, config):
    """LlamaModel.forward: returns (normed, pre-norm) = norm(hidden, residual) (norm_output false)."""
    embeds, residual = w["embed_tokens.weight"][input_ids], None
    for i in range(config.num_hidden_layers):
        hidden, residual = vllm_layer(w, i, positions, embeds, hidden, residual, config)
    return vllm_norm(hidden, w["norm.weight"], config.rms_norm_eps, residual)


def vllm_weights(draft):
    """Our state dict as vLLM loads it: q/k/v stacked into qkv_proj, gate/up into gate_up_proj (hf_to_vllm_mapper)."""
    w = dict(draft.state_dict())
    for i in range(draft.config.num_hidden_layers):
        p = f"layers.{i}."
        w[p + "self_attn.qkv_proj.weight"] = torch.cat([w.pop(f"{p}self_attn.{n}_proj.weight") for n in "qkv"])
        w[p + "mlp.gate_up_proj.weight"] = torch.cat([w.pop(f"{p}mlp.{n}_proj.weight") for n in ("gate", "up")])
    return w


def vllm_target_logits(w, normed, config):
    """compute_logits: lm_head over the draft vocab, scattered to target ids base + draft_id_to_target_id."""
    logits = normed @ w["lm_head.weight"].T
    full = logits.new_full((*logits.shape[:-1], config.vocab_size), -math.inf)
    full[..., torch.arange(config.draft_vocab_size) + w["d2t"]] = logits
    return logits, full


def test_layer0_matches_vllm():
    draft = random_draft(num_layers=1)
    embeds, hidden = torch.randn(2, BATCH, LENGTH, draft.config.hidden_size, dtype=F64)
    got = draft.layers[0](hidden, embeds, *draft.rope(POSITIONS, F64), KVCache())
    mlp_out, residual = vllm_layer(vllm_weights(draft), 0, POSITIONS, embeds, hidden, None, draft.config)
    assert_golden(got, mlp_out + residual)


@pytest.mark.parametrize("num_layers", [1, 2, 3])
def test_draft_and_its_next_step_match_vllm(num_layers):
    draft = random_draft(num_layers)
    config, w = draft.config, vllm_weights(draft)
    aux = torch.randn(BATCH, LENGTH, len(config.aux_layer_ids) * config.target_hidden_size, dtype=F64)
    input_ids = torch.randint(config.vocab_size, (BATCH, LENGTH))
    fc_out = aux @ w["fc.weight"].T  # combine_hidden_states (no norm_before_fc, no fc_norm)
    assert_golden(draft.project_aux(aux), fc_out)

    caches = new_kv_caches(draft)
    out = draft(draft.project_aux(aux), input_ids, POSITIONS, caches)
    normed, prenorm = vllm_model(w, input_ids, POSITIONS, fc_out, config)
    logits, target_logits = vllm_target_logits(w, normed, config)
    assert_golden(draft.logits(out), logits)
    # propose() samples from the normed state and feeds the pre-norm one back: `last_hidden_states,
    # hidden_states = self.model(...)`, then `self.hidden_states[:batch_size] = hidden_states`.
    assert_golden(out, prenorm)
    next_ids = draft.draft_to_target(draft.logits(out[:, -1]).argmax(-1))[:, None]
    assert torch.equal(next_ids[:, 0], target_logits[:, -1].argmax(-1))  # vLLM's greedy token, a target id

    # The second step: one token at the next position, attending to the first step's cached keys. vLLM's KV
    # cache then holds the whole sequence, so its causal run over the concatenation gives the new row. RoPE is
    # relative, so a lost position offset shows clearly only here, where a query meets keys of another step.
    out2 = draft(out[:, -1:], next_ids, POSITIONS[:, -1:] + 1, caches)
    normed2, prenorm2 = vllm_model(
        w,
        torch.cat([input_ids, next_ids], dim=1),
        torch.cat([POSITIONS, POSITIONS[:, -1:] + 1], dim=1),
        torch.cat([fc_out, prenorm[:, -1:]], dim=1),
        config,
    )
    assert_golden(out2, prenorm2[:, -1:])
    assert_golden(draft.logits(out2), vllm_target_logits(w, normed2[:, -1:], config)[0])


def test_rope_stays_float32_in_a_16_bit_draft():
    """A draft cast to bf16 (as evaluation runs it beside a bf16 target) takes the RoPE angles the float32
    draft takes: bf16 frequencies would move the angle at position 1000 by radians."""
    draft = random_draft(num_layers=1)
    positions = torch.tensor([[0, 1, 300, 1000]])
    cos, sin = draft.float().rope(positions, torch.float32)
    cos16, sin16 = draft.to(torch.bfloat16).rope(positions, torch.float32)
    assert torch.equal(cos, cos16) and torch.equal(sin, sin16)
