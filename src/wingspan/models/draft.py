"""The EAGLE-3 draft: fc over the target's aux hidden states, D decoder layers, norm, lm_head over a draft vocab.

Parameter names match vLLM's `LlamaForCausalLMEagle3` checkpoint layout, so export is a plain save.
Attention is delegated to a per-layer cache object (`attend(q, k, v)`), which is how one model serves
both training (the TTT unroll, `wingspan.train.ttt`) and inference (`KVCache` below): the math of every
layer is written once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from wingspan.config import DraftConfig, load, to_dict
from wingspan.errors import CheckpointError, TrainingError
from wingspan.files import atomic_file, write_text_atomically

WEIGHTS = "model.safetensors"
CONFIG = "draft_config.json"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama (rotate-half) RoPE; cos/sin are [B, 1, T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def rope_frequencies(config: DraftConfig) -> tuple[torch.Tensor, float]:
    """RoPE's inverse frequencies [head_dim / 2] (float32) and the scale of cos and sin (YaRN's attention
    factor, else 1): plain RoPE from rope_theta, a scaled one by transformers' own functions, which vLLM's
    get_rope follows, so that the draft rotates as the target and the serving engine do."""
    if config.rope_scaling is None:
        exponents = torch.arange(0, config.head_dim, 2).float() / config.head_dim
        return 1.0 / config.rope_theta**exponents, 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    shape = LlamaConfig(
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters={"rope_theta": config.rope_theta, **config.rope_scaling},
    )
    inverse, scale = ROPE_INIT_FUNCTIONS[config.rope_scaling["rope_type"]](shape, "cpu")
    return inverse.float(), float(scale)


class Attend(Protocol):
    """Stores this layer's new keys/values and returns attention output [B, heads, T, head_dim]."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class Attention(nn.Module):
    def __init__(self, config: DraftConfig, input_size: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(input_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Attend) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        out = cache.attend(rotate(q, cos, sin), rotate(k, cos, sin), v)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm Llama layer; with `takes_embeddings` its q/k/v read cat(norm(embeds), hidden_norm(x)) (2H)."""

    def __init__(self, config: DraftConfig, takes_embeddings: bool) -> None:
        super().__init__()
        self.takes_embeddings = takes_embeddings
        hidden = config.hidden_size
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        if takes_embeddings:
            self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.self_attn = Attention(config, 2 * hidden if takes_embeddings else hidden)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Attend
    ) -> torch.Tensor:
        if self.takes_embeddings:
            h = torch.cat([self.input_layernorm(embeds), self.hidden_norm(x)], dim=-1)
        else:
            h = self.input_layernorm(x)
        x = x + self.self_attn(h, cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Draft(nn.Module):
    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        self.config = config
        num_aux = len(config.aux_layer_ids)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's embeddings, frozen
        self.fc = nn.Linear(num_aux * config.target_hidden_size, config.hidden_size, bias=False)
        self.layers = nn.ModuleList(
            DecoderLayer(config, takes_embeddings=(i == 0 or config.embed_injection == "all"))
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        # d2t: target id = draft id + d2t[draft id]; t2d: which target ids the draft vocab holds.
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        if config.draft_mode == "parallel":
            # what a mask slot reads in place of the target's aux features (through fc, as vLLM does)
            self.mask_hidden = nn.Parameter(torch.empty(num_aux * config.target_hidden_size))
        self.inverse_frequencies, self.rope_scale = rope_frequencies(config)
        self.apply(self._init_weights)
        if config.draft_mode == "parallel":
            nn.init.normal_(self.mask_hidden, std=0.02)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # The frequencies in float32 whatever the draft's dtype, as vLLM and transformers take them (a buffer
        # would follow the draft to bf16, whose rounding moves the angles by radians at long positions).
        if self.inverse_frequencies.device != positions.device:
            self.inverse_frequencies = self.inverse_frequencies.to(positions.device)
        angles = positions[..., None].float() * self.inverse_frequencies
        angles = torch.cat([angles, angles], dim=-1)[:, None]  # [B, 1, T, head_dim]
        return (angles.cos() * self.rope_scale).to(dtype), (angles.sin() * self.rope_scale).to(dtype)

    def forward(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: list[Attend],
    ) -> torch.Tensor:
        """One draft step.

        hidden: [B, T, H]: `project_aux(target aux features)` for positions the target has seen, or the
        draft's own pre-norm output of the previous step. input_ids, positions: [B, T]. caches: one per layer.
        Returns the pre-norm hidden states [B, T, H]: the next step's input, and `logits()`'s.
        """
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rope(positions, hidden.dtype)
        for layer, cache in zip(self.layers, caches, strict=True):
            hidden = layer(hidden, embeds, cos, sin, cache)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits of pre-norm hidden states; separate from forward so that callers pay the
        vocab projection only where they need it (the last position, the loss-masked rows)."""
        return self.lm_head(self.norm(hidden))

    def project_aux(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(aux_hidden)

    def mask_slots(self, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A parallel draft's mask-slot inputs for [batch, length] slots: (hidden [B, T, H], ids [B, T])."""
        hidden = self.fc(self.mask_hidden.to(self.fc.weight.dtype)).expand(batch, length, -1)
        ids = torch.full((batch, length), self.config.mask_token_id, device=hidden.device, dtype=torch.long)
        return hidden, ids

    # --- persistence ------------------------------------------------------------------------------

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything but the frozen target embeddings (which are not ours to save)."""
        return {k: v for k, v in self.state_dict().items() if k != "embed_tokens.weight"}

    def load_trainable_state(self, state: dict[str, torch.Tensor], source: str) -> None:
        """Load everything but the embeddings; any missing or unexpected key is an error naming `source`."""
        missing, unexpected = self.load_state_dict(state, strict=False)
        missing = [k for k in missing if k != "embed_tokens.weight"]
        if missing or unexpected:
            raise CheckpointError(
                f"{source}: draft weights do not match the config: missing {missing}, unexpected {unexpected}"
            )

    @classmethod
    def load(cls, directory: str | Path, embed_weight: torch.Tensor | None = None) -> Eagle3Draft:
        """Load a saved draft; the frozen embeddings come from the target (`embed_weight`)."""
        directory = Path(directory)
        if not (directory / CONFIG).is_file():
            raise CheckpointError(
                f"{directory}: not a wingspan draft (no {CONFIG}) nor a draft export of a known layout"
            )
        config = load(DraftConfig, directory / CONFIG)
        try:
            weights = load_file(str(directory / WEIGHTS))
        except (SafetensorError, OSError) as error:
            raise CheckpointError(f"{directory / WEIGHTS}: not a readable safetensors file ({error})") from None
        model = cls(config)
        model.load_trainable_state(weights, source=str(directory))
        if embed_weight is not None:
            model.embed_tokens.weight.data.copy_(embed_weight)
        return model


def write_draft(directory: str | Path, weights: dict[str, torch.Tensor], config: DraftConfig) -> None:
    """The draft directory `Eagle3Draft.load` reads, from a draft's `trainable_state_dict()` (under FSDP the
    weights gathered on rank 0, hence no module here). Non-finite weights are never written."""
    directory = Path(directory)
    broken = [name for name, tensor in weights.items() if not bool(torch.isfinite(tensor).all())]
    if broken:
        raise TrainingError(f"{directory}: not written: the draft's {', '.join(broken)} hold NaN or inf")
    with atomic_file(directory / WEIGHTS) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(tmp))
    write_text_atomically(directory / CONFIG, json.dumps(to_dict(config), indent=2) + "\n")


class KVCache:
    """Inference-time cache of one layer: keys/values of everything the draft has processed so far.

    New queries attend to all cached keys and causally among themselves, exactly as chain drafting runs.
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """mask: bool (True = may attend), [new, past + new] for tree drafting, or [B, 1, new, past + new]
        for batched rows with padding (`wingspan.decode.batched`); default causal."""
        past = self.length
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        new = q.shape[2]
        if mask is None:
            mask = torch.ones(new, past + new, dtype=torch.bool, device=q.device).tril(diagonal=past)
        return F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=mask, enable_gqa=True)

    def crop(self, length: int) -> None:
        """Forget everything after the first `length` positions (rejected draft tokens)."""
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]


class MaskedAttend:
    """`cache` under an explicit attention mask for one forward: tree drafting, where each node sees the
    verified prefix and its own ancestors only."""

    def __init__(self, cache: KVCache, mask: torch.Tensor) -> None:
        self.cache, self.mask = cache, mask

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.cache.attend(q, k, v, self.mask)


def new_kv_caches(model: Eagle3Draft) -> list[KVCache]:
    return [KVCache() for _ in model.layers]
